"""Will it fit? The user's own training step, run on tensors without memory.

``preflight`` builds the model on PyTorch's ``meta`` device (shapes and
dtypes, no memory), runs a few full training steps on it (forward,
backward, optimizer step, with gradient accumulation and autocast as the
real loop has them), records every allocation and free the GPU would make
with its Python stack and its role, and serves them through oomkit's model
of the CUDA caching allocator. The answer is the peak allocated and
reserved memory, what held it by role and by line, whether it fits a
capacity, the largest micro-batch that does, and a snapshot file that
``oomkit analyze``, ``report`` and ``whatif`` open like a recorded one.
Nothing is allocated on a GPU, and the model's weights are never allocated.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from oomkit import _native
from oomkit._native import PreflightError
from oomkit._preflight_cuda import (
    Autocast,
    CudaFunctions,
    accelerator_answers,
    cublas_workspace,
    cuda_autocast,
    device_answers,
    foreach_on_meta,
    no_graph_capture,
)
from oomkit._preflight_dist import STRATEGIES, fake_world, replaced, shard, zero_redundancy
from oomkit._preflight_frames import user_line
from oomkit._preflight_memory import MemoryQueries
from oomkit._preflight_record import (
    DEFAULT_TIME_LIMIT,
    FAKE_DEVICE,
    PreflightStopped,
    Recorder,
    StepUnsupportedError,
    Trace,
    plain_tensors,
)
from oomkit._preflight_snapshot import write_snapshot

__all__ = ["Preflight", "PreflightError", "preflight"]

#: Steps run by default: the first creates the optimizer's state, the
#: second runs with it in place, as every later step does.
DEFAULT_STEPS = 2

#: Lines listed in the answer, largest first.
TOP_LINES = 10


def _adamw8bit(params: Any) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit AdamW, whose kernels have fake implementations (bitsandbytes 0.46 and later)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise PreflightError("optimizer 'adamw8bit' is bitsandbytes' AdamW8bit: install bitsandbytes where preflight runs") from None
    # Its state is one byte per element in blocks of 256 with an fp32 scale
    # each; tensors under 4096 elements keep fp32 state (min_8bit_size).
    return bnb.optim.AdamW8bit(params)


#: Optimizers by name, built with PyTorch's defaults (bitsandbytes' for ``adamw8bit``).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adafactor": torch.optim.Adafactor,
    "adamw8bit": _adamw8bit,
}


@dataclass
class Preflight:
    """What a preflight measured for one micro-batch, and the search's answer."""

    #: The micro-batch each step ran with.
    micro_batch: int | None
    #: Micro-batches accumulated per optimizer step.
    grad_accum: int
    #: Optimizer steps run.
    steps: int
    #: The most memory handed out at once, in the allocator's rounded blocks.
    peak_allocated_bytes: int
    #: The most memory the allocator reserved from the device.
    peak_reserved_bytes: int
    #: Reserved but not handed out when reserved peaked (fragmentation and cache).
    free_in_segments_at_peak_bytes: int
    #: What the allocator may hold: the capacity given, less the CUDA context for a GPU's name.
    capacity_bytes: int
    #: The capacity as given (``80GiB``, ``H100``).
    capacity: str
    #: No allocation failed when the allocator was limited to the capacity.
    fits: bool
    #: The capacity less the peak reserved (negative when it does not fit).
    margin_bytes: int
    #: Bytes live at the allocated peak, by role (``parameters``, ``gradients``,
    #: ``optimizer_state``, ``activations``, ``temporaries``, ``inputs``, ``other``).
    by_role: dict[str, int]
    #: The user's lines holding the most at the allocated peak: ``{"line", "bytes", "role"}``.
    by_line: list[dict[str, Any]]
    #: Allocations recorded and trace entries written.
    allocations: int
    #: What the preflight assumed or could not do, in words.
    notes: list[str] = field(default_factory=list)
    #: The snapshot written, if one was asked for.
    snapshot: str | None = None
    #: Micro-batches tried by the search and whether each fitted.
    tried: list[tuple[int, bool]] = field(default_factory=list)
    #: The largest micro-batch that fits, when a search ran (None: not even the smallest).
    largest_micro_batch: int | None = None
    #: The accumulation that keeps the effective batch at the largest micro-batch.
    largest_grad_accum: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The answer as plain data (what ``json.dumps`` writes)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        # The same report `oomkit preflight` prints, from the one renderer.
        return _native.preflight_text(json.dumps(self.as_dict()))


def preflight(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any | Callable[[int], Any],
    *,
    micro_batch: int | None = None,
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    step: Callable[[torch.nn.Module, Any, torch.optim.Optimizer | None], Any] | None = None,
    optimizer: str | Callable[[Any], torch.optim.Optimizer] | None = "adamw",
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    grad_accum: int = 1,
    steps: int = DEFAULT_STEPS,
    capacity: str = "H100",
    alloc_conf: str | None = None,
    snapshot: str | os.PathLike[str] | None = None,
    max_micro_batch: int | None = None,
    set_to_none: bool = True,
    gpus: int = 1,
    sharding: str = "fsdp",
    time_limit: float | None = DEFAULT_TIME_LIMIT,
) -> Preflight:
    """Runs ``steps`` training steps on tensors without memory and says whether they fit ``capacity``.

    ``model`` is a module or a function that builds one (built on ``meta``,
    so its weights are never allocated); ``batch`` is a batch or a function
    of the micro-batch size that makes one. The step is ``loss(model,
    batch)`` then ``backward`` then the optimizer's step, or the whole of
    ``step(model, batch, optimizer)`` where given; ``set_to_none=False``
    zeroes the gradients instead of freeing them after each step, as
    ``zero_grad()`` did before PyTorch 2.0 (and the Trainer with it), which
    keeps them allocated throughout. With ``max_micro_batch``
    it also searches the largest micro-batch up to it that fits (with
    accumulation, up to the effective batch ``micro_batch x grad_accum``,
    which the accumulation found for it keeps). With ``gpus`` above 1 the
    model is spread over that many GPUs and the answer is one GPU's:
    sharded with FSDP (``sharding="fsdp"`` or ``"zero3"`` frees the gathered
    parameters after forward, ``"zero2"`` keeps them until backward) or
    replicated with DDP (``"ddp"``), or replicated with each GPU keeping a
    share of the optimizer's state (``"zero1"``: DDP and PyTorch's
    ``ZeroRedundancyOptimizer``). A run still going after ``time_limit``
    seconds (a loop waiting on a value the step does not have; ``None``: no
    limit) stops with a ``PreflightError`` that says what ran and where.
    """
    if grad_accum < 1 or steps < 1 or gpus < 1:
        raise PreflightError(f"grad_accum, steps and gpus must be at least 1 (got {grad_accum}, {steps} and {gpus})")
    if gpus > 1 and sharding not in STRATEGIES:
        raise PreflightError(f"sharding {sharding!r}: give one of {', '.join(STRATEGIES)}")
    if max_micro_batch is not None and not callable(batch):
        raise PreflightError("max_micro_batch needs batch to be a function of the micro-batch size")
    if callable(batch) and micro_batch is None:
        raise PreflightError("batch is a function: give micro_batch, the size to call it with")
    capacity_bytes, _label = _native.parse_capacity(capacity)
    if alloc_conf is not None:
        # Checked before running anything, so a typo costs no step.
        _native.realize_ops([], [], [], alloc_conf, None)
    run = _Run(model, batch, loss, step, optimizer, dtype, autocast, grad_accum, steps, capacity, capacity_bytes, alloc_conf)
    run.set_to_none = set_to_none
    run.gpus, run.sharding = gpus, sharding
    run.time_limit = time_limit
    result = run.once(micro_batch, snapshot)
    if max_micro_batch is not None:
        assert micro_batch is not None
        _search(run, result, micro_batch, max_micro_batch)
    return result


class _Run:
    """One preflight's settings, run at any micro-batch."""

    def __init__(
        self,
        model: Any,
        batch: Any,
        loss: Any,
        step: Any,
        optimizer: Any,
        dtype: Any,
        autocast: Any,
        grad_accum: int,
        steps: int,
        capacity: str,
        capacity_bytes: int,
        alloc_conf: str | None,
    ) -> None:
        self.model, self.batch, self.loss, self.step = model, batch, loss, step
        self.optimizer, self.dtype, self.autocast = optimizer, dtype, autocast
        self.grad_accum, self.steps = grad_accum, steps
        self.capacity, self.capacity_bytes, self.alloc_conf = capacity, capacity_bytes, alloc_conf
        self.set_to_none = True
        self.gpus, self.sharding = 1, "fsdp"
        self.time_limit: float | None = DEFAULT_TIME_LIMIT
        #: What the run assumed beyond the step itself (sharding), for the answer's notes.
        self.notes: list[str] = []

    def once(self, micro_batch: int | None, snapshot: str | os.PathLike[str] | None) -> Preflight:
        if snapshot is not None and os.path.exists(snapshot):
            raise PreflightError(f"{os.fspath(snapshot)}: exists; preflight never overwrites a file")
        rec = Recorder(cublas_workspace(self.capacity), self.time_limit)
        known = Known()
        try:
            self._record(rec, known, micro_batch)
        except StepUnsupportedError as e:
            raise unsupported(e) from None
        except PreflightStopped as e:
            raise PreflightError(str(e)) from None
        finally:
            rec.finish()
        return answer(
            rec,
            known,
            Settings(micro_batch, self.grad_accum, self.steps, self.capacity, self.capacity_bytes, self.alloc_conf),
            snapshot,
            {
                "dtype": str(self.dtype) if self.dtype else None,
                "autocast": str(self.autocast) if self.autocast else None,
                "gpus": self.gpus,
                "sharding": self.sharding if self.gpus > 1 else None,
            },
            self.notes,
        )

    def _record(self, rec: Recorder, known: Known, micro_batch: int | None) -> None:
        self.notes = []
        state = Autocast()
        functions = CudaFunctions(state, read_back=rec.read_back)
        with ExitStack() as stack:
            if self.gpus > 1:
                # FSDP asks torch.cuda for the device, its streams and events.
                memory = MemoryQueries(rec, lambda: self.alloc_conf, self.capacity_bytes, self.notes)
                stack.enter_context(replaced(torch.cuda, device_answers(self.capacity, self.capacity_bytes, rec, memory)))
                accelerator = accelerator_answers(rec, memory)
                stack.enter_context(replaced(torch.accelerator, {k: v for k, v in accelerator.items() if hasattr(torch.accelerator, k)}))
                stack.enter_context(replaced(torch.optim.Optimizer, no_graph_capture()))
                stack.enter_context(fake_world(self.gpus, self.notes))
            stack.enter_context(cuda_autocast(state, functions))
            stack.enter_context(foreach_on_meta())
            stack.enter_context(functions)
            stack.enter_context(rec)
            opt_hooks = _phase_hooks(rec)
            stack.callback(lambda: [h.remove() for h in opt_hooks])
            rec.phase = "setup"
            model = self._build_model()
            if self.gpus > 1:
                # Sharded before the step begins: the full weights never reach one GPU.
                model, spread = shard(model, self.gpus, self.sharding)
                self.notes += spread
            # The model arrives on the GPU as built; its construction happened elsewhere.
            rec.begin()
            known.add_model(rec, model)
            known.watch_grads(rec, model.parameters())
            opt = self._build_optimizer(model)
            for _ in range(self.steps):
                for _ in range(self.grad_accum):
                    rec.phase = "inputs"
                    data = self._make_batch(micro_batch)
                    known.add_inputs(rec, data)
                    rec.phase = "forward"
                    if self.step is not None:
                        self.step(model, data, opt)
                        known.add_grads(rec, model)
                        del data
                        break
                    with ExitStack() as region:
                        if self.autocast is not None:
                            region.enter_context(torch.autocast("cuda", dtype=self.autocast))
                        value = (self.loss or _default_loss)(model, data)
                    if self.grad_accum > 1:
                        value = value / self.grad_accum
                    value.backward()
                    known.add_grads(rec, model)
                    del value, data
                if self.step is None and opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=self.set_to_none)
                if opt is not None:
                    known.add_state(rec, opt, model)
                rec.phase = "forward"

    def _build_model(self) -> torch.nn.Module:
        if isinstance(self.model, torch.nn.Module):
            built = _meta_copy(self.model)
        else:
            with torch.device(FAKE_DEVICE):
                built = self.model()
            if not isinstance(built, torch.nn.Module):
                raise PreflightError(f"model() returned {type(built).__name__}, not a torch.nn.Module")
            if any(p.device.type != FAKE_DEVICE for p in built.parameters()):
                built = built.to(FAKE_DEVICE)
        if self.dtype is not None:
            built = built.to(self.dtype)
        return built

    def _build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer | None:
        if self.optimizer is None:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        if isinstance(self.optimizer, str):
            make = OPTIMIZERS.get(self.optimizer.lower())
            if make is None:
                raise PreflightError(f"optimizer {self.optimizer!r}: give one of {', '.join(OPTIMIZERS)} or a function of the parameters")
            opt = make(params)
        else:
            opt = self.optimizer(params)
        if self.gpus > 1 and self.sharding == "zero1":
            opt = zero_redundancy(opt)
        return opt

    def _make_batch(self, micro_batch: int | None) -> Any:
        data = self.batch(micro_batch) if callable(self.batch) else self.batch
        # A batch on the CPU is what the loop would copy to the GPU first.
        return torch.utils._pytree.tree_map(
            lambda t: t.to(FAKE_DEVICE) if isinstance(t, torch.Tensor) and t.device.type != FAKE_DEVICE else t, data
        )


@dataclass
class Settings:
    """What a preflight ran with, as its answer and snapshot header state it."""

    micro_batch: int | None
    grad_accum: int
    steps: int
    capacity: str
    capacity_bytes: int
    alloc_conf: str | None


def answer(
    rec: Recorder,
    known: Known,
    settings: Settings,
    snapshot: str | os.PathLike[str] | None,
    header: dict[str, Any],
    extra_notes: list[str] | None = None,
) -> Preflight:
    """Serves what ``rec`` recorded through the allocator model and answers; writes the snapshot if asked."""
    tr = rec.trace
    roles = known.roles(tr)
    streams = [0] * len(tr.kinds)
    realized = _native.realize_ops(tr.kinds, tr.args, streams, settings.alloc_conf, None)
    capped = _native.realize_ops(tr.kinds, tr.args, streams, settings.alloc_conf, settings.capacity_bytes)
    peak_reserved, peak_allocated, _peak_op, free_at_peak, _ = realized[2]
    fits = not capped[2][4]
    by_role, by_line = _at_peak(tr, roles, realized[3][0])
    notes = _notes(tr, known) + (extra_notes or [])
    result = Preflight(
        micro_batch=settings.micro_batch,
        grad_accum=settings.grad_accum,
        steps=settings.steps,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        free_in_segments_at_peak_bytes=free_at_peak,
        capacity_bytes=settings.capacity_bytes,
        capacity=settings.capacity,
        fits=fits,
        margin_bytes=settings.capacity_bytes - (capped[2][0] if fits else peak_reserved),
        by_role=by_role,
        by_line=by_line,
        allocations=sum(1 for k in tr.kinds if k == 0),
        notes=notes,
    )
    if snapshot is not None:
        full = {
            "micro_batch": settings.micro_batch,
            "grad_accum": settings.grad_accum,
            "steps": settings.steps,
            "capacity": settings.capacity,
            **header,
            "torch": str(torch.__version__),
            "oomkit": _native.__version__,
            "notes": notes,
        }
        try:
            write_snapshot(snapshot, realized, tr.stacks, tr.stack_of, roles, settings.alloc_conf, full, tr.library)
        except OSError as e:
            raise PreflightError(f"{os.fspath(snapshot)}: {e.strerror or e}") from None
        result.snapshot = os.fspath(snapshot)
    return result


def unsupported(e: StepUnsupportedError) -> PreflightError:
    """The one line for an operation that needs data."""
    module = f", in {e.module}'s forward" if e.module else ""
    fix = "give the operator a fake implementation (torch.library.register_fake), " if e.needs_kernel else ""
    return PreflightError(
        f"preflight cannot run {e.op} without data (at {e.where}{module}: {e.reason}); "
        f"{fix}run that part outside the step, or estimate it with `oomkit estimate`"
    )


def _default_loss(model: torch.nn.Module, data: Any) -> torch.Tensor:
    """The model's loss as Hugging Face models return it, else its output's mean."""
    if isinstance(data, Mapping):
        out = model(**data)
    elif isinstance(data, (tuple, list)):
        out = model(*data)
    else:
        out = model(data)
    value = getattr(out, "loss", None)
    if value is None and isinstance(out, Mapping):
        value = out.get("loss")
    if value is None:
        value = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            value = value.float().mean()
    if not isinstance(value, torch.Tensor):
        raise PreflightError("the model returned no tensor to take a loss of; pass loss=")
    return value


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are on ``meta``, never copying their data."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=FAKE_DEVICE), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device=FAKE_DEVICE)
    return copy.deepcopy(module, memo)


def _phase_hooks(rec: Recorder) -> list[Any]:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(*_: Any) -> None:
        rec.phase = "optimizer"

    def post(*_: Any) -> None:
        rec.phase = "forward"

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]


class Known:
    """The allocations whose role preflight knows from the objects holding them."""

    def __init__(self) -> None:
        self.params: set[int] = set()
        self.inputs: set[int] = set()
        self.grads: set[int] = set()
        self.state: set[int] = set()
        self._watched: set[int] = set()

    @staticmethod
    def _add(rec: Recorder, into: set[int], tensors: Any) -> None:
        leaves = [p for t in torch.utils._pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor) for p in plain_tensors(t)]
        for t in leaves:
            i = rec.index_of(t) if t.device.type == FAKE_DEVICE else None
            if i is None and t.device.type == FAKE_DEVICE:
                i = rec.track(t)
            if i is not None:
                into.add(i)

    def add_model(self, rec: Recorder, model: torch.nn.Module) -> None:
        params = list(model.parameters())
        self.add_params(rec, params + list(model.buffers()) + [t for p in params for t in _attached(p)])

    def add_params(self, rec: Recorder, tensors: list[torch.Tensor]) -> None:
        self._add(rec, self.params, [t.detach() for t in tensors])

    def add_grad_tensors(self, rec: Recorder, grads: list[torch.Tensor]) -> None:
        self._add(rec, self.grads, grads)

    def watch_grads(self, rec: Recorder, params: Any) -> None:
        """Every tensor that becomes a parameter's ``.grad`` is a gradient, even one replaced
        later in the same backward (a weight used twice, as tied embeddings are)."""
        for p in params:
            if p.requires_grad and id(p) not in self._watched:
                self._watched.add(id(p))
                p.register_post_accumulate_grad_hook(lambda p: self._add(rec, self.grads, [p.grad]))

    def add_state_of(self, rec: Recorder, opt: torch.optim.Optimizer) -> None:
        for holder in (opt, *_inner_optimizers(opt)):
            self._add(rec, self.state, [list(s.values()) for s in holder.state.values()])
        # An optimizer may give parameters new tensors inside its step.
        self.add_params(rec, [p for g in opt.param_groups for p in g["params"]])

    def add_inputs(self, rec: Recorder, data: Any) -> None:
        self._add(rec, self.inputs, data)

    def add_grads(self, rec: Recorder, model: torch.nn.Module) -> None:
        self._add(rec, self.grads, [p.grad for p in model.parameters() if p.grad is not None])

    def add_state(self, rec: Recorder, opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.add_state_of(rec, opt)
        self.add_model(rec, model)

    def roles(self, tr: Trace) -> dict[int, str]:
        """The role of every allocation, by its index."""
        out: dict[int, str] = {}
        for i, kind in enumerate(tr.kinds):
            if kind != 0:
                continue
            if i in tr.library:
                role = "other"
            elif i in self.params:
                role = "parameters"
            elif i in self.state:
                role = "optimizer_state"
            elif i in self.grads:
                role = "gradients"
            elif i in self.inputs:
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


def _inner_optimizers(opt: Any) -> list[torch.optim.Optimizer]:
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


def _attached(p: torch.Tensor) -> list[torch.Tensor]:
    """Tensors a quantized parameter carries beside its data (bitsandbytes' ``quant_state``: scales, code book)."""
    state = getattr(p, "quant_state", None)
    found: list[torch.Tensor] = []
    while state is not None and len(found) < 16:
        found += [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
        # Double quantization quantizes the scales too, with a state of its own.
        state = getattr(state, "state2", None)
    return found


def _at_peak(tr: Trace, roles: dict[int, str], allocated_after: list[int]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Bytes live at the allocated peak, by role and by the user's line, in the allocator's blocks.

    ``allocated_after`` is the allocator model's allocated bytes after each
    operation: the peak is where it is highest (the headline's figure), and
    each allocation counts the block it was handed (the request rounded,
    plus a remainder too small to split off), so the roles add up to the
    peak allocated exactly, as ``max_memory_allocated`` counts it.
    """
    peak_at = max(range(len(allocated_after)), key=allocated_after.__getitem__, default=-1)
    freed_by = {arg: i for i, (kind, arg) in enumerate(zip(tr.kinds, tr.args)) if kind == 1}
    by_role = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "other"), 0)
    lines: dict[tuple[str, str], int] = {}
    for i in range(peak_at + 1):
        if tr.kinds[i] != 0 or freed_by.get(i, len(tr.kinds)) <= peak_at:
            continue
        size = allocated_after[i] - (allocated_after[i - 1] if i else 0)
        role = roles.get(i, "other")
        by_role[role] = by_role.get(role, 0) + size
        key = (user_line(tr.stacks[tr.stack_of[i]]), role)
        lines[key] = lines.get(key, 0) + size
    by_line = [{"line": line, "role": role, "bytes": b} for (line, role), b in sorted(lines.items(), key=lambda kv: -kv[1])[:TOP_LINES]]
    return by_role, by_line


def _notes(tr: Trace, known: Known) -> list[str]:
    notes = [
        "sizes are the CUDA allocator's, modelled; the CUDA context is outside them (a GPU's name as the capacity takes it off)",
    ]
    if tr.library:
        if len(tr.library) == 1:
            notes.append("includes cuBLAS's workspace, allocated at the first matrix multiply")
        else:
            notes.append(
                f"includes cuBLAS's {len(tr.library)} workspaces, one for each thread that multiplies matrices "
                "(the forward's and autograd's backward thread), allocated at each one's first"
            )
    if tr.assumed:
        where = sorted({w for _, w in tr.assumed})
        notes.append(
            f"{len(tr.assumed)} value(s) read from tensors without data were taken as 0 "
            f"(first at {where[0]}); a step whose memory depends on data may differ"
        )
    if not known.grads:
        notes.append("no parameter received a gradient: nothing was trained")
    return notes


def _search(run: _Run, first: Preflight, micro_batch: int, max_micro_batch: int) -> None:
    """Doubles the micro-batch until it does not fit (or reaches the maximum), then bisects."""
    effective = micro_batch * first.grad_accum
    if first.grad_accum > 1:
        # A micro-batch above the effective batch would change it, which accumulation exists to avoid.
        max_micro_batch = min(max_micro_batch, effective)
    tried: dict[int, bool] = {micro_batch: first.fits}

    def fits(b: int) -> bool:
        if b not in tried:
            tried[b] = run.once(b, None).fits
        return tried[b]

    lo, hi = 0, None
    b = micro_batch
    if first.fits:
        lo = b
        while b < max_micro_batch:
            b = min(b * 2, max_micro_batch)
            if fits(b):
                lo = b
            else:
                hi = b
                break
    else:
        hi = b
        while b > 1:
            b //= 2
            if fits(b):
                lo = b
                break
            hi = b
    if hi is not None:
        while lo and hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    first.tried = sorted(tried.items())
    if lo:
        first.largest_micro_batch = lo
        first.largest_grad_accum = max(1, -(-effective // lo))
