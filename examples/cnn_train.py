"""A convolutional image classifier trained with AdamW, in plain PyTorch, with bugs that can be planted.

    python examples/cnn_train.py --device cpu --size tiny --steps 20 --tracker --eval-every 5 --eval-keeps-outputs
    oomkit analyze oomkit-logs/run-*.jsonl

Sizes: `tiny` (32x32 images, for CPU tests), `small` (64x64), `resnet`
(a ResNet-style network on 224x224 images, for a GPU). The planted bugs
and every other flag are described in `plain_loop.py`; the run ends with
one line `RESULT {...}` (JSON).
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch
from plain_loop import arguments, run
from torch import nn

# (widths of the stages, blocks per stage, image side, classes)
SIZES = {
    "tiny": ((16, 32), 1, 32, 10),
    "small": ((32, 64, 128), 2, 64, 100),
    "resnet": ((64, 128, 256, 512), 2, 224, 1000),
}


class Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def network(widths: Tuple[int, ...], blocks: int, classes: int) -> nn.Module:
    layers = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, w in enumerate(widths):
        for j in range(blocks):
            layers.append(Residual(cin, w, 2 if j == 0 and i > 0 else 1))
            cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def main() -> None:
    args = arguments("Train a convolutional image classifier.", list(SIZES), "tiny").parse_args()
    widths, blocks, side, classes = SIZES[args.size]

    def build(device: torch.device, dtype: torch.dtype) -> nn.Module:
        return network(widths, blocks, classes).to(device=device, dtype=dtype)

    def batches(micro: int, device: torch.device) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        while True:
            yield (torch.randn(micro, 3, side, side, generator=g).to(device),
                   torch.randint(0, classes, (micro,), generator=g).to(device))

    def loss_of(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        dtype = next(model.parameters()).dtype
        return nn.functional.cross_entropy(model(x.to(dtype)).float(), y)

    run(args, build, batches, loss_of, {"model": "cnn", "size": args.size, "image": side})


if __name__ == "__main__":
    main()
