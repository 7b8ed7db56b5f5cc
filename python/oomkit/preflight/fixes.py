"""The changes preflight can make to a script without editing it, each run on the script itself.

``oomkit preflight`` asks "what would make it fit?" by running the user's
own script again with one change at a time (and then all of them), on
tensors without data, so that each answer is a measurement of their code:

- ``checkpoint``: activation checkpointing of the model's repeated blocks
  (:func:`repeated_blocks`), with PyTorch's
  ``torch.utils.checkpoint`` (non-reentrant), as one would add it by hand;
- ``autocast``: every top-level forward run under ``torch.autocast("cuda",
  torch.bfloat16)``, for a script that runs in float32;
- ``adamw8bit``: bitsandbytes' 8-bit ``AdamW8bit`` (``Adam8bit``) made
  wherever the script makes ``torch.optim.AdamW`` (``Adam``);
- ``fsdp``: the model sharded over N GPUs with FSDP's ``fully_shard`` (each
  repeated block, then the model) when the script moves it to the GPU, as
  one shards it by hand before making the optimizer, run as rank 0 of N in
  PyTorch's fake process group.

The allocator's ``expandable_segments`` and a smaller micro-batch with more
accumulation need no change inside the script: the command reruns it with
other settings or another ``{batch}``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from oomkit._native import PreflightError
from oomkit.preflight.frameworks.bitsandbytes import eight_bit_in_place_of_torch
from oomkit.preflight.notes import Notes
from oomkit.preflight.record.roles import inner_optimizers
from oomkit.preflight.world.autocast import Autocast
from oomkit.preflight.world.cuda import is_cuda
from oomkit.preflight.world.dist import shard, spread_in

#: The changes made inside the script, by name.
INSIDE = ("checkpoint", "autocast", "adamw8bit", "fsdp")


class Fixer:
    """The changes made at the model's forwards (checkpointing its blocks, autocast around each)
    and where the script moves it to the GPU (sharding it)."""

    def __init__(self, fixes: list[str], autocast: Autocast, notes: Notes, world_size: int = 1, *, skip_what_cannot: bool = False) -> None:
        self.fixes = fixes
        #: A change that cannot be made here is skipped, and said in ``skipped``, rather than
        #: ending the run: the command's "all of the above", run beside the changes alone.
        self.skip_what_cannot = skip_what_cannot
        self.skipped: list[str] = []
        self.autocast = autocast
        self.world_size = world_size
        self.notes = notes
        self._wrapped: set[int] = set()
        self._in_autocast = False
        self._autocast_applied = False
        #: The model sharded for ``fsdp``, once it is, and PyTorch's ``fully_shard`` that shards it.
        self.sharded: torch.nn.Module | None = None
        self.real_fully_shard: Any = None

    def stand_ins(self) -> list[tuple[Any, str, Any]]:
        """What the changes replace, as (owner, name, value) for the fake GPU's ledger: the
        optimizers made 8-bit, and a module's move to the GPU that shards it."""
        try:
            found = eight_bit_in_place_of_torch() if "adamw8bit" in self.fixes else []
        except PreflightError:
            if not self.skip_what_cannot:
                raise
            found = []
            self.skipped.append("adamw8bit")
        if "fsdp" in self.fixes:
            for name in ("to", "cuda"):
                found.append((torch.nn.Module, name, self._sharding_after(getattr(torch.nn.Module, name))))
            import torch.distributed.fsdp as fsdp

            self.real_fully_shard = fsdp.fully_shard
            found.append((fsdp, "fully_shard", self._not_twice()))
            from torch.nn.parallel import DistributedDataParallel

            found.append((DistributedDataParallel, "__init__", _replicated))
        return found

    def _not_twice(self) -> Any:
        """``fully_shard`` that, called by the script on a model the fix has sharded already, says
        the script shards its model itself (the fix changes nothing there)."""
        fixer = self

        def shard_once(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if fixer.sharded is not None:
                raise PreflightError(_SHARDED_ALREADY)
            return fixer.real_fully_shard(module, *args, **kwargs)

        return shard_once

    def _sharding_after(self, move: Any) -> Any:
        """``Module.to`` (or ``cuda``) that, the first time a model with repeated blocks goes to
        the GPU, shards it over the GPUs as ``fully_shard`` would, before any optimizer sees its
        parameters."""
        fixer = self

        def moved(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = move(module, *args, **kwargs)
            to_gpu = move.__name__ == "cuda" or any(is_cuda(a) for a in (*args, kwargs.get("device")))
            if fixer.sharded is None and to_gpu and not spread_in(module):
                units = repeated_blocks(module)
                if units:
                    _, said = shard(module, fixer.world_size, "fsdp", units=units, fully_shard=fixer.real_fully_shard)
                    fixer.notes.extend(said)
                    fixer.sharded = module
            return out

        return moved

    def top_forward_begins(self, module: torch.nn.Module) -> None:
        """A forward of a module called outside any other's begins."""
        if "fsdp" in self.fixes and self.sharded is None:
            raise PreflightError(_why_not_sharded(module))
        if "checkpoint" in self.fixes and id(module) not in self._wrapped:
            self._wrapped.add(id(module))
            for block in repeated_blocks(module):
                if id(block) not in self._wrapped:
                    self._wrapped.add(id(block))
                    block.forward = functools.partial(_checkpointed, block.forward)
        if "autocast" in self.fixes and not self._in_autocast:
            if self.autocast.dtype() is None:
                self.autocast.enter(True, torch.bfloat16)
                self._in_autocast = True
                self._autocast_applied = True
            elif not self._autocast_applied and "autocast" not in self.skipped:
                # The script's own autocast is in force at its first forward: the
                # change would change nothing. (Later, a checkpointed block's
                # forward run again in backward is under the autocast it ran in.)
                if not self.skip_what_cannot:
                    raise PreflightError("the script already runs its model's forward under autocast")
                self.skipped.append("autocast")

    def top_forward_ends(self) -> None:
        """That forward has returned."""
        if self._in_autocast:
            self.autocast.exit()
            self._in_autocast = False


class InScript:
    """What the script already does of the changes preflight would try, seen as it runs as
    written: each such change is a row saying so, not a run that changes nothing."""

    def __init__(self) -> None:
        #: Why each change would change nothing, by the change's name (``INSIDE``).
        self.found: dict[str, str] = {}
        self._looked = False
        # Whether the first top-level forward is running: autocast entered inside it (by the
        # model's own forward, or Accelerate's wrapper of it) is seen at its first inner module.
        self._in_first = False
        self._optimizers: list[str] = []

    def first_forward(self, module: torch.nn.Module, autocast: Autocast) -> None:
        """At the model's first top-level forward: its precision, and whether it is sharded."""
        if self._looked:
            return
        self._looked = self._in_first = True
        if not self._under_autocast(autocast):
            trained = {p.dtype for p in module.parameters() if p.requires_grad and p.is_floating_point()}
            if trained and trained <= _HALF:
                names = " and ".join(sorted(str(d).removeprefix("torch.") for d in trained))
                self.found["autocast"] = f"the model's trained weights are already {names}: its matmuls run in it"
        if spread_in(module) == "FSDP":
            self.found["fsdp"] = _SHARDED_ALREADY

    def inner_forward(self, autocast: Autocast) -> None:
        """A module's forward inside a top-level one: inside the first, autocast the model's
        forward entered itself (``accelerate launch --mixed_precision bf16`` wraps it so)."""
        if self._in_first and "autocast" not in self.found:
            self._under_autocast(autocast)

    def top_forward_ends(self) -> None:
        """A top-level forward ended."""
        self._in_first = False

    def _under_autocast(self, autocast: Autocast) -> bool:
        """Whether autocast is in force now, noted as found if so."""
        dtype = autocast.dtype()
        if dtype is not None:
            self.found["autocast"] = f"the script already runs its model's forward under {str(dtype).removeprefix('torch.')} autocast"
        return dtype is not None

    def optimizer_steps(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer's step: which optimizers the script trains with (a wrapper's, as
        Accelerate's, is the one it wraps, whose step runs too)."""
        name = type(opt).__name__
        if not inner_optimizers(opt) and name not in self._optimizers:
            self._optimizers.append(name)

    def said(self, recomputed: bool, alloc_conf: str | None) -> dict[str, str]:
        """Why each change would change nothing here, by name; ``recomputed``: a forward ran
        again inside backward, so the script checkpoints activations itself; ``alloc_conf``:
        the allocator's settings in force."""
        found = dict(self.found)
        if recomputed:
            found["checkpoint"] = "the script already checkpoints activations: forwards run again in its backward"
        if _expands(alloc_conf):
            found[EXPANDABLE] = f"the allocator's settings in force already expand segments ({alloc_conf})"
        if self._optimizers:
            eight_bit = [n for n in self._optimizers if "8bit" in n.lower()]
            if eight_bit:
                found["adamw8bit"] = f"the script's optimizer is already 8-bit ({', '.join(eight_bit)})"
            elif not set(self._optimizers) & _ADAM:
                found["adamw8bit"] = f"the script makes no torch.optim.AdamW or Adam to replace ({', '.join(self._optimizers)})"
        return found


#: The allocator's setting a change turns on without a change inside the script, by its name in ``InScript``.
EXPANDABLE = "expandable_segments"


def _expands(alloc_conf: str | None) -> bool:
    """Whether allocator settings (``PYTORCH_CUDA_ALLOC_CONF``'s form) turn expandable segments on."""
    for pair in (alloc_conf or "").split(","):
        key, _, value = pair.partition(":")
        if key.strip() == EXPANDABLE and value.strip().lower() == "true":
            return True
    return False


#: The 16-bit floating types a model's weights may already train in, for which bf16 autocast changes nothing.
_HALF = frozenset({torch.bfloat16, torch.float16})

#: The optimizers the 8-bit change replaces, by class name.
_ADAM = frozenset({"AdamW", "Adam"})


def _replicated(*_: Any, **__: Any) -> None:
    """``DistributedDataParallel`` under the sharding fix: the script replicates its model, which
    the fix would have to replace in its code."""
    raise PreflightError(_REPLICATED)


#: Why the sharding fix does not apply to a script that shards its model itself.
_SHARDED_ALREADY = "the script already shards its model with FSDP"

#: Why the sharding fix does not apply to a script that wraps its model in DDP.
_REPLICATED = "the script replicates its model with DistributedDataParallel: FSDP in its place is a change to its code"


def _why_not_sharded(module: torch.nn.Module) -> str:
    """Why the model reached its first forward unsharded, for the note in place of the row."""
    how = spread_in(module)
    if how == "FSDP":
        return _SHARDED_ALREADY
    if how == "DDP":
        return _REPLICATED
    if not repeated_blocks(module):
        return f"{type(module).__name__} has no repeated blocks (a ModuleList or Sequential of layers) to shard one by one"
    return "the script does not move its model to the GPU with .to() or .cuda(), where preflight shards it"


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of the ``ModuleList`` or ``Sequential``
    holding the most parameters whose children are two or more of one class (a
    transformer's layers, a ResNet's stages' blocks), as one checkpoints by hand."""
    found: list[torch.nn.Module] = []
    most = -1
    for m in model.modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(m.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > most:
            found, most = children, size
    return found


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """A block's forward under activation checkpointing where gradients are on (its activations recomputed in backward)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
