//! The environment variables `oomkit run` and `oomkit find-batch` set for the
//! command they run, in one place; docs/commands.md lists them under
//! "Environment", and `python/oomkit/_plan.py` reads them under the same names.

/// The micro-batch of this attempt.
pub const MICRO_BATCH: &str = "OOMKIT_MICRO_BATCH";
/// The gradient accumulation of this attempt.
pub const GRAD_ACCUM: &str = "OOMKIT_GRAD_ACCUM";
/// The effective batch the plan keeps (`oomkit run` only).
pub const EFFECTIVE_BATCH: &str = "OOMKIT_EFFECTIVE_BATCH";
/// The attempt's number, from 1.
pub const ATTEMPT: &str = "OOMKIT_ATTEMPT";
/// `cuda` or `cpu`, where oomkit chose the device (`oomkit run` only).
pub const DEVICE: &str = "OOMKIT_DEVICE";
/// Set to `1` so that Lightning's entry point adds oomkit's callback; nothing adds it otherwise.
pub const AUTO_CALLBACK: &str = "OOMKIT_AUTO_CALLBACK";
/// A file where the tracker and the integrations append what `oomkit run`
/// must know of an attempt, one JSON line each: an OOM they recorded
/// (`message`), a run log they opened (`log`), whether the plan was applied
/// (`plan`, `applied`) (`oomkit run` only).
pub const EVENTS_FILE: &str = "OOMKIT_EVENTS_FILE";
/// A file where the tracker writes its peak when the child exits (`oomkit find-batch` only).
pub const PROBE_FILE: &str = "OOMKIT_PROBE_FILE";
/// GPU memory in use before the trial started, which the tracker subtracts (`oomkit find-batch` only).
pub const BASELINE_USED_BYTES: &str = "OOMKIT_BASELINE_USED_BYTES";
