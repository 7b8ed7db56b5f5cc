"""oomkit.preflight from Python: the GPT of train.py, checked against an H100 without one.

Run: python examples/preflight/notebook.py
"""

import oomkit
import torch
from train import GPT

answer = oomkit.preflight(
    lambda: GPT(vocab=50304, ctx=1024, dim=768, heads=12, layers=12),  # built on meta
    lambda b: (torch.randint(0, 50304, (b, 1024)), torch.randint(0, 50304, (b, 1024))),
    micro_batch=8,
    grad_accum=4,                      # micro-batches per optimizer step, as the loop has them
    optimizer="adamw",                 # or a function of the parameters: lambda p: torch.optim.SGD(p, lr=0.1)
    autocast=torch.bfloat16,           # torch.autocast("cuda", dtype=...) around forward and loss
    capacity="H100",                   # a size ("80GiB") or a GPU's name
    max_micro_batch=64,                # also search the largest micro-batch that fits
)
print(answer)
print(answer.largest_micro_batch, answer.largest_grad_accum)
