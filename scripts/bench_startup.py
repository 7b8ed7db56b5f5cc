"""The smallest training script: what one process of the suite costs before its work
(BENCHMARKS.md, "What one of the suite's processes costs"). Run as

    python scripts/bench_startup.py cpu
    oomkit preflight --json --no-fixes -- python scripts/bench_startup.py

A Linear layer trained for three steps with SGD on the device given (``cuda`` by default).
"""

import sys

import torch

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
model = torch.nn.Linear(8, 8).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 8, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
