"""``torch.compile`` under preflight: the graphs AOTAutograd captures, partitioned as the backend would, run on meta.

What a compiled training step holds between its forward and its backward
is what AOTAutograd's partitioner decides to save: with the default
backend (inductor), the min-cut partitioner recomputes cheap pointwise
operations in the backward instead of saving their outputs, often far
less than eager PyTorch saves. The partitioner runs on fake tensors
before any kernel exists, so preflight runs it as ``torch.compile`` does:
the module's forward is captured with the backend's decompositions,
split into a forward and a backward graph by the backend's partitioner,
and both graphs are then run as eager operations on ``meta`` tensors,
recorded like any others, except that a pointwise result inductor would
compute inside the kernel that uses it takes no memory. Only the kernels
themselves differ (a fused kernel's own scratch memory is not modelled,
nor are CUDA graphs' private pools under ``mode="reduce-overhead"``), and
the answer notes it.

The graph is captured by AOTAutograd's own tracer, not by Dynamo's
bytecode capture: Dynamo would trace preflight's stand-ins for CUDA too.
For a forward without graph breaks both give AOTAutograd the same ATen
graph. A forward that cannot be captured whole (it reads a tensor's
value, writes its modules' Python attributes, or calls what cannot be
traced) runs eagerly, and the answer says so with the reason: more than
Dynamo, which compiles the parts around what it cannot capture, holds.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from oomkit.preflight.notes import Notes
from oomkit.preflight.world.dist import spread_by
from oomkit.preflight.world.flex import compiled_alone, eager_wrapper

if TYPE_CHECKING:
    from oomkit.preflight.record.recorder import Recorder
    from oomkit.preflight.world.autocast import Autocast

#: The note a compiled step leaves: what is modelled, and what is not.
COMPILED = (
    "torch.compile ({backend}) was modelled: its graphs were captured and split by "
    "AOTAutograd's partitioner as the backend splits them, then run on meta; fused kernels' "
    "own scratch memory is not counted, and memory inside a compiled module is named by the line that calls it"
)

#: The note a backend preflight does not model leaves.
NOT_MODELLED = "torch.compile's backend {backend!r} is not modelled: the step is measured as eager PyTorch runs it"

#: The note a forward that could not be captured whole leaves.
RAN_EAGER = (
    "torch.compile could not capture {what}'s forward whole ({reason}): it was measured as eager PyTorch "
    "runs it, where Dynamo would compile the parts around what it cannot capture"
)

#: The note a compiled callable that reached Dynamo's recompile limit leaves.
RECOMPILES = (
    "torch.compile compiled {what} for {limit} sizes of its inputs, Dynamo's recompile limit: "
    "inputs of other sizes were measured as eager PyTorch runs them, as Dynamo runs them"
)

#: How many graphs Dynamo compiles for one function before it runs the rest eager
#: (``torch._dynamo.config.recompile_limit``, where the script leaves it).
RECOMPILE_LIMIT = 8

#: What a capture that failed returns.
_FAILED = object()

#: The note CUDA graphs leave.
CUDA_GRAPHS = (
    "torch.compile mode={mode!r} records CUDA graphs, whose private memory pool is not modelled: "
    "the graphs' inputs and outputs are kept alive between replays on a GPU"
)

#: Modes that record CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")

#: Backends that compile through AOTAutograd with inductor's decompositions and min-cut partitioner.
INDUCTOR_LIKE = ("inductor", "aot_eager_decomp_partition")

#: Backends that compile through AOTAutograd with the min-cut partitioner, no decompositions.
MIN_CUT = ("aot_eager",)

#: Backends that compile through AOTAutograd with the default partitioner (save every output backward reads).
DEFAULT_PARTITION = ("aot_eager_default_partitioner",)


@dataclass(frozen=True)
class Partition:
    """How a backend splits a captured graph: which partitioner, with which decompositions."""

    #: The backend's name, as the note shows it.
    backend: str
    #: ``min_cut`` (recompute cheap operations) or ``default`` (save what backward reads).
    partitioner: str
    #: Whether inductor's decompositions are applied before partitioning.
    inductor_decompositions: bool


def partition_of(backend: Any) -> Partition | None:
    """How ``backend`` (a name, or a callable) splits a graph; None where the step runs eager.

    A name PyTorch does not know raises the error ``torch.compile`` raises.
    """
    if backend is None:
        backend = "inductor"
    if not isinstance(backend, str):
        return None
    from torch._dynamo.backends.registry import lookup_backend

    lookup_backend(backend)
    if backend in INDUCTOR_LIKE:
        return Partition(backend, "min_cut", True)
    if backend in MIN_CUT:
        return Partition(backend, "min_cut", False)
    if backend in DEFAULT_PARTITION:
        return Partition(backend, "default", False)
    return None


def check_mode(mode: str | None) -> None:
    """Raises the error ``torch.compile`` raises for a mode it does not know."""
    if mode is None:
        return
    from torch._inductor import list_mode_options

    known = list(list_mode_options())
    if mode not in known:
        raise RuntimeError(f"Unrecognized mode={mode}, should be one of: {', '.join(known)}")


class Compiler:
    """``torch.compile``'s stand-in: compiled modules and functions whose graphs are partitioned as the backend would."""

    def __init__(self, notes: Notes, recorder: Recorder, autocast: Autocast) -> None:
        self.notes = notes
        self.recorder = recorder
        self.autocast = autocast
        #: The classes registered as pytree nodes for a capture (Hugging Face's caches), to remove again.
        self.registered: list[type] = []

    def registrations(self) -> Any:
        """A handle whose ``remove()`` takes back the pytree nodes the captures registered, for the
        fake GPU's ledger: after a preflight, PyTorch's registry is as it was."""
        compiler = self

        class Handle:
            def remove(self) -> None:
                import torch.fx._pytree as fx_pytree
                import torch.utils._pytree as pytree

                for cls in compiler.registered:
                    pytree._deregister_pytree_node(cls)
                    fx_pytree._deregister_pytree_flatten_spec(cls)
                compiler.registered.clear()

        return Handle()

    def register_caches(self) -> None:
        """Hugging Face's ``DynamicCache`` as a pytree node, the way transformers registers it for
        ``torch.export``, where the script uses transformers: a forward that returns its cache
        (a model's default in training too) can then be captured, as Dynamo captures it."""
        cache_utils = sys.modules.get("transformers.cache_utils")
        cls = getattr(cache_utils, "DynamicCache", None)
        if cls is None or cls in self.registered:
            return
        import torch.utils._pytree as pytree

        if cls in pytree.SUPPORTED_NODES:
            return
        try:
            from transformers.integrations.executorch import register_dynamic_cache_export_support
        except ImportError:
            return
        register_dynamic_cache_export_support()
        if cls in pytree.SUPPORTED_NODES:
            self.registered.append(cls)

    def _note(self, note: str) -> None:
        self.notes.add(note)

    def stand_in(self) -> Callable[..., Any]:
        """The function that replaces ``torch.compile`` (its arguments, its errors)."""

        def compile(model: Any = None, *, backend: Any = None, mode: str | None = None, disable: bool = False, **_: Any) -> Any:
            if model is None:
                return lambda m: compile(m, backend=backend, mode=mode, disable=disable)
            check_mode(mode)
            partition = partition_of(backend)
            if disable or eager_wrapper(model):
                return model
            if mode in CUDA_GRAPH_MODES:
                self._note(CUDA_GRAPHS.format(mode=mode))
            if partition is None:
                name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
                self._note(NOT_MODELLED.format(backend=name))
                return model
            return self.compiled(model, partition)

        return compile

    def compiled(self, target: Any, partition: Partition) -> Any:
        """``target`` compiled: a module as ``torch.compile`` wraps one, a module's own
        ``compile()`` (its ``_call_impl``), or a function."""
        if isinstance(target, torch.nn.Module):
            return _compiled_module(target, _Graphs(self, partition, target))
        flex = compiled_alone(target, self.recorder)
        if flex is not None:
            return flex
        owner = getattr(target, "__self__", None)
        if isinstance(owner, torch.nn.Module) and getattr(target, "__name__", "") in ("_call_impl", "__call__", "forward"):
            # nn.Module.compile() sets this as the module's call: the module's own call runs under it.
            graphs = _Graphs(self, partition, owner, call=target)
            return functools.wraps(target)(graphs)
        return functools.wraps(target)(_Graphs(self, partition, None, call=target))

    @contextlib.contextmanager
    def capturing(self) -> Iterator[Callable[[], None]]:
        """The block in which AOTAutograd traces a forward: the recorder lets the tracer's fake
        tensors pass unrecorded, global module hooks (the step's bookkeeping) are held back, and
        autocast's cast cache is the trace's own. Yields the call that ends the capture (the
        graphs are ready and run next, recorded)."""
        import torch.nn.modules.module as nn_module

        hooks = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks)
        held = [dict(h) for h in hooks]
        cache = self.autocast.cache
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            self.recorder.capturing = False
            self.recorder.placement.telling = True
            self.autocast.cache = cache
            refusal.remove()
            for h, saved in zip(hooks, held):
                h.update(saved)

        self.recorder.capturing = True
        # The tracer makes its fake tensors from the meta tensors as they are, reading their device.
        self.recorder.placement.telling = False
        self.autocast.cache = {}
        for h in hooks:
            h.clear()
        # Global hooks run before a module's own: FSDP's and DDP's never see the tracer's tensors.
        refusal = nn_module.register_module_forward_pre_hook(_refuse_spread)
        try:
            with _composites_decomposed():
                yield end
        finally:
            end()


def _meta_shadowed_composites() -> list[Any]:
    """PyTorch's composite operators (``nll_loss``, ``broadcast_tensors``) whose Python reference
    is also registered as their ``meta`` kernel.

    Such a registration names its operator, so the operator is among those
    ``torch.ops.aten`` has already resolved: the walk needs no list of all
    operators.
    """
    from torch._C import DispatchKey

    found = []
    for packet in list(vars(torch.ops.aten).values()):
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for op in list(vars(packet).values()):
            if (
                isinstance(op, torch._ops.OpOverload)
                and DispatchKey.Meta in op.py_kernels
                and (
                    DispatchKey.CompositeImplicitAutograd in op.py_kernels
                    or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
                )
            ):
                found.append(op)
    return found


@contextlib.contextmanager
def _composites_decomposed() -> Iterator[None]:
    """While AOTAutograd traces ``meta`` tensors, composite operators decompose before autograd,
    as they do for the CUDA tensors ``torch.compile`` traces.

    AOTAutograd traces with PyTorch's Python dispatcher on, which would run
    a composite's ``meta`` reference in place of its decomposition for a
    ``meta`` tensor, under autograd: the operator would have no gradient
    (``nll_loss``: a loss whose backward reaches no weight).
    """
    from torch._C import DispatchKey

    held = {op: op.py_kernels.pop(DispatchKey.Meta) for op in _meta_shadowed_composites() if DispatchKey.Meta in op.py_kernels}
    for op in held:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in held.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


#: No output yet: the forward pre-hooks are run, not the forward hooks.
_NO_OUTPUT = object()


def _nothing_to_end() -> None:
    """The end of a capture when none is running."""


class _Graphs:
    """A compiled callable: per kind of input, a forward and backward graph partitioned as the backend would."""

    def __init__(self, compiler: Compiler, partition: Partition, module: torch.nn.Module | None, call: Any = None) -> None:
        self.compiler = compiler
        self.partition = partition
        self.module = module
        self.call = call
        # By signature of the inputs: the compiled callable, or None where the forward runs eager.
        self.by_signature: dict[tuple[Any, ...], Any] = {}
        # The signatures without sizes seen so far, whether symbolic sizes can be traced, and the graphs made for one size each.
        self.sizes_seen: set[tuple[Any, ...]] = set()
        self.dynamic_works = True
        self.static_graphs = 0
        # Whether the compilation running now has captured its graphs, and the call that ends its capture.
        self.captured = False
        # The modules' Python attributes before the capture running now.
        self.state = _ModuleState([])
        # The modules it reads, once known.
        self.reached: list[torch.nn.Module] | None = None
        self.ends_capture: Callable[[], None] = _nothing_to_end
        # The inputs of the call being captured that the tracer cannot take.
        self._held = _HeldOut()
        # For a module's own compile() once FSDP or DDP spreads it: its forward's graphs alone.
        self._inner: _Graphs | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is not None and self.call is not None and spread_by(self.module) is not None:
            return self._hooks_eager(*args, **kwargs)
        static = self._signature(args, kwargs, sizes=True)
        general = self._signature(args, kwargs, sizes=False)
        for key in (static, general):
            if key in self.by_signature:
                compiled = self.by_signature[key]
                if compiled is None:
                    return self._eager(*args, **kwargs)
                with self.compiler.recorder.placement.running_compiled():
                    self._global_hooks(args)
                    out = compiled(*args, **kwargs)
                    self._global_hooks(args, out)
                    return out
        if general in self.sizes_seen and self.dynamic_works:
            # Inputs that differ from ones seen only in their sizes get one graph with symbolic
            # sizes, as Dynamo's automatic dynamic shapes compile one after the first change of size.
            out = self._capture(general, True, args, kwargs)
            if out is not _FAILED:
                return out
            # Where symbolic sizes cannot be traced, each size gets its own graph, as far as Dynamo's limit.
            self.dynamic_works = False
        self.sizes_seen.add(general)
        limit = _recompile_limit()
        if self.static_graphs >= limit:
            self.compiler._note(RECOMPILES.format(what=self._what(), limit=limit))
            self.by_signature[static] = None
            return self._eager(*args, **kwargs)
        self.static_graphs += 1
        out = self._capture(static, False, args, kwargs)
        if out is _FAILED:
            # What cannot be captured at one size cannot at others: these inputs run eager at every size.
            self.by_signature[general] = None
            return self._eager(*args, **kwargs)
        return out

    def _capture(self, key: tuple[Any, ...], dynamic: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Captures, partitions and runs the graphs for ``key``'s inputs; ``_FAILED`` where they
        cannot be captured (noted, unless only symbolic sizes failed)."""
        self.compiler.register_caches()
        compiled = self._aot(dynamic)
        self.captured = False
        self.state = _ModuleState(self._modules())
        try:
            with self.compiler.capturing() as end, self.compiler.recorder.placement.running_compiled():
                began: list[bool] = []
                grad = torch.is_grad_enabled()

                def ended() -> None:
                    end()
                    if not began:
                        # The graphs run from here: the module's forward begins, as its hooks say,
                        # in the call's own grad mode (AOTAutograd compiles without gradients).
                        began.append(True)
                        with torch.set_grad_enabled(grad):
                            self._global_hooks(args)

                self.ends_capture = ended
                try:
                    out = compiled(*args, **kwargs)
                finally:
                    # The call's inputs are held by the closure only while it captures.
                    self.ends_capture = _nothing_to_end
                self._global_hooks(args, out)
        except Exception as e:
            # A failure to capture runs the forward eager, named; one after is the step's own.
            if self.captured:
                raise
            self.state.restore()
            if not dynamic:
                self.compiler._note(RAN_EAGER.format(what=self._what(), reason=_reason(e)))
                self.by_signature[key] = None
            return _FAILED
        self.by_signature[key] = compiled
        self.compiler._note(COMPILED.format(backend=self.partition.backend))
        return out

    def _hooks_eager(self, *args: Any, **kwargs: Any) -> Any:
        """A module's own ``compile()`` where FSDP or DDP spreads the module (torchtitan compiles
        each block, then shards it): as Dynamo skips their hooks, which gather and free the
        weights, those run eager around the module's ``forward``, which alone is captured."""
        module = self.module
        assert module is not None
        if self._inner is None:
            self._inner = _Graphs(self.compiler, self.partition, None, call=module.forward)
        own = vars(module).get("forward", _NO_OUTPUT)
        module.forward = self._inner
        try:
            return self._eager(*args, **kwargs)
        finally:
            if own is _NO_OUTPUT:
                del module.forward
            else:
                module.forward = own

    def _global_hooks(self, args: tuple[Any, ...], out: Any = _NO_OUTPUT) -> None:
        """For a module's own ``compile()``, which replaces its call whole: the global forward
        pre-hooks (no ``out``) or forward hooks, run around its graphs as its compiled call runs
        them, since the step's bookkeeping (which forward runs, its phase) is kept there."""
        if self.module is None or self.call is None:
            return
        import torch.nn.modules.module as nn_module

        if out is _NO_OUTPUT:
            for pre_hook in list(nn_module._global_forward_pre_hooks.values()):
                pre_hook(self.module, args)
        else:
            for hook in list(nn_module._global_forward_hooks.values()):
                hook(self.module, args, out)

    def _modules(self) -> list[torch.nn.Module]:
        """The modules whose parameters the compiled callable reads: its own, or those a
        function reaches (found at its first call, as Dynamo guards on them then)."""
        if self.reached is None:
            self.reached = [self.module] if self.module is not None else modules_reached(self.call)
        return self.reached

    def _what(self) -> str:
        """The compiled module's class, or the function's name, for a note."""
        return type(self.module).__name__ if self.module is not None else getattr(self.call, "__name__", "a function")

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        with self._own_call():
            if self.call is not None:
                return self.call(*args, **kwargs)
            assert self.module is not None
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def _own_call(self) -> Iterator[None]:
        """While the module's own call runs inside its compiled one (``nn.Module.compile()``),
        the module is not compiled: else its call would come back here."""
        module = self.module
        if module is None or self.call is None or getattr(module, "_compiled_call_impl", None) is None:
            yield
            return
        held, module._compiled_call_impl = module._compiled_call_impl, None
        try:
            yield
        finally:
            module._compiled_call_impl = held

    def _aot(self, dynamic: bool) -> Callable[..., Any]:
        """A new AOTAutograd compilation (it captures at its first call, for those inputs; with
        ``dynamic``, for any sizes)."""
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

        partition_fn: Any = default_partition
        if self.partition.partitioner == "min_cut":
            partition_fn = min_cut_rematerialization_partition
            if self.partition.inductor_decompositions:
                partition_fn = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
        decompositions = None
        if self.partition.inductor_decompositions:
            from torch._inductor.compile_fx import select_decomp_table

            decompositions = select_decomp_table()

        def ready(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            kept = self.state.changed()
            if kept:
                # Dynamo would replay the forward's writes to Python state at each call; a
                # graph alone cannot, and the trace's own tensors must not stay behind.
                raise _StateKept(f"its forward keeps state in Python attributes ({', '.join(kept[:3])})")
            # The first graph ready ends the capture: what runs from here is the step, recorded.
            self.captured = True
            self.ends_capture()
            return _ran(gm, self.compiler.recorder, self.compiler.autocast)

        def aot(fn: Callable[..., Any], params_and_buffers: int) -> Any:
            # The first so many of its inputs are the parameters and buffers, as AOTAutograd is told.
            return aot_function(
                fn,
                fw_compiler=ready,
                bw_compiler=ready,
                partition_fn=partition_fn,
                decompositions=decompositions,
                num_params_buffers=params_and_buffers,
                keep_inference_input_mutations=True,
                dynamic=dynamic,
            )

        module = self.module
        if module is None:
            return self._aot_function(aot)

        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())

        def functional(named_params: dict[str, Any], named_buffers: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            args, kwargs = self._held.put_back(args, kwargs)
            with self._own_call():
                return torch.func.functional_call(module, {**named_params, **named_buffers}, args, kwargs)

        inner = aot(functional, len(params) + len(buffers))

        def run(*args: Any, **kwargs: Any) -> Any:
            # The module's tensors as they are now (a fix may have replaced some), passed as the graph's inputs.
            params_now = dict(module.named_parameters())
            args, kwargs = self._held.hold_out(args, kwargs)
            return inner(params_now, dict(module.named_buffers()), *args, **kwargs)

        return run

    def _aot_function(self, aot: Callable[[Callable[..., Any], int], Any]) -> Callable[..., Any]:
        """A compiled function's AOTAutograd compilation (made by ``aot``). The parameters and
        buffers of the modules it reaches are its graph's inputs, as Dynamo lifts them:
        AOTAutograd's tracer takes only tensors it is given."""
        from torch.nn.utils.stateless import _reparametrize_module

        fn = self.call
        modules = self._modules()

        def tensors_now() -> dict[str, torch.Tensor]:
            # As they are now (a fix may have replaced some), each module's under its index.
            return {f"{i}.{name}": t for i, m in enumerate(modules) for name, t in (*m.named_parameters(), *m.named_buffers())}

        def functional(named: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            args, kwargs = self._held.put_back(args, kwargs)
            with contextlib.ExitStack() as stack:
                for i, m in enumerate(modules):
                    own = {name.partition(".")[2]: t for name, t in named.items() if name.partition(".")[0] == str(i)}
                    stack.enter_context(_reparametrize_module(m, own, tie_weights=True))
                return fn(*args, **kwargs)

        inner = aot(functional, len(tensors_now()))

        def run(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self._held.hold_out(args, kwargs)
            return inner(tensors_now(), *args, **kwargs)

        return run

    def _signature(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, sizes: bool) -> tuple[Any, ...]:
        """What a compiled graph is specialised on: its inputs' shapes (or only their number of
        dimensions), types and whether they need gradients, and the modes."""
        parts: list[Any] = [torch.is_grad_enabled(), self.compiler.autocast.dtype()]
        parts.extend(m.training for m in self._modules())
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                parts.append((tuple(leaf.shape) if sizes else leaf.dim(), leaf.dtype, leaf.requires_grad, leaf.device.type))
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                parts.append(leaf)
            else:
                parts.append(type(leaf).__name__)
        return tuple(parts)


#: The inputs AOTAutograd's tracer takes: tensors, and values it specialises the graph on.
TRACEABLE = (torch.Tensor, int, float, bool, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)


class _HeldOut:
    """The inputs of a compiled call that AOTAutograd cannot take (a FlexAttention ``BlockMask``:
    tensors, sizes and a mask function), held out of its arguments and put back inside the traced
    function, where the graph's capture reads them as Dynamo reads its guarded constants."""

    def __init__(self) -> None:
        self.held: dict[int, Any] = {}

    def hold_out(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with each leaf the tracer cannot take replaced by ``0``, remembered."""
        leaves, spec = tree_flatten((args, kwargs))
        self.held = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, TRACEABLE)}
        if not self.held:
            return args, kwargs
        out: tuple[tuple[Any, ...], dict[str, Any]] = tree_unflatten([0 if i in self.held else x for i, x in enumerate(leaves)], spec)
        return out

    def put_back(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The held-out leaves back in their places in the traced call's arguments."""
        if not self.held:
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        out: tuple[tuple[Any, ...], dict[str, Any]] = tree_unflatten([self.held.get(i, x) for i, x in enumerate(leaves)], spec)
        return out


def modules_reached(fn: Any) -> list[torch.nn.Module]:
    """The modules a compiled function reads directly: its ``self``, its closure's cells and
    the globals its code names, less those inside another one found (their parameters are
    that one's). A module reached only through another function is not found: the capture
    then fails on its parameters, and the function runs eager, noted."""
    found: dict[int, torch.nn.Module] = {}
    code = getattr(fn, "__code__", None)
    candidates = [getattr(fn, "__self__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):
            candidates.append(cell.cell_contents)
    if code is not None:
        names = getattr(fn, "__globals__", {})
        candidates += [names.get(name) for name in code.co_names]
    for c in candidates:
        if isinstance(c, torch.nn.Module):
            found.setdefault(id(c), c)
    inside = {id(sub) for m in found.values() for sub in m.modules() if sub is not m}
    return [m for key, m in found.items() if key not in inside]


def checkpoint_stand_in() -> Any:
    """``torch.utils.checkpoint.checkpoint`` that, met while a compiled forward is captured,
    tags its region for the partitioner as ``torch.compile`` does.

    Dynamo turns a checkpointed region into a higher-order operator whose
    operations AOTAutograd marks "prefer recompute": the partitioner then
    saves the region's inputs and recomputes the rest in backward.
    Traced plainly, the recomputation would be merged back into the forward
    and the checkpoint would save nothing. Outside a capture it is
    PyTorch's own.
    """
    import itertools

    import torch.fx.traceback as fx_traceback
    import torch.utils.checkpoint as ac
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    real = ac.checkpoint
    regions = itertools.count(1)

    def prefer_recompute(_ctx: Any, _op: Any, *_: Any, **__: Any) -> Any:
        return ac.CheckpointPolicy.PREFER_RECOMPUTE

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        if get_proxy_mode() is None:
            return real(function, *args, **kwargs)
        own = kwargs.pop("context_fn", None)
        region = next(regions)

        def contexts() -> Any:
            selective = own is not None and own is not ac.noop_context_fn
            forward, recompute = own() if selective else ac.create_selective_checkpoint_contexts(prefer_recompute)
            forward.ac_graph_id = region
            for mode in (forward, recompute):
                if callable(getattr(mode, "policy_fn", None)):
                    mode.policy_fn = _policy_seeing_flex(mode.policy_fn)
            return forward, recompute

        kwargs.update(use_reentrant=False, preserve_rng_state=False, context_fn=contexts)
        with fx_traceback.preserve_node_meta():
            return real(function, *args, **kwargs)

    return checkpoint


def _policy_seeing_flex(policy: Callable[..., Any]) -> Callable[..., Any]:
    """A selective checkpoint's policy that is asked of compiled FlexAttention's one operator
    (preflight's, in a captured graph) as of ``flex_attention`` itself, which is what Dynamo's
    graph holds and what policies name (torchtitan saves its outputs)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    from oomkit.preflight.world.flex import is_fused_operator

    def asked(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return policy(ctx, flex_hop if is_fused_operator(func) else func, *args, **kwargs)

    return asked


class _Uncapturable(Exception):
    """A forward preflight does not capture, said in words for the note (no exception type)."""


class _StateKept(_Uncapturable):
    """A forward that writes to its modules' Python attributes, which a captured graph cannot replay."""


def _refuse_spread(module: torch.nn.Module, _args: Any) -> None:
    """Stops a capture before a module FSDP shards or DDP replicates runs its own hooks: they
    would initialise their state on the tracer's tensors and leave it half made for the eager
    run that follows. Dynamo too runs those hooks outside its graphs."""
    how = spread_by(module)
    if how is not None:
        raise _Uncapturable(f"{type(module).__name__} is spread over GPUs by {how}, whose hooks preflight runs eager")


class _ModuleState:
    """The Python attributes of a module and its submodules (not their parameters, buffers or
    submodules), lists and dicts one level deep: what a forward traced once may have changed."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.saved: list[tuple[str, torch.nn.Module, dict[str, Any], dict[str, Any]]] = []
        for module in modules:
            for name, m in module.named_modules():
                attrs = {k: v for k, v in vars(m).items() if k not in _REGISTRIES}
                inner = {k: _contents(v) for k, v in attrs.items() if isinstance(v, (list, dict))}
                self.saved.append((name or type(m).__name__, m, attrs, inner))

    def changed(self) -> list[str]:
        """The attributes added, rebound, or whose list or dict changed, since the snapshot."""
        found = []
        for shown, m, attrs, inner in self.saved:
            now = {k: v for k, v in vars(m).items() if k not in _REGISTRIES}
            for k in now.keys() | attrs.keys():
                if now.get(k, _MISSING) is not attrs.get(k, _MISSING) or (k in inner and _contents(now[k]) != inner[k]):
                    found.append(f"{shown}.{k}")
        return found

    def restore(self) -> None:
        """Puts every attribute back as it was."""
        for _shown, m, attrs, inner in self.saved:
            for k in [k for k in vars(m) if k not in _REGISTRIES and k not in attrs]:
                del vars(m)[k]
            for k, v in attrs.items():
                if k in inner:
                    if isinstance(v, list):
                        v[:] = [x for _, x in inner[k]]
                    else:
                        v.clear()
                        v.update({key: x for key, (_, x) in inner[k].items()})
                vars(m)[k] = v


def _contents(v: Any) -> Any:
    """What a list or dict holds, compared by identity (tensors have no plain ``==``)."""
    if isinstance(v, list):
        return [(id(x), x) for x in v]
    return {k: (id(x), x) for k, x in v.items()}


#: A module's registries of parameters, buffers, submodules and hooks, and its compiled call and
#: the forward preflight sets around it (a module's own compile() once FSDP spreads it): not
#: Python state a forward writes.
_REGISTRIES = frozenset(
    {
        "forward",
        "_compiled_call_impl",
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
    }
)

_MISSING = object()


def _ran(gm: torch.fx.GraphModule, recorder: Recorder, autocast: Autocast) -> Any:
    """A graph run as eager operations, in AOTAutograd's boxed convention (it frees its inputs
    as it goes), its fused intermediates unrecorded. The casts autocast made are operations of
    the graph, traced with them: the emulated autocast is not asked again as it runs."""
    fused = fused_away(gm.graph)

    class Run(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n not in fused:
                return super().run_node(n)
            recorder.fusing = True
            try:
                return super().run_node(n)
            finally:
                recorder.fusing = False

    def run(args: list[Any]) -> Any:
        # The backward graph runs from autograd's engine, outside the compiled call.
        with recorder.one_stack(), recorder.placement.running_compiled(), autocast.replaying():
            return Run(gm).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def fused_away(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The pointwise results a fusing compiler never writes to memory: every use of them (through
    views) is another pointwise operation or a reduction, computed in the same kernel.

    Inductor fuses such chains into one kernel that reads the chain's inputs
    and writes its end; run one operation at a time, each link would hold a
    tensor of its own. A result the graph returns (saved for backward, a
    gradient) is written. A constant fill (``full``) is computed where it is
    read, and a scatter of a scalar into one (cross-entropy's backward: the
    one-hot of the targets) is a comparison with the positions, as
    Inductor's ``scatter_upon_const_tensor`` rewrites it. A gather reads
    a pointwise input at the positions it picks, computing just those
    (cross-entropy's forward: the log-probability of each target).
    """

    def pointwise(n: torch.fx.Node) -> bool:
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            return False
        if torch.Tag.pointwise in op.tags or op is _FULL:
            return True
        if op is _SCATTER_VALUE:
            base = n.args[0]
            return isinstance(base, torch.fx.Node) and base.target is _FULL and len(base.users) == 1
        return False

    def fusible_uses(n: torch.fx.Node) -> bool:
        for user in n.users:
            op = user.target
            if user.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
                return False
            if op.is_view:
                if not fusible_uses(user):
                    return False
            elif not (pointwise(user) or torch.Tag.reduction in op.tags or op is _GATHER):
                return False
        return True

    fused = {n for n in graph.nodes if pointwise(n) and n.users and fusible_uses(n)}
    # A view of a result never written is never written either (else it would be counted as new memory).
    for n in graph.nodes:
        op = n.target
        if isinstance(op, torch._ops.OpOverload) and op.is_view and n.args and n.args[0] in fused:
            fused.add(n)
    return fused


#: A constant fill, and a scatter of a scalar (fused as in ``fused_away``).
_FULL = torch.ops.aten.full.default
_SCATTER_VALUE = torch.ops.aten.scatter.value
#: A read at chosen positions, which computes a pointwise input only there.
_GATHER = torch.ops.aten.gather.default


def _compiled_module(module: torch.nn.Module, graphs: _Graphs) -> torch.nn.Module:
    """``module`` wrapped as ``torch.compile`` wraps one (an ``OptimizedModule``: ``_orig_mod``,
    its state dict's names, its attributes), its forward the compiled graphs."""

    class _Context:
        """What ``OptimizedModule`` calls to compile the module's call: here, the graphs."""

        def __call__(self, _call: Any) -> Any:
            return graphs

    compiled: torch.nn.Module = _compiled_class()(module, _Context())
    return compiled


@functools.cache
def _compiled_class() -> type:
    """The class of a module compiled under preflight, made at first use (importing
    ``torch._dynamo`` takes a second): an ``OptimizedModule``, so that code that unwraps
    compiled modules (``_orig_mod``) finds one, called without its warning about global
    hooks (preflight's own)."""
    from torch._dynamo.eval_frame import OptimizedModule

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return torch.nn.Module.__call__(self, *args, **kwargs)

    return type("OptimizedModule", (OptimizedModule,), {"__call__": call, "__module__": __name__})


def _recompile_limit() -> int:
    """Dynamo's recompile limit, as the script left it."""
    import torch._dynamo.config as config

    return int(getattr(config, "recompile_limit", RECOMPILE_LIMIT))


def _reason(e: BaseException) -> str:
    """An error's first line, short enough for a note."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return line if isinstance(e, _Uncapturable) else f"{type(e).__name__}: {line}"
