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

#[test]
fn estimate_reads_a_config_from_a_folder_or_the_hub_cache() {
    // One config, three ways: the file, the folder holding it, and a hub id whose cached snapshot holds it.
    let dir = scratch("estimate-hub");
    let config = r#"{"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": false}"#;
    std::fs::create_dir_all(dir.join("folder")).unwrap();
    std::fs::write(dir.join("folder").join("config.json"), config).unwrap();
    let repo = dir.join("hub").join("models--someorg--tiny-llama");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "0123abcd").unwrap();
    std::fs::create_dir_all(repo.join("snapshots").join("0123abcd")).unwrap();
    std::fs::write(
        repo.join("snapshots").join("0123abcd").join("config.json"),
        config,
    )
    .unwrap();
    let run = |arg: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_oomkit"))
            .args(["estimate", "--json", "--gpu", "24GiB", "--config", arg])
            .env("HF_HUB_CACHE", dir.join("hub"))
            .env("HF_HUB_OFFLINE", "1")
            .env("OOMKIT_FAKE_GPUS", "/nonexistent/oomkit-no-gpus.json")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let file = run(dir.join("folder").join("config.json").to_str().unwrap());
    assert_eq!(file.0, Some(0), "{}", file.2);
    let v: Value = serde_json::from_str(&file.1).unwrap();
    // Embedding and head, and per layer four projections, the gated MLP's three and two norms; the final norm.
    let params = 2 * 32000 * 512 + 4 * (4 * 512 * 512 + 3 * 512 * 1376 + 2 * 512) + 512;
    assert_eq!(v["params"].as_u64(), Some(params), "{v}");
    assert_eq!(run(dir.join("folder").to_str().unwrap()).1, file.1);
    assert_eq!(run("someorg/tiny-llama").1, file.1);
    // Offline, an id the cache lacks is one line, exit 2; a folder without a config too.
    let (code, _, err) = run("someorg/absent");
    assert_eq!(code, Some(2));
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("someorg/absent: not in the hub's cache")
            && err.contains("HF_HUB_OFFLINE is set"),
        "{err}"
    );
    let (code, _, err) = run(dir.join("hub").to_str().unwrap());
    assert_eq!(code, Some(2));
    assert!(
        err.contains("a model folder needs a config.json, and this one has none"),
        "{err}"
    );
}

/// A run log of a few CUDA steps at one micro-batch, as the tracker and a callback write it.
fn run_log(dir: &std::path::Path, name: &str, micro_batch: Option<u64>, peak_gib: u64) -> String {
    const GIB: u64 = 1 << 30;
    let mut text = format!(
        "{{\"type\":\"start\",\"version\":1,\"device\":\"cuda:0\",\"capacity_bytes\":{}}}\n",
        80 * GIB
    );
    if let Some(b) = micro_batch {
        text += &format!("{{\"type\":\"plan\",\"micro_batch\":{b},\"grad_accum\":1,\"source\":\"oomkit run\",\"framework\":\"transformers\"}}\n");
    }
    for step in 0..3 {
        let peak = peak_gib * GIB - (2 - step) * (1 << 20);
        text += &format!("{{\"type\":\"step\",\"step\":{step},\"start_bytes\":{},\"end_bytes\":{},\"peak_bytes\":{peak}}}\n", 9 * GIB, 9 * GIB);
    }
    text += "{\"type\":\"end\"}\n";
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn estimate_calibrates_from_two_short_runs() {
    let dir = scratch("calibrate-two");
    // 10 GiB fixed and 1 GiB per sample: 14 GiB at micro-batch 4, 18 GiB at 8.
    let a = run_log(&dir, "b4.jsonl", Some(4), 14);
    let b = run_log(&dir, "b8.jsonl", None, 18);
    let b8 = format!("{b}=8");
    let out = oomkit(
        &[
            "estimate",
            "--params",
            "3B",
            "--seq",
            "512",
            "--json",
            "--calibrate",
            &a,
            &b8,
        ],
        None,
    );
    let v = success_json(&out, "estimate --calibrate");
    let c = &v["calibration"];
    assert_eq!(c["fit"], "line");
    const GIB: f64 = (1u64 << 30) as f64;
    let near = |x: &Value, want: f64| (x.as_f64().unwrap() - want).abs() < 0.01 * GIB;
    assert!(near(&c["fixed_bytes"], 10.0 * GIB), "{c}");
    assert!(near(&c["per_sample_bytes"], GIB), "{c}");
    // The logs say 80 GiB; less the 1 GiB overhead and 10 GiB fixed, each with
    // the allocator's 10% reserve, (80 - 1 - 11) / 1.1 = 61.8 samples fit.
    assert_eq!(c["capacity_bytes"].as_u64(), Some(80 << 30));
    assert_eq!(c["max_batch"], 61);
    assert!(c["formula_max_batch"].is_u64());
    // The text shows both, side by side.
    let text = oomkit(
        &["estimate", "--params", "3B", "--calibrate", &a, &b8],
        None,
    );
    let said = String::from_utf8_lossy(&text.stdout);
    assert!(said.contains("Calibrated from micro-batch 4, 8"), "{said}");
    assert!(
        said.contains("measured") && said.contains("formulas"),
        "{said}"
    );
}

#[test]
fn estimate_calibrates_from_one_run_with_the_formulas_split_and_says_so() {
    let dir = scratch("calibrate-one");
    let a = run_log(&dir, "b4.jsonl", Some(4), 14);
    let v = success_json(
        &oomkit(
            &["estimate", "--params", "3B", "--json", "--calibrate", &a],
            None,
        ),
        "estimate --calibrate one",
    );
    let c = &v["calibration"];
    assert_eq!(c["fit"], "formula_split");
    assert_eq!(c["per_sample_bytes"], v["per_sample_bytes"]);
    let out = oomkit(&["estimate", "--params", "3B", "--calibrate", &a], None);
    assert!(String::from_utf8_lossy(&out.stdout).contains("measure a second micro-batch"));
}

#[test]
fn estimate_calibration_refuses_what_it_cannot_use() {
    let dir = scratch("calibrate-bad");
    // No plan record and no =B: the micro-batch is unknown.
    let a = run_log(&dir, "nobatch.jsonl", None, 14);
    let out = oomkit(&["estimate", "--params", "3B", "--calibrate", &a], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nobatch.jsonl") && err.contains("=B"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // A CPU run's resident set is no GPU budget.
    let cpu = dir.join("cpu.jsonl");
    std::fs::write(
        &cpu,
        "{\"type\":\"start\",\"version\":1,\"device\":\"cpu\"}\n{\"type\":\"step\",\"step\":0,\"start_bytes\":1,\"end_bytes\":1,\"peak_bytes\":2}\n",
    )
    .unwrap();
    let cpu_arg = format!("{}=4", cpu.display());
    let out = oomkit(
        &["estimate", "--params", "3B", "--calibrate", &cpu_arg],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a GPU"));
    // Peaks that do not grow with the batch cannot be fitted.
    let x = run_log(&dir, "x4.jsonl", Some(4), 18);
    let y = run_log(&dir, "x8.jsonl", Some(8), 14);
    let out = oomkit(&["estimate", "--params", "3B", "--calibrate", &x, &y], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("do not grow"));
}

#[test]
fn estimate_calibrates_from_find_batch_output() {
    let dir = scratch("calibrate-findbatch");
    const GIB: u64 = 1 << 30;
    // What `oomkit find-batch --json` printed: two trials that ran, one that ran out.
    let report = serde_json::json!({
        "trials": [
            {"batch": 2, "ok": true, "oom": false, "peak_bytes": 12 * GIB},
            {"batch": 6, "ok": true, "oom": false, "peak_bytes": 16 * GIB},
            {"batch": 99, "ok": false, "oom": true, "peak_bytes": null}
        ],
        "capacity_bytes": 40 * GIB
    });
    let path = dir.join("find-batch.json");
    std::fs::write(&path, report.to_string()).unwrap();
    let v = success_json(
        &oomkit(
            &[
                "estimate",
                "--params",
                "3B",
                "--json",
                "--calibrate",
                path.to_str().unwrap(),
            ],
            None,
        ),
        "estimate --calibrate find-batch",
    );
    let c = &v["calibration"];
    assert_eq!(c["measured"].as_array().unwrap().len(), 2);
    // 10 GiB fixed, 1 GiB per sample, 10% reserve on both, 40 GiB less 1 GiB
    // overhead: (40 - 1 - 11) / 1.1 = 25.5.
    assert_eq!(c["max_batch"], 25);
}

#[test]
fn estimate_without_a_model_names_both_ways_to_give_one() {
    let out = oomkit(&["estimate"], None);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--params <N>") && err.contains("--config <FILE|FOLDER|HUB_ID>"),
        "{err}"
    );
}
