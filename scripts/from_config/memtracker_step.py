"""PyTorch's MemTracker on a full fine-tune of a config's model (bf16, checkpointed, fused AdamW),
two steps under FakeTensorMode, its way of running without a GPU; the fake tensors are on the CPU,
since fake CUDA tensors stop in autograd's engine without a driver.

    python memtracker_step.py MODEL_FOLDER SEQ
"""

import json
import sys
import time

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

start = time.perf_counter()
cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
seq = int(sys.argv[2])
with FakeTensorMode(), torch.device("cpu"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, 32000, (1, seq))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    for step in range(2):
        if step:
            tracker.reset_mod_stats()  # MemTracker measures one iteration at a time.
        with tracker:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    peak = max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
print(json.dumps({"peak_gib": round(peak / 2**30, 2), "seconds": round(time.perf_counter() - start, 2)}))
