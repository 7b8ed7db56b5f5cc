"""The role of every allocation of a preflight, known from the objects that hold it.

Preflight holds the model, the optimizer and the batch, so it knows which
storages are parameters, gradients, optimizer state and inputs instead of
inferring them (docs/roles.md); what FSDP and DDP
allocate themselves is told by the function that allocated it; of the
rest, what forward made and still held when forward ended is
activations, and everything else temporaries.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from oomkit.preflight.record.placement import on_meta, plain_tensors
from oomkit.preflight.record.recorder import Recorder, Trace, tensors_kept


class Known:
    """The allocations whose role preflight knows from the objects holding them."""

    def __init__(self) -> None:
        self.params: set[int] = set()
        self.inputs: set[int] = set()
        self.grads: set[int] = set()
        self.state: set[int] = set()
        # The weights being trained: an optimizer's, and those a forward with gradients reads.
        self.trained: set[int] = set()
        #: Whether any parameter got a gradient, wherever it is held (one offloaded to the host
        #: by FSDP's CPU offload is no allocation of the GPU's, but the step trained).
        self.graded = False
        self._watched: set[int] = set()
        # Storages told before the step began, with the set each belongs in: the set-up's
        # allocations are recorded only as the step begins (Recorder.begin), and known then.
        self._before_step: list[tuple[weakref.ref[Any], set[int]]] = []

    def _add(self, rec: Recorder, into: set[int], tensors: Any) -> None:
        leaves = [p for t in torch.utils._pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor) for p in plain_tensors(t)]
        for t in leaves:
            if not on_meta(t):
                continue
            i = rec.index_of(t)
            if i is None:
                i = rec.track(t)
            if i is not None:
                into.add(i)
            elif not rec.begun:
                # (A weak reference to the storage: one to the tensor would stop PyTorch swapping it.)
                self._before_step.append((weakref.ref(t.untyped_storage()), into))

    def step_begins(self, rec: Recorder) -> None:
        """Gives the storages told before the step began their roles, now that ``rec`` has begun and allocated them."""
        told, self._before_step = self._before_step, []
        for ref, into in told:
            st = ref()
            i = rec.index_of_storage(st) if st is not None else None
            if i is not None:
                into.add(i)

    def add_model(self, rec: Recorder, model: torch.nn.Module) -> None:
        self.add_params(rec, list(model.parameters()) + list(model.buffers()), trained=True)

    def add_params(self, rec: Recorder, tensors: list[torch.Tensor], trained: bool = False) -> None:
        """Tells weights (``trained``: of the model being trained, an optimizer's or read by a
        forward with gradients, never a copy kept beside it)."""
        # Their storages are read as they are: a detach of each would be an operation run and
        # recorded, on every forward of a module first seen and every optimizer step.
        # A quantized weight's scales are the weight's too, however the script found it.
        tensors = tensors + [t for p in tensors for t in _attached(p)]
        self._add(rec, self.params, tensors)
        if trained:
            self._add(rec, self.trained, tensors)

    def add_grad_tensors(self, rec: Recorder, grads: list[torch.Tensor]) -> None:
        self._graded(rec, grads)

    def watch_grads(self, rec: Recorder, params: Any) -> None:
        """Every tensor that becomes a parameter's ``.grad`` is a gradient, even one replaced
        later in the same backward (a weight used twice, as tied embeddings are)."""
        for p in params:
            # A module's parameter that is a view during its forward (FSDP1's of its flat parameter, with
            # use_orig_params) gets no gradient of its own: the flat parameter does, and is watched.
            if p.requires_grad and p.is_leaf and id(p) not in self._watched:
                self._watched.add(id(p))
                p.register_post_accumulate_grad_hook(lambda p: self._graded(rec, [p.grad]))

    def add_state_of(self, rec: Recorder, opt: torch.optim.Optimizer) -> None:
        for holder in (opt, *inner_optimizers(opt)):
            self._add(rec, self.state, [list(s.values()) for s in holder.state.values()])
            # State an optimizer makes in its own __init__ and keeps as attributes (a hand-written
            # AdamW's ``self.m = [torch.zeros_like(p) ...]``), the parameters it names aside.
            params = {id(p) for g in holder.param_groups for p in g["params"]}
            kept = [v for k, v in vars(holder).items() if k not in _OPTIMIZER_OWN]
            self._add(rec, self.state, [t for t in tensors_kept(kept) if id(t) not in params])
        # An optimizer may give parameters new tensors inside its step.
        self.add_params(rec, [p for g in opt.param_groups for p in g["params"]], trained=True)

    def add_inputs(self, rec: Recorder, data: Any) -> None:
        self._add(rec, self.inputs, data)
        rec.batch_given([t for t in torch.utils._pytree.tree_leaves(data) if isinstance(t, torch.Tensor)])

    def add_grads(self, rec: Recorder, model: torch.nn.Module) -> None:
        self._graded(rec, [p.grad for p in model.parameters() if p.grad is not None])

    def _graded(self, rec: Recorder, grads: list[torch.Tensor]) -> None:
        """Tells gradients, noting that some parameter got one."""
        self.graded = self.graded or bool(grads)
        self._add(rec, self.grads, grads)

    def add_state(self, rec: Recorder, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.add_state_of(rec, opt)
        self.add_model(rec, model)

    def roles(self, tr: Trace) -> dict[int, str]:
        """The role of every allocation, by its index."""
        out: dict[int, str] = {}
        ema = self.weight_copies(tr)
        for i, kind in enumerate(tr.kinds):
            if kind != 0:
                continue
            if i in tr.library:
                role = "other"
            elif i in tr.kv_cache:
                # Held across the forwards of one generation and read by a later one: its
                # cache, even where a model keeps it in buffers of its own (gpt-fast's).
                role = "kv_cache"
            elif i in ema and _parallel_role(tr.stacks[tr.stack_of[i]]) is None:
                # (FSDP's gathered weights are copied from the weights too, as each forward begins: its own.)
                role = "ema"
            elif i in self.params or i in tr.module_state:
                role = "parameters"
            elif i in self.state:
                role = "optimizer_state"
            elif i in self.grads:
                role = "gradients"
            elif i in self.inputs or i in tr.batch:
                role = "inputs"
            elif (spread := _parallel_role(tr.stacks[tr.stack_of[i]])) is not None:
                role = spread
            elif tr.phases[i] == "forward":
                # Made in forward and still held when forward ended: saved for backward.
                role = "activations" if tr.freed_in.get(i, "end") != "forward" else "temporaries"
            elif tr.phases[i] == "setup":
                role = "other"
            else:
                role = "temporaries"
            out[i] = role
        return out

    def weight_copies(self, tr: Trace) -> set[int]:
        """The allocations the script keeps in step with the weights it trains, outside any
        forward or backward (an EMA, an averaged model): written in place from the weights or
        from what was computed from them, and neither trained weights, gradients, optimizer
        state nor the batch. A copy of the weights that is only ever read (a frozen teacher)
        or made anew (a checkpoint's clone) is no such copy."""
        from_weights = set(self.params)
        found: set[int] = set()
        for made, read, in_place in tr.updates:
            if from_weights.isdisjoint(read):
                continue
            from_weights.update(made)
            if in_place:
                found.update(made)
        return found - self.trained - self.state - self.grads - self.inputs - tr.library


#: FSDP's functions that allocate a gathered (unsharded) parameter, and
#: those that allocate a gradient to reduce-scatter, by name
#: (``torch/distributed/fsdp/_fully_shard``).
FSDP_GATHERS = frozenset(
    {"foreach_all_gather", "foreach_all_gather_copy_out", "alloc_storage", "init_all_gather_outputs", "init_unsharded_param"}
)
FSDP_REDUCES = frozenset({"foreach_reduce"})


#: DDP's own file: what it allocates itself (its gradient buckets) is ``other``, as docs/roles.md has it.
DDP_FILE = os.path.join("nn", "parallel", "distributed.py")

#: Wrappers PyTorch puts around its functions, passed over to find the function that allocated.
_WRAPPERS = (os.path.join("torch", "_dynamo"), os.path.join("torch", "_compile.py"))


def _parallel_role(stack: tuple[tuple[str, int, str], ...]) -> str | None:
    """The role of what data parallelism allocates itself: FSDP's gathered parameters and
    gradients to reduce-scatter, DDP's buckets (``other``); else None."""
    for filename, _line, name in stack:
        if "fsdp" in filename:
            if name in FSDP_GATHERS:
                return "parameters"
            if name in FSDP_REDUCES:
                return "gradients"
    inner = next((f for f in stack if not any(w in f[0] for w in _WRAPPERS)), None)
    if inner is not None and inner[0].endswith(DDP_FILE):
        return "other"
    return None


#: Where optimizers that wrap another keep it: ZeroRedundancyOptimizer's
#: ``optim`` (this rank's share), Accelerate's and Lightning's ``optimizer``.
WRAPPED_OPTIMIZER = ("optim", "optimizer", "_optimizer")


def inner_optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    """The optimizers ``opt`` wraps, innermost last; their state is the state."""
    found: list[torch.optim.Optimizer] = []
    current = opt
    while len(found) < 4:
        inner = next((getattr(current, a) for a in WRAPPED_OPTIMIZER if isinstance(getattr(current, a, None), torch.optim.Optimizer)), None)
        if inner is None or inner is current or inner in found:
            break
        found.append(inner)
        current = inner
    return found


#: What every torch.optim.Optimizer keeps that is not state of its own making: read elsewhere, or no tensors.
_OPTIMIZER_OWN = frozenset({"state", "param_groups", "defaults", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"})


def _attached(p: torch.Tensor) -> list[torch.Tensor]:
    """Tensors a quantized parameter carries beside its data (bitsandbytes' ``quant_state``: scales, code book)."""
    state = getattr(p, "quant_state", None)
    found: list[torch.Tensor] = []
    while state is not None and len(found) < 16:
        found += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
        # Double quantization quantizes the scales too, with a state of its own.
        state = getattr(state, "state2", None)
    return found
