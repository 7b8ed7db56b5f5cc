//! `oomkit export --perfetto`: the trace-event structure, on real snapshots,
//! the bundled demo and a run log, and its handling of bad input.

mod common;
use common::*;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// Runs `oomkit export --perfetto INPUT -o OUTPUT` with further arguments.
fn export(input: &Path, output: &Path, more: &[&str]) -> std::process::Output {
    let mut args = vec![
        "export",
        "--perfetto",
        input.to_str().unwrap(),
        "-o",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(more);
    oomkit(&args, None)
}

/// Checks what ui.perfetto.dev and chrome://tracing require of a trace, and
/// returns its events.
fn valid_trace(doc: &Value) -> Vec<Value> {
    let events = doc["traceEvents"]
        .as_array()
        .expect("traceEvents is a list")
        .clone();
    let mut last_ts: HashMap<(i64, String), f64> = HashMap::new();
    for e in &events {
        let ph = e["ph"].as_str().expect("every event has ph");
        let pid = e["pid"].as_i64().expect("every event has an integer pid");
        assert!(e["name"].is_string(), "{e}");
        if ph == "M" {
            assert!(e["args"]["name"].is_string(), "{e}");
            continue;
        }
        let ts = e["ts"].as_f64().expect("ts is a number");
        assert!(ts >= 0.0, "{e}");
        match ph {
            "C" => {
                assert!(e["args"]["bytes"].is_u64(), "{e}");
                // A counter's samples must not run back in time.
                let key = (pid, e["name"].as_str().unwrap().to_string());
                let prev = last_ts.insert(key, ts).unwrap_or(0.0);
                assert!(ts >= prev, "counter ran back from {prev} to {ts}: {e}");
            }
            "X" => assert!(e["dur"].as_f64().unwrap() >= 0.0, "{e}"),
            "i" => assert_eq!(e["s"], "p", "{e}"),
            other => panic!("unexpected phase {other}: {e}"),
        }
    }
    events
}

fn names(events: &[Value], ph: &str, part: &str) -> usize {
    events
        .iter()
        .filter(|e| e["ph"] == ph && e["name"].as_str().unwrap().contains(part))
        .count()
}

/// Exports a snapshot and checks it against `oomkit analyze --json` on the same file.
fn check_snapshot(path: &Path, max_points: usize) {
    let p = path.to_str().unwrap();
    let trace = run_json(&[
        "export",
        "--perfetto",
        p,
        "-o",
        "-",
        "--max-points",
        &max_points.to_string(),
    ]);
    let events = valid_trace(&trace);
    let analysis = run_json(&["analyze", "--json", p]);
    for d in analysis["devices"].as_array().unwrap() {
        let dev = d["device"].as_i64().unwrap();
        let mine: Vec<&Value> = events.iter().filter(|e| e["pid"] == dev).collect();
        let ooms = d["ooms"].as_array().unwrap().len();
        let oom_marks = mine
            .iter()
            .filter(|e| e["ph"] == "i" && e["name"].as_str().unwrap().contains("OOM"))
            .count();
        assert_eq!(oom_marks, ooms, "{p} cuda:{dev}");
        let active: Vec<u64> = mine
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == "active")
            .map(|e| e["args"]["bytes"].as_u64().unwrap())
            .collect();
        // However thin, the series keeps the peak the analysis found.
        let peak = d["peak_active_bytes"].as_u64().unwrap();
        if d["events"].as_u64().unwrap() > 0 {
            assert_eq!(active.iter().max().copied(), Some(peak), "{p} cuda:{dev}");
            assert_eq!(
                names(
                    &mine.iter().map(|e| (*e).clone()).collect::<Vec<_>>(),
                    "i",
                    "peak"
                ),
                d["peak_event_index"].is_u64() as usize
            );
        }
        if max_points > 0 {
            assert!(
                active.len() <= max_points + 3,
                "{p}: {} samples for a limit of {max_points}",
                active.len()
            );
        }
    }
}

#[test]
fn real_snapshots_export_valid_traces_that_keep_peaks_and_ooms() {
    for f in fixture_files() {
        check_snapshot(&f, 200_000);
        check_snapshot(&f, 30);
    }
}

#[test]
fn the_demo_exports_its_oom_and_phases() {
    let demo = demo_file();
    check_snapshot(&demo, 0);
    let trace = run_json(&["export", "--perfetto", demo.to_str().unwrap(), "-o", "-"]);
    let events = valid_trace(&trace);
    assert!(names(&events, "i", "OOM") >= 1);
    assert!(events
        .iter()
        .any(|e| e["ph"] == "C" && e["name"] == "reserved"));
    assert_eq!(
        trace["otherData"]["clock"],
        "microseconds since the first trace entry"
    );
}

#[test]
fn a_run_log_exports_steps_stages_and_its_oom() {
    let dir = tempdir("export-run");
    let log = dir.join("run.jsonl");
    let text = run_log_text(3, 1, Some(f64::NAN));
    std::fs::write(&log, text).unwrap();
    let out = dir.join("trace.json");
    let status = export(&log, &out, &[]);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let trace: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let events = valid_trace(&trace);
    assert_eq!(names(&events, "X", "step "), 3);
    assert_eq!(names(&events, "X", "backward"), 3);
    assert_eq!(names(&events, "X", "eval"), 1);
    assert_eq!(names(&events, "i", "OOM"), 1);
    assert!(
        events.iter().all(|e| e["pid"] == 3),
        "the rank is the process"
    );
    // Each stage lies inside its step.
    let slices = |n: &str| -> Vec<(f64, f64)> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["name"].as_str().unwrap().starts_with(n))
            .map(|e| {
                (
                    e["ts"].as_f64().unwrap(),
                    e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    for (stage, step) in slices("optimizer").iter().zip(slices("step ")) {
        assert!(
            stage.0 >= step.0 && stage.1 <= step.1 + 1e-6,
            "{stage:?} outside {step:?}"
        );
    }
}

#[test]
fn export_never_overwrites_and_reports_bad_input_in_one_line() {
    let dir = tempdir("export-bad");
    let out = dir.join("trace.json");
    std::fs::write(&out, "keep me").unwrap();
    let demo = demo_file();
    let r = export(&demo, &out, &[]);
    assert_refused(&r, &["already exists"]);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "keep me");
    let r = export(&demo, &out, &["--force"]);
    assert!(r.status.success());
    valid_trace(&serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap());

    let bad = dir.join("cut.pickle");
    let bytes = std::fs::read(&demo).unwrap();
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let target = dir.join("new.json");
    let r = export(&bad, &target, &[]);
    assert_refused(&r, &["cut.pickle", "truncated"]);
    assert!(!target.exists(), "nothing is written for bad input");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        2,
        "no temporary file is left"
    );
}

#[test]
fn analyze_writes_the_trace_and_the_page_that_export_and_report_write() {
    let demo = demo_file();
    let demo = demo.to_str().unwrap();
    // One seam: `analyze --format perfetto` is `export`, `--format html` is `report`.
    let via_analyze = oomkit(&["analyze", "--format", "perfetto", demo], None);
    let via_export = oomkit(&["export", "--perfetto", demo, "-o", "-"], None);
    assert!(via_analyze.status.success(), "{via_analyze:?}");
    assert_eq!(via_analyze.stdout, via_export.stdout);
    valid_trace(&serde_json::from_slice(&via_analyze.stdout).unwrap());

    let page = oomkit(&["analyze", "--format", "html", "--top", "20", demo], None);
    let report = oomkit(&["report", demo, "-o", "-"], None);
    assert!(page.status.success(), "{page:?}");
    assert!(page.stdout.starts_with(b"<!DOCTYPE html>"));
    assert_eq!(page.stdout, report.stdout);

    // A trace is one file's timeline.
    let two = oomkit(&["analyze", "--format", "perfetto", demo, demo], None);
    assert_refused(&two, &["--format perfetto", "one file", "oomkit export"]);
    // The other commands print text or JSON only.
    let gpus = oomkit(&["gpus", "--format", "html"], None);
    assert_eq!(gpus.status.code(), Some(2), "{gpus:?}");
}
