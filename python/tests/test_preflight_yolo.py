"""Ultralytics' own trainer, ``yolo train``, run unchanged under `oomkit preflight`.

YOLO's command is among the most used training entry points there are. A
detection model is built from its configuration (``yolo11n.yaml``: no
weights), trained on a data set of generated pictures and boxes written
here, with mixed precision, an EMA of the weights, a pinning data loader,
the task-aligned assigner's data-dependent selections and a validation
after the epoch. Before training, the trainer checks mixed precision by
predicting with a second model in float32 and under autocast (inside
``inference_mode``) and comparing the two with ``allclose``: its weights
(``yolo26n.pt``, fetched once by a user with a network) are a stand-in saved
here from its configuration, so nothing is downloaded. Given a batch the GPU
cannot hold, the trainer catches CUDA's error itself and halves its batch.

ultralytics and what it imports that the other tests do not (OpenCV,
matplotlib, polars) are installed by scripts/test.sh into their own folder,
`.venv/ultralytics-site`, for the reason the other frameworks' folders are.
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

#: Where scripts/test.sh installs ultralytics, apart from the other tests' libraries.
ULTRALYTICS_SITE = Path(sys.prefix) / "ultralytics-site"
#: Its console script, as pip writes it (its first line names this Python).
YOLO = ULTRALYTICS_SITE / "bin" / "yolo"

pytestmark = pytest.mark.skipif(
    not (ULTRALYTICS_SITE / "ultralytics").is_dir() or not (VISION_SITE / "PIL").is_dir(),
    reason=f"ultralytics is not installed in {ULTRALYTICS_SITE}, or Pillow in {VISION_SITE} (scripts/test.sh installs them)",
)

#: The pictures trained on: 40, each with up to six boxes of two classes, at 320 pixels.
PICTURES, IMAGE_SIZE = 40, 320

#: What the test reads of the model built on the host: its parameters, the trainable ones
#: (the trainer always freezes the distribution-focal-loss layer, ``.dfl``) and its buffers.
SIZES = """
import json, sys
from ultralytics.nn.tasks import DetectionModel
m = DetectionModel("yolo11n.yaml", nc=2, verbose=False)
json.dump({
    "params": [p.nbytes for p in m.parameters()],
    "trained": [p.nbytes for n, p in m.named_parameters() if ".dfl" not in n],
    "float_buffers": [b.nbytes for b in m.buffers() if b.is_floating_point()],
    "other_buffers": [b.nbytes for b in m.buffers() if not b.is_floating_point()],
}, open(sys.argv[1], "w"))
"""

#: The data set, in YOLO's layout: pictures (Pillow is in a folder of its own, beside ultralytics),
#: and for each a text file of up to six boxes of two classes.
DATA = """
import sys
from pathlib import Path
from PIL import Image
root, pictures = Path(sys.argv[1]), int(sys.argv[2])
for split, count in (("train", pictures), ("val", 8)):
    (root / "images" / split).mkdir(parents=True)
    (root / "labels" / split).mkdir(parents=True)
    for i in range(count):
        shade = (i * 37) % 256
        Image.new("RGB", (160, 120), (shade, 255 - shade, shade // 2)).save(root / "images" / split / f"{i}.jpg")
        boxes = [f"{(i + k) % 2} {0.2 + 0.1 * k:.2f} {0.3 + 0.05 * k:.2f} 0.10 0.15" for k in range(1 + i % 6)]
        (root / "labels" / split / f"{i}.txt").write_text("\\n".join(boxes) + "\\n")
"""

#: The stand-in for the weights the trainer's mixed-precision check predicts with.
AMP_WEIGHTS = """
import sys
from ultralytics import YOLO
YOLO("yolo26n.yaml").save(sys.argv[1])
"""


def _env(home: Path) -> dict[str, str]:
    # Its settings here (no telemetry, weights and runs in this folder); no request leaves the machine.
    refused = "http://127.0.0.1:9"
    return {
        **os.environ, "PYTHONPATH": pythonpath_with(ULTRALYTICS_SITE, VISION_SITE), "YOLO_CONFIG_DIR": str(home / "config"),
        "YOLO_OFFLINE": "1", "http_proxy": refused, "https_proxy": refused, "HTTP_PROXY": refused, "HTTPS_PROXY": refused,
    }  # fmt: skip


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data set in YOLO's layout, its settings, and the mixed-precision check's stand-in weights."""
    out = tmp_path_factory.mktemp("yolo")
    (out / "config" / "Ultralytics").mkdir(parents=True)
    settings = {"weights_dir": str(out / "weights"), "datasets_dir": str(out), "runs_dir": str(out / "runs"), "sync": False}
    (out / "config" / "Ultralytics" / "settings.json").write_text(json.dumps(settings))
    (out / "weights").mkdir()
    env = _env(out)
    subprocess.run([sys.executable, "-c", DATA, str(out / "data"), str(PICTURES)], check=True, env=env, timeout=300)
    (out / "data.yaml").write_text(f"path: {out / 'data'}\ntrain: images/train\nval: images/val\nnames:\n  0: a\n  1: b\n")
    subprocess.run([sys.executable, "-c", AMP_WEIGHTS, str(out / "weights" / "yolo26n.pt")], check=True, cwd=out, env=env, timeout=300)
    subprocess.run([sys.executable, "-c", SIZES, str(out / "sizes.json")], check=True, cwd=out, env=env, timeout=300)
    return out


def _train(home: Path, *flags: str, batch: int, amp: bool = True) -> tuple[dict[str, Any], str]:
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", *flags, "--", str(YOLO), "train", "model=yolo11n.yaml", "data=data.yaml",
         "epochs=1", f"imgsz={IMAGE_SIZE}", f"batch={batch}", "workers=0", "plots=False", "device=0", f"amp={amp}",
         f"project={home / 'runs'}", "exist_ok=True"],
        capture_output=True, text=True, timeout=600, cwd=home, env=_env(home),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    run: dict[str, Any] = json.loads(p.stdout)["run"]
    return run, p.stderr


def test_yolo_train_halves_its_own_batch_and_answers_for_the_batch_it_kept(home: Path) -> None:
    # 450 MiB holds batch 8 and not 16: the trainer catches CUDA's error and halves its batch.
    run, printed = _train(home, "--capacity", "450MiB", batch=16)
    assert any("AMP" in line and "checks passed" in line for line in printed.splitlines()), printed[-3000:]
    assert "out of memory with batch=16. Reducing to batch=8" in printed, printed[-3000:]
    assert run["out_of_memory"]["raised"] == 1 and run["out_of_memory"]["went_on"], run["out_of_memory"]
    assert run["mode"] == "training" and run["peak_reserved_bytes"] <= 450 << 20, run
    sizes = json.loads((home / "sizes.json").read_text())
    blocks = {k: allocator_bytes(SimpleNamespace(nbytes=n) for n in v) for k, v in sizes.items()}
    roles = run["by_role"]
    # A gradient for every weight the trainer trains.
    assert roles["gradients"] == blocks["trained"], (roles, blocks)
    # The EMA: a copy of the weights and of batch norm's statistics, which it updates in place.
    assert roles["ema"] == blocks["params"] + blocks["float_buffers"], (roles, blocks)
    # The weights, with all the buffers (the EMA's batch counters too, which it copies and never updates).
    whole = blocks["params"] + blocks["float_buffers"] + blocks["other_buffers"]
    assert whole <= roles["parameters"] <= whole + blocks["other_buffers"] + (8 << 10), (roles, blocks)
    # The batch of 8 made floats and scaled on the GPU, and the last one's, which the trainer still holds.
    pictures = 8 * 3 * IMAGE_SIZE * IMAGE_SIZE * 4
    assert 2 * pictures <= roles["inputs"] <= 2 * pictures + (64 << 10), roles


def test_yolo_train_under_mixed_precision_keeps_less_than_in_float32(home: Path) -> None:
    amp, _ = _train(home, "--no-fixes", batch=8)
    fp32, _ = _train(home, "--no-fixes", batch=8, amp=False)
    # Each convolution's output kept for backward in half precision, not in float32.
    assert amp["by_role"]["activations"] < 0.6 * fp32["by_role"]["activations"], (amp["by_role"], fp32["by_role"])
    assert amp["peak_allocated_bytes"] < fp32["peak_allocated_bytes"], (amp, fp32)

