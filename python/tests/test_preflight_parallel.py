"""Parallelism beyond FSDP and DDP, as rank 0 of many: tensor parallelism (DTensor's
colwise and rowwise styles), FSDP and tensor parallelism on a 2D mesh with sequence
parallelism, pipeline schedules, and torchrun's command line. Each script is the
project's own; each answer is checked against sizes worked out by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from preflight_cli import OOMKIT, preflight_run

#: Two Linear layers split over the tensor-parallel GPUs, built as a DeviceMesh starts its own group.
TENSOR_PARALLEL = """
import os
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

class Feed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(1024, 4096, bias=False)
        self.down = nn.Linear(4096, 1024, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
# No init_process_group: the mesh starts the default group itself, from torchrun's environment.
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
model = parallelize_module(Feed().cuda(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(4, 256, 1024, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def _under_torchrun(tmp_path: Path, name: str, text: str) -> dict[str, Any]:
    """The answer for the script ``text``, written as ``name``, launched as a user types it: torchrun's
    own command line, which decides the world (2 GPUs)."""
    script = tmp_path / name
    script.write_text(text)
    return preflight_run(script, launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2"))


def test_tensor_parallel_keeps_a_slice_of_each_weight_launched_by_torchrun(tmp_path: Path) -> None:
    run = _under_torchrun(tmp_path, "tp.py", TENSOR_PARALLEL)
    weights = 2 * 1024 * 4096 * 4
    assert run["steps"] == 2, run
    # Each GPU keeps half of each weight (up's rows, down's columns), and AdamW's two moments of that half.
    assert run["by_role"]["parameters"] == weights // 2, run["by_role"]
    assert run["by_role"]["optimizer_state"] == weights, run["by_role"]
    assert any("rank 0 of 2 GPUs" in n for n in run["notes"]), run["notes"]
    # Its mesh made the process group: it ran as one GPU of two, and nothing says it ran on one alone.
    assert not any("made no process group" in n or "in one process" in n for n in run["notes"]), run["notes"]


def test_gpus_given_is_the_world_torchrun_starts_rank_zero_of(tmp_path: Path) -> None:
    script = tmp_path / "tp.py"
    script.write_text(TENSOR_PARALLEL)
    # torchrun's own launcher options (--standalone) are torchrun's; --gpus 4 over its 2 processes is the world.
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    run = preflight_run(script, "--gpus", "4", launcher=launcher)
    assert run["by_role"]["parameters"] == 2 * 1024 * 4096 * 4 // 4, run["by_role"]
    assert any("rank 0 of 4 GPUs" in n for n in run["notes"]), run["notes"]


#: A small transformer's blocks on a 2D mesh: tensor parallelism (with sequence parallelism
#: for the norms and a vocabulary-parallel loss) inside each pair of GPUs, FSDP across pairs.
TWO_D = """
import os
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module,
)

WIDTH, VOCAB, DEPTH = 512, 4096, 4

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.wide = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.narrow = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return x + self.narrow(F.gelu(self.wide(self.norm(x))))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
with torch.device("meta"):
    model = Model()
parallelize_module(model, mesh["tp"], {
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
})
for block in model.blocks:
    parallelize_module(block, mesh["tp"], {
        "norm": SequenceParallel(),
        "wide": ColwiseParallel(input_layouts=Shard(1)),
        "narrow": RowwiseParallel(output_layouts=Shard(1)),
    })
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
model.to_empty(device="cuda")
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    tokens = torch.randint(0, VOCAB, (4, 256), device="cuda")
    logits = model(tokens)
    with loss_parallel():
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    opt.zero_grad()
"""


def test_fsdp_and_tensor_parallel_on_a_2d_mesh_keep_one_shard_per_gpu(tmp_path: Path) -> None:
    script = tmp_path / "two_d.py"
    script.write_text(TWO_D)
    run = preflight_run(script, "--gpus", "8")
    width, vocab, depth = 512, 4096, 4
    # Every weight split eight ways (2 for tensor parallelism x 4 for FSDP), in float32;
    # the norms' weights (width each) split over FSDP's 4 only, as sequence parallelism replicates them.
    matrices = (2 * width * vocab + depth * 8 * width * width) * 4 // 8
    norms = depth * width * 4 // 4
    assert run["steps"] == 2, run
    assert abs(run["by_role"]["optimizer_state"] - 2 * (matrices + norms)) <= 2 * 512 * (2 + 3 * depth), run["by_role"]
    assert any("rank 0 of 8 GPUs" in n for n in run["notes"]), run["notes"]


#: Rank 0's stage of a pipeline: half the layers, run over eight micro-batches by a schedule
#: chosen on the command line.
PIPELINE = """
import os
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

WIDTH, LAYERS, BATCH, SEQ, MICRO = 512, 8, 16, 128, 8
dist.init_process_group("nccl")
rank, ranks = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
kind = sys.argv[1]
# Interleaved: each rank holds two stages, rank and rank + ranks (stage 0 and stage 2 on rank 0).
held = [rank, rank + ranks] if kind == "interleaved" else [rank]
count = len(held) * ranks
per_stage = LAYERS // count

def layer():
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

parts = [nn.Sequential(*[layer() for _ in range(per_stage)]).to(device) for _ in held]
stages = [PipelineStage(part, index, count, device) for part, index in zip(parts, held)]
loss = lambda out, target: (out - target).pow(2).mean()
if kind == "interleaved":
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=loss)
else:
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stages[0], n_microbatches=MICRO, loss_fn=loss)
opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
for _ in range(2):
    schedule.step(torch.randn(BATCH, SEQ, WIDTH, device=device))
    opt.step()
    opt.zero_grad()
"""


def test_pipeline_schedules_keep_the_micro_batches_they_hold_in_flight(tmp_path: Path) -> None:
    script = tmp_path / "pipeline.py"
    script.write_text(PIPELINE)
    width, micro_tokens = 512, 16 // 8 * 128
    layer_weights = (2 * width * 4 * width + 5 * width) * 4
    # What one layer keeps for its backward for one micro-batch: the first Linear's input,
    # GELU's input and the second Linear's input (GELU's output), in float32.
    kept = micro_tokens * (width + 4 * width + 4 * width) * 4
    runs = {kind: preflight_run(script, "--gpus", "2", args=(kind,)) for kind in ("gpipe", "1f1b", "interleaved")}
    for kind, run in runs.items():
        assert run["steps"] == 2, (kind, run)
        # Rank 0 holds its stages' layers alone: half the model.
        assert run["by_role"]["parameters"] == 4 * layer_weights, (kind, run["by_role"])
        assert any("pipeline parallelism: rank 0's stage(s)" in n for n in run["notes"]), run["notes"]
    # GPipe runs every micro-batch's forward before any backward: at its peak (the first
    # backward, its gradients made) rank 0 still holds seven of the eight.
    gpipe, one_f_one_b = runs["gpipe"]["by_role"], runs["1f1b"]["by_role"]
    assert gpipe["activations"] >= 6 * 4 * kept, gpipe
    # 1F1B's first stage starts its backwards after as many forwards as there are stages (two).
    assert 4 * kept <= one_f_one_b["activations"] <= 2.2 * 4 * kept, one_f_one_b
    # The interleaved schedule's second stage on rank 0 takes its inputs' shapes from what rank 0 sent.
    assert any("pipeline stage 2's inputs are taken" in n for n in runs["interleaved"]["notes"]), runs["interleaved"]["notes"]


#: DDP started by the script itself, one process per GPU, as PyTorch's DDP tutorials do.
SPAWNED = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

def work(rank, world, steps):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).to(rank)
    net = DistributedDataParallel(net, device_ids=[rank])
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(16, 1024, device=rank)).square().mean().backward()
        opt.step()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2, 3), nprocs=2, join=True)
"""


def test_processes_the_script_spawns_itself_run_rank_zero_here(tmp_path: Path) -> None:
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    run = preflight_run(script, "--gpus", "2")
    weights = (1024 * 2048 + 2048 + 2048 * 1024 + 1024) * 4
    assert run["steps"] == 2, run
    # DDP keeps the whole model on each GPU: the weights, their gradients and SGD's momentum.
    assert run["by_role"]["parameters"] == weights, run["by_role"]
    assert run["by_role"]["optimizer_state"] == weights, run["by_role"]
    assert any("starts 2 process(es) with torch.multiprocessing" in n and "rank 0 of 2" in n for n in run["notes"]), run["notes"]


#: A launcher other than torchrun (DeepSpeed's ``deepspeed --num_gpus N``, read there, here in this
#: project's words): it starts the training script once per GPU, each told its rank and the world
#: in its environment, and waits for them all.
LAUNCHER = """
import os, subprocess, sys

world = int(sys.argv[1])
procs = [
    subprocess.Popen([sys.executable, "-u", "sharded.py", f"--local_rank={rank}"], env=dict(
        os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29517"))
    for rank in range(world)
]
sys.exit(max(p.wait() for p in procs))
"""

#: Each rank's script: the optimizer's state sharded over the world (ZeRO stage 1), two equal layers.
SHARDED = """
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

dist.init_process_group("nccl")
torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda()
opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW)
for _ in range(3):
    net(torch.randn(16, 1024, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
print("RANK", dist.get_rank(), "OF", dist.get_world_size(), flush=True)
"""


def test_a_launcher_that_starts_each_rank_itself_is_measured_as_rank_zero_of_its_world(tmp_path: Path) -> None:
    (tmp_path / "sharded.py").write_text(SHARDED)
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    layer = (1024 * 1024 + 1024) * 4
    run = preflight_run(launcher, args=("2",), cwd=tmp_path)
    # Rank 0 of 2 keeps AdamW's two moments of one of the two layers; the other rank ran nothing.
    assert run["steps"] == 2 and run["by_role"]["optimizer_state"] == 2 * layer, run["by_role"]
    assert any(n.startswith("the command's launcher started the script as 2 ranks") for n in run["notes"]), run["notes"]
    # Given --gpus, that is the world: ZeRO gives each of 4 ranks one of the four tensors, rank 0 a weight.
    run = preflight_run(launcher, "--gpus", "4", args=("4",), cwd=tmp_path)
    assert run["by_role"]["optimizer_state"] == 2 * 1024 * 1024 * 4, run["by_role"]
    assert not any("launcher started" in n for n in run["notes"]) and any("rank 0 of 4 GPUs" in n for n in run["notes"]), run["notes"]


#: A script that counts the machine's GPUs and refuses fewer than it wants, as Lightning's ``devices=2`` does.
WANTS_TWO = """
import torch
if torch.cuda.device_count() < 2:
    raise RuntimeError("this script trains on 2 GPUs")
net = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    net(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_script_that_counts_more_gpus_than_the_machine_has_is_told_of_gpus(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(WANTS_TWO)
    p = subprocess.run([OOMKIT, "preflight", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "RuntimeError: this script trains on 2 GPUs" in last, p.stderr[-2000:]
    assert last.endswith("if the script asks for N, run it with --gpus N"), last
    assert preflight_run(script, "--gpus", "2")["steps"] == 2


#: Lightning's own DDP over the machine's GPUs: it counts them, and gives the loader a distributed sampler.
LIGHTNING_DDP = """
import torch
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(1024, 1024)

    def training_step(self, batch, _):
        (x,) = batch
        return self.body(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(256, 1024)), batch_size=32)
    trainer = L.Trainer(accelerator="gpu", devices=4, strategy="ddp", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), data)
"""


def test_lightning_ddp_over_the_machines_gpus_runs_as_rank_zero(tmp_path: Path) -> None:
    script = tmp_path / "lightning_ddp.py"
    script.write_text(LIGHTNING_DDP)
    run = preflight_run(script, "--gpus", "4")
    weights = (1024 * 1024 + 1024) * 4
    assert run["steps"] == 2, run
    assert run["by_role"]["parameters"] == weights, run["by_role"]
    # AdamW's two moments (its step counts on the host); each rank's batch is the loader's 32 rows.
    assert run["by_role"]["optimizer_state"] == 2 * weights, run["by_role"]
    assert run["by_role"]["inputs"] == 32 * 1024 * 4, run["by_role"]
    assert any("rank 0 of 4 GPUs" in n for n in run["notes"]), run["notes"]


#: Batch norm synchronised across the GPUs (``--sync-bn`` in detection and segmentation trainers).
SYNC_BATCH_NORM = """
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("nccl")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
net = DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(net).cuda(), device_ids=[rank])
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    net(torch.randn(8, 3, 32, 32, device="cuda")).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_batch_norm_synchronised_across_gpus_runs_its_cuda_only_operators(tmp_path: Path) -> None:
    run = _under_torchrun(tmp_path, "sync_bn.py", SYNC_BATCH_NORM)
    assert run["steps"] == 2, run
    # Blocks of 512 bytes: the convolution's 16 x 3 x 3 x 3 floats (1,728 bytes) in four; batch
    # norm's weight, bias, running mean and variance and its count of batches in one each.
    assert run["by_role"]["parameters"] == 4 * 512 + 5 * 512, run["by_role"]
    # The convolution's output, which the synchronised batch norm keeps for its backward.
    conv_out = 8 * 16 * 32 * 32 * 4
    assert conv_out <= run["by_role"]["activations"] < conv_out + 4096, run["by_role"]


#: A model split by hand over two GPUs in one process (the pattern of ``device_map``'s
#: placement and of the tutorials' model parallelism): each half on its GPU, the activation
#: sent across between them. With ``--gpus 1`` the same script puts both halves on one GPU.
SPREAD = """
import sys
import torch
from torch import nn

second = sys.argv[1]
first_half = nn.Linear(1024, 1024, bias=False).to("cuda:0")
second_half = nn.Linear(1024, 1024, bias=False).to(second)
opt = torch.optim.SGD([*first_half.parameters(), *second_half.parameters()], lr=0.1)
for _ in range(2):
    x = torch.randn(64, 1024, device="cuda:0")
    second_half(first_half(x).to(second)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""

#: A script for one GPU, which never looks at how many there are.
ONE_GPU = """
import torch
from torch import nn

model = nn.Linear(1024, 1024, bias=False).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(64, 1024, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_model_spread_over_gpus_in_one_process_is_said_to_be_measured_as_one(tmp_path: Path) -> None:
    script = tmp_path / "spread.py"
    script.write_text(SPREAD)
    weights = 2 * 1024 * 1024 * 4
    spread = preflight_run(script, "--gpus", "2", args=("cuda:1",))
    # Both halves are held on the one fake GPU: the figures are the two GPUs' together, and the note says so.
    assert spread["by_role"]["parameters"] == weights, spread["by_role"]
    assert any(n.startswith("the script put tensors on cuda:0, cuda:1 in one process") for n in spread["notes"]), spread["notes"]
    # No process group was made: nothing says it ran as rank 0.
    assert not any("rank 0 of" in n for n in spread["notes"]), spread["notes"]
    # The same figures as the script with both halves on one GPU, which gets no such note.
    together = preflight_run(script, args=("cuda:0",))
    assert together["peak_allocated_bytes"] == spread["peak_allocated_bytes"], (together, spread)
    assert not any("in one process" in n for n in together["notes"]), together["notes"]


def test_gpus_given_to_a_script_for_one_gpu_says_it_ran_on_one(tmp_path: Path) -> None:
    script = tmp_path / "one.py"
    script.write_text(ONE_GPU)
    run = preflight_run(script, "--gpus", "4")
    assert run["by_role"]["parameters"] == 1024 * 1024 * 4, run["by_role"]
    assert "--gpus 4: the script made no process group and started no process per GPU, so it ran on one GPU, as measured" in run["notes"]
    assert not any("rank 0 of" in n for n in run["notes"]), run["notes"]
