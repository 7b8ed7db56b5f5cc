"""Preflight with bitsandbytes: its 8-bit optimizer and 4-bit layers run on
meta tensors through the fake kernels bitsandbytes registers (0.46 and
later), and what they hold is counted as the library lays it out, checked
here against bitsandbytes' layout computed from the parameters' shapes."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import oomkit
import pytest
import torch
from preflight_cli import preflight_run
from torch import nn

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed for this Python")

OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")

#: bitsandbytes' rules, from ``Optimizer2State.init_state`` and ``quantize_4bit``:
#: tensors under MIN_8BIT elements keep fp32 state; 8-bit state has an fp32
#: scale per block of 256; NF4 weights pack two per byte with an fp32 scale per 64.
MIN_8BIT, STATE_BLOCK, NF4_BLOCK = 4096, 256, 64


def r512(n: int) -> int:
    """The caching allocator's rounding of a request."""
    return max(512, -(-n // 512) * 512)


def adam8bit_state_bytes(params: list[torch.Tensor]) -> int:
    """The bytes bitsandbytes' AdamW8bit asks for, as a trace's entries record requests."""
    total = 2 * 256 * 4  # the two quantization maps, shared by every tensor
    for p in params:
        n = p.numel()
        if n < MIN_8BIT:
            total += 2 * 4 * n
        else:
            total += 2 * n + 2 * 4 * math.ceil(n / STATE_BLOCK)
    return total


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2000, 256)
        self.layers = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256))
        self.head = nn.Linear(256, 2000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.layers(self.embed(x)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())


def test_8bit_adamw_holds_bitsandbytes_state(tmp_path: Path) -> None:
    snap = tmp_path / "adam8bit.pickle"
    answer = oomkit.preflight(
        Net, lambda b: torch.randint(0, 2000, (b, 128)), micro_batch=4, optimizer="adamw8bit", capacity="8GiB", snapshot=snap
    )
    with open(snap, "rb") as f:
        entries = pickle.load(f)["device_traces"][0]
    held = sum(e["size"] for e in entries if e["action"] == "alloc" and e.get("oomkit_role") == "optimizer_state")
    expected = adam8bit_state_bytes(list(Net().parameters()))
    assert held == expected, (held, expected)
    # A quarter of AdamW's fp32 moments, give or take the small tensors and scales.
    adamw = oomkit.preflight(Net, lambda b: torch.randint(0, 2000, (b, 128)), micro_batch=4, optimizer="adamw", capacity="8GiB")
    assert answer.peak_allocated_bytes < adamw.peak_allocated_bytes


LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 3000,
    "max_position_embeddings": 512,
}


def test_estimate_traces_qlora_with_nf4_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    args = ["estimate", "--config", str(config), "--batch", "2", "--seq", "128", "--gpu", "8GiB", "--trace", "--json"]
    p = subprocess.run([OOMKIT, *args, "--load-in-4bit", "--lora-rank", "8"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc.get("traced_error") is None, doc.get("traced_error")
    # What bitsandbytes keeps for the model: every linear layer but the head
    # packed two weights a byte with an fp32 scale per 64 (and a 16-entry
    # code book), the rest in bf16, and PEFT's adapters on q, k, v and o in fp32 (it keeps them so).
    cfg = transformers.AutoConfig.for_model("llama", **{k: v for k, v in LLAMA.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    expected = 0
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            n = param.numel()
            if isinstance(module, nn.Linear) and name != "lm_head" and pname == "weight":
                expected += r512(math.ceil(n / 2)) + r512(4 * math.ceil(n / NF4_BLOCK)) + r512(16 * 4)
            else:
                expected += r512(2 * n)
        if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            expected += r512(4 * 8 * module.in_features) + r512(4 * 8 * module.out_features)
    held = doc["traced"]["by_role"]["parameters"]
    assert abs(held - expected) / expected < 0.01, (held, expected)
    # Against the same model unquantized: NF4 keeps well under half the weights.
    p = subprocess.run([OOMKIT, *args, "--lora-rank", "8"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    full = json.loads(p.stdout)["traced"]["by_role"]["parameters"]
    assert held < 0.75 * full, (held, full)


SCRIPT = """
import torch, bitsandbytes as bnb
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 512)
        self.up = bnb.nn.Linear4bit(512, 2048, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        self.down = bnb.nn.Linear4bit(2048, 512, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        self.a, self.b = nn.Linear(512, 8, bias=False), nn.Linear(8, 512, bias=False)
        self.head = nn.Linear(512, 1000)

    def forward(self, x):
        h = self.embed(x)
        h = self.down(self.up(h.bfloat16())).float() + self.b(self.a(h))
        return self.head(h)

model = M().cuda()
model.embed.requires_grad_(False)
model.head.requires_grad_(False)
opt = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad])
for _ in range(3):
    x = torch.randint(0, 1000, (4, 128), device="cuda")
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_script_with_4bit_layers_is_measured_quantized(tmp_path: Path) -> None:
    script = tmp_path / "qlora.py"
    script.write_text(SCRIPT)
    run = preflight_run(script, "--capacity", "8GiB", cwd=tmp_path)
    # Moving a Linear4bit to the GPU quantizes it, on meta as on CUDA: the two
    # layers hold half a byte a weight (with double-quantized scales, the
    # default of Linear4bit), not the fp32 they were built in.
    fp32 = 4 * (1000 * 512 + 1000 * 512 + 1000) + 4 * 8 * 512 * 2
    packed = 2 * r512(512 * 2048 // 2)
    held = run["by_role"]["parameters"]
    assert fp32 + packed <= held < fp32 + packed + 64 * 1024, (held, fp32 + packed)
    # The line is the user's move to the GPU, not bitsandbytes' own (which may follow it, as the library beneath).
    lines = [x["line"] for x in run["by_line"] if x["role"] == "parameters"]
    assert lines and all(line.startswith("qlora.py:") for line in lines), lines
    assert not any("bitsandbytes" in line.split(", in ")[0] for line in lines), lines


INT8 = """
import bitsandbytes as bnb
import torch
from torch import nn

# LLM.int8 inference: 8-bit weights, the input's outlier columns (above 6.0) held back in 16 bits.
model = nn.Sequential(bnb.nn.Linear8bitLt(1024, 4096, has_fp16_weights=False, threshold=6.0),
                      bnb.nn.Linear8bitLt(4096, 1024, has_fp16_weights=False, threshold=6.0)).half().cuda()
with torch.no_grad():
    out = model(torch.randn(8, 256, 1024, device="cuda", dtype=torch.float16))
print(float(out.float().abs().mean()))
"""


def test_8bit_layers_with_outlier_columns_run_and_say_the_outliers_are_taken_as_none(tmp_path: Path) -> None:
    script = tmp_path / "int8.py"
    script.write_text(INT8)
    run = preflight_run(script, "--capacity", "8GiB", cwd=tmp_path)
    assert run["mode"] == "inference", run["mode"]
    # Moved to the GPU, each layer's weight is quantized to a byte a weight beside its fp16 bias, as CUDA holds them.
    assert run["by_role"]["parameters"] == 2 * r512(1024 * 4096) + r512(2 * 4096) + r512(2 * 1024), run["by_role"]
    assert any(n.startswith("bitsandbytes' 8-bit layers (LLM.int8, threshold above 0) hold back the input's outlier columns") for n in run["notes"]), run["notes"]


PAGED = """
import bitsandbytes as bnb
import torch
from torch import nn

# The embedding's 2,048,000 elements are paged (100,000 or more); the small Linear's are not
# (the head is not optimized).
model = nn.Sequential(nn.Embedding(8000, 256), nn.Linear(256, 256), nn.Linear(256, 8000)).cuda()
small = list(model[1].parameters())
opt = bnb.optim.PagedAdamW8bit([{"params": model[0].parameters()}, {"params": small}])
for _ in range(2):
    x = torch.randint(0, 8000, (4, 64), device="cuda")
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_paged_optimizer_keeps_its_large_state_in_unified_memory_outside_the_gpu_figures(tmp_path: Path) -> None:
    # Without the stand-ins, bitsandbytes' native library exits the process (no driver).
    script = tmp_path / "paged.py"
    script.write_text(PAGED)
    run = preflight_run(script, "--capacity", "8GiB", "--steps", "2", cwd=tmp_path)
    assert run["steps"] == 2, run
    # bitsandbytes pages state1 and state2, a byte an element each, for tensors of 100,000
    # elements or more (get_state_buffer); the scales (absmax) stay device memory.
    embedding = 8000 * 256
    assert run["host_paged_peak_bytes"] == 2 * embedding, run
    assert run["host_peak_bytes"] == 0, run
    # What stays on the GPU is the small Linear's 8-bit state (its bias's fp32) and the
    # scales, maps and step counters: far less than the embedding's 4 MB.
    small = [torch.empty(256, 256), torch.empty(256)]
    on_gpu = run["by_role"]["optimizer_state"]
    assert adam8bit_state_bytes(small) <= on_gpu < adam8bit_state_bytes(small) + 2 * 4 * math.ceil(embedding / STATE_BLOCK) + 64 * 1024, run
