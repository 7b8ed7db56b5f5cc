//! What `oomkit run` does after an out-of-memory attempt: the smallest fix
//! its cause allows (the allocator setting for fragmentation, another GPU
//! where another process took the memory, else a smaller micro-batch with
//! more accumulation), or why there is none.

use crate::explain::Explanation;
use crate::fit;
use crate::oom::{self, Cause};
use crate::plan::BatchPlan;
use crate::run::{in_parens, Action, Run, RunOptions, ALLOC_CONF_ENV};
use crate::run_gpus::{join, take_gpus};
use oomkit_gpu::GpuError;
use oomkit_units::human_bytes;

/// What the run does after an OOM.
pub(crate) enum Next {
    /// Run again, changed by this action (the plan, the GPU or the allocator settings already updated).
    Retry(Action),
    /// Run once more on the CPU.
    CpuFallback,
    /// Nothing more to try: the run ends with this outcome.
    Stop(&'static str),
}

/// The smallest fix the OOM's cause allows, applied to the run (allocator
/// settings, another GPU, a smaller plan), or why there is none.
#[allow(clippy::too_many_arguments)]
pub(crate) fn next_after_oom(
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
