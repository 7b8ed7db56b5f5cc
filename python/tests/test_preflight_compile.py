"""`torch.compile` under `oomkit preflight`: the compiled step's graphs, partitioned as the backend would.

The check that matters is against PyTorch itself: the same compiled
model run for real on the CPU, through inductor, saves for backward what
preflight's compiled step saves on tensors without data. The rest are
the answers a user of `torch.compile` meets: a module compiled in place,
a compiled function, a backend preflight does not model, CUDA graphs, a
forward that cannot be captured whole, inputs whose sizes change, and a
backend PyTorch does not know.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from preflight_cli import OOMKIT, preflight_run

#: A GPT whose eager and compiled steps save different tensors (softmax, dropout, tanh GELU, written out).
GPT = """
    import math, sys
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Attention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.qkv, self.proj, self.heads, self.drop = nn.Linear(d, 3 * d), nn.Linear(d, d), heads, nn.Dropout(0.1)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
            att = self.drop(F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1)), dim=-1))
            return self.drop(self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, c)))


    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
            self.fc, self.out, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


    class GPT(nn.Module):
        def __init__(self, vocab=512, d=128, heads=4, layers=2):
            super().__init__()
            self.emb, self.blocks = nn.Embedding(vocab, d), nn.Sequential(*[Block(d, heads) for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, idx):
            return self.head(self.ln(self.blocks(self.emb(idx))))


    def saved_bytes(fn, *args):
        # Every storage autograd saves for backward, once (one without an address, on meta or
        # on preflight's fake GPU: by its identity).
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*args)
        return sum(seen.values()), out


    device = sys.argv[1]
    torch.manual_seed(0)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters())
    step = torch.compile(model) if "compile" in sys.argv else model
    idx = torch.randint(0, 512, (8, 256), device=device)
    saved, logits = saved_bytes(step, idx)
    print(f"saved {saved}", flush=True)
    if "forward" in sys.argv:
        sys.exit(0)  # what the forward saved is all that is compared: a CPU backward would compile too
    logits.float().mean().backward()
    opt.step()
"""


def _saved(text: str) -> int:
    found = re.search(r"^saved (\d+)$", text, re.M)
    assert found, text
    return int(found.group(1))


def _preflight(script: Path, *args: str) -> tuple[dict, int]:
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "24GiB", "--", sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=300, cwd=script.parent,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    # The script's own output goes to stderr, the answer to stdout.
    return json.loads(p.stdout)["run"], _saved(p.stderr)


def _cpu_inductor_works() -> str | None:
    """Why inductor cannot compile for the CPU here (no C++ compiler), or None."""
    probe = "import torch; f = torch.compile(lambda x: (x * 2).sin()); f(torch.ones(4))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["failed"])[-1]


def test_a_compiled_step_saves_what_inductor_saves_on_the_cpu(tmp_path: Path) -> None:
    script = tmp_path / "gpt.py"
    script.write_text(textwrap.dedent(GPT))
    real = {}
    for how in ("compile", "eager"):
        p = subprocess.run([sys.executable, str(script), "cpu", how, "forward"], capture_output=True, text=True, timeout=600)
        # Only a compile that failed asks whether inductor compiles for this CPU at all (the
        # probe is a compile of its own: not paid where the script's compiled).
        why = _cpu_inductor_works() if p.returncode != 0 and how == "compile" else None
        if why is not None:
            pytest.skip(f"inductor cannot compile for the CPU here: {why}")
        assert p.returncode == 0, p.stderr
        real[how] = _saved(p.stdout)
    assert real["compile"] < real["eager"] * 0.9, real  # the partitioner recomputes what eager saves

    eager_run, eager_saved = _preflight(script, "cuda", "eager")
    compiled_run, compiled_saved = _preflight(script, "cuda", "compile")
    # Eager saves the same tensors on meta as on the CPU; compiled, what inductor's partitioner
    # keeps for a CUDA device, within 0.5% of what it keeps for the CPU.
    assert eager_saved == real["eager"]
    assert abs(compiled_saved - real["compile"]) <= 0.005 * real["compile"], (compiled_saved, real)
    assert any("torch.compile (inductor) was modelled" in n for n in compiled_run["notes"])
    # The answer's peak (at the end of the forward) is lower by what is no longer saved, to the allocator's rounding.
    saving = eager_saved - compiled_saved
    drop = eager_run["peak_allocated_bytes"] - compiled_run["peak_allocated_bytes"]
    assert abs(drop - saving) <= 2 * 2**20, (drop, saving)
    assert sum(compiled_run["by_role"].values()) == compiled_run["peak_allocated_bytes"]


CASES = """
    import sys
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    case = sys.argv[1]


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)

        def forward(self, x):
            if case == "state":
                self.last = x  # Python state a captured graph cannot write
            if case == "break":
                print("mean", x.mean().item())  # a value read: a graph break
            return self.down(F.gelu(self.up(x)))


    model = MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = model
    if case == "in_place":
        model.compile()
    elif case == "eager_backend":
        run = torch.compile(model, backend="eager")
    elif case == "cuda_graphs":
        run = torch.compile(model, mode="reduce-overhead")
    elif case == "unknown_backend":
        run = torch.compile(model, backend="no_such_backend")
    elif case != "eager":
        run = torch.compile(model)

    loss_of = torch.compile(lambda out, y: F.mse_loss(F.gelu(out), y)) if case == "function" else F.mse_loss
    # A compiled function that reads the model it closes over (a global here), as Dynamo lifts its parameters.
    whole_step = torch.compile(lambda x, y: F.mse_loss(model(x), y))
    for step in range(2):
        for rows in (64, 72, 80) if case == "sizes" else (64,):
            x, y = torch.randn(rows * (step + 1), 256, device="cuda"), torch.randn(rows * (step + 1), 256, device="cuda")
            (whole_step(x, y) if case == "closure" else loss_of(run(x), y)).backward()
        opt.step()
        opt.zero_grad()
"""

MODELLED = "torch.compile (inductor) was modelled"


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    script = tmp_path_factory.mktemp("compile") / "cases.py"
    script.write_text(textwrap.dedent(CASES))
    return script


@pytest.fixture(scope="module")
def eager(cases: Path) -> dict:
    return preflight_run(cases, "--capacity", "24GiB", args=("eager",), cwd=cases.parent)


@pytest.mark.parametrize("case", ["compiled", "in_place", "function", "closure", "sizes"])
def test_compiled_modules_and_functions_are_modelled(cases: Path, eager: dict, case: str) -> None:
    run = preflight_run(cases, "--capacity", "24GiB", args=(case,), cwd=cases.parent)
    assert any(MODELLED in n for n in run["notes"]), run["notes"]
    assert not any("could not capture" in n for n in run["notes"]), run["notes"]
    assert run["steps"] == 2 and sum(run["by_role"].values()) == run["peak_allocated_bytes"]
    # The weights are the model's, seen through the compiled wrapper.
    assert run["by_role"]["parameters"] == eager["by_role"]["parameters"]
    if case == "sizes":
        # Inputs whose sizes change are all run (the largest last): more than the eager step at 64 rows.
        assert run["peak_allocated_bytes"] > eager["peak_allocated_bytes"]
    else:
        # The MLP saves the same tensors compiled as eager (the partitioner keeps GELU's input and output).
        assert run["peak_allocated_bytes"] <= eager["peak_allocated_bytes"]


@pytest.mark.parametrize(
    ("case", "note"),
    [
        ("break", "could not capture MLP's forward whole (DataDependentOutputException"),
        ("state", "could not capture MLP's forward whole (its forward keeps state in Python attributes (MLP.last))"),
        ("eager_backend", "torch.compile's backend 'eager' is not modelled"),
    ],
)
def test_what_cannot_be_compiled_here_is_measured_eager_and_named(cases: Path, eager: dict, case: str, note: str) -> None:
    run = preflight_run(cases, "--capacity", "24GiB", args=(case,), cwd=cases.parent)
    assert any(note in n for n in run["notes"]), run["notes"]
    assert not any(MODELLED in n for n in run["notes"]), run["notes"]
    # Eager it is: the same figures as the script without torch.compile.
    assert run["peak_allocated_bytes"] == eager["peak_allocated_bytes"]
    assert run["by_role"] == eager["by_role"]


def test_cuda_graphs_are_noted_as_not_modelled(cases: Path) -> None:
    run = preflight_run(cases, "--capacity", "24GiB", args=("cuda_graphs",), cwd=cases.parent)
    assert any("mode='reduce-overhead' records CUDA graphs, whose private memory pool is not modelled" in n for n in run["notes"])
    assert any(MODELLED in n for n in run["notes"])


def test_a_backend_pytorch_does_not_know_is_one_line_naming_the_users_line(cases: Path) -> None:
    p = subprocess.run(
        [OOMKIT, "preflight", "--capacity", "24GiB", "--", sys.executable, str(cases), "unknown_backend"],
        capture_output=True, text=True, timeout=300, cwd=cases.parent,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("oomkit: preflight: the script failed under preflight"), last
    assert "InvalidBackend: Invalid backend: 'no_such_backend'" in last and "(at cases.py:" in last, last


HF = """
    import sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    run = torch.compile(model) if sys.argv[1] == "compile" else model
    for _ in range(2):
        ids = torch.randint(0, 5000, (8, 256), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss  # the output holds its DynamicCache, as by default
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed (Python 3.10+ only)")
def test_a_hugging_face_model_that_returns_its_cache_is_compiled_with_its_tied_weights(tmp_path: Path) -> None:
    script = tmp_path / "hf.py"
    script.write_text(textwrap.dedent(HF))
    eager = preflight_run(script, "--capacity", "24GiB", args=("eager",), cwd=tmp_path)
    compiled = preflight_run(script, "--capacity", "24GiB", args=("compile",), cwd=tmp_path)
    assert any(MODELLED in n for n in compiled["notes"]), compiled["notes"]
    assert compiled["by_role"]["parameters"] == eager["by_role"]["parameters"]
    assert compiled["peak_allocated_bytes"] < eager["peak_allocated_bytes"]


def test_cross_entropy_in_a_compiled_graph_writes_only_its_gradient_at_the_logits_size() -> None:
    # Inductor computes the log-softmax where the gather reads it, the one-hot of the targets as a
    # comparison (scatter_upon_const_tensor), and the whole backward in one kernel writing the
    # gradient: of the tensors the size of the logits, only that gradient is written. Views of a
    # result never written are not memory either (counted, they read +0.49 GiB on torchtune's LoRA).
    import functools

    import torch
    import torch.nn.functional as F
    from oomkit.preflight.world.compile import fused_away
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    written: dict[str, list[str]] = {}

    def keep(name: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, _inputs: object) -> object:
            fused = fused_away(gm.graph)
            written[name] = [
                str(n.target)
                for n in gm.graph.nodes
                if n.op == "call_function" and n not in fused and tuple(getattr(n.meta.get("val"), "shape", ())) == (64, 1000)
            ]
            return gm

        return compiler

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="sum")

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    compiled = aot_function(loss, fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition, decompositions=select_decomp_table())
    compiled(torch.randn(64, 1000, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, 1000, (64,))).backward()
    assert written["forward"] == [], written
    assert written["backward"] == ["prims.convert_element_type.default"], written
