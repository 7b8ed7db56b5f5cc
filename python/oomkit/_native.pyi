"""Type stubs of the native half of oomkit (Rust, PyO3)."""

from os import PathLike
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple, Union, final

__all__ = [
    "OomkitError",
    "RunLog",
    "RunLogError",
    "__version__",
    "analyze_run_json",
    "analyze_run_text",
    "back_off",
    "batch_plan",
    "cli_main",
    "oom_cause",
    "oom_kind",
    "oom_requested_bytes",
    "process_peak_rss",
    "process_rss",
    "process_sample",
    "reset_process_peak_rss",
]
__version__: str

class OomkitError(Exception):
    """Base class of oomkit's errors."""

class RunLogError(OomkitError):
    """A run log could not be written or read."""

@final
class RunLog:
    """A run log opened for appending records; never overwrites a file."""

    def __new__(cls, path: Union[str, PathLike[str]]) -> RunLog: ...
    def write(self, record: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    @property
    def path(self) -> Path: ...
    @property
    def records(self) -> int: ...

def analyze_run_json(path: Union[str, PathLike[str]]) -> str: ...
def analyze_run_text(path: Union[str, PathLike[str]]) -> str: ...
def process_rss() -> int: ...
def process_peak_rss() -> int: ...
def reset_process_peak_rss() -> bool: ...
def process_sample(reset: bool) -> Tuple[int, int]: ...
def cli_main(argv: list[str]) -> int: ...
def oom_kind(message: str) -> Optional[str]: ...
def oom_requested_bytes(message: str) -> Optional[int]: ...
def oom_cause(message: str, alloc_conf: Optional[str] = None) -> Optional[str]: ...
def batch_plan(micro_batch: int, effective_batch: int) -> Tuple[int, int]: ...
def back_off(
    micro_batch: int,
    effective_batch: int,
    min_micro_batch: int,
    message: Optional[str] = None,
    earlier: List[Tuple[int, str]] = ...,
) -> Optional[Tuple[int, int]]: ...
