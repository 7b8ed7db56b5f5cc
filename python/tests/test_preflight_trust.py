"""Preflight never hangs, names the user's own lines, and its figures add up.

Each case is one that gave a false or no answer before: a generation loop
that never ended (values read from tensors without data were all zero, so
"not finished" never turned true), a role table that summed to less than
its headline, a library's line named as the user's, one cuBLAS workspace
where CUDA makes two, and ``python -m`` scripts whose package failed to
import named as scripts without an optimizer step.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import oomkit
import pytest
import torch
from oomkit.preflight.record.frames import LIBRARY, RUNTIME, TORCH, USER, classify, user_line
from oomkit.preflight.record.garbage import ALLOCATIONS_BEFORE_PYTHON_COLLECTS, COLLECT_EVERY_OPS, Collector
from oomkit.preflight.record.values import SHADOW_MAX_ELEMENTS
from preflight_cli import OOMKIT, preflight_run

# test.sh installs transformers on Python 3.10 and newer only.
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (Python 3.10+ only)"
)


def preflight_cmd(tmp_path: Path, script: str, *flags: str, args: tuple[str, ...] = (), timeout: int = 120) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(
        [OOMKIT, "preflight", *flags, "--", sys.executable, str(path), *args],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
    )  # fmt: skip


# ----- loops on values: generation ends at its bound, never hangs -----------

GENERATE = """
    import sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    kind, new = sys.argv[1], int(sys.argv[2])
    if kind.startswith("llama"):
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    else:
        # Token 0 is both the end of sequence and the padding: a generated
        # token read as 0 would end the generation at once.
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=512, eos_token_id=0, bos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    model = model.cuda().eval()
    ids = torch.randint(3, 1000, (2, 16)).cuda()
    kw = dict(max_new_tokens=new, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if kind.endswith("sample"):
        kw.update(do_sample=True, top_k=50)
    if kind.endswith("beam"):
        kw.update(num_beams=3)
    if kind.endswith("static"):
        kw.update(cache_implementation="static")
    with torch.no_grad():
        out = model.generate(ids, **kw)
    print("GENERATED", tuple(out.shape))
"""


@needs_transformers
@pytest.mark.parametrize("kind", ["gpt2", "gpt2-sample", "gpt2-beam", "llama", "llama-static"])
def test_a_generation_runs_to_its_max_new_tokens_and_ends(tmp_path: Path, kind: str) -> None:
    started = time.monotonic()
    p = preflight_cmd(tmp_path, GENERATE, args=(kind, "8"))
    took = time.monotonic() - started
    # Ends by itself, in seconds (it used to run until killed), at the bound:
    # the worst case, since the generated tokens are not known to end it sooner.
    assert "GENERATED (2, 24)" in p.stderr, p.stderr[-2000:]
    assert took < 90, took
    assert "stopped the script" not in p.stderr


LOOPS = """
    import sys
    import torch

    model = torch.nn.Linear(8, 8).cuda()
    x = torch.zeros((), device="cuda")
    n = 0
    while x < 10:  # values the script makes itself: known, so the loop ends after 10
        x = x + 1
        n += 1
    print("COUNTED", n, float(x), torch.arange(4, device="cuda").tolist())
    if sys.argv[1] == "forever":
        y = torch.randn(4, 8, device="cuda")
        while model(y).abs().sum() < 1e9:  # data the step does not have: it never ends here
            try:
                y = y * 2
            except Exception:  # a script's own handler cannot swallow the stop
                pass
    # Made from data on the host straight onto the GPU, and in a module's constructor (a counter
    # a buffer keeps, as an averaged model's): their values, and what they ask for, as given.
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.tensor(0, dtype=torch.long))

    made = torch.tensor([3, 1, 2], device="cuda")
    leaf = torch.tensor([1.0, 2.0], device="cuda", requires_grad=True)
    # And from a list of 0-d GPU tensors (torchtune's rotary scaling builds its table so).
    listed = torch.tensor([v * 2 for v in torch.arange(3, device="cuda")], device="cuda")
    print("MADE", made.sort().values.tolist(), bool(Counter().n == 0), leaf.is_leaf, leaf.requires_grad, listed.shape[0])
"""


def test_a_loop_on_values_the_script_makes_runs_as_on_a_gpu(tmp_path: Path) -> None:
    p = preflight_cmd(tmp_path, LOOPS, args=("count",))
    assert "COUNTED 10 10.0 [0, 1, 2, 3]" in p.stderr, p.stderr[-2000:]
    assert "MADE [1, 2, 3] True True True 3" in p.stderr, p.stderr[-2000:]


def test_a_loop_that_never_ends_is_stopped_by_the_time_limit_with_one_line(tmp_path: Path) -> None:
    started = time.monotonic()
    # The limit counts from the script's start, its imports included: long enough that a
    # loaded machine still reaches the loop within it.
    p = preflight_cmd(tmp_path, LOOPS, "--time-limit", "8", args=("forever",))
    assert time.monotonic() - started < 60
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("oomkit: preflight: stopped the script after 8 s ("), last
    # Stopped inside the loop: at its condition or its body, whichever was running.
    assert re.search(r"0 optimizer step\(s\)\) at script\.py:1[4-8] \(<module>\): it had not ended", last), last
    assert "Traceback" not in p.stderr


def test_the_python_api_stops_at_its_time_limit_too() -> None:
    def step(model: torch.nn.Module, batch: torch.Tensor, opt: object) -> None:
        while model(batch).sum() < 1.0:  # read as 0: never ends
            pass

    with pytest.raises(oomkit.PreflightError, match=r"stopped the script after 2 s .* at .*test_preflight_trust\.py:\d+ \(step\)"):
        oomkit.preflight(lambda: torch.nn.Linear(4, 4), torch.zeros(2, 4), step=step, time_limit=2)


def test_values_taken_as_zero_are_still_noted() -> None:
    def step(model: torch.nn.Module, batch: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        loss = model(batch).square().mean()
        loss.backward()
        print("loss", loss.item(), torch.full((3,), 7, device="meta").sum().item())
        opt.step()
        opt.zero_grad()

    r = oomkit.preflight(lambda: torch.nn.Linear(4, 4), torch.zeros(2, 4), step=step)
    assumed = [n for n in r.notes if "taken as 0" in n]
    # The loss has no values (read once in each of the 2 steps); the sum of sevens is known, and not noted.
    assert len(assumed) == 1 and assumed[0].startswith("2 value(s)"), r.notes
    assert SHADOW_MAX_ELEMENTS >= 4096


# ----- the role table adds up to the headline -------------------------------


def test_the_roles_add_up_to_the_peak_allocated() -> None:
    # Many weights of odd sizes: large blocks keep a remainder up to 1 MiB
    # unsplit, which rounding each request to 512 bytes misses.
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(1000 + 37 * i, 1000 + 37 * (i + 1)) for i in range(12)])

    r = oomkit.preflight(model, lambda b: torch.zeros(b, 1000), micro_batch=64)
    assert sum(r.by_role.values()) == r.peak_allocated_bytes, (r.by_role, r.peak_allocated_bytes)
    text = str(r)
    assert "the roles add up to" not in text
    shares = [float(line.split()[-1].rstrip("%")) for line in text.split("By role at the peak")[1].split("\n\n")[0].strip().splitlines()]
    assert 99 <= sum(shares) <= 101, text


def test_the_script_path_adds_up_too(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            model = torch.nn.Sequential(*[torch.nn.Linear(900 + 41 * i, 900 + 41 * (i + 1)) for i in range(8)]).cuda()
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(3):
                model(torch.randn(32, 900, device="cuda")).square().mean().backward()
                opt.step()
                opt.zero_grad()
            """
        )
    )
    run = preflight_run(script, cwd=tmp_path)
    assert sum(run["by_role"].values()) == run["peak_allocated_bytes"], run


def test_a_forward_that_raised_holds_nothing_once_its_exception_is_gone(tmp_path: Path) -> None:
    # The recorder keeps each running forward's call to walk stacks only so far: a forward
    # that ended by raising must not keep its tensors alive past the script's except block.
    script = tmp_path / "infer.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch

            class Boom(torch.nn.Linear):
                def forward(self, x):
                    raise ValueError("refused")

            model = Boom(4, 4).cuda()
            big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            try:
                model(big)  # the call holds its arguments while it runs
            except ValueError:
                pass
            del big
            after = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
            """
        )
    )
    run = preflight_run(script, cwd=tmp_path)
    assert 512 << 20 <= run["peak_allocated_bytes"] < 768 << 20, run["peak_allocated_bytes"]


#: Tensors only a reference cycle holds, freed when Python's cyclic collector runs, with as many
#: other Python objects made between the step's operations as JUNK says: a progress bar formats
#: its line only when enough time has passed, so a real script's count varies from run to run.
CYCLES = """
    import os
    import torch
    from torch import nn

    junk_per_tensor = int(os.environ["JUNK"])
    model = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        for _ in range(32):
            holder = {"t": torch.empty(256 << 10, device="cuda")}  # 1 MiB
            holder["self"] = holder
            del holder
            junk = [[] for _ in range(junk_per_tensor)]
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def test_garbage_in_reference_cycles_is_freed_at_the_same_points_in_every_run(tmp_path: Path) -> None:
    # Python's own trigger counts allocations, so the 1 MiB tensors alive at the peak (and the
    # answer) would change with the objects made between operations: 0 and 100 read 104 MiB,
    # 700 86 MiB and 3000 72 MiB before the recorder collected at fixed operations.
    peaks = set()
    for junk in ("0", "700", "3000"):
        path = tmp_path / "cycles.py"
        path.write_text(textwrap.dedent(CYCLES))
        p = subprocess.run(
            [OOMKIT, "preflight", "--json", "--no-fixes", "--", sys.executable, str(path)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, JUNK=junk),
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        peaks.add(json.loads(p.stdout)["run"]["peak_allocated_bytes"])
    assert len(peaks) == 1, peaks
    # Collected all the same: the 192 tensors the six steps drop are not all alive at once.
    assert peaks.pop() < 192 << 20


class _Node:
    """An object only a reference cycle (itself) holds."""


def _garbage() -> weakref.ref[_Node]:
    """A weak reference to a new object in a reference cycle, dropped: alive until collected."""
    node = _Node()
    node.me = node  # type: ignore[attr-defined]
    return weakref.ref(node)


def test_the_recorder_gives_pythons_collector_back_as_it_found_it() -> None:
    before = gc.get_threshold()
    collector = Collector()
    collector.install()
    try:
        assert gc.get_threshold()[0] == ALLOCATIONS_BEFORE_PYTHON_COLLECTS
        alive = _garbage()
        kept: list[list[int]] = [[] for _ in range(5000)]  # Python's own trigger (700) would have collected it
        assert alive() is not None and kept
        collector.after_op(COLLECT_EVERY_OPS - 1)
        assert alive() is not None
        collector.after_op(COLLECT_EVERY_OPS)
        assert alive() is None
        # The step's first operation restarts the schedule (after a whole collection): a set-up
        # of more or fewer operations moves none of the step's collections.
        collector.restart(5)
        alive = _garbage()
        collector.after_op(2 * COLLECT_EVERY_OPS)
        assert alive() is not None
        collector.after_op(5 + 2 * COLLECT_EVERY_OPS)
        assert alive() is None
        # A script that turns collection off (to collect at its own steps) is obeyed.
        gc.disable()
        try:
            alive = _garbage()
            collector.after_op(2 * COLLECT_EVERY_OPS)
            assert alive() is not None
        finally:
            gc.enable()
    finally:
        collector.uninstall()
    assert gc.get_threshold() == before


def test_checkpointing_recomputes_in_backward_without_a_forward_of_its_own(tmp_path: Path) -> None:
    # Checkpointing reruns each block's forward in backward and stops it early by raising:
    # nothing it reads is a cache held across forwards, and what it held is freed with it.
    script = tmp_path / "train.py"
    script.write_text((Path(__file__).resolve().parents[2] / "examples" / "preflight" / "blocks.py").read_text())
    plain = preflight_run(script, "--capacity", "1GiB", args=("--batch", "32"), cwd=tmp_path)
    checkpointed = preflight_run(script, "--capacity", "1GiB", args=("--batch", "32", "--checkpoint"), cwd=tmp_path)
    assert checkpointed["by_role"]["kv_cache"] == 0, checkpointed["by_role"]
    assert checkpointed["by_role"]["activations"] < plain["by_role"]["activations"] / 4, (checkpointed["by_role"], plain["by_role"])
    assert checkpointed["peak_allocated_bytes"] < plain["peak_allocated_bytes"]


# ----- the user's own lines -------------------------------------------------


def test_frames_are_told_apart_as_analyze_tells_them() -> None:
    assert classify("/venv/lib/python3.12/site-packages/einops/einops.py") == LIBRARY
    assert classify("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py") == TORCH
    assert classify("/usr/lib/python3.12/importlib/metadata/__init__.py") == RUNTIME
    assert classify("<frozen importlib._bootstrap>") == RUNTIME
    # The code PyTorch's compilers generate (a compiled step's graphs) is PyTorch's, as `analyze` has it.
    assert classify("<eval_with_key>.3") == TORCH
    assert classify("/tmp/torchinductor_me/ab/cabxyz.py") == TORCH
    assert classify("/home/me/model.py") == USER
    assert classify("train.py") == USER
    stack = (
        ("/venv/lib/python3.12/site-packages/torch/functional.py", 402, "einsum"),
        ("/venv/lib/python3.12/site-packages/einops/_backends.py", 291, "einsum"),
        ("/venv/lib/python3.12/site-packages/einops/einops.py", 916, "einsum"),
        ("/usr/lib/python3.12/contextlib.py", 81, "inner"),
        (os.path.join(os.getcwd(), "model.py"), 54, "forward"),
        (os.path.join(os.getcwd(), "train.py"), 10, "<module>"),
    )
    assert user_line(stack) == "model.py:54 (forward), in einops/_backends.py:291 (einsum)"
    assert user_line(stack[:3]) == "einops/_backends.py:291 (einsum)"


LIBRARY_CALL = """
    import torch
    from fancylib import mix  # an installed library: its own line is not the user's

    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(128, 256, device="cuda")
        h = mix(model(x))
        loss = (h * h).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""

#: The library: its output (32 MiB) is saved for backward, and held at the peak.
FANCYLIB = "import torch\n\n\ndef mix(x):\n    big = torch.einsum('bi,bj->bij', x, x)\n    return torch.tanh(big)\n"


def test_lines_holding_memory_are_the_users_with_the_library_beneath(tmp_path: Path) -> None:
    lib = tmp_path / "env" / "lib" / "python3.x" / "site-packages" / "fancylib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(FANCYLIB)
    script = tmp_path / "work" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(LIBRARY_CALL))
    env = dict(os.environ, PYTHONPATH=str(lib.parent))
    # Run from elsewhere: the lines are still relative to the script's folder.
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--snapshot", str(tmp_path / "pre.pickle"), "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = [entry["line"] for entry in json.loads(p.stdout)["run"]["by_line"]]
    assert lines, p.stdout
    for line in lines:
        assert line.startswith("train.py:"), lines
        assert "site-packages" not in line and not line.startswith("/"), lines
    assert "train.py:9 (<module>), in fancylib/__init__.py:6 (mix)" in lines, lines
    # The snapshot keeps the frames as PyTorch writes them, and analyze names the same lines.
    with open(tmp_path / "pre.pickle", "rb") as f:
        snap = pickle.load(f)
    frames = [fr["filename"] for e in snap["device_traces"][0] for fr in e.get("frames", [])]
    assert any(f.endswith("site-packages/fancylib/__init__.py") for f in frames)
    analyzed = subprocess.run([OOMKIT, "analyze", "--json", str(tmp_path / "pre.pickle")], capture_output=True, text=True)
    assert analyzed.returncode == 0, analyzed.stderr
    labels = [site["label"] for site in json.loads(analyzed.stdout)["devices"][0]["top_sites"]]
    assert "train.py:9 <module>" in labels and all(label.startswith("train.py:") for label in labels), labels


# ----- cuBLAS: a workspace for each thread that multiplies ------------------


def test_a_training_step_holds_two_cublas_workspaces_and_a_forward_one() -> None:
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))

    train = oomkit.preflight(model, lambda b: torch.zeros(b, 64), micro_batch=8, capacity="H100")
    # Hopper's 32 MiB each (CublasHandlePool.cpp), for the forward's thread and autograd's.
    assert train.by_role["other"] == 2 * (32 << 20), train.by_role
    assert any("2 workspaces" in n for n in train.notes), train.notes
    older = oomkit.preflight(model, lambda b: torch.zeros(b, 64), micro_batch=8, capacity="A100-40GB")
    assert older.by_role["other"] == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)

    def forward_only(m: torch.nn.Module, batch: torch.Tensor, opt: object) -> None:
        with torch.no_grad():
            m(batch)

    fwd = oomkit.preflight(model, lambda b: torch.zeros(b, 64), micro_batch=8, step=forward_only, optimizer=None)
    assert fwd.by_role["other"] == 32 << 20

    def flops_then_forward(m: torch.nn.Module, batch: torch.Tensor, opt: object) -> None:
        # Counting FLOPs as Lightning's measure_flops does: a copy of the model on meta, forward
        # and backward. Those multiplies run on no GPU; only the real forward's takes a workspace.
        with torch.device("meta"):
            counted = model()
        counted(torch.zeros(8, 64, device="meta")).sum().backward()
        forward_only(m, batch, opt)

    fwd = oomkit.preflight(model, lambda b: torch.zeros(b, 64), micro_batch=8, step=flops_then_forward, optimizer=None)
    assert fwd.by_role["other"] == 32 << 20, fwd.by_role


# ----- python -m, and scripts that exit before a step -----------------------


def test_a_module_whose_package_fails_to_import_names_the_users_line(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('from importlib.metadata import version\n\n__version__ = version("mypkg")\n')
    (pkg / "train.py").write_text("import torch\n")
    plain = subprocess.run([sys.executable, "-m", "mypkg.train"], capture_output=True, text=True, cwd=tmp_path)
    assert plain.returncode != 0 and "PackageNotFoundError" in plain.stderr
    p = subprocess.run([OOMKIT, "preflight", "--", sys.executable, "-m", "mypkg.train"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert last == (
        "oomkit: preflight: the script exited before its first optimizer step: "
        "PackageNotFoundError: No package metadata was found for mypkg (at mypkg/__init__.py:3 (<module>))"
    ), last


def test_a_module_run_with_dash_m_reads_its_installed_metadata(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg2"
    pkg.mkdir()
    meta = tmp_path / "mypkg2-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg2\nVersion: 0.1\n")
    (pkg / "__init__.py").write_text('from importlib.metadata import version\n\n__version__ = version("mypkg2")\n')
    (pkg / "train.py").write_text(
        textwrap.dedent(
            """
            import torch
            import mypkg2
            print("VERSION", mypkg2.__version__)
            model = torch.nn.Linear(8, 8).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(4, 8, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
            """
        )
    )
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--", sys.executable, "-m", "mypkg2.train"], capture_output=True, text=True, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert "VERSION 0.1" in p.stderr
    assert json.loads(p.stdout)["run"]["steps"] == 2


def test_a_script_that_exits_with_an_error_is_named_as_such(tmp_path: Path) -> None:
    p = preflight_cmd(tmp_path, 'import sys, torch\nsys.exit("bad config: no data")\n')
    assert (
        p.stderr.strip().splitlines()[-1]
        == "oomkit: preflight: the script exited with 'bad config: no data' before its first optimizer step"
    )
    p = preflight_cmd(
        tmp_path, "import argparse, torch\np = argparse.ArgumentParser()\np.add_argument('--n', required=True)\np.parse_args()\n"
    )
    assert p.stderr.strip().splitlines()[-1] == "oomkit: preflight: the script exited with code 2 before its first optimizer step"


FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "snapshots"


@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} is absent: the real snapshots are not here")
def test_real_training_snapshots_hold_the_two_workspaces_preflight_adds() -> None:
    # Recorded on real GPUs by other people: a training step holds two
    # cuBLAS workspaces (32 MiB on Hopper, 8.125 MiB before), a forward one.
    def workspaces(name: str) -> list[int]:
        with open(FIXTURES / name, "rb") as f:
            snap = pickle.load(f)  # the shared fixtures are trusted test inputs
        return sorted(
            b["size"]
            for seg in snap["segments"]
            for b in seg["blocks"]
            if any("getCurrentCUDABlasHandle" in fr.get("name", "") for fr in b.get("frames", []))
        )

    assert workspaces("lm_ctx128_full_train_step.pickle") == [32 << 20, 32 << 20]
    assert workspaces("small_mem_snapshot.pickle") == [8519680, 8519680]
    assert workspaces("lm_ctx128_forward_mixed_precision.pickle") == [32 << 20]
    assert 8519680 == 4096 * 1024 * 2 + 16 * 1024 * 8
