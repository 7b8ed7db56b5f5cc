"""oomkit.preflight against published measurements: the traced rows of VALIDATION.md.

Each case is a run someone else measured on a GPU (VALIDATION.md's
sources); preflight runs the same step on meta tensors, with no fitting to
these figures, and the test fails when a traced figure is more than
TOLERANCE off (or a known miss more than its own bound), when a run that
ran out of memory is traced as fitting, or when VALIDATION.md no longer
shows what preflight computes (the failure message has the row to paste).
The Hugging Face guide's rows run transformers' BERT as its Trainer did;
LitGPT's rows run LitGPT's own model, LoRA and chunked loss as its
fine-tuning scripts do, and a config-hub row runs through LitGPT's own
command from configs alone.
"""

from __future__ import annotations

import re
import sys
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

#: Rows known to miss by more, with their own bound and why (VALIDATION.md says the same).
KNOWN_MISSES = {
    # LitGPT 0.4 (of the table's date) and 0.5 trace the same figure; what
    # the A10G run held beyond it (about 1 GB) is not found yet.
    "Gemma-2B LoRA r16 b2": 0.09,
    # StableLM's LoRA rows all trace low (-2 to -5%); its QLoRA row the most.
    "StableLM-3B QLoRA (NF4) r8 b1": 0.09,
}

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


# name (as in VALIDATION.md), LitGPT's config, micro-batch, sequence, LoRA rank (0: full fine-tuning),
# LoRA on every layer (else query and value), NF4 weights, measured GB (None: ran out), capacity
LITGPT = [
    # The resource tables: bf16-true, LoRA r8 on query and value, the longest Alpaca example, an A100-40GB.
    ("Llama-2-7B LoRA r8 b1", "Llama-2-7b-hf", 1, 1304, 8, False, False, 21.30, "A100-40GB"),
    ("Llama-2-7B LoRA r8 b2", "Llama-2-7b-hf", 2, 1304, 8, False, False, 29.07, "A100-40GB"),
    ("Llama-2-7B LoRA r8 b4 (ran out on 40 GB)", "Llama-2-7b-hf", 4, 1304, 8, False, False, None, "A100-40GB"),
    ("Llama-2-7B QLoRA (NF4) r8 b1", "Llama-2-7b-hf", 1, 1304, 8, False, True, 14.14, "A100-40GB"),
    ("StableLM-3B LoRA r8 b1", "stablelm-base-alpha-3b", 1, 1034, 8, False, False, 9.69, "A100-40GB"),
    ("StableLM-3B LoRA r8 b2", "stablelm-base-alpha-3b", 2, 1034, 8, False, False, 12.10, "A100-40GB"),
    ("StableLM-3B LoRA r8 b4", "stablelm-base-alpha-3b", 4, 1034, 8, False, False, 16.92, "A100-40GB"),
    ("StableLM-3B QLoRA (NF4) r8 b1", "stablelm-base-alpha-3b", 1, 1034, 8, False, True, 6.35, "A100-40GB"),
    # The config hub (its files of April 2024, when the table was measured): 512 tokens on an A10G,
    # whose 23,028 MiB less the context leave 21,748 MiB to the allocator.
    ("Llama-2-7B LoRA r32 b2", "Llama-2-7b-hf", 2, 512, 32, False, False, 19.77, "21748MiB"),
    ("Mistral-7B LoRA r32 b2", "Mistral-7B-v0.1", 2, 512, 32, False, False, 20.66, "21748MiB"),
    ("Llama-3-8B LoRA r32 b1", "Meta-Llama-3-8B", 1, 512, 32, False, False, 19.73, "21748MiB"),
    ("Gemma-2B LoRA r16 b2", "gemma-2b", 2, 512, 8, True, False, 12.62, "21748MiB"),
    ("Gemma-7B LoRA r16 b1 (ran out on 24 GB)", "gemma-7b", 1, 512, 16, True, False, None, "21748MiB"),
    ("TinyLlama-1.1B full bf16 b4", "tiny-llama-1.1b", 4, 512, 0, False, False, 14.10, "21748MiB"),
]


class MatMul4BitOf041(torch.autograd.Function):
    """bitsandbytes 0.41's 4-bit matmul, which the resource tables ran (their bitsandbytes 0.41.1).

    It dequantized the weight for each product and kept the layer's input
    for backward as an attribute of its context, alive until the graph is
    freed, though backward needs only the weight; 0.43.2 stopped keeping it
    ("fix QLoRA mem bug: delete useless buffered activation",
    bitsandbytes#1270), so today's bitsandbytes holds less.
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, state: Any, bias: Any) -> torch.Tensor:
        weight = bnb.functional.dequantize_4bit(b, state).to(a.dtype)
        ctx.state = state
        ctx.tensors = (a, b)
        return torch.nn.functional.linear(a, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _a, b = ctx.tensors
        return grad @ bnb.functional.dequantize_4bit(b, ctx.state).to(grad.dtype), None, None, None


def test_the_traced_litgpt_rows_match_the_published_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    litgpt = pytest.importorskip("litgpt", reason="litgpt is not installed for this Python (scripts/test.sh installs it)")
    from lightning.fabric.plugins import BitsandbytesPrecision
    from litgpt import lora
    from litgpt.utils import chunked_cross_entropy

    monkeypatch.setattr(bnb, "matmul_4bit", lambda a, b, quant_state, out=None, bias=None: MatMul4BitOf041.apply(a, b, quant_state, bias))
    rows, errors, wrong = [], [], []
    for name, config_name, micro, seq, rank, every_layer, nf4, gb, capacity in LITGPT:
        targets = ("query", "key", "value", "projection", "mlp", "head") if every_layer else ("query", "value")

        def build(
            config_name: str = config_name, rank: int = rank, targets: tuple[str, ...] = targets, seq: int = seq, nf4: bool = nf4
        ) -> torch.nn.Module:
            # bf16-true: Fabric builds the model with bfloat16 as the default dtype.
            torch.set_default_dtype(torch.bfloat16)
            try:
                if rank:
                    flags = {f"lora_{t}": True for t in targets}
                    model = lora.GPT(lora.Config.from_name(config_name, lora_r=rank, lora_alpha=16, lora_dropout=0.05, **flags))
                    lora.mark_only_lora_as_trainable(model)
                else:
                    model = litgpt.GPT(litgpt.Config.from_name(config_name))
            finally:
                torch.set_default_dtype(torch.float32)
            if nf4:
                # --quantize bnb.nf4: Fabric's plugin swaps the linear layers; the move to the GPU quantizes them.
                model = BitsandbytesPrecision("nf4", torch.bfloat16).convert_module(model).cuda()
            model.max_seq_length = seq
            return model

        def loss(model: torch.nn.Module, data: torch.Tensor, rank: int = rank) -> torch.Tensor:
            # finetune/lora.py and finetune/full.py's step, as written.
            input_ids, targets = data[:, :-1], data[:, 1:]
            if rank:
                logits = model(input_ids, lm_head_chunk_size=128)
                logits[-1] = logits[-1][..., :-1, :]
                return chunked_cross_entropy(logits, targets[..., 1:])
            return chunked_cross_entropy(model(input_ids)[..., :-1, :], targets[..., 1:])

        vocab = litgpt.Config.from_name(config_name).vocab_size
        r = oomkit.preflight(
            build,
            lambda b, vocab=vocab, seq=seq: torch.randint(0, vocab, (b, seq + 1)),
            micro_batch=micro,
            loss=loss,
            # Accumulation keeps the gradients through the next micro-batch, as
            # the runs' 4 to 16 micro-batches a step did; two show the same.
            grad_accum=2,
            optimizer=lambda params: torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0),
            capacity=capacity,
        )
        traced = r.peak_allocated_bytes  # max_memory_allocated, what LitGPT printed
        if gb is None:
            rows.append(f"| {name} | ran out | {_formula(name)} | {traced / 1e9:.2f} GB | - |")
            if r.fits:
                wrong.append(name)
            continue
        rows.append(_row(name, int(gb * 1e9), traced))
        errors.append((name, traced / (gb * 1e9) - 1))
    doc = (ROOT / "VALIDATION.md").read_text()
    missing = [row for row in rows if row not in doc]
    assert not missing, "VALIDATION.md lacks these traced rows (or shows old figures):\n" + "\n".join(missing)
    assert not wrong, f"traced as fitting, though they ran out of memory: {wrong}"
    off = [(n, e) for n, e in errors if abs(e) > KNOWN_MISSES.get(n, TOLERANCE)]
    assert not off, off
    summary = re.search(r"(\d+) traced LitGPT cases: (\d+) within 5%", doc)
    within = sum(abs(e) <= 0.05 for _, e in errors)
    assert summary and summary.groups() == (str(len(errors)), str(within)), (len(errors), within)


#: The config-hub rows run here through LitGPT's own command (scripts/litgpt_tables.sh runs them
#: all, about 20 s each): the model, its measured GB (None: ran out), and the case of VALIDATION.md's
#: table. Gemma 2B is the row the written-out step above misses by most.
THROUGH_LITGPT = {
    "gemma-2b": ("Gemma-2B LoRA r16 b2", 12.62),
}


def test_the_config_hub_rows_through_litgpts_own_command_match(tmp_path: Path) -> None:
    import os
    import subprocess

    if subprocess.run([sys.executable, "-c", "import litgpt.__main__, jsonargparse"], capture_output=True).returncode != 0:
        pytest.skip(f"LitGPT and jsonargparse are not installed beside {sys.executable} (scripts/test.sh installs them)")
    env = dict(os.environ, LITGPT_ROWS=" ".join(THROUGH_LITGPT), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "litgpt_tables.sh"), str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert p.returncode == 0, p.stderr[-3000:]
    printed = re.findall(r"^(.+?) \(.*?\)\s+peak allocated\s+([\d.]+) GB, fits: (True|False)$", p.stdout, re.M)
    assert len(printed) == len(THROUGH_LITGPT), p.stdout
    doc = (ROOT / "VALIDATION.md").read_text()
    for (_, gb, fits), (case, measured) in zip(printed, THROUGH_LITGPT.values()):
        if measured is None:
            assert fits == "False", (case, gb)
            row = f"| {case} | ran out | {gb} GB, does not fit | - |"
        else:
            error = float(gb) / measured - 1
            assert abs(error) <= 0.05, (case, gb, measured)
            row = f"| {case} | {measured:.2f} GB | {gb} GB | {100 * error:+.1f}% |"
        assert row in doc, f"VALIDATION.md lacks this row (or shows an old figure):\n{row}"
