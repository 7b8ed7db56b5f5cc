//! The attempts of one job across its ranks' run logs: the plan each
//! attempt ran, which rank ran out of memory first, and how it ended.
//!
//! A job that steps down writes one `plan` record per try: a restarted
//! process (torch elastic, `oomkit run`) starts a new log, and an in-process
//! retry adds a record to the same log. Each OOM belongs to the latest plan
//! its log recorded before it.

use crate::report::{Analysis, Ending, OomSummary};
use serde::Serialize;
use std::collections::BTreeMap;

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// At least one rank ran out of memory.
    RanOut,
    /// Every rank's tracker was closed with this plan: the attempt finished.
    Finished,
    /// It ended without an OOM in these logs and without closing every tracker (killed, or the logs are incomplete).
    Ended,
}

/// The OOM that came first in an attempt.
#[derive(Clone, Debug, Serialize)]
pub struct FirstOom {
    /// The rank that ran out.
    pub rank: u32,
    /// The step, where recorded.
    pub step: Option<u64>,
    /// The stage or phase, where recorded.
    pub stage: Option<String>,
    /// Seconds since the epoch, where recorded.
    pub time: Option<f64>,
    /// True where the kernel's OOM killer ended the rank (host memory).
    pub killed_by_kernel: bool,
}

/// One attempt, across every log that ran it.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    /// The attempt's number, from 1.
    pub attempt: u64,
    /// Samples per forward pass on one process.
    pub micro_batch: Option<u64>,
    /// Micro-batches per optimizer step.
    pub grad_accum: Option<u64>,
    /// Micro-batch x accumulation.
    pub effective_batch: Option<u64>,
    /// Who chose the plan (`auto_batch`, `oomkit run`, `torch elastic restart`, a framework's arguments).
    pub source: String,
    /// Whether the plan was applied, where an integration checked (false: the training ran another batch).
    pub applied: Option<bool>,
    /// The ranks whose logs ran it, in order.
    pub ranks: Vec<u32>,
    /// OOMs recorded in it, over all ranks.
    pub ooms: usize,
    /// The rank that ran out first: by time where every OOM has one, else the only rank that ran out.
    pub first_oom: Option<FirstOom>,
    /// How it ended.
    pub outcome: AttemptOutcome,
}

/// One log's share of an attempt.
struct Share<'a> {
    rank: u32,
    ooms: Vec<&'a OomSummary>,
    finished: bool,
}

/// Groups the logs' plans and OOMs by attempt; empty when no log recorded a plan.
pub fn attempts(logs: &[&Analysis]) -> Vec<Attempt> {
    let mut by_number: BTreeMap<u64, (Attempt, Vec<Share<'_>>)> = BTreeMap::new();
    for a in logs {
        // A plan without a number (a trainer's own arguments) is the attempt
        // the log's start record names, when it is the log's first plan;
        // otherwise the attempt after the log's last numbered one: the
        // first, in a job's first run.
        let mut last = 0;
        let numbers: Vec<u64> = a
            .plans
            .iter()
            .enumerate()
            .map(|(i, p)| {
                last = p.attempt.unwrap_or(match (i, a.start_attempt) {
                    (0, Some(n)) => n,
                    _ => last + 1,
                });
                last
            })
            .collect();
        let numbered: Vec<_> = a.plans.iter().collect();
        for (i, plan) in numbered.iter().enumerate() {
            let n = numbers[i];
            let from = plan.time;
            let until = numbered.get(i + 1).and_then(|p| p.time);
            let last = i + 1 == numbered.len();
            // An OOM without a time can only be placed when the log ran one plan.
            let ooms: Vec<&OomSummary> = a
                .ooms
                .iter()
                .filter(|o| match (o.time, from) {
                    (Some(t), Some(f)) => t >= f && until.is_none_or(|u| t < u),
                    _ => numbered.len() == 1,
                })
                .collect();
            let entry = by_number.entry(n).or_insert_with(|| {
                (
                    Attempt {
                        attempt: n,
                        micro_batch: plan.micro_batch,
                        grad_accum: plan.grad_accum,
                        effective_batch: plan.effective_batch,
                        source: plan.source.clone(),
                        applied: plan.applied,
                        ranks: Vec::new(),
                        ooms: 0,
                        first_oom: None,
                        outcome: AttemptOutcome::Ended,
                    },
                    Vec::new(),
                )
            });
            entry.1.push(Share {
                rank: a.rank,
                ooms,
                // Closed by the tracker, not by `oomkit run` after a kill or by an uncaught exception.
                finished: last && matches!(a.ending, Ending::Closed | Ending::Exit),
            });
        }
    }
    by_number
        .into_values()
        .map(|(mut attempt, shares)| {
            attempt.ranks = shares.iter().map(|s| s.rank).collect();
            attempt.ranks.sort_unstable();
            attempt.ranks.dedup();
            attempt.ooms = shares.iter().map(|s| s.ooms.len()).sum();
            attempt.first_oom = first_oom(&shares);
            attempt.outcome = if attempt.ooms > 0 {
                AttemptOutcome::RanOut
            } else if shares.iter().all(|s| s.finished) {
                AttemptOutcome::Finished
            } else {
                AttemptOutcome::Ended
            };
            attempt
        })
        .collect()
}

fn first_oom(shares: &[Share<'_>]) -> Option<FirstOom> {
    let all: Vec<(u32, &OomSummary)> = shares
        .iter()
        .flat_map(|s| s.ooms.iter().map(move |o| (s.rank, *o)))
        .collect();
    let pick = if all.iter().all(|(_, o)| o.time.is_some()) {
        all.iter().min_by(|a, b| {
            a.1.time
                .partial_cmp(&b.1.time)
                .unwrap_or(std::cmp::Ordering::Equal)
        })
    } else {
        // Without times, only a single failing rank is certain.
        let mut ranks: Vec<u32> = all.iter().map(|(r, _)| *r).collect();
        ranks.dedup();
        if ranks.len() == 1 {
            all.first()
        } else {
            None
        }
    }?;
    Some(FirstOom {
        rank: pick.0,
        step: pick.1.step,
        stage: pick.1.stage.clone(),
        time: pick.1.time,
        killed_by_kernel: pick.1.killed_by_kernel,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analyze, Run};

    fn log(rank: u32, plans: &[(u64, u64, f64)], oom_at: Option<f64>, closed: bool) -> Analysis {
        let mut s = format!(
            "{{\"type\":\"start\",\"version\":1,\"rank\":{rank},\"world_size\":2,\"device\":\"cpu\"}}\n"
        );
        for (attempt, micro, t) in plans {
            s.push_str(&format!(
                "{{\"type\":\"plan\",\"time\":{t},\"micro_batch\":{micro},\"grad_accum\":{},\"effective_batch\":64,\"attempt\":{attempt},\"source\":\"auto_batch\"}}\n",
                64 / micro
            ));
        }
        if let Some(t) = oom_at {
            s.push_str(&format!(
                "{{\"type\":\"oom\",\"time\":{t},\"step\":3,\"stage\":\"forward\",\"message\":\"CUDA out of memory. Tried to allocate 2.00 GiB\"}}\n"
            ));
        }
        if closed {
            s.push_str("{\"type\":\"end\"}\n");
        }
        analyze(&Run::parse(s.as_bytes()).unwrap())
    }

    #[test]
    fn restarted_ranks_group_by_attempt_and_the_first_oom_is_named() {
        // Attempt 1: rank 1 ran out, rank 0 was killed; attempt 2: both finished.
        let logs = [
            log(0, &[(1, 32, 100.0)], Some(105.0), false),
            log(1, &[(1, 32, 100.0)], Some(104.0), false),
            log(0, &[(2, 16, 200.0)], None, true),
            log(1, &[(2, 16, 200.0)], None, true),
        ];
        let a = attempts(&logs.iter().collect::<Vec<_>>());
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].outcome, AttemptOutcome::RanOut);
        assert_eq!(a[0].first_oom.as_ref().map(|f| f.rank), Some(1));
        assert_eq!(a[0].ranks, vec![0, 1]);
        assert_eq!(a[1].micro_batch, Some(16));
        assert_eq!(a[1].outcome, AttemptOutcome::Finished);
    }

    #[test]
    fn an_in_process_retry_splits_one_log_at_its_plan_records() {
        let logs = [log(0, &[(1, 32, 100.0), (2, 16, 110.0)], Some(105.0), true)];
        let a = attempts(&logs.iter().collect::<Vec<_>>());
        assert_eq!(a[0].outcome, AttemptOutcome::RanOut);
        assert_eq!(a[1].outcome, AttemptOutcome::Finished);
        assert_eq!(a[1].ooms, 0);
    }

    #[test]
    fn a_trainers_own_plan_is_the_first_attempt() {
        let mut first = log(1, &[(1, 16, 100.0)], Some(104.0), false);
        first.plans[0].attempt = None;
        let logs = [first, log(1, &[(2, 8, 200.0)], None, true)];
        let a = attempts(&logs.iter().collect::<Vec<_>>());
        assert_eq!(a.iter().map(|x| x.attempt).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(a[0].outcome, AttemptOutcome::RanOut);
    }

    #[test]
    fn an_attempt_killed_without_its_own_oom_has_ended_not_finished() {
        let logs = [log(0, &[(1, 32, 100.0)], None, false)];
        let a = attempts(&logs.iter().collect::<Vec<_>>());
        assert_eq!(a[0].outcome, AttemptOutcome::Ended);
        assert!(a[0].first_oom.is_none());
    }
}
