//! The terminal format, for people: one function per thing a command prints,
//! each starting with what matters most (the verdict, the recommendation).

mod attempts;
mod diff;
mod estimate;
mod explain;
mod file;
mod gpus;
mod preflight;
mod ranks;
mod roles;
mod supervise;
mod whatif;

pub use attempts::attempts;
pub use diff::diff;
pub use estimate::{calibration, estimate, traced};
pub use explain::explanation;
pub use file::{run, snapshot, snapshot_oom};
pub use gpus::gpus;
pub use preflight::preflight;
pub use ranks::ranks;
pub use supervise::{find_batch, run_summary};
pub use whatif::whatif;

use oomkit_advice::Verdict;
use oomkit_compare::{Job, Report};
use std::fmt::Write;

/// The two lines a report starts with: what failed or the peak, then the cause and first fix or the top finding.
pub fn verdict(v: &Verdict) -> String {
    format!("{}\n  {}\n", v.headline, v.detail)
}

/// Renders one file's analysis, a snapshot's or a run log's.
pub fn report(r: &Report) -> String {
    match r {
        Report::Snapshot(f) => snapshot(f),
        Report::Run(r) => run(r),
    }
}

/// Renders the files of one command line: for several, the job's verdict
/// first and the file that failed first at the front; then each file, the
/// rank table and the attempts.
pub fn job(job: &Job) -> String {
    let mut out = String::new();
    let order = job.in_report_order();
    match &job.attempts {
        Some(a) => out.push_str(&attempts_verdict(&order, a)),
        None if order.len() > 1 => {
            out.push_str(&job_verdict(&order, job.failed_first().is_some()));
        }
        None => {}
    }
    for (i, r) in order.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&report(r));
    }
    if !job.ranks.is_empty() {
        let _ = write!(out, "\n{}", ranks(&job.ranks));
    }
    if let Some(a) = &job.attempts {
        let _ = write!(out, "\n{}", attempts(a));
    }
    out
}

/// The lines that head a report of a job that ran several attempts: how the
/// last one ended and which ran out before it; where the last ran out, the
/// verdict of its first failing file.
fn attempts_verdict(order: &[&Report], attempts: &[oomkit_runlog::Attempt]) -> String {
    use oomkit_runlog::AttemptOutcome;
    let mut out = format!(
        "== verdict ({} files, {} attempts)\n",
        order.len(),
        attempts.len()
    );
    let Some(last) = attempts.last() else {
        return out;
    };
    let plan = |a: &oomkit_runlog::Attempt| match (a.micro_batch, a.grad_accum) {
        (Some(m), Some(g)) => format!(" (micro-batch {m} x accumulation {g})"),
        _ => String::new(),
    };
    let before: Vec<String> = attempts[..attempts.len() - 1]
        .iter()
        .filter(|a| a.outcome == AttemptOutcome::RanOut)
        .map(|a| a.attempt.to_string())
        .collect();
    let before = match before.len() {
        0 => String::new(),
        1 => format!("; attempt {} ran out of memory before it", before[0]),
        _ => format!(
            "; attempts {} ran out of memory before it",
            before.join(", ")
        ),
    };
    let how = match last.outcome {
        AttemptOutcome::Finished => "finished",
        AttemptOutcome::RanOut => "ran out of memory",
        AttemptOutcome::Ended => {
            "ended without closing its logs (killed, crashed, or still running)"
        }
    };
    let _ = writeln!(
        out,
        "the last attempt, {}{}, {how}{before}",
        last.attempt,
        plan(last)
    );
    if last.outcome == AttemptOutcome::RanOut {
        let failing = order.iter().find(|r| {
            matches!(r, Report::Run(rf) if rf.analysis.attempt == Some(last.attempt))
                && r.verdict().failed
        });
        if let Some(r) = failing {
            let _ = write!(out, "{}: {}", r.path(), verdict(r.verdict()));
        }
    }
    out.push('\n');
    out
}

/// The lines that head a report of several files: which one failed first, and its verdict.
fn job_verdict(order: &[&Report], first_known: bool) -> String {
    let verdicts: Vec<_> = order.iter().map(|r| (r.path(), r.verdict())).collect();
    let failed = verdicts.iter().filter(|(_, v)| v.failed).count();
    let mut out = format!("== verdict ({} files)\n", verdicts.len());
    match verdicts.first() {
        Some((path, v)) if v.failed => {
            let which = if first_known || failed == 1 {
                "failed first"
            } else {
                "failed (the files do not tell which was first)"
            };
            let others = if failed > 1 {
                format!("; {} of {} files recorded an OOM", failed, verdicts.len())
            } else {
                String::new()
            };
            let _ = write!(out, "{path} {which}{others}\n{}", verdict(v));
        }
        _ => {
            let _ = writeln!(out, "no OOM in any of the {} files", verdicts.len());
        }
    }
    out.push('\n');
    out
}
