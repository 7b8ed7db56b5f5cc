"""Every measurement of the GPU validation, in order of priority, into one folder, in one command.

    python scripts/gpu_validate.py --out validation-out             # on the GPU machine
    python scripts/gpu_validate.py --device cpu --quick --out /tmp/v  # the same steps on CPU, small

Sections, most important first (each is skipped when the time budget left
is smaller than its estimate, and one that fails is recorded and the next
runs):

- amp: mixed precision on a convolutional network: ResNet-50's training
  step in fp32 and under autocast to fp16 and to bf16, preflight's peaks
  beside the same steps measured (scripts/gpu_preflight_check.py); mixed
  precision must hold less than fp32;
- nanogpt: build-nanogpt's train_gpt2.py, unchanged, at its defaults
  (micro-batch 64 x 1024 tokens, bf16 autocast, 8 micro-batches a step),
  with stand-ins for its data, asked whether it fits an 80 GB GPU, beside
  its first two optimizer steps on the GPU capped at that capacity (the
  script and GPT-2's BPE files come from --nanogpt DIR, which
  scripts/nanogpt_inputs.sh fills; skipped without it);
- config: examples/preflight/finetune.py fine-tuning a Llama-shaped model
  of about 1.2 B (full, LoRA, QLoRA where bitsandbytes is installed)
  from a folder holding only its config, beside the same script on the
  GPU loading random weights written beside the same config;
- allocator: oomkit's model of the caching allocator against PyTorch's own
  (scripts/gpu_allocator_run.py): a GPT-2-small-shaped model trained on
  sequences of changing length under four settings, each trace replayed by
  `oomkit whatif` beside the allocator's own figures; the default run's
  trace replayed under the other settings beside those runs measured; and
  two runs with the device nearly full (taken by another library's
  cudaMalloc), the OOM replayed and whatif's answer for other settings
  measured under the same limit;
- preflight: `oomkit.preflight` beside the same steps measured, three
  models at two micro-batches each, and the largest micro-batch under a
  limit against a bisection of real steps (scripts/gpu_preflight_check.py);
- scripts: `oomkit preflight -- python SCRIPT` (the command, on unchanged
  scripts with bfloat16 autocast: the README's GPT at two micro-batches,
  the FSDP GPT under torchrun, the GPT compiled, `generate()` with a
  dynamic and a static cache, and a latent diffusion model's image decoder
  at 1024 x 1024) beside the same scripts run on the GPU
  (scripts/measure_script.py);
- boundary: the longest context of the README's GPT that `oomkit
  preflight --search ctx=...` finds fits 24 GiB, and the next it tried,
  each run on the GPU capped at 24 GiB: the first must fit, the second
  run out;
- fixes: two of preflight's "what would make it fit" rows (activation
  checkpointing, 8-bit AdamW) beside examples/preflight/blocks.py changed
  by hand the same way, run on the GPU;
- warm: `oomkit whatif` on a trace recorded after warm-up steps, its
  answers for a capacity below the peak allocated, one between allocated
  and reserved, and half the micro-batch, beside the same run measured
  under `set_per_process_memory_fraction` and at half the micro-batch;
- workspaces: the cuBLAS workspaces a training step holds, read from a
  snapshot of the GPU (preflight adds one per thread that multiplies
  matrices);

then:

1. planted: the example scripts with each planted bug under oomkit's
   tracker (and, on CUDA, a snapshot), the findings of the run log and the
   snapshot per bug, and the two framework examples with their callbacks;
2. oom: a real OOM (CUDA: `set_per_process_memory_fraction`; CPU: a real
   allocator failure above a micro-batch) captured by the tracker, `oomkit
   run` stepping down with the same effective batch, and `oomkit
   find-batch` against a bisection over every micro-batch;
3. overhead: step time with and without the tracker, and the device memory
   the tracker adds;
4. estimate: `oomkit estimate --config` against measured peaks, three sizes
   at two micro-batches;
5. gpus: `oomkit gpus` against `nvidia-smi`, figures and latency;
6. big: a recording of at least 1 M events timed under `oomkit analyze`,
   `pickle.load` and `torch.cuda._memory_viz stats` (CUDA only).

A quick run (CPU, for the tests) predicts one preflight case and runs one
framework's callback: the tests run the others themselves.

The folder gets `results.json` (everything), `VALIDATION-draft.md` (the
tables), `artifacts.tar.gz` (run logs, commands' outputs, reports) and
`snapshots.tar.gz`: few files, as the device tool brings back at most eight.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# What each planted bug should be named as, in a run log and in a snapshot.
EXPECTED = {
    "leak": ("leak", "phase_retains_memory"),
    "stale_copy": ("duplicate_copy", None),
    "eval_keeps_outputs": ("eval_spike", "phase_retains_memory"),
    "ema_on_device": ("ema_on_device", None),
}


#: The bugs a quick run (on CPU, for the tests) plants in the language model: the one the CNN's
#: quick rows plant too. The leak and the kept eval outputs take the same path through this
#: section, and the tests run each of them on CPU with their own thresholds (test_examples.py).
QUICK_BUGS = ["stale_copy"]

#: The language model's planted bugs that test_examples.py runs on CPU, by the flag that plants each.
TESTED_ELSEWHERE = {"leak": "--leak", "eval_keeps_outputs": "--eval-keeps-outputs"}

#: The framework examples run with oomkit's callback on a clean run: script and arguments.
FRAMEWORK_CASES = (("hf_trainer.py", ["--out", "hf"]), ("lightning_trainer.py", ["--root", "pl", "--oomkit"]))

#: The largest file packed into artifacts.tar.gz.
ARTIFACT_MAX_BYTES = 10 << 20


def _load(path: str) -> Any:
    """A JSON file's content."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def command_env(work: str) -> dict[str, str]:
    """What every command the script runs adds to its environment, ``work`` being its work folder."""
    # A plan memory of the run's own: stepping down is measured, not skipped by a remembered plan.
    return {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OOMKIT_CACHE_DIR": os.path.join(work, "cache")}


class Validation:
    """The run's settings, its results, and the helpers every section uses."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = args.device == "cuda"
        self.out = os.path.abspath(args.out)
        self.work = os.path.abspath(args.work) if args.work else os.path.join(self.out, "work")
        os.makedirs(self.work, exist_ok=True)
        os.makedirs(self.out, exist_ok=True)
        self.t0 = time.monotonic()
        self.results: dict[str, Any] = {"device": args.device, "quick": args.quick, "sections": {}}
        self.oomkit = shutil.which("oomkit") or ""

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def sh(self, cmd: list[str], timeout: float = 300, env: Optional[dict[str, str]] = None, cwd: Optional[str] = None) -> dict[str, Any]:
        """Runs a command; returns its exit code, seconds and output (kept in the artifacts)."""
        t = time.monotonic()
        full_env = dict(os.environ, **command_env(self.work), **(env or {}))
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or self.work)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = 124, str(e.stdout or ""), str(e.stderr or "") + "\n[timed out]"
        n = len(os.listdir(self.work))
        with open(os.path.join(self.work, f"cmd-{n:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(" ".join(cmd) + f"\n# exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}")
        return {"rc": rc, "seconds": time.monotonic() - t, "stdout": out, "stderr": err}

    def example(self, script: str, flags: list[str], **kw: Any) -> dict[str, Any]:
        """Runs an example script; its RESULT line, parsed, is under "result"."""
        r = self.sh([sys.executable, os.path.join(EXAMPLES, script), "--device", self.args.device] + flags, **kw)
        r["result"] = result_line(r["stdout"])
        return r

    def gpu_total_bytes(self) -> int:
        """The GPU's memory, as PyTorch reports it (asked in a child, as every GPU use here is)."""
        probe = self.sh([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"])
        return int(probe["stdout"].strip())

    def analyze(self, path: str) -> dict[str, Any]:
        r = self.sh([self.oomkit, "analyze", "--json", path])
        if r["rc"] != 0:
            return {"error": r["stderr"].strip()[-300:]}
        return json.loads(r["stdout"])

    def section(self, name: str, estimate: float, fn: Callable[[], dict[str, Any]]) -> None:
        if self.left() < estimate:
            self.results["sections"][name] = {"status": "skipped", "why": f"{self.left():.0f} s left, needs about {estimate:.0f} s"}
            return
        t = time.monotonic()
        try:
            data = fn()
            data["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one broken section must not cost the others
            data = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        data["seconds"] = round(time.monotonic() - t, 1)
        self.results["sections"][name] = data
        self.save()
        self.pack()

    def pack(self) -> None:
        """The artifacts so far, so that a run stopped at its time limit still brings them back.

        Two archives: `artifacts.tar.gz` holds everything but the snapshots
        (small, so it always comes back), `snapshots.tar.gz` the snapshots
        of at most ARTIFACT_MAX_BYTES each (the device tool brings back
        files of at most 16 MiB: a recording of a million events stays behind).
        """
        left_out: list[str] = []

        def texts(info: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
            return None if info.name.endswith(".pickle") else info

        def snapshots(info: tarfile.TarInfo) -> Optional[tarfile.TarInfo]:
            if info.isdir():
                return info
            if not info.name.endswith(".pickle"):
                return None
            if info.size > ARTIFACT_MAX_BYTES:
                left_out.append(f"{info.name} ({info.size} bytes)")
                return None
            return info

        for name, keep in (("artifacts.tar.gz", texts), ("snapshots.tar.gz", snapshots)):
            with tarfile.open(os.path.join(self.out, name), "w:gz") as tar:
                tar.add(self.work, arcname="work", filter=keep)
        self.results["artifacts_left_out"] = left_out

    def save(self) -> None:
        with open(os.path.join(self.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(self.results, f, indent=1, default=str)

    # ----- sizes ---------------------------------------------------------------

    def gpt_flags(self) -> list[str]:
        return ["--size", "100m", "--batch", "8"] if not self.args.quick and self.cuda else ["--size", "tiny", "--batch", "32"]

    def cnn_flags(self) -> list[str]:
        return ["--size", "resnet", "--batch", "64"] if not self.args.quick and self.cuda else ["--size", "tiny", "--batch", "32"]


def result_lines(stdout: str) -> list[dict[str, Any]]:
    """The JSON of each ``RESULT {...}`` line a script of this project prints (one for each case it ran)."""
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def result_line(stdout: str) -> Optional[dict[str, Any]]:
    """The JSON of the ``RESULT {...}`` line a script of this project ends with, or None."""
    return next(iter(result_lines(stdout)), None)


def last_json_object(text: str) -> Optional[dict[str, Any]]:
    """The JSON object a command prints after its child's own output (which starts at a line that is just "{")."""
    at = text.rfind("\n{\n")
    if at >= 0:
        start = at + 1
    elif text.startswith("{\n"):
        start = 0
    else:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def kinds(analysis: dict[str, Any]) -> list[str]:
    return [f["kind"] for f in analysis.get("findings", [])]


def step_end_bytes(log: str) -> list[int]:
    """The memory each step of a run log ended with, in order (a line cut short by a crash is left out)."""
    ends = []
    with open(log) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and r.get("type") == "step" and "end_bytes" in r:
                ends.append(r["end_bytes"])
    return ends


def planted(v: Validation) -> dict[str, Any]:
    rows = []
    # A quick run plants no leak (whose growth must outgrow the drift of a CPU's resident set): 12 steps.
    steps = "12" if v.args.quick else "30"
    for script, flags in (("gpt_train.py", v.gpt_flags()), ("cnn_train.py", v.cnn_flags())):
        # Quick runs plant one bug in each model, besides a clean run (QUICK_BUGS says why; an EMA on
        # the device is told by the GPU's memory, not a host's resident set): each row takes the same
        # path, so these show the section and both models' flags still work.
        bugs = [None, *QUICK_BUGS] if v.args.quick else [None, *EXPECTED]
        for bug in bugs:
            name = f"{script.split('_')[0]}-{bug or 'clean'}"
            run_flags = flags + ["--steps", steps, "--eval-every", "4", "--tracker", "--log-dir", f"logs-{name}"]
            if bug:
                run_flags.append("--" + bug.replace("_", "-"))
            if v.cuda:
                run_flags += ["--snapshot", f"{name}.pickle"]
            r = v.example(script, run_flags)
            res = r["result"] or {}
            row: dict[str, Any] = {"case": name, "bug": bug, "rc": r["rc"], "peak_bytes": res.get("peak_bytes")}
            if res.get("log"):
                log = os.path.join(v.work, res["log"])
                row["log_findings"] = kinds(v.analyze(log))
                # What the findings were drawn from, so that a row not named can be read.
                row["step_end_bytes"] = step_end_bytes(log)
            if res.get("snapshot"):
                row["snapshot_findings"] = kinds(v.analyze(os.path.join(v.work, res["snapshot"])))
            if bug:
                want_log, want_snap = EXPECTED[bug]
                row["expected"] = [w for w in (want_log, want_snap) if w]
                row["named"] = want_log in row.get("log_findings", []) or (
                    want_snap is not None and want_snap in row.get("snapshot_findings", [])
                )
            else:
                row["named"] = None
            rows.append(row)
    # The frameworks, each with oomkit's callback, on a clean run. Quick runs take Transformers' alone:
    # the tests run Lightning's, the same command, and analyze its log (test_integration_lightning.py).
    for script, flags in FRAMEWORK_CASES[:1] if v.args.quick else FRAMEWORK_CASES:
        r = v.sh([sys.executable, os.path.join(EXAMPLES, script)] + flags)
        folder = os.path.join(v.work, flags[1], "oomkit-logs")
        logs = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        findings = kinds(v.analyze(os.path.join(folder, logs[-1]))) if logs else None
        rows.append({"case": script.split("_")[0] + "-callback", "bug": None, "rc": r["rc"], "log_findings": findings, "named": None})
    return {"rows": rows}


def oom(v: Validation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The tracker's capture of a real OOM.
    if v.cuda:
        flags = ["--size", "100m", "--batch", "64", "--memory-fraction", "0.25", "--record-history"]
    else:
        flags = ["--size", "tiny", "--batch", "32", "--oom-above", "16", "--tracker"]
    r = v.example("gpt_train.py", flags + ["--steps", "3", "--log-dir", "logs-oom"])
    capture: dict[str, Any] = {"rc": r["rc"], "diagnosis_printed": "out of memory, diagnosis" in r["stderr"]}
    res = r["result"] or {}
    if res.get("log"):
        a = v.analyze(os.path.join(v.work, res["log"]))
        capture["log_ooms"] = a.get("ooms")
        snaps = [o.get("snapshot") for o in a.get("ooms", []) if o.get("snapshot")]
        if snaps:
            s = v.analyze(snaps[0])
            capture["snapshot_ooms"] = sum(len(d.get("ooms", [])) for d in s.get("devices", []))
            capture["snapshot_findings"] = kinds(s)
            # The demo for docs/: the snapshot explained in text, and its HTML report.
            v.sh([v.oomkit, "analyze", snaps[0]])
            v.sh([v.oomkit, "report", snaps[0], "-o", os.path.join(v.work, "oom-report.html")])
        v.sh([v.oomkit, "analyze", os.path.join(v.work, res["log"])])
    out["capture"] = capture
    # oomkit run steps the micro-batch down and keeps the effective batch.
    summary = os.path.join(v.work, "run-summary.json")
    if os.path.exists(summary):
        os.remove(summary)
    # What makes the script run out of memory above some micro-batch.
    script_flags = ["--size", "100m", "--memory-fraction", "0.25"] if v.cuda else ["--size", "tiny", "--oom-above", "16"]
    # A quick run on the CPU starts one step nearer the boundary: one restart is the whole path.
    start = "32" if v.args.quick and not v.cuda else "64"
    run = v.sh(
        [v.oomkit, "run", "--gpus", "0", "--batch-size", start, "--effective-batch", start, "--max-retries", "4",
         "--summary-json", summary, "--", sys.executable, os.path.join(EXAMPLES, "gpt_train.py"),
         "--device", v.args.device, "--steps", "3", "--tracker", "--log-dir", "logs-run"] + script_flags,
        timeout=400,
    )
    out["run"] = {"rc": run["rc"], "summary": _load(summary) if os.path.exists(summary) else None}
    # find-batch against a bisection over every micro-batch.
    # Quick runs start at 16 and search up to 18: three runs (16 fits, 18 and 17 do not) instead of
    # seven from 1 to 32, as the boundary is at 16 either way (test_auto_batch.py searches from 1).
    fb_cmd = [v.oomkit, "find-batch", "--json", *(["--start", "16", "--max", "18"] if v.args.quick else ["--max", "128"])]
    if not v.cuda:
        fb_cmd += ["--capacity", "64GiB"]
    fb = v.sh(
        fb_cmd + ["--", sys.executable, os.path.join(EXAMPLES, "gpt_train.py"), "--device", v.args.device,
                  "--steps", "2", "--tracker", "--log-dir", "logs-fb", "--batch", "{batch_size}"] + script_flags,
        timeout=400,
    )
    found = last_json_object(fb["stdout"]) if fb["rc"] == 0 else None
    out["find_batch"] = {"rc": fb["rc"], "recommended": found and found.get("recommended_batch"),
                         "runs": found and len(found.get("trials", [])), "method": found and found.get("method")}

    def fits(b: int) -> bool:
        r = v.example("gpt_train.py", ["--steps", "2", "--batch", str(b)] + script_flags)
        return r["rc"] == 0

    # The boundary find-batch drew, checked with real runs: its batch, and the next one up.
    rec = out["find_batch"]["recommended"]
    if rec:
        out["scan"] = {"recommended_fits": fits(rec), "next_fits": fits(rec + 1)}
    return out


def overhead(v: Validation) -> dict[str, Any]:
    flags = v.gpt_flags() + ["--bench", "--steps", "36" if v.args.quick else "120", "--log-dir", "logs-bench"]
    r = v.example("gpt_train.py", flags, timeout=400)
    return {"rc": r["rc"], "result": r["result"]}


def estimate(v: Validation) -> dict[str, Any]:
    rows = []
    sizes = ["tiny"] if v.args.quick else ["tiny", "small", "100m"]
    batches = [4, 8]
    for size in sizes:
        cfg = os.path.join(v.work, f"config-{size}.json")
        v.example("gpt_train.py", ["--size", size, "--config-out", cfg])
        seq = _load(cfg)["n_positions"]
        for b in batches:
            r = v.example("gpt_train.py", ["--size", size, "--batch", str(b), "--steps", "3"])
            dtype = "bf16" if v.cuda else "fp32"
            e = v.sh([v.oomkit, "estimate", "--json", "--config", cfg, "--batch", str(b), "--seq", str(seq),
                      "--dtype", dtype, "--optimizer", "adamw", "--gpu", "80GiB",
                      # The example's attention (nn.MultiheadAttention without weights) is fused: no s^2 scores kept.
                      "--flash-attention"])
            est = json.loads(e["stdout"]) if e["rc"] == 0 else {}
            measured = (r["result"] or {}).get("peak_bytes")
            # The allocator's peak excludes the CUDA context, which the estimate adds as overhead.
            predicted = est.get("total_bytes", 0) - est.get("overhead_bytes", 0) if est else None
            rows.append({"size": size, "batch": b, "seq": seq, "measured_peak_bytes": measured,
                         "estimated_bytes": predicted,
                         "error_percent": round(100 * (predicted - measured) / measured, 1) if predicted and measured else None,
                         "measured_on": "allocator peak" if v.cuda else "process RSS peak (includes Python and torch)"})
    return {"rows": rows}


def gpus(v: Validation) -> dict[str, Any]:
    mine = v.sh([v.oomkit, "gpus", "--json"])
    out: dict[str, Any] = {"oomkit_rc": mine["rc"], "oomkit_seconds": round(mine["seconds"], 3)}
    if mine["rc"] == 0:
        out["oomkit"] = json.loads(mine["stdout"])
    if shutil.which("nvidia-smi"):
        smi = v.sh(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,memory.free,utilization.gpu", "--format=csv,noheader,nounits"])
        out["nvidia_smi"] = smi["stdout"].strip().splitlines()
        out["nvidia_smi_seconds"] = round(smi["seconds"], 3)
    return out


def big(v: Validation) -> dict[str, Any]:
    if not v.cuda:
        return {"skipped": "recording allocation history needs CUDA"}
    snap = os.path.join(v.work, "big.pickle")
    steps = "6000"
    r = v.example("gpt_train.py", ["--size", "tiny", "--batch", "8", "--steps", steps, "--snapshot", snap, "--max-entries", "2000000"], timeout=400)
    out: dict[str, Any] = {"record_rc": r["rc"], "file_bytes": os.path.getsize(snap) if os.path.exists(snap) else None}
    if not os.path.exists(snap):
        return out
    t = v.sh([v.oomkit, "analyze", "--json", snap])
    out["oomkit_analyze_seconds"] = round(t["seconds"], 2)
    a = json.loads(t["stdout"]) if t["rc"] == 0 else {}
    out["events"] = sum(d.get("events", 0) for d in a.get("devices", []))
    start = time.monotonic()
    with open(snap, "rb") as f:
        pickle.load(f)
    out["pickle_load_seconds"] = round(time.monotonic() - start, 2)
    mv = v.sh([sys.executable, "-m", "torch.cuda._memory_viz", "stats", snap], timeout=400)
    out["memory_viz_stats_seconds"] = round(mv["seconds"], 2)
    out["memory_viz_rc"] = mv["rc"]
    return out


def _allocator_run(v: Validation, name: str, settings: str, capacity: int = 0, frames: bool = False) -> dict[str, Any]:
    """One recorded run of scripts/gpu_allocator_run.py: the allocator's own figures and the snapshot."""
    snap = os.path.join(v.work, f"alloc-{name}.pickle")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_allocator_run.py"), "--snapshot", snap]
    if v.args.quick:
        cmd += ["--size", "small", "--steps", "4"]
    if capacity:
        cmd += ["--capacity-bytes", str(capacity)]
    if frames:
        cmd.append("--frames")
    r = v.sh(cmd, env={"PYTORCH_CUDA_ALLOC_CONF": settings}, timeout=200)
    res = result_line(r["stdout"])
    if res is None:
        return {"name": name, "settings": settings, "rc": r["rc"], "error": r["stderr"][-500:]}
    res["name"] = name
    return res


def _whatif(v: Validation, snap: str, *flags: str) -> dict[str, Any]:
    r = v.sh([v.oomkit, "whatif", "--json", snap, *flags])
    if r["rc"] != 0:
        return {"error": r["stderr"].strip()[-300:]}
    data = json.loads(r["stdout"])
    (dev,) = data["devices"]
    return dev


def _scenario_row(s: dict[str, Any]) -> dict[str, Any]:
    return {"name": s["name"], "peak_reserved_bytes": s["peak_reserved_bytes"], "peak_allocated_bytes": s["peak_allocated_bytes"],
            "segments": len(s["segments"]), "ooms": s["ooms"][:3], "unfollowed": s["unfollowed"]}


def allocator(v: Validation) -> dict[str, Any]:
    """The allocator model against PyTorch's: each recorded run replayed, then predictions of other settings measured."""
    if not v.cuda:
        return {"skipped": "the real caching allocator needs CUDA"}
    settings = {"default": "", "expandable": "expandable_segments:True", "split128": "max_split_size_mb:128",
                "roundup4": "roundup_power2_divisions:4"}
    runs = {name: _allocator_run(v, name, conf, frames=name == "default") for name, conf in settings.items()}
    out: dict[str, Any] = {"runs": runs, "replays": {}, "predictions": []}
    # 1. Each run replayed as recorded: the model's segments and peaks against the allocator's.
    for name, run in runs.items():
        if "snapshot" not in run:
            continue
        dev = _whatif(v, run["snapshot"])
        if "error" in dev:
            out["replays"][name] = dev
            continue
        rec = dev["scenarios"][0]
        out["replays"][name] = {"agreement": dev["agreement"], "model": _scenario_row(rec),
                                "measured_peak_reserved_bytes": run["peak_reserved_bytes"],
                                "measured_peak_allocated_bytes": run["peak_allocated_bytes"],
                                "measured_segments": run["segments_allocated"], "events": dev["events"]}
    # 2. The default run's trace under the other settings, against those runs measured.
    base = runs["default"].get("snapshot")
    if base:
        for name, conf in settings.items():
            if not conf or "snapshot" not in runs[name]:
                continue
            dev = _whatif(v, base, "--alloc-conf", conf)
            if "error" in dev:
                out["predictions"].append({"settings": conf, **dev})
                continue
            s = dev["scenarios"][-1]
            out["predictions"].append({"settings": conf, "predicted": _scenario_row(s),
                                       "measured_peak_reserved_bytes": runs[name]["peak_reserved_bytes"],
                                       "measured_segments": runs[name]["segments_allocated"]})
    # 3. OOMs: a cap between the default run's peak allocated and its peak
    # reserved (fragmentation decides), and one below the peak allocated (an
    # OOM whatever the settings); each replayed, then whatif's prediction for
    # the other settings measured under the same cap.
    d = runs["default"]
    if "peak_allocated_bytes" in d:
        caps = {"between": (d["peak_allocated_bytes"] + d["peak_reserved_bytes"]) // 2, "below": int(d["peak_allocated_bytes"] * 0.9)}
        out["ooms"] = []
        for label, cap in caps.items():
            capped = _allocator_run(v, f"default-{label}", "", cap, frames=label == "between")
            row: dict[str, Any] = {"cap": label, "capacity_bytes": cap, "measured": {k: capped.get(k) for k in (
                "status", "oom_at_step", "peak_reserved_bytes", "peak_allocated_bytes", "alloc_retries", "ooms", "segments_allocated")}}
            if "snapshot" in capped:
                dev = _whatif(v, capped["snapshot"], "--capacity", str(cap), "--alloc-conf", "expandable_segments:True",
                              "--alloc-conf", "max_split_size_mb:128")
                if "error" not in dev:
                    row["agreement"] = dev["agreement"]
                    row["recorded_ooms"] = [s.get("recorded_ooms") for s in dev["scenarios"]][:1]
                    row["scenarios"] = [_scenario_row(s) | {"settings": s["settings"], "capacity_bytes": s["capacity_bytes"]}
                                        for s in dev["scenarios"]]
                else:
                    row["whatif_error"] = dev["error"]
                for conf in ("expandable_segments:True", "max_split_size_mb:128"):
                    m = _allocator_run(v, f"{conf.split(':')[0]}-{label}", conf, cap)
                    row.setdefault("measured_other", []).append({"settings": conf, **{k: m.get(k) for k in (
                        "status", "oom_at_step", "peak_reserved_bytes", "peak_allocated_bytes", "alloc_retries", "ooms")}})
            out["ooms"].append(row)
    return out


#: The cases of scripts/gpu_preflight_check.py that the preflight section measures.
PREFLIGHT_CASES = ("gpt-100m", "hf-gpt2-medium-bf16", "resnet50")

#: The one a quick run predicts.
QUICK_PREFLIGHT_CASES = ("gpt-100m",)


def preflight(v: Validation) -> dict[str, Any]:
    """oomkit.preflight's peaks and largest micro-batch beside the same steps measured (scripts/gpu_preflight_check.py)."""
    rows = []
    # Quick runs predict one case: the tests predict every case in full beside its GPU figures
    # (test_preflight_gpu_measured.py), so on CPU this section checks its own path once.
    for case in QUICK_PREFLIGHT_CASES if v.args.quick else PREFLIGHT_CASES:
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "gpu_preflight_check.py"), "--case", case]
        if not v.cuda:
            cmd.append("--predict-only")
        r = v.sh(cmd, timeout=240)
        res = result_line(r["stdout"])
        rows.append(res if res is not None else {"case": case, "rc": r["rc"], "error": r["stderr"][-800:]})
    return {"cases": rows}


#: The unchanged scripts `oomkit preflight` is run on and measured against: name, script, arguments, under torchrun.
SCRIPT_CASES = (
    ("train.py b4", "preflight/train.py", ["--batch-size", "4", "--steps", "2"], False),
    ("train.py b12", "preflight/train.py", ["--batch-size", "12", "--steps", "2"], False),
    ("fsdp_train.py", "preflight/fsdp_train.py", ["--steps", "2"], True),
    # A torch.compile'd step (inductor modelled) and generation to its bound, with each kind of cache.
    ("compiled.py b8", "preflight/compiled.py", ["--batch-size", "8", "--steps", "2"], False),
    ("generate.py dynamic", "preflight/generate.py", ["--max-new-tokens", "256"], False),
    ("generate.py static", "preflight/generate.py", ["--max-new-tokens", "256", "--cache", "static"], False),
    # A latent diffusion pipeline's image decoder at 1024 x 1024 (convolutions' workspaces, a 512-wide attention head).
    ("decode.py 1024", "preflight/decode.py", ["--size", "1024"], False),
)

#: The same scripts, small, where nothing is measured (CPU).
QUICK_SCRIPT_ARGS = {"preflight/train.py": ["--ctx", "256", "--dim", "128", "--heads", "4", "--layers", "2"],
                     "preflight/fsdp_train.py": ["--seq", "256", "--dim", "128", "--layers", "2"],
                     "preflight/compiled.py": ["--ctx", "256", "--layers", "2"],
                     "preflight/generate.py": ["--layers", "2", "--prompt", "16", "--max-new-tokens", "8"],
                     "preflight/decode.py": ["--size", "64"]}


def _predicted_into(row: dict[str, Any], pred: dict[str, Any]) -> None:
    """`oomkit preflight --json`'s peaks (or its error) into a row."""
    row["preflight_rc"] = pred["rc"]
    if pred["rc"] in (0, 5):
        run = json.loads(pred["stdout"])["run"]
        row.update(predicted_allocated_bytes=run["peak_allocated_bytes"], predicted_reserved_bytes=run["peak_reserved_bytes"])
    else:
        row["preflight_error"] = pred["stderr"][-800:]


def _measured_into(row: dict[str, Any], m: dict[str, Any]) -> None:
    """scripts/measure_script.py's peaks on the GPU (or its error) into a row, with each prediction's error against them."""
    got = result_line(m["stdout"])
    row["measured_rc"] = m["rc"]
    if got is None:
        row["measured_error"] = m["stderr"][-800:]
        return
    # A run that failed still gives its peaks up to the failure; its exit code and "oom" say how it ended.
    row.update(measured_allocated_bytes=got["peak_allocated_bytes"], measured_reserved_bytes=got["peak_reserved_bytes"], device=got["device"],
               measured_oom=got["oom"])
    for kind in ("allocated", "reserved"):
        predicted = row.get(f"predicted_{kind}_bytes")
        if predicted:
            row[f"{kind}_error"] = round(predicted / got[f"peak_{kind}_bytes"] - 1, 4)


def scripts(v: Validation) -> dict[str, Any]:
    """`oomkit preflight -- python SCRIPT` (the CLI, autocast and all) beside the same unchanged script run on the GPU."""
    rows = []
    for name, script, flags, torchrun in SCRIPT_CASES:
        path = os.path.join(EXAMPLES, script)
        args = flags + (QUICK_SCRIPT_ARGS[script] if v.args.quick else [])
        row: dict[str, Any] = {"case": name, "command": " ".join([script, *args])}
        _predicted_into(row, v.sh([v.oomkit, "preflight", "--json", "--", sys.executable, path, *args], timeout=180))
        if v.cuda:
            measure = [os.path.join(ROOT, "scripts", "measure_script.py"), path, *args]
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if torchrun else [sys.executable]
            _measured_into(row, v.sh(launcher + measure, timeout=240))
        rows.append(row)
    return {"cases": rows}


def boundary(v: Validation) -> dict[str, Any]:
    """`oomkit preflight --search ctx=LO..HI`'s longest context that fits a capacity, and the
    next one it tried, each run for real on the GPU capped at that capacity: the first must fit,
    the second must run out."""
    script = os.path.join(EXAMPLES, "preflight", "train.py")
    if v.cuda and not v.args.quick:
        capacity, span, flags = "24GiB", "ctx=256..8192", ["--batch-size", "8", "--steps", "2"]
    else:
        capacity, span, flags = "1GiB", "ctx=64..4096", ["--batch-size", "8", "--steps", "2", "--dim", "128", "--heads", "4", "--layers", "2"]
    pred = v.sh([v.oomkit, "preflight", "--json", "--capacity", capacity, "--search", span, "--", sys.executable, script, *flags,
                 "--ctx", "{ctx}"], timeout=600)  # fmt: skip
    if pred["rc"] not in (0, 5):
        return {"error": "the search failed", "stderr": pred["stderr"][-800:]}
    doc = json.loads(pred["stdout"])
    largest, tried = doc["largest"], doc["tried"]
    above = sorted(value for value, fits in tried if not fits and (largest is None or value > largest))
    out: dict[str, Any] = {"capacity": capacity, "search": span, "largest": largest, "tried": tried, "rows": []}
    if largest is None or not above or not v.cuda:
        return out
    # The search's own answer says what the allocator may hold at that capacity.
    share = doc["run"]["capacity_bytes"] / v.gpu_total_bytes()
    for ctx, expect in ((largest, "fits"), (above[0], "runs out")):
        m = v.sh([sys.executable, os.path.join(ROOT, "scripts", "measure_script.py"), "--memory-fraction", f"{share:.6f}", script, *flags,
                  "--ctx", str(ctx)], timeout=300)  # fmt: skip
        got = result_line(m["stdout"]) or {}
        row = {"ctx": ctx, "expected": expect, "rc": m["rc"], "oom": got.get("oom"), "measured_reserved_bytes": got.get("peak_reserved_bytes")}
        row["right"] = (m["rc"] == 0) if expect == "fits" else bool(got.get("oom"))
        out["rows"].append(row)
    return out


#: The fixes measured against a GPU: preflight's row, and the flag of examples/preflight/blocks.py that makes the same change by hand.
FIXES_BY_HAND = {
    "activation checkpointing of the model's repeated blocks": "--checkpoint",
    "8-bit AdamW (bitsandbytes) for torch.optim.AdamW": "--adam8",
}


def fixes(v: Validation) -> dict[str, Any]:
    """Two of preflight's "what would make it fit" rows (checkpointing, 8-bit AdamW) beside the
    script changed by hand run for real: each row's peaks against the GPU's."""
    script = os.path.join(EXAMPLES, "preflight", "blocks.py")
    batch = "64" if v.cuda and not v.args.quick else "8"
    pred = v.sh([v.oomkit, "preflight", "--json", "--fixes", "--capacity", "H100", "--", sys.executable, script, "--batch", batch], timeout=600)
    if pred["rc"] not in (0, 5):
        return {"error": "preflight failed", "stderr": pred["stderr"][-800:]}
    doc = json.loads(pred["stdout"])
    rows_by_change = {row["change"]: row for row in doc.get("fixes", [])}
    out: dict[str, Any] = {"batch": int(batch), "fix_notes": doc.get("fix_notes", []), "rows": []}
    for change, flag in FIXES_BY_HAND.items():
        row: dict[str, Any] = {"change": change, "flag": flag}
        fix = rows_by_change.get(change)
        if fix is None:
            row["not_measured"] = next((n for n in doc.get("fix_notes", []) if n.startswith(change)), "no row")
            out["rows"].append(row)
            continue
        row.update(predicted_allocated_bytes=fix["peak_allocated_bytes"], predicted_reserved_bytes=fix["peak_reserved_bytes"])
        if v.cuda:
            m = v.sh([sys.executable, os.path.join(ROOT, "scripts", "measure_script.py"), script, "--batch", batch, flag], timeout=300)
            got = result_line(m["stdout"])
            row["measured_rc"] = m["rc"]
            if got is not None:
                for kind in ("allocated", "reserved"):
                    row[f"measured_{kind}_bytes"] = got[f"peak_{kind}_bytes"]
                    row[f"{kind}_error"] = round(row[f"predicted_{kind}_bytes"] / got[f"peak_{kind}_bytes"] - 1, 4)
            else:
                row["measured_error"] = m["stderr"][-800:]
        out["rows"].append(row)
    return out


def _scenarios(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`oomkit whatif --json`'s scenarios of the first device, by name."""
    return {sc["name"]: sc for sc in doc["devices"][0]["scenarios"]}


def warm(v: Validation) -> dict[str, Any]:
    """`oomkit whatif` on a trace recorded after warm-up steps, beside the same run measured under
    two capacities (below its peak allocated; between allocated and reserved) and at half the micro-batch."""
    if not v.cuda:
        return {"skipped": "a trace needs CUDA: whatif's answers are checked against the allocator itself"}
    flags = v.gpt_flags()
    steps = ["--steps", "6"]
    rec = v.example("gpt_train.py", flags + steps + ["--record-after", "3", "--snapshot", "warm.pickle"])
    if rec["rc"] != 0 or not rec["result"]:
        return {"error": "the recording failed", "stderr": rec["stderr"][-800:]}
    trace = os.path.join(v.work, "warm.pickle")
    total = v.gpu_total_bytes()
    base = v.sh([v.oomkit, "whatif", "--json", trace])
    if base["rc"] != 0:
        return {"error": "whatif failed on the recording", "stderr": base["stderr"][-800:]}
    recorded = _scenarios(json.loads(base["stdout"]))["as recorded"]
    allocated, reserved = recorded["peak_allocated_bytes"], recorded["peak_reserved_bytes"]
    below, between = int(allocated * 0.9), (allocated + reserved) // 2
    asked = v.sh([v.oomkit, "whatif", "--json", trace, "--capacity", str(below), "--capacity", str(between), "--batch-scale", "0.5"])
    if asked["rc"] != 0:
        return {"error": "whatif failed on the scenarios", "stderr": asked["stderr"][-800:]}
    predicted = list(_scenarios(json.loads(asked["stdout"])).values())[-3:]
    rows = []
    micro = int(flags[flags.index("--batch") + 1])
    runs = [
        ("capacity below the peak allocated", predicted[0], flags + ["--memory-fraction", f"{below / total:.6f}"]),
        ("capacity between allocated and reserved", predicted[1], flags + ["--memory-fraction", f"{between / total:.6f}"]),
        ("half the micro-batch", predicted[2], [f if f != str(micro) else str(micro // 2) for f in flags]),
    ]
    for name, scenario, run_flags in runs:
        r = v.example("gpt_train.py", run_flags + steps)
        got = r["result"] or {}
        row = {
            "case": name,
            "scenario": scenario["name"],
            "predicted_oom": bool(scenario["ooms"]),
            "predicted_reserved_bytes": scenario["peak_reserved_bytes"],
            "measured_oom": got.get("status") == "oom",
            "measured_reserved_bytes": got.get("peak_reserved_bytes"),
            "rc": r["rc"],
        }
        row["oom_right"] = row["predicted_oom"] == row["measured_oom"]
        if not row["measured_oom"] and row["measured_reserved_bytes"]:
            row["reserved_error"] = round(row["predicted_reserved_bytes"] / row["measured_reserved_bytes"] - 1, 4)
        rows.append(row)
    return {"trace": {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, "total_bytes": total}, "rows": rows}


#: What names cuBLAS's workspace in a snapshot's C++ frames (CublasHandlePool.cpp).
CUBLAS_FRAMES = ("getCurrentCUDABlasHandle", "CublasHandlePool", "getCUDABlasLtWorkspace", "cublasWorkspace")


def workspaces(v: Validation) -> dict[str, Any]:
    """The cuBLAS workspaces a training step holds, read from a snapshot of this GPU (preflight adds one per
    thread that multiplies matrices: the forward's and autograd's backward thread's)."""
    if not v.cuda:
        return {"skipped": "a snapshot needs CUDA"}
    r = v.example("gpt_train.py", v.gpt_flags() + ["--steps", "2", "--snapshot", "workspaces.pickle"])
    path = os.path.join(v.work, "workspaces.pickle")
    if r["rc"] != 0 or not os.path.exists(path):
        return {"error": "the recording failed", "stderr": r["stderr"][-800:]}
    with open(path, "rb") as f:
        snap = pickle.load(f)  # our own recording, made just now
    found = []
    for seg in snap.get("segments", []):
        for block in seg.get("blocks", []):
            names = " ".join(str(fr.get("name", "")) for fr in block.get("frames", []))
            if block.get("state") == "active_allocated" and any(k in names for k in CUBLAS_FRAMES):
                found.append(block["size"])
    probe = v.sh([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"])
    return {"gpu": probe["stdout"].strip(), "workspace_sizes": found, "count": len(found)}


#: A convolutional network's training step in fp32 and under autocast to fp16 and to bf16 (scripts/gpu_preflight_check.py's cases).
AMP_CASES = ("resnet50", "resnet50-fp16", "resnet50-bf16")


def amp(v: Validation) -> dict[str, Any]:
    """Mixed precision on a convolutional network: preflight's peaks for ResNet-50's step in fp32 and
    under autocast (fp16, bf16) beside the same steps measured; mixed precision must hold less."""
    check = [sys.executable, os.path.join(ROOT, "scripts", "gpu_preflight_check.py"), "--no-search"]
    # On the GPU a process for each case (each measures its own model); predictions alone share one.
    runs = [["--case", case] for case in AMP_CASES] if v.cuda else [["--case", ",".join(AMP_CASES), "--predict-only", "--batches", "4"]]
    found: dict[str, dict[str, Any]] = {}
    for flags in runs:
        r = v.sh(check + flags, timeout=300)
        found.update((res["case"], res) for res in result_lines(r["stdout"]))
        for case in flags[1].split(","):
            found.setdefault(case, {"case": case, "rc": r["rc"], "error": r["stderr"][-800:]})
    rows = [found[case] for case in AMP_CASES]
    out: dict[str, Any] = {"cases": rows}
    if all("rows" in row for row in rows):
        fp32, *mixed = rows
        for side in ("predicted", "measured"):
            pairs = [(m[side], f[side]) for row in mixed for m, f in zip(row["rows"], fp32["rows"]) if side in m and side in f]
            if pairs and all(a.get("fits") and b.get("fits") for a, b in pairs):
                out[f"{side}_mixed_below_fp32"] = all(a["peak_allocated_bytes"] < b["peak_allocated_bytes"] for a, b in pairs)
    return out


#: The capacity build-nanogpt's script is asked about: an 80 GB GPU, as its author trained it on.
NANOGPT_CAPACITY = "H100"

#: The URLs tiktoken reads GPT-2's BPE from (its cache names each file by the SHA-1 of its URL).
GPT2_BPE_URLS = {name: f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}" for name in ("vocab.bpe", "encoder.json")}


def nanogpt_standins(src: str, folder: str, tokens: int) -> dict[str, str]:
    """build-nanogpt's two scripts copied from ``src`` into ``folder`` beside stand-ins for what they read
    (token shards of ``tokens`` random tokens, a few made-up HellaSwag examples, tiktoken's cache of
    GPT-2's BPE from ``src``); returns the environment the scripts need."""
    import numpy as np

    os.makedirs(os.path.join(folder, "edu_fineweb10B"), exist_ok=True)
    for name in ("train_gpt2.py", "hellaswag.py"):
        shutil.copy(os.path.join(src, name), folder)
    rng = np.random.default_rng(0)
    # The names fineweb.py writes; GPT-2's tokens fit in uint16, as there.
    for shard in ("edufineweb_val_000000.npy", "edufineweb_train_000001.npy"):
        np.save(os.path.join(folder, "edu_fineweb10B", shard), rng.integers(0, 50257, tokens, dtype=np.uint16))
    # Its step-0 eval reads HellaSwag's validation set: 16 examples of the same form (4 rows of under
    # 100 tokens each, far below the step's 64 x 1024) keep it short; the real set has 10,042.
    os.makedirs(os.path.join(folder, "hellaswag"), exist_ok=True)
    words = ["a", "the", "person", "dog", "boat", "kitchen", "slowly", "then", "turns", "walks", "holds", "pours", "water", "into", "onto", "table"]
    with open(os.path.join(folder, "hellaswag", "hellaswag_val.jsonl"), "w", encoding="utf-8") as f:
        for i in range(16):
            pick = [words[(i * 7 + k * 3) % len(words)] for k in range(60)]
            f.write(json.dumps({"ctx": " ".join(pick[:30]), "label": i % 4, "endings": [" ".join(pick[30 + 7 * e :][:12]) for e in range(4)]}) + "\n")
    cache = os.path.join(folder, "tiktoken-cache")
    os.makedirs(cache, exist_ok=True)
    for name, url in GPT2_BPE_URLS.items():
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
    return {"TIKTOKEN_CACHE_DIR": cache}


def nanogpt(v: Validation) -> dict[str, Any]:
    """build-nanogpt's train_gpt2.py, unchanged, at its defaults (micro-batch 64 x 1024 tokens, bf16 autocast,
    8 micro-batches a step): preflight's answer for an 80 GB GPU beside its first two optimizer steps
    run on the GPU capped at the same capacity."""
    src = v.args.nanogpt
    if not src or not os.path.isfile(os.path.join(src, "train_gpt2.py")):
        return {"skipped": "no build-nanogpt folder: --nanogpt DIR (scripts/nanogpt_inputs.sh makes one)"}
    folder = os.path.join(v.work, "nanogpt")
    # Two steps of 8 micro-batches, then the 20 of the step-0 evaluation, from one shard each.
    env = nanogpt_standins(src, folder, 21 * 64 * 1024 + 1)
    pred = v.sh([v.oomkit, "preflight", "--json", "--no-fixes", "--capacity", NANOGPT_CAPACITY, "--", sys.executable, "train_gpt2.py"],
                timeout=400, env=env, cwd=folder)  # fmt: skip
    if pred["rc"] not in (0, 5):
        return {"error": "preflight failed", "stderr": pred["stderr"][-800:]}
    doc = json.loads(pred["stdout"])
    run = doc["run"]
    out: dict[str, Any] = {"capacity": NANOGPT_CAPACITY, "capacity_bytes": run["capacity_bytes"], "predicted_fits": run["fits"],
                           "predicted_allocated_bytes": run["peak_allocated_bytes"], "predicted_reserved_bytes": run["peak_reserved_bytes"]}
    if not v.cuda:
        return out
    share = run["capacity_bytes"] / v.gpu_total_bytes()
    m = v.sh([sys.executable, os.path.join(ROOT, "scripts", "measure_script.py"), "--memory-fraction", f"{share:.6f}", "--steps", "2",
              "train_gpt2.py"], timeout=400, env=env, cwd=folder)  # fmt: skip
    got = result_line(m["stdout"])
    out["measured_rc"] = m["rc"]
    if got is None:
        out["measured_error"] = m["stderr"][-800:]
        return out
    out.update(measured_fits=not got["oom"] and m["rc"] == 0, measured_allocated_bytes=got["peak_allocated_bytes"],
               measured_reserved_bytes=got["peak_reserved_bytes"], device=got["device"])
    out["fits_right"] = out["measured_fits"] == out["predicted_fits"]
    if out["measured_fits"]:
        for kind in ("allocated", "reserved"):
            out[f"{kind}_error"] = round(out[f"predicted_{kind}_bytes"] / out[f"measured_{kind}_bytes"] - 1, 4)
    return out


#: The fine-tunes run from a config alone: name and examples/preflight/finetune.py's flags.
CONFIG_MODES: tuple[tuple[str, list[str]], ...] = (("full", []), ("LoRA r16", ["--lora", "16"]), ("QLoRA r16", ["--lora", "16", "--4bit"]))

#: A quick run's model: the 1B config at a few hundredths of its size, the same architecture.
QUICK_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "num_hidden_layers": 2, "vocab_size": 512}

#: Writes random weights in the config's dtype beside it, as a downloaded folder would hold them: config folder, weights folder.
WRITE_RANDOM_WEIGHTS = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16).save_pretrained(sys.argv[2])
"""


def config(v: Validation) -> dict[str, Any]:
    """A Llama-shaped model of about 1.2 B fine-tuned by examples/preflight/finetune.py (full, LoRA, QLoRA):
    preflight from a folder holding only its config, beside the same script on the GPU loading random
    weights written beside the same config."""
    with open(os.path.join(EXAMPLES, "preflight", "llama_1b", "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    quick = v.args.quick
    if quick:
        cfg.update(QUICK_CONFIG)
    cfg_dir, weights_dir = os.path.join(v.work, "llama-config"), os.path.join(v.work, "llama-weights")
    os.makedirs(cfg_dir, exist_ok=True)
    with open(os.path.join(cfg_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    seq = "64" if quick else "2048"
    script = os.path.join(EXAMPLES, "preflight", "finetune.py")
    rows: list[dict[str, Any]] = []
    written: Optional[dict[str, Any]] = None
    for name, flags in CONFIG_MODES:
        args = ["--seq", seq, "--steps", "2", *flags]
        row: dict[str, Any] = {"case": name, "command": " ".join(["finetune.py", *args])}
        if "--4bit" in flags and importlib.util.find_spec("bitsandbytes") is None:
            row["skipped"] = "bitsandbytes is not installed"
            rows.append(row)
            continue
        _predicted_into(row, v.sh([v.oomkit, "preflight", "--json", "--no-fixes", "--", sys.executable, script, "--model", cfg_dir, *args],
                                  timeout=300))  # fmt: skip
        if v.cuda:
            if written is None:
                written = v.sh([sys.executable, "-c", WRITE_RANDOM_WEIGHTS, cfg_dir, weights_dir], timeout=300)
                if written["rc"] != 0:
                    return {"error": "the random weights could not be written", "stderr": written["stderr"][-800:]}
            _measured_into(row, v.sh([sys.executable, os.path.join(ROOT, "scripts", "measure_script.py"), script, "--model", weights_dir, *args],
                                     timeout=300))  # fmt: skip
        rows.append(row)
    return {"model": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}, "seq": int(seq), "rows": rows}


def draft(v: Validation) -> str:
    """The tables for VALIDATION.md."""
    s = v.results["sections"]
    lines = [f"# Validation draft ({v.args.device}{', quick' if v.args.quick else ''})", ""]
    p = s.get("planted", {})
    if p.get("rows"):
        lines += ["## Planted bugs", "", "| case | expected | run-log findings | snapshot findings | named |", "|---|---|---|---|---|"]
        for row in p["rows"]:
            named = {True: "yes", False: "**no**", None: "-"}[row.get("named")]
            lines.append(f"| {row['case']} | {', '.join(row.get('expected', [])) or '(none)'} | "
                         f"{', '.join(row.get('log_findings') or []) or '-'} | {', '.join(row.get('snapshot_findings') or []) or '-'} | {named} |")
        lines.append("")
    for name in ("amp", "nanogpt", "config", "allocator", "preflight", "scripts", "boundary", "fixes", "warm", "workspaces", "oom", "overhead",
                 "estimate", "gpus", "big"):
        if name in s:
            lines += [f"## {name}", "", "```json", json.dumps({k: val for k, val in s[name].items() if k != "traceback"}, indent=1, default=str)[:6000], "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default="validation-out")
    ap.add_argument("--work", default=None, help="the working folder (default: OUT/work), removed once packed")
    ap.add_argument("--quick", action="store_true", help="small sizes (for CPU and CI)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for all sections")
    ap.add_argument("--only", default=None, help="comma-separated sections to run")
    ap.add_argument("--nanogpt", default=os.path.join(ROOT, ".gpu-inputs", "build-nanogpt"),
                    help="a folder with build-nanogpt's train_gpt2.py and hellaswag.py and GPT-2's vocab.bpe and encoder.json "
                    "(scripts/nanogpt_inputs.sh)")
    args = ap.parse_args()
    v = Validation(args)
    if not v.oomkit:
        sys.exit("gpu_validate: the oomkit command is not on PATH: pip install the oomkit wheel first")
    plan = [("amp", 60, amp), ("nanogpt", 120, nanogpt), ("config", 120, config), ("allocator", 90, allocator), ("preflight", 60, preflight),
            ("scripts", 180, scripts), ("boundary", 90, boundary), ("fixes", 60, fixes), ("warm", 90, warm), ("workspaces", 20, workspaces),
            ("oom", 60, oom), ("overhead", 20, overhead), ("gpus", 5, gpus), ("planted", 60, planted), ("estimate", 30, estimate), ("big", 120, big)]
    only = set(args.only.split(",")) if args.only else None
    for name, est, fn in plan:
        if only is None or name in only:
            v.section(name, est if v.cuda else est / 3, functools.partial(fn, v))
    v.results["total_seconds"] = round(time.monotonic() - v.t0, 1)
    v.save()
    with open(os.path.join(v.out, "VALIDATION-draft.md"), "w", encoding="utf-8") as f:
        f.write(draft(v))
    v.pack()
    shutil.rmtree(v.work)
    print(json.dumps({k: {"status": d.get("status"), "seconds": d.get("seconds")} for k, d in v.results["sections"].items()}))


if __name__ == "__main__":
    main()
