"""The world a preflight runs in: the fake GPU, every stand-in in one ledger.

A step written for a GPU runs on ``meta`` tensors only if much of PyTorch
answers as it would on a GPU: ``torch.cuda`` (one GPU of the capacity,
whose memory is the recorder's), ``torch.accelerator``, the device
mapping and CUDA's autocast and attention (a function mode), the
recorder (a dispatch mode), PyTorch's choice of foreach kernels and of
fused optimizers, the data loader's workers (run in the process),
``torch.compile`` (its graphs captured and partitioned as its backend would), several GPUs (PyTorch's fake process
group, FSDP and DDP let run on it), and the hooks that mark the step's
phases. Each is an entry of :meth:`FakeGpu.ledger`: an attribute set on
an owner (:class:`StandIn`) or a global hook registered (:class:`Hook`),
installed one way (:func:`replaced`, a hook's handle) and undone on exit,
so that after ``oomkit.preflight()`` returns, torch is as it was.
``oomkit.preflight()`` enters the world around its steps; the script hook
(``oomkit preflight -- python train.py``) enters it for the life of the
process. Adding a stand-in is one entry in :meth:`FakeGpu.ledger`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Union

import torch

from oomkit.preflight.frameworks.bitsandbytes import FUNCTIONAL, outlier_stand_ins, paged_stand_ins
from oomkit.preflight.frameworks.diffusers import DIFFUSERS_MODELING, DiffusersWeightsFromConfig
from oomkit.preflight.frameworks.huggingface import LITGPT_DATA, LITGPT_MODEL, TOKENIZER_BASE, TORCHTUNE_DATA, TRAINER, SequenceBounds
from oomkit.preflight.frameworks.lightning import BATCH_SIZE_FINDERS, BatchSizeSearch
from oomkit.preflight.frameworks.litgpt import UTILS as LITGPT_UTILS
from oomkit.preflight.frameworks.litgpt import CheckpointWithoutWeights
from oomkit.preflight.frameworks.pretrained import MODELING, PEFT_MODEL, AdapterWithoutWeights, WeightsFromConfig
from oomkit.preflight.frameworks.torchtune import CHECKPOINT_UTILS, CHECKPOINTER, CONFIG, CheckpointFromConfig, RecipeSeen
from oomkit.preflight.notes import Notes
from oomkit.preflight.record.recorder import FAKE_DEVICE, Recorder
from oomkit.preflight.settings import Settings
from oomkit.preflight.world.absent import HUB, SAFETENSORS, URL_LOADERS, AbsentCheckpoints
from oomkit.preflight.world.autocast import Autocast, autocast_stand_ins
from oomkit.preflight.world.checkpoints import load_stand_in
from oomkit.preflight.world.compile import Compiler, checkpoint_stand_in
from oomkit.preflight.world.cuda import (
    CudaFunctions,
    CudaGenerator,
    accelerator_answers,
    device_answers,
    foreach_stand_ins,
    moved_in_place_stand_in,
    no_graph_capture,
    record_stream_stand_in,
    refused_kernels,
    refusing_stand_ins,
    saved_tensor_hooks_in_mode,
    storage_address_stand_in,
    wrapper_subclass_stand_in,
)
from oomkit.preflight.world.dist import (
    PIPELINE_SCHEDULES,
    PipelineOnOneRank,
    Ranks,
    fake_process_group,
    modules_holding,
    parallel_stand_ins,
    rank_zero_environment,
    rank_zero_note,
)
from oomkit.preflight.world.flex import device_check_stand_in, flex_rules
from oomkit.preflight.world.graphs import CudaGraphs
from oomkit.preflight.world.imports import replaced, when_imported
from oomkit.preflight.world.kernels import native_meta_kernels
from oomkit.preflight.world.memory import MemoryQueries, rng_answers
from oomkit.preflight.world.profiler import PROFILER, HostOnlyProfiler
from oomkit.preflight.world.saves import SavedAside
from oomkit.preflight.world.triton import launch_stand_ins

#: PyTorch's module wrapping a module in activation checkpointing (``checkpoint_wrapper``).
CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

#: The note data loader workers run in the process leave.
WORKERS_IN_PROCESS = "data loader workers were run in the main process"

#: Optimizers whose module checks a fused optimizer's devices under its own name.
FUSED_CHECKS = ("optimizer", "adam", "adamw", "sgd", "adagrad")


@dataclass(frozen=True)
class StandIn:
    """An attribute the fake GPU sets on an owner (a module, a class) while it is entered."""

    #: What it stands in for, in words.
    what: str
    owner: Any
    name: str
    value: Any


@dataclass(frozen=True)
class Hook:
    """A global hook the fake GPU registers while it is entered (``register(fn)`` returns its handle)."""

    #: What it is for, in words.
    what: str
    register: Callable[[Any], Any]
    fn: Callable[..., Any]


#: An entry of the ledger.
Entry = Union[StandIn, Hook]


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the block, and puts the old ones back after."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class FakeGpu:
    """The world a preflight runs in: one GPU of the settings' capacity, or rank 0 of their ``gpus``.

    ``hooks`` are the driver's own global hooks (the optimizer's step hooks
    that mark phases), registered and removed with the rest, and
    ``stand_ins`` its own replacements (a fix tried: the optimizer made 8-bit);
    ``on_optimizer_made`` is told whenever a ``torch.optim`` optimizer is
    made, and ``on_module_moved`` of each module's own parameters and buffers
    once it is moved (``.to``, ``.cuda``). ``start_process_group`` makes the fake process group at once
    (``oomkit.preflight(gpus=N)``) rather than when the script asks for one;
    ``torchrun_environment`` gives the process rank 0's environment under
    torchrun (``RANK``, ``WORLD_SIZE``) when there are several GPUs.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        recorder: Recorder,
        memory: MemoryQueries,
        autocast: Autocast,
        functions: CudaFunctions,
        notes: Notes,
        start_process_group: bool = False,
        torchrun_environment: bool = True,
        hooks: list[Hook] | None = None,
        stand_ins: list[StandIn] | None = None,
        on_optimizer_made: Callable[[torch.optim.Optimizer], None] | None = None,
        on_module_moved: Callable[[list[torch.Tensor]], None] | None = None,
        save_dir: str | None = None,
    ) -> None:
        self.settings = settings
        self.recorder, self.memory = recorder, memory
        self.autocast, self.functions = autocast, functions
        # What the GPU cannot run stops the script, as it would there: no figure for a step that cannot run.
        recorder.refused = refused_kernels(settings.capacity)
        # Autocast's cached weight casts are told to the recorder: copies of weights, not a cache.
        autocast.on_cached = recorder.weight_cast
        self.notes = notes
        self.start_process_group = start_process_group
        self.torchrun_environment = torchrun_environment
        #: Whether the script asked how many GPUs the machine has (a failure then may be its asking for more).
        self.devices_counted = False
        self.extra_hooks = hooks or []
        self.extra_stand_ins = stand_ins or []
        self.on_optimizer_made = on_optimizer_made
        self.on_module_moved = on_module_moved
        self._stack: ExitStack | None = None
        #: The longest sequence the script says it keeps (a tokenizer's, a trainer's or a recipe's).
        self.bounds = SequenceBounds()
        #: The framework recipe the script ran (torchtune's), once its config is read.
        self.recipe = RecipeSeen(on_bound=self.bounds.said_by_recipe)
        #: The script's own batch-size search (Lightning's BatchSizeFinder), while it runs.
        self.batch_search = BatchSizeSearch()
        #: PyTorch's own ``init_process_group``, before the ledger replaces it.
        self._init_process_group: Any = None
        #: Whether the script ran as one GPU of ``--gpus``, or on one GPU alone.
        self.ranks = Ranks()
        #: The folder the script's saves are kept in (this run's own), or None for a temporary one.
        self.save_dir = save_dir
        #: Where the checkpoints the script saves went, once the ledger is made.
        self.saves: SavedAside | None = None
        #: The stand-ins for checkpoints and downloads that are not there, once the ledger is made.
        self.absent: AbsentCheckpoints | None = None

    def _count_devices(self) -> int:
        """The machine's GPUs (``--gpus``), as ``torch.cuda.device_count()`` tells the script, noting it asked."""
        self.devices_counted = True
        return self.settings.gpus

    # ----- the ledger ---------------------------------------------------------

    def ledger(self) -> list[Entry]:
        """Every stand-in of the fake GPU, in the order installed."""
        rec, memory = self.recorder, self.memory
        entries: list[Entry] = []

        def attrs(what: str, owner: Any, values: dict[str, Any]) -> None:
            entries.extend(StandIn(what, owner, name, value) for name, value in values.items() if owner is not None)

        # Every operation runs a meta kernel: the C++ ones are about a hundred times faster than the Python ones.
        entries.append(Hook("PyTorch's C++ meta kernels current in place of its Python ones", _called, native_meta_kernels))
        s = self.settings
        gpus = device_answers(s.capacity, s.capacity_bytes, rec, memory, self._count_devices)
        attrs("torch.cuda answers as a machine of --gpus GPUs of the capacity, the script on the first", torch.cuda, gpus)
        attrs("a CUDA random generator is a host one, which tensors without data draw from", torch, {"Generator": CudaGenerator})
        # cuDNN would copy a recurrent layer's weights into one buffer of the same size, views of it
        # taking their place; its kernel needs a GPU, so the weights stay as they are.
        unflattened = {"_use_cudnn_rnn_flatten_weight": lambda: False}
        attrs("a recurrent layer's weights are not gathered into cuDNN's one buffer", torch, unflattened)
        # A Trainer saving a checkpoint asks torch.cuda.random itself for the state.
        cuda_random = sys.modules.get("torch.cuda.random")
        states = {k: v for k, v in rng_answers().items() if hasattr(cuda_random, k)}
        attrs("CUDA's random state answered without a GPU", cuda_random, states)
        absent = self.absent = AbsentCheckpoints(self.notes, self.functions.on_upload)
        saves = self.saves = SavedAside(self.notes, self.save_dir)
        fake_load = saves.torch_load(absent.torch_load(load_stand_in(rec.placement, rec.values)))
        for home in (torch, torch.serialization):
            attrs("a checkpoint bound for the GPU loads onto the fake GPU, its data unread", home, {"load": fake_load})
        kept_aside = "checkpoints the script saves are kept in preflight's own folder, never written where it says"
        save_aside = saves.torch_save(torch.serialization.save)
        for home in (torch, torch.serialization):
            attrs(kept_aside, home, {"save": save_aside})
        not_there = "a checkpoint that is not there loads as a stand-in; what it is loaded into keeps its tensors"
        for owner, name, value in absent.torch_stand_ins():
            entries.append(StandIn(not_there, owner, name, value))
        for module in SAFETENSORS:
            entries.append(Hook(not_there, when_imported(module), absent.safetensors_stand_ins))
            entries.append(Hook(kept_aside, when_imported(module), saves.safetensors_stand_ins))
        for module in HUB:
            entries.append(Hook("a weight file the script asks of the hub is not downloaded", when_imported(module), absent.hub_stand_ins))
        for module in ("torch.hub", *URL_LOADERS):
            entries.append(Hook("weights by URL not in torch's hub cache are not downloaded", when_imported(module), absent.url_stand_ins))
        attrs(
            "torch.cuda.memory's queries answered from the allocator model",
            torch.cuda.memory,
            {**memory.cuda_answers(), **memory.history_answers()},
        )
        accelerator = accelerator_answers(rec, memory, self._count_devices)
        device_api = getattr(torch, "accelerator", None)
        for owner in (device_api, getattr(device_api, "memory", None)):
            attrs("torch.accelerator answers as CUDA", owner, {k: v for k, v in accelerator.items() if hasattr(owner, k)})
        attrs("what torch.cuda's functions and oomkit's tracker read memory from", torch._C, {"_cuda_memoryStats": memory.nested_stats})
        # FSDP's default mesh (fully_shard without one) and DeviceMesh ask the C++ side for the accelerator.
        attrs("the accelerator distributed code asks for is CUDA", torch._C, {"_get_accelerator": lambda *_, **__: torch.device("cuda")})
        attrs("optimizers' checks for a CUDA graph being captured (none is)", torch.optim.Optimizer, no_graph_capture())
        # Fake CUDA tensors (DTensor's sharding propagation, autocast's questions) would start the
        # CUDA that torch.cuda.is_available() says is there: there is none to start.
        attrs("fake CUDA tensors start no CUDA", _fake_tensor_mode(), {"avoid_device_init": property(lambda self: True)})
        for owner, name, value in record_stream_stand_in():
            entries.append(StandIn("a buffer recorded on a side stream: one stream, nothing to keep", owner, name, value))
        for owner, name, value in storage_address_stand_in(rec.placement):
            entries.append(StandIn("storages without data have addresses of their own, as on the GPU", owner, name, value))
        for owner, name, value in refusing_stand_ins(rec.refused):
            entries.append(StandIn("what the GPU cannot run stops the script, as on that GPU", owner, name, value))
        for owner, name, value in foreach_stand_ins():
            entries.append(StandIn("foreach kernels chosen for meta tensors, as for CUDA ones", owner, name, value))
        for owner, name, value in moved_in_place_stand_in(self.on_module_moved):
            entries.append(StandIn("a module moved to the GPU keeps its parameters' objects, as on CUDA", owner, name, value))
        for owner, name, value in wrapper_subclass_stand_in():
            entries.append(StandIn("tensor subclasses wrapping the fake GPU's tensors are on it too", owner, name, value))
        for owner, name, value in saved_tensor_hooks_in_mode(self.functions):
            entries.append(StandIn("saved-tensor hooks see the GPU as the rest of the script does", owner, name, value))
        for owner, name, value in autocast_stand_ins(self.autocast, self.functions):
            entries.append(StandIn("torch.autocast('cuda') emulated on meta tensors", owner, name, value))
        for owner, name, value in launch_stand_ins(self.notes):
            entries.append(StandIn("the script's own Triton kernels launched as nothing", owner, name, value))
        traced = HostOnlyProfiler(self.notes).stand_ins
        entries.append(Hook("the script's profiler traces the host alone", when_imported(PROFILER), traced))
        entries.append(Hook("torchtune's recipe config read as the recipe logs it", when_imported(CONFIG), self.recipe.stand_ins))
        for finder in BATCH_SIZE_FINDERS:
            searched = "Lightning's batch-size finder runs before the steps measured"
            entries.append(Hook(searched, when_imported(finder), self.batch_search.stand_ins))
        bounded = "the longest sequence the script keeps, as its tokenizer or trainer says it"
        entries.append(Hook(bounded, when_imported(TOKENIZER_BASE), self.bounds.tokenizer_stand_ins))
        entries.append(Hook(bounded, when_imported(TRAINER), self.bounds.trainer_stand_ins))
        entries.append(Hook(bounded, when_imported(TORCHTUNE_DATA), self.bounds.collate_stand_ins))
        entries.append(Hook(bounded, when_imported(LITGPT_MODEL), self.bounds.litgpt_model_stand_ins))
        entries.append(Hook(bounded, when_imported(LITGPT_DATA), self.bounds.litgpt_collate_stand_ins))
        tune_checkpoint = CheckpointFromConfig(self.notes)
        let_through = "torchtune's missing weight files let through"
        entries.append(Hook(let_through, when_imported(CHECKPOINT_UTILS), tune_checkpoint.path_stand_ins))
        read_from_config = "torchtune's missing weight files read from the config"
        entries.append(Hook(read_from_config, when_imported(CHECKPOINTER), tune_checkpoint.load_stand_ins))
        weights = WeightsFromConfig(self.notes).stand_ins
        from_config = "transformers' from_pretrained builds from the config, reading no weight file"
        entries.append(Hook(from_config, when_imported(MODELING), weights))
        diffusion = DiffusersWeightsFromConfig(self.notes).stand_ins
        diffusers_from_config = "diffusers' from_pretrained builds from the config, reading no weight file"
        entries.append(Hook(diffusers_from_config, when_imported(DIFFUSERS_MODELING), diffusion))
        lit = CheckpointWithoutWeights(self.notes).stand_ins
        entries.append(Hook("a LitGPT checkpoint folder without its weights is built from its config", when_imported(LITGPT_UTILS), lit))
        adapters = AdapterWithoutWeights(self.notes).stand_ins
        entries.append(Hook("a PEFT adapter folder without weights is built from its config", when_imported(PEFT_MODEL), adapters))
        paged = paged_stand_ins(rec.host)
        entries.append(Hook("bitsandbytes' paged buffers are host memory, counted as paged", when_imported(FUNCTIONAL), paged))
        outliers = outlier_stand_ins(self.notes)
        entries.append(Hook("bitsandbytes' 8-bit layers' outlier columns taken as none", when_imported(FUNCTIONAL), outliers))
        for owner, name, value in _fused_on_meta():
            entries.append(StandIn("fused optimizers take meta parameters, as CUDA ones", owner, name, value))
        compiler = Compiler(self.notes, rec, self.autocast)
        attrs("torch.compile's graphs partitioned as its backend would", torch, {"compile": compiler.stand_in()})
        entries.append(Hook("the pytree nodes torch.compile's captures registered, taken back", _called, compiler.registrations))
        tagged = {"checkpoint": checkpoint_stand_in()}
        regions = "checkpointed regions tagged for the partitioner, as torch.compile tags them"
        attrs(regions, torch.utils.checkpoint, tagged)
        # PyTorch's checkpoint_wrapper (FSDP's and torchtitan's) holds the function it imported.
        entries.append(Hook(regions, when_imported(CHECKPOINT_WRAPPER), lambda m: [(m, "torch_utils_checkpoint", tagged["checkpoint"])]))
        attrs("data loader workers run in the process", torch.utils.data.DataLoader, {"__init__": _one_process_loader(self.notes)})
        attrs("threads the script starts run on the fake GPU too", threading.Thread, {"_bootstrap_inner": _in_world(self.functions, rec)})
        if self.on_optimizer_made is not None:
            attrs("told whenever an optimizer is made", torch.optim.Optimizer, {"__init__": _told_when_made(self.on_optimizer_made)})
        for owner, name, value in rec.stand_ins():
            entries.append(StandIn("storages resized in place are recorded", owner, name, value))
        for owner, name, value in CudaGraphs(rec, self.notes).stand_ins():
            entries.append(StandIn("CUDA graphs captured in their private pools, replayed as nothing", owner, name, value))
        entries += self._distributed()
        entries += self.extra_stand_ins
        for register, fn in rec.hooks():
            entries.append(Hook("which module's forward is running", register, fn))
        for register, fn in flex_rules(rec):
            entries.append(Hook("FlexAttention's kernel sized as CUDA allocates it, compiled or dense", register, fn))
        for owner, name, value in device_check_stand_in():
            entries.append(StandIn("FlexAttention's device check takes the fake GPU's tensors", owner, name, value))
        entries += self.extra_hooks
        return entries

    def _distributed(self) -> list[Entry]:
        """Rank 0 of the fake process group: the script's own ``init_process_group`` answered by it, FSDP and DDP let run on it."""
        import torch.distributed as dist

        entries: list[Entry] = []
        if not dist.is_available():
            return entries
        init = self._init_process_group = dist.init_process_group
        world_size = self.settings.gpus

        def init_process_group(*_: Any, **__: Any) -> None:
            # Whatever backend the script asks for (nccl), rank 0 of the fake group answers.
            fake_process_group(world_size, init)
            self._as_rank_zero(world_size)

        # DeviceMesh (``init_device_mesh`` with no group yet) calls its own imported name.
        import torch.distributed.device_mesh  # noqa: F401

        entries += [
            StandIn("the script's init_process_group gets the fake process group", owner, "init_process_group", init_process_group)
            for owner in modules_holding("init_process_group", init)
        ]
        for owner, values in parallel_stand_ins(self.notes, self.settings.gpus, self.ranks):
            entries.extend(StandIn("FSDP and DDP run as rank 0 on meta tensors", owner, name, value) for name, value in values.items())
        pipeline = PipelineOnOneRank(self.notes).stand_ins
        shapes = "pipeline schedules run rank 0's stages, shapes from other ranks answered"
        entries.append(Hook(shapes, when_imported(PIPELINE_SCHEDULES), pipeline))
        return entries

    # ----- entering and leaving ----------------------------------------------

    def __enter__(self) -> FakeGpu:
        stack = ExitStack()
        try:
            entries = self.ledger()
            # Stand-ins a library imported under its own names outlive the run: they end with it.
            if self.saves is not None:
                stack.callback(self.saves.close)
            if self.absent is not None:
                stack.callback(self.absent.close)
            for entry in entries:
                if isinstance(entry, StandIn):
                    stack.enter_context(replaced(entry.owner, {entry.name: entry.value}))
                else:
                    stack.callback(entry.register(entry.fn).remove)
            world_size = self.settings.gpus
            if world_size > 1 and self.torchrun_environment:
                stack.enter_context(environment(rank_zero_environment(world_size)))
            if self.start_process_group:
                import torch.distributed as dist

                if fake_process_group(world_size, self._init_process_group):
                    stack.callback(dist.destroy_process_group)
                self._as_rank_zero(world_size)
            # The function mode above autograd, the recorder below it.
            stack.enter_context(self.functions)
            stack.enter_context(self.recorder)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def _as_rank_zero(self, world_size: int) -> None:
        """The script runs in the fake process group of ``world_size`` ranks, as rank 0: said once there are several."""
        self.ranks.used = True
        if world_size > 1:
            self.notes.add(rank_zero_note(world_size))

    def gpus_note(self) -> str | None:
        """What the answer says of the GPUs the script used where it is not one rank of
        ``--gpus``: several named in one process (a model spread over them, as ``device_map``
        spreads it), measured together; or ``--gpus`` given to a script that used one."""
        if self.ranks.used:
            return None
        named = sorted(self.functions.gpu_indices)
        if len(named) > 1:
            gpus = ", ".join(f"cuda:{i}" for i in named)
            return (
                f"the script put tensors on {gpus} in one process (a model spread over its GPUs, as device_map does): "
                "preflight holds them on one GPU, so the figures are those GPUs' together, where each holds its part"
            )
        if self.settings.gpus > 1:
            return (
                f"--gpus {self.settings.gpus}: the script made no process group and started no process per GPU, "
                "so it ran on one GPU, as measured"
            )
        return None

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


# ----- the stand-ins written here ----------------------------------------------


def _called(make: Callable[[], Any]) -> Any:
    """A hook's registration that is a call: ``make()`` returns the handle to remove."""
    return make()


def _fake_tensor_mode() -> Any:
    """PyTorch's ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def _fused_on_meta() -> list[tuple[Any, str, Any]]:
    """``fused=True`` optimizers take meta parameters, as they take CUDA ones (their kernels have meta versions)."""
    import torch.optim.optimizer as base

    check = base._device_dtype_check_for_fused

    def allowed(p: torch.Tensor, cuda_unsupported: bool = False) -> None:
        if p.device.type != FAKE_DEVICE:
            check(p, cuda_unsupported)

    found = []
    for name in FUSED_CHECKS:
        module = sys.modules.get(f"torch.optim.{name}")
        if module is not None and hasattr(module, "_device_dtype_check_for_fused"):
            found.append((module, "_device_dtype_check_for_fused", allowed))
    return found


def _one_process_loader(notes: Notes) -> Any:
    """``DataLoader.__init__`` with its workers in the main process: they would carry
    meta tensors between processes; the batch is the same."""
    init = torch.utils.data.DataLoader.__init__

    # Its signature stays DataLoader's: Lightning reads it to make the loader again with a distributed sampler.
    @functools.wraps(init)
    def new_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("num_workers", 0):
            kwargs["num_workers"] = 0
            kwargs.pop("prefetch_factor", None)
            kwargs["persistent_workers"] = False
            notes.add(WORKERS_IN_PROCESS)
        init(self, *args, **kwargs)

    return new_init


def _in_world(functions: CudaFunctions, recorder: Recorder) -> Any:
    """``Thread._bootstrap_inner`` that runs a thread with the fake GPU's modes on its own
    stacks (modes are per thread): a checkpoint loaded on a thread pool (transformers 5's
    ``from_pretrained``), a data loader's pinning thread, land on the fake GPU and are recorded."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap(self: threading.Thread) -> None:
        torch._C._push_on_torch_function_stack(functions)
        _push_mode(recorder)
        try:
            inner(self)
        finally:
            _pop_mode()
            torch._C._pop_torch_function_stack()

    return bootstrap


def _told_when_made(told: Callable[[torch.optim.Optimizer], None]) -> Any:
    """``Optimizer.__init__`` that calls ``told(optimizer)`` first, whenever a ``torch.optim`` optimizer is made."""
    init = torch.optim.Optimizer.__init__

    def new_init(self: Any, *args: Any, **kwargs: Any) -> None:
        told(self)
        init(self, *args, **kwargs)

    return new_init
