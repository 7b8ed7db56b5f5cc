"""Preflight across several GPUs: FSDP run as rank 0 of N through PyTorch's
fake process group, in Python, on an unchanged torchrun script and from
`oomkit estimate --trace --gpus N --zero S`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import oomkit
import pytest
import torch
from oomkit.preflight import Preflight
from preflight_cli import preflight_run
from torch import nn

OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "preflight" / "fsdp_train.py"
DIM, LAYERS = 512, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean()


def run(gpus: int, sharding: str = "fsdp") -> Preflight:
    return oomkit.preflight(Net, lambda b: torch.randn(b, 256, DIM), micro_batch=4, capacity="80GiB", gpus=gpus, sharding=sharding)


def test_fsdp_keeps_a_shard_of_the_states_on_each_gpu() -> None:
    cuda_available = torch.cuda.is_available
    one, four = run(1), run(4)
    # AdamW's two fp32 moments of every parameter, on one GPU and as a quarter on each of four.
    params = sum(p.numel() for p in Net().parameters())
    assert abs(one.by_role["optimizer_state"] - 8 * params) / (8 * params) < 0.01, one.by_role
    assert abs(four.by_role["optimizer_state"] - 2 * params) / (2 * params) < 0.01, four.by_role
    assert four.peak_allocated_bytes < one.peak_allocated_bytes
    assert any("rank 0 of 4 GPUs" in n and "fake process group" in n for n in four.notes), four.notes
    # ZeRO-2 (SHARD_GRAD_OP) keeps the gathered parameters from forward to backward; FSDP frees them.
    zero2 = run(4, "zero2")
    assert zero2.by_role["parameters"] > four.by_role["parameters"]
    # Nothing of the fake world is left behind in the process.
    assert not torch.distributed.is_initialized()
    assert torch.cuda.is_available is cuda_available


def test_bad_sharding_settings_are_one_line() -> None:
    with pytest.raises(oomkit.PreflightError, match="sharding 'zero4'"):
        run(4, "zero4")
    with pytest.raises(oomkit.PreflightError, match="gpus"):
        run(0)


SMALL = ("--dim", "256", "--layers", "4", "--vocab", "1000", "--seq", "128", "--batch-size", "2")




def test_an_unchanged_torchrun_script_runs_as_rank_zero() -> None:
    # The script calls init_process_group("nccl") and shards with fully_shard, as under torchrun.
    one, eight = (preflight_run(EXAMPLE, "--gpus", str(g), "--capacity", "8GiB", args=SMALL) for g in (1, 8))
    state_one, state_eight = one["by_role"]["optimizer_state"], eight["by_role"]["optimizer_state"]
    assert abs(state_eight - state_one / 8) / (state_one / 8) < 0.02, (state_one, state_eight)
    assert eight["peak_allocated_bytes"] < one["peak_allocated_bytes"]
    assert any("rank 0 of 8 GPUs" in n for n in eight["notes"]), eight["notes"]


def test_estimate_traces_every_zero_stage() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    config = ROOT / "examples" / "preflight" / "gpt2_tiny.json"
    common = [OOMKIT, "estimate", "--config", str(config), "--batch", "4", "--seq", "128", "--gpu", "8GiB", "--trace", "--json"]

    def traced(*flags: str) -> dict:
        p = subprocess.run([*common, *flags], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    one, four = traced(), traced("--gpus", "4", "--zero", "3")
    state_one, state_four = one["traced"]["by_role"]["optimizer_state"], four["traced"]["by_role"]["optimizer_state"]
    assert 0 < state_four < state_one / 3, (state_one, state_four)
    # ZeRO-1: DDP with PyTorch's ZeroRedundancyOptimizer, which gives each rank whole
    # parameters, largest first: rank 0 keeps the tied embedding's two moments (bf16,
    # 5000 x 128), the most of this small model's state but not all of it.
    zero1 = traced("--gpus", "4", "--zero", "1")["traced"]["by_role"]
    assert zero1["optimizer_state"] == 2 * 2 * 5000 * 128 < state_one, (zero1, state_one)
    # Stage 0 (plain data parallelism) is DDP: everything on each GPU, and its buckets.
    ddp = traced("--gpus", "4", "--zero", "0")["traced"]["by_role"]
    assert ddp["optimizer_state"] == one["traced"]["by_role"]["optimizer_state"]
    assert ddp["other"] > one["traced"]["by_role"]["other"]


def test_ddp_keeps_everything_and_its_buckets_on_each_gpu() -> None:
    one, four = run(1), run(4, "ddp")
    params = 4 * sum(p.numel() for p in Net().parameters())
    # The whole model and its state on every GPU, as on one.
    assert four.by_role["parameters"] == one.by_role["parameters"]
    assert four.by_role["optimizer_state"] == one.by_role["optimizer_state"]
    # DDP's gradient buckets, beside the gradients (gradient_as_bucket_view is off by default): one more copy.
    extra = four.by_role["other"] - one.by_role["other"]
    assert abs(extra - params) / params < 0.01, (extra, params)
    assert any("with DDP" in n for n in four.notes), four.notes
    assert torch.nn.parallel.DistributedDataParallel.__init__.__qualname__ == "DistributedDataParallel.__init__"
    # ZeRO-1 keeps DDP's copies and a quarter of the optimizer's state (ZeroRedundancyOptimizer's share).
    zero1 = run(4, "zero1")
    assert zero1.by_role["parameters"] == one.by_role["parameters"]
    assert abs(zero1.by_role["optimizer_state"] - one.by_role["optimizer_state"] / 4) / (one.by_role["optimizer_state"] / 4) < 0.01


DDP_SCRIPT = """
import os, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
model = DDP(nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda(), device_ids=[local])
model.register_comm_hook(None, default_hooks.fp16_compress_hook)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(8, 128, 512, device="cuda")).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_an_unchanged_ddp_script_runs_as_rank_zero(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    run = preflight_run(script, "--gpus", "4", "--capacity", "8GiB")
    params = 4 * (512 * 2048 + 2048 + 2048 * 512 + 512)
    assert run["by_role"]["parameters"] >= params
    # The buckets (one copy of the gradients) and cuBLAS's workspace.
    assert run["by_role"]["other"] >= params + (32 << 20), run["by_role"]
    # The script's own hook does not run on one rank, and the answer says so.
    assert any("fp16_compress_hook was not run" in n for n in run["notes"]), run["notes"]


FSDP2_META_INIT = """
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
model.to_empty(device="cuda")  # FSDP2's parameters are swapped in place (torch.utils.swap_tensors)
for layer in model:
    layer.reset_parameters()  # random values on each shard: DTensor's random operators
nn.init.trunc_normal_(model[0].weight, std=0.02)
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_model_built_on_meta_and_sharded_is_made_on_the_gpu_with_to_empty(tmp_path: Path) -> None:
    # FSDP2's and torchtitan's order: built on meta, sharded, then to_empty and initialised.
    # Swapping a parameter refuses a tensor with a weak reference: preflight holds none. The
    # random initialisation of sharded weights reaches for the GPU's generator: not here.
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_META_INIT)
    run = preflight_run(script, "--gpus", "4", "--capacity", "8GiB")
    assert run["steps"] == 2, run
    # Each GPU holds a quarter of each weight and bias; AdamW keeps two moments of that shard.
    shard = 4 * (1024 * 1024 * 4 // 4 + 1024)
    assert run["by_role"]["optimizer_state"] == 2 * shard, run["by_role"]


#: FSDP's first API (the wrapper class, as accelerate's and Lightning's FSDP strategies run it):
#: each block its own unit, bf16 mixed precision, with the original parameters or flat ones.
FSDP1 = """import functools
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(512)
        self.up, self.down = nn.Linear(512, 2048), nn.Linear(2048, 512)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(512, 512)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
model = FullyShardedDataParallel(Net(), auto_wrap_policy=wrap, mixed_precision=bf16,
                                 device_id=torch.cuda.current_device(), use_orig_params=sys.argv[1] == "orig")
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(4, 256, 512, device="cuda")).float().square().mean().backward()
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("params", ["orig", "flat"])
def test_fsdp_wrapper_class_with_mixed_precision_keeps_a_shard_on_each_gpu(tmp_path: Path, params: str) -> None:
    script = tmp_path / "fsdp1.py"
    script.write_text(FSDP1)
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", "4")
    run = preflight_run(script, args=(params,), launcher=launcher)
    assert run["steps"] == 2, run
    # Each block (a norm, 512 x 2048 and 2048 x 512 with biases) and the root (the head) flattened
    # and split four ways, in float32: a quarter of every weight on this GPU.
    block = 2 * 512 + 512 * 2048 + 2048 + 2048 * 512 + 512
    shard = (4 * block + 512 * 512 + 512) // 4 * 4  # a quarter of the elements, 4 bytes each
    assert run["by_role"]["parameters"] == shard, run["by_role"]
    # AdamW's two moments of the shard; a moment served from a larger cached block counts that
    # block, as CUDA's allocator does (a remainder under 1 MiB is not split off).
    assert 2 * shard <= run["by_role"]["optimizer_state"] < 2 * shard + (1 << 20), run["by_role"]


#: FSDP2 with its parameters offloaded to the host (``CPUOffloadPolicy``): each GPU keeps its
#: shards and AdamW's state on the host, pinned, and gathers a layer's weights as it runs it.
FSDP2_OFFLOADED = """
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

dist.init_process_group("nccl")
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
for layer in model:
    fully_shard(layer, offload_policy=CPUOffloadPolicy())
fully_shard(model, offload_policy=CPUOffloadPolicy())
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(16, 2048, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_fsdp_with_its_parameters_offloaded_to_the_host_is_measured_on_the_gpu_it_gathers_on(tmp_path: Path) -> None:
    script = tmp_path / "offloaded.py"
    script.write_text(FSDP2_OFFLOADED)
    run = preflight_run(script, launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2"))
    layer = (2048 * 2048 + 2048) * 4
    # On the host: each layer's half, pinned, and the gradients' halves brought back.
    assert run["host_pinned_peak_bytes"] == 2 * layer and run["host_peak_bytes"] == 4 * layer, run
    # On the GPU: the layer running and the next, gathered whole, a layer's whole gradient before
    # it is reduce-scattered, and no optimizer state (AdamW steps on the host).
    assert run["by_role"]["parameters"] == 2 * layer and run["by_role"]["gradients"] == layer, run["by_role"]
    assert run["by_role"]["optimizer_state"] == 0 and run["steps"] == 2, run
    assert not any("nothing was trained" in n for n in run["notes"]), run["notes"]
