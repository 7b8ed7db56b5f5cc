"""``oomkit estimate --config config.json --trace``: the model built from its config, its step traced.

``oomkit estimate`` runs ``python -m oomkit._preflight_config`` with its
settings in ``OOMKIT_PREFLIGHT_CONFIG`` (JSON); this builds the Hugging
Face model from the config on ``meta`` (no download, no weights), runs the
training step the flags describe through :func:`oomkit.preflight`, and
writes the answer (or the one line why it cannot) to the result file.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import oomkit

#: The environment variable carrying the settings from ``oomkit estimate``.
ENV = "OOMKIT_PREFLIGHT_CONFIG"

#: Attention projections LoRA adapts, as the formula counts them (query and value).
LORA_TARGETS = ("q_proj", "v_proj", "query", "value", "q", "v")


def _lora(base: Any, rank: int) -> Any:
    """A LoRA-adapted linear layer: the frozen ``base`` plus two trainable factors."""
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
            self.b = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.b(self.a(x))

    return LoRALinear()


def _build(config: dict[str, Any], s: dict[str, Any]) -> Any:
    import torch
    import transformers

    kind = config.get("model_type")
    if not kind:
        raise ValueError("the config has no model_type")
    cfg = transformers.AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa" if s["flash_attention"] else "eager"
    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    model = cls(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[s["dtype"]]
    if not s["mixed_precision"]:
        model = model.to(dtype)
    if s["grad_checkpointing"]:
        model.gradient_checkpointing_enable()
    if s.get("lora_rank"):
        model.requires_grad_(False)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if name in LORA_TARGETS and isinstance(child, torch.nn.Linear):
                    setattr(parent, name, _lora(child, int(s["lora_rank"])))
    return model.train()


def _batch(model: Any, config: dict[str, Any], seq: int, b: int) -> dict[str, Any]:
    """A batch of ``b`` random sequences, with the labels the model's head takes."""
    import torch

    vocab = int(config.get("vocab_size") or 32000)
    ids = torch.randint(0, vocab, (b, seq))
    sequence_classifier = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.randint(0, 2, (b,)) if sequence_classifier else ids
    return {"input_ids": ids, "labels": labels}


def _unsupported(s: dict[str, Any]) -> str | None:
    if s.get("load_in_4bit"):
        return "4-bit weights (bitsandbytes NF4) have no meta kernels"
    if s["optimizer"] == "adamw8bit":
        return "the 8-bit optimizer (bitsandbytes) has no meta kernels"
    if int(s.get("gpus", 1)) > 1:
        return "sharding across GPUs is not traced yet"
    if s.get("ema"):
        return "an EMA copy is not traced yet"
    return None


def main() -> int:
    raw = os.environ.get(ENV)
    if not raw:
        sys.stderr.write(f"{ENV} is not set: this module is run by `oomkit estimate --trace`\n")
        return 2
    s = json.loads(raw)
    result: dict[str, Any]
    why = _unsupported(s)
    if why is not None:
        result = {"error": f"not traced: {why}; the formula's figures stand"}
    else:
        try:
            import torch

            with open(s["config"], encoding="utf-8") as f:
                config = json.load(f)
            built: list[Any] = []

            def build() -> Any:
                built.append(_build(config, s))
                return built[-1]

            optimizer = {"adamw": "adamw", "sgd": "sgd", "adafactor": "adafactor"}[s["optimizer"]]
            autocast = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(s["dtype"]) if s["mixed_precision"] else None

            def batch(b: int) -> Any:
                return _batch(built[-1], config, int(s["seq"]), b)

            answer = oomkit.preflight(
                build,
                batch,
                micro_batch=int(s["batch"]),
                optimizer=optimizer,
                autocast=autocast,
                capacity=s["capacity"],
            )
            result = {"result": answer.as_dict()}
        except ImportError as e:
            result = {"error": f"not traced: {e} (install transformers where oomkit runs)"}
        except (oomkit.OomkitError, ValueError, TypeError, KeyError, AttributeError) as e:
            result = {"error": f"not traced: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    with open(s["result"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
