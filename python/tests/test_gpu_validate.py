"""The GPU validation script, run end to end on CPU with small sizes, so no GPU minute goes to debugging it."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
from preflight_cli import OOMKIT, VISION_SITE, pythonpath_with, warm_python

pytest.importorskip("transformers", reason="transformers is not installed for this Python (it needs Python 3.10 or newer)")
pytest.importorskip("lightning", reason="lightning is not installed for this Python")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "gpu_validate.py")


# The sections in four runs, so that the suite's two workers share them.
GROUPS = {
    "preflight's side": ["preflight", "scripts", "boundary", "fixes", "config", "nanogpt"],
    "runs": ["allocator", "warm", "workspaces", "oom", "overhead", "gpus", "estimate", "big"],
    "planted": ["planted"],
    # torchvision is installed in a folder of its own (scripts/test.sh): on the path of this run alone.
    "mixed precision": ["amp"],
}

#: A stand-in for build-nanogpt's folder, in this project's words, small: train_gpt2.py reads the
#: token shards and HellaSwag's examples where the real one does, checks tiktoken's cache holds
#: GPT-2's two BPE files under tiktoken's names for them, and trains until stopped, 2 micro-batches
#: a step under bf16 autocast (the real one trains 19,073 steps of 8).
STANDIN_TRAIN = """
import hashlib, os
import numpy as np
import torch
import torch.nn.functional as F
from hellaswag import iterate_examples

cache = os.environ["TIKTOKEN_CACHE_DIR"]
for name in ("vocab.bpe", "encoder.json"):
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/" + name
    assert os.path.exists(os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())), name
shards = sorted(os.listdir("edu_fineweb10B"))
tokens = torch.tensor(np.load(os.path.join("edu_fineweb10B", [s for s in shards if "train" in s][0])).astype(np.int64))
assert len([s for s in shards if "val" in s]) == 1 and len(list(iterate_examples("val"))) == 16
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Embedding(50304, 32), torch.nn.Linear(32, 50304)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
B, T = 4, 64
for step in range(19073):
    for micro in range(2):
        at = (step * 2 + micro) * B * T
        x, y = tokens[at : at + B * T].view(B, T).to(device), tokens[at + 1 : at + B * T + 1].view(B, T).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
"""

#: hellaswag.py's reader, as the stand-in needs it: the examples from hellaswag/ beside the file.
STANDIN_HELLASWAG = """
import json, os


def iterate_examples(split):
    with open(os.path.join(os.path.dirname(__file__), "hellaswag", f"hellaswag_{split}.jsonl")) as f:
        for line in f:
            yield json.loads(line)
"""


def _nanogpt_standin(folder: Path) -> Path:
    """A build-nanogpt folder of the stand-ins above, with BPE files that are not GPT-2's (never read)."""
    folder.mkdir()
    (folder / "train_gpt2.py").write_text(STANDIN_TRAIN)
    (folder / "hellaswag.py").write_text(STANDIN_HELLASWAG)
    for name in ("vocab.bpe", "encoder.json"):
        (folder / name).write_text("a stand-in\n")
    return folder


def _run_sections(tmp_path: Path, sections: list[str]) -> tuple[Path, dict[str, Any]]:
    """Runs the script on CPU, quick, with these sections only; returns its folder and its sections' results."""
    out = tmp_path / "v"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if "amp" in sections:
        if not (VISION_SITE / "torchvision").is_dir():
            pytest.skip(f"torchvision is not installed in {VISION_SITE} (scripts/test.sh installs it)")
        env["PYTHONPATH"] = pythonpath_with(VISION_SITE)
    extra = ["--nanogpt", str(_nanogpt_standin(tmp_path / "build-nanogpt"))] if "nanogpt" in sections else []
    # The script adds these to its commands' environment (its work folder is out/work): a warm
    # Python started with them serves its preflights, as the suite's own serves the tests'.
    theirs = dict(env, **_script().command_env(str(out / "work")))
    with warm_python(theirs) as served:
        if served is not None:
            env["OOMKIT_PREFLIGHT_SERVER"] = served
        p = subprocess.run(
            [sys.executable, SCRIPT, "--device", "cpu", "--quick", "--out", str(out), "--budget", "900", "--only", ",".join(sections), *extra],
            capture_output=True, text=True, env=env, timeout=900,
        )
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["VALIDATION-draft.md", "artifacts.tar.gz", "results.json", "snapshots.tar.gz"]
    s = json.loads((out / "results.json").read_text())["sections"]
    assert {k: d["status"] for k, d in s.items()} == dict.fromkeys(sections, "ok"), {k: d.get("error") for k, d in s.items()}
    return out, s


def test_the_sections_together_are_every_section_of_the_script() -> None:
    text = Path(SCRIPT).read_text()
    plan = text[text.index("plan = [") : text.index("]\n", text.index("plan = ["))]
    named = [part.split('"')[1] for part in plan.split("(")[1:]]
    assert sorted(named) == sorted(name for group in GROUPS.values() for name in group), named


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_section_runs_on_cpu_and_reports(tmp_path: Path, group: str) -> None:
    out, s = _run_sections(tmp_path, GROUPS[group])
    if group == "preflight's side":
        _check_preflight_side(s)
    elif group == "runs":
        _check_runs(s)
    elif group == "planted":
        _check_planted(out, s)
    else:
        _check_mixed_precision(s)


def _check_preflight_side(s: dict[str, Any]) -> None:
    # Preflight's side runs anywhere: each case's predictions and its search.
    cases = {c["case"]: c for c in s["preflight"]["cases"]}
    assert list(cases) == ["gpt-100m"], cases
    assert cases["gpt-100m"]["predicted_largest_micro_batch"] == 11, cases["gpt-100m"]
    assert all(len(c.get("rows", [])) == 2 for name, c in cases.items() if name != "resnet50"), cases

    # The command's side of the scripts: each unchanged script answered (measured only on a GPU).
    scripts = s["scripts"]["cases"]
    assert [c["case"] for c in scripts] == [
        "train.py b4", "train.py b12", "fsdp_train.py", "compiled.py b8", "generate.py dynamic", "generate.py static", "decode.py 1024"
    ]  # fmt: skip
    assert all(c["preflight_rc"] == 0 and c["predicted_reserved_bytes"] >= c["predicted_allocated_bytes"] > 0 for c in scripts), scripts
    assert scripts[0]["predicted_allocated_bytes"] < scripts[1]["predicted_allocated_bytes"]

    # The longest context the search finds: it fits, and the next value it tried does not (run on a GPU only).
    boundary = s["boundary"]
    assert boundary["largest"] and boundary["rows"] == [], boundary
    assert any(not fits and value > boundary["largest"] for value, fits in boundary["tried"]), boundary

    # Preflight's rows for two fixes, ready to be set beside the script changed by hand on a GPU.
    fixes = {row["change"]: row for row in s["fixes"]["rows"]}
    checkpointed = fixes["activation checkpointing of the model's repeated blocks"]
    assert checkpointed["predicted_allocated_bytes"] > 0 and "measured_rc" not in checkpointed, checkpointed
    if importlib.util.find_spec("bitsandbytes") is not None:
        assert fixes["8-bit AdamW (bitsandbytes) for torch.optim.AdamW"]["predicted_allocated_bytes"] > 0

    # A fine-tune from a folder holding only its config: full, LoRA and (where bitsandbytes is installed) QLoRA.
    config = {row["case"]: row for row in s["config"]["rows"]}
    assert list(config) == ["full", "LoRA r16", "QLoRA r16"], config
    for name, row in config.items():
        if name == "QLoRA r16" and importlib.util.find_spec("bitsandbytes") is None:
            assert row["skipped"] == "bitsandbytes is not installed"
            continue
        assert row["preflight_rc"] == 0 and row["predicted_reserved_bytes"] >= row["predicted_allocated_bytes"] > 0, row
    assert s["config"]["seq"] == 64 and s["config"]["model"]["num_hidden_layers"] == 2

    # build-nanogpt's folder, here a stand-in: answered from its own folder, with its stand-in inputs.
    nanogpt = s["nanogpt"]
    assert nanogpt["predicted_fits"] and nanogpt["predicted_reserved_bytes"] >= nanogpt["predicted_allocated_bytes"] > 0, nanogpt
    assert nanogpt["capacity_bytes"] > 75 << 30 and "measured_rc" not in nanogpt  # an 80 GB GPU, less its CUDA context
    # At least the stand-in's float32 weights, their gradients and AdamW's two moments: 4 x 4 bytes a weight.
    weights = 50304 * 32 + 32 * 50304 + 50304
    assert nanogpt["predicted_allocated_bytes"] >= 16 * weights, nanogpt


def _check_mixed_precision(s: dict[str, Any]) -> None:
    # ResNet-50's step under autocast holds less than in fp32, fp16 and bf16 alike (each 2 bytes an element).
    amp = s["amp"]
    cases = {c["case"]: c for c in amp["cases"]}
    assert list(cases) == ["resnet50", "resnet50-fp16", "resnet50-bf16"], amp
    assert [cases[c]["autocast"] for c in cases] == ["None", "torch.float16", "torch.bfloat16"]
    assert all([row["micro_batch"] for row in c["rows"]] == [4] for c in cases.values()), cases
    assert amp["predicted_mixed_below_fp32"] is True and "measured_mixed_below_fp32" not in amp, amp


def _check_runs(s: dict[str, Any]) -> None:
    assert s["allocator"]["skipped"] and s["warm"]["skipped"] and s["workspaces"]["skipped"]
    oom = s["oom"]
    assert oom["capture"]["rc"] == 1 and oom["capture"]["diagnosis_printed"]
    [captured] = oom["capture"]["log_ooms"]
    assert captured["requested_bytes"] == 1 << 62 and captured["stage"] == "forward"
    attempts = oom["run"]["summary"]["attempts"]
    assert [(a["batch_size"], a["grad_accum"]) for a in attempts] == [(32, 1), (16, 2)]
    assert oom["run"]["rc"] == 0
    # The script fits up to 16: find-batch says so, and real runs at 16 and 17 agree.
    assert oom["find_batch"]["recommended"] == 16
    assert oom["scan"] == {"recommended_fits": True, "next_fits": False}

    bench = s["overhead"]["result"]
    assert bench["plain_ms"] > 0 and bench["tracked_ms"] > 0 and bench["tracker_device_bytes"] is None
    assert len(s["estimate"]["rows"]) == 2 and all(row["estimated_bytes"] for row in s["estimate"]["rows"])
    assert s["gpus"]["oomkit_rc"] == 3  # no GPU here
    assert s["big"]["skipped"]


def _check_planted(out: Path, s: dict[str, Any]) -> None:
    rows = {row["case"]: row for row in s["planted"]["rows"]}
    # Quick: a clean run and the stale copy in each model, Transformers' callback.
    assert len(rows) == 2 + 2 + 1, sorted(rows)
    assert all(row["rc"] == 0 for row in rows.values()), rows
    # Each step's figures, in full where a row is wrong (pytest shortens a dict).
    def shown(case: str) -> str:
        return json.dumps(rows[case])

    # The stale copy is named in both models, with each step's figures kept; a clean run gets no finding.
    assert rows["gpt-stale_copy"]["named"], shown("gpt-stale_copy")
    assert len(rows["gpt-stale_copy"]["step_end_bytes"]) == 12
    assert rows["cnn-stale_copy"]["named"], shown("cnn-stale_copy")
    assert rows["gpt-clean"]["log_findings"] == [], shown("gpt-clean")
    assert rows["cnn-clean"]["log_findings"] == [], shown("cnn-clean")
    assert rows["hf-callback"]["log_findings"] == []

    draft = (out / "VALIDATION-draft.md").read_text()
    assert "| gpt-stale_copy | duplicate_copy |" in draft
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith(".jsonl") for n in names)


def test_what_a_quick_run_leaves_out_the_tests_run_elsewhere(tmp_path: Path) -> None:
    # A quick run predicts one preflight case and runs one framework's callback; the rest are the
    # tests' own: every case beside its GPU figures, Lightning's example analyzed clean.
    gv, _ = _validation(tmp_path)
    measured = json.loads((Path(__file__).with_name("gpu_h200_preflight.json")).read_text())["cases"]
    assert list(gv.PREFLIGHT_CASES) == [c["case"] for c in measured]
    assert set(gv.QUICK_PREFLIGHT_CASES) <= set(gv.PREFLIGHT_CASES)
    # The planted bugs a quick run leaves out: each run on CPU by test_examples.py, named there.
    examples = (Path(__file__).with_name("test_examples.py")).read_text()
    assert set(gv.QUICK_BUGS) | set(gv.TESTED_ELSEWHERE) == set(gv.EXPECTED) - {"ema_on_device"}
    for bug, flag in gv.TESTED_ELSEWHERE.items():
        assert f'"{flag}"]' in examples and f'"{gv.EXPECTED[bug][0]}"' in examples, bug
    lightning = (Path(__file__).with_name("test_integration_lightning.py")).read_text()
    assert [script for script, _ in gv.FRAMEWORK_CASES[1:]] == ["lightning_trainer.py"]
    assert '"lightning_trainer.py"), "--root", "runs/pl", "--oomkit"]' in lightning and 'analysis["findings"] == []' in lightning


def test_the_measuring_wrapper_runs_a_script_as_python_would(tmp_path):
    # On the GPU it adds the RESULT line; what the script sees must be as under `python SCRIPT ARGS`.
    script = tmp_path / "echo.py"
    (tmp_path / "helper.py").write_text("VALUE = 'imported beside the script'\n")
    script.write_text("import sys, helper\nif __name__ == '__main__':\n    print(sys.argv[0].endswith('echo.py'), sys.argv[1:], helper.VALUE)\n")
    wrapper = os.path.join(os.path.dirname(SCRIPT), "measure_script.py")
    p = subprocess.run([sys.executable, wrapper, str(script), "--batch-size", "3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "True ['--batch-size', '3'] imported beside the script"


def test_the_measuring_wrapper_ends_a_script_after_its_steps(tmp_path):
    # A script that would train for hours is measured over its first optimizer steps, as preflight runs it;
    # the script's own `except Exception` does not stop that, and what it registered at exit still runs.
    script = tmp_path / "forever.py"
    script.write_text(
        "import atexit, torch\n"
        "atexit.register(lambda: print('the script exits'))\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for step in range(10**9):\n"
        "    try:\n"
        "        w.sum().backward()\n"
        "        opt.step()\n"
        "    except Exception:\n"
        "        print('swallowed')\n"
        "    print('step', step)\n"
    )
    wrapper = os.path.join(os.path.dirname(SCRIPT), "measure_script.py")
    p = subprocess.run([sys.executable, wrapper, "--steps", "3", str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["step 0", "step 1", "the script exits"]


def _script() -> Any:
    """The script as a module."""
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    assert spec is not None and spec.loader is not None
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    return gv


def _validation(tmp_path: Path) -> Any:
    """The script as a module, and a run of it that believes it has a GPU."""
    gv = _script()
    v = gv.Validation(Namespace(device="cuda", quick=True, out=str(tmp_path / "out"), work=None, budget=300))
    v.oomkit = OOMKIT
    return gv, v


#: A GPU's memory, as the sections ask torch for it.
TOTAL = 80 << 30


def test_the_warm_trace_section_asks_whatif_and_measures_each_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On the GPU the recording and the runs are real; here the demo snapshot stands for the
    # recording, and the runs report what the GPU would: whatif's reading of them is what is checked.
    gv, v = _validation(tmp_path)
    demo = Path(SCRIPT).parents[1] / "crates" / "oomkit-cli" / "assets" / "demo_snapshot.pickle"
    runs: list[list[str]] = []
    recorded = json.loads(subprocess.run([OOMKIT, "whatif", "--json", str(demo)], capture_output=True, text=True, check=True).stdout)
    allocated = recorded["devices"][0]["scenarios"][0]["peak_allocated_bytes"]

    def example(script: str, flags: list[str], **_: Any) -> dict[str, Any]:
        runs.append(flags)
        if "--snapshot" in flags:
            shutil.copy(demo, os.path.join(v.work, flags[flags.index("--snapshot") + 1]))
            return {"rc": 0, "stderr": "", "result": {"status": "ok"}}
        # A cap below what the step holds at once fails, as the allocator would.
        capped = "--memory-fraction" in flags and float(flags[flags.index("--memory-fraction") + 1]) * TOTAL < allocated
        return {"rc": 1 if capped else 0, "stderr": "", "result": {"status": "oom" if capped else "ok", "peak_reserved_bytes": 18 << 30}}

    real_sh = v.sh
    monkeypatch.setattr(v, "example", example)
    monkeypatch.setattr(v, "sh", lambda cmd, **kw: {"rc": 0, "stdout": str(TOTAL)} if cmd[:2] == [sys.executable, "-c"] else real_sh(cmd, **kw))
    out = gv.warm(v)
    trace = out["trace"]
    assert trace["total_bytes"] == TOTAL and trace["peak_allocated_bytes"] < trace["peak_reserved_bytes"], out
    rows = {row["case"]: row for row in out["rows"]}
    assert list(rows) == ["capacity below the peak allocated", "capacity between allocated and reserved", "half the micro-batch"]
    below = rows["capacity below the peak allocated"]
    # Below what the step holds at once, whatif says it runs out, as the capped run did.
    assert below["predicted_oom"] and below["measured_oom"] and below["oom_right"], below
    # The runs asked for: the recording after 3 warm-up steps, then each capacity as the matching
    # share of the GPU, then half the micro-batch with no cap.
    assert runs[0][-4:] == ["--record-after", "3", "--snapshot", "warm.pickle"]
    shares = [float(r[r.index("--memory-fraction") + 1]) for r in runs[1:3]]
    assert abs(shares[0] * TOTAL - int(trace["peak_allocated_bytes"] * 0.9)) < 1e-5 * TOTAL
    assert runs[3][runs[3].index("--batch") + 1] == "16" and "--memory-fraction" not in runs[3]
    half = rows["half the micro-batch"]
    assert half["scenario"] == "micro-batch x0.5" and half["reserved_error"] == round(half["predicted_reserved_bytes"] / (18 << 30) - 1, 4)


def test_the_workspace_section_finds_cublas_blocks_by_their_frames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gv, v = _validation(tmp_path)

    def block(size: int, name: str) -> dict[str, Any]:
        return {"size": size, "state": "active_allocated", "frames": [{"name": name, "filename": "??", "line": 0}]}

    snapshot = {
        "segments": [
            {"blocks": [block(32 << 20, "at::cuda::getCurrentCUDABlasHandle()"), block(1 << 20, "at::native::empty_cuda")]},
            {"blocks": [block(32 << 20, "at::cuda::getCUDABlasLtWorkspace()")]},
        ]
    }

    def example(script: str, flags: list[str], **_: Any) -> dict[str, Any]:
        with open(os.path.join(v.work, "workspaces.pickle"), "wb") as f:
            pickle.dump(snapshot, f)
        return {"rc": 0, "stderr": "", "result": {"status": "ok"}}

    monkeypatch.setattr(v, "example", example)
    monkeypatch.setattr(v, "sh", lambda cmd, **kw: {"rc": 0, "stdout": "NVIDIA H100 80GB HBM3\n"})
    assert gv.workspaces(v) == {"gpu": "NVIDIA H100 80GB HBM3", "workspace_sizes": [32 << 20, 32 << 20], "count": 2}
