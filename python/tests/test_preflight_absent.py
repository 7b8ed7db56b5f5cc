"""A checkpoint the script loads itself that is not there (not written yet, not downloaded) answers
under preflight as the same script with the file present: the model it is loaded into keeps the
tensors it was built with, a copy loaded onto the GPU is held while the script holds it, and a note
names the folder; a URL torch's hub would download, or a weight file of a hub repository, is not fetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from preflight_cli import OOMKIT, allocator_bytes, preflight_run

#: The same model in the script and in the checkpoint the test writes for it.
MODEL = "torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))"

#: How the script loads its checkpoint, by the way it is written.
LOADS = {
    # A resumed run: the model's and the optimizer's state onto the GPU, the epoch read with a default, the file let go.
    "torch.load": """
        ckpt = torch.load(path, map_location="cuda")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start = ckpt.get("epoch", 0)
        del ckpt
    """,
    # Weights onto the GPU, kept alive by the script for the whole run.
    "load_file": """
        from safetensors.torch import load_file
        weights = load_file(path, device="cuda")
        model.load_state_dict(weights)
    """,
    # Tensor by tensor, keys renamed as a script does for a checkpoint saved from a wrapped model.
    "safe_open": """
        from safetensors import safe_open
        with safe_open(path, framework="pt", device="cpu") as f:
            weights = {k.removeprefix("module."): f.get_tensor(k) for k in f.keys()}
        model.load_state_dict(weights)
    """,
}


def _script(load: str) -> str:
    return (
        "import sys, torch\n"
        f"model = {MODEL}.cuda()\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "path = sys.argv[1]\n"
        + textwrap.dedent(load)
        + "for _ in range(2):\n"
        "    model(torch.randn(64, 512, device='cuda')).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
    )


def _write_checkpoint(how: str, path: Path) -> None:
    """The checkpoint the script expects, written as a run would have: one step on the CPU first."""
    model = eval(MODEL)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    if how == "torch.load":
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    else:
        from safetensors.torch import save_file

        prefix = "module." if how == "safe_open" else ""
        save_file({prefix + k: v for k, v in model.state_dict().items()}, path)


def _absent_notes(run: dict[str, Any]) -> list[str]:
    return [n for n in run["notes"] if "are not there" in n or "was not downloaded" in n]


@pytest.mark.parametrize("how", sorted(LOADS))
def test_a_checkpoint_that_is_not_there_answers_as_the_file_would(tmp_path: Path, how: str) -> None:
    pytest.importorskip("safetensors", reason="safetensors is not installed for this Python")
    script = tmp_path / "train.py"
    script.write_text(_script(LOADS[how]))
    present, absent = tmp_path / "written" / "ckpt.bin", tmp_path / "to_come" / "ckpt.bin"
    present.parent.mkdir()
    _write_checkpoint(how, present)
    with_file = preflight_run(script, args=(str(present),))
    without = preflight_run(script, args=(str(absent),))
    assert not absent.parent.exists(), "preflight wrote where the checkpoint is to come"
    if how == "torch.load":
        # The file's step counters were loaded onto the GPU (a block each); AdamW keeps its own on the CPU.
        counters = 512 * len(list(eval(MODEL).parameters()))
        with_file["peak_allocated_bytes"] -= counters
        with_file["by_role"]["optimizer_state"] -= counters
    for key in ("peak_allocated_bytes", "by_role", "steps"):
        assert without[key] == with_file[key], (key, without[key], with_file[key])
    assert _absent_notes(with_file) == []
    (note,) = _absent_notes(without)
    assert note.startswith(f"checkpoint files the script loads from {absent.parent} are not there (the first: ckpt.bin)"), note
    # Loaded onto the GPU, the file's other contents are not known: the answer says they are not counted.
    gpu_bound = [n for n in without["notes"] if n.startswith("a checkpoint that is not there was loaded onto the GPU")]
    assert len(gpu_bound) == (0 if how == "safe_open" else 1), without["notes"]
    if how == "load_file":
        # The weights loaded onto the GPU are held beside the model's own: two copies of each.
        model = eval(MODEL)
        weights = sum(p.nbytes for p in model.parameters())
        assert without["by_role"]["parameters"] == weights, without["by_role"]
        assert without["peak_allocated_bytes"] >= 2 * weights + 2 * weights + weights, without


HUB = """
import sys, torch
model = {model}
state = torch.hub.load_state_dict_from_url("https://download.example.org/models/mlp-0123abcd.pth", model_dir=sys.argv[1], map_location="cpu")
model.load_state_dict(state)
model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_checkpoint_url_is_not_downloaded_and_a_cached_one_is_read(tmp_path: Path) -> None:
    script = tmp_path / "pretrained.py"
    script.write_text(HUB.format(model=MODEL))
    empty, cached = tmp_path / "empty_cache", tmp_path / "cache"
    cached.mkdir()
    torch.save(eval(MODEL).state_dict(), cached / "mlp-0123abcd.pth")
    without = preflight_run(script, args=(str(empty),))
    with_file = preflight_run(script, args=(str(cached),))
    for key in ("peak_allocated_bytes", "by_role", "steps"):
        assert without[key] == with_file[key], (key, without[key], with_file[key])
    # Nothing downloaded, nor a folder made for it in the cache.
    assert not empty.exists(), list(empty.iterdir())
    (note,) = _absent_notes(without)
    assert note.startswith("https://download.example.org/models/mlp-0123abcd.pth was not downloaded"), note
    assert _absent_notes(with_file) == []


def test_a_missing_checkpoint_the_script_checks_for_is_still_missing(tmp_path: Path) -> None:
    # A script that resumes only where its checkpoint exists goes its own way: nothing stands in for os.path.exists.
    script = tmp_path / "resume.py"
    script.write_text(
        "import os, sys, torch\n"
        f"model = {MODEL}.cuda()\n"
        "if os.path.exists(sys.argv[1]):\n"
        "    raise SystemExit('resumed from a file that is not there')\n"
        "model(torch.randn(8, 512, device='cuda')).sum().backward()\n"
    )
    run = preflight_run(script, args=(str(tmp_path / "last.pt"),))
    assert _absent_notes(run) == []


#: The end of the hub scripts: the loaded model trained on the GPU for two steps.
TRAINS_ON_THE_GPU = """
model.cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(64, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""

FROM_HUB = """
import sys, torch
from huggingface_hub import hf_hub_download
from safetensors.torch import load_file
model = {model}
# As timm's pretrained=True and many scripts fetch weights: one file of a hub repository, then loaded.
path = hf_hub_download("someorg/tiny-mlp", "model.safetensors")
model.load_state_dict(load_file(path))
""" + TRAINS_ON_THE_GPU


def test_a_weight_file_asked_of_the_hub_is_not_downloaded_and_a_cached_one_is_read(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed for this Python")
    from safetensors.torch import save_file

    script = tmp_path / "from_hub.py"
    script.write_text(FROM_HUB.format(model=MODEL))
    # The hub cache's layout: the repository's ref and one snapshot holding the weights.
    revision = "0" * 40
    repo = tmp_path / "cached" / "models--someorg--tiny-mlp"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    save_file(eval(MODEL).state_dict(), repo / "snapshots" / revision / "model.safetensors")
    runs = {}
    for cache in ("empty", "cached"):
        (tmp_path / cache).mkdir(exist_ok=True)
        p = subprocess.run(
            [OOMKIT, "preflight", "--json", "--", sys.executable, str(script)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env=dict(os.environ, HF_HUB_CACHE=str(tmp_path / cache), HF_HUB_OFFLINE="1"),
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        runs[cache] = json.loads(p.stdout)["run"]
    for key in ("peak_allocated_bytes", "by_role", "steps"):
        assert runs["empty"][key] == runs["cached"][key], (key, runs["empty"][key], runs["cached"][key])
    assert list((tmp_path / "empty").rglob("*.safetensors")) == [], "a weight file was downloaded"
    (note,) = _absent_notes(runs["empty"])
    assert note.startswith("someorg/tiny-mlp/model.safetensors was not downloaded"), note
    assert _absent_notes(runs["cached"]) == []


FROM_SNAPSHOT = """
import sys, torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file
# As a fine-tuning script fetches a whole repository, then loads the weights from the folder.
folder = snapshot_download("someorg/tiny-mlp", cache_dir=sys.argv[1])
model = {model}
model.load_state_dict(load_file(folder + "/model.safetensors"))
""" + TRAINS_ON_THE_GPU


def test_a_whole_repository_fetched_from_the_hub_comes_without_its_weight_files(tmp_path: Path) -> None:
    # snapshot_download, served by a hub on localhost: its other files come, its weight files never do.
    pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed for this Python")
    from fake_hub import FakeHub
    from safetensors.torch import save_file

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"layers": [512, 2048, 512]}))
    save_file(eval(MODEL).state_dict(), repo / "model.safetensors")
    script = tmp_path / "from_snapshot.py"
    script.write_text(FROM_SNAPSHOT.format(model=MODEL))
    hub = FakeHub(repo, "someorg/tiny-mlp")
    try:
        p = subprocess.run(
            [OOMKIT, "preflight", "--json", "--", sys.executable, str(script), str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            env=dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0"),
        )  # fmt: skip
    finally:
        hub.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert hub.asked_for("config.json"), hub.log
    assert hub.asked_for("model.safetensors") == [], hub.log
    assert list((tmp_path / "cache").rglob("*.safetensors")) == [], "a weight file was downloaded"
    run = json.loads(p.stdout)["run"]
    notes = _absent_notes(run)
    assert any(n.startswith("someorg/tiny-mlp/model.safetensors was not downloaded") for n in notes), notes
    # The model's weights, as if read: the sizes its own tensors stand for.
    assert run["by_role"]["parameters"] == allocator_bytes(eval(MODEL).parameters()), run["by_role"]
