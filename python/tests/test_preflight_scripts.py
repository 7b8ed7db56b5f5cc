"""What the scripts people run do, under `oomkit preflight`: each pattern in a script of this project's own.

Widely used public scripts load a checkpoint onto the GPU, format a 0-d
tensor as a number in their logs, load weights on worker threads, wrap
the model in ``nn.DataParallel``, or fail in their logging after a step
has run. Each is written here as a small script in its own words, run
unchanged under preflight, and its answer checked against what can be
worked out by hand (weights, gradients, optimizer states).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from preflight_cli import OOMKIT, allocator_bytes, preflight_run

MIB = 1 << 20
#: nn.Linear(1024, 1024)'s weight and bias in float32, as the allocator rounds them (to 512 bytes).
LINEAR_1024 = 1024 * 1024 * 4 + 1024 * 4


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_checkpoint_loaded_onto_the_gpu_lands_on_the_fake_gpu_unread(tmp_path: Path) -> None:
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    torch.save(layers.state_dict(), tmp_path / "ckpt.pt")
    for map_location in ('"cuda"', "torch.device('cuda:0')", "{'cpu': 'cuda:0'}", "lambda storage, loc: storage.cuda(0)"):
        script = _script(
            tmp_path,
            f"""
            import torch
            model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
            state = torch.load("ckpt.pt", map_location={map_location})   # kept: held beside the model
            assert all(t.is_cuda or t.device.type == "meta" for t in state.values())
            model.load_state_dict(state)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(torch.randn(8, 1024, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
            """,
        )
        run = preflight_run(script, cwd=tmp_path)
        # The checkpoint's four layers are held on the GPU beside the model's own, from its line.
        loaded = sum(line["bytes"] for line in run["by_line"] if line["line"].startswith("train.py:4 "))
        assert loaded == 4 * LINEAR_1024, (map_location, run["by_line"])
        assert run["by_role"]["parameters"] == 4 * LINEAR_1024


def test_a_formatted_0d_tensor_is_a_number_and_a_failure_after_a_step_still_answers(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for step in range(3):
            loss = model(torch.randn(32, 1024, device="cuda")).square().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            print(f"step {step}: loss {loss:.4f} grad norm {norm:.2f}")
            if step == 1:
                raise KeyError("a logger's missing key")
        """,
    )
    p = subprocess.run([OOMKIT, "preflight", "--json", "--steps", "3", "--", sys.executable, str(script)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    run = json.loads(p.stdout)["run"]
    assert "step 0: loss 0.0000 grad norm 0.00" in p.stderr
    # Two whole steps ran before the error: their figures stand, and the error is said with its line.
    assert run["steps"] == 2 and run["by_role"]["optimizer_state"] == 2 * LINEAR_1024
    failed = [n for n in run["notes"] if n.startswith("the script failed under preflight after 2 step(s)")]
    assert failed and "KeyError" in failed[0] and "train.py:13" in failed[0], run["notes"]
    assert any("taken as 0" in n for n in run["notes"]), run["notes"]


def test_a_script_that_fails_before_its_first_step_gets_no_figures(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(64, 64).cuda()
        loss = model(torch.randn(2, 64, device="cuda")).sum()
        raise KeyError("before any step")
        """,
    )
    p = subprocess.run([OOMKIT, "preflight", "--", sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 2 and "after 0 optimizer step(s)" in p.stderr and "KeyError" in p.stderr, p.stderr
    # A script that is not there is named as such, not as one that ran without a forward.
    p = subprocess.run([OOMKIT, "preflight", "--", sys.executable, "trian.py"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == "oomkit: preflight: trian.py: no such script; Python could not open it", p.stderr


def test_tensors_made_on_the_scripts_threads_are_on_the_fake_gpu(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import threading
        from concurrent.futures import ThreadPoolExecutor
        import torch
        held = {}
        def load(i):
            held[i] = torch.empty(1024, 1024, device="cuda")   # 4 MiB, on a worker thread
        t = threading.Thread(target=load, args=(0,))
        t.start()
        t.join()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(load, range(1, 5)))
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    run = preflight_run(script, cwd=tmp_path)
    made = sum(line["bytes"] for line in run["by_line"] if line["line"] == "train.py:7 (load)")
    assert made == 5 * 4 * MIB, run["by_line"]


@pytest.mark.parametrize("gpus", [1, 4])
def test_data_parallel_runs_as_its_first_gpu(tmp_path: Path, gpus: int) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        model = torch.nn.DataParallel(torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            out = model(torch.randn(256, 1024).cuda(non_blocking=True))
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    flags = ("--gpus", str(gpus)) if gpus > 1 else ()
    run = preflight_run(script, *flags, cwd=tmp_path)
    weights = 2 * (1024 * 4096 * 4) + 4096 * 4 + 1024 * 4
    # GPU 0 holds the whole model, its gradients and its momentum, whatever its share of the batch.
    assert run["by_role"]["parameters"] == pytest.approx(weights, rel=0.01)
    assert run["by_role"]["optimizer_state"] == pytest.approx(weights, rel=0.01)
    said = [n for n in run["notes"] if n.startswith("nn.DataParallel over")]
    assert bool(said) == (gpus > 1), run["notes"]


def test_the_gpus_people_rent_by_the_names_they_use(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        print("capability", torch.cuda.get_device_capability(), "bf16", torch.cuda.is_bf16_supported())
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    seen = {}
    for name in ("A100", "a100 40gb", "H200", "B200", "L4", "NVIDIA A10G", "V100", "rtx 4090"):
        p = subprocess.run([OOMKIT, "preflight", "--json", "--capacity", name, "--", sys.executable, str(script)],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
        assert p.returncode == 0, (name, p.stderr)
        seen[name] = (json.loads(p.stdout)["run"], p.stderr)
    gib = 1 << 30
    # A GPU's name is its total less 1.25 GiB of CUDA context (docs/whatif.md's table).
    assert seen["A100"][0]["capacity_bytes"] == int(79.14 * gib) - 1280 * MIB
    assert seen["a100 40gb"][0]["capacity_bytes"] == int(39.50 * gib) - 1280 * MIB
    assert seen["H200"][0]["capacity_bytes"] == int(139.80 * gib) - 1280 * MIB
    # The generation decides bfloat16 and the cuBLAS workspace: a V100 has neither bfloat16 nor Hopper's 32 MiB.
    assert "capability (7, 0) bf16 False" in seen["V100"][1] and "capability (10, 0) bf16 True" in seen["B200"][1]
    assert seen["V100"][0]["by_role"]["other"] < seen["H200"][0]["by_role"]["other"]


@pytest.mark.parametrize(("name", "said"), [("B300", "not a size (80GiB) or a GPU oomkit knows"), ("MI300X", "ROCm")])
def test_a_capacity_refused_is_one_line_and_nothing_runs(tmp_path: Path, name: str, said: str) -> None:
    script = _script(tmp_path, "open('ran', 'w').write('the script ran')\n")
    p = subprocess.run([OOMKIT, "preflight", "--capacity", name, "--", sys.executable, str(script)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)  # fmt: skip
    assert p.returncode == 2 and said in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "ran").exists()


def test_a_change_that_cannot_be_made_says_what_to_install(tmp_path: Path) -> None:
    # bitsandbytes is missing where the script runs: the 8-bit AdamW row is a note naming it, in one line.
    missing = tmp_path / "missing" / "bitsandbytes"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('No module named bitsandbytes')\n")
    script = _script(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "missing"))
    p = subprocess.run([OOMKIT, "preflight", "--json", "--fixes", "--", sys.executable, str(script)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    notes = json.loads(p.stdout)["fix_notes"]
    said = [n for n in notes if n.startswith("8-bit AdamW")]
    assert said and "install bitsandbytes where preflight runs" in said[0] and "exited with" not in said[0], notes


RECURRENT_TRAINING = """
    import torch
    from torch import nn

    class Halve(nn.Module):  # a data transform: a module without weights, run on the host per sample
        def forward(self, x):
            return x * 0.5

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 256)
            self.rnn = nn.LSTM(256, 512, batch_first=True)
            self.head = nn.Linear(512, 1000)
            self.table = None

        def forward(self, ids, hidden):
            if self.table is None:  # a positional table built by the first forward, kept after it
                self.table = torch.ones(4096, 256, device=ids.device)
            out, hidden = self.rnn(self.emb(ids) + self.table[: ids.shape[1]], hidden)
            return self.head(out), hidden

    class HandAdam(torch.optim.Optimizer):  # its moments made in __init__, kept as attributes
        def __init__(self, params):
            super().__init__(params, dict(lr=1e-3))
            self.ps = [p for g in self.param_groups for p in g["params"]]
            self.moments = {"m": [torch.zeros_like(p) for p in self.ps], "v": [torch.zeros_like(p) for p in self.ps]}

        @torch.no_grad()
        def step(self):
            for p, m, v in zip(self.ps, self.moments["m"], self.moments["v"]):
                m.lerp_(p.grad, 0.1)
                v.mul_(0.99).addcmul_(p.grad, p.grad, value=0.01)
                p.sub_(1e-3 * m / (v.sqrt() + 1e-8))

    model = LM().cuda()
    opt = HandAdam(model.parameters())
    halve, hidden = Halve(), None
    for _ in range(3):
        samples = [halve(torch.randn(64)) for _ in range(32)]
        ids = torch.randint(0, 1000, (32, 64)).cuda()
        logits, hidden = model(ids, hidden)
        hidden = tuple(h.detach() for h in hidden)  # the state carried to the next batch
        nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
"""


def test_training_roles_of_recurrent_state_kept_tables_and_state_made_in_init(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, RECURRENT_TRAINING), cwd=tmp_path)
    # The host transforms run 32 times a step, the model once: two steps are two forwards.
    assert run["steps"] == 2 and run["forwards"] == 2, run
    # A training step holds no cache: the recurrent state carried between batches is the step's own.
    assert run["by_role"]["kv_cache"] == 0, run["by_role"]
    emb, rnn, head = torch.nn.Embedding(1000, 256), torch.nn.LSTM(256, 512), torch.nn.Linear(512, 1000)
    weights = allocator_bytes([*emb.parameters(), *rnn.parameters(), *head.parameters()])
    # The moments made in __init__ are the optimizer's state: two per weight (a block may hold
    # a remainder too small to split off, which the allocator hands out with it).
    assert 2 * weights <= run["by_role"]["optimizer_state"] <= 1.02 * 2 * weights, (weights, run["by_role"])
    # The table the first forward built and the model keeps is the model's, as a buffer is.
    assert run["by_role"]["parameters"] == weights + 4096 * 256 * 4, (weights, run["by_role"])


#: Images copied to the GPU as bytes and made floats there, outside the model (YOLO's trainer:
#: ``batch["img"].float() / 255``), the last batch's kept while the next one trains.
BATCH_MADE_ON_GPU = """
    import torch
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = None
    for _ in range(3):
        raw = torch.randint(0, 255, (64, 224, 224, 3), dtype=torch.uint8).cuda()
        labels = torch.randint(0, 10, (64,)).cuda()
        images = raw.permute(0, 3, 1, 2).float() / 255
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        last = images
"""


def test_what_the_script_makes_of_the_batch_alone_is_the_batch(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, BATCH_MADE_ON_GPU), "--no-fixes", cwd=tmp_path)
    floats = 64 * 3 * 224 * 224 * 4
    # This batch's floats and the last one's, both made of the batch alone, beside its bytes and labels.
    assert run["by_role"]["inputs"] >= 2 * floats + 64 * 224 * 224 * 3, run["by_role"]
    made = [row for row in run["by_line"] if row["line"].endswith(":11 (<module>)")]
    assert made and {row["role"] for row in made} == {"inputs"}, run["by_line"]
    # The loss, made of the model's output and the labels, is not the batch.
    assert not [row for row in run["by_line"] if row["line"].endswith(":12 (<module>)") and row["role"] == "inputs"], run["by_line"]


#: An autoencoder of which a step trains only the encoder, as a latent model's training encodes with
#: its VAE and never decodes; and a data set moved to the GPU whole before training, sampled from there.
UNUSED_PART_AND_DATA_ON_GPU = """
    import torch
    from torch import nn

    class AutoEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(1024, 256)
            self.decoder = nn.Linear(256, 1024)

    ae = AutoEncoder().cuda()
    head = nn.Linear(256, 10).cuda()
    data = torch.randn(2048, 1024).cuda()
    labels = torch.randint(0, 10, (2048,)).cuda()
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for step in range(2):
        pick = torch.randint(0, 2048, (64,), device="cuda")
        with torch.no_grad():
            z = ae.encoder(data[pick])
        nn.functional.cross_entropy(head(z), labels[pick]).backward()
        opt.step()
        opt.zero_grad()
"""


def test_weights_whose_forward_never_runs_and_data_moved_before_the_step_have_their_roles(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, UNUSED_PART_AND_DATA_ON_GPU), cwd=tmp_path)
    ae, head = torch.nn.ModuleDict({"e": torch.nn.Linear(1024, 256), "d": torch.nn.Linear(256, 1024)}), torch.nn.Linear(256, 10)
    # The decoder's weights are on the GPU as the encoder's are, though no forward of it runs.
    assert run["by_role"]["parameters"] == allocator_bytes([*ae.parameters(), *head.parameters()]), run["by_role"]
    # The data set copied to the GPU before the first step is an input, as a batch copied there is.
    data = [torch.empty(2048, 1024), torch.empty(2048, dtype=torch.int64)]
    assert run["by_role"]["inputs"] >= allocator_bytes(data), run["by_role"]


KEPT_STATE_GENERATION = """
    import torch
    from torch import nn

    LAYERS, DIM, VOCAB, BATCH, MAX = 2, 256, 1000, 4, 512

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.register_buffer("keys", None, persistent=False)
            self.register_buffer("values", None, persistent=False)

        def make_cache(self):  # the cache kept in the model's own buffers, written in place
            self.keys = torch.zeros(BATCH, MAX, DIM, device="cuda")
            self.values = torch.zeros(BATCH, MAX, DIM, device="cuda")

        def forward(self, x, at):
            q, k, v = self.qkv(x).chunk(3, -1)
            self.keys.index_copy_(1, at, k)
            self.values.index_copy_(1, at, v)
            return x + torch.softmax(q @ self.keys.transpose(1, 2), -1) @ self.values

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.table = None

        def forward(self, ids, at):
            if self.table is None:  # built by the first forward, read by every later one, never written
                self.table = torch.ones(MAX, DIM, device=ids.device)
            x = self.emb(ids) + self.table[at]
            for block in self.blocks:
                x = block(x, at)
            return x[:, -1] @ self.emb.weight.T

    model = LM().cuda().eval()
    for block in model.blocks:
        block.make_cache()
    ids = torch.randint(0, VOCAB, (BATCH, 1), device="cuda")
    with torch.no_grad():
        for i in range(32):
            ids = model(ids, torch.tensor([i], device="cuda")).argmax(-1, keepdim=True)
"""


def test_a_generation_cache_is_what_each_forward_writes_and_a_kept_table_is_not(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, KEPT_STATE_GENERATION), "--capacity", "24GiB", cwd=tmp_path)
    assert run["mode"] == "inference" and run["forwards"] == 32, run
    # Layers x (keys, values) x batch x length x width, fp32: exactly the buffers each forward writes.
    assert run["by_role"]["kv_cache"] == 2 * 2 * 4 * 512 * 256 * 4, run["by_role"]
    emb, qkv = torch.nn.Embedding(1000, 256), torch.nn.Linear(256, 768)
    weights = allocator_bytes([*emb.parameters(), *qkv.parameters(), *qkv.parameters()])
    assert run["by_role"]["parameters"] == weights + 512 * 256 * 4, (weights, run["by_role"])


NO_CACHE_SAMPLING = """
    import torch
    from torch import nn

    DIM, VOCAB = 256, 1000

    class Block(nn.Module):  # attends over the whole sequence again at each token: no cache
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    model = nn.Sequential(nn.Embedding(VOCAB, DIM), Block(), Block(), nn.Linear(DIM, VOCAB)).cuda().eval()
    prompt = torch.randint(0, VOCAB, (1, 4), device="cuda")
    # One autocast region around every sample: its cast of each weight is made once and kept.
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for sample in range(2):  # each sample starts again from the same prompt
            seq = prompt
            for _ in range(8):
                seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
"""


def test_sampling_without_a_cache_holds_none_under_one_autocast_region(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, NO_CACHE_SAMPLING), "--capacity", "24GiB", cwd=tmp_path)
    assert run["mode"] == "inference" and run["forwards"] == 16, run
    # Neither the prompt every sample reads nor autocast's kept casts of the weights are a cache.
    assert run["by_role"]["kv_cache"] == 0, run["by_role"]
    up, down, head = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256), torch.nn.Linear(256, 1000)
    linears = [*up.parameters(), *down.parameters(), *up.parameters(), *down.parameters(), *head.parameters()]
    weights = allocator_bytes([*torch.nn.Embedding(1000, 256).parameters(), *linears])
    # The 16-bit casts are copies of the linear layers' weights, kept for the region: weights too.
    casts = allocator_bytes([p.to(torch.bfloat16) for p in linears])
    assert run["by_role"]["parameters"] == weights + casts, (weights, casts, run["by_role"])


PINNED = """
    import torch

    ds = torch.utils.data.TensorDataset(torch.randn(256, 1024), torch.randint(0, 10, (256,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=32, pin_memory=True)  # each batch pinned
    staging = torch.empty(4096, 1024, pin_memory=True)  # a pinned buffer of the script's own
    model = torch.nn.Linear(1024, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        assert x.is_pinned() and staging.is_pinned()
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
"""


def test_pinned_host_memory_needs_no_gpu_and_is_counted(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, PINNED), cwd=tmp_path)
    assert run["steps"] == 2, run
    # The staging buffer, and one batch at a time (the loader's last is freed as the next is made).
    batch = 32 * 1024 * 4 + 32 * 8
    assert run["host_pinned_peak_bytes"] == 4096 * 1024 * 4 + batch, run
    assert run["host_peak_bytes"] == run["host_pinned_peak_bytes"]


OFFLOADED = """
    import resource
    import sys
    import torch
    from torch import nn

    model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(16)]).cuda()
    # Every weight copied to pinned host memory, as a trainer that offloads keeps it: 4 GiB.
    kept = [p.detach().to("cpu", non_blocking=True).pin_memory() for p in model.parameters()]
    assert all(k.is_pinned() for k in kept)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):  # what backward needs, kept on the host
            loss = model(torch.randn(512, 8192, device="cuda")).square().mean()
        loss.backward()
        print("RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
        opt.step()
        opt.zero_grad()
"""


def test_offloaded_weights_and_activations_take_no_host_memory_and_are_counted(tmp_path: Path) -> None:
    script = _script(tmp_path, OFFLOADED)
    p = subprocess.run([OOMKIT, "preflight", "--json", "--", sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(p.stdout)["run"]
    weights = 16 * (8192 * 8192 + 8192) * 4
    # The copies are counted, pinned; each step's saved inputs go to the host beside them.
    assert run["host_pinned_peak_bytes"] == run["host_peak_bytes"] > weights + 16 * 512 * 8192 * 4, run
    # ...but hold no data: the process stayed far below the 4 GiB it offloaded.
    rss = max(int(line.split()[1]) for line in p.stdout.splitlines() + p.stderr.splitlines() if line.startswith("RSS "))
    assert rss < weights / 2, rss
    # On the GPU: the weights and gradients; the activations went to the host.
    assert run["by_role"]["activations"] == 0, run["by_role"]


SAMPLED_ON_THE_HOST = """
    import torch
    from torch import nn

    V = 1000
    emb, rnn, head = nn.Embedding(V, 128).cuda(), nn.LSTM(128, 256).cuda(), nn.Linear(256, V).cuda()
    word, hidden, words = torch.zeros(1, 1, dtype=torch.long, device="cuda"), None, []
    with torch.no_grad():
        for _ in range(20):
            out, hidden = rnn(emb(word), hidden)
            weights = head(out).squeeze().div(0.8).exp().cpu()  # the word weights, read back
            index = torch.multinomial(weights, 1)[0]  # sampled on the host
            word.fill_(index)
            words.append(int(index))
    assert len(words) == 20
"""


def test_sampling_on_the_host_from_values_read_back_runs(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, SAMPLED_ON_THE_HOST), cwd=tmp_path)
    # Each of the 20 words runs the three modules: zeros read back sample as uniform weights would.
    assert run["mode"] == "inference" and run["forwards"] == 60, run
    assert any("taken as 0" in n for n in run["notes"]), run["notes"]


#: What pytorch/examples' scripts do around their step (read there, written here in this project's
#: words): a rotary table's positions made where its frequencies are, remade under ``with
#: torch.device(buffer.device)`` (its tensor-parallel Llama), ``model.share_memory()`` of a model
#: on the GPU (Hogwild), and images saved from the GPU converted on the way (DCGAN's
#: ``save_image``: ``.to("cpu", torch.uint8)``).
AROUND_THE_STEP = """
    import numpy as np
    import torch
    from torch import nn


    def rotary(dim, end):
        freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
        positions = torch.arange(end, device=freqs.device)
        angles = torch.outer(positions, freqs)
        return torch.polar(torch.ones_like(angles), angles)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(1024, 1024)
            self.register_buffer("rope", rotary(16, 64))

        def remake(self):
            with torch.device(self.rope.device):
                self.rope = rotary(16, 64)


    model = Net().cuda()
    model.remake()
    model.share_memory()
    assert all(p.is_shared() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        out = model.proj(torch.randn(32, 1024, device="cuda"))
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        image = (out.detach().clamp(0, 1) * 255).to("cpu", torch.uint8)
        kept = out.detach().to("cpu", dtype=torch.bfloat16)
        assert image.dtype == torch.uint8 and image.numpy().dtype == np.uint8, image.dtype
        assert kept.dtype == torch.bfloat16 and kept.shape == (32, 1024)
"""


def test_tables_made_on_the_cpu_by_name_shared_models_and_converted_copies_run_as_on_a_gpu(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, AROUND_THE_STEP), cwd=tmp_path)
    assert run["steps"] == 2, run
    # The weights, and the table kept on the GPU: 64 positions x 8 frequencies in complex64.
    assert run["by_role"]["parameters"] == LINEAR_1024 + 64 * 8 * 8, run["by_role"]
    # The first step's copies on the host, each of the type it was converted to (the second step ends the run).
    assert run["host_peak_bytes"] == 32 * 1024 * (1 + 2), run


#: Hogwild training on the GPU (pytorch/examples' ``mnist_hogwild --cuda``, read there): the
#: model's weights shared with processes of the script's own, each training them.
HOGWILD = """
    import torch
    import torch.multiprocessing as mp


    def train(rank, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            model(torch.randn(32, 1024, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()


    if __name__ == "__main__":
        mp.set_start_method("spawn", force=True)
        model = torch.nn.Linear(1024, 1024).cuda()
        model.share_memory()
        workers = [mp.Process(target=train, args=(rank, model)) for rank in range(4)]
        for p in workers:
            p.start()
        for p in workers:
            p.join()
        assert all(p.exitcode == 0 and not p.is_alive() for p in workers)
"""


def test_processes_given_the_models_gpu_weights_run_the_first_here(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, HOGWILD), cwd=tmp_path)
    # The first process's training is the step measured: the shared weights, its gradients and momentum.
    assert run["steps"] == 2 and run["mode"] == "training", run
    assert run["by_role"]["parameters"] == run["by_role"]["optimizer_state"] == LINEAR_1024, run["by_role"]
    said = [n for n in run["notes"] if n.startswith("the script starts processes of its own (multiprocessing)")]
    assert said and "the others were not started" in said[0], run["notes"]


def test_a_python_without_oomkit_is_one_line(tmp_path: Path) -> None:
    # The interpreter this virtual environment was made from has no oomkit of its own.
    base = getattr(sys, "_base_executable", sys.executable)
    if subprocess.run([base, "-c", "import oomkit.preflight"], capture_output=True).returncode == 0:
        pytest.skip(f"{base} can import oomkit: no Python without it here")
    script = _script(tmp_path, "import torch\n")
    # As a user sees it without the suite's shared warm Python (which would say first that it runs another).
    env = {k: v for k, v in os.environ.items() if k != "OOMKIT_PREFLIGHT_SERVER"}
    p = subprocess.run([OOMKIT, "preflight", "--", base, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import oomkit's preflight" in lines[0] and "install oomkit where the script runs" in lines[0], p.stderr


SCORED_AT_LABELS = """
import torch
from torch import nn

width, vocab = 256, 4000
body, head = nn.Linear(width, width).cuda(), nn.Linear(width, vocab).cuda()
opt = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
labels = torch.full((4, 128), -100)
for row, length in enumerate((100, 90, 80, 70)):
    labels[row, :length] = 7  # each row's completion, the rest padding
for _ in range(2):
    hidden = body(torch.randn(4, 128, width, device="cuda"))
    target = labels.to(hidden.device)
    mask = target != -100
    # On a CUDA device only the label positions are scored (TRL's compact path).
    before = torch.cuda.memory_allocated()
    selected = hidden[mask] if hidden.is_cuda else hidden.flatten(0, 1)
    print("SELECTED", tuple(selected.shape), torch.cuda.memory_allocated() - before)
    scores = head(selected)
    nn.functional.cross_entropy(scores, target[mask] if hidden.is_cuda else target.flatten()).backward()
    opt.step()
    opt.zero_grad()
    del selected, scores
"""


def test_only_the_label_positions_are_scored_when_the_mask_is_known(tmp_path: Path) -> None:
    # x[mask] has as many rows as the mask has positions: the mask comes from the batch
    # (known values), the hidden states are data the step does not have.
    script = _script(tmp_path, SCORED_AT_LABELS)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["run"]["steps"] == 2
    positions = 100 + 90 + 80 + 70
    # The selection has a row per label position, and takes that much memory, as on a GPU.
    said = [line for line in p.stderr.splitlines() if line.startswith("SELECTED")]
    assert said == [f"SELECTED ({positions}, 256) {allocator_bytes([torch.empty(positions, 256)])}"] * 2, p.stderr[-3000:]


TRITON_KERNEL = """
import torch
import triton
import triton.language as tl

@triton.jit
def scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)

@triton.autotune(configs=[triton.Config({"BLOCK": 256}), triton.Config({"BLOCK": 1024})], key=["n"])
@triton.jit
def shift(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        before = torch.cuda.memory_allocated()
        out = torch.empty_like(x)
        scale[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        shifted = torch.empty_like(out)
        shift[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](out, shifted, x.numel())
        print("GREW", torch.cuda.memory_allocated() - before, shifted.is_cuda)
        return shifted

    @staticmethod
    def backward(ctx, grad):
        return grad * 2

model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    Scale.apply(model(torch.randn(64, 1024, device="cuda"))).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_scripts_own_triton_kernels_launch_as_nothing_into_what_the_step_allocated(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="Triton is not installed for this Python")
    script = _script(tmp_path, TRITON_KERNEL)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(p.stdout)["run"]
    assert run["steps"] == 2, run
    assert any(n.startswith("the script's Triton kernels (first scale)") for n in run["notes"]), run["notes"]
    # The launches allocate nothing: the memory is the two buffers they write, 64 x 1024 floats each.
    grew = [line for line in p.stderr.splitlines() if line.startswith("GREW")]
    assert grew == [f"GREW {2 * 64 * 1024 * 4} True"] * 2, p.stderr[-3000:]


#: A check of mixed precision before training, as YOLO's trainer makes: a fused convolution (its
#: bias kept) run on the same images in float32 and, under autocast, given them in half
#: precision, inside ``inference_mode``; the two predictions compared with ``allclose``.
AMP_CHECK = """
    import torch
    from torch import nn

    conv = nn.Conv2d(3, 64, 3, padding=1).cuda().eval()
    images = torch.zeros(8, 3, 256, 256, device="cuda")
    with torch.inference_mode():
        full = conv(images)
        with torch.autocast("cuda"):
            half = conv(images.half())
        same = full.shape == half.shape and torch.allclose(full, half.float(), atol=0.5)
    print("AMP", same, half.dtype, torch.equal(full, full))
"""


def test_predictions_compared_in_full_and_half_precision_under_inference_mode(tmp_path: Path) -> None:
    p = subprocess.run([OOMKIT, "preflight", "--json", "--", sys.executable, str(_script(tmp_path, AMP_CHECK))],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    # Autocast casts the weight and bias down to meet the half-precision images, as on a GPU.
    assert "AMP True torch.float16 True" in p.stderr, p.stderr[-3000:]
    run = json.loads(p.stdout)["run"]
    # Both predictions are held at the end: 8 x 64 x 256 x 256 in float32, and in float16.
    assert run["peak_allocated_bytes"] >= 8 * 64 * 256 * 256 * (4 + 2), run
    # The comparisons read values the step does not have, as zeros, and say so.
    assert any("taken as 0" in n and ":11 (<module>)" in n for n in run["notes"]), run["notes"]


#: A classic loop: modules that hold no tensor (a loss, a matcher of its own made of one) called on
#: the models' outputs, beside a model whose weights are plain tensors it keeps as attributes.
LOSS_MODULES = """
import torch
from torch import nn

class Matcher(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.SmoothL1Loss()

    def forward(self, a, b):
        return self.inner(a, b)

class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.zeros(256, 64, device="cuda", requires_grad=True)

    def forward(self, x):
        return x @ self.w

model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 8192)).cuda()
plain = Plain()
criterion, matcher = nn.CrossEntropyLoss(), Matcher()
opt = torch.optim.SGD([*model.parameters(), plain.w], lr=0.1)
for _ in range(3):
    x = torch.randn(512, 256, device="cuda")
    y = torch.randint(0, 8192, (512,), device="cuda")
    loss = criterion(model(x), y) + matcher(plain(x), torch.zeros(512, 64, device="cuda"))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_loss_module_called_on_the_output_is_no_forward_of_a_model(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, LOSS_MODULES), "--no-fixes", cwd=tmp_path)
    # Two models' forwards a step; the loss and the matcher are functions of their outputs.
    assert run["steps"] == 2 and run["forwards"] == 4, run
    # The loss's log-probabilities (512 x 8192 floats) are still kept for its backward.
    assert run["by_role"]["activations"] >= 512 * 8192 * 4, run["by_role"]


OPTIMIZER_IN_BACKWARD = """
import torch
from torch import nn

model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda()
# One optimizer per parameter, stepped as its gradient is accumulated (torchtune's optimizer_in_bwd).
optimizers = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}

def step_now(p):
    optimizers[p].step()
    optimizers[p].zero_grad()

for p in model.parameters():
    p.register_post_accumulate_grad_hook(step_now)
for _ in range(3):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
"""


def test_optimizers_stepped_in_backward_are_one_step_with_it(tmp_path: Path) -> None:
    # Each parameter's step runs inside the backward: the training step is the backward, not each of 8 steps.
    run = preflight_run(_script(tmp_path, OPTIMIZER_IN_BACKWARD), cwd=tmp_path)
    assert run["steps"] == 2 and run["forwards"] == 2, run
    # Every weight's two moments exist from the first step on; no gradient outlives its own step.
    assert run["by_role"]["optimizer_state"] == 2 * 4 * LINEAR_1024, run["by_role"]
    assert run["by_role"]["gradients"] <= 1024 * 1024 * 4, run["by_role"]


NESTED_OPTIMIZERS = """
import torch
from torch import nn

class Both(torch.optim.Optimizer):
    # A container that is an optimizer itself, stepping the ones it holds (torchtitan's way).
    def __init__(self, optimizers):
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none)

model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda()
opt = Both([torch.optim.AdamW(model[0].parameters()), torch.optim.SGD(model[1].parameters(), lr=0.1)])
for _ in range(3):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_container_of_optimizers_steps_once_a_step(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, NESTED_OPTIMIZERS), cwd=tmp_path)
    # Two training steps, each the container's step and the two it runs inside.
    assert run["steps"] == 2 and run["forwards"] == 2, run
    assert run["by_role"]["optimizer_state"] == 2 * LINEAR_1024, run["by_role"]


FLEX_ATTENTION_EAGER = """
import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

B, H, L, D = 2, 4, 512, 64

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v).transpose(1, 2).reshape(B, L, H * D)

model = Attn().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(B, L, H * D, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_flex_attention_called_eagerly_holds_its_scores_as_on_a_gpu(tmp_path: Path) -> None:
    # FlexAttention checks its inputs are on CUDA, and has no rule for a dispatch mode of its own:
    # called without torch.compile, PyTorch runs its dense implementation, which holds the scores.
    run = preflight_run(_script(tmp_path, FLEX_ATTENTION_EAGER), cwd=tmp_path)
    assert run["steps"] == 2, run
    scores = 2 * 4 * 512 * 512 * 4
    assert run["peak_allocated_bytes"] >= scores, run["peak_allocated_bytes"]


def test_flex_attention_compiled_on_its_own_is_the_fused_kernel_forward_and_backward(tmp_path: Path) -> None:
    # torchtune and torchtitan call torch.compile(flex_attention): one fused kernel, whose
    # forward holds the output and a float32 log-sum-exp per row, and no matrix of scores;
    # nor does its backward (the dense backward would hold the scores and their gradient).
    source = FLEX_ATTENTION_EAGER.replace(
        "from torch.nn.attention.flex_attention import flex_attention",
        "from torch.nn.attention.flex_attention import flex_attention as flex\nflex_attention = torch.compile(flex, dynamic=False)",
    )
    run = preflight_run(_script(tmp_path, source), cwd=tmp_path)
    assert run["steps"] == 2, run
    scores = 2 * 4 * 512 * 512 * 4
    # cuBLAS's workspaces (64 MiB) are live from the first step's inputs on: the forward adds less
    # than the scores to them, the backward (with the gradients) less than twice; the dense
    # kernel adds four times the scores to the forward and eight to the backward.
    peaks = run["phase_peaks"]
    assert peaks["forward"] - peaks["inputs"] < scores and peaks["backward"] - peaks["inputs"] < 2 * scores, peaks
    assert run["by_role"]["temporaries"] < scores, run["by_role"]
    # What the forward keeps for the backward: the output and the log-sum-exp, as the fused kernel makes them.
    out, lse = 2 * 4 * 512 * 64 * 4, 2 * 4 * 512 * 4
    assert run["by_role"]["activations"] >= out + lse, run["by_role"]
    assert not any("flex" in n.lower() or "not modelled" in n for n in run["notes"]), run["notes"]


FLEX_BLOCK_COMPILED = """
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex = torch.compile(flex_attention, dynamic=False)
B, H, L, D = 2, 4, 512, 64

def causal(b, h, q, kv):
    return q >= kv

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.out = nn.Linear(H * D, H * D)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        y = flex(q, k, v, block_mask=mask).transpose(1, 2).reshape(B, L, H * D)
        return nn.functional.gelu(self.out(y)) * 2 + 1

model = Block().cuda()
model.compile()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mask = create_block_mask(causal, B, None, L, L, device="cuda")
for _ in range(3):
    model(torch.randn(B, L, H * D, device="cuda"), mask).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_compiled_block_given_a_block_mask_is_captured_with_its_attention_fused(tmp_path: Path) -> None:
    # A BlockMask (tensors, sizes and a function) is no input AOTAutograd takes: before, the block
    # ran eager ("all flat_args must be KNOWN_TYPES"). Held out of the inputs and read as a constant,
    # the block is captured, and the compiled attention inside it is one fused operator.
    run = preflight_run(_script(tmp_path, FLEX_BLOCK_COMPILED), cwd=tmp_path)
    assert run["steps"] == 2, run
    assert any("torch.compile (inductor) was modelled" in n for n in run["notes"]), run["notes"]
    assert not any("could not capture" in n for n in run["notes"]), run["notes"]
    # Beside cuBLAS's workspaces (role "other"), the step holds less than twice the scores at its
    # peak; the dense attention would hold several times them.
    scores = 2 * 4 * 512 * 512 * 4
    assert run["peak_allocated_bytes"] - run["by_role"]["other"] < 2 * scores, run["by_role"]
    # The model's own compile() replaces its call, hooks and all: its forward is still the step's
    # forward phase, and what it keeps for the backward its activations (before, temporaries).
    assert run["forwards"] == 2 and "forward" in run["phase_peaks"], run
    assert run["by_role"]["activations"] > 0, run["by_role"]


FLEX_BLOCK_SELECTIVE = FLEX_BLOCK_COMPILED.replace(
    "model = Block().cuda()",
    """import sys
from functools import partial
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

SAVED = {"attention": [torch.ops.higher_order.flex_attention], "nothing": []}[sys.argv[1]]

def policy(ctx, func, *args, **kwargs):
    # torchtitan's way: the attention's outputs named by its operator, the rest recomputed.
    return CheckpointPolicy.MUST_SAVE if func in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, mask):
        contexts = partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.block, x, mask, use_reentrant=False, context_fn=contexts)

model = Checkpointed().cuda()""",
)


def test_a_selective_checkpoint_inside_a_compiled_block_saves_the_attention_its_policy_names(tmp_path: Path) -> None:
    # Inside a captured graph compiled FlexAttention is preflight's one operator; a policy that
    # names flex_attention (torchtitan's) is asked of it as of flex_attention, as of Dynamo's graph.
    script = _script(tmp_path, FLEX_BLOCK_SELECTIVE)
    saved, recomputed = (preflight_run(script, cwd=tmp_path, args=(kind,)) for kind in ("attention", "nothing"))
    for run in (saved, recomputed):
        assert run["steps"] == 2 and not any("could not capture" in n for n in run["notes"]), run["notes"]
    # Saving the attention keeps its output and log-sum-exp for the backward: the rest is recomputed either way.
    out, lse = 2 * 4 * 512 * 64 * 4, 2 * 4 * 512 * 4
    kept = saved["by_role"]["activations"] - recomputed["by_role"]["activations"]
    assert kept >= out + lse, (saved["by_role"], recomputed["by_role"])


CHUNKED_HEAD = """
import torch
from torch import nn

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.output = nn.Linear(64, 1000)

    def forward(self, x):
        return self.body(x)  # the hidden states: the loss runs the output projection itself

model = LM().cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    hidden = model(torch.randn(8, 256, 64, device="cuda"))
    target = torch.randint(0, 1000, (8, 256), device="cuda")
    # torchtitan's chunked loss: the model's own output projection, chunk by chunk, after its forward.
    loss = sum(
        nn.functional.cross_entropy(model.output(h).flatten(0, 1), t.flatten())
        for h, t in zip(hidden.chunk(4, dim=1), target.chunk(4, dim=1))
    )
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_models_own_layer_run_after_its_forward_continues_that_forward(tmp_path: Path) -> None:
    # Each chunk's output projection is a call of one of the model's modules outside its forward:
    # part of the step's forward, not a forward of its own (torchtitan's debug model read 18 for 2 steps).
    run = preflight_run(_script(tmp_path, CHUNKED_HEAD), cwd=tmp_path)
    assert run["steps"] == 2 and run["forwards"] == 2, run
    # The chunks' logits, kept for the backward, are the step's activations.
    logits = 4 * 8 * 64 * 1000 * 4
    assert run["by_role"]["kv_cache"] == 0 and run["by_role"]["activations"] >= logits, run["by_role"]


VARYING = """
import torch
from torch import nn

model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with torch.no_grad():
    model(torch.zeros(8, 999, dtype=torch.long, device="cuda"))  # an evaluation first: not a step
for seq in (64, 128, 96):
    ids = torch.randint(0, 1000, (2, seq), device="cuda")
    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_answer_says_the_sequence_lengths_its_steps_ran_at(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, VARYING), "--steps", "2")
    said = [n for n in run["notes"] if "tokens (batch x sequence" in n]
    assert said == [
        "the measured steps ran at 2 x 64, 2 x 128 tokens (batch x sequence, at each step's first embedding lookup); "
        "activations grow with the sequence, so a batch of longer sequences than these holds more"
    ], run["notes"]


CUDA_GRAPH = """
import torch
from torch import nn

MIB = 1 << 20
model = nn.Linear(1024, 1024, bias=False).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
static_x = torch.randn(16, 1024, device="cuda")

def step():
    # A 64 MiB temporary, freed before the step ends.
    scratch = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del scratch
    model(static_x).sum().backward()

step()  # warm-up, eager
opt.step()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    step()
for _ in range(2):
    graph.replay()
    # The same temporary outside the graph: its block is the graph's, not the default pools'.
    outside = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del outside
    opt.step()
"""


def test_a_cuda_graph_captures_into_its_own_pool_and_replays_without_allocating(tmp_path: Path) -> None:
    # Creating a graph or a pool needs the driver: stood in. The capture runs as the code runs,
    # from the graph's private pool; a replay allocates nothing.
    run = preflight_run(_script(tmp_path, CUDA_GRAPH), cwd=tmp_path)
    assert run["steps"] == 2, run
    assert any("a CUDA graph was captured" in n for n in run["notes"]), run["notes"]
    # The capture's freed 64 MiB stays in the graph's pool: the eager one after it takes a segment
    # of its own, reserved beside the peak allocated (one pool for both would reuse the block).
    assert run["peak_reserved_bytes"] - run["peak_allocated_bytes"] >= 64 * (1 << 20), run


#: Three copies of the weights kept in step with them after each optimizer step, as three
#: well-known ways of keeping an EMA do it: an averaged model (PyTorch's own, a deep copy
#: updated with a multi-tensor lerp), a list of shadow tensors updated by subtracting a share
#: of the difference, and a deep copy updated with ``_foreach_lerp_`` and evaluated without
#: gradients. Beside them, a frozen teacher whose forward only reads its weights, and a copy
#: of the best weights cloned anew each step: neither is kept in step.
EMA_COPIES = """
    import copy
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = nn.Linear(1024, 1024).cuda()
    teacher = nn.Linear(1024, 1024).cuda().requires_grad_(False)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    shadow = [p.detach().clone() for p in model.parameters()]
    kept = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        x = torch.randn(64, 1024, device="cuda")
        with torch.no_grad():
            target = teacher(x)
        nn.functional.mse_loss(model(x), target).backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(model)
        with torch.no_grad():
            for s, p in zip(shadow, model.parameters()):
                s.sub_(0.001 * (s - p))
            torch._foreach_lerp_(list(kept.parameters()), list(model.parameters()), 0.001)
            kept(x)
        best = [p.detach().clone() for p in model.parameters()]
"""


def test_copies_of_the_weights_kept_in_step_with_them_are_the_ema(tmp_path: Path) -> None:
    run = preflight_run(_script(tmp_path, EMA_COPIES), "--no-fixes", cwd=tmp_path)
    # The three copies, each the Linear's weight and bias; not the teacher nor the clones.
    assert run["by_role"]["ema"] == 3 * LINEAR_1024, run["by_role"]
    # The model and its teacher are the weights; the copies evaluated without gradients are not.
    assert run["by_role"]["parameters"] == 2 * LINEAR_1024, run["by_role"]
    assert run["by_role"]["optimizer_state"] == 2 * LINEAR_1024, run["by_role"]
    assert any(n.startswith("an EMA of the weights") for n in run["notes"]), run["notes"]


#: Mixed precision with a loss scaler, a gradient norm clipped, and the step skipped where that
#: norm is not finite (as many training scripts guard against a divergence): the norm comes from
#: data the step does not have, and must not read as NaN, which would skip every step; nor may
#: the loss, a value taken as zero, be unequal to itself (``isnan`` asks ``loss != loss``).
SKIPS_A_NON_FINITE_NORM = """
    import sys
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    for step in range(4):
        x, y = torch.randn(64, 3, 32, 32).cuda(), torch.randint(0, 10, (64,)).cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if torch.isnan(loss) or not torch.isfinite(norm):
            print("SKIPPED", float(loss), float(norm), file=sys.stderr)
            opt.zero_grad()
            continue
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


def _answer_and_output(tmp_path: Path, body: str) -> tuple[dict[str, Any], str]:
    """The answer of ``oomkit preflight --json --no-fixes`` on a script of ``body``, and what the
    script printed (its output goes to standard error under --json)."""
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--no-fixes", "--", sys.executable, str(_script(tmp_path, body))],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["run"], p.stderr


def test_a_norm_from_data_the_step_lacks_is_finite_and_the_step_is_taken(tmp_path: Path) -> None:
    run, printed = _answer_and_output(tmp_path, SKIPS_A_NON_FINITE_NORM)
    assert "SKIPPED" not in printed, printed[-2000:]
    # Two steps taken, each keeping SGD's momentum: one buffer per weight.
    weights = sum(t.numel() * 4 for t in (torch.empty(64, 3, 3, 3), torch.empty(64), torch.empty(64), torch.empty(64), torch.empty(10, 64), torch.empty(10)))
    assert run["steps"] == 2 and run["by_role"]["optimizer_state"] >= weights, run


#: Selections whose size the data decides, on data the step does not have (a layer's output):
#: the script reads the allocator's count around each, as a user checking them on a GPU would.
DATA_SIZED = """
    import sys
    import torch
    from torch import nn

    model = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        h = model(torch.randn(256, 1024, device="cuda"))
        keep = h > 0
        sizes = []
        for select in (lambda: torch.nonzero(keep), lambda: h[keep], lambda: torch.unique(h.detach())):
            before = torch.cuda.memory_allocated()
            made = select()
            sizes.append((tuple(made.shape), torch.cuda.memory_allocated() - before))
            del made
        print("SIZES", sizes, file=sys.stderr)
        (h[keep].sum() + h.sum()).backward()
        opt.step()
        opt.zero_grad()
"""


def test_a_selection_the_data_sizes_is_made_at_its_largest_and_noted(tmp_path: Path) -> None:
    run, printed = _answer_and_output(tmp_path, DATA_SIZED)
    n = 256 * 1024
    # Every element selected: its two coordinates (int64), its value (float32), every value distinct.
    want = [((n, 2), n * 2 * 8), ((n,), n * 4), ((n,), n * 4)]
    assert f"SIZES {want}" in printed, printed[-2000:]
    assert run["steps"] == 2
    said = [note for note in run["notes"] if "sized at their largest" in note]
    # Four a step (the loss's selection too), in both steps, the first at the first selection's line.
    assert said and said[0].startswith("8 operation(s)") and "nonzero at train.py:12 (<lambda>)" in said[0], run["notes"]


#: An object detector's sampler (torchvision's BalancedPositiveNegativeSampler, read there, in this
#: project's words): of positives and negatives the data decides, a fixed number of each chosen at
#: random, each kept as a mask of zeros with the chosen positions set, and the two masks' union
#: selected; beside it, a mask written with data the step lacks after its positions were set.
SAMPLED = """
    import sys
    import torch
    from torch import nn

    head = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for step in range(3):
        feats = torch.randn(4096, 1024, device="cuda")
        labels = head(feats)[:, 0] > 0
        positive, negative = torch.where(labels)[0], torch.where(~labels)[0]
        num_pos = min(positive.numel(), 64)
        num_neg = min(negative.numel(), 256 - num_pos)
        chosen_pos = positive[torch.randperm(positive.numel(), device="cuda")[:num_pos]]
        chosen_neg = negative[torch.randperm(negative.numel(), device="cuda")[:num_neg]]
        pos_mask = torch.zeros_like(labels, dtype=torch.uint8)
        neg_mask = torch.zeros_like(labels, dtype=torch.uint8)
        pos_mask[chosen_pos] = 1
        neg_mask[chosen_neg] = 1
        sampled = torch.where(pos_mask | neg_mask)[0]
        both = torch.where(torch.cat([pos_mask, neg_mask]))[0]
        pos_mask |= labels
        rewritten = torch.where(pos_mask)[0]
        print("SAMPLED", tuple(sampled.shape), tuple(both.shape), tuple(rewritten.shape), file=sys.stderr)
        head(feats[sampled]).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""


def test_a_samplers_chosen_positions_select_no_more_than_it_chose(tmp_path: Path) -> None:
    run, printed = _answer_and_output(tmp_path, SAMPLED)
    # 64 positives and 192 negatives chosen of 4,096 (every one of them, at their largest): the
    # union selects at most 256, as on a GPU; the masks side by side as many; a mask written
    # with the data's own comparison after its positions were set, at its largest again.
    assert "SAMPLED (256,) (256,) (4096,)" in printed, printed[-2000:]
    assert run["steps"] == 2


#: Masks a contrastive loss builds from values it knows, larger than the values kept for any
#: small tensor (512 x 512): the pairs off the diagonal of a batch's similarities, selected and
#: reshaped to one row per sample, as NT-Xent losses do; beside them a mask made on the host and
#: uploaded, one written in place through a view, and one written with data the step lacks.
KNOWN_MASKS = """
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn

    n = 512
    encoder = nn.Linear(256, 128).cuda()
    opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
    for step in range(2):
        z = F.normalize(encoder(torch.randn(n, 256, device="cuda")), dim=1)
        sim = z @ z.t()
        off = ~torch.eye(n, device="cuda").bool()
        logits = sim[off].reshape(n, n - 1)
        uploaded = torch.eye(n, dtype=torch.bool).cuda()
        keep = torch.ones(n, n, device="cuda")
        keep[0].zero_()
        written = torch.zeros(n, n, dtype=torch.bool, device="cuda")
        written |= sim > 0
        print("SHAPES", tuple(logits.shape), tuple(sim[~uploaded].shape), tuple(sim[keep.bool()].shape), tuple(sim[written].shape), file=sys.stderr)
        target = torch.cat([torch.arange(n // 2, n, device="cuda") - 1, torch.arange(n // 2, device="cuda")])
        F.cross_entropy(logits, target).backward()
        opt.step()
        opt.zero_grad()
"""


def test_masks_the_script_builds_from_values_it_knows_select_what_they_select_on_a_gpu(tmp_path: Path) -> None:
    run, printed = _answer_and_output(tmp_path, KNOWN_MASKS)
    n = 512
    shapes = [line for line in printed.splitlines() if line.startswith("SHAPES")]
    # The mask written with the step's own similarities is not known: it selects every pair.
    assert shapes == [f"SHAPES ({n}, {n - 1}) ({n * (n - 1)},) ({n * (n - 1)},) ({n * n},)"] * 2, printed[-2000:]
    said = [note for note in run["notes"] if "sized at their largest" in note]
    assert said and said[0].startswith("2 operation(s)"), run["notes"]


#: An adversarial loop with two optimizers, each stepped every iteration, the critic ``N_CRITIC``
#: times to the generator's once (as a Wasserstein GAN trains): a training step is one iteration.
ADVERSARIAL = """
    import sys
    import torch
    from torch import nn

    n_critic = int(sys.argv[1])
    G = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 784)).cuda()
    D = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
    opt_g = torch.optim.Adam(G.parameters())
    opt_d = torch.optim.Adam(D.parameters())
    for step in range(4):
        for _ in range(n_critic):
            real = torch.randn(256, 784, device="cuda")
            fake = G(torch.randn(256, 128, device="cuda")).detach()
            loss_d = D(fake).mean() - D(real).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
        loss_g = -D(G(torch.randn(256, 128, device="cuda"))).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
"""


@pytest.mark.parametrize("n_critic", [1, 3])
def test_a_loop_of_two_optimizers_steps_each_of_them_in_each_step(tmp_path: Path, n_critic: int) -> None:
    run = preflight_run(_script(tmp_path, ADVERSARIAL), "--no-fixes", args=(str(n_critic),), cwd=tmp_path)
    # Two whole iterations: the critic's three forwards per step and the generator's two.
    assert run["steps"] == 2 and run["forwards"] == 2 * (3 * n_critic + 2), run
    assert len(run["step_peaks"]) == 2, run["step_peaks"]
    g = allocator_bytes([*nn_sizes(128, 1024, 784)])
    d = allocator_bytes([*nn_sizes(784, 1024, 1)])
    # Both optimizers' moments, two per weight.
    assert run["by_role"]["optimizer_state"] >= 2 * (g + d), (g, d, run["by_role"])


def nn_sizes(n_in: int, hidden: int, n_out: int) -> list[torch.Tensor]:
    """The weights of a two-layer perceptron, as tensors of their sizes (never filled)."""
    return [torch.empty(hidden, n_in), torch.empty(hidden), torch.empty(n_out, hidden), torch.empty(n_out)]


#: A router's top-2 choices among 4 experts for 4,096 tokens, each expert's tokens found as a
#: mixture of experts finds them (``torch.where(idx == i)``, or the slices of a one-hot), beside
#: a threshold on the routing weights: all on data the step does not have.
ROUTED = """
    import sys
    import torch
    from torch import nn

    router = nn.Linear(64, 4).cuda()
    opt = torch.optim.SGD(router.parameters(), lr=0.1)
    for step in range(3):
        w, idx = router(torch.randn(4096, 64, device="cuda")).softmax(-1).topk(2, dim=-1)
        by_equality = [int(torch.where(idx == i)[0].shape[0]) for i in range(4)]
        one_hot = nn.functional.one_hot(idx, 4).permute(2, 1, 0)
        by_one_hot = [int(torch.where(one_hot[i])[0].shape[0]) for i in range(4)]
        print("ROWS", by_equality, by_one_hot, int(torch.nonzero(w > 0.3).shape[0]), file=sys.stderr)
        w.sum().backward()
        opt.step()
        opt.zero_grad()
"""


def test_masks_that_split_one_tensor_share_its_elements_at_their_largest(tmp_path: Path) -> None:
    _, printed = _answer_and_output(tmp_path, ROUTED)
    # The experts' tokens add up to the router's 8,192 choices (the first takes them all, as
    # unevenly as routing can go), where each alone at its largest would take them all again;
    # a threshold's selection is every element.
    assert printed.count("ROWS [8192, 0, 0, 0] [8192, 0, 0, 0] 8192") == 2, printed[-2000:]


def test_checkpoints_the_script_saves_leave_the_users_files_as_they_were(tmp_path: Path) -> None:
    # A script that saves as it trains, over the checkpoints a user already has: torch.save of the
    # optimizer, safetensors of a weight, save_pretrained of the model, each loaded back as a
    # resuming or evaluating script does.
    out = tmp_path / "out"
    out.mkdir()
    theirs = {name: f"the user's own {name}\n" for name in ("model.safetensors", "optimizer.pt", "head.safetensors", "best.pt")}
    for name, text in theirs.items():
        (out / name).write_text(text)
    script = _script(
        tmp_path,
        """
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)).cuda()
        # As on a GPU, each storage has an address of its own, and tied weights share one.
        params = dict(model.named_parameters(remove_duplicate=False))
        assert params["lm_head.weight"].data_ptr() == params["transformer.wte.weight"].data_ptr()
        assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
        assert all(p.data_ptr() != 0 for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 512, (2, 32), device="cuda")
        for _ in range(3):
            # What a Trainer saves beside the model: CUDA's random state, asked of torch.cuda.random.
            torch.save({"cuda": torch.cuda.random.get_rng_state_all()}, "out/rng_state.pth")
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            model.save_pretrained("out")
            torch.save(opt.state_dict(), "out/optimizer.pt")
            torch.save(model.state_dict(), "out/best.pt")
            save_file({"head": model.lm_head.weight.detach()}, "out/head.safetensors")
            opt.load_state_dict(torch.load("out/optimizer.pt"))
            model.load_state_dict(torch.load("out/best.pt", map_location="cuda"))
            assert load_file("out/head.safetensors", device="cuda")["head"].shape == (512, 64)
        """,
    )
    run = preflight_run(script, cwd=tmp_path)
    assert run["steps"] == 2, run
    assert {name: (out / name).read_text() for name in theirs} == theirs
    assert any("were not written where it says (the first: out/rng_state.pth)" in n for n in run["notes"]), run["notes"]


def test_a_failure_after_a_checkpointed_backward_names_no_forward(tmp_path: Path) -> None:
    # Checkpointing's recomputation stops early by raising past its modules' forward hooks; once
    # the backward is over, none of them is running, whatever fails next.
    script = _script(
        tmp_path,
        """
        import torch
        from torch.utils.checkpoint import checkpoint_sequential
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(8, 256, device="cuda", requires_grad=True)
            checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
            opt.step()
            if step:
                raise ValueError("a bug in the script's logging")
        """,
    )
    run = preflight_run(script, "--steps", "3")
    failed = [n for n in run["notes"] if "a bug in the script's logging" in n]
    assert failed and "forward" not in failed[0], run["notes"]


def test_a_profiled_step_traces_the_host_alone_and_says_so(tmp_path: Path) -> None:
    # A benchmarking script profiling its steps on CPU and CUDA: tracing CUDA needs the
    # driver, and each operation would log a C++ backtrace around the answer.
    script = _script(
        tmp_path,
        """
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function, schedule
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=2), profile_memory=True) as prof:
            for _ in range(4):
                with record_function("step"):
                    model(torch.randn(32, 512, device="cuda")).sum().backward()
                    opt.step()
                    opt.zero_grad()
                prof.step()
        """,
    )
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert "Failed to record CUDA event" not in p.stderr, p.stderr[-2000:]
    run = json.loads(p.stdout)["run"]
    assert run["steps"] == 2 and run["by_role"]["parameters"] == 2 * 512 * 2048 * 4 + 2048 * 4 + 512 * 4, run
    assert any("profiler traced the host alone" in n for n in run["notes"]), run["notes"]


EVALUATED = """
import torch
import torch.nn.functional as F
body = torch.nn.Linear(256, 256).cuda()
head = torch.nn.Linear(256, 32000).cuda()
with torch.{mode}():
    for _ in range(2):
        hidden = body(torch.randn(8, 128, 256, device="cuda"))
        # The log-probabilities over the vocabulary, a temporary inside cross_entropy.
        loss = F.cross_entropy(head(hidden).flatten(0, 1), torch.zeros(8 * 128, dtype=torch.long, device="cuda"))
        print(f"{{loss.item():.3f}}")
"""


def test_an_evaluation_under_inference_mode_holds_what_it_holds_under_no_grad(tmp_path: Path) -> None:
    # Under torch.inference_mode() (Lightning's validation, many generation scripts) autograd is
    # left out, and with it the decomposition of composite operators: item() reached preflight
    # undecomposed and stopped the script, and the log-probabilities inside cross_entropy went
    # unseen. Both evaluations hold the same memory, as on a GPU.
    runs = {}
    for mode in ("no_grad", "inference_mode"):
        script = tmp_path / f"{mode}.py"
        script.write_text(EVALUATED.format(mode=mode))
        runs[mode] = preflight_run(script, cwd=tmp_path)
    assert runs["inference_mode"]["peak_allocated_bytes"] == runs["no_grad"]["peak_allocated_bytes"], runs
    # The logits and the log-probabilities of 8 x 128 tokens over 32,000 words, in float32, at once.
    assert runs["inference_mode"]["peak_allocated_bytes"] >= 2 * 8 * 128 * 32000 * 4, runs["inference_mode"]


def test_big_model_inference_built_empty_and_dispatched_from_its_checkpoint(tmp_path: Path) -> None:
    # accelerate's big model inference: the model made without memory (init_empty_weights sends
    # each new weight to meta), its checkpoint loaded and dispatched in float16, then a generation
    # under inference_mode. The tied embedding must be the loaded one, as on a GPU.
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "ckpt")
    script = _script(
        tmp_path,
        """
        import torch
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
        from transformers import AutoConfig, AutoModelForCausalLM
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("ckpt"))
        assert model.transformer.wte.weight.is_meta
        model.tie_weights()
        model = load_checkpoint_and_dispatch(model, "ckpt", device_map="auto", no_split_module_classes=["GPT2Block"], dtype=torch.float16)
        assert model.lm_head.weight.dtype == torch.float16 and model.lm_head.weight.is_cuda
        with torch.inference_mode():
            model.generate(torch.randint(0, 512, (2, 16), device="cuda"), max_new_tokens=32, do_sample=False)
        """,
    )
    run = preflight_run(script, cwd=tmp_path)
    # Every weight once in float16 (the output layer is the embedding), in 512-byte blocks.
    # Each block: attention's fused projection and output (weights, biases), the MLP's two layers,
    # two norms; the embeddings of words and positions and the final norm beside them.
    block = (3 * 256 * 256, 3 * 256, 256 * 256, 256, 4 * 256 * 256, 4 * 256, 4 * 256 * 256, 256, 256, 256, 256, 256)
    weights = [512 * 256, 128 * 256, *(n for _ in range(4) for n in block), 256, 256]
    assert run["mode"] == "inference" and run["forwards"] == 32, run
    assert run["by_role"]["parameters"] == sum(-(-n * 2 // 512) * 512 for n in weights), run["by_role"]


def test_a_step_calling_its_modules_one_by_one_keeps_no_cache(tmp_path: Path) -> None:
    # Lightning's validation_step calls the body and the head itself, each a forward of its own:
    # the head reading the body's output is one step's pipeline, not a cache kept for the next.
    script = _script(
        tmp_path,
        """
        import lightning as L
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset

        class Net(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.body, self.head = torch.nn.Linear(256, 256), torch.nn.Linear(256, 8000)

            def training_step(self, batch, _):
                return F.cross_entropy(self.head(self.body(batch[0])), batch[1])

            def validation_step(self, batch, _):
                self.log("val", F.cross_entropy(self.head(self.body(batch[0])), batch[1]))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = TensorDataset(torch.randn(1024, 256), torch.randint(0, 8000, (1024,)))
        trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=4, val_check_interval=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Net(), DataLoader(data, batch_size=128), DataLoader(data, batch_size=1024))
        """,
    )
    run = preflight_run(script, "--steps", "3", cwd=tmp_path)
    assert run["by_role"]["kv_cache"] == 0, run["by_role"]
    # The validation's logits and log-probabilities of 1,024 rows over 8,000 classes, at once.
    assert run["by_role"]["temporaries"] >= 2 * 1024 * 8000 * 4, run["by_role"]
