//! Helpers shared by the CLI tests.
#![allow(dead_code, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The shared fixtures folder, or `None` (with a note on stderr) where it is absent.
pub(crate) fn fixtures() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/snapshots");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("skipping: real snapshots not found at {} (they live beside the repository, in shared/)", dir.display());
        None
    }
}

/// Every snapshot file among the fixtures, sorted.
pub(crate) fn fixture_files() -> Vec<PathBuf> {
    let Some(dir) = fixtures() else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("pickle" | "pkl")
            )
        })
        .collect();
    v.sort();
    v
}

/// The real snapshots committed with the tests (`tests/real/SOURCES.md` says where each came from).
pub(crate) fn own_fixture_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/real");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    v.sort();
    v
}

/// The demo snapshot bundled in the binary.
pub(crate) fn demo_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/demo_snapshot.pickle")
}

/// Runs the oomkit binary.
pub(crate) fn oomkit(args: &[&str], cwd: Option<&std::path::Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oomkit"));
    c.args(args).env("NO_COLOR", "1");
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    c.output().expect("run oomkit")
}

/// Runs oomkit in `cwd` with `env` added and returns its whole result as
/// one text for a snapshot: the exit code, then standard output, then
/// standard error, so that a changed message or exit code shows in review
/// (as uv's `uv_snapshot!` does). The scratch folder reads `[DIR]` and the
/// repository `[REPO]`.
pub(crate) fn whole(
    args: &[&str],
    cwd: &std::path::Path,
    env: &[(&str, &std::ffi::OsStr)],
) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oomkit"));
    c.args(args).env("NO_COLOR", "1").current_dir(cwd);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run oomkit");
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let repo = repo.canonicalize().unwrap_or(repo);
    let clean = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .replace(&cwd.display().to_string(), "[DIR]")
            .replace(&repo.display().to_string(), "[REPO]")
    };
    format!(
        "exit code: {}\n----- stdout -----\n{}\n----- stderr -----\n{}",
        out.status
            .code()
            .map_or("killed by a signal".to_string(), |c| c.to_string()),
        clean(&out.stdout),
        clean(&out.stderr)
    )
}

/// Runs oomkit, which must succeed, and parses what it printed as JSON.
pub(crate) fn run_json(args: &[&str]) -> serde_json::Value {
    success_json(&oomkit(args, None), &format!("{args:?}"))
}

/// Asserts that a run of oomkit (`what`) succeeded and parses what it printed as JSON.
pub(crate) fn success_json(out: &Output, what: &str) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts that oomkit refused its input: exit code 2 and one line on
/// stderr that holds every one of `needles`.
pub(crate) fn assert_refused(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    for n in needles {
        assert!(err.contains(n), "{n:?} not in {err}");
    }
}

/// The Python interpreter used for independent checks.
pub(crate) fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Runs a Python script with `args`, which must succeed, and returns what it printed.
pub(crate) fn python_script(script: &str, args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let out = Command::new(python())
        .arg(script)
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// An empty scratch folder for one test, unique to this process, removed with
/// everything in it when the test drops it (a failing test's unwinding too), so
/// that the suite leaves nothing in the system's temporary folder.
pub(crate) struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Makes an empty scratch folder for one test, unique to this process.
pub(crate) fn tempdir(tag: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("oomkit-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// A run log as the tracker writes it: three steps of forward, backward
/// and optimizer, an eval phase, and an OOM in step 3 when `oom_time` is
/// given (seconds since the epoch; NaN writes no time). Peaks scale with `scale`.
pub(crate) fn run_log_text(rank: u32, scale: u64, oom_time: Option<f64>) -> String {
    let mut text = format!(
        r#"{{"type":"start","version":1,"rank":{rank},"device":"cuda:0","capacity_bytes":1073741824}}"#
    );
    text.push('\n');
    for step in 0..3u64 {
        for (name, peak) in [("forward", 500u64), ("backward", 700), ("optimizer", 600)] {
            let peak = peak * scale;
            text.push_str(&format!(
                r#"{{"type":"stage","step":{step},"name":"{name}","start_bytes":100,"end_bytes":200,"peak_bytes":{peak},"seconds":0.01}}"#
            ));
            text.push('\n');
        }
        let peak = 700 * scale;
        text.push_str(&format!(
            r#"{{"type":"step","step":{step},"start_bytes":100,"end_bytes":200,"peak_bytes":{peak},"reserved_bytes":900,"seconds":0.05}}"#
        ));
        text.push('\n');
    }
    let peak = 800 * scale;
    text.push_str(&format!(
        r#"{{"type":"phase","step":2,"name":"eval","start_bytes":200,"end_bytes":250,"peak_bytes":{peak},"seconds":0.02}}"#
    ));
    text.push('\n');
    if let Some(t) = oom_time {
        let time = if t.is_nan() {
            String::new()
        } else {
            format!(r#""time":{t},"#)
        };
        text.push_str(&format!(
            r#"{{"type":"oom",{time}"step":3,"stage":"forward","requested_bytes":1024,"message":"CUDA out of memory","memory":{{}}}}"#
        ));
        text.push('\n');
    }
    text
}
