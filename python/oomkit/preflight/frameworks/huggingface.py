"""Hugging Face models under preflight: the sequence bounds a script keeps, and the model of a config.

A script's tokenizer and trainer say the longest sequence it keeps, as
torchtune's and LitGPT's recipes do (:class:`SequenceBounds`, which also
pads their batches to it). ``oomkit estimate --config ... --trace`` builds
its model here (:func:`model_from_config`) the way a fine-tuning script
does, with ``from_pretrained``, ``BitsAndBytesConfig`` and PEFT, which
preflight answers from the config alone: the script path and the
no-script path are one way of making a model from its config.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypeGuard

import torch

#: transformers' module of the tokenizers' base class, whose ``__call__`` truncates and pads.
TOKENIZER_BASE = "transformers.tokenization_utils_base"

#: transformers' module of the Trainer, whose arguments (TRL's ``max_length``) bound sequences.
TRAINER = "transformers.trainer"

#: torchtune's data module, whose ``padded_collate_sft`` its recipes collate their batches with.
TORCHTUNE_DATA = "torchtune.data"

#: LitGPT's model, whose ``max_seq_length`` its recipes set to their data's longest sequence.
LITGPT_MODEL = "litgpt.model"

#: LitGPT's data module, whose ``get_sft_collate_fn`` its data sets collate their batches with.
LITGPT_DATA = "litgpt.data.base"

#: What a LitGPT recipe's bound is called in the answer's notes.
LITGPT_BOUND = "LitGPT's model.max_seq_length"

#: The names trainers' arguments give the longest sequence they keep (TRL's SFT and DPO, older TRL).
LENGTH_ARGUMENTS = ("max_length", "max_seq_length")


class SequenceBounds:
    """The longest sequence the script says it keeps: a tokenizer call that truncates or pads to
    ``max_length``, or a trainer's ``max_length`` argument; each with where it was said."""

    def __init__(self) -> None:
        #: The largest bound said, and by what.
        self.longest: tuple[int, str] | None = None
        #: The longest sequence of a batch padded to ``longest`` (None: none was).
        self.padded_from: int | None = None
        # The same, for batches a data loader's worker processes padded: shared memory, made
        # (before the workers fork) only where a collate that pads may run in one.
        self._padded_in_workers: Any = None

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

    def pad_to_longest(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A training forward's token batch padded to the longest sequence the script keeps (a
        forward pre-hook with keyword arguments), so that a step runs at its longest batch.

        The sequence is the second size of the first integer tensor of two
        dimensions among the inputs (``input_ids``); every input of that
        batch and sequence (its attention mask, labels, positions) is padded
        along the sequence alike. A forward without gradients (evaluation,
        generation), or already at the longest, is left as it is.
        """
        if self.longest is None or not torch.is_grad_enabled():
            return None
        values = [*args, *kwargs.values()]
        ids = kwargs.get("input_ids")
        if not _token_batch(ids):
            ids = next((v for v in values if _token_batch(v)), None)
        if ids is None:
            return None
        batch, length = int(ids.shape[0]), int(ids.shape[1])
        if not self._pads(length):
            return None

        def padded(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == batch and v.shape[1] == length:
                return self._padded(v)
            return v

        return tuple(padded(a) for a in args), {k: padded(v) for k, v in kwargs.items()}

    def _pads(self, length: int) -> bool:
        """Whether a batch of sequences ``length`` long is padded (shorter than the longest kept), noted if so."""
        if self.longest is None or length >= self.longest[0]:
            return False
        if torch.utils.data.get_worker_info() is not None and self._padded_in_workers is not None:
            with self._padded_in_workers.get_lock():
                self._padded_in_workers.value = max(self._padded_in_workers.value, length)
        self.padded_from = max(self.padded_from or 0, length)
        return True

    def padded_longest(self) -> int | None:
        """The longest sequence of a batch padded to ``longest``, in this process or a data loader's worker (None: none was)."""
        in_workers = self._padded_in_workers.value if self._padded_in_workers is not None else 0
        found = max(self.padded_from or 0, in_workers)
        return found or None

    def _padded(self, t: torch.Tensor, value: int = 0) -> torch.Tensor:
        """``t`` (batch x sequence x ...) with its sequence grown to the longest kept, filled with ``value``."""
        assert self.longest is not None
        grow = (0, 0) * (t.dim() - 2) + (0, self.longest[0] - int(t.shape[1]))
        return torch.nn.functional.pad(t, grow, value=value)

    def _padded_batch(self, out: Any, tokens: str, pad: int, ignore: int) -> Any:
        """A collated batch (a dict) with its token batch under ``tokens`` padded with ``pad`` to the
        longest kept, and its labels, of the same shape, with ``ignore``; as it is if not padded."""
        ids = out.get(tokens) if isinstance(out, dict) else None
        if not _token_batch(ids) or not self._pads(int(ids.shape[1])):
            return out
        out[tokens] = self._padded(ids, pad)
        if isinstance(out.get("labels"), torch.Tensor) and out["labels"].shape == ids.shape:
            out["labels"] = self._padded(out["labels"], ignore)
        return out

    def said_by_recipe(self, n: Any, by: str) -> None:
        """A framework's recipe said the longest sequence it keeps (torchtune's ``tokenizer.max_seq_len``)."""
        self._said(n, by)

    def collate_stand_ins(self, data: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """torchtune's ``padded_collate_sft`` that, from its second batch on, pads the batch's
        tokens and labels to the longest sequence the recipe keeps (its loss reads the labels
        outside the model, so the batch is padded where it is made, tokens and labels alike)."""
        collate = getattr(data, "padded_collate_sft", None)
        if collate is None:
            return []
        calls = [0]

        def padded_collate_sft(batch: Any, padding_idx: int = 0, ignore_idx: int = -100, *args: Any, **kwargs: Any) -> Any:
            out = collate(batch, padding_idx, ignore_idx, *args, **kwargs)
            calls[0] += 1
            return out if calls[0] == 1 else self._padded_batch(out, "tokens", padding_idx, ignore_idx)

        return [(data, "padded_collate_sft", padded_collate_sft)]

    def litgpt_model_stand_ins(self, model: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """LitGPT's ``GPT.max_seq_length`` that notes what a recipe sets it to: its data's longest
        sequence, or its ``--train.max_seq_length`` if shorter, which its collate pads batches up to
        (the model's own setting to its context length, in its constructor, is no bound of the data)."""
        cls = getattr(model, "GPT", None)
        prop = vars(cls).get("max_seq_length") if cls is not None else None
        if not isinstance(prop, property) or prop.fset is None:
            return []
        fget, fset = prop.fget, prop.fset

        def max_seq_length(gpt: Any, value: int) -> None:
            fset(gpt, value)
            if not _constructing(gpt):
                self._said(value, LITGPT_BOUND)

        return [(cls, "max_seq_length", property(fget, max_seq_length, prop.fdel, prop.__doc__))]

    def litgpt_collate_stand_ins(self, base: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """LitGPT's ``get_sft_collate_fn`` whose collate, from each data loader's second batch on, pads
        the batch's tokens and labels to the longest sequence the recipe keeps (its loss reads the
        labels outside the model). Each loader gets its own count of the batches made, in the
        loader's order where its worker processes make them (a worker makes every n-th)."""
        make = getattr(base, "get_sft_collate_fn", None)
        if make is None:
            return []
        import multiprocessing

        if self._padded_in_workers is None:
            self._padded_in_workers = multiprocessing.Value("i", 0)

        def get_sft_collate_fn(max_seq_length: int = -1, pad_id: int = 0, ignore_index: int = -100) -> Any:
            collate = make(max_seq_length, pad_id, ignore_index)
            made = [0]

            def padded_collate(samples: Any) -> Any:
                out = collate(samples)
                index = _in_loader_order(made[0])
                made[0] += 1
                return out if index == 0 else self._padded_batch(out, "input_ids", pad_id, ignore_index)

            return padded_collate

        return [(base, "get_sft_collate_fn", get_sft_collate_fn)]

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


#: How far up from a setter the constructor of the object set is looked for (``nn.Module.__setattr__`` is between).
_SETTER_DEPTH = 4


def _constructing(obj: Any) -> bool:
    """Whether ``obj``'s own constructor is what is setting an attribute of it (a few frames up)."""
    f: Any = sys._getframe(2)
    for _ in range(_SETTER_DEPTH):
        if f is None:
            return False
        if f.f_code.co_name == "__init__" and f.f_locals.get("self") is obj:
            return True
        f = f.f_back
    return False


def _in_loader_order(made: int) -> int:
    """Which of its data loader's batches is the ``made``-th this process collated: a loader with
    worker processes hands batch i to worker i mod n, so each worker's k-th is the loader's k n + id."""
    worker = torch.utils.data.get_worker_info()
    return made if worker is None else made * worker.num_workers + worker.id


def _token_batch(v: Any) -> TypeGuard[torch.Tensor]:
    """Whether ``v`` is a batch of token ids: an integer tensor of batch x sequence."""
    return isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point() and v.dtype != torch.bool


#: Attention projections LoRA adapts, by the names models give them: the
#: four of Llama-style and T5 attention, BERT's three, and GPT-2's fused
#: ``c_attn`` (the layer PEFT adapts for GPT-2).
LORA_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "query", "key", "value", "q", "k", "v", "o", "c_attn"})

#: The name a model folder gives its config, which ``from_pretrained`` reads.
CONFIG_NAME = "config.json"


def model_from_config(folder: str, s: dict[str, Any]) -> Any:
    """The model of ``folder``'s ``config.json``, made as a fine-tuning script makes it, with the
    estimate's flags ``s`` (``dtype``, ``mixed_precision``, ``flash_attention``,
    ``grad_checkpointing``, ``load_in_4bit``, ``lora_rank``), in training mode.

    It is ``from_pretrained`` of the class the config names, which preflight
    answers from the config alone (no weight file is read), with
    transformers' ``BitsAndBytesConfig`` for 4-bit weights (NF4, its
    defaults) and PEFT's ``get_peft_model`` for LoRA on the attention
    projections: the same calls, and so the same figures, as a script's.
    The rest of a 4-bit model stays in ``dtype``: ``prepare_model_for_kbit_training``,
    which a script may add, would keep it in float32.
    """
    import torch
    import transformers

    with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as f:
        config = json.load(f)
    kind = config.get("model_type")
    if not kind:
        raise ValueError("the config has no model_type")
    if kind not in transformers.CONFIG_MAPPING:
        # transformers' own error lists every type it knows (hundreds): one line says what to do.
        raise ValueError(
            f"the installed transformers ({transformers.__version__}) has no model type {kind!r}, which the config names: "
            "upgrade transformers, or give a config of a type it has"
        )
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[s["dtype"]]
    options: dict[str, Any] = {
        # Mixed precision keeps the weights in float32 and casts in autocast.
        "dtype": torch.float32 if s["mixed_precision"] else dtype,
        "attn_implementation": "sdpa" if s["flash_attention"] else "eager",
    }
    if s.get("load_in_4bit"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ValueError("4-bit weights are bitsandbytes': install bitsandbytes where oomkit runs") from None
        options["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    names = config.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    model = (cls or transformers.AutoModelForCausalLM).from_pretrained(folder, **options)
    if s["grad_checkpointing"]:
        model.gradient_checkpointing_enable()
    if s.get("lora_rank"):
        try:
            import peft
        except ImportError:
            raise ValueError("LoRA is PEFT's: install peft where oomkit runs") from None
        targets = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} & LORA_TARGETS)
        if not targets:
            known = ", ".join(sorted(LORA_TARGETS))
            raise ValueError(f"{type(model).__name__} has none of the attention projections LoRA adapts ({known})")
        if s["grad_checkpointing"]:
            # The frozen embedding's output must carry a gradient for checkpointed blocks to run their backward.
            model.enable_input_require_grads()
        model = peft.get_peft_model(model, peft.LoraConfig(r=int(s["lora_rank"]), target_modules=targets))
    return model.train()


def random_batch(model: Any, config: dict[str, Any], seq: int, b: int) -> dict[str, Any]:
    """A batch of ``b`` random sequences, with the labels the model's head takes."""
    import torch

    vocab = int(config.get("vocab_size") or 32000)
    ids = torch.randint(0, vocab, (b, seq))
    sequence_classifier = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.randint(0, 2, (b,)) if sequence_classifier else ids
    return {"input_ids": ids, "labels": labels}
