//! The retry loop behind `oomkit run`.

use crate::child::{self, Spec};
use crate::child_env;
use crate::events;
use crate::fit::{self, Observation};
use crate::oom::{self, Cause, Explanation};
use crate::plan::BatchPlan;
use crate::remember::{PlanMemory, Remembered};
use crate::{fill_placeholders, has_batch_placeholder, SuperviseError};
use oomkit_gpu::{acquire, ClaimDir, GpuError, Held, Request, Wait};
use oomkit_units::human_bytes;
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
const UNMANAGED_MODEL: &str = "GPUs chosen by the command";

/// The allocator settings variable that `expandable_segments` is added to.
const ALLOC_CONF_ENV: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// torch elastic's switch for a rendezvous store apart from the workers' one;
/// torchrun's restarts hang without it on current releases (pytorch #135712,
/// #167288), and `auto_batch` relies on them to step every rank down.
const TORCHRUN_SEPARATE_STORE_ENV: &str = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE";

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

fn env(k: &str, v: impl ToString) -> (OsString, OsString) {
    (k.into(), v.to_string().into())
}

/// Runs the command, rerunning it after each OOM with a smaller micro-batch; `say` hears progress.
pub fn supervise(
    opts: &RunOptions,
    say: &mut dyn FnMut(&str),
) -> Result<RunSummary, SuperviseError> {
    let plan = first_plan(opts, say)?;
    child::catch_signals();
    // Which signal ended a wait for GPUs, for the error that reports it.
    let stopped_by = std::cell::Cell::new(0);
    let (gpus, held, model) = first_gpus(opts, &stopped_by, say)?;
    let key = PlanMemory::key(&opts.command, &model, plan.map_or(0, |p| p.effective_batch));
    let mut run = Run {
        plan,
        gpus,
        _held: held,
        alloc_conf: None,
        on_cpu: false,
        avoid: Vec::new(),
        retries_left: opts.max_retries,
        observed: Vec::new(),
        attempts: Vec::new(),
        notes: Vec::new(),
    };
    recall(opts, &key, &model, &mut run, say);
    let events_file =
        std::env::temp_dir().join(format!("oomkit-events-{}.jsonl", std::process::id()));
    loop {
        let number = run.attempts.len() as u32 + 1;
        let (spec, device) = attempt_spec(opts, &run, number, &events_file, say);
        let _ = std::fs::remove_file(&events_file);
        let out = child::run(&spec, &mut |_| {})?;
        let events = events::read(&events_file);
        let _ = std::fs::remove_file(&events_file);
        let settings = run
            .alloc_conf
            .clone()
            .or_else(|| std::env::var(ALLOC_CONF_ENV).ok());
        let (attempt, explained) = record_attempt(
            opts,
            &run,
            number,
            device,
            &out,
            &events,
            settings.as_deref(),
            say,
        );
        run.attempts.push(attempt);
        let last = run.attempts.last().expect("pushed");
        let (oom, plan_applied) = (last.oom, last.plan_applied);
        let not_applied = last.plan_not_applied.clone();
        if let Some(sig) = out.interrupted_by {
            run.notes
                .push(format!("stopped by signal {sig}; not retried"));
            return Ok(run.finish(opts, &out, None, "interrupted"));
        }
        if out.exit_code == 0 {
            remember(
                opts,
                &key,
                &mut run,
                plan_applied,
                not_applied.as_deref(),
                say,
            );
            return Ok(run.finish(opts, &out, None, "succeeded"));
        }
        if !oom {
            // Not memory: a smaller micro-batch cannot fix it.
            run.notes.push(format!(
                "attempt {number} failed with exit code {}, not for memory{}: not retried",
                out.exit_code,
                in_parens(out.error_line.as_deref())
            ));
            return Ok(run.finish(opts, &out, None, "failed"));
        }
        match next_after_oom(
            opts,
            &mut run,
            explained.as_ref(),
            settings.as_deref(),
            plan_applied,
            not_applied.as_deref(),
            &stopped_by,
            say,
        ) {
            Next::Retry(action) => {
                run.retries_left = run.retries_left.saturating_sub(1);
                run.attempts.last_mut().expect("pushed").action = Some(action);
            }
            Next::CpuFallback => {
                say("falling back to the CPU (--cpu-fallback)");
                run.attempts.last_mut().expect("pushed").action = Some(Action::CpuFallback);
                run.on_cpu = true;
            }
            Next::Stop(outcome) => return Ok(run.finish(opts, &out, Some(Action::Stop), outcome)),
        }
    }
}

/// What a supervised run carries from one attempt to the next.
struct Run {
    /// The plan the next attempt runs, where oomkit manages the batch.
    plan: Option<BatchPlan>,
    /// The GPUs the command gets, where oomkit chose them.
    gpus: Option<Vec<u32>>,
    /// The claim on them, held while the run lasts.
    _held: Option<Held>,
    /// What oomkit adds to the allocator settings, on top of the user's.
    alloc_conf: Option<String>,
    /// Whether the next attempt runs on the CPU (`--cpu-fallback`).
    on_cpu: bool,
    /// GPUs where another process took the memory: not chosen again this run.
    avoid: Vec<u32>,
    /// Reruns left.
    retries_left: u32,
    /// What each capacity OOM said about memory at its micro-batch.
    observed: Vec<Observation>,
    /// Every attempt so far.
    attempts: Vec<Attempt>,
    /// What the user should know.
    notes: Vec<String>,
}

/// What the run does after an OOM.
enum Next {
    /// Run again, changed by this action (the plan, the GPU or the allocator settings already updated).
    Retry(Action),
    /// Run once more on the CPU.
    CpuFallback,
    /// Nothing more to try: the run ends with this outcome.
    Stop(&'static str),
}

impl Run {
    /// The summary of a run that ends after its last attempt with `outcome`.
    fn finish(
        mut self,
        opts: &RunOptions,
        out: &child::Outcome,
        action: Option<Action>,
        outcome: &'static str,
    ) -> RunSummary {
        if let Some(last) = self.attempts.last_mut() {
            last.action = action;
        }
        if outcome == "succeeded" && self.attempts.len() > 1 {
            self.notes.push(next_time(
                opts,
                self.plan.as_ref(),
                self.alloc_conf.as_deref(),
            ));
        }
        RunSummary {
            exit_code: out.exit_code,
            attempts: self.attempts,
            outcome,
            notes: self.notes,
        }
    }
}

/// The plan of the first attempt, where oomkit manages the batch; a usage error where the flags cannot make one.
fn first_plan(
    opts: &RunOptions,
    say: &mut dyn FnMut(&str),
) -> Result<Option<BatchPlan>, SuperviseError> {
    if opts.command.is_empty() {
        return Err(SuperviseError::Usage("no command given after --".into()));
    }
    if opts.batch_size.is_none() && opts.command.iter().any(|a| has_batch_placeholder(a)) {
        return Err(SuperviseError::Usage(
            "the command uses {batch_size} or {grad_accum}; give --batch-size to fill them".into(),
        ));
    }
    let plan = opts.batch_size.map(|b| {
        let eff = opts.effective_batch.unwrap_or(b * opts.grad_accum.max(1));
        BatchPlan::new(b, eff)
    });
    if let (Some(p), Some(b)) = (&plan, opts.batch_size) {
        if b * opts.grad_accum.max(1) < p.effective_batch {
            say(&format!(
                "effective batch {} needs accumulation {} at micro-batch {b}",
                p.effective_batch, p.grad_accum
            ));
        }
    }
    Ok(plan)
}

/// The GPUs of the first attempt, their claim, and the GPU model the plan memory is kept under.
#[allow(clippy::type_complexity)]
fn first_gpus(
    opts: &RunOptions,
    stopped_by: &std::cell::Cell<i32>,
    say: &mut dyn FnMut(&str),
) -> Result<(Option<Vec<u32>>, Option<Held>, String), SuperviseError> {
    if opts.gpus == 0 {
        return Ok((None, None, UNMANAGED_MODEL.to_string()));
    }
    match take_gpus(opts, &[], stopped_by, say) {
        Ok((ids, model, h)) => Ok((Some(ids), Some(h), model)),
        Err(e) if e.is_absent() && !opts.require_gpu => {
            say(&format!(
                "warning: {e}; running the command without choosing a GPU (--require-gpu makes this an error)"
            ));
            Ok((None, None, UNMANAGED_MODEL.to_string()))
        }
        Err(GpuError::Stopped) => Err(SuperviseError::Interrupted(stopped_by.get())),
        Err(e) => Err(e.into()),
    }
}

/// Starts from the plan that finished last time for this command, where it is smaller or set the allocator.
fn recall(opts: &RunOptions, key: &str, model: &str, run: &mut Run, say: &mut dyn FnMut(&str)) {
    let (Some(memory), false) = (&opts.memory, opts.fresh) else {
        return;
    };
    let Some(r) = memory.recall(key) else {
        return;
    };
    let smaller = run.plan.filter(|p| r.micro_batch < p.micro_batch);
    if smaller.is_none() && r.alloc_conf.is_none() {
        return;
    }
    if let Some(p) = smaller {
        run.plan = Some(BatchPlan::new(r.micro_batch, p.effective_batch));
    }
    run.alloc_conf = r.alloc_conf.clone();
    let what = [
        smaller.map(|_| {
            format!(
                "micro-batch {} x accumulation {}",
                r.micro_batch, r.grad_accum
            )
        }),
        r.alloc_conf
            .as_ref()
            .map(|c| format!("{ALLOC_CONF_ENV}={c}")),
    ];
    let what: Vec<String> = what.into_iter().flatten().collect();
    say(&format!(
        "starting from {}, which finished last time for this command on {model} (--fresh starts over; kept in {})",
        what.join(" and "),
        memory.path().display()
    ));
}

/// The command of attempt `number`, with the variables it gets, and where it runs (`cuda`, `cpu` or `unmanaged`); says which plan it runs.
fn attempt_spec(
    opts: &RunOptions,
    run: &Run,
    number: u32,
    events_file: &std::path::Path,
    say: &mut dyn FnMut(&str),
) -> (Spec, &'static str) {
    let mut spec = Spec {
        argv: opts
            .command
            .iter()
            .map(|a| fill_placeholders(a, run.plan.as_ref(), number))
            .collect(),
        env: vec![
            env(child_env::ATTEMPT, number),
            (
                child_env::EVENTS_FILE.into(),
                events_file.as_os_str().to_os_string(),
            ),
        ],
        stdout_to_stderr: opts.child_stdout_to_stderr,
        data_limit: opts.host_memory_limit,
    };
    if opts.auto_callback {
        spec.env.push(env(child_env::AUTO_CALLBACK, 1));
    }
    // Only torchrun reads it; a user's own setting stands.
    if std::env::var_os(TORCHRUN_SEPARATE_STORE_ENV).is_none() {
        spec.env.push(env(TORCHRUN_SEPARATE_STORE_ENV, 1));
    }
    if let Some(conf) = &run.alloc_conf {
        spec.env.push(env(ALLOC_CONF_ENV, conf));
    }
    if let Some(p) = &run.plan {
        spec.env.push(env(child_env::MICRO_BATCH, p.micro_batch));
        spec.env.push(env(child_env::GRAD_ACCUM, p.grad_accum));
        spec.env
            .push(env(child_env::EFFECTIVE_BATCH, p.effective_batch));
    }
    let device = if run.on_cpu {
        spec.env.push(env("CUDA_VISIBLE_DEVICES", ""));
        spec.env.push(env(child_env::DEVICE, "cpu"));
        "cpu"
    } else if let Some(ids) = &run.gpus {
        spec.env.extend(child::visible_devices(ids));
        spec.env.push(env(child_env::DEVICE, "cuda"));
        "cuda"
    } else {
        "unmanaged"
    };
    let place = match device {
        "cpu" => "the CPU".to_string(),
        "cuda" => format!("cuda:{}", join(run.gpus.as_deref().unwrap_or(&[]))),
        _ => "the devices the command chooses".to_string(),
    };
    if let Some(p) = &run.plan {
        say(&format!(
            "attempt {number}: micro-batch {} x accumulation {} = {} on {place}",
            p.micro_batch,
            p.grad_accum,
            p.actual_effective()
        ));
    } else if number > 1 {
        say(&format!("attempt {number} on {place}"));
    }
    (spec, device)
}

/// What one attempt did, from how it ended and what it reported through the
/// events file: an OOM (the kernel's kill included) and its explanation, and
/// whether the plan was applied. A killed attempt's logs get their end record.
#[allow(clippy::too_many_arguments)]
fn record_attempt(
    opts: &RunOptions,
    run: &Run,
    number: u32,
    device: &'static str,
    out: &child::Outcome,
    events: &events::Events,
    settings: Option<&str>,
    say: &mut dyn FnMut(&str),
) -> (Attempt, Option<Explanation>) {
    let killed = out.oom_kill.as_ref().map(|k| {
        let message = kill_message(k, out.signal.unwrap_or(libc::SIGKILL));
        say(&message);
        message
    });
    if let (Some(sig), None) = (out.signal, out.interrupted_by) {
        // A killed process cannot close its own log.
        let closed = events::close_killed_logs(
            &events.logs,
            &events::Killed {
                signal: sig,
                oom_kill: out.oom_kill.is_some(),
                limit_bytes: out.oom_kill.as_ref().and_then(|k| k.limit_bytes),
            },
        );
        if out.oom_kill.is_some() {
            for log in closed {
                say(&format!(
                    "closed {} with how the attempt ended",
                    log.display()
                ));
            }
        }
    }
    let oom = (out.oom_line.is_some() || !events.ooms.is_empty() || killed.is_some())
        && out.exit_code != 0;
    let (oom_message, explained) = match (&killed, oom) {
        // The kernel's kill is the attempt's end, whatever the output said before it.
        (Some(m), true) => (Some(m.clone()), oom::explain(m, settings)),
        (None, true) => read_cause(&events.ooms, out.oom_line.as_deref(), settings),
        (_, false) => (out.oom_line.clone(), None),
    };
    // Applied where the command line carries the plan, else as an integration said.
    let plan = run.plan;
    let placed = plan.is_some() && opts.command.iter().any(|a| has_batch_placeholder(a));
    let (plan_applied, plan_not_applied) = match (&plan, &events.plan) {
        (None, _) => (None, None),
        (Some(_), Some(r)) if !r.applied => (Some(false), r.reason.clone()),
        (Some(_), _) if placed => (Some(true), None),
        (Some(_), Some(r)) => (Some(r.applied), None),
        (Some(_), None) => (None, None),
    };
    if plan_applied == Some(false) {
        say(&format!(
            "attempt {number}: the command did not apply micro-batch {} x accumulation {}{}",
            plan.map_or(0, |p| p.micro_batch),
            plan.map_or(0, |p| p.grad_accum),
            in_parens(plan_not_applied.as_deref())
        ));
    }
    let attempt = Attempt {
        attempt: number,
        batch_size: plan.map(|p| p.micro_batch),
        grad_accum: plan.map(|p| p.grad_accum),
        effective_batch: plan.map(|p| p.actual_effective()),
        gpus: if run.on_cpu {
            vec![]
        } else {
            run.gpus.clone().unwrap_or_default()
        },
        device,
        exit_code: out.exit_code,
        oom,
        oom_message,
        error: (out.exit_code != 0 && !oom && out.interrupted_by.is_none())
            .then(|| out.error_line.clone())
            .flatten(),
        cause: explained.as_ref().map(|e| e.cause),
        action: None,
        plan_applied,
        plan_not_applied,
        killed_for_memory: killed.is_some(),
        logs: events
            .logs
            .iter()
            .map(|l| l.display().to_string())
            .collect(),
        snapshot: events.snapshots.last().map(|p| p.display().to_string()),
        replayed: None,
        seconds: out.duration.as_secs_f64(),
    };
    (attempt, explained)
}

/// ` (why)`, or nothing.
fn in_parens(why: Option<&str>) -> String {
    why.map(|r| format!(" ({r})")).unwrap_or_default()
}

/// Keeps the plan of a run that finished, unless the command did not apply it.
fn remember(
    opts: &RunOptions,
    key: &str,
    run: &mut Run,
    plan_applied: Option<bool>,
    not_applied: Option<&str>,
    say: &mut dyn FnMut(&str),
) {
    if plan_applied == Some(false) {
        run.notes.push(format!(
            "the command did not apply the plan oomkit handed it{}: it is not remembered; give the command {{batch_size}} and {{grad_accum}} so that oomkit's plan reaches it",
            in_parens(not_applied)
        ));
        return;
    }
    let Some(memory) = &opts.memory else {
        return;
    };
    let finished = Remembered {
        micro_batch: run.plan.map_or(0, |p| p.micro_batch),
        grad_accum: run.plan.map_or(0, |p| p.grad_accum),
        alloc_conf: run.alloc_conf.clone(),
        time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    if let Err(e) = memory.remember(key, finished) {
        say(&format!(
            "warning: could not keep the plan in {}: {e}",
            memory.path().display()
        ));
    }
}

/// The smallest fix the OOM's cause allows, applied to the run (allocator
/// settings, another GPU, a smaller plan), or why there is none.
#[allow(clippy::too_many_arguments)]
fn next_after_oom(
    opts: &RunOptions,
    run: &mut Run,
    explained: Option<&Explanation>,
    settings: Option<&str>,
    plan_applied: Option<bool>,
    not_applied: Option<&str>,
    stopped_by: &std::cell::Cell<i32>,
    say: &mut dyn FnMut(&str),
) -> Next {
    if plan_applied == Some(false) {
        run.notes.push(format!(
            "out of memory, and the command did not apply the plan oomkit handed it{}: a smaller micro-batch would not reach it either; give the command {{batch_size}} and {{grad_accum}}",
            in_parens(not_applied)
        ));
        return Next::Stop("oom");
    }
    if run.on_cpu {
        run.notes
            .push("the CPU run ran out of host memory too".into());
        return Next::Stop("oom");
    }
    if run.retries_left == 0 {
        run.notes.push(format!(
            "out of memory; no retries left (--max-retries {})",
            opts.max_retries
        ));
        return Next::Stop("oom");
    }
    let cause = explained.map(|e| e.cause);
    // The smallest fix first: neither of these costs throughput.
    if cause == Some(Cause::Fragmentation) && !settings.is_some_and(oom::expandable_segments_on) {
        let conf = with_expandable_segments(settings);
        // Where the attempt left a snapshot, its replay says whether the
        // setting avoids the OOM before an attempt is spent finding out.
        let snapshot = run.attempts.last().and_then(|a| a.snapshot.clone());
        let replayed = snapshot
            .as_deref()
            .and_then(|s| crate::replay::replay_fix(std::path::Path::new(s), &conf));
        if let Some(last) = run.attempts.last_mut() {
            last.replayed = replayed.clone();
        }
        match (&replayed, &snapshot) {
            (Some(r), Some(s)) if !r.avoided => {
                let note = format!(
                    "the memory was fragmented, but replaying {s} with {conf}, the OOM at event {} still happens (peak {} reserved instead of {}): stepping the micro-batch down instead",
                    r.event,
                    human_bytes(r.peak_reserved_bytes),
                    human_bytes(r.recorded_peak_reserved_bytes)
                );
                say(&note);
                run.notes.push(note);
            }
            (r, s) => {
                let why = match (r, s) {
                    (Some(r), Some(s)) => format!(
                        " (replaying {s} with it, the OOM at event {} does not happen; peak {} reserved instead of {})",
                        r.event,
                        human_bytes(r.peak_reserved_bytes),
                        human_bytes(r.recorded_peak_reserved_bytes)
                    ),
                    _ => String::new(),
                };
                say(&format!(
                    "the memory was fragmented: retrying the same plan with {ALLOC_CONF_ENV}={conf}{why}"
                ));
                run.alloc_conf = Some(conf);
                return Next::Retry(Action::ExpandableSegments);
            }
        }
    }
    if cause == Some(Cause::OtherProcesses) {
        if let Some(next) = other_gpu(opts, run, stopped_by, say) {
            return next;
        }
    }
    if cause == Some(Cause::MemoryFractionLimit) {
        run.notes.push("the process hit its own cap (set_per_process_memory_fraction), not the device's: raising the cap fixes it without a smaller batch".into());
    }
    match step_down(opts, run, explained, cause) {
        Some(n) => {
            if !n.is_exact() {
                let note = format!(
                    "micro-batch {} cannot divide the effective batch {}: accumulation {} gives {} samples per step",
                    n.micro_batch,
                    n.effective_batch,
                    n.grad_accum,
                    n.actual_effective()
                );
                say(&note);
                run.notes.push(note);
            }
            run.plan = Some(n);
            Next::Retry(Action::StepDown)
        }
        None if opts.cpu_fallback => Next::CpuFallback,
        None => Next::Stop("oom"),
    }
}

/// The same plan on another GPU that qualifies, never one where another process took the memory;
/// `None` where no other GPU can take the job (the run steps down instead).
fn other_gpu(
    opts: &RunOptions,
    run: &mut Run,
    stopped_by: &std::cell::Cell<i32>,
    say: &mut dyn FnMut(&str),
) -> Option<Next> {
    let ids = run.gpus.clone()?;
    for id in &ids {
        if !run.avoid.contains(id) {
            run.avoid.push(*id);
        }
    }
    match take_gpus(opts, &run.avoid, stopped_by, say) {
        Ok((new_ids, _, h)) => {
            say(&format!(
                "another process took the memory on GPU {}: retrying the same plan on GPU {}",
                join(&ids),
                join(&new_ids)
            ));
            run.gpus = Some(new_ids);
            run._held = Some(h);
            Some(Next::Retry(Action::OtherGpu))
        }
        Err(GpuError::Stopped) => {
            run.notes
                .push("stopped while waiting for another GPU".into());
            Some(Next::Stop("interrupted"))
        }
        Err(e) => {
            say(&format!(
                "another process took the memory on GPU {}, and no other GPU can take the job ({e}): stepping down instead",
                join(&ids)
            ));
            None
        }
    }
}

/// The next smaller plan: the largest the capacity OOMs' figures leave
/// possible, else half; `None` (with a note saying why) where none is allowed.
fn step_down(
    opts: &RunOptions,
    run: &mut Run,
    explained: Option<&Explanation>,
    cause: Option<Cause>,
) -> Option<BatchPlan> {
    let Some(p) = run.plan else {
        run.notes.push("out of memory; give --batch-size (and {batch_size} in the command or OOMKIT_MICRO_BATCH in the script) to retry with smaller micro-batches".into());
        return None;
    };
    // Only a capacity OOM with figures steps by them; any other step down
    // halves, whatever earlier OOMs said.
    let this = explained.and_then(|e| fit::observe(e, p.micro_batch));
    run.observed.extend(this);
    let target = this
        .and_then(|_| fit::predicted_fit(&run.observed))
        .unwrap_or(p.micro_batch / 2);
    let next = p.step_to(target, opts.min_batch_size);
    if next.is_none() {
        run.notes
            .push(if cause == Some(Cause::RequestExceedsCapacity) {
                format!(
                    "one allocation is larger than the whole device even at micro-batch {}: no batch can fix it (split the operation, or use a larger GPU)",
                    p.micro_batch
                )
            } else {
                format!(
                    "out of memory at micro-batch {}, the smallest allowed (--min-batch-size {})",
                    p.micro_batch, opts.min_batch_size
                )
            });
    }
    next
}

/// The line that says the kernel's OOM killer ended an attempt, in the form `oomkit explain` reads.
fn kill_message(k: &oomkit_gpu::host::OomKill, signal: i32) -> String {
    let limit = k
        .limit_bytes
        .map(|l| format!(" of {l} bytes"))
        .unwrap_or_default();
    let by = match &k.cgroup {
        Some(dir) => format!("the memory cgroup {} recorded an OOM kill", dir.display()),
        None => "the kernel recorded an OOM kill".to_string(),
    };
    format!(
        "{}: signal {signal} ended the command while {by}{}",
        oom::KERNEL_KILL_MARKER,
        if limit.is_empty() {
            String::new()
        } else {
            format!(" (limit{limit})")
        }
    )
}

/// The OOM message to go by and its explanation: the latest message the
/// tracker recorded, else the OOM line the command printed, taking the first
/// of them whose figures say how much was asked for and how much was free.
///
/// The tracker's record comes first because it is the error training really
/// raised, where a framework may print another line or none (accelerate's
/// batch finder prints "No executable batch size found"); a message without
/// figures (the allocator observer's, an old form) explains less than one with them.
fn read_cause(
    recorded: &[String],
    printed: Option<&str>,
    settings: Option<&str>,
) -> (Option<String>, Option<Explanation>) {
    let mut explained: Vec<(&str, Explanation)> = recorded
        .iter()
        .rev()
        .map(String::as_str)
        .chain(printed)
        .filter_map(|m| Some((m, oom::explain(m, settings)?)))
        .collect();
    let has_figures =
        |e: &Explanation| e.message.requested_bytes.is_some() && e.message.free_bytes.is_some();
    match explained
        .iter()
        .position(|(_, e)| has_figures(e))
        .or((!explained.is_empty()).then_some(0))
    {
        Some(i) => {
            let (m, e) = explained.swap_remove(i);
            (Some(m.to_string()), Some(e))
        }
        None => (
            printed
                .or(recorded.last().map(String::as_str))
                .map(String::from),
            None,
        ),
    }
}

/// Chooses and claims the GPUs the job asks for, leaving out `avoid`; a signal
/// that ends the wait is left in `stopped_by`, for the error that reports it.
fn take_gpus(
    opts: &RunOptions,
    avoid: &[u32],
    stopped_by: &std::cell::Cell<i32>,
    say: &mut dyn FnMut(&str),
) -> Result<(Vec<u32>, String, Held), GpuError> {
    let req = Request {
        count: opts.gpus,
        min_free: opts.min_free,
        exclude: avoid.to_vec(),
    };
    let stop = || match child::take_signal() {
        Some(sig) => {
            stopped_by.set(sig);
            true
        }
        None => false,
    };
    let a = acquire(&req, &opts.claims, opts.wait, &mut |m| say(m), &stop)?;
    let names: Vec<String> = a
        .gpus
        .iter()
        .map(|g| {
            format!(
                "GPU {} ({}, {} free)",
                g.index,
                g.name,
                human_bytes(g.free_bytes)
            )
        })
        .collect();
    say(&format!("using {}", names.join(", ")));
    let model = a.gpus.first().map(|g| g.name.clone()).unwrap_or_default();
    Ok((a.gpus.iter().map(|g| g.index).collect(), model, a.held))
}

fn join(ids: &[u32]) -> String {
    ids.iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The user's allocator settings with `expandable_segments:True` added, their other settings kept.
pub(crate) fn with_expandable_segments(settings: Option<&str>) -> String {
    let kept: Vec<&str> = settings
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|kv| {
            !kv.is_empty()
                && !kv
                    .replace(' ', "")
                    .to_ascii_lowercase()
                    .starts_with("expandable_segments:")
        })
        .collect();
    let mut all = kept.join(",");
    if !all.is_empty() {
        all.push(',');
    }
    all.push_str("expandable_segments:True");
    all
}

/// What to put in the launch script so that the next run starts where this one ended.
fn next_time(opts: &RunOptions, plan: Option<&BatchPlan>, alloc_conf: Option<&str>) -> String {
    let mut parts = Vec::new();
    if let (Some(p), Some(first)) = (plan, opts.batch_size) {
        if p.micro_batch != first {
            parts.push(format!(
                "--batch-size {} --grad-accum {}",
                p.micro_batch, p.grad_accum
            ));
        }
    }
    if let Some(conf) = alloc_conf {
        parts.push(format!("{ALLOC_CONF_ENV}={conf}"));
    }
    if parts.is_empty() {
        "next time, start as this run ended: nothing to change".into()
    } else {
        format!(
            "next time, start as this run ended: {}",
            parts.join(" and ")
        )
    }
}
