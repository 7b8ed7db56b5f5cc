//! The terminal table of a job's attempts: the plan each ran, and which rank ran out first.

use oomkit_runlog::{Attempt, AttemptOutcome};
use std::fmt::Write;

/// Renders the attempts of a job for a terminal; empty for fewer than two attempts.
pub fn attempts(attempts: &[Attempt]) -> String {
    let mut out = String::new();
    if attempts.len() < 2 {
        return out;
    }
    let _ = writeln!(out, "== attempts ({})", attempts.len());
    let _ = writeln!(
        out,
        "  {:<8} {:<22} {:<8} outcome",
        "attempt", "micro x accum = batch", "ranks"
    );
    for a in attempts {
        let plan = match (a.micro_batch, a.grad_accum) {
            (Some(m), Some(g)) => format!("{m} x {g} = {}", a.effective_batch.unwrap_or(m * g)),
            (Some(m), None) => format!("{m} x ?"),
            _ => "?".to_string(),
        };
        let outcome = match a.outcome {
            AttemptOutcome::Finished => "finished".to_string(),
            AttemptOutcome::Ended => "ended without an OOM of its own".to_string(),
            AttemptOutcome::RanOut => match &a.first_oom {
                Some(f) => {
                    let mut at = match (f.step, f.killed_by_kernel) {
                        (Some(s), _) => format!("step {s}"),
                        (None, true) => "before any record".into(),
                        (None, false) => "outside a step".into(),
                    };
                    if let Some(stage) = &f.stage {
                        let _ = write!(at, ", {stage}");
                    }
                    let what = if f.killed_by_kernel {
                        "was killed for host memory"
                    } else {
                        "ran out of memory"
                    };
                    // "First" only says something where several ranks ran.
                    let first = if a.ranks.len() > 1 { " first" } else { "" };
                    format!("rank {} {what}{first} ({at})", f.rank)
                }
                None => format!(
                    "{} {} recorded; the logs do not tell which rank was first",
                    a.ooms,
                    if a.ooms == 1 { "OOM" } else { "OOMs" }
                ),
            },
        };
        let outcome = if a.applied == Some(false) {
            format!("{outcome} (the plan was not applied)")
        } else {
            outcome
        };
        let _ = writeln!(
            out,
            "  {:<8} {:<22} {:<8} {outcome}",
            a.attempt,
            plan,
            ranges(&a.ranks)
        );
    }
    out
}

/// `0-3`, or `0,2,5` where the ranks are not consecutive.
fn ranges(ranks: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j > i {
            format!("{}-{}", ranks[i], ranks[j])
        } else {
            ranks[i].to_string()
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_ranks_read_as_a_range() {
        assert_eq!(ranges(&[0, 1, 2, 3]), "0-3");
        assert_eq!(ranges(&[0, 2, 3, 5]), "0,2-3,5");
        assert_eq!(ranges(&[]), "");
    }
}
