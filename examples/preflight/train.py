"""A small GPT trained the usual way on a GPU: the script `oomkit preflight` is shown on.

It is written for CUDA (`device="cuda"`, bfloat16 autocast, fused-free
AdamW) and runs unchanged under `oomkit preflight`, which needs no GPU.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    vocab = 50304
    model = GPT(vocab, args.ctx, args.dim, args.heads, args.layers).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, batch {args.batch_size} x {args.ctx} tokens")
    for step in range(args.steps):
        x = torch.randint(0, vocab, (args.batch_size, args.ctx))
        y = torch.roll(x, -1, dims=1)
        x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f} (ln vocab {math.log(vocab):.3f})")


if __name__ == "__main__":
    main()
