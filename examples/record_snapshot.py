"""Record a memory snapshot of a few training steps, for `oomkit analyze`: the README's second example.

Needs a CUDA GPU (PyTorch records snapshots of CUDA memory only); without
one it says so and exits with status 1.

    python examples/record_snapshot.py
    oomkit analyze snap.pickle
"""

import sys

import torch

if not torch.cuda.is_available():
    sys.exit(
        "record_snapshot.py: no CUDA device here, and PyTorch records snapshots of CUDA memory only; "
        "`oomkit demo --save snap.pickle` writes one to try oomkit on"
    )

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def train():
    for _ in range(5):
        x = torch.randn(256, 1024, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


torch.cuda.memory._record_memory_history(max_entries=1_000_000)  # start recording allocations
try:
    train()                                                      # your training loop
finally:
    torch.cuda.memory._dump_snapshot("snap.pickle")              # write what was recorded
    torch.cuda.memory._record_memory_history(enabled=None)       # stop recording
print("wrote snap.pickle: oomkit analyze snap.pickle")
