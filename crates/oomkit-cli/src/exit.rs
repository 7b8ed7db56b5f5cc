//! Which exit code each failure gets (the README's table, docs/commands.md#exit-codes).

use crate::{EXIT_INPUT, EXIT_INTERNAL, EXIT_NO_GPU, EXIT_WAIT_TIMEOUT};
use oomkit_gpu::GpuError;
use oomkit_supervise::SuperviseError;

/// Exit code when the command could not be started (the shell's "command not found").
pub(crate) const EXIT_SPAWN: u8 = 127;

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
    }
}
