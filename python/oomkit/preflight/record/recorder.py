"""Records every device allocation and free of a step run on ``meta`` tensors.

A ``TorchDispatchMode`` sees each operation below autograd; every new
storage of a ``meta`` tensor in its outputs is an allocation the GPU would
make, and a weak reference to the storage tells when it is freed (PyTorch
keeps a storage's Python object alive as long as the storage, so the
reference dies exactly when the memory would go back). PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` counts memory the same
way. CPU tensors (Adam's step counters, a data loader's batch) are real and
are not device memory, so they are not recorded.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from oomkit.preflight.record.frames import user_line
from oomkit.preflight.record.garbage import Collector
from oomkit.preflight.record.host import HostMemory, host_zeros
from oomkit.preflight.record.out_of_memory import OutOfMemory
from oomkit.preflight.record.placement import ASKED_HOST, Placement, on_meta, plain_tensors
from oomkit.preflight.record.values import Values, tensors_in
from oomkit.preflight.record.worst import SELECTING, Selections
from oomkit.preflight.settings import DEFAULT_TIME_LIMIT

#: The device fake tensors live on: shapes and dtypes, no memory.
FAKE_DEVICE = "meta"

#: Stacks are cut at this depth; real snapshots keep deeper ones, but no
#: question oomkit asks of a preflight looks further from the allocation.
MAX_FRAMES = 96

#: Frames of these files are the recorder's own machinery, not the user's step.
_OWN_FILES = (
    os.path.join("torch", "utils", "_python_dispatch.py"),
    os.path.join("torch", "overrides.py"),
    os.path.join("oomkit", "preflight", ""),
)

#: Whether each function seen in a stack (its code) is in one of ``_OWN_FILES``: a stack is
#: taken for every allocation, and its frames come from few functions.
_OWN_BY_CODE: dict[Any, bool] = {}

#: The phases a step goes through, in the words the trace's roles use.
PHASES = ("setup", "inputs", "forward", "backward", "optimizer")

#: aten operations that call cuBLAS on CUDA, where the first call on a
#: stream allocates the handle's workspace through the caching allocator.
_CUBLAS_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "_scaled_mm",
        "_addmm_activation",
    }
)


#: Operations between two looks at the clock: a look costs as much as a small operation's
#: recording, and a run past its limit stops within a fraction of a millisecond anyway.
TIME_CHECK_EVERY = 64

#: Whether each operator seen calls cuBLAS (its packet is one of ``_CUBLAS_OPS``).
_MULTIPLIES: dict[Any, bool] = {}


def _multiplies(func: Any) -> bool:
    """Whether ``func`` calls cuBLAS on CUDA, looked up once per operator."""
    found = _MULTIPLIES.get(func)
    if found is None:
        found = _MULTIPLIES[func] = getattr(getattr(func, "overloadpacket", None), "__name__", "") in _CUBLAS_OPS
    return found


#: By operator: whether it has a decomposition autograd runs (a CompositeImplicitAutograd kernel).
_COMPOSITE: dict[Any, bool] = {}


def _composite(func: Any) -> bool:
    """Whether ``func`` decomposes into other operators above autograd, looked up once per operator."""
    found = _COMPOSITE.get(func)
    if found is None:
        found = False
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
            try:
                found = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
            except RuntimeError:
                pass  # An operator the dispatcher does not list by name (TorchScript's prim:: ones).
        _COMPOSITE[func] = found
    return found


def _answers_a_value(func: Any) -> bool:
    """Whether an operator's one result is a flag or a number, not a tensor (``allclose``, ``equal``)."""
    returns: list[Any] = list(getattr(getattr(func, "_schema", None), "returns", ()))
    return len(returns) == 1 and str(returns[0].type) in ("bool", "int", "float", "Scalar")


#: ``detach``, whose result shares its input's storage.
_DETACH = torch.ops.aten.detach.default

#: Operators the recorder answers itself, below Python's functions.
_PIN_MEMORY = torch.ops.aten._pin_memory.default
#: A scalar read back (``Tensor.item()``, decomposed into this by autograd, or by the recorder
#: itself under ``torch.inference_mode()``).
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_COPY = torch.ops.aten.copy_.default

#: What ``torch.tensor(data)`` dispatches: the tensor it made out of the modes' sight.
_LIFT_FRESH = torch.ops.aten.lift_fresh.default

#: ``Tensor.set_`` of a storage: the storage may have been made outside any operation.
_SET_STORAGE = frozenset({torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset})

#: What PyTorch says when an operator has no implementation for tensors without data.
_NO_FAKE_KERNEL = ("no fake impl", "'Meta' backend", "meta kernel")


#: PyTorch's call of a function that skips the function modes for that call alone (what
#: ``torch.overrides.redispatch_function`` calls), where this PyTorch has it.
_SKIP_ONE_HOP = getattr(torch._C, "_skip_one_hop_torch_function", None)

#: How many function modes are on: in a backward autograd runs, preflight's is.
_FUNCTION_MODES = torch._C._len_torch_function_stack


#: Operations whose result holds none of their inputs' values, only their shapes: a
#: buffer made ``zeros_like`` a weight (an optimizer's new state) is no copy of it.
_NO_DATA_FROM_INPUTS = frozenset(
    {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
     "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "zero_", "fill_", "normal_", "uniform_"}
)  # fmt: skip


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` as CUDA's dispatcher runs it at this point, below autograd.

    In a backward the function mode is on, and would see each ATen operator autograd runs once
    more, with all its handling (autocast's policy among it) for a call that names no device:
    such a call passes it for this call alone, and what the operator's kernel calls still meets
    it. One that names a device (a process group's barrier makes its tensor on ``cuda`` from
    C++) goes through it, which puts the fake GPU's device in its place.
    """
    if (
        _SKIP_ONE_HOP is not None
        and type(func) is torch._ops.OpOverload
        and kwargs.get("device") is None
        and _FUNCTION_MODES()
        and torch._C._current_graph_task_id() != -1
    ):
        return _SKIP_ONE_HOP(func, (), args, kwargs)
    return func(*args, **kwargs)


class _ByStorage:
    """Allocation indices by storage, found by identity as a ``WeakIdKeyDictionary`` finds them,
    at a plain dict's cost (that dictionary makes a weak reference for every lookup, and the
    recorder looks up each tensor of each operation): each entry keeps a weak reference to its
    storage, and one whose storage has died, its id free for another's, is not found."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], int]] = {}

    def get(self, st: Any, default: int | None = None) -> int | None:
        """The index of storage ``st``, or ``default``."""
        entry = self._entries.get(id(st))
        return entry[1] if entry is not None and entry[0]() is st else default

    def __contains__(self, st: Any) -> bool:
        return self.get(st) is not None

    def __setitem__(self, st: Any, index: int) -> None:
        self._entries[id(st)] = (weakref.ref(st), index)

    def __delitem__(self, st: Any) -> None:
        if st not in self:
            raise KeyError(st)
        del self._entries[id(st)]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def forget(self, key: int, index: int) -> None:
        """Drops the entry of a storage that died (by its id then), if it is still that allocation's."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] == index:
            del self._entries[key]


class PreflightStopped(BaseException):
    """The preflight ran past its time limit; says what it ran and where it stopped.

    A ``BaseException``, as ``KeyboardInterrupt`` is, so that a script's own
    ``except Exception`` cannot swallow it and loop on.
    """

    def __init__(self, seconds: float, ops: int, where: str) -> None:
        super().__init__(seconds, ops, where)
        self.seconds, self.ops, self.where = seconds, ops, where

    def words(self, steps: int | None = None) -> str:
        """The one line: how long, how much ran (and how many optimizer steps), where, and what to do."""
        done = "" if steps is None else f", {steps} optimizer step(s)"
        return (
            f"stopped the script after {self.seconds:g} s ({self.ops:,} operations on tensors without data{done}) "
            f"at {self.where}: it had not ended. A loop whose end depends on values the step does not have "
            f"(read as 0) may never end here; give it a bound, or raise the limit (--time-limit, or time_limit=)"
        )

    def __str__(self) -> str:
        return self.words()


class StepUnsupportedError(Exception):
    """An operation cannot run on tensors without data; carries the operation and where."""

    def __init__(self, op: str, where: str, reason: str, module: str | None = None) -> None:
        super().__init__(f"{op} at {where}: {reason}")
        self.op = op
        self.where = where
        self.reason = reason
        #: The innermost module whose forward was running (its class), if any.
        self.module = module
        #: The operation has no implementation for tensors without data (rather than needing values).
        self.needs_kernel = False


@dataclass
class Trace:
    """What the recorder saw, as parallel lists indexed by operation."""

    #: 0 an allocation, 1 a free, 2 ``empty_cache``.
    kinds: list[int] = field(default_factory=list)
    #: The bytes of an allocation, or the index of the allocation freed.
    args: list[int] = field(default_factory=list)
    #: The phase each operation happened in.
    phases: list[str] = field(default_factory=list)
    #: The index of each operation's stack in ``stacks``.
    stack_of: list[int] = field(default_factory=list)
    #: Distinct stacks, innermost frame first: (filename, line, function).
    stacks: list[tuple[tuple[str, int, str], ...]] = field(default_factory=list)
    #: The phase each allocation was freed in, by allocation index.
    freed_in: dict[int, str] = field(default_factory=dict)
    #: The operations recorded when each optimizer step ended: step k is the operations
    #: from the end of step k-1 (or the end of set-up) up to its own end.
    step_ends: list[int] = field(default_factory=list)
    #: Allocations the CUDA libraries make (the cuBLAS workspace).
    library: set[int] = field(default_factory=set)
    #: Values read from tensors that have none, taken as zero: (operation, where).
    assumed: list[tuple[str, str]] = field(default_factory=list)
    #: Operations whose result's size depends on data the step does not have, made at
    #: their largest (``worst.worst_case``): (operator, where).
    worst_sized: list[tuple[str, str]] = field(default_factory=list)
    #: Allocations held across forwards of one generation and read by a later one (its key-value cache).
    kv_cache: set[int] = field(default_factory=set)
    #: Allocations a module keeps as its own state, made in set-up or in a forward before the
    #: last (a table built on the first forward, a buffer registered late): by role, weights.
    module_state: set[int] = field(default_factory=set)
    #: The top-level forward each operation ran in (0: outside any), by operation index.
    forward_of: list[int] = field(default_factory=list)
    #: The private pool of each allocation made while a CUDA graph captured (1 on), by
    #: allocation index; every other allocation is in the default pools.
    pools: dict[int, int] = field(default_factory=dict)
    #: The first operation of the run the answer is of: after the script's own batch-size search
    #: (Lightning's finder), whose trials are not the run; 0 where it ran none.
    measured_from: int = 0
    #: The operations between forwards and backwards (an optimizer's step, and what the
    #: script does after it), each as (what it wrote in place or made, what else it read,
    #: whether it wrote in place), by allocation index: where a copy of the weights that
    #: the script keeps in step with them (an EMA) is found (``roles.Known.roles``).
    updates: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = field(default_factory=list)
    #: Allocations made of the batch alone outside any forward (images made floats and
    #: scaled, a permuted copy), by allocation index: by role, inputs, as the batch is.
    batch: set[int] = field(default_factory=set)

    def streams(self) -> list[int]:
        """Each operation's pool as the allocator model takes it (its stream): a CUDA graph's
        private pool shares no cached block with the default pools, nor a stream with another's."""
        return [self.pools.get(i, 0) for i in range(len(self.kinds))]


def _where(stack: tuple[tuple[str, int, str], ...]) -> str:
    """Where the step is: the user's line of the stack (``frames.user_line``)."""
    return user_line(stack)


class Recorder(TorchDispatchMode):
    """Records the allocations and frees of ``meta`` tensors, with their stacks and phases."""

    def __init__(self, cublas_workspace: int, time_limit: float | None = DEFAULT_TIME_LIMIT) -> None:
        super().__init__()
        self.trace = Trace()
        #: The values of small tensors, where the step makes them known.
        self.values = Values()
        self.selections = Selections(self.index_of)
        #: The host memory the script holds for the GPU (pinned, and copies from it).
        self.host = HostMemory()
        #: Which tensors without data are the fake GPU's and which the script's own meta tensors.
        self.placement = Placement()
        #: Operations run so far, and when the run must stop (None: never).
        self.ops = 0
        # Python's cyclic garbage collected at fixed operations, not after allocations that vary by run.
        self._garbage = Collector()
        self.time_limit = time_limit
        self._started = time.monotonic()
        self._stopped: PreflightStopped | None = None
        self.phase = "setup"
        self._index = _ByStorage()
        # The batch's storages as the script copied it to the GPU, and those it made of them
        # alone outside any forward (``Trace.batch``); before the step begins too.
        self._batch = _ByStorage()
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._stack_ids: dict[tuple[tuple[str, int, str], ...], int] = {}
        self._cublas_workspace = cublas_workspace
        #: The matrix multiplies the GPU cannot run, by operator name, each with the error CUDA raises there.
        self.refused: dict[str, str] = {}
        #: Where set (a script's first run), the step's allocations the GPU would refuse raise CUDA's error.
        self.out_of_memory: OutOfMemory | None = None
        #: Bytes of the storages alive now, and the most so far (unrounded).
        self.live_bytes = 0
        self.peak_bytes = 0
        # Until the step begins (the model built, the first forward), new
        # storages wait here: only those still alive then are recorded. On
        # a GPU the model is built elsewhere (on the CPU, or loaded) and
        # arrives in its final form; the copies and casts of building it
        # would otherwise count as a peak no real run has.
        self._deferred = True
        self._pending: list[tuple[weakref.ref[Any], int, int]] = []
        # cuBLAS keeps a workspace per handle and stream
        # (CublasHandlePool.cpp's cublas_handle_stream_to_workspace), and
        # each thread takes its own handle: the forward's thread and
        # autograd's backward thread each get one, which lives as long as
        # the handle, to the end of the process. By thread: main or backward.
        self._workspaces: dict[str, torch.Tensor] = {}
        # The modules whose forward is running, innermost last: an operation
        # that cannot run is named with the module that ran it.
        self._modules: list[str] = []
        # The frame that called each of those forwards, innermost last (held,
        # so that no other frame takes its id while it is listed; one that
        # ended without its forward hook is taken off at the next forward, or
        # at the next allocation or free made outside it),
        # and by its id the stack above it, once an allocation inside asked
        # for it: the frames above a running call do not change, and a deep
        # model's stack (a generation's is ninety frames) is then walked
        # only as far as the innermost forward.
        self._calls: list[Any] = []
        self._above: dict[int, tuple[tuple[str, int, str], ...] | None] = {}
        # The frames backward passes run below, held while they run (``frames_fixed``).
        self._fixed: list[Any] = []
        # While a compiled graph runs (``one_stack``): the thread running it, and its call's stack.
        self._one_stack: tuple[int, int] | None = None
        # The modules whose forward checkpointing is running again in backward,
        # innermost last, each by its call's id: named, never held.
        self._recomputing: list[tuple[int, str]] = []
        #: Whether a module's forward ran inside a backward (activations checkpointed and recomputed).
        self.recomputed = False
        #: Top-level forwards begun (a module's forward called outside any other's that
        #: touches the GPU: a data transform run on the host is no forward of the model).
        self.forwards = 0
        #: The top-level forward running now (0: none).
        self.forward_open = 0
        #: Whether the module call running now, outermost, works on the host alone (a data transform).
        self.on_host = False
        #: Whether a forward with gradients ran on the host of a module whose weights are the host's and trained.
        self.trains_on_host = False
        # The generation each forward belongs to: forwards without gradients and with no
        # backward between them are one generation, and only there is what one forward
        # keeps for the next a cache; a training step's forwards are each their own.
        self._generation_of: dict[int, int] = {}
        self._generation = 0
        # The module each forward ran (by forward), and whether two such modules are one model (by
        # their ids): a forward reading what another model made (a head reading a body's output,
        # each called by a step of its own, as Lightning's validation_step does) keeps no cache.
        self._module_of: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._one_model: dict[tuple[int, int], bool] = {}
        self._last_forward_grad = True
        self._backward_seen = False
        #: Whether any backward has run: a run without one reads a loop with gradients on as a generation too.
        self.any_backward = False
        # By allocation index, the last forward that wrote it in place: a cache a generation
        # keeps in one buffer (a static cache) is written by each forward.
        self._written_in: dict[int, int] = {}
        # Caches marked between forwards with gradients on, before any backward: no cache if one comes.
        self._until_backward: set[int] = set()
        # The top-level modules whose forwards ran, to find the state they keep at the end.
        self._top_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # The modules inside those (their submodules, not themselves): one of them called on
        # its own (an output projection run chunk by chunk by a loss) continues the forward.
        self._inside_top: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # The forward each allocation was made in (0: outside any), and for
        # those made outside, the first forward that read them: a tensor
        # read by a later forward than its own is held across forwards.
        self._made_in: dict[int, int] = {}
        self._first_reader: dict[int, int] = {}
        # A rearranged whole copy made between forwards, by its index, to the
        # allocation it copies: when the copy proves a cache, so was that.
        self._copied_from: dict[int, int] = {}
        # Autocast's cached 16-bit casts of weights, by allocation index: a region around a
        # whole generation keeps them for every forward in it, as copies of the weights.
        self._weight_casts: set[int] = set()
        #: Whether torch.compile's tracer is capturing a graph: its fake tensors pass unrecorded.
        self.capturing = False
        #: The private pool a CUDA graph being captured allocates from (0: none is capturing).
        self.graph_pool = 0
        #: Whether the operation running is one a fusing compiler computes inside another's kernel: its result takes no memory.
        self.fusing = False

    def stand_ins(self) -> list[tuple[Any, str, Any]]:
        """What the recorder replaces while it records, for the fake GPU's ledger: storages
        resized in place (FSDP frees and retakes memory so) are told to it."""
        resize = torch.UntypedStorage.resize_
        recorder = self

        def resize_(st: Any, size: int) -> Any:
            out = resize(st, size)
            recorder.resized(st, int(size))
            return out

        return [(torch.UntypedStorage, "resize_", resize_)]

    def hooks(self) -> list[tuple[Callable[[Any], Any], Callable[..., Any]]]:
        """The global hooks the recorder needs, as (register, hook) for the fake GPU's ledger:
        which module's forward is running, so that an operation that cannot run names it."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def entered(module: torch.nn.Module, _args: Any) -> None:
            call = sys._getframe(1)
            if torch._C._current_graph_task_id() != -1:
                # Checkpointing's recomputation, part of the backward: not a forward, and its
                # frames not held (it ends early by raising, past its forward hooks).
                self._recomputing.append((id(call), type(module).__name__))
                self.recomputed = True
                return
            self._drop_ended(call)
            if not self._modules:
                self.on_host = not _touches_gpu(module, _args, self.placement.on_gpu, call)
                if self.on_host and torch.is_grad_enabled() and not self.trains_on_host:
                    # A model the script trains where it is, on the host (``use_cpu=True``).
                    on_host = self.placement.on_host
                    self.trains_on_host = any(p.requires_grad and on_host(p) for p in module.parameters())
                if not self.on_host and module in self._inside_top and self.forwards:
                    # A part of a model seen (torchtitan's loss runs the output projection
                    # chunk by chunk after the model's forward): that forward, continued.
                    self.forward_open = self.forwards
                elif not self.on_host and not _holds_no_tensor(module):
                    self._forward_begins(module)
            self._modules.append(type(module).__name__)
            self._calls.append(call)
            self._above[id(call)] = None

        def left(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
            # This forward's call, and any inner one that ended without this hook.
            call = sys._getframe(1)
            if torch._C._current_graph_task_id() != -1 and self._recomputing:
                while self._recomputing and self._recomputing.pop()[0] != id(call):
                    pass
                return
            while self._calls:
                done = self._calls.pop()
                self._modules.pop()
                del self._above[id(done)]
                if done is call:
                    break
            if not self._modules:
                self.forward_open = 0
                self.on_host = False

        return [(register_module_forward_pre_hook, entered), (register_module_forward_hook, left)]

    def _forward_begins(self, module: torch.nn.Module) -> None:
        """A top-level forward of a model on the GPU begins: counted, and given its generation."""
        self.forwards += 1
        self.forward_open = self.forwards
        if module not in self._top_modules:
            self._top_modules.add(module)
            self._inside_top.update(m for m in module.modules() if m is not module)
        grad = torch.is_grad_enabled()
        if grad or self._last_forward_grad or self._backward_seen:
            self._generation += 1
        self._generation_of[self.forwards] = self._generation
        self._module_of[self.forwards] = weakref.ref(module)
        self._last_forward_grad = grad
        self._backward_seen = False

    @contextlib.contextmanager
    def frames_fixed(self, frame: Any) -> Iterator[None]:
        """The block runs below ``frame`` (a backward's call), whose frames out do not change
        meanwhile: a stack taken inside is walked as far as it, and the rest taken once, as
        above a forward's call. A training loop's backward (a trainer's, forty frames deep)
        allocates most of a step's tensors, each of which takes a stack."""
        key = id(frame)
        if key in self._above:
            yield
            return
        # Forwards that ended without their hook are taken off first: the walks inside stop here.
        self._drop_ended(frame)
        self._above[key] = None
        # Held, so that no other frame takes its id while it is listed.
        self._fixed.append(frame)
        try:
            yield
        finally:
            self._fixed.remove(frame)
            self._above.pop(key, None)

    @contextlib.contextmanager
    def one_stack(self) -> Iterator[None]:
        """The block runs a compiled graph: what it allocates and frees on this thread is named
        by the stack of the graph's call, taken once here. Each of its operations would otherwise
        walk the same frames out, below the graph interpreter's own, which name nothing (a
        compiled module's memory is named by the line that calls it). Inside a graph running
        already, the stack it named stands."""
        if self._one_stack is not None:
            yield
            return
        self._one_stack = (threading.get_ident(), self._stack_id())
        try:
            yield
        finally:
            self._one_stack = None

    def _drop_ended(self, call: Any) -> None:
        """Takes off the list the forwards' calls that ended without their forward hook (an
        exception; checkpointing stops its recomputation early by raising): their frames,
        held here, would keep their tensors alive. ``call`` is the frame starting a forward."""
        # Outside backward, no recomputation runs.
        self._recomputing.clear()
        if not self._calls:
            return
        innermost = self._calls[-1]
        f = call.f_back
        while f is not None and f is not innermost:
            f = f.f_back
        if f is not None:
            # The innermost listed call is running, and so is every one outside it.
            return
        running = set()
        f = call
        while f is not None:
            running.add(id(f))
            f = f.f_back
        # A listed frame is alive (held), so no running frame can share its id.
        keep = len(self._calls)
        while keep and id(self._calls[keep - 1]) not in running:
            keep -= 1
        self._drop_calls(keep)

    @property
    def module_depth(self) -> int:
        """How many modules' forwards are running now, one inside the other (1: a top-level forward)."""
        return len(self._modules) + len(self._live_recomputing())

    def _live_recomputing(self) -> list[tuple[int, str]]:
        """The recomputed forwards running: none once the backward is over (a recomputation that
        stopped early, by raising past its forward hooks, is left on the list until the next forward)."""
        if self._recomputing and torch._C._current_graph_task_id() == -1:
            self._recomputing.clear()
        return self._recomputing

    def innermost_module(self) -> str | None:
        """The class of the innermost module whose forward is running (or was, when an error left it), if any."""
        recomputing = self._live_recomputing()
        if recomputing:
            return recomputing[-1][1]
        return self._modules[-1] if self._modules else None

    # ---- what the step does ----

    def __enter__(self) -> Recorder:
        self._garbage.install()
        try:
            return super().__enter__()
        except BaseException:
            self._garbage.uninstall()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._garbage.uninstall()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        self._garbage.after_op(self.ops)
        if self.out_of_memory is not None:
            self.out_of_memory.before_op()
        if not self.ops % TIME_CHECK_EVERY:
            self._check_time()
        if self.capturing:
            return func(*args, **kwargs)
        if _composite(func):
            # Reached undecomposed only where autograd is left out (``torch.inference_mode()``,
            # Lightning's validation): its pieces are recorded one by one, as in every other
            # step, so that a temporary inside it (``cross_entropy``'s log-probabilities) counts.
            _push_mode(self)
            try:
                out = func.decompose(*args, **kwargs)
            finally:
                _pop_mode()
            if out is not NotImplemented:
                return out
        if kwargs.get("pin_memory"):
            # Pinned host memory asked below Python's functions (activations saved to the
            # host by autograd's hooks): plain host memory here, counted as pinned.
            out = func(*args, **dict(kwargs, pin_memory=False))
            self.host.hold(out, pinned=True)
            return out
        if func is _PIN_MEMORY:
            # Pinning below Python's functions: page-locked memory needs a GPU; the tensor
            # stands for its pinned copy, counted as such (``HostMemory``).
            self.host.hold(args[0], pinned=True)
            return args[0]
        if func is _LOCAL_SCALAR_DENSE and on_meta(args[0]):
            return self.read_back(args[0], "Tensor.item()").item()
        if func is _COPY and not on_meta(args[0]) and on_meta(args[1]):
            # A copy back to the host made below Python (DDP's bucket indices
            # after their broadcast) brings the values where the step made
            # them known; else the host tensor keeps its own, which on rank 0
            # are the ones sent. (A script's own reads, .cpu() and .item(),
            # are met above and noted.)
            known = self.values.get(args[1])
            if known is not None and known.values.shape == args[0].shape:
                args[0].copy_(known.values)
            return args[0]
        if self.refused and _multiplies(func):
            refusal = self.refused.get(func.overloadpacket.__name__)
            if refusal is not None:
                raise RuntimeError(refusal)
        if func in _SET_STORAGE and self.placement.deciding and isinstance(args[1], torch.UntypedStorage):
            self.placement.set_storage(args[0], args[1])
        try:
            out = _run(func, args, kwargs)
        except (NotImplementedError, RuntimeError) as e:
            if _answers_a_value(func) and any(on_meta(t) for t in args):
                # A flag or a number answered from values inside one operator (``allclose``,
                # ``equal``: YOLO's AMP check compares two predictions), which meta cannot
                # give: computed on the host from the values the step knows, the rest read as 0.
                name = f"torch.{func.overloadpacket.__name__}"
                return func(*(self.read_back(t, name) if on_meta(t) else t for t in args), **kwargs)
            # An operation whose result's shape depends on values (nonzero,
            # masked_select) runs on the CPU where its inputs' values are known.
            computed = self.values.run_on_cpu(func, args, kwargs) if isinstance(e, NotImplementedError) else None
            by_position = self.values.masks_as_indices(func, args) if computed is None and isinstance(e, NotImplementedError) else None
            if by_position is not None:
                # Indexed by a mask whose values are known (labels' positions): by the positions it selects.
                computed = func(*by_position, **kwargs)
            if computed is None:
                # Sized by data the step does not have: at its largest, noted.
                computed = self.selections.worst_case(func, args, kwargs)
                if computed is not None:
                    self.trace.worst_sized.append((func.overloadpacket.__name__, _where(self._stack())))
            if computed is not None:
                for t in tree_leaves(computed):
                    if on_meta(t):
                        self.track(t, may_refuse=True)
                return computed
            # Meta tensors raise NotImplementedError where an operation needs
            # the values (nonzero, unique) or has no meta kernel, and a custom
            # operator without a fake implementation a RuntimeError saying
            # so; any other error is the step's own and would happen on the
            # GPU too.
            kernel_missing = isinstance(e, NotImplementedError) or any(m in str(e) for m in _NO_FAKE_KERNEL)
            if kernel_missing and any(on_meta(t) for t in tree_leaves((args, kwargs))):
                error = StepUnsupportedError(
                    str(func.overloadpacket.__name__),
                    _where(self._stack()),
                    _first_sentence(e),
                    self.innermost_module(),
                )
                # PyTorch's own operators that fail here need values; another
                # library's operator lacks the fake kernel its author can add.
                error.needs_kernel = getattr(func, "namespace", "aten") not in ("aten", "prims")
                raise error from None
            raise
        with torch._C.DisableTorchFunction():
            # What the recorder asks of tensors (their storages, sizes, devices) is its own
            # business: past the function mode, which would see each question as the script's.
            if func is _DETACH and self._index.get(out.untyped_storage()) is not None:
                # Autograd detaches each tensor it saves (a checkpointed step: four in ten of its
                # operations): the same storage, recorded already, under another tensor; only its
                # values, where it has them, go with it.
                self.values.after(func, args, kwargs, out)
            else:
                self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Records what an operation that ran made and read: new storages, a forward's reads,
        small values, and cuBLAS's workspace at a thread's first multiply."""
        if self.forward_open and not self._deferred:
            self._note_reads(func, args, kwargs)
        if not self.fusing:
            placement = self.placement
            where = placement.made_where(tensors_in(args, kwargs)) if placement.deciding else None
            if where is not None:
                self._script_meta(func, args, kwargs, out, where)
            for t in tensors_in(out):
                if on_meta(t):
                    self.track(t, may_refuse=True)
        if not self.forward_open and torch._C._current_graph_task_id() == -1:
            if self.forwards and isinstance(out, torch.Tensor):
                # (Backward's copies feed no forward.)
                self._carry_forward_origin(args, out)
            if not self._deferred:
                self._note_update(func, args, kwargs, out)
            if self._batch and isinstance(out, torch.Tensor):
                self._made_of_batch(func, args, kwargs, out)
        selecting = func in SELECTING
        if selecting or self.selections.bounds:
            self.selections.bounded(func, args, kwargs, out)
        self.values.after(func, args, kwargs, out)
        if selecting:
            self.selections.made(func, args, out)
        if self._cublas_workspace > 0 and not self._deferred and _multiplies(func):
            thread = "backward" if torch._C._current_graph_task_id() != -1 else "main"
            # A multiply of the script's own meta tensors (Lightning's measure_flops runs a
            # meta model's forward and backward) runs on no GPU and takes no workspace.
            if thread not in self._workspaces and any(self.placement.on_gpu(t) for t in tensors_in(args, kwargs)):
                workspace = torch.empty(self._cublas_workspace, dtype=torch.uint8, device=FAKE_DEVICE)
                self._workspaces[thread] = workspace
                index = self.track(workspace, may_refuse=True)
                if index is not None:
                    self.trace.library.add(index)

    def _script_meta(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, where: str) -> None:
        """Notes the new storages of an operation's outputs as the script's own meta, or the host's
        (``where``): no device memory."""
        made_from = set()
        if func is not _LIFT_FRESH:
            # (``torch.tensor(..., device="meta")`` makes its tensor where no mode sees it, and
            # hands it to ``lift_fresh``, which returns it: new, though it is its input.)
            made_from = {id(t.untyped_storage()) for t in tensors_in(args, kwargs) if on_meta(t) and not is_traceable_wrapper_subclass(t)}
        # A module's weight made for the host in its constructor: the stack that made it, where its
        # copy on the GPU is said to be made (the layer holding it, as if it had been built there).
        born_at = self._stack_id() if self.placement.asked == ASKED_HOST else None
        for t in tensors_in(out):
            if not on_meta(t) or is_traceable_wrapper_subclass(t):
                continue
            st = t.untyped_storage()
            # A view of an input, or the input itself (``.to("meta")`` of a tensor already there), keeps its place.
            if id(st) not in made_from and st not in self._index:
                self.placement.mark(st, where, born_at)

    def _note_update(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Notes an operation run between forwards and backwards: what it wrote in place (its
        first argument, or ``out=``) or made, and which allocations it read besides."""
        name = func.overloadpacket.__name__
        if name in _NO_DATA_FROM_INPUTS:
            return
        if "out" in kwargs:
            written, in_place = tensors_in(kwargs["out"]), True
        elif name.endswith("_") and args:
            written, in_place = tensors_in(args[0]), True
        else:
            written, in_place = tensors_in(out), False
        made = {i for t in written if (i := self.index_of(t)) is not None}
        read = {i for t in tensors_in(args, kwargs) if (i := self.index_of(t)) is not None} - made
        if made and read:
            self.trace.updates.append((tuple(made), tuple(read), in_place))

    def batch_given(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` are the batch, copied to the GPU: what the script makes of them alone outside any forward is the batch too."""
        for t in tensors:
            if on_meta(t):
                self._batch[t.untyped_storage()] = 0

    def _made_of_batch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> None:
        """Marks a tensor made outside any forward from the batch and nothing else (YOLO's
        ``batch["img"].float() / 255``) as the batch; one made of the batch and the model's
        output (a loss), or only shaped like the batch (``zeros_like``), is not."""
        if not on_meta(out) or func.overloadpacket.__name__ in _NO_DATA_FROM_INPUTS:
            return
        read = [t.untyped_storage() for t in tensors_in(args, kwargs) if on_meta(t)]
        st = out.untyped_storage()
        if not read or st in self._batch or not all(r in self._batch for r in read):
            return
        self._batch[st] = 0
        index = self._index.get(st)
        if index is not None:
            self.trace.batch.add(int(index))

    def _carry_forward_origin(self, args: tuple[Any, ...], out: torch.Tensor) -> None:
        """Gives a tensor made between forwards, as a whole rearranged copy of one a forward
        made, that forward as its origin: a beam search reorders its cache this way, and
        the copy is the cache the next forward reads."""
        if not on_meta(out) or not args or not on_meta(args[0]):
            return
        source = args[0]
        origin = self._index.get(source.untyped_storage())
        made = self._made_in.get(int(origin)) if origin is not None else None
        if origin is None or not made or source.numel() != out.numel():
            return
        index = self._index.get(out.untyped_storage())
        if index is not None and int(index) not in self._made_in:
            self._made_in[int(index)] = made
            self._copied_from[int(index)] = int(origin)

    def _note_reads(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Marks the allocations a forward reads that an earlier forward of its generation
        made, or that an earlier one read too: held across forwards (a key-value cache,
        written by one step of a generation and read by the next), and those it writes in place."""
        now = self.forward_open
        if func.overloadpacket.__name__.endswith("_") and args and on_meta(args[0]):
            # An in-place operation writes its first argument (a static cache's index_copy_).
            written = self._index.get(args[0].untyped_storage())
            if written is not None:
                self._written_in[int(written)] = now
        generation = self._generation_of.get(now)
        for t in tensors_in(args, kwargs):
            if not on_meta(t) or is_traceable_wrapper_subclass(t):
                continue
            index = self._index.get(t.untyped_storage())
            if index is None or index in self.trace.kv_cache:
                continue
            made = self._made_in.get(int(index), 0)
            if made:
                earlier = made if made < now else None
            else:
                first = self._first_reader.setdefault(int(index), now)
                earlier = first if first != now else None
                if not self._written_in.get(int(index), 0):
                    # Made outside the forwards and never written by one: an input they
                    # read again (a prompt each sample starts from), not what they keep.
                    earlier = None
            if earlier is None or not self._of_one_model(earlier, now):
                continue
            if int(index) in self._weight_casts:
                # Read again by a later forward because autocast's region keeps it, not
                # because a forward kept it for the next: a copy of a weight.
                self.trace.module_state.add(int(index))
            elif self._generation_of.get(earlier) == generation:
                self._held_across(int(index))
            elif not self.any_backward:
                # Forwards with gradients on and no backward yet: a generation loop that
                # forgot no_grad, unless a backward comes later and makes it training.
                self._held_across(int(index), until_backward=True)

    def _of_one_model(self, earlier: int, now: int) -> bool:
        """Whether forwards ``earlier`` and ``now`` ran one model: the same module, or one inside the
        other (a generation's encoder, called on its own before the model's steps)."""
        first, second = self._module_of.get(earlier), self._module_of.get(now)
        a, b = first() if first is not None else None, second() if second is not None else None
        if a is None or b is None or a is b:
            return True
        key = (id(a), id(b))
        found = self._one_model.get(key)
        if found is None:
            found = self._one_model[key] = any(m is a for m in b.modules()) or any(m is b for m in a.modules())
        return found

    def weight_cast(self, t: torch.Tensor) -> None:
        """Notes ``t`` as autocast's cached cast of a weight (kept for the region, not by a forward)."""
        index = self.index_of(t)
        if index is not None:
            self._weight_casts.add(index)

    def _last_caches(self) -> None:
        """Marks as cache what the line that made a cache made in a forward that none read
        after: the last forward of a generation grows its cache where the others did."""
        tr = self.trace
        lines = {tr.stack_of[i] for i in tr.kv_cache}
        if not lines:
            return
        for i, made in self._made_in.items():
            if made and i not in tr.kv_cache and i not in tr.module_state and tr.stack_of[i] in lines:
                tr.kv_cache.add(i)

    def _module_state(self) -> None:
        """Finds the tensors the models keep as their own state (buffers, and tables kept as
        attributes) made before their last forward: weights by role, and no cache unless a
        later forward wrote them (a cache a model keeps in its own buffers, as gpt-fast does)."""
        tr = self.trace
        for top in list(self._top_modules):
            for module in top.modules():
                for t in tensors_kept(list(vars(module).values())):
                    index = self.index_of(t)
                    if index is None:
                        continue
                    # The forward it was made in, or for one made outside forwards the first
                    # that read it: kept as state only if a later forward ran with it there
                    # (an input a forward stores on its module is replaced by the next).
                    made = self._made_in.get(index, 0)
                    since = made or self._first_reader.get(index, self.forwards)
                    if since >= self.forwards:
                        continue
                    if index in tr.kv_cache and self._written_in.get(index, 0) > made:
                        continue
                    tr.module_state.add(index)
                    tr.kv_cache.discard(index)

    def _held_across(self, index: int, until_backward: bool = False) -> None:
        """Marks an allocation held across forwards, with those it was copied from; ``until_backward``:
        only as long as no backward runs."""
        while index not in self.trace.kv_cache:
            self.trace.kv_cache.add(index)
            if until_backward:
                self._until_backward.add(index)
            source = self._copied_from.get(index)
            if source is None:
                return
            index = source

    def assume(self, what: str) -> None:
        """Notes a value read from a tensor without data, taken as zero."""
        self.trace.assumed.append((what, _where(self._stack())))

    def read_back(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A meta tensor's values on the host: known where the step made them, else zeros, noted."""
        known = self.values.get(t)
        if known is not None and known.values.shape == t.shape:
            if known.assumed:
                # Values resting on data the step does not have: taken as zero where read.
                self.assume(what)
                return self.host.taken_as_zero(known.values.clone())
            return known.values.clone()
        self.assume(what)
        return self.host.taken_as_zero(host_zeros(t.shape, t.dtype))

    def _check_time(self) -> None:
        """Stops a run past its time limit, saying what it ran and where."""
        if self._stopped is not None:
            # Caught by the script (a bare except) and run on: stopped again at once.
            raise self._stopped
        if self.time_limit is None or time.monotonic() - self._started <= self.time_limit:
            return
        self._stopped = PreflightStopped(self.time_limit, self.ops, _where(self._stack()))
        raise self._stopped

    # ---- allocations and frees ----

    def begin(self) -> None:
        """The step begins: what the set-up made and still holds is allocated now, in the order it was made."""
        if not self._deferred:
            return
        self._garbage.restart(self.ops)
        alive = self._alive_pending()
        self._deferred = False
        self._pending = []
        # Made before any forward, though allocated as the first one begins.
        open_now, self.forward_open = self.forward_open, 0
        for st, stack_id in alive:
            # Its size now: a storage resized since (FSDP frees by resizing to 0) holds what it holds now.
            index = self._allocate(st, st.nbytes(), stack_id)
            if st in self._batch:
                self.trace.batch.add(index)
        self.forward_open = open_now

    def step_ended(self, later: bool = False) -> None:
        """An optimizer step ends here: the answer gives each step's own peak (``Trace.step_ends``);
        ``later``: the step that seemed to end before does here instead (a second optimizer's step
        is part of the loop's first)."""
        if later and self.trace.step_ends:
            self.trace.step_ends.pop()
        self.trace.step_ends.append(len(self.trace.kinds))

    def held_before_step(self) -> list[int]:
        """Before the step begins: the sizes of the set-up's storages still alive (on the GPU now); after, none."""
        if not self._deferred:
            return []
        return [st.nbytes() for st, _stack_id in self._alive_pending()]

    def _alive_pending(self) -> list[tuple[Any, int]]:
        """The set-up's storages still alive and holding memory, in the order made, each with the stack that made it first."""
        found: dict[int, tuple[Any, int]] = {}
        for ref, _size, stack_id in self._pending:
            st = ref()
            # A storage tracked twice before the step (a parameter moved in place) is held once.
            if st is not None and id(st) not in found and st not in self._index and st.nbytes() > 0:
                found[id(st)] = (st, stack_id)
        return list(found.values())

    @property
    def begun(self) -> bool:
        """Whether the step has begun (allocations are recorded as they happen)."""
        return not self._deferred

    def track(self, t: torch.Tensor, may_refuse: bool = False) -> int | None:
        """Records the storage of ``t`` if it is new; returns its allocation index. Where
        ``may_refuse`` (an operation's new output), an allocation the GPU would refuse raises
        CUDA's error (``out_of_memory``) and is recorded as refused, holding nothing."""
        if is_traceable_wrapper_subclass(t):
            # A wrapper (DTensor: a shard of a parameter) holds no memory of its own; what it wraps does.
            found = [self.track(inner, may_refuse) for inner in plain_tensors(t)]
            return next((i for i in found if i is not None), None)
        st = t.untyped_storage()
        known = self._index.get(st)
        if known is not None:
            return int(known)
        size = st.nbytes()
        if size == 0 or self.placement.holds(st):
            # Nothing held, or the script's own meta tensor: no device memory.
            return None
        # (A copy of a host weight moved to the GPU is said to be made where the weight was.)
        moving_from = self.placement.moving_from
        stack_id = moving_from if moving_from is not None else self._stack_id()
        if self._deferred:
            self._pending.append((weakref.ref(st), size, stack_id))
            return None
        return self._allocate(st, size, stack_id, may_refuse)

    def _allocate(self, st: Any, size: int, stack_id: int, may_refuse: bool = False) -> int:
        tr = self.trace
        index = len(tr.kinds)
        self._append(0, size, stack_id)
        if self.graph_pool:
            tr.pools[index] = self.graph_pool
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._index[st] = index
        self._refs[index] = weakref.ref(st, self._freed_callback(index, id(st)))
        if self.forward_open:
            self._made_in[index] = self.forward_open
        if may_refuse and self.out_of_memory is not None:
            self.out_of_memory.check(index, self.live_bytes)
        return index

    def allocation_refused(self, index: int) -> None:
        """The allocation at ``index`` was refused (CUDA's error is raised): it holds nothing, and
        the death of its storage, which the script may still hold, frees nothing."""
        ref = self._refs.pop(index, None)
        st = ref() if ref is not None else None
        if st is not None:
            self._index.forget(id(st), index)
        self.live_bytes -= self.trace.args[index]
        self._made_in.pop(index, None)

    def index_of(self, t: torch.Tensor) -> int | None:
        """The allocation index of ``t``'s storage, if recorded."""
        if not on_meta(t):
            return None
        if is_traceable_wrapper_subclass(t):
            found = [self.index_of(inner) for inner in plain_tensors(t)]
            return next((i for i in found if i is not None), None)
        return self.index_of_storage(t.untyped_storage())

    def index_of_storage(self, st: Any) -> int | None:
        """The allocation index of storage ``st``, if recorded."""
        known = self._index.get(st)
        return None if known is None else int(known)

    def _freed_callback(self, index: int, key: int) -> Callable[[Any], None]:
        def freed(_ref: Any) -> None:
            self._index.forget(key, index)
            self._free(index)

        return freed

    def _free(self, index: int) -> None:
        self._refs.pop(index, None)
        self.selections.freed(index)
        self.live_bytes -= self.trace.args[index]
        self.trace.freed_in[index] = self.current_phase()
        self._append(1, index)

    def resized(self, st: Any, size: int) -> None:
        """A storage resized in place: its memory goes back and, unless the size is 0, new memory is taken.

        FSDP frees a gathered parameter's memory and takes it again by
        resizing its storage (``_fsdp_param.free_storage``/``alloc_storage``),
        which no operation or object's death shows; on CUDA each is a free
        and an allocation through the caching allocator.
        """
        if st.device.type != FAKE_DEVICE:
            return
        index = self._index.get(st)
        if index is not None and index in self._refs:
            # Dropping the weak reference drops its callback: the free is recorded here, once.
            self._free(int(index))
            del self._index[st]
        if size > 0 and not self._deferred:
            self._allocate(st, size, self._stack_id(), may_refuse=True)

    def empty_cache(self) -> None:
        """Records ``torch.cuda.empty_cache()``."""
        if self.out_of_memory is not None:
            # (What a failed attempt left in cycles goes back before the cache is emptied, as on a GPU.)
            self.out_of_memory.before_op()
        if not self._deferred:
            self._append(2, 0)

    def _append(self, kind: int, arg: int, stack_id: int | None = None) -> None:
        tr = self.trace
        tr.kinds.append(kind)
        tr.args.append(arg)
        tr.phases.append(self.current_phase())
        tr.forward_of.append(self.forward_open)
        tr.stack_of.append(self._stack_id() if stack_id is None else stack_id)

    def current_phase(self) -> str:
        """The phase now: backward while autograd's engine runs, else the one set."""
        if torch._C._current_graph_task_id() != -1:
            # A backward ends the generation its forward began.
            self._backward_seen = self.any_backward = True
            return "backward"
        return self.phase

    # ---- stacks ----

    def _stack(self) -> tuple[tuple[str, int, str], ...]:
        """The frames from here out, oomkit's and PyTorch's dispatch frames left out, at most ``MAX_FRAMES``."""
        return self._frames_from(sys._getframe(1))[:MAX_FRAMES]

    def _frames_from(self, f: Any, first: bool = True) -> tuple[tuple[str, int, str], ...]:
        """The frames from ``f`` out, walked as far as the innermost forward's call, whose
        frames above are taken (or kept, the first time) whole. A ``first`` walk (from an
        allocation or a free) that meets no listed call finds them all ended."""
        frames: list[tuple[str, int, str]] = []
        above = self._above
        while f is not None and len(frames) < MAX_FRAMES:
            co = f.f_code
            own = _OWN_BY_CODE.get(co)
            if own is None:
                own = _OWN_BY_CODE[co] = any(o in co.co_filename for o in _OWN_FILES)
            if not own:
                frames.append((co.co_filename, f.f_lineno, co.co_name))
            key = id(f)
            if key in above:
                # A forward's call: its own line moves as it runs, the frames above it do not.
                outer = above[key]
                if outer is None:
                    outer = above[key] = self._frames_from(f.f_back, first=False)
                return (*frames, *outer)
            f = f.f_back
        if first and f is None and self._calls and torch._C._current_graph_task_id() == -1:
            # Every forward listed ended without its hook (an exception the script caught):
            # their frames, held, would keep their tensors past the point they are freed.
            self._drop_calls(0)
        return tuple(frames)

    def _drop_calls(self, keep: int) -> None:
        """Takes the forwards' calls after the first ``keep`` off the list, as ended. Their
        frames go last, once the lists are consistent: what they held is freed then, and
        each free walks a stack."""
        ended = self._calls[keep:]
        del self._calls[keep:]
        del self._modules[keep:]
        for call in ended:
            del self._above[id(call)]
        if not self._modules:
            self.forward_open = 0
            self.on_host = False
        del ended

    def _stack_id(self) -> int:
        one = self._one_stack
        if one is not None and one[0] == threading.get_ident():
            return one[1]
        stack = self._stack()
        sid = self._stack_ids.get(stack)
        if sid is None:
            sid = len(self.trace.stacks)
            self.trace.stacks.append(stack)
            self._stack_ids[stack] = sid
        return sid

    def finish(self) -> None:
        """Frees the workspace and stops watching; storages alive now stay allocated."""
        if self.any_backward:
            self.trace.kv_cache -= self._until_backward
        self._module_state()
        self._last_caches()
        for ref in self._refs.values():
            # Dropping the references without their callbacks keeps what is
            # alive at the end allocated, as a snapshot taken then would show.
            del ref
        self._refs = {}
        self._pending = []
        self._workspaces = {}


#: How deep into a user's objects (a module's attributes, an optimizer's, a forward's
#: arguments) tensors are looked for: what a script nests, bounded, so that no structure
#: of its own (one holding itself) can make the walk endless.
KEPT_DEPTH = 3


def tensors_kept(values: list[Any], depth: int = KEPT_DEPTH) -> list[torch.Tensor]:
    """The tensors in ``values`` and in the lists, tuples and dicts inside them, ``depth`` deep."""
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif depth > 1 and isinstance(v, (list, tuple)):
            found += tensors_kept(list(v), depth - 1)
        elif depth > 1 and isinstance(v, dict):
            found += tensors_kept(list(v.values()), depth - 1)
    return found


def _holds_no_tensor(module: torch.nn.Module) -> bool:
    """Whether a module and those inside it hold no tensor: a loss, an activation or a box
    matcher called on a model's output (``nn.CrossEntropyLoss()(logits, y)``, YOLO's assigner
    in its validation loss) is a function, as ``F.cross_entropy`` is, not a model's forward.
    A model that keeps its weights as plain tensor attributes holds them, and is one."""
    if next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
        return False
    return not any(isinstance(v, torch.Tensor) for m in module.modules() for v in vars(m).values())


def _touches_gpu(module: torch.nn.Module, args: tuple[Any, ...], on_gpu: Callable[[Any], bool], call: Any) -> bool:
    """Whether a module's call works on the GPU: its first weight is there, or an argument
    is. A transform a data loader runs on the host does neither. ``call`` is the frame of
    the module's call, which holds the keyword arguments a global hook is not given (a model
    whose weights FSDP offloads to the host, called as ``model(**batch)`` by torchtune)."""
    first: torch.Tensor | None = next(module.parameters(), None)
    if first is None:
        first = next(module.buffers(), None)
    if first is not None and on_gpu(first):
        return True
    if any(on_gpu(t) for t in tensors_kept(list(args))):
        return True
    # (``Module._call_impl``, or the ``inner`` it runs a module with hooks in: both see ``self`` and ``kwargs``.)
    seen = call.f_locals
    kwargs = seen.get("kwargs") if seen.get("self") is module else None
    return isinstance(kwargs, dict) and any(on_gpu(t) for t in tensors_kept(list(kwargs.values())))


def _first_sentence(e: BaseException) -> str:
    """The first sentence of an error's first line: PyTorch's go on with advice meant for compilers."""
    line = _first_line(e)
    cut = line.find(". ")
    return line[:cut] if cut > 0 else line


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
