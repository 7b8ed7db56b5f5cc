"""What ``accelerate estimate-memory`` computes for a config: the model built empty, its float32
size, and its training row (Adam: weights, gradients and two moments, 4x the float32 size; half
of that for bf16 mixed precision's largest term). The command itself asks the hub first, so it
cannot run from a folder.

    python accelerate_sizes.py MODEL_FOLDER
"""

import json
import sys
import time

start = time.perf_counter()
import transformers  # noqa: E402 - its import is part of what the command costs
from accelerate import init_empty_weights  # noqa: E402
from accelerate.utils import calculate_maximum_sizes  # noqa: E402

cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
with init_empty_weights():
    model = transformers.AutoModelForCausalLM.from_config(cfg)
total, _ = calculate_maximum_sizes(model)
out = {"fp32_weights_gib": total / 2**30, "fp32_training_gib": 4 * total / 2**30, "bf16_training_gib": 2 * total / 2**30}
print(json.dumps({k: round(v, 2) for k, v in out.items()} | {"seconds": round(time.perf_counter() - start, 2)}))
