"""The plain PyTorch training loop of the example scripts, with bugs that can be planted on request.

`gpt_train.py` and `cnn_train.py` give it a model, batches and a loss; this
module owns the flags every example shares, the loop, the planted bugs,
oomkit's tracker, a snapshot recording, and the one JSON line a run ends
with. Planted bugs (each is a mistake found in real training scripts):

- ``--leak``: keeps every step's model output on the device, for a metric
  at the end of the epoch (a loss kept with its graph, the other classic,
  holds almost nothing on a GPU once backward has freed what the graph saved);
- ``--stale-copy``: keeps the model as it was built (fp32) beside the copy
  that trains (bf16 on CUDA, a second fp32 copy on CPU);
- ``--eval-keeps-outputs``: the eval phase runs with autograd on and keeps
  every batch's output on the device;
- ``--ema-on-device``: keeps an EMA copy of the weights on the device.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from planted import huge

BUGS = ("leak", "stale_copy", "eval_keeps_outputs", "ema_on_device")


def arguments(description: str, sizes: List[str], default_size: str) -> argparse.ArgumentParser:
    """The flags every example shares."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when there is one)")
    ap.add_argument("--size", choices=sizes, default=default_size, help="model size")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (default: $OOMKIT_MICRO_BATCH or 8)")
    ap.add_argument("--grad-accum", type=int, default=None, help="gradient accumulation (default: $OOMKIT_GRAD_ACCUM or 1)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--eval-every", type=int, default=0, help="an eval phase every N steps (0: none)")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--tracker", action="store_true", help="record an oomkit run log")
    ap.add_argument("--log-dir", default="oomkit-logs")
    ap.add_argument("--record-history", action="store_true", help="CUDA: the tracker records allocation history and dumps a snapshot at an OOM")
    ap.add_argument("--snapshot", default=None, help="CUDA: record allocation history and dump a snapshot here at the end (or at an OOM)")
    ap.add_argument("--record-after", type=int, default=0, help="with --snapshot: start recording after this many steps (a warm cache)")
    ap.add_argument("--max-entries", type=int, default=1_000_000)
    ap.add_argument("--memory-fraction", type=float, default=None, help="CUDA: cap this process's memory (a real OOM when it is exceeded)")
    ap.add_argument("--oom-above", type=int, default=0, help="a real allocator failure when the micro-batch is larger than this")
    ap.add_argument("--bench", action="store_true", help="time steps with and without the tracker, alternating blocks")
    for bug in BUGS:
        ap.add_argument("--" + bug.replace("_", "-"), action="store_true", help="plant this bug")
    return ap


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip().isdigit() else None


def device_of(args: argparse.Namespace) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def dtype_of(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run(
    args: argparse.Namespace,
    build: Callable[[torch.device, torch.dtype], torch.nn.Module],
    batches: Callable[[int, torch.device], Iterator[Any]],
    loss_of: Callable[[torch.nn.Module, Any], torch.Tensor],
    describe: Dict[str, Any],
) -> Dict[str, Any]:
    """Trains, with the bugs and instruments the flags ask for, and prints one JSON line of results."""
    device = device_of(args)
    dtype = dtype_of(args, device)
    micro = args.batch or _env_int("OOMKIT_MICRO_BATCH") or 8
    accum = args.grad_accum or _env_int("OOMKIT_GRAD_ACCUM") or 1
    if device.type == "cuda" and args.memory_fraction:
        # It takes a device with an index ("cuda" alone is refused).
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, torch.cuda.current_device())
    if device.type == "cuda" and args.snapshot and not args.record_after:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
    torch.manual_seed(0)
    built = build(device, torch.float32)
    keep: Dict[str, Any] = {}
    if args.stale_copy:
        # The fp32 model as built stays referenced; training runs on a copy.
        keep["model32"] = built
        model = copy.deepcopy(built).to(dtype)
    else:
        model = built.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ema = None
    if args.ema_on_device:
        ema = copy.deepcopy(model).requires_grad_(False)
    import oomkit

    tracker = None
    if args.tracker or args.record_history:
        tracker = oomkit.Tracker(
            model, optimizer=opt, ema=ema, log_dir=args.log_dir,
            record_history=args.record_history and device.type == "cuda", max_entries=args.max_entries,
        )
    if args.oom_above and micro > args.oom_above:
        # Registered after the tracker's hooks, so the forward stage has begun
        # when the allocation fails, as it would inside a real forward.
        model.register_forward_pre_hook(lambda module, inputs: huge())
    kept_preds: List[torch.Tensor] = []
    if args.leak:
        # the bug: every step's predictions stay on the device until the epoch ends
        model.register_forward_hook(lambda module, inputs, output: kept_preds.append(output.detach()) if module.training else None)
    kept_outputs: List[torch.Tensor] = []
    data = batches(micro, device)
    times: List[float] = []

    def one_step(i: int) -> None:
        for _ in range(accum):
            batch = next(data)
            loss = loss_of(model, batch) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.01)

    def evaluate() -> None:
        model.eval()
        grad = torch.enable_grad() if args.eval_keeps_outputs else torch.no_grad()
        with grad:
            for _ in range(args.eval_batches):
                out = loss_of(model, next(data))
                if args.eval_keeps_outputs:
                    kept_outputs.append(out)  # the bug: outputs with their graphs stay on the device
        model.train()

    result: Dict[str, Any] = {"example": describe, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
                              "micro_batch": micro, "grad_accum": accum, "bugs": [b for b in BUGS if getattr(args, b)]}
    result["params"] = sum(p.numel() for p in model.parameters())
    status = "ok"
    try:
        if args.bench:
            result.update(_bench(args, model, one_step, device))
        else:
            for i in range(args.steps):
                if device.type == "cuda" and args.snapshot and args.record_after and i == args.record_after:
                    # After warm-up steps, as most recordings are made: the trace begins with the cache full.
                    torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
                _sync(device)
                t = time.perf_counter()
                if tracker is not None:
                    with tracker.step(i):
                        one_step(i)
                else:
                    one_step(i)
                _sync(device)
                times.append(time.perf_counter() - t)
                if args.eval_every and (i + 1) % args.eval_every == 0:
                    if tracker is not None:
                        with tracker.phase("eval"):
                            evaluate()
                    else:
                        evaluate()
    except Exception as exc:  # noqa: BLE001 - reported in the result line, then re-raised
        status = "oom" if oomkit.is_oom(exc) else "error"
        # The type only: the message is in the traceback on stderr, and a
        # second copy here would be the first OOM line `oomkit run` reads.
        result["error"] = type(exc).__name__
        raise
    finally:
        result["status"] = status
        result["steps_done"] = len(times)
        result["step_ms_median"] = statistics.median(times) * 1e3 if times else None
        result["peak_bytes"] = _peak(device)
        if device.type == "cuda":
            result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        if tracker is not None:
            tracker.close()
            result["log"] = tracker.log_path
            if device.type == "cuda":
                # The tracker resets the allocator's peak at every stage: its log has the run's peak.
                result["peak_bytes"] = oomkit.analyze(tracker.log_path)["peak_bytes"]
        if device.type == "cuda" and args.snapshot:
            torch.cuda.memory._dump_snapshot(args.snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            result["snapshot"] = args.snapshot
        print("RESULT " + json.dumps(result), flush=True)
    return result


def _bench(args: argparse.Namespace, model: torch.nn.Module, one_step: Callable[[int], None], device: torch.device) -> Dict[str, Any]:
    """Step times with and without the tracker in alternating blocks, and the device memory the tracker adds."""
    import oomkit

    blocks, per = 6, max(1, args.steps // 6)
    for i in range(3):
        one_step(i)
    _sync(device)
    plain: List[float] = []
    tracked: List[float] = []
    tracker = oomkit.Tracker(model, log_dir=args.log_dir, check_duplicates=False)
    tracker.close()  # hooks off; built once so that its import and set-up are not timed
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    tracker = oomkit.Tracker(model, log_dir=args.log_dir, check_duplicates=False)
    added = (torch.cuda.memory_allocated(device) - before) if before is not None else None
    j = 0
    for _ in range(blocks):
        for _ in range(per):
            _sync(device)
            t = time.perf_counter()
            one_step(j)
            _sync(device)
            plain.append(time.perf_counter() - t)
            j += 1
        for _ in range(per):
            _sync(device)
            t = time.perf_counter()
            with tracker.step(j):
                one_step(j)
            _sync(device)
            tracked.append(time.perf_counter() - t)
            j += 1
    tracker.close()
    a, b = statistics.median(plain), statistics.median(tracked)
    return {
        "bench_steps_each": len(plain),
        "plain_ms": a * 1e3,
        "tracked_ms": b * 1e3,
        "overhead_percent": 100 * (b - a) / a,
        "tracker_device_bytes": added,
        "bench_log": tracker.log_path,
    }
