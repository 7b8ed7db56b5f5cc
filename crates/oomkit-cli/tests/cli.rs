//! Whole-command tests: output snapshots (insta) and bad input.

mod common;
use common::*;
use std::path::Path;
use std::process::Command;

fn stdout(args: &[&str], cwd: Option<&Path>) -> String {
    let out = oomkit(args, cwd);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn demo_text() {
    insta::assert_snapshot!(stdout(&["demo"], None));
}

#[test]
fn demo_json() {
    insta::assert_snapshot!(stdout(&["demo", "--json", "--top", "3"], None));
}

#[test]
fn real_snapshots_text() {
    let Some(dir) = fixtures() else { return };
    for name in [
        "lm_medium_ctx128_training.pickle",
        "small_mem_snapshot.pickle",
        "llama_select_4gpu.pickle",
        "legacy_segment_list.pkl",
        "gpt2_segments_only.pickle",
        "snapviewer_sample.pickle",
    ] {
        insta::assert_snapshot!(name, stdout(&["analyze", name], Some(&dir)));
    }
}

#[test]
fn real_snapshot_json() {
    let Some(dir) = fixtures() else { return };
    insta::assert_snapshot!(stdout(
        &[
            "analyze",
            "--json",
            "--top",
            "2",
            "lm_ctx128_full_train_step.pickle"
        ],
        Some(&dir)
    ));
}

#[test]
fn several_files_give_a_json_array_and_device_filter_works() {
    let demo = demo_file();
    let d = demo.to_str().unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&["analyze", "--json", d, d], None)).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&["analyze", "--json", "--device", "0", d], None)).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 1);
    // A device the file does not hold is a usage error that names the ones it does.
    let out = oomkit(&["analyze", "--device", "3", d], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--device 3: the snapshot holds device 0 only"),
        "{err}"
    );
}

/// Runs oomkit on a bad file and checks the contract: exit 2, one line on
/// stderr naming the file and the problem, nothing on stdout, file intact.
fn bad_input(dir: &Path, name: &str, bytes: &[u8], problem: &str) {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let out = oomkit(&["analyze", path.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{name}: {err}");
    assert_eq!(err.lines().count(), 1, "{name}: {err}");
    assert!(err.contains(name), "{name}: {err}");
    assert!(
        err.contains(problem),
        "{name}: expected '{problem}' in {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty());
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "the input must not change"
    );
}

#[test]
fn bad_input_is_one_clear_line_and_exit_2() {
    let dir = tempdir("bad");
    let demo = std::fs::read(demo_file()).unwrap();
    bad_input(
        &dir,
        "truncated.pickle",
        &demo[..demo.len() / 2],
        "truncated at byte",
    );
    bad_input(
        &dir,
        "empty.pickle",
        b"",
        "it starts with nothing (it is empty)",
    );
    bad_input(
        &dir,
        "garbage.pickle",
        b"\x7fELF\x02\x01\x01garbage",
        "not a PyTorch memory snapshot or an oomkit run log: it starts with 7f 45 4c 46",
    );
    // A text file: what it starts with, and how snapshots are made.
    bad_input(
        &dir,
        "notes.txt.pickle",
        b"# not a pickle\n",
        "it starts with \"# not a pickle\\n\"; record a snapshot with torch.cuda.memory._dump_snapshot",
    );
    // pickle.dumps({'a': [1, 2]}, protocol=4)
    bad_input(
        &dir,
        "dict.pickle",
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94]\x94(K\x01K\x02es.",
        "not a PyTorch memory snapshot",
    );
    bad_input(
        &dir,
        "str.pickle",
        b"\x80\x04\x8c\x02hi\x94.",
        "not a PyTorch memory snapshot",
    );
    let mut flipped = demo.clone();
    let mid = flipped.len() / 3;
    flipped[mid..mid + 64].fill(0xff);
    bad_input(&dir, "damaged.pickle", &flipped, "at byte");
}

#[test]
fn a_pickle_that_runs_a_shell_command_is_refused_and_runs_nothing() {
    let dir = tempdir("evil");
    let marker = dir.join("pwned");
    let evil = dir.join("evil.pickle");
    // CPython writes the exploit; loading it with pickle.load would run `touch`.
    let script = format!(
        "import os, pickle\nclass E:\n    def __reduce__(self):\n        return (os.system, ('touch {}',))\nopen({:?}, 'wb').write(pickle.dumps({{'segments': [], 'x': E()}}, protocol=4))",
        marker.display(),
        evil.display().to_string()
    );
    let ok = Command::new(python())
        .arg("-c")
        .arg(&script)
        .status()
        .unwrap();
    assert!(ok.success());
    let bytes = std::fs::read(&evil).unwrap();
    let out = oomkit(&["analyze", evil.to_str().unwrap()], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("evil.pickle") && err.contains("refused at byte"),
        "{err}"
    );
    assert!(
        err.contains("STACK_GLOBAL") || err.contains("GLOBAL"),
        "{err}"
    );
    assert!(!marker.exists(), "the shell command ran");
    assert_eq!(std::fs::read(&evil).unwrap(), bytes);
    // The same file does run the command under pickle.load, so the test is real.
    let load = format!(
        "import pickle; pickle.load(open({:?}, 'rb'))",
        evil.display().to_string()
    );
    Command::new(python()).arg("-c").arg(load).status().unwrap();
    assert!(
        marker.exists(),
        "control: pickle.load should have run the command"
    );
}

#[test]
fn missing_files_directories_and_usage_errors_exit_2() {
    let out = oomkit(&["analyze", "/nonexistent/snap.pickle"], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    // The path once, then the problem.
    assert_eq!(
        err.trim(),
        "oomkit: /nonexistent/snap.pickle: no such file",
        "{err}"
    );
    let dir = tempdir("dir");
    let out = oomkit(&["analyze", dir.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is a directory"));
    assert_eq!(oomkit(&["analyze"], None).status.code(), Some(2));
    assert_eq!(oomkit(&["frobnicate"], None).status.code(), Some(2));
    assert_eq!(
        oomkit(&["analyze", "--top", "x", "f"], None).status.code(),
        Some(2)
    );
}

#[test]
fn good_files_are_still_reported_beside_a_bad_one() {
    let dir = tempdir("mixed");
    let bad = dir.join("bad.pickle");
    std::fs::write(&bad, b"").unwrap();
    let demo = demo_file();
    let out = oomkit(
        &[
            "analyze",
            "--json",
            demo.to_str().unwrap(),
            bad.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v[0]["devices"].is_array());
    assert!(v[1]["error"].as_str().unwrap().contains("it is empty"));
}

#[test]
fn demo_save_never_overwrites() {
    let dir = tempdir("save");
    let path = dir.join("demo.pickle");
    let out = oomkit(&["demo", "--save", path.to_str().unwrap()], None);
    assert!(out.status.success());
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(demo_file()).unwrap()
    );
    std::fs::write(&path, b"mine").unwrap();
    let out = oomkit(&["demo", "--save", path.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("already exists (pass --force to replace it)"));
    assert_eq!(std::fs::read(&path).unwrap(), b"mine");
    // One rule for every file oomkit writes: --force replaces it.
    let out = oomkit(&["demo", "--save", path.to_str().unwrap(), "--force"], None);
    assert!(out.status.success());
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(demo_file()).unwrap()
    );
}

#[test]
fn a_trace_with_many_ooms_details_the_first_ones_and_counts_the_rest() {
    // A loop that retries after every OOM records one per step; each OOM's
    // holders cost a pass over the live set, so only the first are detailed.
    let dir = tempdir("many-ooms");
    let file = dir.join("many_ooms.pickle");
    let script = r#"
import pickle, sys
ev = []
for i in range(40):
    ev.append({'action': 'alloc', 'addr': (1 << 30) + i * 512, 'size': 512, 'frames': []})
    ev.append({'action': 'oom', 'addr': 1 << 20, 'size': 1 << 30, 'frames': []})
ev += [{'action': 'free_completed', 'addr': (1 << 30) + i * 512, 'size': 512, 'frames': []} for i in range(40)]
pickle.dump({'segments': [], 'device_traces': [ev]}, open(sys.argv[1], 'wb'), protocol=4)
"#;
    let status = Command::new(python())
        .args(["-c", script])
        .arg(&file)
        .status()
        .expect("python3");
    assert!(status.success());
    let path = file.to_str().unwrap();
    let j = run_json(&["analyze", "--json", path]);
    let ooms = j["devices"][0]["ooms"].as_array().unwrap();
    assert_eq!(ooms.len(), 40);
    let detailed: Vec<bool> = ooms
        .iter()
        .map(|o| !o["top_holders"].as_array().unwrap().is_empty())
        .collect();
    assert_eq!(detailed, [[true; 32].as_slice(), &[false; 8]].concat());
    assert_eq!(ooms[39]["live_bytes"], 40 * 512);
    let oom_findings = j["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "oom_capacity")
        .count();
    assert_eq!(oom_findings, 32);
    assert!(j["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w["kind"] == "many_ooms"));
    let text = stdout(&["analyze", path], None);
    assert_eq!(text.matches("OOM at event").count(), 10);
    assert!(text.contains("and 30 more OOM entries"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn format_json_is_json_and_json_is_its_short_form() {
    let long = stdout(&["demo", "--format", "json"], None);
    assert_eq!(long, stdout(&["demo", "--json"], None));
    assert!(serde_json::from_str::<serde_json::Value>(&long).is_ok());
    assert_eq!(
        stdout(&["demo", "--format", "text"], None),
        stdout(&["demo"], None)
    );
    let bad = oomkit(&["demo", "--format", "yaml"], None);
    assert_eq!(bad.status.code(), Some(2));
}
