//! Every real snapshot parses, and oomkit's figures equal those CPython's
//! pickle gives for the same file (tests/independent_figures.py).

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

fn independent(path: &Path) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/independent_figures.py");
    serde_json::from_slice(&python_script(script, &[path.as_os_str()])).unwrap()
}

fn check(path: &Path) {
    let out = oomkit(&["analyze", "--json", path.to_str().unwrap()], None);
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: Value = serde_json::from_slice(&out.stdout).unwrap();
    let theirs = independent(path);
    let devices = ours["devices"].as_array().unwrap();
    assert_eq!(
        devices.len(),
        theirs.as_object().unwrap().len(),
        "{}: device count",
        path.display()
    );
    for d in devices {
        let want = &theirs[d["device"].as_i64().unwrap().to_string()];
        for field in [
            "events",
            "reserved_bytes",
            "active_bytes",
            "allocated_bytes",
            "peak_active_bytes",
            "peak_event_index",
            "peak_reserved_bytes",
        ] {
            assert_eq!(
                d[field],
                want[field],
                "{}: cuda:{} {field}",
                path.display(),
                d["device"]
            );
        }
        let ooms = d["ooms"].as_array().unwrap();
        let want_ooms = want["ooms"].as_array().unwrap();
        assert_eq!(ooms.len(), want_ooms.len(), "{}: OOM count", path.display());
        for (o, w) in ooms.iter().zip(want_ooms) {
            for field in ["event_index", "requested_bytes", "free_bytes", "live_bytes"] {
                assert_eq!(o[field], w[field], "{}: oom {field}", path.display());
            }
        }
        // The live set at the peak never exceeds the peak itself.
        let sites: u64 = d["top_sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["bytes"].as_u64().unwrap())
            .sum();
        assert!(sites <= d["peak_active_bytes"].as_u64().unwrap());
    }
    check_whatif(path, &theirs);
}

/// Real files that are not one allocator's record, where the model cannot
/// agree (crates/oomkit-allocator/tests/real.rs says why); the files the
/// tests generate (the demo, the pager's large file) are not runs either.
const NOT_A_RUN: [&str; 1] = ["snapviewer_sample.pickle"];

/// The first place two lists of (entry, size) differ, for a short message.
fn first_difference(a: &[(u64, u64)], b: &[(u64, u64)]) -> Option<String> {
    (0..a.len().max(b.len()))
        .find(|&i| a.get(i) != b.get(i))
        .map(|i| {
            format!(
                "{} against {} segments; at {i}: {:?} against {:?}",
                a.len(),
                b.len(),
                a.get(i),
                b.get(i)
            )
        })
}

/// `oomkit whatif` lists the segments CPython finds in the trace, and its
/// model of the allocator makes the same ones, at the same entries.
fn check_whatif(path: &Path, theirs: &Value) {
    let out = oomkit(&["whatif", "--json", path.to_str().unwrap()], None);
    let has_trace = theirs
        .as_object()
        .unwrap()
        .values()
        .any(|d| d["events"].as_u64() > Some(0));
    if !has_trace {
        assert_eq!(
            out.status.code(),
            Some(2),
            "{}: no trace to replay",
            path.display()
        );
        return;
    }
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: Value = serde_json::from_slice(&out.stdout).unwrap();
    let name = path.file_name().unwrap().to_string_lossy();
    for d in ours["devices"].as_array().unwrap() {
        let want = &theirs[d["device"].as_i64().unwrap().to_string()]["recorded_segments"];
        let pairs = |v: &Value| -> Vec<(u64, u64)> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| match s {
                    Value::Array(a) => (a[0].as_u64().unwrap(), a[1].as_u64().unwrap()),
                    o => (o["event"].as_u64().unwrap(), o["size"].as_u64().unwrap()),
                })
                .collect()
        };
        let want = pairs(want);
        if let Some(diff) = first_difference(&pairs(&d["recorded_segments"]), &want) {
            panic!("{}: recorded segments: {diff}", path.display());
        }
        let real = fixture_files()
            .iter()
            .chain(&own_fixture_files())
            .any(|f| f == path);
        if real && !NOT_A_RUN.contains(&name.as_ref()) {
            if let Some(diff) = first_difference(&pairs(&d["scenarios"][0]["segments"]), &want) {
                panic!(
                    "{}: the model's segments for the recorded run: {diff}",
                    path.display()
                );
            }
            assert_eq!(
                d["scenarios"][0]["peak_reserved_bytes"],
                theirs[d["device"].as_i64().unwrap().to_string()]["peak_reserved_bytes"]
            );
        }
    }
}

#[test]
fn every_real_snapshot_matches_cpython() {
    let files = fixture_files();
    for f in &files {
        check(f);
    }
    if !files.is_empty() {
        assert!(
            files.len() >= 12,
            "expected the 12 shared fixtures, found {}",
            files.len()
        );
    }
}

#[test]
fn our_own_real_snapshots_match_cpython() {
    let files = own_fixture_files();
    assert!(
        files.len() >= 2,
        "tests/real holds {} snapshots",
        files.len()
    );
    for f in &files {
        check(f);
    }
}

#[test]
fn the_demo_snapshot_matches_cpython() {
    check(&demo_file());
}

#[test]
fn the_demo_shows_its_planted_bug_and_oom() {
    let out = oomkit(&["demo", "--json"], None);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let kinds: Vec<&str> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.first(), Some(&"oom_capacity"), "{kinds:?}");
    assert!(kinds.contains(&"phase_retains_memory"), "{kinds:?}");
    let oom = &v["devices"][0]["ooms"][0];
    assert_eq!(oom["cause"], "capacity");
    assert_eq!(oom["site"]["filename"], "/home/user/gpt/model.py");
    assert_eq!(oom["site"]["line"], 112);
}

/// Snapshots with traces must have their peaks attributed to real sites.
#[test]
fn peaks_are_attributed_to_user_lines() {
    let Some(dir) = fixtures() else { return };
    let out = oomkit(
        &["analyze", "--json", "small_mem_snapshot.pickle"],
        Some(&dir),
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let sites = v["devices"][0]["top_sites"].as_array().unwrap();
    let labels: Vec<&str> = sites.iter().map(|s| s["label"].as_str().unwrap()).collect();
    assert!(
        labels.contains(&"trace_peak_memory.py:7 custom_softmax"),
        "{labels:?}"
    );
    assert!(labels.contains(&"<backward: DivBackward0>"), "{labels:?}");
    let softmax = sites
        .iter()
        .find(|s| s["label"] == "trace_peak_memory.py:7 custom_softmax")
        .unwrap();
    assert_eq!(softmax["bytes"], 512 << 20);
    assert!(
        softmax["stack"].as_array().unwrap().len() > 10,
        "the full stack is kept"
    );
}

/// The streaming reader (trace entries claimed while parsing) and the
/// generic reader (every dict kept in the arena) must agree on every file.
#[test]
fn claimed_and_generic_readings_agree() {
    let mut files = fixture_files();
    files.push(demo_file());
    for path in files {
        readings_agree(&path);
    }
}

/// A file past the size at which the parser's pager runs a helper thread
/// (mapping pages ahead, releasing them behind, faulting tables in) gives
/// CPython's figures and the generic reader's events all the same.
#[test]
fn a_file_large_enough_for_the_pager_matches_cpython() {
    let dir = tempdir("pager");
    let big = dir.join("big.pickle");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/make_big_snapshot.py"
    );
    let demo = demo_file();
    let args: [&std::ffi::OsStr; 5] = [
        demo.as_ref(),
        big.as_ref(),
        "--events".as_ref(),
        "700000".as_ref(),
        "--fresh-frames".as_ref(),
    ];
    python_script(script, &args);
    let size = std::fs::metadata(&big).unwrap().len() as usize;
    assert!(
        size > oomkit_pickle::PAGER_MIN,
        "{size} bytes is too small to start the pager's helper"
    );
    check(&big);
    readings_agree(&big);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Checks that the streaming and the generic readings of `path` give the
/// same analysis and the same events.
fn readings_agree(path: &Path) {
    use oomkit_compare::FileAnalysis;
    use oomkit_report::json;
    use oomkit_snapshot::{Options, Snapshot};
    let bytes = std::fs::read(path).unwrap();
    let streamed = Snapshot::load(path, &mut |_, _| {}).unwrap();
    let doc = oomkit_pickle::Document::parse(&bytes).unwrap();
    let generic = Snapshot::from_document(&doc).unwrap();
    let opts = Options::default();
    let a = json::snapshot(&FileAnalysis::new("f".into(), 0, &streamed, &opts));
    let b = json::snapshot(&FileAnalysis::new("f".into(), 0, &generic, &opts));
    assert_eq!(a, b, "{}", path.display());
    let events = |s: &Snapshot| -> Vec<String> {
        s.traces
            .iter()
            .flat_map(|t| &t.events)
            .map(|e| {
                let frames: Vec<_> = s
                    .stacks
                    .stack(e.stack)
                    .iter()
                    .map(|&f| s.stacks.frame(f))
                    .collect();
                format!(
                    "{:?} {} {} {:?} {frames:?}",
                    e.action,
                    e.addr,
                    e.size,
                    e.time_us()
                )
            })
            .collect()
    };
    assert_eq!(events(&streamed), events(&generic), "{}", path.display());
}
