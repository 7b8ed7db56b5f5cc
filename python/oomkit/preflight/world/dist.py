"""Several GPUs in one process: a fake process group, and FSDP run on meta tensors.

A training run sharded over N GPUs keeps on each what one rank keeps, so
preflight runs rank 0 alone: ``torch.distributed`` is initialised with
PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``,
a backend whose collectives complete without moving data, made for
exactly this: running one rank of a job as if the others were there), and
FSDP (``fully_shard``) shards, gathers and reduce-scatters as it would on
the GPUs. Its all-gathered parameters, gradient buffers and sharded
states are real tensors of rank 0's sizes, recorded like any other.

What FSDP needs from a GPU that ``meta`` tensors lack is stood in for:
CUDA streams and events (``cuda.device_answers``: FSDP overlaps
communication on side streams; here every operation runs on the one
stream, so the allocator's per-stream pools are not modelled), the device
handle of a ``meta`` tensor, and FSDP's check that no parameter is on
``meta`` (it is meant for models not yet materialised; here ``meta`` is
the GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch

from oomkit._native import PreflightError
from oomkit.preflight.notes import Notes
from oomkit.preflight.settings import STRATEGIES
from oomkit.preflight.world.imports import replaced

#: Sharding strategies by name: whether parameters are freed again after
#: forward (FSDP's FULL_SHARD, ZeRO-3) or kept gathered until backward
#: (SHARD_GRAD_OP, ZeRO-2).
RESHARD_AFTER_FORWARD = {"fsdp": True, "zero3": True, "zero2": False}

#: What every answer for several GPUs says of what is not modelled.
ONE_STREAM = "communication streams are not modelled (one stream)"

#: The environment torchrun gives each rank; a script run under preflight is rank 0.
RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK")


def fake_process_group(world_size: int, init: Any) -> bool:
    """Initialises ``torch.distributed`` as rank 0 of ``world_size`` with the fake process group,
    through ``init`` (PyTorch's own ``init_process_group``); whether it made one (none was there)."""
    import torch.distributed as dist

    try:
        # Importing it registers the "fake" backend.
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise PreflightError(f"this PyTorch has no fake process group to shard with ({e})") from None
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise PreflightError(f"torch.distributed is already initialised with {dist.get_world_size()} ranks, not {world_size}")
        return False
    init(backend="fake", store=FakeStore(), rank=0, world_size=world_size)
    return True


def modules_holding(name: str, value: Any) -> list[Any]:
    """The imported modules of ``torch.distributed`` that hold ``value`` as ``name``: each
    imported it by name and calls its own, so a stand-in is set on every one of them."""
    return [m for n, m in list(sys.modules.items()) if n.startswith("torch.distributed") and getattr(m, name, None) is value]


def rank_zero_environment(world_size: int) -> dict[str, str]:
    """The environment torchrun gives rank 0 of ``world_size`` (nothing for one GPU).

    One GPU keeps the environment as it is: a script that shards only under
    torchrun (``RANK`` set) takes its one-GPU branch, as it would.
    """
    if world_size <= 1:
        return {}
    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), **dict.fromkeys(RANK_ENV, "0")}
    env["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = os.environ.get("MASTER_PORT", "29500")
    return env


def rank_zero_note(world_size: int) -> str:
    """What an answer for several GPUs says of the process group it ran in."""
    return f"rank 0 of {world_size} GPUs: the script's process group is PyTorch's fake one; {ONE_STREAM}"


class Ranks:
    """Whether the script ran as one GPU of several: it made a process group, started a process
    per GPU or split its batches with ``nn.DataParallel``; a script given ``--gpus`` that does
    none of these runs on one GPU, and its answer says so."""

    def __init__(self) -> None:
        #: Set once the script has done any of them.
        self.used = False


def parallel_stand_ins(notes: Notes, world_size: int, ranks: Ranks) -> list[tuple[Any, dict[str, Any]]]:
    """What lets FSDP and DDP run as rank 0 of the fake group on ``meta`` tensors, and
    ``nn.DataParallel`` as its first GPU, as (owner, attributes) to set; ``ranks`` is told
    when the script runs as one GPU of several."""
    return (
        fsdp_on_meta()
        + ddp_on_one_rank(notes)
        + data_parallel_on_first_gpu(notes, world_size, ranks)
        + dtensor_random_on_shards()
        + spawned_ranks_in_process(notes, world_size, ranks)
        + processes_given_gpu_tensors(notes)
    )


class _RanksRunHere:
    """What ``torch.multiprocessing.spawn(..., join=False)`` returns when rank 0 has already run
    in this process: a context whose processes have all ended well."""

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.error_files: list[str] = []

    def pids(self) -> list[int]:
        """The processes' ids: this one, where rank 0 ran."""
        return [os.getpid()]

    def join(self, *_: Any, **__: Any) -> bool:
        """Whether every process has ended: each has."""
        return True


def spawned_ranks_in_process(notes: Notes, world_size: int, ranks: Ranks) -> list[tuple[Any, dict[str, Any]]]:
    """``torch.multiprocessing.spawn`` and ``start_processes`` run rank 0's function in this
    process, as (owner, attributes) to set.

    A script that starts one process per GPU itself (the pattern of PyTorch's
    DDP tutorials and Lightning's ``ddp_spawn``) gives each a fresh
    interpreter, where the fake GPU is not: its ``init_process_group("nccl")``
    would find no GPU. Each rank holds what rank 0 holds, so rank 0's
    function runs here, with the script's arguments, on the fake GPU and in
    the fake process group of ``--gpus`` ranks; the others are not started.
    """
    import torch.multiprocessing as mp

    def start_processes(fn: Any, args: Any = (), nprocs: int = 1, join: bool = True, *_: Any, **__: Any) -> Any:
        if nprocs > 1 or world_size > 1:
            ranks.used = True
            differs = nprocs > 1 and nprocs != world_size
            notes.add(
                f"the script starts {nprocs} process(es) with torch.multiprocessing: rank 0's function ran in the script's "
                f"process, as rank 0 of {world_size} GPU(s)" + (f" (--gpus {nprocs} measures it as one of {nprocs})" if differs else "")
            )
        fn(0, *args)
        return None if join else _RanksRunHere()

    spawn_module = sys.modules.get("torch.multiprocessing.spawn")
    values = {"spawn": start_processes, "start_processes": start_processes}
    return [(owner, values) for owner in (mp, spawn_module) if owner is not None]


class _EndedHere:
    """What a process started with ``multiprocessing`` holds as its running child, where its
    function ran in this process instead (or was not run): a child that has ended well."""

    returncode = 0

    def poll(self, *_: Any) -> int:
        """Its exit code: it has ended, well."""
        return 0

    def wait(self, *_: Any) -> int:
        """Its exit code, at once."""
        return 0

    def terminate(self) -> None:
        """Nothing: it has ended."""

    kill = terminate
    close = terminate


def _given_gpu_tensors(values: Any) -> bool:
    """Whether ``values`` (a process's arguments) hold a tensor or a module's weight on the GPU."""
    for value in values:
        if isinstance(value, torch.nn.Module):
            found = any(t.is_cuda for t in value.parameters())
        elif isinstance(value, torch.Tensor):
            found = value.is_cuda
        elif isinstance(value, dict):
            found = _given_gpu_tensors(value.values())
        else:
            found = isinstance(value, (list, tuple)) and _given_gpu_tensors(value)
        if found:
            return True
    return False


def processes_given_gpu_tensors(notes: Notes) -> list[tuple[Any, dict[str, Any]]]:
    """A process the script starts with ``multiprocessing`` and gives its GPU tensors runs its
    function in this process, as (owner, attributes) to set.

    Hogwild training (pytorch/examples' ``mnist_hogwild`` with ``--cuda``)
    shares the model's weights (``share_memory()``) with processes of its
    own, each training them on the same GPU. A fresh interpreter has no fake
    GPU, so the first such process's function runs here, its steps measured
    as the script's; the others are not started, and the answer says what
    each would add.
    """
    from multiprocessing import process

    start = process.BaseProcess.start
    given: list[Any] = []

    def start_here(self: Any) -> None:
        if not _given_gpu_tensors((*self._args, *self._kwargs.values())):
            start(self)
            return
        given.append(self)
        # As a started child that has ended: join(), exitcode and is_alive() answer as for one.
        self._popen, self._sentinel = _EndedHere(), None
        if len(given) == 1:
            notes.add(
                "the script starts processes of its own (multiprocessing) given its GPU tensors: the first one's "
                "function ran in the script's process and is what is measured; the others were not started, and "
                "each would hold on the same GPU what it holds beyond the tensors they share"
            )
            self.run()

    return [(process.BaseProcess, {"start": start_here})]


def dtensor_random_on_shards() -> list[tuple[Any, dict[str, Any]]]:
    """DTensor's random operators run on each shard as they are, as (owner, attributes) to set.

    On a GPU, DTensor keeps every rank's generator in step for its random
    operators (``reset_parameters()``, ``trunc_normal_``: initialising a
    model sharded on meta), through the device's generator, which does not
    exist here; the values are not what preflight measures, and the shard
    each one fills is the same.
    """
    import torch.distributed.tensor._dispatch as dtensor_dispatch
    import torch.distributed.tensor._random as dtensor_random

    stand_ins: list[tuple[Any, dict[str, Any]]] = []
    if hasattr(dtensor_dispatch, "is_rng_supported_mesh"):
        stand_ins.append((dtensor_dispatch, {"is_rng_supported_mesh": lambda *_, **__: False}))
    tracker = getattr(dtensor_random, "OffsetBasedRNGTracker", None)
    if tracker is not None and hasattr(tracker, "_distribute_region"):
        # Newer PyTorch steps into the region for a shard on another device than the GPU (FSDP2's
        # shards offloaded to the host, initialised there), reading the GPU generator's state.
        stand_ins.append((tracker, {"_distribute_region": lambda *_, **__: contextlib.nullcontext()}))
    return stand_ins


def data_parallel_on_first_gpu(notes: Notes, world_size: int, ranks: Ranks) -> list[tuple[Any, dict[str, Any]]]:
    """What lets ``nn.DataParallel`` run as its first GPU, the one that holds the most.

    DataParallel keeps the model on its first GPU, splits each batch along
    ``dim`` over its GPUs, runs a replica on each, and gathers the outputs on
    the first. Its forward refuses parameters that are not on that GPU (here
    they are on ``meta``), and its scatter and gather are CUDA copies; in
    their place the first GPU's share of the batch runs through the model
    and the outputs of all shares are gathered as that share's, repeated
    (the same sizes), so that GPU 0 holds what it would: the model, its
    gradients and optimizer state, the activations of its share and the
    whole gathered output. With one GPU that is the model run on the whole
    batch, as DataParallel runs it. Its GPUs are those it is given
    (``device_ids``), else all the machine's: ``world_size`` (``--gpus``).
    """
    from torch.nn.parallel import DataParallel

    init = DataParallel.__init__

    def new_init(self: Any, module: Any, device_ids: Any = None, *args: Any, **kwargs: Any) -> None:
        init(self, module, device_ids, *args, **kwargs)
        self._oomkit_gpus = len(device_ids) if device_ids else world_size

    def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        gpus = getattr(self, "_oomkit_gpus", 1)
        if gpus <= 1:
            return self.module(*inputs, **kwargs)
        ranks.used = True
        notes.add(
            f"nn.DataParallel over {gpus} GPUs: the first is measured, which runs 1/{gpus} of each batch and gathers "
            "the outputs of all; the replicas on the others are not counted here"
        )
        dim = getattr(self, "dim", 0)

        def share(x: Any) -> Any:
            return x.chunk(gpus, dim)[0] if isinstance(x, torch.Tensor) and x.dim() > dim else x

        out = self.module(*torch.utils._pytree.tree_map(share, inputs), **torch.utils._pytree.tree_map(share, kwargs))

        def gathered(x: Any) -> Any:
            return torch.cat([x] * gpus, dim) if isinstance(x, torch.Tensor) and x.dim() > dim else x

        return torch.utils._pytree.tree_map(gathered, out)

    return [(DataParallel, {"__init__": new_init, "forward": forward})]


def _reduced_in_place(_state: Any, bucket: Any) -> Any:
    """DDP's all-reduce of a bucket as one rank sees it: the bucket, done (NCCL reduces it in place)."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def ddp_on_one_rank(notes: Notes) -> list[tuple[Any, dict[str, Any]]]:
    """What lets ``DistributedDataParallel`` run as rank 0 of the fake group, as (owner, attributes) to set.

    Its check that every rank has the same parameters gathers nothing from
    a fake group, so it is skipped; its all-reduce of each gradient bucket
    is answered by the bucket itself, as the default in-place all-reduce
    leaves it (the buckets DDP allocates beside the gradients are DDP's
    own and recorded); inputs are copied to the device on the one stream.
    A hook the script registers itself is not run, and ``notes`` says so.
    """
    import torch.distributed as dist
    from torch.nn.parallel import distributed as ddp

    # DDP checks a hook's annotations against the classes themselves (not the names this module's are).
    _reduced_in_place.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    cls = ddp.DistributedDataParallel
    init, register = cls.__init__, cls.register_comm_hook

    def new_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.use_side_stream_for_tensor_copies = False
        register(self, None, _reduced_in_place)
        self._oomkit_reduced = True

    def new_register(self: Any, state: Any, hook: Any) -> None:
        if getattr(self, "_oomkit_reduced", False):
            note = f"DDP's communication hook {getattr(hook, '__name__', 'of the script')} was not run (its buffers are not counted)"
            notes.add(note)
            return
        register(self, state, hook)

    return [
        (ddp, {"_verify_param_shape_across_processes": lambda *_, **__: None}),
        (cls, {"__init__": new_init, "register_comm_hook": new_register}),
    ]


def fsdp_on_meta() -> list[tuple[Any, dict[str, Any]]]:
    """What lets FSDP run on ``meta`` parameters, as (owner, attributes) to set.

    The device handle of ``meta`` is ``torch.cuda`` (FSDP looks up the
    handle of its buffers' device to wait on streams), and FSDP's check that
    no parameter is on ``meta`` is off (it is meant for a model not yet
    materialised; here ``meta`` is the GPU).
    """
    from torch.distributed import device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    original = getattr(device_mesh._get_device_handle, "_oomkit_original", device_mesh._get_device_handle)

    def handle(device_type: str = "cuda") -> Any:
        return torch.cuda if device_type == "meta" else original(device_type)

    handle._oomkit_original = original  # type: ignore[attr-defined]
    owners = {_fsdp_collectives, *modules_holding("_get_device_handle", original)}
    changes: list[tuple[Any, dict[str, Any]]] = [(m, {"_get_device_handle": handle}) for m in owners]
    changes.append((_fsdp_param_group.FSDPParamGroup, {"_validate_no_meta_params": lambda self: None}))
    return changes


#: The classes by which a module is spread over GPUs, by the name the answers use: FSDP2's
#: ``fully_shard`` makes a module's class a subclass of ``FSDPModule``; FSDP1 and DDP wrap it.
SPREADERS = {"FSDPModule": "FSDP", "FullyShardedDataParallel": "FSDP", "DistributedDataParallel": "DDP"}


def spread_by(module: torch.nn.Module) -> str | None:
    """How ``module`` itself is spread over GPUs by the script (``FSDP`` or ``DDP``), if it is.
    By class name, so that nothing of ``torch.distributed`` is imported to ask."""
    for cls in type(module).__mro__:
        if cls.__name__ in SPREADERS:
            return SPREADERS[cls.__name__]
    return None


def spread_in(module: torch.nn.Module) -> str | None:
    """How the script spreads ``module`` or any module inside it over GPUs, if it does."""
    for m in module.modules():
        if (how := spread_by(m)) is not None:
            return how
    return None


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units FSDP is usually applied to: the layers of the model's largest ``ModuleList``."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(largest)


def shard(
    model: torch.nn.Module,
    world_size: int,
    strategy: str,
    units: list[torch.nn.Module] | None = None,
    fully_shard: Any = None,
) -> tuple[torch.nn.Module, list[str]]:
    """Spreads ``model`` over ``world_size`` GPUs as ``strategy`` does; returns the model to train and notes.

    FSDP's strategies apply ``fully_shard`` to each block (``units``, else
    the layers of the model's largest ``ModuleList``) and to the model
    (with ``fully_shard``, else PyTorch's);
    ``ddp`` wraps it in ``DistributedDataParallel``. Runs in the fake GPU
    (``fake_gpu.FakeGpu``) as rank 0 of ``world_size``.
    """
    if strategy not in STRATEGIES:
        raise PreflightError(f"sharding {strategy!r}: give one of {', '.join(STRATEGIES)}")
    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        state = ", a share of the optimizer's state on each (ZeroRedundancyOptimizer)" if strategy == "zero1" else ""
        note = f"rank 0 of {world_size} GPUs with DDP (the whole model on each{state}), through PyTorch's fake process group; {ONE_STREAM}"
        return DistributedDataParallel(model), [note]
    from torch.distributed.device_mesh import init_device_mesh

    if fully_shard is None:
        from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (world_size,))
    reshard = RESHARD_AFTER_FORWARD[strategy]
    units = blocks(model) if units is None else units
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    notes = [
        f"rank 0 of {world_size} GPUs, sharded with FSDP (fully_shard, reshard_after_forward={reshard}) "
        f"over {len(units)} block(s) and the model, through PyTorch's fake process group; {ONE_STREAM}"
    ]
    if not units:
        notes.append("the model has no ModuleList of layers: FSDP gathers all of it at once")
    return model, notes


def zero_redundancy(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` as ZeRO-1 runs it: PyTorch's ZeroRedundancyOptimizer over the same groups, this rank's share stepped."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    # Only what the class's constructor takes (AdamW's defaults hold a flag its constructor sets itself).
    takes = inspect.signature(type(opt).__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in takes and k != "params"}
    groups = [{k: v for k, v in g.items() if k == "params" or k in takes} for g in opt.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(opt), **defaults)


#: The module whose import brings pipeline parallelism's schedules (and stages) in.
PIPELINE_SCHEDULES = "torch.distributed.pipelining.schedules"

#: What a pipeline's answer adds where rank 0 does not hold the last stage.
ELSEWHERE = "; the last stage (the output layer and the loss) is on another rank and may hold more"


class PipelineOnOneRank:
    """What lets ``torch.distributed.pipelining``'s schedules run as rank 0 of the fake group.

    A schedule runs the stages this rank holds, in its own order of
    forwards and backwards over the micro-batches, so rank 0's activations
    in flight are what the schedule keeps (all of them under GPipe, at most
    the number of stages under 1F1B). What a stage learns from the other
    ranks before the first step is the shapes of what it will receive, and
    on a fake group nothing arrives (PyTorch refuses to infer them there).
    Here they are answered from what this rank knows: the gradients a stage
    receives have the shapes of its outputs, and the activations a later
    stage on this rank receives have the shapes this rank last sent on,
    which holds where the stages between keep the shape of what they pass
    (a transformer's hidden states), and a note says so.
    """

    def __init__(self, notes: Notes) -> None:
        self.notes = notes
        self._sent: Any = None

    def stand_ins(self, schedules: Any) -> list[tuple[Any, str, Any]]:
        """The (owner, name, value) triples to set once ``schedules`` is imported; none where
        this PyTorch's pipelining infers no shapes across ranks (it has nothing to stand in for)."""
        from torch.distributed.pipelining import _utils, stage

        base = getattr(schedules, "_PipelineSchedule", None)
        cls = getattr(stage, "PipelineStage", None)
        modes = getattr(_utils, "InferenceMode", None)
        wanted = (base, "_initialize_pipeline_distributed_state"), (cls, "_recv_meta"), (cls, "_send_meta")
        if base is None or cls is None or modes is None or any(not hasattr(owner, name) for owner, name in wanted):
            return []
        initialize, send = base._initialize_pipeline_distributed_state, cls._send_meta
        needs_dynamic = modes.needs_dynamic

        def initialize_on_one_rank(schedule: Any, stages: Any, has_backward: bool, *args: Any, **kwargs: Any) -> None:
            # PyTorch asks every rank whether any stage needs its shapes inferred and refuses
            # that on a fake group; here this rank's stages answer for all (each rank builds alike).
            dynamic = any(needs_dynamic(s._user_meta, has_backward) for s in stages if hasattr(s, "_user_meta"))
            with replaced(modes, {"needs_dynamic": classmethod(lambda *_: False)}):
                initialize(schedule, stages, has_backward, *args, **kwargs)
            if dynamic:
                for s in stages:
                    s._inference_mode = modes.DYNAMIC
            held = ", ".join(str(s.stage_index) for s in stages)
            last = "" if any(getattr(s, "is_last", False) for s in stages) else ELSEWHERE
            in_flight = "with the micro-batches its schedule keeps in flight"
            self.notes.add(f"pipeline parallelism: rank 0's stage(s) {held} measured, {in_flight}{last}")

        def send_meta(stage_: Any, meta: Any, dst_stage: int) -> None:
            if isinstance(meta, _utils._StageForwardMeta):
                self._sent = meta
            send(stage_, meta, dst_stage)

        def recv_meta(stage_: Any, src_stage: int) -> Any:
            if src_stage > stage_.stage_index:
                # The gradients of a stage's outputs have its outputs' shapes.
                return _utils._StageBackwardMeta(backward_metas=tuple(stage_._stage_meta.outputs))
            if self._sent is None:
                raise PreflightError(
                    f"pipeline stage {stage_.stage_index} receives its inputs from stage {src_stage} on another rank, "
                    "and rank 0 has sent nothing to take their shapes from: give the stage its input_args"
                )
            self.notes.add(
                f"pipeline stage {stage_.stage_index}'s inputs are taken to have the shapes this rank sent on "
                "(the stages between, on other ranks, keep the shape of what they pass)"
            )
            return self._sent

        return [
            (base, "_initialize_pipeline_distributed_state", initialize_on_one_rank),
            (cls, "_recv_meta", recv_meta),
            (cls, "_send_meta", send_meta),
        ]
