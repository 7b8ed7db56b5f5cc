"""The documentation holds together: every relative link resolves, and every command's reference is one click from the README."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "VALIDATION.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    title = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return title.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_reaches_a_file_and_a_heading() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_command_is_one_click_from_the_readme() -> None:
    commands = re.findall(r"^### `oomkit ([a-z-]+)[^\n]*$", (ROOT / "docs" / "commands.md").read_text(), flags=re.M)
    headings = {
        name: _slug(line[4:])
        for line in (ROOT / "docs" / "commands.md").read_text().splitlines()
        if line.startswith("### `oomkit ")
        for name in [line.split()[2].rstrip("`")]
    }
    readme = (ROOT / "README.md").read_text()
    assert len(commands) >= 10, commands
    missing = [c for c in commands if f"docs/commands.md#{headings[c]}" not in readme]
    assert not missing, f"the README links no reference for: {missing}"
