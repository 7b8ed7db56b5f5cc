"""Blocks of a small MLP trained on the GPU, with each change preflight's "what would make it fit" makes, by hand.

`oomkit preflight` measures each change on the script unchanged
(`python/tests/test_preflight_fixes.py` checks its rows against this script
run with the flag), and `scripts/gpu_validate.py` runs the flags for real
on a GPU: `--checkpoint` (activation checkpointing of the blocks),
`--autocast` (bf16), `--adam8` (bitsandbytes' 8-bit AdamW), `--fsdp`
(each block and the model given to `fully_shard`, under torchrun). Two
more make the script the kind preflight meets in the wild: `--ddp` (the
model wrapped in `DistributedDataParallel`, under torchrun) and
`--compile` (the model given to `torch.compile` last, as nanoGPT does).
"""

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=64)
p.add_argument("--checkpoint", action="store_true")
p.add_argument("--autocast", action="store_true")
p.add_argument("--adam8", action="store_true")
p.add_argument("--fsdp", action="store_true")
p.add_argument("--ddp", action="store_true")
p.add_argument("--compile", action="store_true")
a = p.parse_args()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(6)])

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if a.checkpoint else layer(x)
        return x


model = Net().cuda()
if a.fsdp or a.ddp:
    import torch.distributed as dist

    dist.init_process_group("nccl")
if a.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
if a.adam8:
    import bitsandbytes as bnb

    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if a.ddp:
    model = nn.parallel.DistributedDataParallel(model)
if a.compile:
    model = torch.compile(model)
for _ in range(3):
    x = torch.randn(a.batch, 128, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.autocast):
        y = model(x)
    y.float().square().mean().backward()
    opt.step()
    opt.zero_grad()
