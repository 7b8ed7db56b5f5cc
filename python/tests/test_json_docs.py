"""Every field of every command's JSON is documented: a key missing from docs/ fails the test.

Each command that prints JSON runs on the bundled inputs (the demo, a real
snapshot, the example run logs, message, calibration runs and fake GPUs);
every key of what it prints, at any depth, must appear in the docs as code
(`key`, or inside a code span such as `{filename, line, name}`). Objects
whose keys are data rather than fields are named in DATA_KEYED.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
REAL = ROOT / "crates" / "oomkit-cli" / "tests" / "real"
RANKS = sorted(str(p) for p in (EX / "ranks").glob("*.jsonl"))
# Objects keyed by data: PyTorch's allocator settings as the snapshot
# recorded them, and trace entries counted by PyTorch's action names.
DATA_KEYED = {"allocator_settings", "actions"}

COMMANDS = {
    "demo": ["demo", "--json"],
    "analyze (run logs of a job)": ["analyze", "--json", *RANKS],
    "analyze (a real snapshot)": ["analyze", "--json", str(REAL / "cs336_lm_train_magma27.pickle")],
    "diff (run logs)": ["diff", "--json", RANKS[1], RANKS[-1]],
    "diff (snapshots)": ["diff", "--json", str(REAL / "cs336_lm_train_magma27.pickle"), str(REAL / "cs336_lm_train_bcrafton.pickle")],
    "explain": ["explain", "--json", str(EX / "messages" / "wekws-152.log")],
    "explain (a snapshot)": ["explain", "--json", str(ROOT / "crates" / "oomkit-cli" / "assets" / "demo_snapshot.pickle")],
    "estimate": ["estimate", "--json", "--params", "3B", "--gpu", "80GiB", "--calibrate", str(EX / "calibrate" / "b4.jsonl"), str(EX / "calibrate" / "b8.jsonl")],
    "estimate (traced)": [
        *("estimate", "--json", "--config", str(EX / "preflight" / "gpt2_tiny.json"), "--batch", "2", "--seq", "64"),
        "--trace",
    ],
    "estimate (not traced)": [
        *("estimate", "--json", "--config", str(EX / "preflight" / "gpt2_tiny.json"), "--optimizer", "adamw8bit"),
        "--trace",
    ],
    "gpus": ["gpus", "--json"],
    "whatif": ["whatif", "--json", str(REAL / "tinyllama_int8_lora_notebook_ftcourse.pickle"), "--capacity", "T4", "--batch-scale", "0.5"],
    "run": ["run", "--json", "--batch-size", "256", "--", "sh", str(EX / "find_batch_standin.sh"), "{batch_size}"],
    "preflight": [
        *("preflight", "--json", "--capacity", "1GiB", "--micro-batch", "2", "--max-micro-batch", "4", "--"),
        *(sys.executable, str(EX / "preflight" / "train.py"), "--batch-size", "{batch}"),
        *("--ctx", "128", "--dim", "64", "--heads", "4", "--layers", "1", "--steps", "3"),
    ],
    # The first run raises CUDA's error where the GPU runs out, and the script halves its batch.
    "preflight (the GPU runs out)": ["preflight", "--json", "--capacity", "2GiB", "--", sys.executable, str(EX / "preflight" / "halving.py")],
    "find-batch": ["find-batch", "--json", "--effective", "256", "--", "sh", str(EX / "find_batch_standin.sh"), "{batch_size}"],
}


def documented_words() -> set[str]:
    """Every identifier inside a code span of the README and docs/, fenced blocks left out."""
    words: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", text):
            words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return words


def keys(value: object, path: str, out: dict[str, str]) -> None:
    """Each key in `value`, at any depth, with the path where it was first seen."""
    if isinstance(value, dict):
        for k, v in value.items():
            out.setdefault(k, path)
            if k not in DATA_KEYED:
                keys(v, f"{path}.{k}", out)
    elif isinstance(value, list):
        for v in value:
            keys(v, f"{path}[]", out)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_json_field_is_documented(name: str, tmp_path: Path) -> None:
    if shutil.which("oomkit") is None:
        pytest.skip("the oomkit console script is not installed (scripts/test.sh installs it)")
    env = dict(os.environ, OOMKIT_FAKE_GPUS=str(EX / "gpus" / "two_h100.json"), OOMKIT_CACHE_DIR=str(tmp_path))
    p = subprocess.run(["oomkit", *COMMANDS[name]], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    seen: dict[str, str] = {}
    keys(json.loads(p.stdout), name, seen)
    assert len(seen) > 3, seen
    words = documented_words()
    missing = {k: where for k, where in seen.items() if k not in words}
    assert not missing, f"`oomkit {name}` prints fields docs/ does not name: {missing}"
