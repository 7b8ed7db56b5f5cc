//! The run log of oomkit's Python tracker: one JSON object per line.
//!
//! The tracker hands each record to [`Writer`], which appends it and
//! flushes at every step boundary, so a run killed by SIGKILL still leaves a
//! log whose complete lines can be read. [`Run::read`] reads a log back,
//! tolerating a torn last line, and [`analyze`] turns it into a stage table,
//! leak detection, eval spikes, gradient anomalies, the component breakdown
//! and findings that carry their evidence in numbers.

mod analysis;
mod error;
pub mod process;
mod record;
mod writer;

pub use analysis::{
    analyze, Analysis, Finding, Leak, OomSummary, StageGrowth, StageStats, Warning,
};
pub use error::{Error, Result};
pub use record::{
    is_run_log, Components, DuplicateGroup, Duplicates, Grad, Measure, MeasureKind, ModuleCost,
    Oom, OomMemory, Plan, Run, Start,
};
pub use writer::Writer;
