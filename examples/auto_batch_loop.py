"""`oomkit.auto_batch`: a training function tried again with a smaller micro-batch and more accumulation after an OOM.

The example of docs/tracker.md. Its model runs out of memory whenever its
micro-batch is above 16 (a real allocator failure, planted by
`planted.huge`), so the tries at 64 and 32 fail and the third, 16 x 16,
keeps the effective batch of 256. Runs on CPU in a second:

    python examples/auto_batch_loop.py

Under torchrun, every rank steps down together and `sync_gradients`
all-reduces the gradients after the guarded block.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import oomkit
from planted import huge

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(1024, 32), torch.randn(1024, 1))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(32, 1)

    def forward(self, x, y):
        if len(x) > 16:
            huge()  # the planted OOM: this model runs out of memory above 16 samples
        return torch.nn.functional.mse_loss(self.net(x), y)


model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def sync_gradients():
    if dist.is_initialized():
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@oomkit.auto_batch(batch_size=64, effective_batch=256)
def train(micro_batch, grad_accum):
    loader = DataLoader(dataset, batch_size=micro_batch)
    for i, (x, y) in enumerate(loader):
        with oomkit.oom_guard():            # all ranks agree here on an OOM
            loss = model(x, y) / grad_accum
            loss.backward()
        if (i + 1) % grad_accum == 0:
            sync_gradients()                # collectives after the guard
            opt.step(); opt.zero_grad(set_to_none=True)

train()
print(train.plan)      # (16, 16) after two OOMs: 16 x 16 = 256 samples per step
