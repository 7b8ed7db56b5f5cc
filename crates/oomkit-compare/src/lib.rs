//! What oomkit's formats render, below the renderers: the one input type
//! ([`Report`]: a snapshot or a run log, analyzed), and what is worked out
//! across files: the [`Diff`] of two runs, the rank table of a job's ranks
//! ([`rank_table`]) and a command line's files taken together ([`Job`]).

mod diff;
mod error;
mod input;
mod job;
mod ranks;

pub use diff::{
    diff_mixed, diff_runs, diff_snapshots, DeviceDelta, Diff, RoleDelta, SiteDelta, StageDelta,
};
pub use error::CompareError;
pub use input::{FileAnalysis, Report, RunFile};
pub use job::{job_attempts, Job, Unreadable};
pub use ranks::{rank_table, RankRow, IMBALANCE_FRACTION};
