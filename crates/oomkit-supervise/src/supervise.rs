//! The retry loop behind `oomkit run`.

use crate::child::{self, Spec};
use crate::plan::BatchPlan;
use crate::{fill_placeholders, has_batch_placeholder, SuperviseError};
use oomkit_gpu::{acquire, ClaimDir, GpuError, Request, Wait};
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
    /// Ask frameworks with entry points (Lightning) to add oomkit's callback, through [`AUTO_CALLBACK_ENV`].
    pub auto_callback: bool,
    /// Where GPU claims are kept.
    pub claims: ClaimDir,
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

/// Set to `1` in the command's environment so that Lightning's entry point adds oomkit's callback,
/// which applies the plan and records a run log; nothing adds it otherwise.
pub const AUTO_CALLBACK_ENV: &str = "OOMKIT_AUTO_CALLBACK";

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
    let (gpus, _held) = if opts.gpus == 0 {
        (None, None)
    } else {
        let req = Request {
            count: opts.gpus,
            min_free: opts.min_free,
        };
        // Which signal ended the wait, for the error that reports it.
        let stopped_by = std::cell::Cell::new(0);
        let stop = || match child::take_signal() {
            Some(sig) => {
                stopped_by.set(sig);
                true
            }
            None => false,
        };
        match acquire(&req, &opts.claims, opts.wait, &mut |m| say(m), &stop) {
            Ok(a) => {
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
                (
                    Some(a.gpus.iter().map(|g| g.index).collect::<Vec<_>>()),
                    Some(a.held),
                )
            }
            Err(e) if e.is_absent() && !opts.require_gpu => {
                say(&format!(
                    "warning: {e}; running the command without choosing a GPU (--require-gpu makes this an error)"
                ));
                (None, None)
            }
            Err(GpuError::Stopped) => {
                return Err(SuperviseError::Interrupted(stopped_by.get()));
            }
            Err(e) => return Err(e.into()),
        }
    };

    let mut attempts = Vec::new();
    let mut notes = Vec::new();
    let mut on_cpu = false;
    let mut retries_left = opts.max_retries;
    loop {
        let number = attempts.len() as u32 + 1;
        let mut spec = Spec {
            argv: opts
                .command
                .iter()
                .map(|a| fill_placeholders(a, plan.as_ref(), number))
                .collect(),
            env: vec![env("OOMKIT_ATTEMPT", number)],
        };
        if opts.auto_callback {
            spec.env.push(env(AUTO_CALLBACK_ENV, 1));
        }
        if let Some(p) = &plan {
            spec.env.push(env("OOMKIT_MICRO_BATCH", p.micro_batch));
            spec.env.push(env("OOMKIT_GRAD_ACCUM", p.grad_accum));
            spec.env
                .push(env("OOMKIT_EFFECTIVE_BATCH", p.effective_batch));
        }
        let device = if on_cpu {
            spec.env.push(env("CUDA_VISIBLE_DEVICES", ""));
            spec.env.push(env("OOMKIT_DEVICE", "cpu"));
            "cpu"
        } else if let Some(ids) = &gpus {
            spec.env.extend(child::visible_devices(ids));
            spec.env.push(env("OOMKIT_DEVICE", "cuda"));
            "cuda"
        } else {
            "unmanaged"
        };
        let place = match device {
            "cpu" => "the CPU".to_string(),
            "cuda" => format!(
                "cuda:{}",
                gpus.iter()
                    .flatten()
                    .map(|g| g.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
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
        let oom = out.oom_line.is_some() && out.exit_code != 0;
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
            oom_message: out.oom_line.clone(),
            seconds: out.duration.as_secs_f64(),
        });
        let finish = |outcome, notes| RunSummary {
            exit_code: out.exit_code,
            attempts: attempts.clone(),
            outcome,
            notes,
        };
        if let Some(sig) = out.interrupted_by {
            notes.push(format!("stopped by signal {sig}; not retried"));
            return Ok(finish("interrupted", notes));
        }
        if out.exit_code == 0 {
            return Ok(finish("succeeded", notes));
        }
        if !oom {
            return Ok(finish("failed", notes));
        }
        if on_cpu {
            notes.push("the CPU run ran out of host memory too".into());
            return Ok(finish("oom", notes));
        }
        let next = match &plan {
            None => {
                notes.push("out of memory; give --batch-size (and {batch_size} in the command or OOMKIT_MICRO_BATCH in the script) to retry with smaller micro-batches".into());
                None
            }
            Some(_) if retries_left == 0 => {
                notes.push(format!(
                    "out of memory; no retries left (--max-retries {})",
                    opts.max_retries
                ));
                None
            }
            Some(p) => match p.back_off(opts.min_batch_size) {
                Some(n) => Some(n),
                None => {
                    notes.push(format!(
                        "out of memory at micro-batch {}, the smallest allowed (--min-batch-size {})",
                        p.micro_batch, opts.min_batch_size
                    ));
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
                plan = Some(n);
            }
            None if opts.cpu_fallback => {
                say("falling back to the CPU (--cpu-fallback)");
                on_cpu = true;
            }
            None => return Ok(finish("oom", notes)),
        }
    }
}

impl RunSummary {
    /// The attempts as a table for the terminal.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "oomkit run: {} after {} attempt(s)",
            self.outcome,
            self.attempts.len()
        );
        let _ = writeln!(
            out,
            "  {:<3} {:>11} {:>6} {:>9} {:<10} {:>5} {:<4} {:>8}",
            "#", "micro-batch", "accum", "effective", "device", "exit", "OOM", "time"
        );
        for a in &self.attempts {
            let dash = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_else(|| "-".into());
            let device = match (a.device, a.gpus.is_empty()) {
                ("cuda", false) => format!(
                    "cuda:{}",
                    a.gpus
                        .iter()
                        .map(|g| g.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                (d, _) => d.to_string(),
            };
            let _ = writeln!(
                out,
                "  {:<3} {:>11} {:>6} {:>9} {:<10} {:>5} {:<4} {:>7.1}s",
                a.attempt,
                dash(a.batch_size),
                dash(a.grad_accum),
                dash(a.effective_batch),
                device,
                a.exit_code,
                if a.oom { "yes" } else { "no" },
                a.seconds
            );
        }
        for n in &self.notes {
            let _ = writeln!(out, "  note: {n}");
        }
        out
    }
}
