"""A tiny Lightning run on CPU, for `lightning.pytorch` or the standalone `pytorch_lightning`.

    python examples/lightning_trainer.py --root runs/pl --oomkit
    oomkit analyze runs/pl/oomkit-logs/run-*.jsonl

`--oomkit` adds oomkit's callback; without it the script has no oomkit code
at all, and `oomkit run` still gets a run log and applies its plan through
Lightning's entry point. It prints the callbacks Lightning used and the
micro-batch and accumulation it trained with. `--oom-above N` plants a real
allocator OOM when the micro-batch is larger than N. The tests import
`build` to drive it in-process.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch
from planted import FailInBackward, huge
from torch.utils.data import DataLoader, TensorDataset


def make(namespace: str):
    """The module and data classes, written against one Lightning namespace."""
    pl = importlib.import_module(namespace)

    class Regressor(pl.LightningModule):
        def __init__(self, oom_above: int = 0, oom_at_batch: int = -1, oom_in_backward: bool = False, call_self: bool = False):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
            self.oom_above = oom_above
            self.oom_at_batch = oom_at_batch
            self.oom_in_backward = oom_in_backward
            self.call_self = call_self
            self.seen_batches = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen_batches.append(len(x))
            # Many training steps never call self(...): the callback must not need it.
            pred = self(x) if self.call_self else self.net(x)
            if (self.oom_above and len(x) > self.oom_above) or batch_idx == self.oom_at_batch:
                if self.oom_in_backward:
                    pred = FailInBackward.apply(pred)
                else:
                    huge()
            return torch.nn.functional.mse_loss(pred.squeeze(-1), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Data(pl.LightningDataModule):
        def __init__(self, batch_size: int = 8):
            super().__init__()
            self.batch_size = batch_size
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(96, 32, generator=g)
            self.y = torch.randn(96, generator=g)

        def train_dataloader(self):
            return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=8)

    return pl, Regressor, Data


def build(namespace: str, root: str, *, batch: int = 8, accum: int = 1, steps: int = 4, val_every: int = 0, callbacks=(), devices: int = 1, **planted):
    pl, Regressor, Data = make(namespace)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=devices,
        # Under torchrun (one process per device), DDP over gloo.
        strategy="ddp" if devices > 1 else "auto",
        max_steps=steps,
        accumulate_grad_batches=accum,
        limit_val_batches=2 if val_every else 0,
        val_check_interval=val_every or None,
        num_sanity_val_steps=1 if val_every else 0,
        check_val_every_n_epoch=None if val_every else 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    return trainer, Regressor(**planted), Data(batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--namespace", default="lightning.pytorch")
    ap.add_argument("--root", required=True)
    ap.add_argument("--batch", type=int, default=8, help="the datamodule's batch_size")
    ap.add_argument("--accum", type=int, default=2, help="accumulate_grad_batches")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--val-every", type=int, default=4, help="validate every N batches (0: never)")
    ap.add_argument("--oom-above", type=int, default=0, help="run out of memory above this micro-batch")
    ap.add_argument("--oomkit", action="store_true", help="add oomkit's callback")
    ap.add_argument("--devices", type=int, default=1, help="processes of a DDP run (as torchrun's --nproc-per-node)")
    args = ap.parse_args()
    callbacks = []
    if args.oomkit:
        module = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}[args.namespace]
        callbacks.append(importlib.import_module(f"oomkit.integrations.{module}").OomkitCallback())
    trainer, model, data = build(
        args.namespace, args.root, batch=args.batch, accum=args.accum, steps=args.steps,
        val_every=args.val_every, callbacks=callbacks, devices=args.devices, oom_above=args.oom_above,
    )
    trainer.fit(model, datamodule=data)
    names = [type(c).__module__ + "." + type(c).__name__ for c in trainer.callbacks]
    print("callbacks:", ", ".join(names))
    print(f"trained with micro-batch {model.seen_batches[-1]} x accumulation {trainer.accumulate_grad_batches}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
