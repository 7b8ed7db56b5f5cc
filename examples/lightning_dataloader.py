"""A Lightning script whose batch size lives only in its DataLoader, as in Lightning's own examples.

    oomkit run --batch-size 20 --effective-batch 40 -- python examples/lightning_dataloader.py --root runs/dl
    oomkit analyze runs/dl/oomkit-logs/run-*.jsonl

It follows Lightning's `examples/pytorch/basics/transformer.py`: the demo
`Transformer` wrapped in a `LightningModule`, and `trainer.fit(model,
train_dataloaders=DataLoader(dataset, batch_size=20))`, with no
`batch_size` on the module, its hparams or a datamodule (the places
Lightning's own batch-size finder looks). The tokens are random (the
original downloads WikiText-2), so it runs offline and on CPU. There is
no oomkit code here: under `oomkit run`, Lightning's entry point adds
oomkit's callback, which rebuilds the training DataLoader with the plan's
micro-batch and sets `accumulate_grad_batches`. The last line it prints is
`RESULT {...}`: the batch sizes training saw, the accumulation and the
final loss. `--test` runs `trainer.test()` after fitting (a second log),
`--oom-above N` plants a real allocator OOM when a batch holds more than N
samples, and `--batch-sampler` builds the loader from its own
`BatchSampler`, which no one can resize from outside (the callback then
says the plan was not applied).
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.demos import Transformer
from planted import huge
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

VOCAB = 500
SEQ = 32


class Tokens(Dataset):
    """Random token sequences and their next-token targets, the shape WikiText2 yields."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[i]
        return row[:-1], row[1:]


class LightningTransformer(L.LightningModule):
    def __init__(self, vocab_size: int, oom_above: int = 0) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=64, nhead=2, nhid=64, nlayers=2, dropout=0.0)
        self.oom_above = oom_above
        self.seen_batches: list[int] = []

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        self.seen_batches.append(len(inputs))
        if self.oom_above and len(inputs) > self.oom_above:
            huge()
        output = self(inputs, target)
        loss = torch.nn.functional.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        loss = torch.nn.functional.nll_loss(self(inputs, target), target.view(-1))
        self.log("test_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="runs/dl", help="Lightning's default_root_dir")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps")
    ap.add_argument("--test", action="store_true", help="run trainer.test() after fitting")
    ap.add_argument("--oom-above", type=int, default=0, help="a real allocator failure for batches larger than this")
    ap.add_argument("--batch-sampler", action="store_true", help="batch with a BatchSampler of the script's own")
    args = ap.parse_args()
    L.seed_everything(42, verbose=False)
    model = LightningTransformer(vocab_size=VOCAB, oom_above=args.oom_above)
    trainer = L.Trainer(
        default_root_dir=args.root,
        max_steps=args.steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = Tokens(400, 0)
    if args.batch_sampler:
        loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), batch_size=20, drop_last=False))
    else:
        loader = DataLoader(data, batch_size=20, shuffle=True)
    trainer.fit(model, train_dataloaders=loader)
    result = {
        "batches": model.seen_batches,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "loss": round(float(trainer.callback_metrics["train_loss"]), 6),
    }
    if args.test:
        trainer.test(model, dataloaders=DataLoader(Tokens(40, 1), batch_size=20), verbose=False)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
