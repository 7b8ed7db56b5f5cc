//! Keeping a training command alive: choosing its GPUs, running it, telling
//! an OOM from other failures, and rerunning it with a smaller micro-batch
//! and more gradient accumulation so the effective batch stays the same.
//! Also the batch-size search behind `oomkit find-batch`.
//!
//! ```
//! use oomkit_supervise::explain::explain;
//! use oomkit_supervise::oom::Cause;
//! let e = explain(
//!     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total \
//!      capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process \
//!      has 78.02 GiB memory in use. Of the allocated memory 71.44 GiB is allocated by PyTorch, and \
//!      6.08 GiB is reserved by PyTorch but unallocated.",
//!     None,
//! )
//! .unwrap();
//! assert_eq!(e.cause, Cause::Fragmentation);
//! assert_eq!(e.message.requested_bytes, Some(2 << 30));
//! ```

pub mod child;
pub mod child_env;
pub mod events;
pub mod explain;
pub mod find_batch;
pub mod fit;
pub mod oom;
pub mod plan;
mod policy;
mod recall;
pub mod remember;
pub mod replay;
mod run;
mod run_gpus;
pub mod search;
mod supervise;

pub use plan::BatchPlan;
pub use run::{Attempt, RunOptions, RunSummary};
pub use supervise::supervise;

/// Why a command could not be supervised.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The options do not make sense together.
    #[error("{0}")]
    Usage(String),
    /// The command could not be started.
    #[error("cannot run {program}: {message}")]
    Spawn {
        /// The program as given.
        program: String,
        /// The operating system's reason.
        message: String,
    },
    /// Waiting for the command failed.
    #[error("lost track of the command: {0}")]
    Wait(String),
    /// The GPUs could not be read or claimed, or none qualified in time.
    #[error(transparent)]
    Gpu(#[from] oomkit_gpu::GpuError),
    /// The user stopped oomkit while it waited for a GPU.
    #[error("stopped by signal {0} while waiting for a GPU")]
    Interrupted(i32),
    /// A run finished without a peak to compare with the budget, so nothing can be recommended.
    #[error("{0}")]
    Unmeasured(String),
    /// The command failed for a reason other than memory (an import error,
    /// a bad argument): no batch size can fix it, so the search stops.
    #[error("{what} failed with exit code {exit_code}, not for memory{}: the search stops, as a failure that is not memory says nothing about which micro-batch fits; fix the command and run it again", error.as_ref().map(|e| format!(" ({e})")).unwrap_or_default())]
    CommandFailed {
        /// Which run failed, in words (`trial 1 (micro-batch 1)`).
        what: String,
        /// The command's exit code.
        exit_code: i32,
        /// The command's own error line, as its standard error last put it.
        error: Option<String>,
    },
}

/// Replaces `{batch_size}`, `{grad_accum}`, `{effective_batch}` and `{attempt}` in one argument.
pub fn fill_placeholders(
    arg: &std::ffi::OsStr,
    plan: Option<&BatchPlan>,
    attempt: u32,
) -> std::ffi::OsString {
    let Some(text) = arg.to_str() else {
        return arg.to_os_string();
    };
    let mut out = text.replace("{attempt}", &attempt.to_string());
    if let Some(p) = plan {
        out = out
            .replace("{batch_size}", &p.micro_batch.to_string())
            .replace("{grad_accum}", &p.grad_accum.to_string())
            .replace("{effective_batch}", &p.effective_batch.to_string());
    }
    out.into()
}

/// Whether an argument holds a batch placeholder that needs `--batch-size`.
pub fn has_batch_placeholder(arg: &std::ffi::OsStr) -> bool {
    arg.to_str().is_some_and(|t| {
        ["{batch_size}", "{grad_accum}", "{effective_batch}"]
            .iter()
            .any(|p| t.contains(p))
    })
}
