//! The formats oomkit writes, one module each: text for people ([`text`]),
//! JSON for scripts ([`json`], the contracts in docs/json.md), the
//! self-contained HTML page ([`html_report`]) and Perfetto's trace
//! ([`trace`]). They render the analyses below them: the one input type
//! ([`oomkit_compare::Report`]: a snapshot or a run log) and what is worked
//! out across files, and every other command's result. [`Output`] is the
//! one decision of which format a command writes, and [`Render`] the seam
//! every result with a text and a JSON form prints through.
//!
//! ```
//! use oomkit_report::Output;
//! let log = "{\"type\":\"start\",\"version\":1,\"device\":\"cpu\"}\n\
//!            {\"type\":\"step\",\"step\":0,\"start_bytes\":0,\"end_bytes\":0,\"peak_bytes\":1048576}\n";
//! let run = oomkit_runlog::Run::parse(log.as_bytes()).unwrap();
//! let report = oomkit_compare::Report::Run(Box::new(oomkit_compare::RunFile {
//!     path: "run.jsonl".into(),
//!     analysis: oomkit_runlog::analyze(&run),
//!     run: None,
//! }));
//! let job = oomkit_compare::Job::new(vec![Ok(report)]);
//! let mut out = Vec::new();
//! Output::Text.write_job(&job, &mut out).unwrap();
//! assert!(String::from_utf8(out).unwrap().contains("1 step, peak 1.00 MiB"));
//! ```

mod error;
mod html;
pub mod json;
mod output;
mod perfetto;
mod preflight;
pub mod text;

pub use error::ReportError;
pub use html::{html_report, PAGE_MAX_POINTS};
pub use output::{Needs, Output};
pub use perfetto::{run_trace, snapshot_trace, trace, Trace, TRACE_MAX_POINTS};
pub use preflight::{
    FixRow, LineBytes, OutOfMemory, PreflightReport, PreflightRun, Recipe, Replayed,
};

use oomkit_compare::{Diff, Job};
use oomkit_estimate::calibrate::Calibration;
use oomkit_estimate::Estimate;
use oomkit_gpu::Gpu;
use oomkit_supervise::explain::Explanation;
use oomkit_supervise::find_batch::FindBatchReport;
use oomkit_supervise::RunSummary;
use serde_json::Value;

/// A result a command prints, in the two formats every command offers.
pub trait Render {
    /// The report for people, as the terminal shows it.
    fn text(&self) -> String;
    /// The JSON document for scripts, as docs/json.md describes it.
    fn json(&self) -> Value;
}

/// Serialises a result whose JSON is its serde form.
fn serde_json_of(v: &impl serde::Serialize) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

impl Render for Job {
    fn text(&self) -> String {
        text::job(self)
    }
    fn json(&self) -> Value {
        json::job(self)
    }
}

/// A comparison, listing at most `top` changed sites per device in text (JSON lists them all).
pub struct Compared<'a> {
    /// The comparison.
    pub diff: &'a Diff,
    /// How many changed sites the text lists per device.
    pub top: usize,
}

impl Render for Compared<'_> {
    fn text(&self) -> String {
        text::diff(self.diff, self.top)
    }
    fn json(&self) -> Value {
        serde_json_of(self.diff)
    }
}

/// A memory budget and, where peaks were measured, its calibration.
pub struct Budget<'a> {
    /// What the formulas say.
    pub estimate: &'a Estimate,
    /// What the measured peaks say, beside it.
    pub calibration: Option<&'a Calibration>,
    /// The step traced with preflight (`--trace`), or why it could not be.
    pub traced: Option<&'a Result<PreflightRun, String>>,
}

impl Render for Budget<'_> {
    fn text(&self) -> String {
        let mut out = text::estimate(self.estimate);
        if let Some(c) = self.calibration {
            out.push('\n');
            out.push_str(&text::calibration(c));
        }
        if let Some(t) = self.traced {
            out.push('\n');
            out.push_str(&text::traced(self.estimate, t));
        }
        out
    }
    fn json(&self) -> Value {
        let mut v = json::estimate(self.estimate, self.calibration);
        if let (Some(t), Value::Object(m)) = (self.traced, &mut v) {
            match t {
                Ok(run) => m.insert("traced".into(), serde_json_of(run)),
                Err(e) => m.insert("traced_error".into(), Value::String(e.clone())),
            };
        }
        v
    }
}

/// The GPUs `oomkit gpus` lists.
pub struct Gpus<'a>(pub &'a [Gpu]);

impl Render for Gpus<'_> {
    fn text(&self) -> String {
        text::gpus(self.0)
    }
    fn json(&self) -> Value {
        serde_json_of(&self.0)
    }
}

impl Render for Explanation {
    fn text(&self) -> String {
        text::explanation(self)
    }
    fn json(&self) -> Value {
        serde_json_of(self)
    }
}

impl Render for RunSummary {
    fn text(&self) -> String {
        text::run_summary(self)
    }
    fn json(&self) -> Value {
        serde_json_of(self)
    }
}

/// A snapshot's OOM explained (`oomkit explain SNAPSHOT`).
pub struct SnapshotOom<'a>(pub &'a oomkit_compare::FileAnalysis);

impl Render for SnapshotOom<'_> {
    fn text(&self) -> String {
        text::snapshot_oom(self.0)
    }
    fn json(&self) -> Value {
        let a = &self.0.analysis;
        let oom = self.0.first_oom();
        let findings: Vec<&oomkit_advice::Finding> = match oom {
            Some((d, o)) => a
                .findings
                .iter()
                .filter(|f| {
                    f.device == Some(d) && (f.event == Some(o.event_index) || f.replayed.is_some())
                })
                .collect(),
            None => Vec::new(),
        };
        serde_json::json!({
            "file": self.0.path,
            "verdict": serde_json_of(&a.verdict),
            "device": oom.map(|(d, _)| d),
            "oom": oom.map(|(_, o)| serde_json_of(o)),
            "findings": serde_json_of(&findings),
        })
    }
}

/// The what-ifs of one snapshot, with the file they came from.
pub struct WhatIfReport<'a> {
    /// The file, as given.
    pub file: &'a str,
    /// The replays.
    pub whatif: &'a oomkit_allocator::WhatIf,
}

impl Render for WhatIfReport<'_> {
    fn text(&self) -> String {
        text::whatif(self.file, self.whatif)
    }
    fn json(&self) -> Value {
        let mut v = serde_json_of(self.whatif);
        if let Value::Object(m) = &mut v {
            m.insert("file".into(), Value::String(self.file.to_string()));
        }
        v
    }
}

impl Render for PreflightReport {
    fn text(&self) -> String {
        text::preflight(self)
    }
    fn json(&self) -> Value {
        serde_json_of(self)
    }
}

impl Render for FindBatchReport {
    fn text(&self) -> String {
        text::find_batch(self)
    }
    fn json(&self) -> Value {
        serde_json_of(self)
    }
}
