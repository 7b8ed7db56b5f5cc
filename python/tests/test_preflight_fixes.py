"""What would make it fit, measured: each change preflight makes to a script checked against the script changed by hand.

`oomkit preflight` reruns the user's unchanged script with one change at a
time (activation checkpointing of its repeated blocks, bf16 autocast, 8-bit
AdamW, expandable segments, half the micro-batch), then all of them, and
then the model sharded with FSDP over 8 GPUs. Each figure must be what
preflight measures on the script written with that change by hand.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from preflight_cli import OOMKIT

#: The script, as the examples have it (run from a copy named train.py).
SCRIPT = (Path(__file__).resolve().parents[2] / "examples" / "preflight" / "blocks.py").read_text()


#: The row of the sharding fix, for a script run on one GPU.
SHARDED = "FSDP over 8 GPUs (fully_shard of each block)"

#: The row of the allocator's expandable segments.
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"

#: The row of activation checkpointing.
CHECKPOINT = "activation checkpointing of the model's repeated blocks"

#: The row of bitsandbytes' 8-bit AdamW.
ADAM8 = "8-bit AdamW (bitsandbytes) for torch.optim.AdamW"

#: The row of every change at once, on the script's own GPUs.
ALL = "all of the above"


def preflight(script: Path, *args: str, capacity: str = "100MiB") -> dict:
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", capacity, *args], capture_output=True, text=True, timeout=600, cwd=script.parent
    )
    assert p.returncode in (0, 5), p.stderr[-3000:]
    return json.loads(p.stdout)


def test_each_fix_is_what_the_script_changed_by_hand_measures(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    doc = preflight(script, "--micro-batch", "64", "--", sys.executable, str(script), "--batch", "{batch}")
    assert doc["run"]["fits"] is False, doc["run"]["peak_reserved_bytes"]
    rows = {row["change"]: row for row in doc["fixes"]}
    assert list(rows)[-2:] == ["all of the above", SHARDED]
    by_hand = {
        "activation checkpointing of the model's repeated blocks": ("--batch", "64", "--checkpoint"),
        "bf16 autocast around the model's forward": ("--batch", "64", "--autocast"),
        "micro-batch 32 x accumulation 2": ("--batch", "32"),
    }
    if importlib.util.find_spec("bitsandbytes") is not None:
        by_hand[ADAM8] = ("--batch", "64", "--adam8")
    # Sharded by hand: the script launched on 8 GPUs, each block and the model given to fully_shard.
    by_hand[SHARDED] = ("--batch", "64", "--fsdp")
    # The allocator's settings given by hand (the row is the first run replayed by the allocator model).
    by_hand[EXPANDABLE] = ("--batch", "64")
    # All of them at once (a run beside the changes alone, which would skip what cannot be made).
    by_hand[ALL] = ("--batch", "32", "--checkpoint", "--autocast", *(("--adam8",) if ADAM8 in by_hand else ()))
    flags = {SHARDED: ("--gpus", "8"), EXPANDABLE: ("--alloc-conf", "expandable_segments:True")}
    flags[ALL] = flags[EXPANDABLE]
    for change, args in by_hand.items():
        # The answer alone for each (--no-fixes): the rows are what is compared, not the hand's own fixes.
        hand = preflight(script, "--no-fixes", *flags.get(change, ()), "--", sys.executable, str(script), *args)["run"]
        row = rows[change]
        assert row["peak_allocated_bytes"] == hand["peak_allocated_bytes"], (change, row, hand["peak_allocated_bytes"])
        assert row["peak_reserved_bytes"] == hand["peak_reserved_bytes"], (change, row, hand["peak_reserved_bytes"])
        assert row["fits"] == hand["fits"] and row["cost"]
    # Each lowers what the step needs, and all of them together lower it most.
    base = doc["run"]["peak_allocated_bytes"]
    for change in by_hand:
        if change != EXPANDABLE:
            assert rows[change]["peak_allocated_bytes"] < base, change
    alone = [r["peak_allocated_bytes"] for change, r in rows.items() if change != SHARDED]
    assert rows["all of the above"]["peak_allocated_bytes"] <= min(alone)
    # Expandable segments change what is reserved, not what is allocated.
    assert rows[EXPANDABLE]["peak_allocated_bytes"] == base


def test_fixes_are_asked_for_when_it_fits(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = preflight(script, "--", sys.executable, str(script), "--batch", "4", capacity="1GiB")
    assert plain["run"]["fits"] and "fixes" not in plain
    asked = preflight(script, "--fixes", "--", sys.executable, str(script), "--batch", "4", capacity="1GiB")
    assert asked["run"]["fits"] and len(asked["fixes"]) >= 4
    # With --no-fixes a step that does not fit gets its answer alone, from one run.
    alone = preflight(script, "--no-fixes", "--", sys.executable, str(script), "--batch", "64")
    assert not alone["run"]["fits"] and "fixes" not in alone and "fix_notes" not in alone, sorted(alone)
    assert alone["run"]["peak_allocated_bytes"] > asked["run"]["peak_allocated_bytes"]


def test_sharding_is_a_row_saying_so_where_the_script_spreads_its_model_itself(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    doc = preflight(script, "--gpus", "8", "--fixes", "--", sys.executable, str(script), "--batch", "4", "--fsdp", capacity="1GiB")
    rows = {row["change"]: row for row in doc["fixes"]}
    # Not run: the row is the script as written, and says why.
    assert rows[SHARDED]["already"] == "the script already shards its model with FSDP", rows[SHARDED]
    assert rows[SHARDED]["peak_allocated_bytes"] == doc["run"]["peak_allocated_bytes"]
    assert all(row["already"] is None for change, row in rows.items() if change != SHARDED), rows


def _line(script: Path, text: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def test_a_change_the_script_already_has_is_a_row_saying_so_and_the_rest_still_combine(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    doc = preflight(script, "--micro-batch", "64", "--", sys.executable, str(script), "--batch", "{batch}", "--autocast", "--checkpoint")
    rows = {row["change"]: row for row in doc["fixes"]}
    # Autocast and checkpointing the script already has would change nothing: their rows say
    # so, with the script's own figures, and no run claims a change for them.
    autocast, checkpoint = rows["bf16 autocast around the model's forward"], rows[CHECKPOINT]
    assert autocast["already"] == "the script already runs its model's forward under bfloat16 autocast", autocast
    assert checkpoint["already"] == "the script already checkpoints activations: forwards run again in its backward", checkpoint
    for row in (autocast, checkpoint):
        assert (row["peak_allocated_bytes"], row["peak_reserved_bytes"], row["fits"]) == (
            doc["run"]["peak_allocated_bytes"], doc["run"]["peak_reserved_bytes"], doc["run"]["fits"])  # fmt: skip
    assert not [n for n in doc.get("fix_notes", []) if "autocast" in n or "checkpoint" in n], doc["fix_notes"]
    # "All of the above" is the changes that ran, together, and it ran; sharding follows.
    assert list(rows)[-2:] == ["all of the above", SHARDED]
    # It is the script changed by hand with the changes that ran (autocast and checkpointing are its own).
    adam8 = ("--adam8",) if ADAM8 in rows and rows[ADAM8]["already"] is None else ()
    hand = preflight(
        script, "--alloc-conf", "expandable_segments:True", "--", sys.executable, str(script), "--batch", "32", "--autocast", "--checkpoint", *adam8
    )["run"]
    assert (rows[ALL]["peak_allocated_bytes"], rows[ALL]["peak_reserved_bytes"]) == (hand["peak_allocated_bytes"], hand["peak_reserved_bytes"])


def test_a_compiled_model_spread_over_gpus_is_measured_eager_and_said(tmp_path: Path) -> None:
    # Capturing would run FSDP's or DDP's hooks on the tracer's tensors: the compiled
    # model is the sharded or replicated one, measured as its eager self, and the note says why.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for how, flag in (("FSDP", "--fsdp"), ("DDP", "--ddp")):
        eager = preflight(script, "--gpus", "2", "--", sys.executable, str(script), "--batch", "4", flag, capacity="1GiB")["run"]
        compiled = preflight(script, "--gpus", "2", "--", sys.executable, str(script), "--batch", "4", flag, "--compile", capacity="1GiB")["run"]
        assert (compiled["peak_allocated_bytes"], compiled["peak_reserved_bytes"]) == (eager["peak_allocated_bytes"], eager["peak_reserved_bytes"])
        assert compiled["by_role"] == eager["by_role"]
        said = [n for n in compiled["notes"] if n.startswith("torch.compile could not capture")]
        assert len(said) == 1 and f"is spread over GPUs by {how}, whose hooks preflight runs eager" in said[0], compiled["notes"]


def test_the_sharding_fix_on_a_compiled_model_is_what_the_compiled_script_sharded_by_hand_measures(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    doc = preflight(script, "--fixes", "--", sys.executable, str(script), "--batch", "4", "--compile", capacity="1GiB")
    rows = {row["change"]: row for row in doc["fixes"]}
    assert SHARDED in rows, doc.get("fix_notes")
    hand = preflight(script, "--gpus", "8", "--", sys.executable, str(script), "--batch", "4", "--compile", "--fsdp", capacity="1GiB")["run"]
    assert (rows[SHARDED]["peak_allocated_bytes"], rows[SHARDED]["peak_reserved_bytes"]) == (hand["peak_allocated_bytes"], hand["peak_reserved_bytes"])
    # The rows that ran on the compiled model were compiled: checkpointing saves less than the compiled step.
    checkpointed = rows["activation checkpointing of the model's repeated blocks"]
    assert checkpointed["peak_allocated_bytes"] < doc["run"]["peak_allocated_bytes"]


ACCUMULATING = """
    import sys
    import torch

    batch = int(sys.argv[1])
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for micro in range(4):  # the script's own accumulation: 4 micro-batches a step
            (model(torch.randn(batch, 512, device="cuda")).square().mean() / 4).backward()
        opt.step()
        opt.zero_grad()
"""


def test_accumulation_is_counted_on_the_scripts_own_and_what_it_cannot_change_says_so(tmp_path: Path) -> None:
    import os
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ACCUMULATING))
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--fixes", "--capacity", "1GiB", "--micro-batch", "64", "--", sys.executable, str(script), "{batch}"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["run"]["grad_accum"] == 4, doc["run"]
    rows = {row["change"]: row for row in doc["fixes"]}
    # Half the micro-batch keeps the effective batch with twice the script's accumulation.
    halved = rows["micro-batch 32 x accumulation 8 (twice the script's 4)"]
    assert halved["already"] is None and halved["peak_allocated_bytes"] < doc["run"]["peak_allocated_bytes"]
    # SGD has no AdamW to make 8-bit, and the allocator already expands segments: rows saying so.
    assert rows[ADAM8]["already"] == "the script makes no torch.optim.AdamW or Adam to replace (SGD)", rows[ADAM8]
    assert rows[EXPANDABLE]["already"] == "the allocator's settings in force already expand segments (expandable_segments:True)"
    assert rows[EXPANDABLE]["peak_reserved_bytes"] == doc["run"]["peak_reserved_bytes"]


NEVER_ENDS_WHEN_CHANGED = """
    import json
    import os
    import torch

    changed = json.loads(os.environ["OOMKIT_PREFLIGHT"])["fixes"]  # what preflight tries in this run
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(2):
        model(torch.randn(64, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        count = torch.zeros(8, device="cuda")
        while changed:  # under a change, a loop that never ends
            count = count + 1
"""


def test_the_time_limit_bounds_the_whole_command(tmp_path: Path) -> None:
    import textwrap
    import time

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(NEVER_ENDS_WHEN_CHANGED))
    limit = 20
    began = time.monotonic()
    doc = preflight(script, "--fixes", "--time-limit", str(limit), "--", sys.executable, str(script), capacity="1GiB")
    took = time.monotonic() - began
    # The script as written answered; the changes ran in what was left of the limit, and were stopped.
    assert doc["run"]["steps"] == 2, doc["run"]
    # Beyond the limit: starting the command and its Python, and telling the answer (slower on a loaded machine).
    assert took < limit + 20, took
    stopped = [n for n in doc["fix_notes"] if "stopped the script after" in n or "time limit" in n]
    assert len(stopped) >= 3, doc["fix_notes"]
    # The allocator's settings need no run: the first run's step is replayed.
    assert [row["change"] for row in doc["fixes"]] == [EXPANDABLE], doc["fixes"]
