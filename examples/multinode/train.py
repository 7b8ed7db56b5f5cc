"""A data-parallel training loop that survives an OOM on any rank, on any node.

Run it under torchrun (README, "Multi-GPU and multi-node"): NCCL on GPUs,
gloo on CPU. ``--oom-rank R --oom-above M`` plants a real OOM on rank R
whenever the micro-batch is above M, in the middle of a step while the other
ranks wait in DDP's gradient all-reduce, so the retry has to bring every rank
back on one smaller plan.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import oomkit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch-size", type=int, default=32, help="the micro-batch to start with")
parser.add_argument("--effective-batch", type=int, default=128, help="samples per optimizer step on each rank")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--log-dir", default="oomkit-logs")
parser.add_argument("--oom-rank", type=int, default=None, help="the rank that runs out of memory")
parser.add_argument("--oom-above", type=int, default=8, help="... whenever its micro-batch is above this")
args = parser.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

# After a restart, the plan every rank agreed on (a script would load its checkpoint here).
start = oomkit.current_plan()
if rank == 0 and start is not None:
    print(f"attempt {start.attempt}: micro-batch {start.micro_batch} x accumulation {start.grad_accum} ({start.source})", flush=True)

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256).to(device))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


@oomkit.auto_batch(batch_size=args.batch_size, effective_batch=args.effective_batch)
def train(micro_batch: int, grad_accum: int) -> int:
    with oomkit.Tracker(model.module, optimizer=opt, log_dir=args.log_dir) as tracker:
        for step in range(args.steps):
            with tracker.step(step):
                for _ in range(grad_accum):
                    x = torch.randn(micro_batch, 256, device=device)
                    if rank == args.oom_rank and micro_batch > args.oom_above and step == 1:
                        # A real allocator OOM, outside any oom_guard.
                        torch.empty(1 << 62, dtype=torch.uint8, device=device)
                    loss = model(x).square().mean() / grad_accum
                    loss.backward()  # DDP all-reduces the gradients here
                opt.step()
                opt.zero_grad(set_to_none=True)
    return micro_batch * grad_accum


samples = train()
if rank == 0:
    micro, accum = train.plan
    print(f"finished: every rank ran micro-batch {micro} x accumulation {accum} = {samples} samples per step", flush=True)
# Every rank's gloo work done before any rank tears its group down: a rank
# that exits while another still talks to it can abort at exit ("terminate
# called without an active exception").
dist.barrier()
dist.destroy_process_group()
# On a loaded machine gloo's threads can still abort the interpreter's own
# teardown ("terminate called without an active exception", exit -6) after
# the run has finished: the logs are closed and nothing is left to flush,
# so leave at once.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
