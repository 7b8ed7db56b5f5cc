//! Every command's main case and its error cases, each snapshotted whole:
//! exit code, standard output and standard error together (`whole`), so
//! that a changed message or exit code shows in review.

mod common;
use common::*;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// What differs from run to run in the commands' output: wall times.
fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.add_filter(r"\b\d+\.\ds\b", "[TIME]");
    s.add_filter(r"\(\d+(\.\d+)? (KiB|MiB)\)", "([SIZE])");
    s
}

/// Snapshots `args` run in `dir` with `env`, under the name `name`.
fn check(name: &str, args: &[&str], dir: &Path, env: &[(&str, &OsStr)]) {
    let text = whole(args, dir, env);
    settings().bind(|| insta::assert_snapshot!(name, text));
}

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
        .canonicalize()
        .expect("in the repository")
}

/// The environment of a GPU command: the fake backend's two H100s, and claims and plans in `dir`.
fn gpu_env(dir: &Path, gpus: &Path) -> Vec<(&'static str, std::ffi::OsString)> {
    vec![
        ("OOMKIT_FAKE_GPUS", gpus.as_os_str().to_os_string()),
        ("OOMKIT_CLAIMS_DIR", dir.join("claims").into_os_string()),
        ("OOMKIT_CACHE_DIR", dir.join("cache").into_os_string()),
    ]
}

fn as_env<'a>(v: &'a [(&'static str, std::ffi::OsString)]) -> Vec<(&'static str, &'a OsStr)> {
    v.iter().map(|(k, v)| (*k, v.as_os_str())).collect()
}

#[test]
fn analyze() {
    let dir = tempdir("cmd-analyze");
    std::fs::copy(demo_file(), dir.join("demo.pickle")).unwrap();
    std::fs::write(dir.join("notes.txt"), "hello").unwrap();
    check(
        "analyze_main",
        &["analyze", "--top", "1", "demo.pickle"],
        &dir,
        &[],
    );
    check(
        "analyze_missing_file",
        &["analyze", "nope.pickle"],
        &dir,
        &[],
    );
    check(
        "analyze_not_a_snapshot",
        &["analyze", "notes.txt"],
        &dir,
        &[],
    );
    check(
        "analyze_one_bad_among_good",
        &[
            "analyze",
            "--json",
            "--top",
            "1",
            "demo.pickle",
            "notes.txt",
        ],
        &dir,
        &[],
    );
    check(
        "analyze_perfetto_two_files",
        &[
            "analyze",
            "--format",
            "perfetto",
            "demo.pickle",
            "demo.pickle",
        ],
        &dir,
        &[],
    );
    check(
        "analyze_device_not_held",
        &["analyze", "--device", "3", "demo.pickle"],
        &dir,
        &[],
    );
}

#[test]
fn demo_report_export() {
    let dir = tempdir("cmd-files");
    std::fs::copy(demo_file(), dir.join("demo.pickle")).unwrap();
    check(
        "demo_save_existing",
        &["demo", "--save", "demo.pickle"],
        &dir,
        &[],
    );
    check(
        "report_main",
        &["report", "demo.pickle", "-o", "page.html"],
        &dir,
        &[],
    );
    check(
        "report_existing_without_force",
        &["report", "demo.pickle", "-o", "page.html"],
        &dir,
        &[],
    );
    check(
        "report_missing_input",
        &["report", "nope.pickle", "-o", "other.html"],
        &dir,
        &[],
    );
    assert!(
        !dir.join("other.html").exists(),
        "nothing written for bad input"
    );
    check(
        "export_main",
        &["export", "--perfetto", "demo.pickle", "-o", "trace.json"],
        &dir,
        &[],
    );
    check(
        "export_existing_without_force",
        &["export", "--perfetto", "demo.pickle", "-o", "trace.json"],
        &dir,
        &[],
    );
}

#[test]
fn diff() {
    let dir = tempdir("cmd-diff");
    std::fs::copy(demo_file(), dir.join("demo.pickle")).unwrap();
    check(
        "diff_main",
        &["diff", "demo.pickle", "demo.pickle"],
        &dir,
        &[],
    );
    check(
        "diff_missing_file",
        &["diff", "demo.pickle", "nope.pickle"],
        &dir,
        &[],
    );
}

#[test]
fn gpus() {
    let dir = tempdir("cmd-gpus");
    let env = gpu_env(&dir, &repo("examples/gpus/two_h100.json"));
    check("gpus_main", &["gpus"], &dir, &as_env(&env));
    std::fs::write(dir.join("none.json"), "[]").unwrap();
    let none = gpu_env(&dir, &dir.join("none.json"));
    check("gpus_none", &["gpus"], &dir, &as_env(&none));
    std::fs::write(dir.join("broken.json"), "{").unwrap();
    let broken = gpu_env(&dir, &dir.join("broken.json"));
    check("gpus_broken_fake_file", &["gpus"], &dir, &as_env(&broken));
}

#[test]
fn run() {
    let dir = tempdir("cmd-run");
    let env = gpu_env(&dir, &repo("examples/gpus/two_h100.json"));
    let script = dir.join("train.sh");
    std::fs::write(
        &script,
        "if [ \"$1\" -gt 4 ]; then echo \"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 77.44 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but unallocated.\" >&2; exit 1; fi\necho trained with $1\n",
    )
    .unwrap();
    check(
        "run_main",
        &[
            "run",
            "--batch-size",
            "16",
            "--effective-batch",
            "32",
            "--",
            "sh",
            "train.sh",
            "{batch_size}",
        ],
        &dir,
        &as_env(&env),
    );
    check(
        "run_placeholder_without_batch_size",
        &["run", "--", "sh", "train.sh", "{batch_size}"],
        &dir,
        &as_env(&env),
    );
    check(
        "run_command_not_found",
        &["run", "--", "no-such-command-here"],
        &dir,
        &as_env(&env),
    );
}

#[test]
fn find_batch() {
    let dir = tempdir("cmd-find-batch");
    let env = gpu_env(&dir, &repo("examples/gpus/two_h100.json"));
    let standin = repo("examples/find_batch_standin.sh");
    check(
        "find_batch_main",
        &[
            "find-batch",
            "--effective",
            "256",
            "--",
            "sh",
            standin.to_str().unwrap(),
            "{batch_size}",
        ],
        &dir,
        &as_env(&env),
    );
    check(
        "find_batch_nothing_measured",
        &["find-batch", "--", "true", "{batch_size}"],
        &dir,
        &as_env(&env),
    );
    check(
        "find_batch_bad_margin",
        &["find-batch", "--margin", "2", "--", "true", "{batch_size}"],
        &dir,
        &as_env(&env),
    );
}

#[test]
fn explain() {
    let dir = tempdir("cmd-explain");
    check(
        "explain_main",
        &["explain", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the allocated memory 71.44 GiB is allocated by PyTorch, and 6.08 GiB is reserved by PyTorch but unallocated."],
        &dir,
        &[],
    );
    check(
        "explain_no_oom",
        &["explain", "step 10 loss 2.1"],
        &dir,
        &[],
    );
}

#[test]
fn estimate() {
    let dir = tempdir("cmd-estimate");
    check(
        "estimate_main",
        &[
            "estimate", "--params", "7B", "--batch", "4", "--seq", "512", "--gpu", "80GiB",
        ],
        &dir,
        &[],
    );
    check(
        "estimate_missing_config",
        &["estimate", "--config", "nope.json"],
        &dir,
        &[],
    );
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "gpt2", "n_embd": 64}"#,
    )
    .unwrap();
    check(
        "estimate_config_without_layers",
        &["estimate", "--config", "config.json"],
        &dir,
        &[],
    );
}

#[test]
fn whatif() {
    let dir = tempdir("cmd-whatif");
    std::fs::copy(
        repo("crates/oomkit-cli/tests/real/tinyllama_int8_lora_notebook_ftcourse.pickle"),
        dir.join("tinyllama.pickle"),
    )
    .unwrap();
    std::fs::copy(demo_file(), dir.join("demo.pickle")).unwrap();
    std::fs::copy(repo("examples/calibrate/b4.jsonl"), dir.join("run.jsonl")).unwrap();
    // pickle.dumps({"segments": [], "device_traces": []}, protocol=4)
    std::fs::write(
        dir.join("no_trace.pickle"),
        b"\x80\x04\x95$\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94u.",
    )
    .unwrap();
    check(
        "whatif_main",
        &[
            "whatif",
            "tinyllama.pickle",
            "--alloc-conf",
            "expandable_segments:True",
            "--capacity",
            "T4",
            "--batch-scale",
            "0.5",
        ],
        &dir,
        &[],
    );
    check("whatif_demo", &["whatif", "demo.pickle"], &dir, &[]);
    check("whatif_run_log", &["whatif", "run.jsonl"], &dir, &[]);
    check("whatif_no_trace", &["whatif", "no_trace.pickle"], &dir, &[]);
    check("whatif_missing_file", &["whatif", "nope.pickle"], &dir, &[]);
    check(
        "whatif_bad_settings",
        &[
            "whatif",
            "tinyllama.pickle",
            "--alloc-conf",
            "max_split_size_mb:8",
        ],
        &dir,
        &[],
    );
    check(
        "whatif_bad_capacity",
        &["whatif", "tinyllama.pickle", "--capacity", "B300"],
        &dir,
        &[],
    );
    check(
        "whatif_bad_scale",
        &["whatif", "tinyllama.pickle", "--batch-scale", "0"],
        &dir,
        &[],
    );
}

#[test]
fn preflight() {
    let dir = tempdir("cmd-preflight");
    // A stand-in that answers as the Python side does (the real script runs
    // in python/tests/test_preflight.py, where PyTorch is installed); `-S`
    // keeps this Python from loading the hook, which needs oomkit installed.
    std::fs::copy(
        repo("crates/oomkit-cli/tests/preflight_standin.py"),
        dir.join("train.py"),
    )
    .unwrap();
    std::fs::write(dir.join("taken.pickle"), "keep").unwrap();
    let script = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut v = vec!["--", "python3", "-S", "train.py"];
        v.extend_from_slice(extra);
        v
    };
    let with = |head: &[&'static str], extra: &[&'static str]| -> Vec<&'static str> {
        let mut v = vec!["preflight"];
        v.extend_from_slice(head);
        v.extend(script(extra));
        v
    };
    let search = with(
        &[
            "--capacity",
            "24GiB",
            "--micro-batch",
            "8",
            "--max-micro-batch",
            "64",
        ],
        &["{batch}"],
    );
    check("preflight_main", &search, &dir, &[]);
    check(
        "preflight_json",
        &with(&["--json", "--capacity", "24GiB"], &["8"]),
        &dir,
        &[],
    );
    check(
        "preflight_does_not_fit",
        &with(&["--capacity", "24GiB"], &["40"]),
        &dir,
        &[],
    );
    check("preflight_no_answer", &with(&[], &["0"]), &dir, &[]);
    check(
        "preflight_no_batch_placeholder",
        &with(&["--max-micro-batch", "8"], &[]),
        &dir,
        &[],
    );
    // Any placeholder, searched from its smallest value up by the same search.
    check(
        "preflight_knob",
        &with(
            &["--capacity", "24GiB", "--search", "seq=1..64"],
            &["{seq}"],
        ),
        &dir,
        &[],
    );
    check(
        "preflight_knob_no_placeholder",
        &with(&["--search", "seq=1..8"], &["8"]),
        &dir,
        &[],
    );
    check(
        "preflight_knob_bad_range",
        &with(&["--search", "seq=64..8"], &["{seq}"]),
        &dir,
        &[],
    );
    check(
        "preflight_existing_snapshot",
        &with(&["--snapshot", "taken.pickle"], &[]),
        &dir,
        &[],
    );
    check(
        "preflight_not_found",
        &["preflight", "--", "no-such-command-here", "train.py"],
        &dir,
        &[],
    );
    assert_eq!(std::fs::read(dir.join("taken.pickle")).unwrap(), b"keep");
}

#[test]
fn explain_a_snapshot() {
    let dir = tempdir("cmd-explain-snapshot");
    std::fs::copy(demo_file(), dir.join("demo.pickle")).unwrap();
    std::fs::copy(
        repo("crates/oomkit-cli/tests/real/cs336_lm_train_bcrafton.pickle"),
        dir.join("healthy.pickle"),
    )
    .unwrap();
    check("explain_snapshot", &["explain", "demo.pickle"], &dir, &[]);
    check(
        "explain_snapshot_without_oom",
        &["explain", "healthy.pickle"],
        &dir,
        &[],
    );
}
