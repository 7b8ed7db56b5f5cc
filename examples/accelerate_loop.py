"""oomkit inside an accelerate loop: the tracker on the prepared model, and `auto_batch` keeping accelerate's accumulation in step.

The example of docs/tracker.md; runs on CPU in a few seconds:

    python examples/accelerate_loop.py
"""

import torch, oomkit
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
data = TensorDataset(torch.randn(64, 32), torch.randn(64, 1))

@oomkit.auto_batch(batch_size=16, effective_batch=32, accelerator=accelerator)
def train(micro_batch, grad_accum):        # accelerator.gradient_accumulation_steps == grad_accum here
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.AdamW(model.parameters())
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=micro_batch))
    with oomkit.Tracker(model, optimizer=opt, log_dir="oomkit-logs") as tracker:
        for i, (x, y) in enumerate(loader):
            with accelerator.accumulate(model), tracker.step(i):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step(); opt.zero_grad()

train()
print(train.plan)                          # (16, 2): nothing ran out
