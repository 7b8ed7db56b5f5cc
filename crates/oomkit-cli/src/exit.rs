//! Every exit code oomkit gives, and which failure gets which (docs/commands.md#exit-codes).

use oomkit_gpu::GpuError;
use oomkit_supervise::SuperviseError;

/// Exit code for success.
pub const EXIT_OK: u8 = 0;
/// Exit code for a bug in oomkit.
pub const EXIT_INTERNAL: u8 = 1;
/// Exit code for bad input or usage.
pub const EXIT_INPUT: u8 = 2;
/// Exit code when a GPU is needed and the machine has none (or no driver).
pub const EXIT_NO_GPU: u8 = 3;
/// Exit code when no GPU qualified before `--wait` ran out.
pub const EXIT_WAIT_TIMEOUT: u8 = 4;
/// Exit code from `find-batch` when not even the smallest micro-batch fits.
pub const EXIT_NOTHING_FITS: u8 = 5;
/// Exit code from `find-batch` when a run finished with no peak measured, so no batch is recommended.
pub const EXIT_UNMEASURED: u8 = 6;

/// Exit code from `find-batch` when a trial failed for a reason other than memory, which no micro-batch can fix.
pub(crate) const EXIT_COMMAND_FAILED: u8 = 7;

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
        | SuperviseError::Unmeasured(_)
        | SuperviseError::CommandFailed { .. } => RUN_FAILED,
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
        SuperviseError::CommandFailed { .. } => EXIT_COMMAND_FAILED,
    }
}
