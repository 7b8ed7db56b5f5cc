"""One recorded training run for checking oomkit's allocator model against PyTorch's own (needs CUDA).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
        python scripts/gpu_allocator_run.py --snapshot s.pickle --capacity-bytes 8000000000

A GPT of GPT-2 small's shape (examples/gpt_train.py, fp32, AdamW) trains
a few steps on micro-batches whose sequence length changes from step to
step, as with unpadded text, which is what makes the caching allocator
split, cache and fragment. Allocation history is recorded from the
process's first allocation, so the trace holds every segment, and the
snapshot is dumped at the end or at the first OOM. The allocator's own
figures (``torch.cuda.memory_stats``) are printed as one line ``RESULT
{...}``: what `oomkit whatif` is compared with. The allocator's settings
come from ``PYTORCH_CUDA_ALLOC_CONF``, as for any PyTorch program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt_train import GPT, SIZES

#: Sequence lengths of the steps in turn: long, short, then in between, so
#: that blocks freed by one step are the wrong size for the next.
LENGTHS = (1024, 256, 768, 512, 1024, 384, 896, 640)


def take_all_but(capacity: int) -> str:
    """Takes the device's free memory but ``capacity`` with a cudaMalloc of another library, as another program would.

    Unlike ``set_per_process_memory_fraction``, the OOM the allocator then
    meets is the driver's, and the trace's OOM entry records what the driver
    had free, which is what a replay needs to know the limit.
    """
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, so that what is free is what is left after it
    free, _total = torch.cuda.mem_get_info()
    # Freed at once, before the trace begins; its segment goes back to the driver.
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info()
    take = free - capacity
    if take <= 0:
        return "none (less free than the capacity)"
    try:
        import cupy

        ptr = cupy.cuda.runtime.malloc(take)
        _KEEP.append(ptr)
        return f"cupy.cuda.runtime.malloc({take})"
    except ImportError:
        import ctypes

        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
            try:
                rt = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise SystemExit("gpu_allocator_run: neither cupy nor libcudart is there to take memory outside PyTorch") from None
        p = ctypes.c_void_p()
        if rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(take)) != 0:
            raise SystemExit(f"gpu_allocator_run: cudaMalloc({take}) failed") from None
        _KEEP.append(p)
        return f"cudaMalloc({take})"


#: What the blocker allocated, held to the end of the process.
_KEEP: list = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--size", default="100m", choices=list(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--capacity-bytes", type=int, default=0,
                    help="leave the allocator only this much of the device (the rest taken by a plain cudaMalloc outside PyTorch)")
    ap.add_argument("--frames", action="store_true", help="record Python stacks (larger file)")
    args = ap.parse_args()
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    blocker = None
    if args.capacity_bytes:
        blocker = take_all_but(args.capacity_bytes)
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all" if args.frames else None, stacks="python", max_entries=2_000_000
    )
    layers, dim, heads, vocab, ctx = SIZES[args.size]
    torch.manual_seed(0)
    model = GPT(layers, dim, heads, vocab, ctx).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    result: dict = {"settings": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "capacity_bytes": args.capacity_bytes or None,
                    "total_bytes": total, "status": "ok", "steps_done": 0, "oom_at_step": None,
                    "capacity_method": blocker}
    try:
        for step in range(args.steps):
            seq = min(LENGTHS[step % len(LENGTHS)], ctx)
            tokens = torch.randint(0, vocab, (args.batch, seq + 1), generator=g).to(device)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            del logits
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss, tokens
            result["steps_done"] = step + 1
    except torch.OutOfMemoryError as exc:
        result["status"] = "oom"
        result["oom_at_step"] = result["steps_done"]
        result["error"] = str(exc).splitlines()[0][:300]
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats(device)
    result.update(
        peak_allocated_bytes=stats["allocated_bytes.all.peak"],
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        reserved_at_end_bytes=stats["reserved_bytes.all.current"],
        segments_allocated=stats["segment.all.allocated"],
        segments_freed=stats["segment.all.freed"],
        alloc_retries=stats["num_alloc_retries"],
        ooms=stats["num_ooms"],
        inactive_split_bytes_at_end=stats["inactive_split_bytes.all.current"],
    )
    torch.cuda.memory._dump_snapshot(args.snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
    result["snapshot"] = args.snapshot
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
