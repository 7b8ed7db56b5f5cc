"""The tracker driven by hand, as a framework's callbacks drive it: docs/tracker.md.

`stage_hooks=False` turns the automatic stage hooks off, so that the caller
marks the stages; then the run log is read back with `oomkit.analyze`.
Runs on CPU in a second:

    python examples/manual_stages.py
"""

import torch, oomkit

model = torch.nn.Linear(64, 10)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tracker = oomkit.Tracker(model, optimizer=opt, log_dir="oomkit-logs", stage_hooks=False)
for i in range(3):
    tracker.begin_step(i)
    tracker.begin_stage("forward")
    loss = model(torch.randn(8, 64)).square().mean()
    tracker.begin_stage("backward")             # ends the forward stage
    loss.backward()
    tracker.begin_stage("optimizer")
    opt.step(); opt.zero_grad(set_to_none=True)
    tracker.end_step()                          # ends the open stage too
tracker.begin_phase("eval"); tracker.end_phase()
tracker.close()

result = oomkit.analyze(tracker.log_path)
leaks = [f for f in result["findings"] if f["kind"] == "leak"]
print(f"{result['steps']} steps, stages {[s['name'] for s in result['stages']]}, {len(leaks)} leaks")
