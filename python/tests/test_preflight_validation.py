"""oomkit.preflight against published measurements: the traced rows of VALIDATION.md.

Each case is a run someone else measured on a GPU (VALIDATION.md's
sources); preflight runs the same step on meta tensors, with no fitting to
these figures, and the test fails when a traced figure is more than
TOLERANCE off or when VALIDATION.md no longer shows what preflight computes
(the failure message has the row to paste).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")
# The 8-bit Adam rows run bitsandbytes' own optimizer, whose kernels have fake implementations.
bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed for this Python")

import oomkit  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

#: The largest error allowed; the goal is 5% (docs/preflight.md).
TOLERANCE = 0.06

#: The CUDA context, as the hf-single-gpu guide measured it on its V100 (VALIDATION.md).
CONTEXT = 1343 * MIB

#: bert-large-uncased as published on the Hugging Face Hub.
BERT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522}

# name (as in VALIDATION.md), micro-batch, accumulation, measured MiB (nvidia-smi), checkpointing, optimizer, autocast
HF_SINGLE_GPU = [
    ("bert-large fp32 AdamW b4", 4, 1, 14949, False, "adamw", None),
    ("bert-large fp32 AdamW b1", 1, 4, 8681, False, "adamw", None),
    ("bert-large fp32 AdamW b1 checkpointing", 1, 4, 6775, True, "adamw", None),
    ("bert-large fp16 autocast AdamW b4", 4, 1, 13939, False, "adamw", torch.float16),
    ("bert-large fp16 autocast AdamW b1 checkpointing", 1, 4, 7275, True, "adamw", torch.float16),
    ("bert-large fp32 Adafactor b4", 4, 1, 12295, False, "adafactor", None),
    ("bert-large fp32 8-bit Adam b4", 4, 1, 13085, False, "adam8bit", None),
    ("bert-large fp16 autocast Adafactor b1 checkpointing", 1, 4, 4847, True, "adafactor", torch.float16),
    ("bert-large fp16 autocast 8-bit Adam b1 checkpointing", 1, 4, 5363, True, "adam8bit", torch.float16),
]


def _optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "adamw":
        # The Trainer of v4.21 to v4.3x defaulted to transformers' own AdamW, a loop over parameters.
        return lambda params: torch.optim.AdamW(params, foreach=False)
    if name == "adam8bit":
        # The guide built bitsandbytes' Adam8bit itself and passed it to the Trainer.
        return bnb.optim.Adam8bit
    # optim="adafactor": the Trainer's Adafactor with a fixed learning rate.
    return lambda params: transformers.Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)


def _formula(name: str) -> str:
    """The formula's figure ("ours") for the same case in VALIDATION.md's first table."""
    for line in (ROOT / "VALIDATION.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] == name and len(cells) >= 8:
            return cells[4]
    raise AssertionError(f"VALIDATION.md has no formula row for {name!r}")


def _row(name: str, measured: int, traced: int) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    return f"| {name} | {gb(measured)} | {_formula(name)} | {gb(traced)} | {100 * (traced / measured - 1):+.1f}% |"


def test_the_traced_figures_match_the_published_measurements() -> None:
    config = transformers.BertConfig(**BERT_LARGE, num_labels=2)
    config._attn_implementation = "eager"  # the guide's transformers had no SDPA for BERT

    def batch(b: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, 30522, (b, 512)), "labels": torch.randint(0, 2, (b,))}

    rows, errors = [], []
    for name, micro, accum, mib, checkpointing, optimizer, autocast in HF_SINGLE_GPU:

        def build(checkpointing: bool = checkpointing) -> torch.nn.Module:
            model = transformers.BertForSequenceClassification(config)
            if checkpointing:
                model.gradient_checkpointing_enable()
            return model.train()

        r = oomkit.preflight(
            build,
            batch,
            micro_batch=micro,
            grad_accum=accum,
            optimizer=_optimizer(optimizer),
            autocast=autocast,
            # zero_grad() kept the gradients allocated before PyTorch 2.0.
            set_to_none=False,
            # A V100 is older than Hopper, as the A100 is: the same cuBLAS workspace.
            capacity="A100-40GB",
        )
        measured = mib * MIB
        traced = r.peak_reserved_bytes + CONTEXT  # nvidia-smi: the reserve and the context
        rows.append(_row(name, measured, traced))
        errors.append((name, traced / measured - 1))
    doc = (ROOT / "VALIDATION.md").read_text()
    missing = [r for r in rows if r not in doc]
    assert not missing, "VALIDATION.md lacks these traced rows (or shows old figures):\n" + "\n".join(missing)
    off = [(n, e) for n, e in errors if abs(e) > TOLERANCE]
    assert not off, off
    summary = re.search(r"(\d+) traced cases: (\d+) within 5%", doc)
    within = sum(abs(e) <= 0.05 for _, e in errors)
    assert summary and summary.groups() == (str(len(errors)), str(within)), (len(errors), within)
