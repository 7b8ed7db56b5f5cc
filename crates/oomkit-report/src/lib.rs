//! The formats oomkit renders its analyses in, over one input type
//! ([`Report`]: a snapshot or a run log): text for people ([`text`]), JSON
//! for scripts ([`json`], the contract in docs/json.md), the self-contained
//! HTML page ([`html_report`]) and Perfetto's trace ([`trace`]); and the
//! comparisons across files they show: `diff` and the rank and attempt tables.

mod attempts;
mod diff;
mod html;
mod input;
pub mod json;
mod perfetto;
mod ranks;
pub mod text;

pub use attempts::attempts_text;
pub use diff::{diff_runs, diff_snapshots, diff_text, DeviceDelta, Diff, SiteDelta, StageDelta};
pub use html::html_report;
pub use input::{FileAnalysis, Report, RunFile};
use oomkit_snapshot::human_bytes;
pub use perfetto::{run_trace, snapshot_trace, trace, Trace};
pub use ranks::{rank_table, rank_text, RankRow, IMBALANCE_FRACTION};
