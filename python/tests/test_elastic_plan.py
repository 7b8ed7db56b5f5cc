"""The torchrun plan channel's pieces: reading torchrun's flags, and agreeing once when two ranks fail at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from oomkit import _elastic
from oomkit._elastic import Agreed, Channel


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "/venv/bin/torchrun", "--rdzv-endpoint", "node7:29500", "train.py"], ("node7", 29500)),
        (["python", "-m", "torch.distributed.run", "--rdzv_endpoint=10.0.0.2:1234", "t.py"], ("10.0.0.2", 1234)),
        (["torchrun", "--rdzv-endpoint", "[::1]:29400", "t.py"], ("::1", 29400)),
        # torchrun's default port where the endpoint names only the host.
        (["torchrun", "--rdzv-endpoint", "node7", "t.py"], ("node7", 29400)),
        # --standalone and port 0 pick a port at run time that workers cannot see.
        (["torchrun", "--standalone", "t.py"], None),
        (["torchrun", "--rdzv-endpoint", "localhost:0", "t.py"], None),
        (["torchrun", "t.py"], None),
    ],
)
def test_the_rendezvous_endpoint_is_read_from_torchruns_command_line(argv, expected, monkeypatch) -> None:
    monkeypatch.delenv(_elastic.ENDPOINT_ENV, raising=False)
    assert _elastic._endpoint(argv) == expected


def test_the_endpoint_from_the_environment_wins(monkeypatch) -> None:
    monkeypatch.setenv(_elastic.ENDPOINT_ENV, "head:4000")
    assert _elastic._endpoint(["torchrun", "--rdzv-endpoint", "other:1", "t.py"]) == ("head", 4000)


def test_a_plan_survives_the_store_and_foreign_values_are_ignored() -> None:
    plan = Agreed(16, 8, 128, 2, rank=3, failed_micro_batch=32, message="CUDA out of memory.")
    assert Agreed.decode(plan.encode()) == plan
    assert Agreed.decode("") is None
    assert Agreed.decode("not json") is None
    assert Agreed.decode('{"micro_batch": 1}') is None


def _file_channel(tmp_path: Path) -> Channel:
    return Channel(_elastic._FileChannel(str(tmp_path / "plan.json")))


def test_two_ranks_that_run_out_under_one_plan_step_down_once(tmp_path: Path) -> None:
    ch = _file_channel(tmp_path)
    failed, _ = ch.read()
    # Both ranks ran out under the first plan and propose from it: one step down, the smaller plan.
    first = ch.propose(failed, Agreed(16, 8, 128, 2, rank=1, failed_micro_batch=32))
    second = ch.propose(failed, Agreed(8, 16, 128, 2, rank=2, failed_micro_batch=32))
    raw, now = ch.read()
    assert first.micro_batch == 16 and second.micro_batch == 8
    assert now is not None and (now.micro_batch, now.attempt, now.rank) == (8, 2, 2)
    # A late rank with a larger proposal for the same failure changes nothing.
    late = ch.propose(failed, Agreed(16, 8, 128, 2, rank=0, failed_micro_batch=32))
    assert late.micro_batch == 8
    assert ch.read()[0] == raw


def test_a_proposal_from_a_plan_that_is_already_past_keeps_the_newer_plan(tmp_path: Path) -> None:
    ch = _file_channel(tmp_path)
    ch.propose("", Agreed(16, 8, 128, 2, rank=1, failed_micro_batch=32))
    raw, _ = ch.read()
    ch.propose(raw, Agreed(8, 16, 128, 3, rank=1, failed_micro_batch=16))
    # A rank still holding attempt 1's text proposes attempt 2 again: attempt 3 stands.
    kept = ch.propose("", Agreed(16, 8, 128, 2, rank=0, failed_micro_batch=32))
    assert (kept.micro_batch, kept.attempt) == (8, 3)


def test_outside_torchrun_there_is_no_channel(monkeypatch) -> None:
    monkeypatch.delenv(_elastic.RUN_ID_ENV, raising=False)
    assert _elastic.channel() is None


def test_two_ranks_of_a_trainer_that_run_out_at_once_keep_the_smaller_plan(tmp_path: Path, monkeypatch) -> None:
    """The integrations' step down: a second rank's proposal for the same failure never replaces a smaller one."""
    from oomkit import _native, _plan

    ch = _file_channel(tmp_path)
    monkeypatch.setattr(_elastic, "channel", lambda: ch)
    fields = {"micro_batch": 32, "grad_accum": 4, "effective_batch": 128, "attempt": 1}
    # A message with the allocator's figures allows a bigger jump than plain halving.
    far = ("CUDA out of memory. Tried to allocate 70.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
           "of which 1.00 GiB is free. Of the allocated memory 10.00 GiB is allocated by PyTorch, "
           "and 100.00 MiB is reserved by PyTorch but unallocated.")
    near = "CUDA out of memory. Tried to allocate 2.00 MiB"
    fitted, halved = _native.back_off(32, 128, 1, far, []), _native.back_off(32, 128, 1, near, [])
    assert fitted is not None and halved is not None
    small = fitted[0]
    assert small < halved[0]
    # Either order: the smaller proposal stands, once.
    for first, second in ((far, near), (near, far)):
        (tmp_path / "plan.json").unlink(missing_ok=True)
        _plan.elastic_step_down(fields, first, 1)
        _plan.elastic_step_down(fields, second, 2)
        _, now = ch.read()
        assert now is not None and (now.attempt, now.micro_batch) == (2, small)
