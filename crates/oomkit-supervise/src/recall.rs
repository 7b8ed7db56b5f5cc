//! The plan that finished last time for the same command on the same GPU
//! model: where a run starts from it, what it keeps when it finishes, and
//! what to put in the launch script so that the next run starts where this
//! one ended. The store itself is `remember.rs`.

use crate::plan::BatchPlan;
use crate::remember::Remembered;
use crate::run::{in_parens, Run, RunOptions, ALLOC_CONF_ENV};

/// Starts from the plan that finished last time for this command, where it is smaller or set the allocator.
pub(crate) fn recall(
    opts: &RunOptions,
    key: &str,
    model: &str,
    run: &mut Run,
    say: &mut dyn FnMut(&str),
) {
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

/// Keeps the plan of a run that finished, unless the command did not apply it.
pub(crate) fn remember(
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

/// What to put in the launch script so that the next run starts where this one ended.
pub(crate) fn next_time(
    opts: &RunOptions,
    plan: Option<&BatchPlan>,
    alloc_conf: Option<&str>,
) -> String {
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
