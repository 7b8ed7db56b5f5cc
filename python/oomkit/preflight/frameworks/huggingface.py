"""Hugging Face models under preflight: built from their config on ``meta``, with LoRA adapters and 4-bit layers.

No weight file is read and nothing is downloaded: the model is the class
its config names, built by transformers from the config alone on the
fake GPU. LoRA adapts the attention projections as PEFT does, and 4-bit
quantization replaces the linear layers by bitsandbytes' NF4 layers as
transformers' ``BitsAndBytesConfig`` does, so each holds what the real
model holds on a GPU. ``oomkit estimate --config config.json --trace``
builds its model here (``config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: transformers' module of the tokenizers' base class, whose ``__call__`` truncates and pads.
TOKENIZER_BASE = "transformers.tokenization_utils_base"

#: transformers' module of the Trainer, whose arguments (TRL's ``max_length``) bound sequences.
TRAINER = "transformers.trainer"

#: The names trainers' arguments give the longest sequence they keep (TRL's SFT and DPO, older TRL).
LENGTH_ARGUMENTS = ("max_length", "max_seq_length")


class SequenceBounds:
    """The longest sequence the script says it keeps: a tokenizer call that truncates or pads to
    ``max_length``, or a trainer's ``max_length`` argument; each with where it was said."""

    def __init__(self) -> None:
        #: The largest bound said, and by what.
        self.longest: tuple[int, str] | None = None

    def _said(self, n: Any, by: str) -> None:
        if isinstance(n, int) and not isinstance(n, bool) and n > 0 and (self.longest is None or n > self.longest[0]):
            self.longest = (n, by)

    def tokenizer_stand_ins(self, base: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``PreTrainedTokenizerBase.__call__`` that notes a truncation or padding to ``max_length``."""
        cls = getattr(base, "PreTrainedTokenizerBase", None)
        if cls is None:
            return []
        call = cls.__call__

        def __call__(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("truncation") or kwargs.get("padding") == "max_length":
                self._said(kwargs.get("max_length"), "the tokenizer's max_length")
            return call(tokenizer, *args, **kwargs)

        return [(cls, "__call__", __call__)]

    def trainer_stand_ins(self, trainer: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``Trainer.__init__`` that notes its arguments' sequence bound (TRL's trainers pass theirs)."""
        cls = getattr(trainer, "Trainer", None)
        init = getattr(cls, "__init__", None)
        if init is None:
            return []

        def __init__(self_: Any, *args: Any, **kwargs: Any) -> None:
            init(self_, *args, **kwargs)
            arguments = getattr(self_, "args", None)
            for name in LENGTH_ARGUMENTS:
                self._said(getattr(arguments, name, None), f"the trainer's {name}")

        return [(cls, "__init__", __init__)]

#: Attention projections LoRA adapts, by the names models give them: the
#: four of Llama-style and T5 attention, BERT's three, and GPT-2's fused
#: ``c_attn`` (the layer PEFT adapts for GPT-2).
LORA_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "query", "key", "value", "q", "k", "v", "o", "c_attn"})

#: Output heads, kept in the compute dtype when the rest is quantized to 4 bits (as transformers does).
HEAD_NAMES = frozenset({"lm_head", "classifier", "score", "qa_outputs"})


def linear_features(layer: Any) -> tuple[int, int] | None:
    """A linear layer's (in, out) features: ``nn.Linear``'s, or GPT-2's ``Conv1D`` (its weight is in x out)."""
    import torch

    if isinstance(layer, torch.nn.Linear) or (hasattr(layer, "in_features") and hasattr(layer, "out_features")):
        return int(layer.in_features), int(layer.out_features)
    if type(layer).__name__ == "Conv1D" and getattr(layer, "weight", None) is not None and layer.weight.dim() == 2:
        return int(layer.weight.shape[0]), int(layer.weight.shape[1])
    return None


def lora_linear(base: Any, rank: int, dtype: Any) -> Any:
    """A LoRA-adapted linear layer: the frozen ``base`` plus two trainable factors in ``dtype``."""
    import torch
    from torch import nn

    features = linear_features(base)
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


def quantize_4bit(model: Any, dtype: Any) -> int:
    """Replaces every linear layer but the output head by bitsandbytes' NF4 layer, quantized on the fake GPU.

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
            features = linear_features(child) if type(child) is torch.nn.Linear or type(child).__name__ == "Conv1D" else None
            if name in HEAD_NAMES or features is None:
                continue
            layer = bnb.nn.Linear4bit(
                *features,
                bias=child.bias is not None,
                compute_dtype=dtype,
                # transformers' BitsAndBytesConfig defaults: NF4, no double quantization.
                compress_statistics=False,
                quant_type="nf4",
                # The fake GPU's device (meta underneath): the layer is on the GPU, not the script's meta.
                device="cuda",
            )
            quantize = getattr(layer.weight, "_quantize", None)
            if quantize is None:
                raise ValueError(f"bitsandbytes {bnb.__version__} cannot quantize on meta tensors")
            layer.weight = quantize("cuda")
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(torch.empty_like(child.bias, dtype=dtype), requires_grad=False)
            setattr(parent, name, layer)
            replaced += 1
    if not replaced:
        raise ValueError("the model has no linear layer to quantize to 4 bits")
    return replaced


def model_from_config(config: dict[str, Any], s: dict[str, Any]) -> Any:
    """The model ``config`` describes, built as the estimate's flags ``s`` say (``dtype``,
    ``mixed_precision``, ``flash_attention``, ``grad_checkpointing``, ``load_in_4bit``,
    ``lora_rank``), in training mode."""
    import torch
    import transformers

    kind = config.get("model_type")
    if not kind:
        raise ValueError("the config has no model_type")
    if kind not in transformers.CONFIG_MAPPING:
        # transformers' own error lists every type it knows (hundreds): one line says what to do.
        raise ValueError(
            f"the installed transformers ({transformers.__version__}) has no model type {kind!r}, which the config names: "
            "upgrade transformers, or give a config of a type it has"
        )
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
        quantize_4bit(model, dtype)
    if s.get("lora_rank"):
        model.requires_grad_(False)
        adapters = torch.float32 if s["mixed_precision"] else dtype
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if name in LORA_TARGETS and linear_features(child) is not None:
                    setattr(parent, name, lora_linear(child, int(s["lora_rank"]), adapters))
    return model.train()


def random_batch(model: Any, config: dict[str, Any], seq: int, b: int) -> dict[str, Any]:
    """A batch of ``b`` random sequences, with the labels the model's head takes."""
    import torch

    vocab = int(config.get("vocab_size") or 32000)
    ids = torch.randint(0, vocab, (b, seq))
    sequence_classifier = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.randint(0, 2, (b,)) if sequence_classifier else ids
    return {"input_ids": ids, "labels": labels}
