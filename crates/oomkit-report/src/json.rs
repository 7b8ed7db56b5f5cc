//! The JSON format: the contract documented in docs/json.md and docs/tracker.md.

use oomkit_compare::{FileAnalysis, Job, Report, RunFile};
use oomkit_estimate::calibrate::Calibration;
use oomkit_estimate::Estimate;
use serde_json::{json, Value};

/// Renders one file's analysis as the JSON object documented in docs/json.md.
pub fn snapshot(file: &FileAnalysis) -> Value {
    let mut v = serde_json::to_value(&file.analysis).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("file".into(), json!(file.path));
        m.insert("file_bytes".into(), json!(file.file_bytes));
        m.insert(
            "layout".into(),
            serde_json::to_value(&file.layout).unwrap_or(Value::Null),
        );
    }
    v
}

/// Renders a run log's analysis as JSON: `{"kind": "run", "file": ..., "steps": N, ...}`.
pub fn run(run: &RunFile) -> Value {
    let mut v = serde_json::to_value(&run.analysis).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("file".into(), json!(run.path));
    }
    v
}

/// Renders one file's analysis, a snapshot's or a run log's.
pub fn report(r: &Report) -> Value {
    match r {
        Report::Snapshot(f) => snapshot(f),
        Report::Run(r) => run(r),
    }
}

/// Renders the files of one command line: one file's object, or an array
/// of them for several, each with its rows of the rank table
/// (`multi_rank`) and, for a run log of a job that stepped down, the
/// job's `attempts`; a file that could not be read is `{"file", "error"}`.
pub fn job(job: &Job) -> Value {
    let mut values: Vec<Value> = job
        .files
        .iter()
        .map(|r| match r {
            Ok(rep) => {
                let mut v = report(rep);
                if let (false, Some(m)) = (job.ranks.is_empty(), v.as_object_mut()) {
                    m.insert("multi_rank".into(), json!(job.ranks_of(rep.path())));
                }
                if let (Report::Run(_), Some(a), Some(m)) = (rep, &job.attempts, v.as_object_mut())
                {
                    m.insert("attempts".into(), json!(a));
                }
                v
            }
            Err(u) => json!({"file": u.file, "error": u.error}),
        })
        .collect();
    if values.len() == 1 {
        values.pop().unwrap_or_default()
    } else {
        Value::Array(values)
    }
}

/// Renders a memory budget, with its `calibration` (null when no peak was measured).
pub fn estimate(e: &Estimate, calibration: Option<&Calibration>) -> Value {
    let mut v = serde_json::to_value(e).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        obj.insert("calibration".into(), json!(calibration));
    }
    v
}
