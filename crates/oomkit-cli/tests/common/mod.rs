//! Helpers shared by the CLI tests.
#![allow(dead_code, clippy::print_stderr)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The shared fixtures folder, or `None` (with a note on stderr) where it is absent.
pub fn fixtures() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/snapshots");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("skipping: real snapshots not found at {} (they live beside the repository, in shared/)", dir.display());
        None
    }
}

/// Every snapshot file among the fixtures, sorted.
pub fn fixture_files() -> Vec<PathBuf> {
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

/// The demo snapshot bundled in the binary.
pub fn demo_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/demo_snapshot.pickle")
}

/// Runs the oomkit binary.
pub fn oomkit(args: &[&str], cwd: Option<&std::path::Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oomkit"));
    c.args(args).env("NO_COLOR", "1");
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    c.output().expect("run oomkit")
}

/// The Python interpreter used for independent checks.
pub fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Makes an empty scratch folder for one test, unique to this process.
pub fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oomkit-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
