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
    if opts.command.is_empty() {
        return Err(SuperviseError::Usage("no command given after --".into()));
    }
    if opts.batch_size.is_none() && opts.command.iter().any(|a| has_batch_placeholder(a)) {
        return Err(SuperviseError::Usage(
            "the command uses {batch_size} or {grad_accum}; give --batch-size to fill them".into(),
        ));
    }
    let mut plan = opts.batch_size.map(|b| {
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
    child::catch_signals();
    // Which signal ended a wait for GPUs, for the error that reports it.
    let stopped_by = std::cell::Cell::new(0);
    let (mut gpus, mut _held, model) = if opts.gpus == 0 {
        (None, None, UNMANAGED_MODEL.to_string())
    } else {
        match take_gpus(opts, &[], &stopped_by, say) {
            Ok((ids, model, h)) => (Some(ids), Some(h), model),
            Err(e) if e.is_absent() && !opts.require_gpu => {
                say(&format!(
                    "warning: {e}; running the command without choosing a GPU (--require-gpu makes this an error)"
                ));
                (None, None, UNMANAGED_MODEL.to_string())
            }
            Err(GpuError::Stopped) => {
                return Err(SuperviseError::Interrupted(stopped_by.get()));
            }
            Err(e) => return Err(e.into()),
        }
    };
    // GPUs where another process took the memory: not chosen again this run.
    let mut avoid: Vec<u32> = Vec::new();
    // What oomkit adds to the allocator settings, on top of the user's.
    let mut alloc_conf: Option<String> = None;
    let key = PlanMemory::key(&opts.command, &model, plan.map_or(0, |p| p.effective_batch));
    if let (Some(memory), false) = (&opts.memory, opts.fresh) {
        if let Some(r) = memory.recall(&key) {
            let smaller = plan.filter(|p| r.micro_batch < p.micro_batch);
            if smaller.is_some() || r.alloc_conf.is_some() {
                if let Some(p) = smaller {
                    plan = Some(BatchPlan::new(r.micro_batch, p.effective_batch));
                }
                alloc_conf = r.alloc_conf.clone();
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
        }
    }

    let mut attempts = Vec::new();
    let mut notes = Vec::new();
    let mut on_cpu = false;
    let mut retries_left = opts.max_retries;
    // What each capacity OOM said about memory at its micro-batch.
    let mut observed: Vec<Observation> = Vec::new();
    let events_file =
        std::env::temp_dir().join(format!("oomkit-events-{}.jsonl", std::process::id()));
    loop {
        let number = attempts.len() as u32 + 1;
        let mut spec = Spec {
            argv: opts
                .command
                .iter()
                .map(|a| fill_placeholders(a, plan.as_ref(), number))
                .collect(),
            env: vec![
                env(child_env::ATTEMPT, number),
                (
                    child_env::EVENTS_FILE.into(),
                    events_file.clone().into_os_string(),
                ),
            ],
            stdout_to_stderr: opts.child_stdout_to_stderr,
            data_limit: opts.host_memory_limit,
        };
        let _ = std::fs::remove_file(&events_file);
        if opts.auto_callback {
            spec.env.push(env(child_env::AUTO_CALLBACK, 1));
        }
        // Only torchrun reads it; a user's own setting stands.
        if std::env::var_os(TORCHRUN_SEPARATE_STORE_ENV).is_none() {
            spec.env.push(env(TORCHRUN_SEPARATE_STORE_ENV, 1));
        }
        if let Some(conf) = &alloc_conf {
            spec.env.push(env(ALLOC_CONF_ENV, conf));
        }
        if let Some(p) = &plan {
            spec.env.push(env(child_env::MICRO_BATCH, p.micro_batch));
            spec.env.push(env(child_env::GRAD_ACCUM, p.grad_accum));
            spec.env
                .push(env(child_env::EFFECTIVE_BATCH, p.effective_batch));
        }
        let device = if on_cpu {
            spec.env.push(env("CUDA_VISIBLE_DEVICES", ""));
            spec.env.push(env(child_env::DEVICE, "cpu"));
            "cpu"
        } else if let Some(ids) = &gpus {
            spec.env.extend(child::visible_devices(ids));
            spec.env.push(env(child_env::DEVICE, "cuda"));
            "cuda"
        } else {
            "unmanaged"
        };
        let place = match device {
            "cpu" => "the CPU".to_string(),
            "cuda" => format!("cuda:{}", join(gpus.as_deref().unwrap_or(&[]))),
            _ => "the devices the command chooses".to_string(),
        };
        if let Some(p) = &plan {
            say(&format!(
                "attempt {number}: micro-batch {} x accumulation {} = {} on {place}",
                p.micro_batch,
                p.grad_accum,
                p.actual_effective()
            ));
        } else if number > 1 {
            say(&format!("attempt {number} on {place}"));
        }
        let out = child::run(&spec, &mut |_| {})?;
        let events = events::read(&events_file);
        let _ = std::fs::remove_file(&events_file);
        let killed = out.oom_kill.as_ref().map(|k| {
            let message = kill_message(k, out.signal.unwrap_or(libc::SIGKILL));
            say(&message);
            message
        });
        if let (Some(sig), Some(kill)) = (out.signal, &out.oom_kill) {
            let closed = events::close_killed_logs(
                &events.logs,
                &events::Killed {
                    signal: sig,
                    oom_kill: true,
                    limit_bytes: kill.limit_bytes,
                },
            );
            for log in closed {
                say(&format!(
                    "closed {} with how the attempt ended",
                    log.display()
                ));
            }
        } else if let (Some(sig), None) = (out.signal, out.interrupted_by) {
            events::close_killed_logs(
                &events.logs,
                &events::Killed {
                    signal: sig,
                    oom_kill: false,
                    limit_bytes: None,
                },
            );
        }
        let recorded = events.ooms.clone();
        let oom = (out.oom_line.is_some() || !recorded.is_empty() || killed.is_some())
            && out.exit_code != 0;
        let settings = alloc_conf
            .clone()
            .or_else(|| std::env::var(ALLOC_CONF_ENV).ok());
        let (oom_message, explained) = if oom {
            // The kernel's kill is the attempt's end, whatever the output said before it.
            match &killed {
                Some(m) => (Some(m.clone()), oom::explain(m, settings.as_deref())),
                None => read_cause(&recorded, out.oom_line.as_deref(), settings.as_deref()),
            }
        } else {
            (out.oom_line.clone(), None)
        };
        // Applied where the command line carries the plan, else as an integration said.
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
                plan_not_applied
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            ));
        }
        attempts.push(Attempt {
            attempt: number,
            batch_size: plan.map(|p| p.micro_batch),
            grad_accum: plan.map(|p| p.grad_accum),
            effective_batch: plan.map(|p| p.actual_effective()),
            gpus: if on_cpu {
                vec![]
            } else {
                gpus.clone().unwrap_or_default()
            },
            device,
            exit_code: out.exit_code,
            oom,
            oom_message,
            cause: explained.as_ref().map(|e| e.cause),
            action: None,
            plan_applied,
            plan_not_applied: plan_not_applied.clone(),
            killed_for_memory: killed.is_some(),
            logs: events
                .logs
                .iter()
                .map(|l| l.display().to_string())
                .collect(),
            seconds: out.duration.as_secs_f64(),
        });
        let finish = |attempts: &mut Vec<Attempt>,
                      action: Option<Action>,
                      outcome,
                      mut notes: Vec<String>| {
            if let Some(last) = attempts.last_mut() {
                last.action = action;
            }
            if outcome == "succeeded" && attempts.len() > 1 {
                notes.push(next_time(opts, plan.as_ref(), alloc_conf.as_deref()));
            }
            RunSummary {
                exit_code: out.exit_code,
                attempts: attempts.clone(),
                outcome,
                notes,
            }
        };
        if let Some(sig) = out.interrupted_by {
            notes.push(format!("stopped by signal {sig}; not retried"));
            return Ok(finish(&mut attempts, None, "interrupted", notes));
        }
        if out.exit_code == 0 {
            let remember = plan_applied != Some(false);
            if !remember {
                notes.push(format!(
                    "the command did not apply the plan oomkit handed it{}: it is not remembered; give the command {{batch_size}} and {{grad_accum}} so that oomkit's plan reaches it",
                    plan_not_applied
                        .as_ref()
                        .map(|r| format!(" ({r})"))
                        .unwrap_or_default()
                ));
            }
            if let Some(memory) = opts.memory.as_ref().filter(|_| remember) {
                let finished = Remembered {
                    micro_batch: plan.map_or(0, |p| p.micro_batch),
                    grad_accum: plan.map_or(0, |p| p.grad_accum),
                    alloc_conf: alloc_conf.clone(),
                    time: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                };
                if let Err(e) = memory.remember(&key, finished) {
                    say(&format!(
                        "warning: could not keep the plan in {}: {e}",
                        memory.path().display()
                    ));
                }
            }
            return Ok(finish(&mut attempts, None, "succeeded", notes));
        }
        if !oom {
            return Ok(finish(&mut attempts, None, "failed", notes));
        }
        if plan_applied == Some(false) {
            notes.push(format!(
                "out of memory, and the command did not apply the plan oomkit handed it{}: a smaller micro-batch would not reach it either; give the command {{batch_size}} and {{grad_accum}}",
                plan_not_applied
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            ));
            return Ok(finish(&mut attempts, Some(Action::Stop), "oom", notes));
        }
        if on_cpu {
            notes.push("the CPU run ran out of host memory too".into());
            return Ok(finish(&mut attempts, Some(Action::Stop), "oom", notes));
        }
        if retries_left == 0 {
            notes.push(format!(
                "out of memory; no retries left (--max-retries {})",
                opts.max_retries
            ));
            return Ok(finish(&mut attempts, Some(Action::Stop), "oom", notes));
        }
        let cause = explained.as_ref().map(|e| e.cause);
        // The smallest fix first: neither of these costs throughput.
        if cause == Some(Cause::Fragmentation)
            && !settings.as_deref().is_some_and(oom::expandable_segments_on)
        {
            let conf = with_expandable_segments(settings.as_deref());
            say(&format!(
                "the memory was fragmented: retrying the same plan with {ALLOC_CONF_ENV}={conf}"
            ));
            alloc_conf = Some(conf);
            retries_left -= 1;
            attempts.last_mut().expect("pushed").action = Some(Action::ExpandableSegments);
            continue;
        }
        if cause == Some(Cause::OtherProcesses) {
            if let Some(ids) = gpus.clone() {
                for id in &ids {
                    if !avoid.contains(id) {
                        avoid.push(*id);
                    }
                }
                match take_gpus(opts, &avoid, &stopped_by, say) {
                    Ok((new_ids, _, h)) => {
                        say(&format!(
                            "another process took the memory on GPU {}: retrying the same plan on GPU {}",
                            join(&ids),
                            join(&new_ids)
                        ));
                        gpus = Some(new_ids);
                        _held = Some(h);
                        retries_left -= 1;
                        attempts.last_mut().expect("pushed").action = Some(Action::OtherGpu);
                        continue;
                    }
                    Err(GpuError::Stopped) => {
                        notes.push("stopped while waiting for another GPU".into());
                        return Ok(finish(&mut attempts, Some(Action::Stop), "interrupted", notes));
                    }
                    Err(e) => say(&format!(
                        "another process took the memory on GPU {}, and no other GPU can take the job ({e}): stepping down instead",
                        join(&ids)
                    )),
                }
            }
        }
        if cause == Some(Cause::MemoryFractionLimit) {
            notes.push("the process hit its own cap (set_per_process_memory_fraction), not the device's: raising the cap fixes it without a smaller batch".into());
        }
        let next = match &plan {
            None => {
                notes.push("out of memory; give --batch-size (and {batch_size} in the command or OOMKIT_MICRO_BATCH in the script) to retry with smaller micro-batches".into());
                None
            }
            Some(p) => match p.step_to(
                {
                    // Only a capacity OOM with figures steps by them; any
                    // other step down halves, whatever earlier OOMs said.
                    let this = explained
                        .as_ref()
                        .and_then(|e| fit::observe(e, p.micro_batch));
                    observed.extend(this);
                    this.and_then(|_| fit::predicted_fit(&observed))
                        .unwrap_or(p.micro_batch / 2)
                },
                opts.min_batch_size,
            ) {
                Some(n) => Some(n),
                None => {
                    notes.push(if cause == Some(Cause::RequestExceedsCapacity) {
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
                    None
                }
            },
        };
        match next {
            Some(n) => {
                retries_left -= 1;
                if !n.is_exact() {
                    let note = format!(
                        "micro-batch {} cannot divide the effective batch {}: accumulation {} gives {} samples per step",
                        n.micro_batch,
                        n.effective_batch,
                        n.grad_accum,
                        n.actual_effective()
                    );
                    say(&note);
                    notes.push(note);
                }
                attempts.last_mut().expect("pushed").action = Some(Action::StepDown);
                plan = Some(n);
            }
            None if opts.cpu_fallback => {
                say("falling back to the CPU (--cpu-fallback)");
                attempts.last_mut().expect("pushed").action = Some(Action::CpuFallback);
                on_cpu = true;
            }
            None => return Ok(finish(&mut attempts, Some(Action::Stop), "oom", notes)),
        }
    }
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
