//! The first screen answers the question: every report of a snapshot, a
//! run log or several files starts with what failed, where, why and what to
//! do, and the failing device or rank comes first.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;

fn analyze(args: &[&str], cwd: &Path) -> String {
    let out = oomkit_in(&[&["analyze"], args].concat(), cwd);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn oomkit_in(args: &[&str], cwd: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oomkit"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

/// The first `n` lines of a report.
fn head(text: &str, n: usize) -> String {
    text.lines().take(n).collect::<Vec<_>>().join("\n")
}

/// A DataParallel-like snapshot: cuda:0 healthy, cuda:1 out of memory in update_nodes.
fn two_device_snapshot(dir: &Path) {
    let script = r#"
import pickle, sys
def trace(n, oom):
    ev = [{'action': 'alloc', 'addr': (1 << 30) + i * (64 << 20), 'size': 64 << 20, 'time_us': 1000 + i,
           'frames': [{'filename': 'models.py', 'line': 120, 'name': 'forward'}]} for i in range(n)]
    if oom:
        ev.append({'action': 'oom', 'addr': 32 << 20, 'size': 1 << 30, 'time_us': 2000,
                   'frames': [{'filename': 'models.py', 'line': 181, 'name': 'update_nodes'}]})
    return ev
pickle.dump({'segments': [], 'device_traces': [trace(4, False), trace(12, True)]}, open(sys.argv[1], 'wb'), protocol=4)
"#;
    let status = Command::new(python())
        .args(["-c", script])
        .arg(dir.join("dp.pickle"))
        .status()
        .expect("python3");
    assert!(status.success());
}

fn run_log(dir: &Path, name: &str, rank: u32, oom: bool) {
    let mut s = format!(
        "{{\"type\":\"start\",\"version\":1,\"rank\":{rank},\"world_size\":2,\"device\":\"cuda:{rank}\",\"capacity_bytes\":85899345920,\"time\":100}}\n"
    );
    for step in 0..3u64 {
        s.push_str(&format!(
            "{{\"type\":\"stage\",\"name\":\"forward\",\"step\":{step},\"start_bytes\":1000,\"end_bytes\":2000,\"peak_bytes\":{}}}\n",
            (40u64 << 30) + step
        ));
        s.push_str(&format!(
            "{{\"type\":\"step\",\"step\":{step},\"start_bytes\":1000,\"end_bytes\":1000,\"peak_bytes\":{}}}\n",
            (40u64 << 30) + step
        ));
    }
    if oom {
        s.push_str("{\"type\":\"oom\",\"time\":110.5,\"step\":3,\"stage\":\"backward\",\"requested_bytes\":4294967296,\"message\":\"CUDA out of memory. Tried to allocate 4.00 GiB\",\"memory\":{\"allocated_bytes\":77309411328,\"reserved_bytes\":79456894976,\"capacity_bytes\":85899345920}}\n");
    } else {
        s.push_str("{\"type\":\"end\",\"steps\":3}\n");
    }
    std::fs::write(dir.join(name), s).unwrap();
}

#[test]
fn a_multi_device_snapshot_leads_with_the_failing_device() {
    let dir = tempdir("first-screen-dp");
    two_device_snapshot(&dir);
    let text = analyze(&["dp.pickle"], &dir);
    insta::assert_snapshot!("multi_device_oom", head(&text, 5));
    // The failing device's detail comes before the healthy one's.
    let one = text.find("active on cuda:1").unwrap();
    let zero = text.find("active on cuda:0").unwrap();
    assert!(one < zero, "{text}");
    let v = &serde_json::from_str::<serde_json::Value>(&analyze(&["--json", "dp.pickle"], &dir))
        .unwrap()["verdict"];
    assert_eq!(v["failed"], true);
    assert_eq!(v["place"]["device"], "cuda:1");
    assert_eq!(v["site"], "models.py:181 update_nodes");
    assert_eq!(v["cause"], "capacity");
}

#[test]
fn a_run_log_with_an_oom_leads_with_its_step_stage_and_fix() {
    let dir = tempdir("first-screen-run");
    run_log(&dir, "rank1.jsonl", 1, true);
    insta::assert_snapshot!("run_log_oom", head(&analyze(&["rank1.jsonl"], &dir), 3));
}

#[test]
fn several_ranks_lead_with_the_one_that_failed() {
    let dir = tempdir("first-screen-ranks");
    run_log(&dir, "rank0.jsonl", 0, false);
    run_log(&dir, "rank1.jsonl", 1, true);
    let text = analyze(&["rank0.jsonl", "rank1.jsonl"], &dir);
    insta::assert_snapshot!("ranks_one_failing", head(&text, 5));
    // rank 1's own report comes before rank 0's.
    assert!(text.find("== rank1.jsonl").unwrap() < text.find("== rank0.jsonl").unwrap());
}

#[test]
fn a_healthy_file_leads_with_its_peak() {
    let dir = tempdir("first-screen-healthy");
    run_log(&dir, "rank0.jsonl", 0, false);
    insta::assert_snapshot!("healthy_run_log", head(&analyze(&["rank0.jsonl"], &dir), 3));
}

#[test]
fn the_documented_demo_verdict_is_what_demo_prints() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let doc = std::fs::read_to_string(format!("{root}/docs/commands.md")).unwrap();
    let shown: Vec<&str> = doc
        .lines()
        .skip_while(|l| *l != "$ oomkit demo")
        .skip(1)
        .take_while(|l| *l != "...")
        .collect();
    assert_eq!(shown.len(), 3, "docs/commands.md lacks the demo's verdict");
    let out = oomkit_in(&["demo"], Path::new(root));
    let printed = String::from_utf8(out.stdout).unwrap();
    assert_eq!(head(&printed, 3), shown.join("\n"));
}
