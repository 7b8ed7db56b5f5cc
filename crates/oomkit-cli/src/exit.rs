//! Which exit code each failure gets (the README's table, docs/commands.md#exit-codes).

use crate::{EXIT_INPUT, EXIT_INTERNAL, EXIT_NO_GPU, EXIT_UNMEASURED, EXIT_WAIT_TIMEOUT};
use oomkit_gpu::GpuError;
use oomkit_supervise::SuperviseError;

/// Exit code when the command could not be started (the shell's "command not found").
pub(crate) const EXIT_SPAWN: u8 = 127;

/// `oomkit run` itself failed (a usage error, no GPU where one is required,
/// an existing `--summary-json`): the reserved code, as `timeout` and `env`
/// reserve theirs, so that no training command's own code reads as oomkit's.
pub(crate) const RUN_FAILED: u8 = 125;
/// `oomkit run`: no GPU qualified before `--wait` ran out (as `timeout`'s 124).
pub(crate) const RUN_WAIT_TIMEOUT: u8 = 124;

/// The exit code of a failure of `oomkit run` itself, in the reserved range
/// 124 to 127, or 128 + n for a signal.
pub(crate) fn run_exit(e: &SuperviseError) -> u8 {
    match e {
        SuperviseError::Spawn { .. } => EXIT_SPAWN,
        SuperviseError::Gpu(GpuError::TimedOut(_)) => RUN_WAIT_TIMEOUT,
        SuperviseError::Gpu(GpuError::Stopped) => 130,
        SuperviseError::Interrupted(sig) => 128u8.saturating_add(*sig as u8),
        SuperviseError::Usage(_)
        | SuperviseError::Wait(_)
        | SuperviseError::Gpu(_)
        | SuperviseError::Unmeasured(_) => RUN_FAILED,
    }
}

/// The exit code of a GPU failure.
pub(crate) fn gpu_exit(e: &GpuError) -> u8 {
    match e {
        GpuError::TimedOut(_) => EXIT_WAIT_TIMEOUT,
        GpuError::Fake { .. } => EXIT_INPUT,
        // Stopped by Ctrl-C while waiting: the shell's code for SIGINT.
        GpuError::Stopped => 130,
        _ => EXIT_NO_GPU,
    }
}

/// The exit code of a supervision failure.
pub(crate) fn supervise_exit(e: &SuperviseError) -> u8 {
    match e {
        SuperviseError::Usage(_) => EXIT_INPUT,
        SuperviseError::Spawn { .. } => EXIT_SPAWN,
        SuperviseError::Wait(_) => EXIT_INTERNAL,
        SuperviseError::Gpu(g) => gpu_exit(g),
        SuperviseError::Interrupted(sig) => 128u8.saturating_add(*sig as u8),
        SuperviseError::Unmeasured(_) => EXIT_UNMEASURED,
    }
}
