"""oomkit.preflight's prediction beside the same step measured on the GPU, for one model.

    python scripts/gpu_preflight_check.py --case gpt-100m              # on the GPU machine
    python scripts/gpu_preflight_check.py --case resnet50 --predict-only  # the predictions alone, on CPU
    python scripts/gpu_preflight_check.py --case resnet50-bf16 --no-search --batches 64  # under autocast, no search

For each micro-batch of the case, preflight runs the step on tensors
without memory and says its peak allocated and reserved; then (unless
``--predict-only``) the model is built on the GPU and the very same step
(same loss, optimizer and autocast, the same number of steps) runs there,
with ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()``
read after it. Last, the largest micro-batch that fits ``--capacity``:
preflight's search beside a bisection of real steps under
``set_per_process_memory_fraction`` (the same limit on what the allocator
holds). Prints one line ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import oomkit

GIB = 1 << 30
#: Steps per measurement, for preflight and the GPU alike (the optimizer's state appears in the first).
STEPS = 2


class Case:
    """A model, a batch of any micro-batch, a loss, an optimizer and the autocast dtype."""

    def __init__(self, build: Callable[[], nn.Module], batch: Callable[[int], Any], loss: Callable[[nn.Module, Any], torch.Tensor],
                 optimizer: Callable[[Any], torch.optim.Optimizer], autocast: torch.dtype | None, batches: tuple[int, int],
                 search_max: int) -> None:
        self.build, self.batch, self.loss, self.optimizer, self.autocast = build, batch, loss, optimizer, autocast
        self.batches, self.search_max = batches, search_max


def gpt_100m() -> Case:
    from gpt_train import GPT, SIZES

    layers, dim, heads, vocab, ctx = SIZES["100m"]

    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return Case(lambda: GPT(layers, dim, heads, vocab, ctx), lambda n: torch.randint(0, vocab, (n, ctx + 1), device="cuda"), loss,
                lambda params: torch.optim.AdamW(params, lr=1e-4), None, (4, 8), 64)


def hf_gpt2_medium() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257)
    config._attn_implementation = "sdpa"
    seq = 1024

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (n, seq), device="cuda")
        return {"input_ids": ids, "labels": ids}

    return Case(lambda: GPT2LMHeadModel(config), batch, lambda m, b: m(**b).loss, lambda params: torch.optim.AdamW(params, lr=1e-4),
                torch.bfloat16, (2, 4), 64)


def resnet50() -> Case:
    import torchvision

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (n,), device="cuda")

    return Case(torchvision.models.resnet50, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), None, (32, 64), 1024)


def under_autocast(build: Callable[[], Case], dtype: torch.dtype) -> Callable[[], Case]:
    """The same case, its loss under ``torch.autocast`` to ``dtype`` (mixed precision, as a training script sets it)."""

    def case() -> Case:
        c = build()
        c.autocast = dtype
        return c

    return case


CASES = {"gpt-100m": gpt_100m, "hf-gpt2-medium-bf16": hf_gpt2_medium, "resnet50": resnet50,
         "resnet50-fp16": under_autocast(resnet50, torch.float16), "resnet50-bf16": under_autocast(resnet50, torch.bfloat16)}


def predict(case: Case, micro: int, capacity: str, search: bool) -> dict[str, Any]:
    t = time.monotonic()
    p = oomkit.preflight(case.build, case.batch, micro_batch=micro, loss=case.loss, optimizer=case.optimizer, autocast=case.autocast,
                         steps=STEPS, capacity=capacity, max_micro_batch=case.search_max if search else None)
    out: dict[str, Any] = {"peak_allocated_bytes": p.peak_allocated_bytes, "peak_reserved_bytes": p.peak_reserved_bytes, "fits": p.fits,
           "seconds": round(time.monotonic() - t, 2)}
    if search:
        out["largest_micro_batch"] = p.largest_micro_batch
        out["tried"] = p.tried
    return out


def measure(case: Case, model: nn.Module, micro: int) -> dict[str, Any]:
    """The same steps on the GPU; the peaks from after the model was built."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    opt = case.optimizer([p for p in model.parameters() if p.requires_grad])
    try:
        for _ in range(STEPS):
            data = case.batch(micro)
            if case.autocast is not None:
                with torch.autocast("cuda", dtype=case.autocast):
                    value = case.loss(model, data)
            else:
                value = case.loss(model, data)
            value.backward()
            del value, data
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return {"fits": True, "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    except torch.OutOfMemoryError:
        return {"fits": False}
    finally:
        del opt
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True, help=f"one of {', '.join(CASES)}; with --predict-only, several, comma-separated")
    ap.add_argument("--capacity", default="16GiB", help="what the allocator may hold, for the largest micro-batch")
    ap.add_argument("--predict-only", action="store_true")
    ap.add_argument("--no-search", action="store_true", help="the peaks alone, without the largest micro-batch")
    ap.add_argument("--batches", default=None, help="comma-separated micro-batches in place of the case's own")
    args = ap.parse_args()
    names = args.case.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case {unknown[0]!r}: one of {', '.join(CASES)}")
    # On the GPU each case measures in a process of its own: a model left from the case before would
    # sit in the next one's peaks. Predictions hold no memory, so several share one process's imports.
    if len(names) > 1 and not args.predict_only:
        ap.error("several cases at once only with --predict-only")
    for name in names:
        run_case(name, args)


def run_case(name: str, args: argparse.Namespace) -> None:
    """One case's predictions (and, without ``--predict-only``, its measurements): one RESULT line."""
    case = CASES[name]()
    if args.batches:
        case.batches = tuple(int(b) for b in args.batches.split(","))
    result: dict[str, Any] = {"case": name, "steps": STEPS, "capacity": args.capacity, "autocast": str(case.autocast), "rows": []}
    preds = {m: predict(case, m, "1TiB", False) for m in case.batches}
    if not args.no_search:
        search = predict(case, case.batches[0], args.capacity, True)
        result["predicted_largest_micro_batch"] = search.get("largest_micro_batch")
        result["predicted_tried"] = search.get("tried")
    if args.predict_only:
        result["rows"] = [{"micro_batch": m, "predicted": preds[m]} for m in case.batches]
        print("RESULT " + json.dumps(result), flush=True)
        return
    torch.manual_seed(0)
    model = case.build().to("cuda")
    for m in case.batches:
        result["rows"].append({"micro_batch": m, "predicted": preds[m], "measured": measure(case, model, m)})
    if args.no_search:
        print("RESULT " + json.dumps(result), flush=True)
        return
    # The largest micro-batch under the capacity, by bisection of real steps.
    cap = oomkit._native.parse_capacity(args.capacity)[0]
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    lo, hi, tried = 0, case.search_max + 1, []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = measure(case, model, mid)["fits"]
        tried.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    result["measured_largest_micro_batch"] = lo
    result["measured_tried"] = tried
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
