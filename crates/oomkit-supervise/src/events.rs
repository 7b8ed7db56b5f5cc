//! What a supervised attempt told `oomkit run` through the file named by
//! `OOMKIT_EVENTS_FILE` (`child_env::EVENTS_FILE`): the OOMs its tracker
//! recorded, the run logs it opened, and whether an integration applied the
//! plan; and the end record `oomkit run` adds to a log whose process the
//! kernel killed, since a killed process writes nothing more.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One attempt's events, in the order they were written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Events {
    /// The messages of the OOMs the tracker recorded, oldest first.
    pub ooms: Vec<String>,
    /// The snapshots the tracker dumped at those OOMs (where it recorded history), oldest first.
    pub snapshots: Vec<PathBuf>,
    /// The run logs the attempt's trackers opened.
    pub logs: Vec<PathBuf>,
    /// What the integrations said of the plan: applied or not, and why not.
    pub plan: Option<PlanReport>,
}

/// Whether the command applied the micro-batch and accumulation it was handed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanReport {
    /// True where every report said applied.
    pub applied: bool,
    /// Why it was not, as the integration put it.
    pub reason: Option<String>,
    /// Who reported it (`lightning callback`, `transformers callback`, `auto_batch`).
    pub by: String,
}

/// Reads the events file at `path`; empty where the command wrote none.
///
/// A line that is not a JSON object (a torn last line after a kill) is
/// skipped; of several plan reports, one that says "not applied" wins, as
/// one rank that trains another batch is enough to break the plan.
pub fn read(path: &Path) -> Events {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Events::default();
    };
    let mut events = Events::default();
    for v in text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        if let Some(m) = v.get("message").and_then(Value::as_str) {
            events.ooms.push(m.to_string());
            if let Some(s) = v.get("snapshot").and_then(Value::as_str) {
                events.snapshots.push(PathBuf::from(s));
            }
        }
        if let Some(log) = v.get("log").and_then(Value::as_str) {
            let log = PathBuf::from(log);
            if !events.logs.contains(&log) {
                events.logs.push(log);
            }
        }
        if let Some(applied) = v.get("applied").and_then(Value::as_bool) {
            let report = PlanReport {
                applied,
                reason: v.get("reason").and_then(Value::as_str).map(String::from),
                by: v
                    .get("by")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            };
            if events.plan.as_ref().is_none_or(|p| p.applied) {
                events.plan = Some(report);
            }
        }
    }
    events
}

/// How a killed attempt ended, for the end record of its logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Killed {
    /// The signal that ended the command.
    pub signal: i32,
    /// True when the kernel recorded an OOM kill while it ran.
    pub oom_kill: bool,
    /// The memory cgroup's limit, where one was set.
    pub limit_bytes: Option<u64>,
}

/// Adds an end record saying how the attempt ended to each log in `logs`
/// that has none; returns the logs it closed.
///
/// A killed process cannot close its own log, so without this the log ends
/// on its last step and reads as a run that is still going. A last line
/// cut short by the kill is ended first, so that the record stands on a
/// line of its own; a log that ends with an `end` record, or that cannot
/// be read or written, is left as it is.
pub fn close_killed_logs(logs: &[PathBuf], killed: &Killed) -> Vec<PathBuf> {
    let mut closed = Vec::new();
    for log in logs {
        let Ok(text) = std::fs::read_to_string(log) else {
            continue;
        };
        let last = text.lines().rev().find(|l| !l.trim().is_empty());
        let has_end = last
            .and_then(|l| serde_json::from_str::<Value>(l).ok())
            .is_some_and(|v| v.get("type").and_then(Value::as_str) == Some("end"));
        if has_end {
            continue;
        }
        let record = serde_json::json!({
            "type": "end",
            "time": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            "ended": "killed",
            "signal": killed.signal,
            "oom_kill": killed.oom_kill,
            "limit_bytes": killed.limit_bytes,
            "written_by": "oomkit run",
        });
        let torn = !text.is_empty() && !text.ends_with('\n');
        let line = format!("{}{record}\n", if torn { "\n" } else { "" });
        let written = std::fs::OpenOptions::new()
            .append(true)
            .open(log)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if written.is_ok() {
            closed.push(log.clone());
        }
    }
    closed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `text` in a scratch folder of its own (the tests run on threads side by side),
    /// and a guard that removes the folder.
    fn temp(name: &str, text: &str) -> (PathBuf, Scratch) {
        let dir = std::env::temp_dir().join(format!("oomkit-events-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        (p, Scratch(dir))
    }

    /// Removes its folder when dropped, so that the tests leave nothing in the temporary folder.
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn ooms_logs_and_a_plan_not_applied() {
        let (p, _scratch) = temp(
            "events.jsonl",
            "{\"log\": \"/runs/a.jsonl\", \"rank\": 0}\n\
             {\"plan\": {\"micro_batch\": 20}, \"applied\": true, \"by\": \"auto_batch\"}\n\
             {\"message\": \"CUDA out of memory. Tried to allocate 2.00 GiB\", \"step\": 3, \"snapshot\": \"/runs/oom-step3-rank0-1.pickle\"}\n\
             {\"plan\": {\"micro_batch\": 20}, \"applied\": false, \"reason\": \"no batch_size\", \"by\": \"lightning callback\"}\n\
             {\"log\": \"/runs/a.jsonl\", \"rank\": 0}\n\
             {\"message\": \"torn",
        );
        let e = read(&p);
        assert_eq!(e.ooms.len(), 1);
        assert_eq!(
            e.snapshots,
            vec![PathBuf::from("/runs/oom-step3-rank0-1.pickle")]
        );
        assert_eq!(e.logs, vec![PathBuf::from("/runs/a.jsonl")]);
        let plan = e.plan.expect("reported");
        assert!(!plan.applied);
        assert_eq!(plan.reason.as_deref(), Some("no batch_size"));
        assert_eq!(read(Path::new("/nonexistent/events")), Events::default());
    }

    #[test]
    fn a_killed_log_gets_one_end_record_after_its_torn_line() {
        let (log, _scratch) = temp(
            "run.jsonl",
            "{\"type\":\"start\",\"version\":1}\n{\"type\":\"step\",\"step\":0,\"peak_bytes\":5}\n{\"type\":\"st",
        );
        let (closed_log, _closed) = temp("closed.jsonl", "{\"type\":\"end\",\"steps\":1}\n");
        let killed = Killed {
            signal: 9,
            oom_kill: true,
            limit_bytes: Some(1 << 30),
        };
        let closed = close_killed_logs(&[log.clone(), closed_log.clone()], &killed);
        assert_eq!(closed, vec![log.clone()]);
        let text = std::fs::read_to_string(&log).expect("read");
        let last: Value = serde_json::from_str(text.lines().last().expect("a line")).expect("json");
        assert_eq!(last["ended"], "killed");
        assert_eq!(last["oom_kill"], true);
        assert_eq!(last["limit_bytes"], 1u64 << 30);
        // Closing again adds nothing.
        assert!(close_killed_logs(&[log], &killed).is_empty());
    }
}
