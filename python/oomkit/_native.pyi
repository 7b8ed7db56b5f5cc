"""Type stubs of the native half of oomkit (Rust, PyO3)."""

from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any, final

__all__ = [
    "AllocatorRun",
    "OomkitError",
    "PreflightError",
    "RunLog",
    "RunLogError",
    "__version__",
    "analyze_run_json",
    "analyze_run_text",
    "back_off",
    "batch_plan",
    "cli_main",
    "gpu_capability",
    "host_capacity",
    "largest_that_fits",
    "oom_cause",
    "oom_kind",
    "oom_limits",
    "oom_requested_bytes",
    "parse_capacity",
    "preflight_text",
    "process_peak_rss",
    "process_rss",
    "process_sample",
    "realize_ops",
    "reset_process_peak_rss",
]
__version__: str

class OomkitError(Exception):
    """Base class of oomkit's errors."""

class RunLogError(OomkitError):
    """A run log could not be written or read."""

class PreflightError(OomkitError):
    """A preflight could not run the training step on fake tensors, or was given settings it cannot use."""

@final
class RunLog:
    """A run log opened for appending records; never overwrites a file."""

    def __new__(cls, path: str | PathLike[str]) -> RunLog: ...
    def write(self, record: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    @property
    def path(self) -> Path: ...
    @property
    def records(self) -> int: ...

@final
class AllocatorRun:
    """A run's allocations served as they are made, against what the GPU may hold."""

    def __new__(cls, alloc_conf: str | None, capacity: int) -> AllocatorRun: ...
    def feed(self, kinds: list[int], a: list[int], b: list[int]) -> list[tuple[int, int, int, int]]: ...
    def __len__(self) -> int: ...
    def set_capacity(self, capacity: int) -> None: ...

def analyze_run_json(path: str | PathLike[str]) -> str: ...
def analyze_run_text(path: str | PathLike[str]) -> str: ...
def process_rss() -> int: ...
def process_peak_rss() -> int: ...
def reset_process_peak_rss() -> bool: ...
def process_sample(reset: bool) -> tuple[int, int]: ...
def host_capacity() -> tuple[int, str] | None: ...
def cli_main(argv: list[str]) -> int: ...
def oom_kind(message: str) -> str | None: ...
def oom_requested_bytes(message: str) -> int | None: ...
def oom_limits(message: str) -> tuple[int | None, int | None]: ...
def oom_cause(message: str, alloc_conf: str | None = None) -> str | None: ...
def batch_plan(micro_batch: int, effective_batch: int) -> tuple[int, int]: ...
def back_off(
    micro_batch: int,
    effective_batch: int,
    min_micro_batch: int,
    message: str | None = None,
    earlier: list[tuple[int, str]] = ...,
) -> tuple[int, int] | None: ...
def realize_ops(
    kinds: list[int],
    a: list[int],
    b: list[int],
    alloc_conf: str | None = None,
    capacity: int | None = None,
) -> tuple[
    tuple[list[str], list[int], list[int], list[int], list[int]],
    list[tuple[int, int, int, str, bool, list[tuple[int, int, int, bool, int | None]]]],
    tuple[int, int, int | None, int, list[int]],
    tuple[list[int], list[int], list[int]],
]: ...
def parse_capacity(text: str) -> tuple[int, str]: ...
def gpu_capability(text: str) -> tuple[int, int] | None: ...
def preflight_text(doc: str) -> str: ...
def largest_that_fits(
    start: int, max: int, capacity: int, measure: Callable[[int], tuple[bool, int]]
) -> tuple[int | None, list[tuple[int, bool]]]: ...
