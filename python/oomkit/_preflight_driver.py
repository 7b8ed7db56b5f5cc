"""The driver of ``oomkit.preflight()``: the model built on ``meta``, the steps run in the fake GPU.

A run builds the model (copied to ``meta`` without its weights, or built
there by the user's function), spreads it over GPUs where asked, makes
the optimizer, and runs the steps (forward and loss under the script's
autocast, backward, the optimizer's step, with accumulation) inside the
fake GPU (``_preflight_world``), telling the role bookkeeping
(``_preflight_roles.Known``) what each object holds; the answer is
``_preflight_answer``'s.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import torch

from oomkit._native import PreflightError
from oomkit._preflight_answer import Preflight, Settings, answer, unsupported
from oomkit._preflight_cuda import Autocast, CudaFunctions, cublas_workspace
from oomkit._preflight_dist import shard, zero_redundancy
from oomkit._preflight_memory import MemoryQueries
from oomkit._preflight_record import DEFAULT_TIME_LIMIT, FAKE_DEVICE, PreflightStopped, Recorder, StepUnsupportedError
from oomkit._preflight_roles import Known
from oomkit._preflight_world import FakeGpu, Hook

#: Steps run by default: the first creates the optimizer's state, the
#: second runs with it in place, as every later step does.
DEFAULT_STEPS = 2


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
        memory = MemoryQueries(rec, lambda: self.alloc_conf, self.capacity_bytes, self.notes)
        world = FakeGpu(
            capacity=self.capacity,
            capacity_bytes=self.capacity_bytes,
            recorder=rec,
            memory=memory,
            autocast=state,
            functions=functions,
            notes=self.notes,
            world_size=self.gpus,
            start_process_group=self.gpus > 1,
            hooks=_phase_hooks(rec),
        )
        with world:
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
