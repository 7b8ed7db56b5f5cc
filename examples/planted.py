"""Real out-of-memory failures that the example scripts plant on request."""

from __future__ import annotations

import torch


def huge() -> None:
    """A real allocator failure: the CPU allocator refuses 4 EiB at once (a RuntimeError, as on a full host)."""
    torch.empty(1 << 62, dtype=torch.uint8)


class FailInBackward(torch.autograd.Function):
    """The identity in the forward; its backward runs out of memory, as a backward that needs too much would."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        huge()
        return g
