"""The GPT of train.py trained compiled, as nanoGPT and torchtitan train by default.

`torch.compile(model)` under `oomkit preflight` is modelled as the default
backend builds the step: what the compiled step saves for backward is what
AOTAutograd's partitioner decides, and chains of pointwise operations take
no memory of their own (inductor fuses them), so a compiled step can hold
less than the same step run eagerly (at this GPT's peak, the start of
backward, the loss's tensors over the vocabulary are not held).
"""

import argparse

import torch
from train import GPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    vocab = 50304
    model = GPT(vocab, args.ctx, 768, 12, args.layers).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    step_of = torch.compile(model)
    for _ in range(args.steps):
        x = torch.randint(0, vocab, (args.batch_size, args.ctx), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_of(x, torch.roll(x, -1, dims=1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
