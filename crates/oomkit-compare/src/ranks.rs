//! The multi-rank table: one row per rank and device, the spread of peaks
//! between ranks, and which rank ran out of memory first.

use crate::Report;
use serde::Serialize;

/// Ranks whose peaks differ by more than this fraction of the smallest are flagged.
pub const IMBALANCE_FRACTION: f64 = 0.10;
/// Differences smaller than this are noise, whatever the fraction.
const IMBALANCE_MIN_BYTES: u64 = 1 << 20;

/// One rank's device in the table.
#[derive(Clone, Debug, Serialize)]
pub struct RankRow {
    /// The file it came from.
    pub file: String,
    /// The rank: from the run log, or from `rank<N>` in a snapshot's file name.
    pub rank: Option<u32>,
    /// `cuda:N` or `cpu`.
    pub device: String,
    /// The attempt the log's last plan belongs to, for a job that stepped down; null for snapshots.
    pub attempt: Option<u64>,
    /// Peak bytes in use (active bytes for a snapshot, the run's peak for a run log); null for a log that measured nothing.
    pub peak_bytes: Option<u64>,
    /// Peak bytes reserved by the allocator.
    pub reserved_bytes: u64,
    /// OOMs recorded.
    pub ooms: usize,
    /// Where the first OOM happened: the trace entry, or the step and stage.
    pub first_oom: Option<String>,
    /// When the first OOM happened, seconds since the epoch, where recorded.
    pub first_oom_time: Option<f64>,
    /// The step of the first OOM, for run logs.
    #[serde(skip)]
    first_oom_step: Option<u64>,
    /// How far this peak lies above the smallest peak in the table, as a fraction of it.
    pub above_smallest: f64,
    /// This row holds the largest peak and the spread is flagged as an imbalance.
    pub imbalanced: bool,
    /// This rank ran out of memory before every other one.
    pub failed_first: bool,
}

fn rank_in_name(path: &str) -> Option<u32> {
    let name = path
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or(path)
        .to_ascii_lowercase();
    let at = name.find("rank")? + 4;
    let digits: String = name[at..]
        .trim_start_matches(['_', '-'])
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// Builds the rank table of several files, with the imbalance and the
/// first failure marked. Several files are taken to be the ranks of one
/// run; a single file has no table, so this is empty for fewer than two.
pub fn rank_table(sources: &[&Report]) -> Vec<RankRow> {
    let mut rows = Vec::new();
    if sources.len() < 2 {
        return rows;
    }
    for s in sources {
        match s {
            Report::Snapshot(fa) => {
                for d in &fa.analysis.devices {
                    let first = d.ooms.first();
                    rows.push(RankRow {
                        file: fa.path.clone(),
                        rank: rank_in_name(&fa.path),
                        device: format!("cuda:{}", d.device),
                        attempt: None,
                        peak_bytes: Some(d.peak_active_bytes),
                        reserved_bytes: d.peak_reserved_bytes.max(d.reserved_bytes),
                        ooms: d.ooms.len(),
                        first_oom: first.map(|o| format!("event {}", o.event_index)),
                        first_oom_time: first.and_then(|o| o.time_us).map(|t| t as f64 / 1e6),
                        first_oom_step: None,
                        above_smallest: 0.0,
                        imbalanced: false,
                        failed_first: false,
                    });
                }
            }
            Report::Run(rf) => {
                let a = &rf.analysis;
                let first = a.ooms.first();
                rows.push(RankRow {
                    file: rf.path.clone(),
                    rank: Some(a.rank),
                    device: a.device.clone(),
                    attempt: a.attempt,
                    peak_bytes: a.peak_bytes,
                    reserved_bytes: a.peak_reserved_bytes,
                    ooms: a.ooms.len(),
                    first_oom: first.map(|o| {
                        let mut s = match (o.step, o.killed_by_kernel) {
                            (Some(s), _) => format!("step {s}"),
                            // A kill before the first record: no step is known.
                            (None, true) => "before any record".into(),
                            (None, false) => "outside a step".into(),
                        };
                        if o.killed_by_kernel {
                            s.push_str(", killed (host memory)");
                        }
                        if let Some(stage) = &o.stage {
                            s.push_str(&format!(", {stage}"));
                        }
                        s
                    }),
                    first_oom_time: first.and_then(|o| o.time),
                    first_oom_step: first.and_then(|o| o.step),
                    above_smallest: 0.0,
                    imbalanced: false,
                    failed_first: false,
                });
            }
        }
    }
    // Rows are compared only with the rows of the same attempt: a job that
    // stepped down holds each rank once per attempt, and two attempts of one
    // rank are not two ranks.
    let mut groups: Vec<Option<u64>> = rows.iter().map(|r| r.attempt).collect();
    groups.sort_unstable();
    groups.dedup();
    for g in groups {
        let members: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].attempt == g).collect();
        mark_group(&mut rows, &members);
    }
    rows
}

/// Marks the spread and the first failure among the rows `members` (one attempt's).
///
/// Files of one rank (two logs of one process: `trainer.fit()` then
/// `trainer.test()`) are not ranks of a job: the spread and the first
/// failure are told only between distinct ranks, or between files whose
/// rank is unknown.
fn mark_group(rows: &mut [RankRow], members: &[usize]) {
    let mut ranks: Vec<Option<u32>> = members.iter().map(|&i| rows[i].rank).collect();
    ranks.sort_unstable();
    let distinct = ranks.windows(2).all(|w| w[0] != w[1] || w[0].is_none());
    if members.len() < 2 || !distinct {
        return;
    }
    // A log that measured nothing has no peak to compare.
    let peaks: Vec<u64> = members.iter().filter_map(|&i| rows[i].peak_bytes).collect();
    let min = peaks.iter().copied().min().unwrap_or(0);
    let max = peaks.iter().copied().max().unwrap_or(0);
    for &i in members {
        let r = &mut rows[i];
        r.above_smallest = match r.peak_bytes {
            Some(p) if min > 0 => (p - min) as f64 / min as f64,
            _ => 0.0,
        };
    }
    let flagged = peaks.len() > 1
        && max - min >= IMBALANCE_MIN_BYTES
        && (min == 0 || (max - min) as f64 / min as f64 > IMBALANCE_FRACTION);
    if flagged {
        for &i in members {
            if rows[i].peak_bytes == Some(max) {
                rows[i].imbalanced = true;
            }
        }
    }
    let group: Vec<RankRow> = members.iter().map(|&i| rows[i].clone()).collect();
    if let Some(k) = first_failure(&group) {
        rows[members[k]].failed_first = true;
    }
}

/// The row that ran out first: by time where every failed row has one,
/// else by step where every failed row is a run log; otherwise unknown.
fn first_failure(rows: &[RankRow]) -> Option<usize> {
    let failed: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].ooms > 0).collect();
    if failed.len() == 1 {
        return failed.first().copied();
    }
    if failed.iter().all(|&i| rows[i].first_oom_time.is_some()) {
        return failed.into_iter().min_by(|&a, &b| {
            let (ta, tb) = (rows[a].first_oom_time, rows[b].first_oom_time);
            ta.partial_cmp(&tb).unwrap_or(std::cmp::Ordering::Equal)
        });
    }
    if failed.iter().all(|&i| rows[i].first_oom_step.is_some()) {
        let earliest = failed
            .iter()
            .filter_map(|&i| rows[i].first_oom_step)
            .min()?;
        let at: Vec<usize> = failed
            .into_iter()
            .filter(|&i| rows[i].first_oom_step == Some(earliest))
            .collect();
        // Ranks that failed in the same step cannot be told apart by step.
        return (at.len() == 1).then(|| at[0]);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_is_read_from_file_names() {
        assert_eq!(rank_in_name("/runs/snap_rank3.pickle"), Some(3));
        assert_eq!(rank_in_name("oom-step4-rank12-1700000000.pickle"), Some(12));
        assert_eq!(rank_in_name("Rank_7.pickle"), Some(7));
        assert_eq!(rank_in_name("/rank9/snap.pickle"), None);
        assert_eq!(rank_in_name("snap.pickle"), None);
    }

    fn row(peak: u64, ooms: usize, time: Option<f64>, step: Option<u64>) -> RankRow {
        RankRow {
            file: "f".into(),
            rank: None,
            device: "cuda:0".into(),
            attempt: None,
            peak_bytes: Some(peak),
            reserved_bytes: peak,
            ooms,
            first_oom: None,
            first_oom_time: time,
            first_oom_step: step,
            above_smallest: 0.0,
            imbalanced: false,
            failed_first: false,
        }
    }

    #[test]
    fn attempts_of_one_rank_are_never_compared_as_ranks() {
        let at = |rank: u32, attempt: u64, peak: u64, ooms: usize| RankRow {
            rank: Some(rank),
            attempt: Some(attempt),
            ..row(peak, ooms, None, Some(1))
        };
        // Rank 0's three attempts: 13% apart, the first two ran out.
        let mut rows = vec![
            at(0, 1, 800 << 20, 1),
            at(0, 2, 760 << 20, 1),
            at(0, 3, 700 << 20, 0),
        ];
        for g in [1, 2, 3] {
            let members: Vec<usize> = (0..3).filter(|&i| rows[i].attempt == Some(g)).collect();
            mark_group(&mut rows, &members);
        }
        assert!(rows.iter().all(|r| !r.imbalanced && !r.failed_first));
        // Two ranks of one attempt are ranks: the spread and the only failure are told.
        let mut rows = vec![at(0, 1, 700 << 20, 0), at(1, 1, 900 << 20, 1)];
        mark_group(&mut rows, &[0, 1]);
        assert!(rows[1].imbalanced && rows[1].failed_first);
        // Two logs of one process (fit, then test) are not ranks either.
        let mut rows = vec![at(0, 1, 700 << 20, 0), at(0, 1, 900 << 20, 1)];
        mark_group(&mut rows, &[0, 1]);
        assert!(!rows[1].imbalanced && !rows[1].failed_first);
    }

    #[test]
    fn first_failure_goes_by_time_then_step() {
        let rows = [
            row(1, 1, Some(20.0), Some(3)),
            row(1, 1, Some(10.0), Some(5)),
            row(1, 0, None, None),
        ];
        assert_eq!(first_failure(&rows), Some(1));
        let rows = [row(1, 1, None, Some(3)), row(1, 1, Some(1.0), Some(5))];
        assert_eq!(first_failure(&rows), Some(0));
        let rows = [row(1, 1, None, Some(3)), row(1, 1, None, Some(3))];
        assert_eq!(first_failure(&rows), None, "a tie is not a first");
        let rows = [row(1, 1, None, None), row(1, 1, None, Some(3))];
        assert_eq!(first_failure(&rows), None);
        let rows = [row(1, 0, None, None), row(1, 2, None, None)];
        assert_eq!(
            first_failure(&rows),
            Some(1),
            "the only failure is the first"
        );
    }
}
