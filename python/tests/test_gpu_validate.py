"""The GPU validation script, run end to end on CPU with small sizes, so no GPU minute goes to debugging it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

pytest.importorskip("transformers", reason="transformers is not installed for this Python (it needs Python 3.10 or newer)")
pytest.importorskip("lightning", reason="lightning is not installed for this Python")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "gpu_validate.py")


def test_every_section_runs_on_cpu_and_reports(tmp_path):
    out = tmp_path / "v"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--quick", "--out", str(out), "--budget", "900"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["VALIDATION-draft.md", "artifacts.tar.gz", "results.json", "snapshots.tar.gz"]
    r = json.loads((out / "results.json").read_text())
    s = r["sections"]
    assert {k: d["status"] for k, d in s.items()} == {
        "allocator": "ok", "preflight": "ok", "scripts": "ok", "planted": "ok", "oom": "ok", "overhead": "ok", "estimate": "ok", "gpus": "ok", "big": "ok"
    }, {k: d.get("error") for k, d in s.items()}
    assert s["allocator"]["skipped"]
    # Preflight's side runs anywhere: each case's predictions and its search.
    cases = {c["case"]: c for c in s["preflight"]["cases"]}
    assert cases["gpt-100m"]["predicted_largest_micro_batch"] == 11, cases["gpt-100m"]
    assert all(len(c.get("rows", [])) == 2 for name, c in cases.items() if name != "resnet50"), cases

    # The command's side of the scripts: each unchanged script answered (measured only on a GPU).
    scripts = s["scripts"]["cases"]
    assert [c["case"] for c in scripts] == [
        "train.py b4", "train.py b12", "fsdp_train.py", "compiled.py b8", "generate.py dynamic", "generate.py static"
    ]  # fmt: skip
    assert all(c["preflight_rc"] == 0 and c["predicted_reserved_bytes"] >= c["predicted_allocated_bytes"] > 0 for c in scripts), scripts
    assert scripts[0]["predicted_allocated_bytes"] < scripts[1]["predicted_allocated_bytes"]

    rows = {row["case"]: row for row in s["planted"]["rows"]}
    assert len(rows) == 2 * 5 + 2
    assert all(row["rc"] == 0 for row in rows.values()), rows
    # What CPU can show: the language model's kept outputs (1 MiB a step) are a
    # leak; the small CNN's (1.25 KiB a step) are lost in the resident set's noise.
    assert rows["gpt-leak"]["named"], rows["gpt-leak"]
    # The stale copy is named in both models; a clean run gets no finding.
    assert rows["gpt-stale_copy"]["named"] and rows["cnn-stale_copy"]["named"]
    # An eval that keeps its outputs, though the resident set never gives the memory back.
    assert rows["gpt-eval_keeps_outputs"]["named"] and rows["cnn-eval_keeps_outputs"]["named"]
    assert rows["gpt-clean"]["log_findings"] == [] and rows["cnn-clean"]["log_findings"] == []
    assert rows["hf-callback"]["log_findings"] == [] and rows["lightning-callback"]["log_findings"] == []

    oom = s["oom"]
    assert oom["capture"]["rc"] == 1 and oom["capture"]["diagnosis_printed"]
    [captured] = oom["capture"]["log_ooms"]
    assert captured["requested_bytes"] == 1 << 62 and captured["stage"] == "forward"
    attempts = oom["run"]["summary"]["attempts"]
    assert [(a["batch_size"], a["grad_accum"]) for a in attempts] == [(64, 1), (32, 2), (16, 4)]
    assert oom["run"]["rc"] == 0
    # The script fits up to 16: find-batch says so, and real runs at 16 and 17 agree.
    assert oom["find_batch"]["recommended"] == 16
    assert oom["scan"] == {"recommended_fits": True, "next_fits": False}

    bench = s["overhead"]["result"]
    assert bench["plain_ms"] > 0 and bench["tracked_ms"] > 0 and bench["tracker_device_bytes"] is None
    assert len(s["estimate"]["rows"]) == 2 and all(row["estimated_bytes"] for row in s["estimate"]["rows"])
    assert s["gpus"]["oomkit_rc"] == 3  # no GPU here
    assert s["big"]["skipped"]

    draft = (out / "VALIDATION-draft.md").read_text()
    assert "| gpt-stale_copy | duplicate_copy |" in draft
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith(".jsonl") for n in names)


def test_the_measuring_wrapper_runs_a_script_as_python_would(tmp_path):
    # On the GPU it adds the RESULT line; what the script sees must be as under `python SCRIPT ARGS`.
    script = tmp_path / "echo.py"
    (tmp_path / "helper.py").write_text("VALUE = 'imported beside the script'\n")
    script.write_text("import sys, helper\nif __name__ == '__main__':\n    print(sys.argv[0].endswith('echo.py'), sys.argv[1:], helper.VALUE)\n")
    wrapper = os.path.join(os.path.dirname(SCRIPT), "measure_script.py")
    p = subprocess.run([sys.executable, wrapper, str(script), "--batch-size", "3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "True ['--batch-size', '3'] imported beside the script"
