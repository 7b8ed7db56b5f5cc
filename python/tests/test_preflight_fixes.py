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
        hand = preflight(script, *flags.get(change, ()), "--", sys.executable, str(script), *args)["run"]
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


def test_sharding_is_a_note_where_the_script_spreads_its_model_itself(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    doc = preflight(script, "--gpus", "8", "--fixes", "--", sys.executable, str(script), "--batch", "4", "--fsdp", capacity="1GiB")
    assert SHARDED not in {row["change"] for row in doc["fixes"]}
    said = [n for n in doc["fix_notes"] if n.startswith(SHARDED)]
    assert said == [f"{SHARDED}: not measured: the script already shards its model with FSDP (at train.py:{_line(script, 'fully_shard(layer)')} (<module>))"], doc["fix_notes"]


def _line(script: Path, text: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def test_a_change_the_script_already_has_is_a_note_and_the_rest_still_combine(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    doc = preflight(script, "--micro-batch", "64", "--", sys.executable, str(script), "--batch", "{batch}", "--autocast")
    rows = {row["change"]: row for row in doc["fixes"]}
    # Autocast around a forward already under autocast would change nothing: no row claims a figure for it.
    assert "bf16 autocast around the model's forward" not in rows, rows
    assert any(
        n.startswith("bf16 autocast around the model's forward: not measured: the script already runs its model's forward under autocast (at train.py:")
        for n in doc["fix_notes"]
    ), doc["fix_notes"]
    # "All of the above" is the changes that ran on the script's GPU, together, and it ran; sharding follows.
    assert list(rows)[-2:] == ["all of the above", SHARDED]
    checkpointed = rows["activation checkpointing of the model's repeated blocks"]
    assert rows["all of the above"]["peak_allocated_bytes"] <= checkpointed["peak_allocated_bytes"]
    # It is the script changed by hand with the changes that ran alone (autocast is the script's own).
    adam8 = ("--adam8",) if ADAM8 in rows else ()
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
