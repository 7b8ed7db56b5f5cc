"""A training loop that halves its micro-batch when the GPU runs out, and goes on.

The pattern of accelerate's `find_executable_batch_size`, the Hugging Face
Trainer's `auto_find_batch_size` and many hand-written loops: catch
`torch.cuda.OutOfMemoryError`, halve the batch, try again. Under
`oomkit preflight` the error is raised where a GPU of the capacity given
would raise it, so the script settles on the batch it would settle on there.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=65536)
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

model = nn.Sequential(nn.Linear(1024, args.width), nn.GELU(), nn.Linear(args.width, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(batch: int) -> float:
    x = torch.randn(batch, 1024, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


batch, done = args.batch_size, 0
while done < args.steps:
    try:
        loss = train_step(batch)
    except torch.cuda.OutOfMemoryError:
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if batch == 1:
            raise
        batch //= 2
        print(f"out of memory: micro-batch halved to {batch}", flush=True)
        continue
    done += 1
    print(f"step {done}: micro-batch {batch}, loss {loss:.4f}", flush=True)
