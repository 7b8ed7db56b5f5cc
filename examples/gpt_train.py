"""A GPT-style language model trained with AdamW, in plain PyTorch, with bugs that can be planted.

    python examples/gpt_train.py --device cpu --size tiny --steps 20 --tracker --leak
    oomkit analyze oomkit-logs/run-*.jsonl

Sizes: `tiny` (about 0.4 M parameters, for CPU tests), `small` (about 11 M),
`100m` (about 110 M, GPT-2 small's shape: for a GPU). bf16 on CUDA, fp32 on
CPU. `--config-out FILE` writes the model's shape as a Hugging Face style
config.json for `oomkit estimate --config`. The planted bugs and every
other flag are described in `plain_loop.py`; the run ends with one line
`RESULT {...}` (JSON: peak, step time, run log, snapshot).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator

import torch
from plain_loop import arguments, run
from torch import nn

# (layers, hidden, heads, vocabulary, context)
SIZES = {
    "tiny": (2, 64, 2, 512, 64),
    "small": (6, 256, 8, 8192, 256),
    "100m": (12, 768, 12, 50257, 1024),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int, ctx: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        mask = self.mask[:t, :t].to(x.dtype)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.norm(x))


def config(size: str) -> Dict[str, Any]:
    """The model's shape in Hugging Face's GPT-2 config terms."""
    layers, dim, heads, vocab, ctx = SIZES[size]
    return {"model_type": "gpt2", "n_layer": layers, "n_embd": dim, "n_head": heads, "vocab_size": vocab,
            "n_positions": ctx, "n_inner": 4 * dim, "activation_function": "gelu", "tie_word_embeddings": True}


def main() -> None:
    ap = arguments("Train a GPT-style language model.", list(SIZES), "tiny")
    ap.add_argument("--config-out", default=None, help="write the model's config.json here and exit")
    args = ap.parse_args()
    if args.config_out:
        with open(args.config_out, "w", encoding="utf-8") as f:
            json.dump(config(args.size), f, indent=1)
        return
    layers, dim, heads, vocab, ctx = SIZES[args.size]

    def build(device: torch.device, dtype: torch.dtype) -> nn.Module:
        return GPT(layers, dim, heads, vocab, ctx).to(device=device, dtype=dtype)

    def batches(micro: int, device: torch.device) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randint(0, vocab, (micro, ctx + 1), generator=g).to(device)

    def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    run(args, build, batches, loss_of, {"model": "gpt", "size": args.size, "seq": ctx})


if __name__ == "__main__":
    main()
