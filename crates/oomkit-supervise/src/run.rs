//! What `oomkit run` is asked, what it carries from one attempt to the
//! next, and what it reports: the types the retry loop (`supervise.rs`),
//! the policy after an OOM (`policy.rs`), the GPUs it claims
//! (`run_gpus.rs`) and the remembered plan (`recall.rs`) share.

use crate::fit::Observation;
use crate::oom::Cause;
use crate::plan::BatchPlan;
use crate::remember::PlanMemory;
use oomkit_gpu::{ClaimDir, Held, Wait};
use serde::Serialize;
use std::ffi::OsString;

/// What `oomkit run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The training command and its arguments, placeholders unfilled.
    pub command: Vec<OsString>,
    /// How many GPUs to choose; 0 leaves `CUDA_VISIBLE_DEVICES` alone.
    pub gpus: usize,
    /// Free memory each chosen GPU must have.
    pub min_free: Option<u64>,
    /// How long to wait for GPUs, and how often to look.
    pub wait: Wait,
    /// Fail instead of running without a GPU when the machine has none.
    pub require_gpu: bool,
    /// The first micro-batch; without it an OOM is reported but not retried.
    pub batch_size: Option<u64>,
    /// The first gradient accumulation.
    pub grad_accum: u64,
    /// The effective batch to keep; micro-batch x accumulation by default.
    pub effective_batch: Option<u64>,
    /// The smallest micro-batch to try.
    pub min_batch_size: u64,
    /// Reruns allowed after the first attempt.
    pub max_retries: u32,
    /// After the last GPU attempt fails with an OOM, run once more on the CPU.
    pub cpu_fallback: bool,
    /// Ask frameworks with entry points (Lightning) to add oomkit's callback, through [`child_env::AUTO_CALLBACK`].
    pub auto_callback: bool,
    /// Where the plans that finished are kept, if anywhere.
    pub memory: Option<PlanMemory>,
    /// Start from `batch_size` even when a plan finished last time for this command.
    pub fresh: bool,
    /// Where GPU claims are kept.
    pub claims: ClaimDir,
    /// Send the command's standard output to stderr, keeping stdout for oomkit's JSON.
    pub child_stdout_to_stderr: bool,
    /// Cap the command's private memory (`RLIMIT_DATA`), to rehearse running out of host memory.
    pub host_memory_limit: Option<u64>,
}

/// One run of the command.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    /// 1 for the first run.
    pub attempt: u32,
    /// The micro-batch given to the command, where oomkit manages it.
    pub batch_size: Option<u64>,
    /// The accumulation given to the command, where oomkit manages it.
    pub grad_accum: Option<u64>,
    /// Micro-batch x accumulation, which may exceed the effective batch when it could not be exact.
    pub effective_batch: Option<u64>,
    /// The GPU indices it ran on; empty for none chosen, or for the CPU.
    pub gpus: Vec<u32>,
    /// "cuda", "cpu", or "unmanaged" where no GPU was chosen.
    pub device: &'static str,
    /// Its exit code, or 128 + n for a signal.
    pub exit_code: i32,
    /// Whether its output showed an out-of-memory error.
    pub oom: bool,
    /// The OOM line, if any.
    pub oom_message: Option<String>,
    /// Where it failed for a reason other than memory, the command's own
    /// error as its standard error last put it (`ModuleNotFoundError: ...`); null otherwise.
    pub error: Option<String>,
    /// Why it ran out, as `oomkit explain` reads the OOM line; null without an OOM.
    pub cause: Option<Cause>,
    /// What oomkit did about it: `expandable_segments`, `other_gpu`, `step_down`, `cpu_fallback` or `stop`; null without an OOM.
    pub action: Option<Action>,
    /// Whether the command trained with the micro-batch and accumulation it
    /// was handed: true where its arguments carry `{batch_size}` or an
    /// integration said so, false where an integration said it could not,
    /// null where nothing tells (a script that may read `OOMKIT_MICRO_BATCH`
    /// itself); null where oomkit manages no batch.
    pub plan_applied: Option<bool>,
    /// Why the plan was not applied, as the integration said.
    pub plan_not_applied: Option<String>,
    /// True when the kernel's OOM killer ended the attempt (SIGKILL while a memory cgroup or the kernel recorded an OOM kill).
    pub killed_for_memory: bool,
    /// The run logs the attempt's trackers wrote.
    pub logs: Vec<String>,
    /// The snapshot the attempt's tracker dumped at its last OOM, where it recorded history.
    pub snapshot: Option<String>,
    /// What replaying that snapshot said of the allocator setting a fragmentation OOM would retry with.
    pub replayed: Option<crate::replay::FixReplay>,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// How a supervised run went.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    /// Every attempt in order.
    pub attempts: Vec<Attempt>,
    /// The exit code oomkit passes on: the last attempt's.
    pub exit_code: i32,
    /// "succeeded", "failed", "oom" (no smaller batch left), or "interrupted".
    pub outcome: &'static str,
    /// Things the user should know, such as an effective batch that could not be kept exact.
    pub notes: Vec<String>,
}

/// The GPU model in the plan memory's key when oomkit does not choose the GPUs.
pub(crate) const UNMANAGED_MODEL: &str = "GPUs chosen by the command";

/// The allocator settings variable that `expandable_segments` is added to.
pub(crate) const ALLOC_CONF_ENV: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// What `oomkit run` does after an out-of-memory attempt: the smallest fix the cause allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Fragmentation: the same plan again with `expandable_segments:True` added to the allocator settings.
    ExpandableSegments,
    /// Another process took the memory: the same plan on another GPU.
    OtherGpu,
    /// A smaller micro-batch with more accumulation.
    StepDown,
    /// One more run on the CPU.
    CpuFallback,
    /// Nothing left to try, or nothing that could help.
    Stop,
}

/// What a supervised run carries from one attempt to the next.
pub(crate) struct Run {
    /// The plan the next attempt runs, where oomkit manages the batch.
    pub(crate) plan: Option<BatchPlan>,
    /// The GPUs the command gets, where oomkit chose them.
    pub(crate) gpus: Option<Vec<u32>>,
    /// The claim on them, held while the run lasts.
    pub(crate) _held: Option<Held>,
    /// What oomkit adds to the allocator settings, on top of the user's.
    pub(crate) alloc_conf: Option<String>,
    /// Whether the next attempt runs on the CPU (`--cpu-fallback`).
    pub(crate) on_cpu: bool,
    /// GPUs where another process took the memory: not chosen again this run.
    pub(crate) avoid: Vec<u32>,
    /// Reruns left.
    pub(crate) retries_left: u32,
    /// What each capacity OOM said about memory at its micro-batch.
    pub(crate) observed: Vec<Observation>,
    /// Every attempt so far.
    pub(crate) attempts: Vec<Attempt>,
    /// What the user should know.
    pub(crate) notes: Vec<String>,
}

/// ` (why)`, or nothing.
pub(crate) fn in_parens(why: Option<&str>) -> String {
    why.map(|r| format!(" ({r})")).unwrap_or_default()
}
