"""Image models' pretrained weights under preflight: torchvision's ``weights=`` and timm's ``pretrained=True``.

An image fine-tune starts from pretrained weights: torchvision fetches them
by URL into torch's hub cache (``load_state_dict_from_url``), timm from the
Hugging Face hub (``hf_hub_download`` of ``model.safetensors``). Under
preflight neither is downloaded where it is not cached: the model keeps the
tensors it was built with, whose sizes are the weights', and the answer is
the same as the script's run from scratch and as its run with the weights
in the cache. Every network request fails here (a proxy that refuses), so
a download tried would stop the script. torchvision, timm and Pillow are
installed by scripts/test.sh into their own folder, `.venv/vision-site`,
for the reason the other frameworks' folders are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from preflight_cli import OOMKIT, VISION_SITE, allocator_bytes, pythonpath_with

pytestmark = pytest.mark.skipif(
    not (VISION_SITE / "torchvision").is_dir() or not (VISION_SITE / "timm").is_dir(),
    reason=f"torchvision and timm are not installed in {VISION_SITE} (scripts/test.sh installs them)",
)

#: A fine-tune in the pattern of the image trainers: pretrained weights (torchvision's or timm's,
#: or none), a new 10-class head, mixed precision with a gradient scaler. Given a file, it writes
#: the sizes of its parameters and of its buffers (batch norm's statistics), built on the host, instead.
FINE_TUNE = r"""
import json, sys, torch
from torch import nn

library, start = sys.argv[1], sys.argv[2]
if library == "torchvision":
    from torchvision.models import ResNet18_Weights, resnet18
    model = resnet18(weights=ResNet18_Weights.DEFAULT if start == "pretrained" else None)
    model.fc = nn.Linear(model.fc.in_features, 10)
else:
    import timm
    model = timm.create_model("resnet18", pretrained=start == "pretrained", num_classes=10)
if len(sys.argv) > 3:
    json.dump([[t.nbytes for t in ts] for ts in (model.parameters(), model.buffers())], open(sys.argv[3], "w"))
    sys.exit(0)
model = model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cuda")
for step in range(3):
    x, y = torch.randn(8, 3, 64, 64, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
"""


def _env(home: Path) -> dict[str, str]:
    path = pythonpath_with(VISION_SITE)
    # Empty caches of torch's hub and of the Hugging Face hub; no request leaves the machine.
    refused = "http://127.0.0.1:9"
    return {
        **os.environ, "PYTHONPATH": path, "TORCH_HOME": str(home / "torch"), "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1", "http_proxy": refused, "https_proxy": refused, "HTTP_PROXY": refused, "HTTPS_PROXY": refused,
    }  # fmt: skip


def _preflight(tmp_path: Path, library: str, start: str) -> tuple[dict[str, Any], str]:
    script = tmp_path / "fine_tune.py"
    script.write_text(FINE_TUNE)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "24GiB", "--", sys.executable, str(script), library, start],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(tmp_path),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    run: dict[str, Any] = json.loads(p.stdout)["run"]
    return run, p.stderr


def _model_bytes(tmp_path: Path, library: str) -> tuple[int, int, int]:
    """The fine-tuned model's parameters and its buffers as the allocator holds them, counted from
    the model built on the host, and how many parameters are large (over 1 MiB)."""
    sizes = tmp_path / f"{library}-sizes.json"
    subprocess.run([sys.executable, "-c", FINE_TUNE, library, "scratch", str(sizes)], check=True, timeout=300, env=_env(tmp_path))
    params, buffers = json.loads(sizes.read_text())
    large = sum(n > 1 << 20 for n in params)
    return allocator_bytes(SimpleNamespace(nbytes=n) for n in params), allocator_bytes(SimpleNamespace(nbytes=n) for n in buffers), large


def _momentum_fits(state: int, params: int, large: int) -> bool:
    """SGD's momentum: a copy of each parameter, made at the first step by the optimizer, each in the
    block the allocator gives it, which for a large one keeps a remainder of at most 1 MiB unsplit
    (as CUDA's allocator counts it among the allocated bytes)."""
    return params <= state <= params + large * (1 << 20)


def _same_step(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "by_role", "steps"):
        assert a[key] == b[key], (key, a[key], b[key])


def test_torchvision_weights_not_in_the_cache_are_not_downloaded_and_change_no_figure(tmp_path: Path) -> None:
    scratch, _ = _preflight(tmp_path, "torchvision", "scratch")
    pretrained, stderr = _preflight(tmp_path, "torchvision", "pretrained")
    url = "https://download.pytorch.org/models/resnet18-f37072fd.pth"
    assert any(n.startswith(f"{url} was not downloaded; what is loaded from it keeps the tensors") for n in pretrained["notes"]), (
        pretrained["notes"]
    )
    # torch.hub would say it is downloading, and make its cache's folder: neither happens.
    assert "Downloading" not in stderr and not (tmp_path / "torch").exists(), stderr[-2000:]
    _same_step(pretrained, scratch)
    params, buffers, large = _model_bytes(tmp_path, "torchvision")
    # The weights with batch norm's statistics, each in blocks of its own as the model was made.
    assert pretrained["by_role"]["parameters"] == params + buffers
    assert _momentum_fits(pretrained["by_role"]["optimizer_state"], params, large), (pretrained["by_role"], params)

    # The weights in torch's hub cache: read as the file they are, with the same figures.
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    save = "import sys, torch\nfrom torchvision.models import resnet18\ntorch.save(resnet18().state_dict(), sys.argv[1])\n"
    subprocess.run([sys.executable, "-c", save, str(cached)], check=True, timeout=300, env=_env(tmp_path))
    read, _ = _preflight(tmp_path, "torchvision", "pretrained")
    assert not any("was not downloaded" in n for n in read["notes"]), read["notes"]
    _same_step(read, scratch)


def test_timm_pretrained_weights_are_not_downloaded_from_the_hub_and_change_no_figure(tmp_path: Path) -> None:
    scratch, _ = _preflight(tmp_path, "timm", "scratch")
    pretrained, _ = _preflight(tmp_path, "timm", "pretrained")
    # timm's default tag of resnet18, fetched from the hub as model.safetensors (its head replaced by 10 classes).
    assert any(n.startswith("timm/resnet18.a1_in1k/model.safetensors was not downloaded") for n in pretrained["notes"]), pretrained["notes"]
    _same_step(pretrained, scratch)
    params, buffers, large = _model_bytes(tmp_path, "timm")
    assert pretrained["by_role"]["parameters"] == params + buffers
    assert _momentum_fits(pretrained["by_role"]["optimizer_state"], params, large), (pretrained["by_role"], params)


#: An object detector's training step, as torchvision's detection reference trains one: the
#: proposals it keeps, the boxes non-maximum suppression keeps and the samples its heads score
#: are chosen by the data. Given a file, it writes its parameters' and buffers' sizes instead.
DETECTOR = r"""
import json, sys, torch
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=5)
if len(sys.argv) > 1:
    json.dump([[t.nbytes for t in ts] for ts in (model.parameters(), model.buffers())], open(sys.argv[1], "w"))
    sys.exit(0)
model = model.cuda().train()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(3):
    images = [torch.rand(3, 480, 640, device="cuda") for _ in range(2)]
    boxes = torch.tensor([[10.0, 20.0, 200.0, 220.0], [50.0, 60.0, 300.0, 400.0]], device="cuda")
    targets = [{"boxes": boxes, "labels": torch.tensor([1, 3], device="cuda")} for _ in range(2)]
    loss = sum(model(images, targets).values())
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_an_object_detectors_step_runs_with_its_selections_at_their_largest(tmp_path: Path) -> None:
    script = tmp_path / "detect.py"
    script.write_text(DETECTOR)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--no-fixes", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(tmp_path),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(p.stdout)["run"]
    assert run["steps"] == 2, run
    said = [n for n in run["notes"] if "sized at their largest" in n]
    assert said and said[0].split("(first ")[1].startswith("nonzero at ") and "torchvision/ops/boxes.py:" in said[0], run["notes"]
    sizes = tmp_path / "sizes.json"
    subprocess.run([sys.executable, str(script), str(sizes)], check=True, timeout=300, env=_env(tmp_path))
    params, buffers = json.loads(sizes.read_text())
    weights = allocator_bytes(SimpleNamespace(nbytes=n) for n in params)
    # The weights and batch norm's statistics, and a gradient for every weight (none frozen, as none
    # is pretrained); a large one's block may keep a remainder under 1 MiB unsplit, _momentum_fits says.
    held = weights + allocator_bytes(SimpleNamespace(nbytes=n) for n in buffers)
    large = sum(n > 1 << 20 for n in params)
    assert _momentum_fits(run["by_role"]["parameters"], held, large), (held, run["by_role"])
    assert _momentum_fits(run["by_role"]["gradients"], weights, large), (weights, run["by_role"])
