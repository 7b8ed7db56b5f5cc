"""A GPT-shaped model trained with FSDP (fully_shard), launched with torchrun on N GPUs.

On a cluster: torchrun --nproc-per-node 8 examples/preflight/fsdp_train.py
Without GPUs: oomkit preflight --gpus 8 -- python examples/preflight/fsdp_train.py
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--dim", type=int, default=1024)
parser.add_argument("--layers", type=int, default=12)
parser.add_argument("--vocab", type=int, default=32000)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, dim // 64, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=True, attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device))[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Block(args.dim) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
mesh = init_device_mesh("cuda", (world,))
model = GPT().cuda()
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
for step in range(args.steps):
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq + 1), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.3f}")
dist.destroy_process_group()
