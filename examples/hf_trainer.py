"""A tiny Hugging Face Trainer run with oomkit's callback: GPT-2 built from a config (nothing is downloaded), on CPU.

    python examples/hf_trainer.py --out runs/hf
    oomkit analyze runs/hf/oomkit-logs/run-*.jsonl

It trains with gradient accumulation and evaluates every few steps, then
prints the run log's path. `--oom-above N` plants a real allocator OOM in the
forward when the micro-batch is larger than N, to watch `oomkit run` step it
down. The tests import `build` to drive it in-process.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import Dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from oomkit.integrations.transformers import OomkitCallback, train
from planted import FailInBackward, huge  # noqa: E402

VOCAB = 128
CTX = 16


class Tokens(Dataset):
    """Random token sequences; labels are the inputs, as for language modelling."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, CTX), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Planted(GPT2LMHeadModel):
    """GPT-2 whose forward (or backward) runs out of memory where the test says."""

    oom_above = 0  # micro-batch above which the forward runs out of memory
    oom_at_step = -1  # forward call at which it runs out
    oom_in_backward = False
    calls = 0

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if self.training:
            Planted.calls += 1
            due = (self.oom_above and input_ids.shape[0] > self.oom_above) or Planted.calls - 1 == self.oom_at_step
            if due and not self.oom_in_backward:
                huge()
            if due and self.oom_in_backward:
                out.loss = FailInBackward.apply(out.loss)
        return out


def build(
    out_dir: str, *, batch: int = 4, accum: int = 1, steps: int = 4, eval_steps: int = 0, callback=None, gpu: bool = False, **planted
) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=CTX, bos_token_id=0, eos_token_id=0)
    model = Planted(config)
    # Each build plants only what it is given.
    settings = {"oom_above": 0, "oom_at_step": -1, "oom_in_backward": False, **planted}
    for k, v in settings.items():
        setattr(Planted, k, v)
    Planted.calls = 0
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=accum,
        max_steps=steps,
        learning_rate=1e-3,
        use_cpu=not gpu,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps or None,
        dataloader_num_workers=0,
    )
    data, eval_data = Tokens(), Tokens(8) if eval_steps else None
    if callback is not None:
        return Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_data, callbacks=[callback])
    # As docs/tracker.md shows it.
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_data, callbacks=[OomkitCallback()])
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    ap.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--eval-steps", type=int, default=3, help="evaluate every N steps (0: never)")
    ap.add_argument("--oom-above", type=int, default=0, help="run out of memory above this micro-batch")
    ap.add_argument("--gpu", action="store_true", help="train on the GPU when there is one (the default, the CPU, runs anywhere)")
    args = ap.parse_args()
    trainer = build(
        args.out, batch=args.batch, accum=args.accum, steps=args.steps, eval_steps=args.eval_steps, oom_above=args.oom_above,
        gpu=args.gpu,
    )
    train(trainer)       # trainer.train() works too: an OOM that ends the script is still recorded
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, OomkitCallback))
    print(f"log: {cb.tracker.log_path}")
    print(f"trained with micro-batch {trainer._train_batch_size} x accumulation {trainer.args.gradient_accumulation_steps}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
