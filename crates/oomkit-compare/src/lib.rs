//! What oomkit's formats render, below the renderers: the one input type
//! ([`Report`]: a snapshot or a run log, analyzed), and what is worked out
//! across files: the [`Diff`] of two runs, the rank table of a job's ranks
//! ([`rank_table`]) and a command line's files taken together ([`Job`]).
//!
//! ```
//! use oomkit_compare::{Job, Report, RunFile};
//! let log = |rank: u32, peak: u64| {
//!     let text = format!(
//!         "{{\"type\":\"start\",\"version\":1,\"rank\":{rank},\"device\":\"cuda:0\"}}\n\
//!          {{\"type\":\"step\",\"step\":0,\"start_bytes\":0,\"end_bytes\":0,\"peak_bytes\":{peak}}}\n"
//!     );
//!     let run = oomkit_runlog::Run::parse(text.as_bytes()).unwrap();
//!     Ok(Report::Run(Box::new(RunFile {
//!         path: format!("rank{rank}.jsonl"),
//!         analysis: oomkit_runlog::analyze(&run),
//!         run: None,
//!     })))
//! };
//! // Two ranks of one job: rank 1 peaks 3x rank 0, which the rank table flags.
//! let job = Job::new(vec![log(0, 1 << 30), log(1, 3 << 30)]);
//! assert!(job.ranks.iter().any(|r| r.rank == Some(1) && r.imbalanced));
//! ```

mod diff;
mod error;
mod fixes;
mod input;
mod job;
mod ranks;

pub use diff::{
    diff_mixed, diff_runs, diff_snapshots, DeviceDelta, Diff, RoleDelta, SiteDelta, StageDelta,
};
pub use error::CompareError;
pub use fixes::{peak_words, replay_fixes, SAME_PEAK};
pub use input::{FileAnalysis, Report, RunFile};
pub use job::{job_attempts, Job, Unreadable};
pub use ranks::{rank_table, RankRow, IMBALANCE_FRACTION};
