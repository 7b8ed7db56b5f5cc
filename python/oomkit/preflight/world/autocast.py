"""CUDA autocast under preflight: its regions kept here, what it does to each call asked of PyTorch itself.

PyTorch applies ``torch.autocast("cuda")`` only to tensors of a device that
has it (its ``AutocastCUDA`` dispatch key), which ``meta`` tensors do not.
So preflight keeps the regions itself (:class:`Autocast`, entered by the
stand-ins for ``torch.autocast``, :func:`autocast_stand_ins`), and for a
call made inside one asks PyTorch's own CUDA autocast what it would do
(:class:`CastPolicies`): the same call is run once on fake CUDA tensors of
the same shapes and dtypes (``FakeTensorMode``: no GPU, no memory) with
CUDA autocast on and off, and the casts of the call's tensors seen only
with it on are autocast's. Those casts are then made on the ``meta`` tensors above autograd, as
CUDA's autocast makes them above autograd, so that autograd records and
saves what it would on a GPU (a linear layer keeps the 16-bit copies of
its input and weight; a batch norm, which autocast leaves alone, keeps
what it was given). A new PyTorch brings its own lists: nothing here names
an operator. What autocast refuses (``binary_cross_entropy``) raises
PyTorch's own error, as on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.amp.autocast_mode as _autocast_mode
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from oomkit.preflight.record.recorder import FAKE_DEVICE

#: The device types whose autocast is emulated ("meta": what activation
#: checkpointing re-enters autocast for, the device its tensors are on).
EMULATED = ("cuda", FAKE_DEVICE)

#: Calls that compute nothing autocast could cast (autograd's entry, hooks,
#: reading values back): never asked, so that asking runs nothing twice.
NOT_ASKED = frozenset(
    {"backward", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "requires_grad_",
     "item", "tolist", "numpy", "__format__", "__repr__", "__str__", "__bool__", "__int__", "__float__",
     "__index__", "__len__", "__iter__", "__array__", "data_ptr", "untyped_storage", "storage"}
)  # fmt: skip


@dataclass(frozen=True)
class Policy:
    """What CUDA autocast does to one kind of call (one function, with arguments of these dtypes)."""

    #: The dtype each tensor among the call's arguments is cast to, in their flattened
    #: order (``None``: left as it is).
    casts: tuple[torch.dtype | None, ...] = ()
    #: The output dtype the call is asked for (``dtype=``), where autocast asks for one
    #: (``sum``, ``softmax``: computed in float32 from a 16-bit input without a copy of it).
    dtype_kwarg: torch.dtype | None = None
    #: The dtype of each tensor the call returns, where neither the casts nor ``dtype=``
    #: give it: else ``None`` (the result is cast, a copy the GPU does not make).
    outputs: tuple[torch.dtype | None, ...] | None = None


#: A call autocast leaves as it is.
UNTOUCHED = Policy()


class Autocast:
    """The autocast regions entered with ``device_type="cuda"``, emulated, and what each call in one casts."""

    def __init__(self) -> None:
        self.stack: list[tuple[bool, torch.dtype]] = []
        #: Casts of weights, held until the outermost region exits (CUDA's cast cache).
        self.cache: dict[int, torch.Tensor] = {}
        #: What CUDA autocast does to each kind of call, asked of PyTorch.
        self.policies = CastPolicies()
        #: Told of each weight's cast as it enters the cache (the recorder's ``weight_cast``).
        self.on_cached: Optional[Callable[[torch.Tensor], None]] = None
        #: How many compiled graphs are running now, whose casts are operations of their own.
        self.graphs_running = 0

    def dtype(self) -> torch.dtype | None:
        """The lower precision in force, or None outside autocast."""
        if self.stack and self.stack[-1][0]:
            return self.stack[-1][1]
        return None

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """The block runs a compiled graph, traced with the casts autocast made: no call in it is cast again."""
        self.graphs_running += 1
        try:
            yield
        finally:
            self.graphs_running -= 1

    def casts_now(self) -> bool:
        """Whether a call made now is cast: inside a region, and not an operation of a compiled graph."""
        return not self.graphs_running and self.dtype() is not None

    def enter(self, enabled: bool, dtype: torch.dtype) -> None:
        """Enters a region."""
        self.stack.append((enabled, dtype))

    def exit(self) -> None:
        """Leaves a region; the cast cache goes with the outermost."""
        if self.stack:
            self.stack.pop()
        if not self.stack:
            self.cache.clear()

    def policy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Policy:
        """What CUDA autocast, as in force now, does to ``func(*args, **kwargs)``."""
        dtype = self.dtype()
        return UNTOUCHED if dtype is None else self.policies.policy(func, args, kwargs, dtype)

    def apply(self, policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments cast as ``policy`` says, with the output dtype asked for where it says so."""
        if policy.dtype_kwarg is not None:
            kwargs = {**kwargs, "dtype": policy.dtype_kwarg}
        if not any(policy.casts):
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        if len(leaves) != len(policy.casts):
            return args, kwargs
        cast = [x if to is None else self.cast(x, to) for x, to in zip(leaves, policy.casts)]
        args, kwargs = tree_unflatten(cast, spec)
        return args, kwargs

    def outputs(self, policy: Policy, out: Any) -> Any:
        """The call's result, its tensors in the dtypes autocast gives them where neither the casts nor ``dtype=`` did."""
        if policy.outputs is None:
            return out
        leaves, spec = tree_flatten(out)
        if len(leaves) != len(policy.outputs):
            return out
        done = [_as(x, to) for x, to in zip(leaves, policy.outputs)]
        return tree_unflatten(done, spec)

    def cast(self, t: Any, dtype: torch.dtype) -> Any:
        """``cached_cast``: a floating tensor of the device to ``dtype``; a float32 weight's cast
        to the lower precision (a leaf that requires grad) is kept until the outermost region exits."""
        if not (isinstance(t, torch.Tensor) and t.device.type == FAKE_DEVICE and t.is_floating_point() and t.dtype != dtype):
            return t
        # As autocast_mode.cpp's cached_cast: only float32 leaves that require grad, cast to the lower precision.
        if dtype == self.dtype() and t.dtype == torch.float32 and t.is_leaf and t.requires_grad:
            hit = self.cache.get(id(t))
            if hit is None:
                hit = t.to(dtype)
                self.cache[id(t)] = hit
                if self.on_cached is not None:
                    self.on_cached(hit)
            return hit
        return t.to(dtype)


class CastPolicies:
    """What CUDA autocast does to each kind of call, asked of PyTorch once per kind and kept."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], Policy] = {}
        #: Calls asked about, for the tests and the benchmarks.
        self.asked = 0

    def policy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> Policy:
        """What CUDA autocast at ``dtype`` does to ``func(*args, **kwargs)``; raises what it raises
        for a call it refuses."""
        leaves = tree_leaves((args, kwargs))
        if getattr(func, "__name__", "") in NOT_ASKED or not any(_castable(t) for t in leaves):
            return UNTOUCHED
        key = (func, len(args), tuple(kwargs), dtype, *(_kind(x) for x in leaves))
        found = self._known.get(key)
        if found is None:
            found = self._known[key] = self._ask(func, args, kwargs, dtype)
        return found

    def _ask(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> Policy:
        """Runs the call on fake CUDA tensors with CUDA autocast on and off, and sees what autocast casts.

        A cast seen both ways is the operator's own (the math attention computes
        16-bit inputs in float32 itself) and stays the operator's; one seen only
        with autocast on is autocast's. Where those casts alone do not give the
        output's dtype (``sum``, ``softmax``: a 16-bit input computed in float32
        without a copy of it), the call is asked for it with ``dtype=``, or,
        where it takes none, its result is cast.
        """
        self.asked += 1
        leaves, spec = tree_flatten((args, kwargs))
        # The calls run inside the fake mode, so that what a composite makes inside is fake too.
        with _asking() as fake, fake:
            if not all(_mirrorable(x) for x in leaves):
                return UNTOUCHED
            try:
                on, cast_on = _seen(func, spec, leaves, fake, dtype)
            except Exception as refused:
                try:
                    _seen(func, spec, leaves, fake, None)
                except Exception:  # noqa: BLE001 - neither runs on fake tensors: nothing can be told
                    return UNTOUCHED
                # It runs without autocast and not with it: autocast refuses it, as on a GPU.
                raise refused from None
            try:
                off, cast_off = _seen(func, spec, leaves, fake, None)
            except Exception:  # noqa: BLE001 - runs only with autocast (mixed dtypes)
                # Run without autocast on the inputs autocast lowered, so that the casts the
                # kernel makes itself (math attention computing 16-bit inputs in float32) are
                # told from autocast's; where it still refuses (a promote op), every cast is autocast's.
                lowered = {i: d for i, d in cast_on.items() if d == dtype}
                try:
                    off, cast_off = _seen(func, spec, leaves, fake, None, given=lowered)
                except Exception:  # noqa: BLE001
                    off, cast_off = None, {}
            casts = tuple(cast_on.get(i) if cast_on.get(i) != cast_off.get(i) else None for i in range(len(leaves)))
            if not any(casts) and on == off:
                return UNTOUCHED
            made = [m.to(d) if d is not None else m for m, d in zip((_mirror(x, fake) for x in leaves), casts)]
            if _tensor_dtypes(_call(func, spec, made)) == on:
                return Policy(casts)
            asked = next((d for d in on if d is not None), None)
            # F.softmax hands its dtype=None on: not given is None as well as absent.
            if asked is not None and kwargs.get("dtype") is None:
                try:
                    if _tensor_dtypes(_call(func, spec, made, dtype=asked)) == on:
                        return Policy(casts, dtype_kwarg=asked)
                except Exception:  # noqa: BLE001 - the function takes no dtype=: its result is cast instead
                    pass
        return Policy(casts, outputs=on)


#: What a call run on fake tensors gives: its outputs' dtypes, and the dtype each of its tensors was first cast to.
Seen = tuple[tuple[Optional[torch.dtype], ...], dict[int, torch.dtype]]


def _seen(
    func: Any, spec: Any, leaves: list[Any], fake: Any, dtype: torch.dtype | None, given: dict[int, torch.dtype] | None = None
) -> Seen:
    """The call run on fresh fake mirrors of ``leaves``, with CUDA autocast at ``dtype`` (None: off):
    its outputs' dtypes, and the first cast of each of its tensors (by their place among the leaves);
    ``given`` makes some of them other dtypes (by place)."""
    mirrors = [_mirror(x, fake, (given or {}).get(i)) for i, x in enumerate(leaves)]
    seen = _Casts({id(m): i for i, m in enumerate(mirrors) if isinstance(m, torch.Tensor)})
    with _cuda_autocast(dtype) if dtype is not None else contextlib.nullcontext(), seen:
        out = _tensor_dtypes(_call(func, spec, mirrors))
    return out, seen.found


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Sees, below autocast, the first cast of each of the call's own tensors (whose are autocast's, ``_ask`` tells)."""

    def __init__(self, index: dict[int, int]) -> None:
        super().__init__()
        self.index = index
        self.found: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _CASTS and args and id(args[0]) in self.index:
            to = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            if to is not None and to != args[0].dtype:
                self.found.setdefault(self.index[id(args[0])], to)
        return func(*args, **kwargs)


#: The operators autocast casts with: ``to`` is seen whole under ``torch.inference_mode()``
#: (a predictor's, as YOLO's AMP check runs), ``_to_copy``, what it becomes, elsewhere.
_CASTS = (torch.ops.aten._to_copy, torch.ops.aten.to)


#: The dispatch keys autocast is switched on and off with (excluded: off).
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA) | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

#: The dispatch keys a thread includes when nothing traces it (read when this module is imported).
_PLAIN_INCLUDE = torch._C._dispatch_tls_local_include_set()

def _as(x: Any, dtype: torch.dtype | None) -> Any:
    """``x`` in ``dtype``, where it is a tensor of another."""
    return x.to(dtype) if isinstance(x, torch.Tensor) and dtype is not None and x.dtype != dtype else x


def _castable(x: Any) -> bool:
    """A floating tensor on the fake GPU: what CUDA autocast may cast."""
    return isinstance(x, torch.Tensor) and x.device.type == FAKE_DEVICE and x.is_floating_point()


def _kind(x: Any) -> Any:
    """What of an argument decides autocast's policy: a tensor's device and dtype, a
    flag's or dtype's value, another value's type (not sizes: the policy is per operator)."""
    if isinstance(x, torch.Tensor):
        return (x.device.type, x.dtype)
    if x is None or isinstance(x, (bool, str, torch.dtype)):
        return x
    return type(x)


def _numbers(sizes: Any) -> list[int] | None:
    """Sizes as numbers: themselves, or a symbolic size's hint (a compile capture's); None where one has none."""
    found = []
    for n in sizes:
        hint = n if isinstance(n, int) else getattr(getattr(n, "node", None), "hint", None)
        if not isinstance(hint, int):
            return None
        found.append(hint)
    return found


def _mirrorable(x: Any) -> bool:
    """Whether a fake tensor can stand for ``x``: any value but a tensor whose sizes have no numbers."""
    return not isinstance(x, torch.Tensor) or (_numbers(x.shape) is not None and _numbers(x.stride()) is not None)


def _mirror(x: Any, fake: Any, dtype: torch.dtype | None = None) -> Any:
    """A fake tensor for a tensor of the call (a ``meta`` one on the fake CUDA device), in ``dtype``
    where given, or the value itself; ``x`` is ``_mirrorable``."""
    if not isinstance(x, torch.Tensor):
        return x
    device = "cuda" if x.device.type == FAKE_DEVICE else x.device
    with fake:
        return torch.empty_strided(_numbers(x.shape) or [], _numbers(x.stride()) or [], dtype=dtype or x.dtype, device=device)


def _call(func: Any, spec: Any, leaves: list[Any], **extra: Any) -> Any:
    """``func`` called with the arguments ``leaves`` and ``spec`` make, and ``extra``, without autograd."""
    args, kwargs = tree_unflatten(leaves, spec)
    with torch.no_grad():
        return func(*args, **{**kwargs, **extra})


def _tensor_dtypes(out: Any) -> tuple[torch.dtype | None, ...]:
    return tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in tree_leaves(out))


@contextlib.contextmanager
def _asking() -> Iterator[Any]:
    """Where a call is asked about: the step's own modes (the recorder, a compile capture's
    tracer) and functions' overrides held back, a fake tensor mode of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    # A call made while a compile capture traces (inside its modes' own dispatch) has the
    # Python dispatch keys excluded, which would send the fake mode's tensors to real CUDA,
    # and PyTorch's Python dispatcher on: the question is asked as from outside them both,
    # only autocast's switches kept as they are.
    keep = torch._C._dispatch_tls_local_exclude_set() & _AUTOCAST_KEYS
    clean = torch._C._ForceDispatchKeyGuard(_PLAIN_INCLUDE, keep)
    # The question is preflight's own: what PyTorch warns while answering it (why a fake CUDA
    # tensor cannot take flash attention, where the script allows no other) is not the script's.
    # Nor is what the fake mode logs of a call that refuses without autocast (torchvision's
    # roi_align, given a 16-bit input and float32 boxes, which CUDA autocast casts alike).
    quiet = warnings.catch_warnings()
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch._C._DisablePythonDispatcher(), clean, quiet, _silent(FAKE_LOG):
        warnings.simplefilter("ignore")
        yield FakeTensorMode(allow_non_fake_inputs=True)


#: The logger of PyTorch's fake tensor mode, which logs each call its kernels refuse.
FAKE_LOG = "torch._subclasses.fake_tensor"


@contextlib.contextmanager
def _silent(name: str) -> Iterator[None]:
    """The logger ``name`` says nothing meanwhile."""
    logger = logging.getLogger(name)
    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """PyTorch's CUDA autocast on at ``dtype`` (its C++ switches: ``torch.autocast`` refuses
    without a GPU), its cast cache off, and everything as it was after."""
    c = torch._C
    was = (c.is_autocast_enabled("cuda"), c.get_autocast_dtype("cuda"), c.is_autocast_cache_enabled())
    c.set_autocast_enabled("cuda", True)
    c.set_autocast_dtype("cuda", dtype)
    c.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        c.set_autocast_enabled("cuda", was[0])
        c.set_autocast_dtype("cuda", was[1])
        c.set_autocast_cache_enabled(was[2])


def autocast_stand_ins(autocast: Autocast, functions: TorchFunctionMode | None = None) -> list[tuple[Any, str, Any]]:
    """What makes ``torch.autocast("cuda", ...)`` enter the emulated regions:
    (owner, name, value) for the fake GPU's ledger.

    ``functions`` is pushed again for a region entered where function modes
    are not active (activation checkpointing's recompute inside backward:
    autograd's engine carries dispatch modes into backward, not function
    modes), so that the recompute casts as the forward did.
    """
    cls = _autocast_mode.autocast
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__

    def new_init(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        # "meta": activation checkpointing re-enters autocast for the device its tensors are on.
        if device_type in EMULATED:
            self.device = "cuda"
            self.fast_dtype = dtype or torch.float16
            self._enabled = enabled
            self._cache_enabled = cache_enabled
            self._oomkit_emulated = True
            return
        init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def new_enter(self: Any) -> Any:
        if getattr(self, "_oomkit_emulated", False):
            autocast.enter(self._enabled, self.fast_dtype)
            self._oomkit_pushed = False
            if functions is not None and functions not in _get_current_function_mode_stack():
                functions.__enter__()
                self._oomkit_pushed = True
            return self
        return enter(self)

    def new_exit(self: Any, *exc: Any) -> Any:
        if getattr(self, "_oomkit_emulated", False):
            if functions is not None and getattr(self, "_oomkit_pushed", False):
                functions.__exit__(None, None, None)
            autocast.exit()
            return False
        return exit_(self, *exc)

    # torch.utils.checkpoint records the autocast state of the device its
    # tensors are on when forward runs and restores it for the recompute in
    # backward; for "meta" (and "cuda") that state is the emulated one.
    available, is_enabled, get_dtype = torch.amp.is_autocast_available, torch.is_autocast_enabled, torch.get_autocast_dtype

    def new_available(device_type: str) -> bool:
        return device_type in EMULATED or available(device_type)

    def new_is_enabled(*args: Any) -> bool:
        if args and args[0] in EMULATED:
            return autocast.dtype() is not None
        return bool(is_enabled(*args))

    def new_get_dtype(device_type: str) -> torch.dtype:
        if device_type in EMULATED:
            return autocast.dtype() or torch.float16
        return get_dtype(device_type)

    return [
        (cls, "__init__", new_init),
        (cls, "__enter__", new_enter),
        (cls, "__exit__", new_exit),
        (torch.amp, "is_autocast_available", new_available),
        (torch, "is_autocast_enabled", new_is_enabled),
        (torch, "get_autocast_dtype", new_get_dtype),
    ]
