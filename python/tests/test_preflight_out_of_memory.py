"""The GPU running out as the script runs: CUDA's error raised where the allocator would raise it.

A script that catches ``torch.cuda.OutOfMemoryError`` and halves its batch
(accelerate's ``find_executable_batch_size``, the Trainer's
``auto_find_batch_size``, hand-written loops) must settle, under preflight,
on the batch it would settle on with a GPU of the capacity given, and the
answer must be that batch's; a script that stops with the error, or skips
every batch, is measured whole and told where the GPU ran out.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from oomkit import _native
from preflight_cli import OOMKIT, preflight_run

ROOT = Path(__file__).resolve().parents[2]
HALVING = ROOT / "examples" / "preflight" / "halving.py"
#: ``oomkit preflight``'s exit code where the step does not fit (docs/commands.md).
EXIT_NOTHING_FITS = 5


def _does_not_fit(script: Path, *flags: str, args: tuple[str, ...] = ()) -> tuple[dict, str]:
    """``oomkit preflight --json`` on a script that does not fit: its run, and what it printed to stderr."""
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--no-fixes", *flags, "--", sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == EXIT_NOTHING_FITS, p.stderr
    return json.loads(p.stdout)["run"], p.stderr


def test_a_loop_that_halves_its_batch_settles_where_the_gpu_has_room_and_answers_for_that_batch(tmp_path: Path) -> None:
    # 2 GiB: the first step at 65,536 rows needs a 1 GiB block beside the 1 GiB of its forward,
    # and runs out; at 32,768 the first step fits (AdamW has no state yet) and the second runs
    # out; 16,384 fits both.
    halved = preflight_run(HALVING, "--capacity", "2GiB")
    oom = halved["out_of_memory"]
    assert oom["raised"] == 2 and oom["went_on"] and oom["ended"] is None
    assert oom["first_bytes"] == 1 << 30 and oom["first_at"].startswith("halving.py:27")
    assert halved["fits"]
    # After the GPU ran out, the steps asked for (2) are counted at the batch it went on with.
    assert halved["steps"] == 3
    # The answer is the batch it settled on: the same figures as the script started there.
    direct = preflight_run(HALVING, "--capacity", "2GiB", args=("--batch-size", "16384"))
    assert direct["out_of_memory"] is None
    assert halved["peak_allocated_bytes"] == direct["peak_allocated_bytes"]
    weights = ("parameters", "gradients", "optimizer_state")
    assert [halved["by_role"][r] for r in weights] == [direct["by_role"][r] for r in weights]
    # Its reserved memory holds the cache the larger attempts left, within the capacity, as on a GPU.
    assert direct["peak_reserved_bytes"] <= halved["peak_reserved_bytes"] <= halved["capacity_bytes"]


def test_the_error_the_script_catches_reads_as_cudas_and_frees_the_failed_forward(tmp_path: Path) -> None:
    script = tmp_path / "catch.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys, torch
            from torch import nn

            model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            seen = open(sys.argv[1], "w")
            for batch in (262144, 4096, 4096):
                try:
                    model(torch.randn(batch, 1024, device="cuda")).square().mean().backward()
                except torch.OutOfMemoryError as e:
                    # What is held once the failed forward has let go (its tensors are the traceback's until here).
                    print(json.dumps({"message": str(e), "class": type(e).__name__, "runtime": isinstance(e, RuntimeError)}), file=seen, flush=True)
                    continue
                # (Preflight ends the script at its second step's end: what it holds then is said before.)
                print(json.dumps({"allocated": torch.cuda.memory_allocated(), "ooms": torch.cuda.memory_stats()["num_ooms"]}), file=seen, flush=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
            """
        )
    )
    out = tmp_path / "seen.jsonl"
    run = preflight_run(script, "--capacity", "4GiB", args=(str(out),))
    failed, first, second = map(json.loads, out.read_text().splitlines())
    assert failed["class"] == "OutOfMemoryError" and failed["runtime"]
    message = failed["message"]
    # Worded as CUDA's allocator words it, so that what reads the message (oomkit's own parser,
    # accelerate's should_reduce_batch_size, Lightning's is_oom_error) reads it the same.
    # (The 262,144-row forward's input is 1 GiB; its first layer's output, 4 GiB, is refused.)
    assert message.startswith("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 4.00 GiB")
    assert _native.oom_kind(message) is not None
    assert _native.oom_requested_bytes(message) == 4 << 30 == run["out_of_memory"]["first_bytes"]
    # After the backward of a 4,096-row batch: the weights, their gradients, cuBLAS's two workspaces
    # and what the forward kept; nothing of the failed forward's 1 GiB input.
    weights = 4 * (1024 * 4096 + 4096 + 4096 * 1024 + 1024)
    kept = 4 * 4096 * (1024 + 4096 + 4096 + 1024)
    assert first["allocated"] == second["allocated"] < 2 * weights + 2 * (32 << 20) + kept
    # The allocator counts the failure, as memory_stats()["num_ooms"] does on a GPU.
    assert first["ooms"] == second["ooms"] == 1
    assert run["fits"] and run["out_of_memory"]["raised"] == 1 and run["out_of_memory"]["went_on"]


def test_a_script_that_does_not_catch_it_is_measured_whole_and_told_where_it_ran_out(tmp_path: Path) -> None:
    run, stderr = _does_not_fit(HALVING, "--capacity", "1GiB", args=("--batch-size", "1", "--width", "65536"))
    # Its weights alone (2 x 1024 x 65,536 floats, 512 MiB) and AdamW's two moments do not fit 1 GiB:
    # the first step runs out, at batch 1 the script raises it again, and stops.
    oom = run["out_of_memory"]
    assert oom["raised"] == 1 and not oom["went_on"]
    assert oom["first_at"].startswith("halving.py:")
    assert "running it again with nothing refused" in stderr
    # The figures are of the run made again, refusing nothing: its whole steps.
    assert run["steps"] == 2 and not run["fits"]
    params = 4 * (1024 * 65536 + 65536 + 65536 * 1024 + 1024)
    assert run["by_role"]["parameters"] >= params and run["by_role"]["optimizer_state"] >= 2 * params


@pytest.mark.parametrize("ended_by", ["skips", "gives up"])
def test_a_script_that_skips_or_gives_up_after_the_error_is_measured_whole(tmp_path: Path, ended_by: str) -> None:
    script = tmp_path / "skip.py"
    if ended_by == "skips":
        # A loop that skips a batch that does not fit, and every batch is too large.
        body = """
            for i in range(1000):
                try:
                    train(65536)
                except torch.cuda.OutOfMemoryError:
                    print("skipped batch", i, flush=True)
        """
    else:
        # A search that gives up with an error of its own.
        body = """
            for batch in (65536, 32768):
                try:
                    train(batch)
                    break
                except torch.cuda.OutOfMemoryError:
                    pass
            else:
                raise RuntimeError("no batch size fits")
        """
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            model = nn.Linear(4096, 4096).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def train(batch):
                model(torch.randn(batch, 4096, device="cuda")).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            """
        )
        + textwrap.dedent(body)
    )
    run, _ = _does_not_fit(script, "--capacity", "512MiB")
    oom = run["out_of_memory"]
    assert not oom["went_on"] and oom["first_at"].startswith("skip.py:")
    if ended_by == "skips":
        assert oom["raised"] == 33 and oom["ended"].startswith("it caught 33 in a row without completing a step")
    else:
        assert oom["raised"] == 2 and oom["ended"].startswith("RuntimeError: no batch size fits (at skip.py:")
    # Measured whole at the first batch (its 1 GiB input alone is over the capacity), where with
    # nothing refused the search's first batch runs, and the script ends after its one step.
    assert run["steps"] == (2 if ended_by == "skips" else 1) and run["peak_allocated_bytes"] > 1 << 30


def test_accelerates_batch_search_settles_where_the_gpu_has_room(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    script = tmp_path / "search.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch
            from torch import nn
            from accelerate.utils import find_executable_batch_size

            model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
            opt = torch.optim.AdamW(model.parameters())

            @find_executable_batch_size(starting_batch_size=int(sys.argv[1]))
            def train(batch_size):
                print("batch", batch_size, flush=True)
                for _ in range(3):
                    model(torch.randn(batch_size, 1024, device="cuda")).square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            train()
            """
        )
    )
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "2GiB", "--", sys.executable, str(script), "131072"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    searched = json.loads(p.stdout)["run"]
    settled = int([line for line in p.stderr.splitlines() if line.startswith("batch ")][-1].split()[1])
    assert searched["fits"] and searched["out_of_memory"]["went_on"] and searched["out_of_memory"]["raised"] >= 1
    assert settled < 131072
    # The batch it settled on fits, started there, with its figures (to the blocks the allocator
    # hands out, which hold a remainder too small to split off, and depend on what it cached from
    # the larger attempts).
    direct = preflight_run(script, "--capacity", "2GiB", args=(str(settled),))
    assert direct["out_of_memory"] is None
    assert searched["peak_allocated_bytes"] == pytest.approx(direct["peak_allocated_bytes"], rel=0.005)


TRAINER = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64))

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 100000
    def __getitem__(self, i):
        ids = torch.randint(0, 1000, (64,))
        return {"input_ids": ids, "labels": ids}

args = TrainingArguments(
    output_dir=sys.argv[1], per_device_train_batch_size=180, auto_find_batch_size=True, max_steps=3,
    report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no",
)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
"""


def test_the_trainers_auto_find_batch_size_settles_below_the_batch_that_ran_out(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = tmp_path / "auto.py"
    script.write_text(TRAINER)
    run = preflight_run(script, "--capacity", "512MiB", args=(str(tmp_path / "out"),))
    oom = run["out_of_memory"]
    assert run["fits"] and oom["went_on"] and oom["raised"] >= 1
    assert oom["first_at"].startswith("auto.py:")
    # Each step measured ran at the batch the Trainer settled on (an attempt that ran out is no step).
    tokens = next(n for n in run["notes"] if n.startswith("the measured steps ran at "))
    batches = [int(b) for b in re.findall(r"(\d+) x 64", tokens)]
    assert len(batches) == 3 and all(b < 180 for b in batches), tokens


AUTO_BATCH = """
import torch, oomkit
from torch import nn

model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.AdamW(model.parameters())

@oomkit.auto_batch(batch_size=65536, effective_batch=65536)
def train(micro_batch, grad_accum):
    for step in range(3):
        for _ in range(grad_accum):
            x = torch.randn(micro_batch, 1024, device="cuda")
            (model(x).square().mean() / grad_accum).backward()
            del x
        opt.step()
        opt.zero_grad(set_to_none=True)

train()
"""


def test_oomkits_own_auto_batch_steps_down_from_the_errors_figures(tmp_path: Path) -> None:
    script = tmp_path / "auto_batch.py"
    script.write_text(AUTO_BATCH)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "2GiB", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    run = json.loads(p.stdout)["run"]
    # auto_batch reads the error's figures as a GPU's, tells a capacity OOM, and keeps the
    # effective batch: 65,536 x 1 and 32,768 x 2 run out, 16,384 x 4 fits.
    steps = re.findall(r"out of memory on this rank \(capacity\); retrying with micro-batch (\d+) x accumulation (\d+)", p.stderr)
    assert steps == [("32768", "2"), ("16384", "4")], p.stderr
    assert run["fits"] and run["out_of_memory"]["raised"] == 2 and run["out_of_memory"]["went_on"]
    assert run["grad_accum"] == 4


TUNED = """
import sys
import torch, lightning as L
from torch import nn
from lightning.pytorch.tuner import Tuner

class Classifier(L.LightningModule):
    def __init__(self, batch_size=32):
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 10))
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(1 << 14, 1024), torch.randint(0, 10, (1 << 14,)))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

search = sys.argv[1] == "search"
model = Classifier(32 if search else int(sys.argv[1]))
trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[2])
if search:
    Tuner(trainer).scale_batch_size(model, mode="power")
trainer.fit(model)
"""


def test_lightnings_batch_size_finder_runs_first_and_the_run_after_it_is_measured(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    script = tmp_path / "tuned.py"
    script.write_text(TUNED)
    # Against 256 MiB the search doubles from 2 and runs out at 4,096 (the forward's 64 MiB
    # input and 64 MiB hidden layer beside the state); the run trains at 2,048.
    tuned = preflight_run(script, "--capacity", "256MiB", args=("search", str(tmp_path / "t")))
    assert any("batch-size search (Lightning's BatchSizeFinder) ran first and found 2048" in n for n in tuned["notes"]), tuned["notes"]
    assert tuned["fits"] and tuned["steps"] == 2 and len(tuned["step_peaks"]) == 2
    assert tuned["out_of_memory"]["went_on"] and tuned["out_of_memory"]["raised"] == 1
    # The same figures as the run started at 2,048 without a search (to the blocks the allocator
    # hands out, which depend on what the trials left cached).
    direct = preflight_run(script, "--capacity", "256MiB", args=("2048", str(tmp_path / "d")))
    assert direct["out_of_memory"] is None
    assert tuned["peak_allocated_bytes"] == pytest.approx(direct["peak_allocated_bytes"], rel=0.005)
    assert tuned["step_peaks"] == pytest.approx(direct["step_peaks"], rel=0.005)
