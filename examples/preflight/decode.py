"""Decoding a latent into an image, as a latent diffusion pipeline's last step does, for `oomkit preflight`.

An image decoder of the shape latent diffusion models use (a variational
autoencoder's decoder: 16 latent channels, a middle of two residual blocks
around one single-head attention over every position, then four stages of
three residual blocks each, upsampled 2x between them, 512, 512, 256 and 128
channels wide), with random weights, decoding one latent at 1/8 of the image's
side in bfloat16 without gradients:

    oomkit preflight --capacity H100 -- python examples/preflight/decode.py --size 1024

It prints `torch.cuda.max_memory_allocated()` when done. On a GPU the
convolutions at the full size (128 channels over a million positions) and the
attention over 16,384 positions with one 512-wide head are where such a
decoder's memory peaks (scripts/gpu_validate.py runs it on both).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F

#: Channels of the four stages, from the latent's resolution to the image's.
STAGES = (512, 512, 256, 128)
#: Residual blocks in each stage.
BLOCKS_PER_STAGE = 3
#: Groups of every group normalisation.
GROUPS = 32


class Residual(nn.Module):
    """Two normalised 3x3 convolutions around a skip connection (1x1 where the width changes)."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(GROUPS, width_in, eps=1e-6)
        self.conv1 = nn.Conv2d(width_in, width_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(GROUPS, width_out, eps=1e-6)
        self.conv2 = nn.Conv2d(width_out, width_out, 3, padding=1)
        self.skip = nn.Conv2d(width_in, width_out, 1) if width_in != width_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Attention(nn.Module):
    """One head over every position of the feature map, as wide as its channels."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(GROUPS, width, eps=1e-6)
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)  # (b, positions, channels)
        q, k, v = (proj(h)[:, None] for proj in (self.q, self.k, self.v))  # one head
        h = F.scaled_dot_product_attention(q, k, v)[:, 0]
        h = self.out(h).transpose(1, 2).reshape(b, c, height, width)
        return x + h


class Decoder(nn.Module):
    """Latent (b, latent_channels, s/8, s/8) to image (b, 3, s, s)."""

    def __init__(self, latent_channels: int) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(latent_channels, STAGES[0], 3, padding=1)
        self.middle = nn.ModuleList([Residual(STAGES[0], STAGES[0]), Attention(STAGES[0]), Residual(STAGES[0], STAGES[0])])
        self.stages = nn.ModuleList()
        self.upsample = nn.ModuleList()
        width = STAGES[0]
        for i, out in enumerate(STAGES):
            self.stages.append(nn.ModuleList(Residual(width if j == 0 else out, out) for j in range(BLOCKS_PER_STAGE)))
            width = out
            # Each stage but the last doubles the side, then a 3x3 convolution.
            self.upsample.append(nn.Conv2d(out, out, 3, padding=1) if i < len(STAGES) - 1 else nn.Identity())
        self.norm_out = nn.GroupNorm(GROUPS, STAGES[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(STAGES[-1], 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for layer in self.middle:
            h = layer(h)
        for blocks, up in zip(self.stages, self.upsample):
            for block in blocks:
                h = block(h)
            if isinstance(up, nn.Conv2d):
                h = up(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=1024, help="the image's side in pixels (a multiple of 8)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--latent-channels", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    decoder = Decoder(args.latent_channels).to("cuda", dtype).eval()
    latent = torch.randn(args.batch, args.latent_channels, args.size // 8, args.size // 8, device="cuda", dtype=dtype)
    with torch.no_grad():
        image = decoder(latent)
    print(f"image {tuple(image.shape)}, peak allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB")


if __name__ == "__main__":
    main()
