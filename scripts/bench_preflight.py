#!/usr/bin/env python3
"""Time oomkit.preflight beside PyTorch's own MemTracker on one training step, without a GPU.

The step is a Llama-2-7B built from its config (no download), in bfloat16,
first with LoRA adapters (rank 8 on the query and value projections,
float32; the base frozen), then fully fine-tuned; AdamW, a micro-batch of
2 x 512 tokens, two optimizer steps. Each tool runs in a fresh process --runs
times, taking turns; the median wall time (the tool's own work, after
imports) and the largest peak resident set size are reported, with each
tool's peak.

    python scripts/bench_preflight.py --runs 3

MemTracker (torch.distributed._tools.mem_tracker) counts tensors by
category on the same meta tensors; it models no allocator, writes no
snapshot and cannot search batch sizes, so it is the nearest thing a user
has, not an equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch, transformers
from torch import nn

cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
cfg._attn_implementation = "sdpa"

class LoRA(nn.Module):
    def __init__(self, base, r=8):
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, r, bias=False, dtype=torch.float32)
        self.b = nn.Linear(r, base.out_features, bias=False, dtype=torch.float32)
    def forward(self, x):
        return self.base(x) + self.b(self.a(x.to(self.a.weight.dtype))).to(x.dtype)

lora = sys.argv[2] == "lora"

def build():
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if not lora:
        return m
    m.requires_grad_(False)
    for layer in m.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    return m

def batch(b, device=None):
    ids = torch.randint(0, 32000, (b, 512), device=device)
    return {"input_ids": ids, "labels": ids}

tool = sys.argv[1]
t = time.perf_counter()
if tool == "oomkit":
    import oomkit
    r = oomkit.preflight(build, batch, micro_batch=2, capacity="H100")
    peak = r.peak_allocated_bytes
else:
    from torch.distributed._tools.mem_tracker import MemTracker
    with torch.device("meta"):
        model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=True)
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        for _ in range(2):
            model(**batch(2, "meta")).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mt.reset_mod_stats()
    peak = int(mt.get_tracker_snapshot("peak")[torch.device("meta")]["Total"])
import resource
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
print(json.dumps({"seconds": time.perf_counter() - t, "peak": peak, "rss": rss}))
"""


def run(tool: str, case: str) -> tuple[float, int, int] | str:
    """One fresh process: (seconds, the tool's peak, its peak RSS in bytes), or the error's last line."""
    out = subprocess.run([sys.executable, "-c", CHILD, tool, case], capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit {out.returncode}"
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return doc["seconds"], doc["peak"], doc["rss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    gib = 1 << 30
    for case in ("lora", "full"):
        times: dict[str, list[float]] = {"oomkit": [], "memtracker": []}
        peaks: dict[str, int] = {}
        rss: dict[str, int] = {}
        failed: dict[str, str] = {}
        for i in range(args.runs):
            order = ["oomkit", "memtracker"] if i % 2 == 0 else ["memtracker", "oomkit"]
            for tool in order:
                if tool in failed:
                    continue
                got = run(tool, case)
                if isinstance(got, str):
                    failed[tool] = got
                    continue
                s, peak, r = got
                times[tool].append(s)
                peaks[tool] = peak
                rss[tool] = max(rss.get(tool, 0), r)
        print(f"Llama-2-7B {'LoRA r=8' if case == 'lora' else 'full fine-tune'}, AdamW, 2 x 512 tokens, 2 steps:")
        for tool in times:
            if tool in failed:
                print(f"  {tool:<11} failed: {failed[tool]}")
                continue
            print(
                f"  {tool:<11} median {statistics.median(times[tool]):6.2f} s over {len(times[tool])} runs, "
                f"step peak {peaks[tool] / gib:6.2f} GiB, peak RSS {rss[tool] / gib:.2f} GiB"
            )
    print(f"cores: {os.cpu_count()}")


if __name__ == "__main__":
    main()
