"""The driver of ``oomkit.preflight()``: the model built on ``meta``, the steps run in the fake GPU, recorded.

A run builds the model (copied to ``meta`` without its weights, or built
there by the user's function), spreads it over GPUs where asked, makes
the optimizer, and runs the steps (forward and loss under the given
autocast, backward, the optimizer's step, with accumulation) inside the
fake GPU (``world.fake_gpu``), telling the role bookkeeping
(``record.roles.Known``) what each object holds. It reads the settings
whole (``settings.Settings``) and returns what it recorded
(``record.recording.Recording``); the answer is made above it
(``answer``), so nothing here knows how the answer is told.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch

from oomkit._native import PreflightError
from oomkit.preflight.frameworks.bitsandbytes import adamw8bit
from oomkit.preflight.notes import Notes
from oomkit.preflight.record.placement import on_meta
from oomkit.preflight.record.recorder import Recorder
from oomkit.preflight.record.recording import Recording
from oomkit.preflight.record.roles import Known
from oomkit.preflight.settings import Settings
from oomkit.preflight.world.autocast import Autocast
from oomkit.preflight.world.cuda import CudaFunctions, cublas_workspace
from oomkit.preflight.world.dist import shard, zero_redundancy
from oomkit.preflight.world.fake_gpu import FakeGpu, Hook
from oomkit.preflight.world.memory import MemoryQueries

#: Optimizers by name, built with PyTorch's defaults (bitsandbytes' for ``adamw8bit``).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adafactor": torch.optim.Adafactor,
    "adamw8bit": adamw8bit,
}


def record(settings: Settings) -> Recording:
    """Runs ``settings.steps`` training steps at ``settings.micro_batch`` in the fake GPU and
    returns what was recorded; a step that needs data raises ``StepUnsupportedError``, and
    one past the time limit ``PreflightStopped``, for the caller to say in one line."""
    rec = Recorder(cublas_workspace(settings.capacity), settings.time_limit)
    known = Known()
    notes = Notes()
    try:
        _run(settings, rec, known, notes)
    finally:
        rec.finish()
    return Recording(
        recorder=rec,
        known=known,
        notes=notes.said(),
        steps=settings.steps,
        capacity_bytes=settings.capacity_bytes,
        alloc_conf=settings.alloc_conf,
    )


def _run(s: Settings, rec: Recorder, known: Known, notes: Notes) -> None:
    """The steps, in the fake GPU: the model built and spread, the optimizer made, then
    each step's micro-batches (forward and loss, backward) and the optimizer's step."""
    state = Autocast()
    functions = CudaFunctions(state, read_back=rec.read_back, host=rec.host, placement=rec.placement)
    functions.frames_fixed = rec.frames_fixed
    memory = MemoryQueries(rec, lambda: s.alloc_conf, s.capacity_bytes, notes)
    world = FakeGpu(
        settings=s,
        recorder=rec,
        memory=memory,
        autocast=state,
        functions=functions,
        notes=notes,
        start_process_group=s.gpus > 1,
        hooks=_phase_hooks(rec),
    )
    with world:
        rec.phase = "setup"
        model = _build_model(s)
        if s.gpus > 1:
            # Sharded before the step begins: the full weights never reach one GPU.
            model, spread = shard(model, s.gpus, s.sharding)
            notes.extend(spread)
        # The model arrives on the GPU as built; its construction happened elsewhere.
        rec.begin()
        known.add_model(rec, model)
        known.watch_grads(rec, model.parameters())
        opt = _build_optimizer(s, model)
        for _ in range(s.steps):
            for _ in range(s.grad_accum):
                rec.phase = "inputs"
                data = _make_batch(s)
                known.add_inputs(rec, data)
                rec.phase = "forward"
                if s.step is not None:
                    s.step(model, data, opt)
                    known.add_grads(rec, model)
                    del data
                    break
                with ExitStack() as region:
                    if s.autocast is not None:
                        region.enter_context(torch.autocast("cuda", dtype=s.autocast))
                    value = (s.loss or _default_loss)(model, data)
                if s.grad_accum > 1:
                    value = value / s.grad_accum
                value.backward()
                known.add_grads(rec, model)
                del value, data
            if s.step is None and opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=s.set_to_none)
            if opt is not None:
                known.add_state(rec, opt, model)
            if opt is not None or s.step is not None:
                rec.step_ended()
            rec.phase = "forward"


def _build_model(s: Settings) -> torch.nn.Module:
    if isinstance(s.model, torch.nn.Module):
        built = _meta_copy(s.model)
    else:
        # Built on the GPU, which the fake GPU makes meta: never allocated, and told it is on cuda:0.
        with torch.device("cuda"):
            built = s.model()
        if not isinstance(built, torch.nn.Module):
            raise PreflightError(f"model() returned {type(built).__name__}, not a torch.nn.Module")
        if not all(on_meta(p) for p in built.parameters()):
            built = built.to("cuda")
    if s.dtype is not None:
        built = built.to(s.dtype)
    return built


def _build_optimizer(s: Settings, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    if s.optimizer is None:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(s.optimizer, str):
        make = OPTIMIZERS.get(s.optimizer.lower())
        if make is None:
            raise PreflightError(f"optimizer {s.optimizer!r}: give one of {', '.join(OPTIMIZERS)} or a function of the parameters")
        opt = make(params)
    else:
        opt = s.optimizer(params)
    if s.gpus > 1 and s.sharding == "zero1":
        opt = zero_redundancy(opt)
    return opt


def _make_batch(s: Settings) -> Any:
    data = s.batch(s.micro_batch) if callable(s.batch) else s.batch
    # A batch on the CPU is what the loop would copy to the GPU first.
    return torch.utils._pytree.tree_map(
        lambda t: t.to("cuda") if isinstance(t, torch.Tensor) and not on_meta(t) else t, data
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
    """A copy of ``module`` whose parameters and buffers are on the fake GPU, never copying their data."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cuda"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="cuda")
    return copy.deepcopy(module, memo)


def _phase_hooks(rec: Recorder) -> list[Hook]:
    """The optimizer's step hooks that mark its phase, for the fake GPU's ledger."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(*_: Any) -> None:
        rec.phase = "optimizer"

    def post(*_: Any) -> None:
        rec.phase = "forward"

    return [
        Hook("the optimizer's step marks its phase", register_optimizer_step_pre_hook, pre),
        Hook("the step after the optimizer's is forward's again", register_optimizer_step_post_hook, post),
    ]
