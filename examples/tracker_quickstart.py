"""The README's first example: a training loop with oomkit's tracker added.

Its evaluation keeps each validation loss with its autograd graph, a common
mistake, so memory grows every step; `oomkit analyze` on the run log names it.
Runs on CPU or on a GPU in a few seconds:

    python examples/tracker_quickstart.py
    oomkit analyze oomkit-logs/run-*.jsonl
"""

import torch

import oomkit

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = [torch.randn(64, 512, device=device) for _ in range(40)]
val_losses = []


def evaluate(model):
    x = torch.randn(1024, 512, device=device)
    val_losses.append(model(x).square().mean())  # the mistake: `.item()` would keep a float, not the graph


tracker = oomkit.Tracker(model, optimizer=opt, log_dir="oomkit-logs")
for i, batch in enumerate(loader):
    with tracker.step(i):                      # forward, backward and optimizer found by hooks
        loss = model(batch).square().mean()
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    with tracker.phase("eval"):                # any named phase, measured the same way
        evaluate(model)
tracker.close()                                # or: with oomkit.Tracker(...) as tracker:
print(tracker.log_path)                        # oomkit-logs/run-<time>-rank0.jsonl
