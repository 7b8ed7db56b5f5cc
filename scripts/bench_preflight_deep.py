"""A deep convolutional network trained with activation checkpointing: the many-small-operations
case of preflight's speed (BENCHMARKS.md). Run under preflight:

    oomkit preflight --json -- python scripts/bench_preflight_deep.py [BLOCKS]

and, for what a user would otherwise wait for, the same steps run by PyTorch itself on this
machine's CPU or on the meta device (sizes only, PyTorch's own meta kernels):

    python scripts/bench_preflight_deep.py BLOCKS cpu 2

400 blocks of two 3x3 convolutions and batch norms, each block checkpointed, micro-batch 8 at
32 x 32: about 73,000 operations a step, most of them on tensors of a few thousand elements.
"""

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """Two 3x3 convolutions with batch norm, around a residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x))))))


class Net(nn.Module):
    """A stem, ``blocks`` checkpointed blocks of 32 channels, and a classifier."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.ModuleList(Block(32) for _ in range(blocks))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x.mean((2, 3)))


blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 400
device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
# Preflight stops after its --steps optimizer steps (2); a run elsewhere takes the number given.
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
model = Net(blocks).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(steps):
    x, y = torch.randn(8, 3, 32, 32, device=device), torch.randint(0, 10, (8,), device=device)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
