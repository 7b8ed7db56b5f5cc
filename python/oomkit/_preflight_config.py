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
from oomkit._preflight_driver import OPTIMIZERS

#: The environment variable carrying the settings from ``oomkit estimate``.
ENV = "OOMKIT_PREFLIGHT_CONFIG"

#: Attention projections LoRA adapts, by the names models give them: the
#: four of Llama-style and T5 attention, BERT's three, and GPT-2's fused
#: ``c_attn`` (the layer PEFT adapts for GPT-2).
LORA_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "query", "key", "value", "q", "k", "v", "o", "c_attn"})

#: ZeRO stages preflight runs, as what PyTorch keeps the same states with:
#: DDP for stage 0 (nothing sharded), DDP with ZeroRedundancyOptimizer for 1,
#: FSDP's strategies for 2 and 3.
ZERO_SHARDING = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}

#: Output heads, kept in the compute dtype when the rest is quantized to 4 bits (as transformers does).
HEAD_NAMES = frozenset({"lm_head", "classifier", "score", "qa_outputs"})


def _features(layer: Any) -> tuple[int, int] | None:
    """A linear layer's (in, out) features: ``nn.Linear``'s, or GPT-2's ``Conv1D`` (its weight is in x out)."""
    import torch

    if isinstance(layer, torch.nn.Linear) or (hasattr(layer, "in_features") and hasattr(layer, "out_features")):
        return int(layer.in_features), int(layer.out_features)
    if type(layer).__name__ == "Conv1D" and getattr(layer, "weight", None) is not None and layer.weight.dim() == 2:
        return int(layer.weight.shape[0]), int(layer.weight.shape[1])
    return None


def _lora(base: Any, rank: int, dtype: Any) -> Any:
    """A LoRA-adapted linear layer: the frozen ``base`` plus two trainable factors in ``dtype``."""
    import torch
    from torch import nn

    features = _features(base)
    assert features is not None
    inner, outer = features

    class LoRALinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Linear(inner, rank, bias=False, dtype=dtype)
            self.b = nn.Linear(rank, outer, bias=False, dtype=dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.b(self.a(x))

    return LoRALinear()


def _quantize_4bit(model: Any, dtype: Any) -> int:
    """Replaces every linear layer but the output head by bitsandbytes' NF4 layer, quantized on meta.

    bitsandbytes (0.46 and later) gives its 4-bit operations fake
    implementations, so the packed weights (half a byte per parameter plus
    an fp32 scale per block of 64) and the dequantized weight each matmul
    makes are the real layer's. Returns how many layers were replaced.
    """
    import torch

    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("4-bit weights are bitsandbytes': install bitsandbytes where oomkit runs") from None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # GPT-2's Conv1D is a linear layer stored transposed; transformers quantizes it too.
            features = _features(child) if type(child) is torch.nn.Linear or type(child).__name__ == "Conv1D" else None
            if name in HEAD_NAMES or features is None:
                continue
            layer = bnb.nn.Linear4bit(
                *features,
                bias=child.bias is not None,
                compute_dtype=dtype,
                # transformers' BitsAndBytesConfig defaults: NF4, no double quantization.
                compress_statistics=False,
                quant_type="nf4",
                device="meta",
            )
            quantize = getattr(layer.weight, "_quantize", None)
            if quantize is None:
                raise ValueError(f"bitsandbytes {bnb.__version__} cannot quantize on meta tensors")
            layer.weight = quantize("meta")
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(torch.empty_like(child.bias, dtype=dtype), requires_grad=False)
            setattr(parent, name, layer)
            replaced += 1
    if not replaced:
        raise ValueError("the model has no linear layer to quantize to 4 bits")
    return replaced


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
    if s.get("load_in_4bit"):
        model.requires_grad_(False)
        _quantize_4bit(model, dtype)
    if s.get("lora_rank"):
        model.requires_grad_(False)
        adapters = torch.float32 if s["mixed_precision"] else dtype
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if name in LORA_TARGETS and _features(child) is not None:
                    setattr(parent, name, _lora(child, int(s["lora_rank"]), adapters))
    return model.train()


#: The EMA's decay; memory does not depend on it.
EMA_DECAY = 0.999

#: Said in the answer when the step keeps an EMA copy.
EMA_NOTE = "the EMA copy (one more copy of every weight, updated in place after each optimizer step) counts as parameters"


def _with_ema(model: Any) -> Any:
    """Attaches an exponential moving average of ``model``'s weights, as a frozen copy the optimizer's steps update.

    The copy is a submodule, so it is counted with the weights; the update
    (``torch._foreach_lerp_``, in place, as timm's ``ModelEmaV3`` does it)
    runs after each optimizer step, from the hook the optimizer factory of
    :func:`_ema_updating` registers.
    """
    import torch

    live = list(model.parameters())
    holder = torch.nn.Module()
    holder.weights = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in live)
    model.oomkit_ema = holder
    model.oomkit_ema_pairs = (list(holder.weights), live)
    return model


def _ema_updating(make: Any, model: Any) -> Any:
    """``make``'s optimizer, which moves ``model``'s EMA copy toward the weights after each step."""
    import torch

    def build(params: Any) -> Any:
        opt = make(params)
        averages, live = model().oomkit_ema_pairs

        @torch.no_grad()
        def update(*_: Any) -> None:
            torch._foreach_lerp_(averages, live, 1 - EMA_DECAY)

        opt.register_step_post_hook(update)
        return opt

    return build


def _batch(model: Any, config: dict[str, Any], seq: int, b: int) -> dict[str, Any]:
    """A batch of ``b`` random sequences, with the labels the model's head takes."""
    import torch

    vocab = int(config.get("vocab_size") or 32000)
    ids = torch.randint(0, vocab, (b, seq))
    sequence_classifier = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.randint(0, 2, (b,)) if sequence_classifier else ids
    return {"input_ids": ids, "labels": labels}


def _unsupported(s: dict[str, Any]) -> str | None:
    if int(s.get("gpus", 1)) > 1 and int(s.get("zero", 0)) not in ZERO_SHARDING:
        return f"ZeRO stage {s.get('zero', 0)} is not one PyTorch runs"
    if s.get("ema") and int(s.get("gpus", 1)) > 1:
        return "an EMA copy of sharded weights is not traced"
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
                model = _build(config, s)
                built.append(_with_ema(model) if s.get("ema") else model)
                return built[-1]

            optimizer: Any = {"adamw": "adamw", "sgd": "sgd", "adafactor": "adafactor", "adamw8bit": "adamw8bit"}[s["optimizer"]]
            if s.get("ema"):
                optimizer = _ema_updating(OPTIMIZERS[optimizer], lambda: built[-1])
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
                gpus=int(s.get("gpus", 1)),
                sharding=ZERO_SHARDING.get(int(s.get("zero", 0)), "fsdp"),
            )
            if s.get("ema"):
                answer.notes.append(EMA_NOTE)
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
