//! The JSON format: the contract documented in docs/json.md and docs/tracker.md.

use crate::{FileAnalysis, RunFile};
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
