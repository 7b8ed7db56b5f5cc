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


#: How far down the README a newcomer reads before scrolling far: its first screen, give or take.
FIRST_SCREEN_LINES = 120


def test_the_readme_first_screen_answers_the_three_questions() -> None:
    # One sentence of what oomkit is, then each question with its one command
    # and real output (the doc-example test runs them), then the two set-up commands.
    lines = (ROOT / "README.md").read_text().splitlines()
    headings = [(i, line[3:]) for i, line in enumerate(lines) if line.startswith("## ")]
    asked = [title for _, title in headings[:4]]
    assert asked == ["Will it fit?", "Why did it run out?", "How do I keep it running?", "Set up"], asked
    first = lines[2 : lines.index("", 2)]
    sentence = " ".join(first)
    assert sentence.startswith("oomkit ") and sentence.endswith(".") and sentence.count(". ") == 0, sentence
    for (start, title), (end, _), command in zip(headings, headings[1:], ("oomkit preflight", "oomkit analyze", "oomkit run")):
        section = lines[start:end]
        assert "```console" in section, title
        assert any(line.startswith("$ ") and f"{command} " in line for line in section), (title, command)
    set_up = "\n".join(lines[headings[3][0] : headings[4][0]])
    assert "cargo run --release -p oomkit-cli -- demo" in set_up and "scripts/test.sh" in set_up
    assert headings[3][0] < FIRST_SCREEN_LINES, f"the set-up commands start at line {headings[3][0] + 1}"
    assert "![" in "\n".join(lines[: headings[3][0]]), "a picture of the HTML report where a user would rather look than read"
