//! The run log of oomkit's Python tracker: one JSON object per line.
//!
//! The tracker hands each record to [`Writer`], which appends it and
//! flushes at every stage and step boundary, so a run killed by SIGKILL still leaves a
//! log whose complete lines can be read. [`Run::read`] reads a log back,
//! tolerating a torn last line, and [`analyze`] turns it into a stage table,
//! leak detection, eval spikes, gradient anomalies, the component breakdown
//! and findings that carry their evidence in numbers.
//!
//! ```
//! use oomkit_runlog::{analyze, Run};
//! let log = concat!(
//!     r#"{"type":"start","version":1,"rank":0,"device":"cuda:0","capacity_bytes":85899345920}"#, "\n",
//!     r#"{"type":"step","step":0,"start_bytes":100,"end_bytes":200,"peak_bytes":900}"#, "\n",
//!     r#"{"type":"end","steps":1}"#, "\n",
//! );
//! let a = analyze(&Run::parse(log.as_bytes()).unwrap());
//! assert_eq!((a.steps, a.peak_bytes), (1, Some(900)));
//! assert!(!a.verdict.failed);
//! ```

mod analysis;
mod attempts;
mod error;
mod findings;
pub mod process;
mod record;
mod report;
mod roles;
mod writer;

pub use analysis::analyze;
pub use attempts::{attempts, Attempt, AttemptOutcome, FirstOom};
pub use error::{Error, Result};
pub use oomkit_advice::{Finding, FindingKind};
pub use record::{
    is_run_log, Components, DuplicateGroup, Duplicates, End, Grad, Measure, MeasureKind,
    ModuleCost, Oom, OomMemory, Plan, Run, Seen, Start, LOG_VERSION,
};
pub use report::{Analysis, Ending, Leak, OomSummary, StageGrowth, StageStats, Warning};
pub use writer::Writer;
