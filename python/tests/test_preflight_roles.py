"""Preflight as the oracle of `oomkit analyze`'s roles.

Preflight knows the role of every allocation (it holds the model, the
gradients and the optimizer); `analyze` tells roles from frames and
lifetimes alone. Each case runs a training step of a model family through
preflight, writes the snapshot, lets `analyze` tell its roles, and compares
the bytes of each role at the peak. The agreement of a case is the share of
the peak's bytes that `analyze` gives the role preflight knows (the sum
over roles of the smaller of the two figures, over the peak). The table is
printed (pytest -s) and every case must reach MIN_AGREEMENT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")

import oomkit  # noqa: E402

OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")

#: The share of the peak every case's roles must agree on.
MIN_AGREEMENT = 0.95

V, L = 4096, 128


def lm_batch(b: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (b, L))
    return {"input_ids": ids, "labels": ids}


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_head=4, n_embd=256, vocab_size=V, n_positions=L))


def gpt2_checkpointed() -> nn.Module:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_head=4, n_embd=256, vocab_size=V, n_positions=L))
    model.gradient_checkpointing_enable()
    return model


def bert() -> nn.Module:
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=1024, vocab_size=V)
    return transformers.BertForSequenceClassification(cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(d_model=256, d_ff=1024, num_layers=2, num_heads=4, vocab_size=V, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def vit() -> nn.Module:
    cfg = transformers.ViTConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=1024, image_size=128, patch_size=16, num_labels=10)
    return transformers.ViTForImageClassification(cfg)


def mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=V,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


class ReassigningSGD(torch.optim.Optimizer):
    """An optimizer that gives each parameter a new tensor (``p.data = ...``) in its step."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = p.data - group["lr"] * p.grad


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any], dict[str, Any]]] = {
    "decoder LM, AdamW": (gpt2, lm_batch, {}),
    "decoder LM, AdamW, bf16 autocast": (gpt2, lm_batch, {"autocast": torch.bfloat16}),
    "decoder LM, SGD momentum, accumulation 2": (gpt2, lm_batch, {"optimizer": "sgd", "grad_accum": 2}),
    "decoder LM, AdamW, checkpointing": (gpt2_checkpointed, lm_batch, {}),
    "decoder LM, p.data reassigned by the optimizer": (gpt2, lm_batch, {"optimizer": ReassigningSGD}),
    "encoder, Adafactor": (bert, lambda b: {"input_ids": torch.randint(0, V, (b, L)), "labels": torch.randint(0, 2, (b,))}, {"optimizer": "adafactor"}),
    "encoder-decoder, AdamW": (t5, lambda b: {"input_ids": torch.randint(0, V, (b, L)), "labels": torch.randint(0, V, (b, 32))}, {}),
    "vision, AdamW, fp16 autocast": (vit, lambda b: {"pixel_values": torch.randn(b, 3, 128, 128), "labels": torch.randint(0, 10, (b,))}, {"autocast": torch.float16}),
    "mixture of experts, AdamW": (mixtral, lm_batch, {}),
}


def agreement(truth: dict[str, int], told: dict[str, int]) -> float:
    total = sum(told.values())
    return sum(min(truth.get(r, 0), told.get(r, 0)) for r in set(truth) | set(told)) / total


@pytest.mark.parametrize("name", list(CASES))
def test_analyze_tells_the_roles_preflight_knows(name: str, tmp_path: Any) -> None:
    build, batch, settings = CASES[name]
    path = tmp_path / "step.pickle"
    truth = oomkit.preflight(build, batch, micro_batch=4, snapshot=path, **settings).by_role
    out = subprocess.run([OOMKIT, "analyze", "--json", str(path)], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    told = doc.get("files", [doc])[0]["devices"][0]["roles"]["peak"]
    share = agreement(truth, told)
    mib = lambda d: {k: round(v / 2**20, 1) for k, v in d.items() if v}  # noqa: E731
    print(f"\n{name}: {share:.1%} agree\n  preflight {mib(truth)}\n  analyze   {mib(told)}")
    assert share >= MIN_AGREEMENT, (name, share, mib(truth), mib(told))
