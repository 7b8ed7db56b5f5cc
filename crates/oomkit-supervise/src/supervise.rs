//! The retry loop behind `oomkit run`: each attempt run and read (its
//! exit, its OOM and the cause its message gives), and the next one chosen
//! by the policy (`policy.rs`) until the command succeeds, fails for
//! another reason, or nothing is left to try.

use crate::child::{self, Spec};
use crate::child_env;
use crate::events;
use crate::explain::{explain, Explanation};
use crate::oom;
use crate::plan::BatchPlan;
use crate::policy::{next_after_oom, Next};
use crate::recall::{next_time, recall, remember};
use crate::remember::PlanMemory;
use crate::run::{in_parens, Action, Attempt, Run, RunOptions, RunSummary, ALLOC_CONF_ENV};
use crate::run_gpus::{first_gpus, join};
use crate::{fill_placeholders, has_batch_placeholder, SuperviseError};
use std::ffi::OsString;

/// torch elastic's switch for a rendezvous store apart from the workers' one;
/// torchrun's restarts hang without it on current releases (pytorch #135712,
/// #167288), and `auto_batch` relies on them to step every rank down.
const TORCHRUN_SEPARATE_STORE_ENV: &str = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE";

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
        (Some(m), true) => (Some(m.clone()), explain(m, settings)),
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
        .filter_map(|m| Some((m, explain(m, settings)?)))
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
