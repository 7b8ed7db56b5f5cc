"""oomkit.preflight: a training step run on tensors without memory, checked
against PyTorch's own MemTracker, the allocator model's replay and the
kernels CUDA would choose."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from typing import Any

import oomkit
import pytest
import torch
import torch.nn.functional as F
from oomkit import preflight
from preflight_cli import preflight_run
from torch import nn

OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")
VOCAB, DIM, HEADS, LAYERS, CTX = 1024, 256, 4, 3, 256


class Block(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS)
            y = att.softmax(-1) @ v
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, sdpa: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(*[Block(sdpa) for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.blocks(self.embed(x))).flatten(0, 1), y.flatten())


def tokens(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (b, CTX), device="cuda"), torch.randint(0, VOCAB, (b, CTX), device="cuda")


def memtracker_peak(micro_batch: int) -> int:
    """PyTorch's own count of the same step on meta tensors (no allocator, no rounding)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with torch.device("meta"):
        model = LM(sdpa=False)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        for _ in range(2):
            x = torch.randint(0, VOCAB, (micro_batch, CTX), device="meta")
            y = torch.randint(0, VOCAB, (micro_batch, CTX), device="meta")
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x, y
            # MemTracker keeps per-module figures one iteration at a time; its device peak stays.
            mt.reset_mod_stats()
    return int(mt.get_tracker_snapshot("peak")[torch.device("meta")]["Total"])


def test_the_peak_agrees_with_pytorchs_memtracker() -> None:
    r = preflight(lambda: LM(sdpa=False), tokens, micro_batch=8, capacity="80GiB")
    theirs = memtracker_peak(8)
    # Ours counts every tensor as the block the allocator hands it (rounded
    # to 512 bytes at least), and adds cuBLAS's two workspaces, the forward's
    # and the backward thread's ("other"); the rest must be the same tensors.
    ours = sum(b for role, b in r.by_role.items() if role != "other")
    assert abs(ours - theirs) / theirs < 0.01, (ours, theirs)
    assert r.by_role["other"] == 2 * (32 << 20)
    # The allocator's blocks: at least what was live, never far above it.
    assert r.peak_allocated_bytes >= theirs
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes


def test_roles_are_known_exactly() -> None:
    r = preflight(LM, tokens, micro_batch=8, capacity="80GiB", steps=2)
    params = sum(p.numel() for p in LM(sdpa=True).parameters()) * 4
    # Every parameter tensor is live at the peak, rounded to 512-byte blocks.
    assert params <= r.by_role["parameters"] <= params + 512 * 64
    # AdamW's two moments per parameter (its step counters live on the CPU).
    assert 2 * params <= r.by_role["optimizer_state"] <= 2 * params + 512 * 128
    assert r.by_role["activations"] > r.by_role["temporaries"]
    assert r.by_line and r.by_line[0]["line"].startswith(os.path.relpath(__file__))
    # Each step's own peak: the second holds AdamW's moments, which the first makes only at its end.
    first, second = r.step_peaks
    assert second == r.peak_allocated_bytes and second - first >= 2 * params, r.step_peaks


def test_the_snapshot_is_pytorchs_format_and_the_allocator_replay_agrees(tmp_path) -> None:
    path = tmp_path / "pre.pickle"
    r = preflight(LM, tokens, micro_batch=4, snapshot=path)
    assert r.snapshot == str(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["oomkit_preflight"]["micro_batch"] == 4
    entries = snap["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert len(allocs) == r.allocations
    assert {e["oomkit_role"] for e in allocs} >= {"parameters", "activations", "optimizer_state", "gradients"}
    assert all(e["frames"] for e in allocs)
    assert sum(s["total_size"] for s in snap["segments"]) <= r.peak_reserved_bytes
    # The replay of the written trace makes exactly the segments it records.
    out = subprocess.run([OOMKIT, "whatif", str(path), "--json"], capture_output=True, text=True, check=True)
    agreement = json.loads(out.stdout)["devices"][0]["agreement"]
    assert agreement["share"] == 1.0 and agreement["placed_at_recorded_address"] == 1.0, agreement
    assert json.loads(out.stdout)["devices"][0]["scenarios"][0]["peak_reserved_bytes"] == r.peak_reserved_bytes
    analyzed = subprocess.run([OOMKIT, "analyze", str(path)], capture_output=True, text=True)
    assert analyzed.returncode == 0, analyzed.stderr
    # Never overwritten.
    with pytest.raises(oomkit.PreflightError, match="exists"):
        preflight(LM, tokens, micro_batch=4, snapshot=path)


def test_autocast_and_cudas_attention_kernels_change_what_is_saved() -> None:
    plain = preflight(LM, tokens, micro_batch=8)
    half = preflight(LM, tokens, micro_batch=8, autocast=torch.bfloat16)
    assert half.by_role["activations"] < 0.75 * plain.by_role["activations"]
    # Without flash and memory-efficient attention, the math path keeps the
    # attention matrix (batch x heads x ctx x ctx) of every layer for backward.
    flash = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        math_path = preflight(LM, tokens, micro_batch=8, autocast=torch.bfloat16)
    finally:
        torch.backends.cuda.enable_flash_sdp(flash[0])
        torch.backends.cuda.enable_mem_efficient_sdp(flash[1])
    matrix = 8 * HEADS * CTX * CTX * 2
    assert math_path.by_role["activations"] - half.by_role["activations"] >= LAYERS * matrix


class GroupedAttention(torch.nn.Module):
    """Grouped-query attention (Llama 3's shape of it): 32 query heads share 8 key-value heads."""

    def __init__(self, width: int = 1024, heads: int = 32, groups: int = 8) -> None:
        super().__init__()
        self.heads, self.groups, self.size = heads, groups, width // heads
        self.q = torch.nn.Linear(width, width, bias=False)
        self.kv = torch.nn.Linear(width, 2 * groups * self.size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.size).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.groups, self.size).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, -1)


def test_grouped_query_attention_takes_the_flash_kernel_without_the_attention_matrix() -> None:
    # CUDA's flash and memory-efficient kernels take grouped keys as they are (sdp_utils.cpp's
    # check_batch_size_and_num_heads_dense with grouped-query support): no matrix of 4096 x 4096 per head.
    seq = 4096
    batch = lambda b: torch.randn(b, seq, 1024)  # noqa: E731
    flash = preflight(GroupedAttention, batch, micro_batch=1, autocast=torch.bfloat16, capacity="80GiB")
    matrix = 32 * seq * seq * 2
    assert flash.by_role["activations"] < matrix / 8, flash.by_role
    # The math path, as CUDA takes it with both kernels switched off, holds it.
    switched = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        math_path = preflight(GroupedAttention, batch, micro_batch=1, autocast=torch.bfloat16, capacity="80GiB")
    finally:
        torch.backends.cuda.enable_flash_sdp(switched[0])
        torch.backends.cuda.enable_mem_efficient_sdp(switched[1])
    assert math_path.by_role["activations"] - flash.by_role["activations"] >= matrix, (math_path.by_role, flash.by_role)


def test_the_largest_micro_batch_fits_and_the_next_does_not() -> None:
    r = preflight(LM, tokens, micro_batch=4, grad_accum=8, capacity="300MiB", max_micro_batch=64)
    best = r.largest_micro_batch
    assert best is not None and 4 <= best < 64
    assert r.largest_grad_accum == math.ceil(32 / best)
    tried = dict(r.tried)
    assert tried[best] and not tried[best + 1]
    assert not preflight(LM, tokens, micro_batch=best + 1, grad_accum=8, capacity="300MiB").fits


def test_a_model_instance_is_copied_without_its_weights() -> None:
    model = LM()
    before = model.head.weight.detach().clone()
    # A batch on the CPU, as a data loader gives it: preflight moves it as the loop would.
    batch = (torch.randint(0, VOCAB, (2, CTX)), torch.randint(0, VOCAB, (2, CTX)))
    r = preflight(model, batch, capacity="80GiB")
    assert r.fits
    assert model.head.weight.device.type == "cpu" and torch.equal(model.head.weight, before)


def test_bad_settings_and_steps_that_need_data_get_one_line() -> None:
    with pytest.raises(oomkit.PreflightError, match="B300"):
        preflight(LM, tokens, micro_batch=2, capacity="B300")
    with pytest.raises(oomkit.PreflightError, match="expandable_segments"):
        preflight(LM, tokens, micro_batch=2, alloc_conf="expandable_segments:maybe")
    with pytest.raises(oomkit.PreflightError, match="micro_batch"):
        preflight(LM, tokens)

    def select(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = data
        counts = torch.bincount(y.flatten())  # its shape depends on the values, with no largest
        return model(x, y) + counts.sum()

    with pytest.raises(oomkit.PreflightError) as e:
        preflight(LM, tokens, micro_batch=2, loss=select)
    assert "bincount" in str(e.value) and "test_preflight.py" in str(e.value)
    assert "\n" not in str(e.value)

    def logged(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        value = model(*data)
        if value.item() > 100:  # a value without data: taken as 0, and said
            raise AssertionError("unreachable")
        return value

    r = preflight(LM, tokens, micro_batch=2, loss=logged)
    assert any("taken as 0" in n for n in r.notes), r.notes


def test_hugging_face_model_from_its_config() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=256)

    def batch(b: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1000, (b, 256))
        return {"input_ids": ids, "labels": ids}

    r = preflight(lambda: transformers.GPT2LMHeadModel(config), batch, micro_batch=4, autocast=torch.bfloat16)
    params = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters()) * 4
    assert r.by_role["parameters"] >= params
    assert r.by_role["activations"] > 0 and r.fits


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "preflight", "train.py")
SMALL = ["--ctx", "256", "--dim", "128", "--heads", "4", "--layers", "2", "--steps", "5"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OOMKIT, "preflight", *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_cli_runs_an_unchanged_cuda_script_and_searches_the_batch(tmp_path) -> None:
    snap = tmp_path / "pre.pickle"
    p = cli(
        "--json", "--capacity", "1GiB", "--micro-batch", "2", "--max-micro-batch", "64", "--snapshot", str(snap),
        "--", sys.executable, EXAMPLE, "--batch-size", "{batch}", *SMALL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)  # the script's own prints went to stderr
    assert "parameters, batch 2 x 256 tokens" in p.stderr
    run = doc["run"]
    assert run["micro_batch"] == 2 and run["fits"] and run["steps"] == 2
    assert run["by_role"]["parameters"] > 0 and run["by_role"]["optimizer_state"] >= 2 * run["by_role"]["parameters"] - 512 * 64
    best = doc["largest_micro_batch"]
    tried = dict(doc["tried"])
    assert tried[best] and not tried[best + 1], doc["tried"]
    assert run["snapshot"] == str(snap) and snap.exists()
    # The snapshot is the first micro-batch's, and the allocator replay agrees with it.
    out = subprocess.run([OOMKIT, "whatif", str(snap), "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["devices"][0]["agreement"]["share"] == 1.0
    # The text form says the same.
    text = cli("--capacity", "1GiB", "--", sys.executable, EXAMPLE, "--batch-size", "2", *SMALL)
    assert text.returncode == 0 and "fits 1GiB" in text.stdout and "By role at the peak" in text.stdout


AUTOCAST_SCRIPT = """
import sys, torch
from torch import nn
def mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(4)])
model = mlp().cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    x = torch.randn(2048, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=sys.argv[1] == "bf16"):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_the_cli_runs_a_scripts_autocast_as_the_python_api_does(tmp_path) -> None:
    # The CLI once let CUDA's own autocast back in, which never casts meta
    # tensors: every script's autocast step was measured in float32.
    script = tmp_path / "autocast_train.py"
    script.write_text(AUTOCAST_SCRIPT)
    scope: dict[str, Any] = {}
    exec(AUTOCAST_SCRIPT.split("model =")[0], scope)
    for precision, autocast in (("bf16", torch.bfloat16), ("fp32", None)):
        run = preflight_run(script, args=(precision,))
        api = preflight(
            scope["mlp"], lambda b: torch.randn(b, 512, device="cuda"), micro_batch=2048, autocast=autocast,
            loss=lambda m, x: m(x).float().square().mean(),
        )  # fmt: skip
        assert run["by_role"]["activations"] == pytest.approx(api.by_role["activations"], rel=0.001), precision
        assert run["peak_allocated_bytes"] == pytest.approx(api.peak_allocated_bytes, rel=0.01), precision
        if autocast is not None:
            half = run["by_role"]["activations"]
    # What each layer keeps for backward is bfloat16, half of float32's, beside
    # the bfloat16 copies of the weights that autocast casts and backward keeps.
    assert half < 0.7 * run["by_role"]["activations"]


FOREACH_SCRIPT = """
import sys, torch
from torch import nn
foreach = {"default": None, "foreach": True}[sys.argv[1]]
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
for _ in range(2):
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_a_scripts_optimizer_and_clipping_take_the_foreach_kernels_cuda_defaults_to(tmp_path) -> None:
    # On CUDA, foreach=None means foreach=True (the update holds a temporary
    # for every parameter at once); on meta PyTorch would pick the loop.
    script = tmp_path / "foreach_train.py"
    script.write_text(FOREACH_SCRIPT)
    default, explicit = (preflight_run(script, args=(how,)) for how in ("default", "foreach"))
    assert default["peak_allocated_bytes"] == explicit["peak_allocated_bytes"]
    assert default["by_role"] == explicit["by_role"]
    # At the peak (the update), the temporaries are a parameter-sized set at least.
    assert default["by_role"]["temporaries"] >= default["by_role"]["parameters"]


DEFAULT_DEVICE_SCRIPT = """
import sys, torch
from torch import nn
how = sys.argv[1]
if how == "set_default_device":
    torch.set_default_device("cuda")
def build():
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
if how == "with_device":
    with torch.device("cuda"):
        model = build()
else:
    model = build() if how == "set_default_device" else build().cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    x = torch.randn(256, 1024) if how == "set_default_device" else torch.randn(256, 1024, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_cuda_as_the_default_device_is_the_gpu_too(tmp_path) -> None:
    # torch.set_default_device("cuda") puts its mode below preflight's; its
    # tensors once went to a real CUDA device and the script failed.
    script = tmp_path / "default_device.py"
    script.write_text(DEFAULT_DEVICE_SCRIPT)
    runs = {how: preflight_run(script, args=(how,)) for how in ("explicit", "set_default_device", "with_device")}
    for how, run in runs.items():
        assert run["peak_allocated_bytes"] == runs["explicit"]["peak_allocated_bytes"], how
        assert run["by_role"] == runs["explicit"]["by_role"], how


MEMORY_QUERIES_SCRIPT = """
import json, sys, torch
from torch import nn
out, dump, fraction = sys.argv[1], sys.argv[2], float(sys.argv[3])
torch.cuda.memory._record_memory_history(max_entries=100000)
if fraction < 1:
    torch.cuda.set_per_process_memory_fraction(fraction)
seen = {}
with torch.cuda.device(0):  # what a checkpoint's code asks of the GPU, answered
    seen["rng"] = len(torch.cuda.get_rng_state())
model = nn.Linear(1024, 1024, bias=False).cuda()  # 4 MiB
seen["built"] = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved()]
opt = torch.optim.SGD(model.parameters())
for step in range(2):
    x = torch.randn(256, 1024, device="cuda")  # 1 MiB
    big = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.reset_peak_memory_stats()
    seen[f"reset{step}"] = [torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()]
    model(x).square().mean().backward()
    stats = torch.cuda.memory_stats()
    seen[f"backward{step}"] = [torch.cuda.memory_allocated(), stats["allocated_bytes.all.current"], torch.cuda.max_memory_reserved(),
                               stats["num_alloc_retries"], stats["num_ooms"]]
    with open(out, "w") as f:
        json.dump(seen, f)
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.memory._dump_snapshot(dump)
"""


def test_a_scripts_own_memory_queries_get_the_allocators_figures(tmp_path) -> None:
    script = tmp_path / "queries.py"
    script.write_text(MEMORY_QUERIES_SCRIPT)
    seen_path, dump = tmp_path / "seen.json", tmp_path / "own.pickle"
    run = preflight_run(script, "--capacity", "1GiB", args=(str(seen_path), str(dump), "1"))
    seen = json.loads(seen_path.read_text())
    mib = 1 << 20
    # The 4 MiB weight, in a 20 MiB segment (kLargeBuffer, for requests of 1-10 MiB).
    assert seen["built"] == [4 * mib, 20 * mib] and seen["rng"] == 16
    # After the reset the 128 MiB freed before it is no longer the peak (what is
    # held then: the weight, its gradient, cuBLAS's two workspaces of 32 MiB).
    for step in (0, 1):
        now, peak = seen[f"reset{step}"]
        assert now == peak and peak < 128 * mib, seen
        allocated, from_stats, _, retries, ooms = seen[f"backward{step}"]
        assert allocated == from_stats and retries == ooms == 0
    # The script's figures are the report's: its peak reserved is the run's.
    assert seen["backward1"][2] <= run["peak_reserved_bytes"]
    assert not dump.exists()
    assert any("_record_memory_history() and _dump_snapshot() did nothing" in n for n in run["notes"])
    # The script's share of the GPU is what the answer is against.
    half = preflight_run(script, "--capacity", "1GiB", args=(str(seen_path), str(dump), "0.5"))
    assert half["capacity_bytes"] == 512 * mib and run["capacity_bytes"] == 1024 * mib
    assert any("set_per_process_memory_fraction(0.5)" in n for n in half["notes"])
    tight = cli("--json", "--no-fixes", "--capacity", "1GiB", "--", sys.executable, str(script), str(seen_path), str(dump), "0.05")
    assert tight.returncode == 5, tight.stderr
    assert json.loads(tight.stdout)["run"]["fits"] is False
    # The script's own counters saw the 128 MiB fail, after releasing the cache and retrying.
    _, _, _, retries, ooms = json.loads(seen_path.read_text())["backward0"]
    assert retries >= 1 and ooms >= 1


TRACKED_SCRIPT = """
import contextlib, sys, torch, oomkit
from torch import nn
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters())
tracker = oomkit.Tracker(model, optimizer=opt, log_dir=sys.argv[1]) if sys.argv[2] == "tracked" else None
for i in range(3):
    with tracker.step(i) if tracker else contextlib.nullcontext():
        model(torch.randn(512, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""


def test_a_tracker_in_the_script_changes_nothing_and_leaves_no_run_log(tmp_path) -> None:
    script, logs = tmp_path / "tracked.py", tmp_path / "logs"
    script.write_text(TRACKED_SCRIPT)
    tracked = preflight_run(script, args=(str(logs), "tracked"))
    plain = preflight_run(script, args=(str(logs), "plain"))
    assert tracked["peak_allocated_bytes"] == plain["peak_allocated_bytes"]
    assert tracked["by_role"] == plain["by_role"]
    # A log of a run that never ran on a GPU would read as one that did.
    assert not logs.exists()
    assert any("its run log was not kept" in n for n in tracked["notes"])


ACCELERATOR_SCRIPT = """
import json, sys, torch
from torch import nn
# PyTorch's device-agnostic API, as pytorch/examples now write it; a CPU build has no accelerator.
device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
torch.accelerator.set_device_index(0)
model = nn.Linear(1024, 1024, bias=False).to(device)  # 4 MiB
seen = [str(device), torch.accelerator.device_count(), torch.accelerator.memory_allocated()]
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(256, 1024).to(device)).square().mean().backward()
    torch.accelerator.synchronize()
    seen.append(torch.accelerator.max_memory_reserved())
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
    opt.step()
    opt.zero_grad()
"""


def test_a_script_written_for_torch_accelerator_runs_on_the_gpu(tmp_path) -> None:
    script, seen_path = tmp_path / "accelerator.py", tmp_path / "seen.json"
    script.write_text(ACCELERATOR_SCRIPT)
    run = preflight_run(script, args=(str(seen_path),))
    seen = json.loads(seen_path.read_text())
    assert seen[:3] == ["cuda", 1, 4 << 20]
    assert run["by_role"]["parameters"] == 4 << 20 and run["by_role"]["optimizer_state"] >= 8 << 20
    assert 0 < seen[3] <= seen[4] <= run["peak_reserved_bytes"]


MANUAL_UPDATE_SCRIPT = """
import sys, torch
from torch import nn
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1) if sys.argv[1] == "optim" else None
for step in range(5):
    model.zero_grad(set_to_none=True)
    model(torch.randn(512, 1024, device="cuda")).square().mean().backward()
    if opt is not None:
        opt.step()
    else:
        # As pytorch/examples' word_language_model updates its weights.
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
"""


def test_a_loop_that_updates_its_weights_itself_is_measured_by_its_backward_passes(tmp_path) -> None:
    script = tmp_path / "manual.py"
    script.write_text(MANUAL_UPDATE_SCRIPT)
    manual, optim = preflight_run(script, args=("manual",)), preflight_run(script, args=("optim",))
    assert manual["steps"] == optim["steps"] == 2
    # Plain SGD updates in place as the loop does: the same memory.
    assert manual["peak_allocated_bytes"] == optim["peak_allocated_bytes"]
    # (the loss's 512-byte block may fall to activations or temporaries, by where the step's phases split)
    assert all(abs(manual["by_role"][r] - optim["by_role"][r]) <= 512 for r in optim["by_role"]), (manual["by_role"], optim["by_role"])
    assert any("uses no torch.optim optimizer" in n for n in manual["notes"])
    assert not any("uses no torch.optim optimizer" in n for n in optim["notes"])


ALLOC_CONF_SCRIPT = """
import os, sys
if sys.argv[1] != "-":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = sys.argv[1]  # before torch, as scripts set it
import torch
from torch import nn
model = nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters())
for step in range(2):
    model(torch.randn(64, 1024, device="cuda")).sum().backward()
    scratch = torch.empty((24 + 16 * step) << 20, dtype=torch.uint8, device="cuda")  # a growing buffer
    del scratch
    opt.step()
"""


def test_the_scripts_own_allocator_settings_are_modelled(tmp_path) -> None:
    script = tmp_path / "conf.py"
    script.write_text(ALLOC_CONF_SCRIPT)
    default = preflight_run(script, args=("-",))
    own = preflight_run(script, args=("expandable_segments:True",))
    given = preflight_run(script, "--alloc-conf", "expandable_segments:True", args=("-",))
    # A growing buffer takes a new segment each time, unless segments expand.
    assert own["peak_reserved_bytes"] == given["peak_reserved_bytes"] < default["peak_reserved_bytes"]
    assert any("sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in n for n in own["notes"])
    # --alloc-conf wins over what the script sets.
    overridden = preflight_run(script, "--alloc-conf", "expandable_segments:False", args=("expandable_segments:True",))
    assert overridden["peak_reserved_bytes"] == default["peak_reserved_bytes"]
    p = cli("--", sys.executable, str(script), "bogus:1")
    assert p.returncode == 2 and 'unknown setting "bogus"' in p.stderr and "conf.py:10 (<module>)" in p.stderr, p.stderr


def test_the_cli_says_when_it_does_not_fit_and_when_it_cannot_answer(tmp_path) -> None:
    p = cli("--capacity", "20MiB", "--", sys.executable, EXAMPLE, "--batch-size", "4", *SMALL)
    assert p.returncode == 5 and "does NOT fit 20MiB" in p.stdout
    # What would make it fit follows, as a table of the changes each run on the script.
    assert "What would make it fit, each change run on the script (peaks against 20.0 MiB):" in p.stdout, p.stdout
    assert "\n  all of the above " in p.stdout, p.stdout
    never = tmp_path / "never.py"
    never.write_text("import torch\nx = torch.zeros(4, device='cuda')\nprint('no training here')\n")
    p = cli("--", sys.executable, str(never))
    assert p.returncode == 2 and "the script ended before its model's first forward" in p.stderr
    needs_data = tmp_path / "needs_data.py"
    needs_data.write_text(
        "import torch\nm = torch.nn.Linear(4, 4).cuda()\nopt = torch.optim.SGD(m.parameters())\n"
        "x = torch.randn(8, 4, device='cuda')\nm(x[torch.bincount(x[:, 0].long())]).sum().backward()\nopt.step()\n"
    )
    p = cli("--", sys.executable, str(needs_data))
    assert p.returncode == 2, p.stderr
    assert "oomkit: preflight: preflight cannot run bincount without data (at " in p.stderr and "needs_data.py:5" in p.stderr
    p = cli("--", "no-such-python-here", "train.py")
    assert p.returncode == 127 and "no-such-python-here" in p.stderr
    p = cli("--max-micro-batch", "8", "--", sys.executable, EXAMPLE)
    assert p.returncode == 2 and "{batch}" in p.stderr
    existing = tmp_path / "exists.pickle"
    existing.write_bytes(b"keep")
    p = cli("--snapshot", str(existing), "--", sys.executable, EXAMPLE)
    assert p.returncode == 2 and existing.read_bytes() == b"keep"


def test_the_environments_own_sitecustomize_still_runs(tmp_path) -> None:
    theirs = tmp_path / "site"
    theirs.mkdir()
    marker = tmp_path / "marker"
    (theirs / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {**os.environ, "PYTHONPATH": str(theirs)}
    p = cli("--capacity", "1GiB", "--", sys.executable, EXAMPLE, "--batch-size", "2", *SMALL, env=env)
    assert p.returncode == 0, p.stderr
    assert marker.read_text() == "ran"


LIGHTNING_GPU = """
import torch, lightning as L
from torch import nn
class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10))
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
ds = torch.utils.data.TensorDataset(torch.randn(256, 256), torch.randint(0, 10, (256,)))
L.Trainer(accelerator="gpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
          enable_progress_bar=False).fit(M(), torch.utils.data.DataLoader(ds, batch_size=32))
"""


def test_trainer_scripts_run_unchanged(tmp_path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    hf = os.path.join(os.path.dirname(EXAMPLE), "..", "hf_trainer.py")
    # The Trainer on "the GPU": its fused AdamW, accelerate's device placement, oomkit's own callback.
    p = cli("--json", "--capacity", "8GiB", "--", sys.executable, hf, "--out", str(tmp_path / "hf"), "--gpu")
    assert p.returncode == 0, p.stderr
    roles = json.loads(p.stdout)["run"]["by_role"]
    assert roles["parameters"] > 0 and roles["optimizer_state"] > 0
    # The example's default keeps the CPU: nothing to measure, and preflight says why.
    p = cli("--", sys.executable, hf, "--out", str(tmp_path / "cpu"))
    assert p.returncode == 2 and "trains on the CPU" in p.stderr
    pytest.importorskip("lightning", reason="lightning is not installed for this Python")
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING_GPU)
    p = cli("--json", "--capacity", "8GiB", "--", sys.executable, str(script))
    assert p.returncode == 0, p.stderr
    run = json.loads(p.stdout)["run"]
    # The module was built on meta by its constructor, never on the CPU and moved.
    params = next(x for x in run["by_line"] if x["role"] == "parameters")
    assert params["line"].endswith("lit.py:7 (__init__)"), run["by_line"]


def test_estimate_traces_the_config_beside_the_formula() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    config = os.path.join(os.path.dirname(EXAMPLE), "gpt2_tiny.json")
    common = ["estimate", "--config", config, "--batch", "4", "--seq", "128", "--gpu", "8GiB", "--trace"]
    p = subprocess.run([OOMKIT, *common, "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    traced = doc["traced"]
    assert traced["peak_reserved_bytes"] >= traced["peak_allocated_bytes"] > 0
    # The same parameters the formula counts, here in bf16 (its default dtype).
    assert abs(traced["by_role"]["parameters"] - doc["weights_bytes"]) / doc["weights_bytes"] < 0.02
    text = subprocess.run([OOMKIT, *common], capture_output=True, text=True, timeout=300)
    assert "Traced (oomkit preflight" in text.stdout and "the formula's tensors" in text.stdout
    # --ema: one more copy of every weight, counted with them, and said.
    p = subprocess.run([OOMKIT, *common, "--json", "--ema"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    ema = json.loads(p.stdout)["traced"]
    assert abs(ema["by_role"]["parameters"] - 2 * traced["by_role"]["parameters"]) / traced["by_role"]["parameters"] < 0.01
    assert any("EMA copy" in n for n in ema["notes"]), ema["notes"]
    p = subprocess.run([OOMKIT, *common, "--json", "--optimizer", "adamw8bit"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    eight = json.loads(p.stdout)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        # Without the library there is nothing to run: said, and the formula stands.
        assert "install bitsandbytes" in eight["traced_error"]
    else:
        # bitsandbytes' own optimizer ran (test_preflight_bitsandbytes.py checks its layout).
        assert eight["traced"]["by_role"]["optimizer_state"] < traced["by_role"]["optimizer_state"]


def test_estimate_names_a_model_type_transformers_lacks_in_one_line(tmp_path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    with open(os.path.join(os.path.dirname(EXAMPLE), "gpt2_tiny.json")) as f:
        config = json.load(f)
    config["model_type"] = "gpt2_from_the_future"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    p = subprocess.run(
        [OOMKIT, "estimate", "--config", str(tmp_path / "model"), "--gpu", "8GiB", "--trace", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    error = json.loads(p.stdout)["traced_error"]
    assert "\n" not in error and "has no model type 'gpt2_from_the_future', which the config names" in error, error
    assert len(error) < 300, error


def test_an_operator_without_a_fake_kernel_is_named_with_its_module() -> None:
    # A custom operator with a CUDA implementation only, as an extension's would be.
    @torch.library.custom_op("oomkit_test::fused_gelu", mutates_args=(), device_types="cuda")
    def fused_gelu(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)

    class FusedMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(64, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fused_gelu(self.up(x)).sum()

    with pytest.raises(oomkit.PreflightError) as e:
        preflight(FusedMLP, lambda b: torch.randn(b, 64), micro_batch=2, capacity="1GiB")
    line = str(e.value)
    assert "\n" not in line and "cannot run fused_gelu without data" in line, line
    assert "in FusedMLP's forward" in line and "test_preflight.py:" in line, line
    assert "torch.library.register_fake" in line, line
    # Once the operator has one, the step runs.
    fused_gelu.register_fake(torch.empty_like)
    fused_gelu.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)
    answer = preflight(FusedMLP, lambda b: torch.randn(b, 64), micro_batch=2, capacity="1GiB")
    assert answer.fits and answer.by_role["parameters"] > 0


def test_a_script_failing_inside_a_module_is_named_with_it(tmp_path) -> None:
    # An extension that refuses tensors without data, as a compiled kernel's launcher
    # does from its C++ side ("Pointer argument cannot be accessed from Triton (cpu
    # tensor?)"), where the Python answers a GPU tensor gives do not reach: here it
    # refuses every tensor.
    script = tmp_path / "ext.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "class FusedNorm(nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise ValueError('Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)')\n"
        "m = nn.Sequential(nn.Linear(8, 8), FusedNorm()).cuda()\n"
        "opt = torch.optim.SGD(m.parameters())\n"
        "m(torch.randn(2, 8, device='cuda')).sum().backward()\nopt.step()\n"
    )
    p = cli("--", sys.executable, str(script))
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert "failed under preflight after 0 optimizer step(s) in FusedNorm's forward: ValueError: Pointer argument" in line, line
    # The script's line, relative to its folder.
    assert line.endswith("(cpu tensor?) (at ext.py:5 (forward))"), line
    # A bare assert has no message: where it failed is the line's only clue.
    script.write_text("import torch\nm = torch.nn.Linear(8, 8).cuda()\nassert m.weight.shape[0] % 3 == 0\n")
    p = cli("--", sys.executable, str(script))
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].endswith("after 0 optimizer step(s): AssertionError (at ext.py:3 (<module>))"), p.stderr
