//! `oomkit explain` and `oomkit estimate` as a user runs them.

mod common;

use common::success_json;
use serde_json::Value;
use std::io::Write;
use std::process::{Command, Output, Stdio};

fn oomkit(args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oomkit"));
    c.args(args)
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env("OOMKIT_FAKE_GPUS", "/nonexistent/oomkit-no-gpus.json")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut pipe = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        pipe.write_all(s.as_bytes()).unwrap();
    }
    drop(pipe);
    child.wait_with_output().unwrap()
}

// https://github.com/wenet-e2e/wekws/issues/152
const LOG: &str = "Traceback (most recent call last):
  File \"wekws/bin/train.py\", line 249, in <module>
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.24 GiB. GPU 0 has a total capacity of 9.78 GiB of which 913.62 MiB is free. Including non-PyTorch memory, this process has 8.88 GiB memory in use. Of the allocated memory 5.35 GiB is allocated by PyTorch, and 2.32 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.
";

#[test]
fn explain_json_from_stdin() {
    let out = oomkit(&["explain", "--json"], Some(LOG));
    let v = success_json(&out, "oomkit explain --json");
    for field in [
        "requested_bytes",
        "capacity_bytes",
        "free_bytes",
        "process_bytes",
        "allocated_bytes",
        "reserved_unallocated_bytes",
        "other_processes",
        "cause",
    ] {
        assert!(v.get(field).is_some(), "missing {field}");
    }
    assert_eq!(v["cause"], "fragmentation");
    assert_eq!(v["other_processes"], serde_json::json!([]));
}

#[test]
fn explain_old_form_has_nulls_and_file_input_works() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("explain-old.log");
    // https://github.com/One-2-3-45/One-2-3-45/issues/25
    std::fs::write(&path, "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.69 GiB (GPU 0; 14.56 GiB total capacity; 649.97 MiB already allocated; 1.31 GiB free; 1.01 GiB reserved in total by PyTorch)\n").unwrap();
    let out = oomkit(&["explain", "--json", path.to_str().unwrap()], None);
    let v = success_json(&out, "oomkit explain FILE");
    assert_eq!(v["process_bytes"], Value::Null);
    assert_eq!(v["cause"], "capacity");
}

#[test]
fn explain_without_a_message_is_exit_2() {
    let out = oomkit(&["explain"], Some("epoch 1 done\n"));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no PyTorch out-of-memory message"));
}

#[test]
fn estimate_json_fields() {
    let out = oomkit(
        &[
            "estimate", "--params", "3B", "--batch", "8", "--seq", "128", "--gpu", "80GiB",
            "--json",
        ],
        None,
    );
    let v = success_json(&out, "oomkit estimate --json");
    for field in [
        "weights_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "ema_bytes",
        "activations_bytes",
        "overhead_bytes",
        "total_bytes",
        "capacity_bytes",
        "max_batch",
    ] {
        assert!(v.get(field).is_some(), "missing {field}");
    }
    let parts: u64 = [
        "weights_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "ema_bytes",
        "activations_bytes",
        "overhead_bytes",
    ]
    .iter()
    .map(|k| v[*k].as_u64().unwrap())
    .sum();
    assert_eq!(parts, v["total_bytes"].as_u64().unwrap());
    assert_eq!(v["capacity_bytes"], 80u64 << 30);
    assert!(v["max_batch"].as_u64().unwrap() > 8);
}

#[test]
fn estimate_bad_input() {
    assert_eq!(oomkit(&["estimate"], None).status.code(), Some(2));
    assert_eq!(
        oomkit(&["estimate", "--params", "lots"], None)
            .status
            .code(),
        Some(2)
    );
    let out = oomkit(&["estimate", "--config", "/nonexistent/config.json"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/config.json"));
    // No --gpu and no GPU here: capacity and max_batch are null.
    let out = oomkit(&["estimate", "--params", "125M", "--json"], None);
    let v = success_json(&out, "oomkit estimate --params 125M");
    assert_eq!(v["capacity_bytes"], Value::Null);
    assert_eq!(v["max_batch"], Value::Null);
}
