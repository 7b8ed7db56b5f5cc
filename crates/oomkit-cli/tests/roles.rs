//! Memory by role on real snapshots: the roles add up to the bytes live at
//! each moment, and parameters, gradients and optimizer state match the
//! figures worked out by hand from each public model's configuration.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

const ROLES: [&str; 8] = [
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "inputs",
    "other",
    "unknown",
];

fn analyze(path: &Path) -> Value {
    let out = oomkit(&["analyze", "--json", path.to_str().unwrap()], None);
    success_json(&out, &path.display().to_string())
}

fn total(roles: &Value) -> u64 {
    ROLES.iter().map(|r| roles[r].as_u64().unwrap()).sum()
}

/// Every role object has the eight keys, adds up to the moment's bytes, and
/// its evidence accounts for every byte of each role but `unknown`.
fn check_moment(what: &str, roles: &Value, evidence: &Value, reason: &Value, bytes: u64) {
    assert_eq!(roles.as_object().unwrap().len(), ROLES.len(), "{what}");
    assert_eq!(
        total(roles),
        bytes,
        "{what}: roles add up to the live bytes"
    );
    for r in ROLES {
        let e = &evidence[r];
        let told: u64 = ["frames", "lifetimes", "sizes"]
            .iter()
            .map(|k| e[k].as_u64().unwrap())
            .sum();
        let want = if r == "unknown" {
            0
        } else {
            roles[r].as_u64().unwrap()
        };
        assert_eq!(told, want, "{what}: evidence for {r}");
    }
    assert_eq!(
        reason.is_null(),
        roles["unknown"].as_u64().unwrap() == 0,
        "{what}: a reason exactly when bytes are unknown"
    );
}

fn check_invariants(path: &Path) -> Value {
    let a = analyze(path);
    for d in a["devices"].as_array().unwrap() {
        let what = format!("{} cuda:{}", path.display(), d["device"]);
        check_moment(
            &format!("{what} peak"),
            &d["roles"]["peak"],
            &d["roles_evidence"]["peak"],
            &d["roles_unknown_reason"]["peak"],
            d["peak_active_bytes"].as_u64().unwrap(),
        );
        check_moment(
            &format!("{what} end"),
            &d["roles"]["end"],
            &d["roles_evidence"]["end"],
            &d["roles_unknown_reason"]["end"],
            d["active_bytes"].as_u64().unwrap(),
        );
        for o in d["ooms"].as_array().unwrap() {
            check_moment(
                &format!("{what} OOM {}", o["event_index"]),
                &o["roles"],
                &o["roles_evidence"],
                &o["roles_unknown_reason"],
                o["live_bytes"].as_u64().unwrap(),
            );
        }
    }
    a
}

#[test]
fn roles_add_up_on_every_snapshot() {
    let mut files = fixture_files();
    files.extend(own_fixture_files());
    files.push(demo_file());
    for f in &files {
        check_invariants(f);
    }
}

/// CS336's Transformer LM (`cs336_basics/model.py`, the assignment's
/// template): an untied token embedding and output head (vocab x d each);
/// per layer Q, K, V and O projections (d x d each, no biases), a SwiGLU
/// feed-forward of three d x d_ff matrices and two RMSNorm gains (d each);
/// and a final RMSNorm (d).
fn cs336_params(vocab: u64, d: u64, d_ff: u64, layers: u64) -> u64 {
    2 * vocab * d + layers * (4 * d * d + 3 * d * d_ff + 2 * d) + d
}

/// Asserts that `got` is within `tolerance` (a fraction) of `want`.
fn within(what: &str, got: u64, want: u64, tolerance: f64) {
    let err = (got as f64 - want as f64).abs() / want as f64;
    assert!(
        err <= tolerance,
        "{what}: {got} bytes against {want} worked out by hand ({:.2}% off)",
        100.0 * err
    );
}

/// Asserts that `got` is within 10% of `want`.
fn near(what: &str, got: u64, want: u64) {
    within(what, got, want, 0.10);
}

fn device(a: &Value, index: i64) -> &Value {
    a["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == index)
        .unwrap()
}

fn bytes(d: &Value, at: &str, role: &str) -> u64 {
    d["roles"][at][role].as_u64().unwrap()
}

/// A training step of an fp32 model with AdamW: parameters and gradients of
/// 4 bytes per parameter, and two fp32 state tensors per parameter.
fn check_training(file: &str, params: u64, at: &[&str]) {
    let Some(dir) = fixtures() else { return };
    let a = check_invariants(&dir.join(file));
    let d = device(&a, 0);
    for &m in at {
        near(
            &format!("{file} {m} parameters"),
            bytes(d, m, "parameters"),
            4 * params,
        );
        near(
            &format!("{file} {m} gradients"),
            bytes(d, m, "gradients"),
            4 * params,
        );
        near(
            &format!("{file} {m} optimizer state"),
            bytes(d, m, "optimizer_state"),
            2 * 4 * params,
        );
    }
}

/// A forward-only or inference snapshot: fp32 parameters, and neither
/// gradients nor optimizer state at any moment.
fn check_forward_only(file: &str, dev: i64, params: u64) {
    let Some(dir) = fixtures() else { return };
    let a = check_invariants(&dir.join(file));
    let d = device(&a, dev);
    for m in ["peak", "end"] {
        near(
            &format!("{file} {m} parameters"),
            bytes(d, m, "parameters"),
            4 * params,
        );
        assert_eq!(bytes(d, m, "gradients"), 0, "{file} {m}");
        assert_eq!(bytes(d, m, "optimizer_state"), 0, "{file} {m}");
    }
}

#[test]
fn cs336_medium_training_step() {
    // Wedsonlin/assignment2-systems, "medium": d_model 1024, d_ff 4096, 24
    // layers, vocabulary 10000: 423,183,360 parameters (1.58 GiB in fp32).
    // The trace covers one step's tail; the optimizer step replaces AdamW's
    // two moments, so at the peak the old ones (from before recording,
    // told by sizes) and some new ones (told by frames) are both alive.
    assert_eq!(cs336_params(10_000, 1024, 4096, 24), 423_183_360);
    check_training(
        "lm_medium_ctx128_training.pickle",
        cs336_params(10_000, 1024, 4096, 24),
        &["peak", "end"],
    );
}

#[test]
fn cs336_2_7b_full_train_step() {
    // kkaitlyn111/cs336-a2-systems, "2.7B": d_model 2560, d_ff 10240, 32
    // layers, vocabulary 10000: 3,406,809,600 parameters (12.7 GiB in fp32).
    check_training(
        "lm_ctx128_full_train_step.pickle",
        cs336_params(10_000, 2560, 10_240, 32),
        &["peak", "end"],
    );
}

#[test]
fn cs336_forward_and_inference_snapshots_hold_no_gradients_or_optimizer_state() {
    // The same medium model, inference only.
    check_forward_only(
        "lm_medium_ctx128_inference.pickle",
        0,
        cs336_params(10_000, 1024, 4096, 24),
    );
    // The 2.7B model's forward under mixed precision: fp32 parameters.
    check_forward_only(
        "lm_ctx128_forward_mixed_precision.pickle",
        0,
        cs336_params(10_000, 2560, 10_240, 32),
    );
    // silmont2000/assignment2-systems, "small" (d_model 768, d_ff 3072, 12
    // layers, vocabulary 10000), forward in bf16 autocast: fp32 parameters.
    check_forward_only(
        "lm_forward_bf16_ctx128.pickle",
        0,
        cs336_params(10_000, 768, 3072, 12),
    );
}

#[test]
fn bert_large_forward_on_the_first_of_four_gpus() {
    // Maphsge4/select_n runs BERT-large (modeling_bert.py) forward on
    // cuda:0: vocabulary 30522, 512 positions, 2 token types, hidden 1024,
    // 24 layers with an intermediate size of 4096, all with biases, a
    // LayerNorm after the embeddings and two per layer, and the pooler.
    let (d, ff, layers) = (1024u64, 4096u64, 24u64);
    let embeddings = (30_522 + 512 + 2) * d + 2 * d;
    let layer = 4 * (d * d + d) + 2 * d + (d * ff + ff) + (ff * d + d) + 2 * d;
    let params = embeddings + layers * layer + d * d + d;
    assert_eq!(params, 335_141_888);
    check_forward_only("llama_select_4gpu.pickle", 0, params);
}

#[test]
fn a_file_without_frames_or_trace_says_so_and_calls_everything_unknown() {
    let Some(dir) = fixtures() else { return };
    for file in [
        "gpt2_segments_only.pickle",
        "diffusion_segments_only.pickle",
        "legacy_segment_list.pkl",
    ] {
        let a = check_invariants(&dir.join(file));
        for d in a["devices"].as_array().unwrap() {
            let r = &d["roles"]["peak"];
            assert_eq!(r["unknown"], d["peak_active_bytes"], "{file}");
            assert_eq!(d["roles_unknown_reason"]["peak"], "no_evidence", "{file}");
        }
        let warned = a["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["kind"] == "roles_unknown")
            .count();
        assert!(warned >= 1, "{file}: one line says why");
    }
}

#[test]
fn the_terminal_report_lists_roles_at_the_peak_and_at_the_oom() {
    let out = oomkit(&["demo"], None);
    let text = String::from_utf8(out.stdout).unwrap();
    let peak = text
        .split("By role at the peak")
        .nth(1)
        .expect("roles at the peak");
    assert!(
        peak.contains("activations") && peak.contains("from lifetimes"),
        "{text}"
    );
    assert!(
        peak.contains("parameters") && peak.contains("from sizes"),
        "{text}"
    );
    let oom = text.split("OOM at event").nth(1).expect("an OOM");
    assert!(oom.contains("by role:"), "{text}");
}

fn finding<'a>(a: &'a Value, kind: &str) -> Option<&'a Value> {
    a["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == kind)
}

#[test]
fn the_advice_fits_the_largest_role_with_the_estimates_numbers() {
    let Some(dir) = fixtures() else { return };
    // A 2.7B training step: AdamW's state is half the peak. An 8-bit
    // optimizer keeps 2 of AdamW's 8 bytes per parameter; sharding over 8
    // GPUs keeps an eighth.
    let a = analyze(&dir.join("lm_ctx128_full_train_step.pickle"));
    let f = finding(&a, "dominant_role").expect("a dominant role");
    assert_eq!(f["role"], "optimizer_state");
    let state = bytes(device(&a, 0), "peak", "optimizer_state");
    assert_eq!(f["bytes"].as_u64().unwrap(), state);
    let advice = f["advice"].as_str().unwrap();
    let eight_bit = oomkit_units::human_bytes(state - state * 2 / 8);
    let sharded = oomkit_units::human_bytes(state - state / 8);
    assert!(advice.contains(&format!("8-bit optimizer (bitsandbytes AdamW8bit, 2 bytes per parameter) saves about {eight_bit}")), "{advice}");
    assert!(
        advice.contains(&format!("over 8 GPUs (ZeRO-1/FSDP) saves about {sharded}")),
        "{advice}"
    );
    assert_eq!(a["verdict"]["role"], "optimizer_state");

    // Inference: the weights dominate, and nothing is said of an optimizer or a batch.
    let a = analyze(&dir.join("lm_medium_ctx128_inference.pickle"));
    let f = finding(&a, "dominant_role").expect("a dominant role");
    assert_eq!(f["role"], "parameters");
    let advice = f["advice"].as_str().unwrap();
    assert!(
        !advice.contains("optimizer") && !advice.contains("micro-batch"),
        "{advice}"
    );
}

#[test]
fn the_failure_names_the_role_that_filled_the_device() {
    let a = analyze(&demo_file());
    let v = &a["verdict"];
    assert_eq!(v["role"], "activations");
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("63% of it activations"),
        "{v}"
    );
    let f = finding(&a, "dominant_role").expect("a dominant role");
    assert_eq!(f["role"], "activations");
    let oom = &a["devices"][0]["ooms"][0];
    let act = oom["roles"]["activations"].as_u64().unwrap();
    assert!(
        f["advice"].as_str().unwrap().contains(&format!(
            "saves about {}",
            oomkit_units::human_bytes(act / 2)
        )),
        "{f}"
    );
}

#[test]
fn the_estimate_is_compared_with_a_snapshot_term_by_term() {
    // The demo, as a measurement at micro-batch 8: its roles at the peak
    // are the measured terms.
    let demo = demo_file();
    let arg = format!("{}=8", demo.display());
    let e = run_json(&[
        "estimate",
        "--params",
        "350M",
        "--json",
        "--calibrate",
        &arg,
    ]);
    let terms = &e["calibration"]["terms"][0];
    assert_eq!(terms["micro_batch"], 8);
    let peak = &analyze(&demo)["devices"][0]["roles"]["peak"];
    for t in terms["roles"].as_array().unwrap() {
        let role = t["role"].as_str().unwrap();
        assert_eq!(t["measured_bytes"], peak[role], "{role}");
    }
    assert_eq!(e["calibration"]["measured"][0]["roles"], *peak);
    // Without the micro-batch a snapshot is refused in one line.
    let out = oomkit(
        &[
            "estimate",
            "--params",
            "350M",
            "--calibrate",
            demo.to_str().unwrap(),
        ],
        None,
    );
    assert_refused(&out, &["does not record its micro-batch", "=B"]);

    // The CS336 medium model in fp32 with AdamW: the formulas' weights,
    // gradients and state against the training step's, within 10%.
    let Some(dir) = fixtures() else { return };
    let params = cs336_params(10_000, 1024, 4096, 24).to_string();
    let arg = format!(
        "{}=4",
        dir.join("lm_medium_ctx128_training.pickle").display()
    );
    let e = run_json(&[
        "estimate",
        "--params",
        &params,
        "--dtype",
        "fp32",
        "--seq",
        "128",
        "--json",
        "--calibrate",
        &arg,
    ]);
    let roles = e["calibration"]["terms"][0]["roles"].as_array().unwrap();
    for role in ["parameters", "gradients", "optimizer_state"] {
        let t = roles.iter().find(|t| t["role"] == role).unwrap();
        near(
            &format!("estimate's {role}"),
            t["measured_bytes"].as_u64().unwrap(),
            t["estimated_bytes"].as_u64().unwrap(),
        );
    }
}

#[test]
fn cs336_large_step_found_by_the_team() {
    // notHanmin/assignment2-systems (tests/real/SOURCES.md), "large": d_model
    // 1280, d_ff 5120, 36 layers, vocabulary 10000: 969,411,840 parameters,
    // AdamW with two fp32 states each. The trace runs from zero_grad, which
    // frees the previous step's gradients (allocated before recording: told
    // by the free's frames), to the step; the state was made by an earlier
    // step (told by its blocks' frames); the weights by sizes.
    let params = cs336_params(10_000, 1280, 5120, 36);
    assert_eq!(params, 969_411_840);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/real/cs336_lm_large_step_nothanmin.pickle");
    let a = check_invariants(&path);
    let d = device(&a, 0);
    for m in ["peak", "end"] {
        near(
            &format!("{m} parameters"),
            bytes(d, m, "parameters"),
            4 * params,
        );
        near(
            &format!("{m} gradients"),
            bytes(d, m, "gradients"),
            4 * params,
        );
        near(
            &format!("{m} optimizer state"),
            bytes(d, m, "optimizer_state"),
            8 * params,
        );
    }
    assert_eq!(
        d["roles_evidence"]["peak"]["gradients"]["frames"],
        d["roles"]["peak"]["gradients"]
    );
}

#[test]
fn gradients_accumulated_in_place_from_before_the_trace_pair_with_their_parameters() {
    // Two students' runs of the same assignment (tests/real/SOURCES.md),
    // both recorded after their first backward: the gradients were
    // allocated before recording and the traced backward adds into them,
    // so no entry tells them. MAGMA27: d_model 768, d_ff 3072, 12 layers,
    // vocabulary 10000 (128,625,408 fp32 parameters), forward and backward
    // only; its backward's own results of each parameter size say how many
    // parameters have it. bcrafton: the same shape with GPT-2's vocabulary
    // of 50257 (190,460,160), under torch.compile, with an AdamW step whose
    // state (two per parameter, by its frames) says so.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/real");
    for (file, params, state) in [
        (
            "cs336_lm_train_magma27.pickle",
            cs336_params(10_000, 768, 3072, 12),
            0,
        ),
        (
            "cs336_lm_train_bcrafton.pickle",
            cs336_params(50_257, 768, 3072, 12),
            2,
        ),
    ] {
        assert!([128_625_408, 190_460_160].contains(&params));
        let a = check_invariants(&dir.join(file));
        let d = device(&a, 0);
        for m in ["peak", "end"] {
            for role in ["parameters", "gradients"] {
                within(
                    &format!("{file} {m} {role}"),
                    bytes(d, m, role),
                    4 * params,
                    0.01,
                );
                assert_eq!(
                    d["roles_evidence"][m][role]["sizes"], d["roles"][m][role],
                    "{file} {m}: {role} told by sizes"
                );
            }
        }
        if state > 0 {
            within(
                &format!("{file} end optimizer state"),
                bytes(d, "end", "optimizer_state"),
                state * 4 * params,
                0.01,
            );
        }
    }
}

#[test]
fn torch_2_0_history_blocks_are_told_by_their_frames() {
    // A segments-only file in torch 2.0's layout: each block's frames sit in
    // its `history`. A gradient (AccumulateGrad), a forward tensor and a
    // parameter copied to the GPU (Module._apply).
    let dir = tempdir("roles-history");
    let path = dir.join("history.pickle");
    let script = r#"
import pickle, sys
def frames(*fs): return [{"filename": f, "line": 1, "name": n} for f, n in fs]
grad = frames(("??", "torch::autograd::AccumulateGrad::apply(std::vector<at::Tensor>&&)"))
fwd = frames(("/home/me/model.py", "forward"))
param = frames(("/venv/site-packages/torch/nn/modules/module.py", "_apply"), ("/home/me/train.py", "main"))
blocks = [
    {"size": 4096, "state": "active_allocated", "history": [{"addr": 1 << 20, "real_size": 4000, "frames": grad}]},
    {"size": 8192, "state": "active_allocated", "history": [{"addr": (1 << 20) + 4096, "real_size": 8192, "frames": fwd}]},
    {"size": 4096, "state": "active_allocated", "history": [{"addr": (1 << 20) + 12288, "real_size": 4000, "frames": param}]},
    {"size": 4096, "state": "inactive"},
]
seg = {"device": 0, "address": 1 << 20, "total_size": 20480, "stream": 0, "segment_type": "small", "blocks": blocks}
pickle.dump({"segments": [seg], "device_traces": [[]]}, open(sys.argv[1], "wb"), protocol=2)
"#;
    python_script_inline(script, &path);
    let a = check_invariants(&path);
    let d = device(&a, 0);
    assert_eq!(bytes(d, "end", "gradients"), 4096);
    assert_eq!(bytes(d, "end", "parameters"), 4096);
    // Training is shown (a gradient), so the forward tensor alive is an activation.
    assert_eq!(bytes(d, "end", "activations"), 8192);
    assert_eq!(d["roles_evidence"]["end"]["gradients"]["frames"], 4096);
}

/// Runs an inline Python script with one path argument.
fn python_script_inline(script: &str, path: &Path) {
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
