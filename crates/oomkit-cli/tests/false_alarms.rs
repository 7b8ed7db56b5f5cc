//! The false-alarm check: `oomkit analyze` on every real snapshot, with the
//! findings each must get and no more. A rule that starts firing on healthy
//! runs fails here, before it teaches users to ignore oomkit.

mod common;
use common::*;
use serde_json::Value;

/// Each shared snapshot's expected finding kinds, with why.
const EXPECTED: &[(&str, &[&str], &str)] = &[
    (
        "diffusion_segments_only.pickle",
        &[],
        "1.52 GiB cached, the largest piece 128 MiB: larger than any 72 MiB block it asks for",
    ),
    (
        "eor_nn_counterfactuals.pickle",
        &[],
        "81 MiB free: too little to matter",
    ),
    (
        "gpt2_segments_only.pickle",
        &[],
        "4.67 GiB cached with a 3.07 GiB piece, for 148 MiB requests",
    ),
    ("legacy_segment_list.pkl", &[], "8% of reserved free"),
    (
        "llama_select_4gpu.pickle",
        &["dominant_role:parameters"],
        "860 MiB cached with a 478 MiB piece, for 477 MiB requests; BERT-large's weights are 56% of its forward's peak",
    ),
    (
        "lm_ctx128_forward_mixed_precision.pickle",
        &["dominant_role:parameters"],
        "1% of reserved free; the 2.7B model's fp32 weights are 57% of its forward's peak",
    ),
    (
        "lm_ctx128_full_train_step.pickle",
        &["dominant_role:optimizer_state"],
        "AdamW's first step creates its state: by design; that state is half the peak",
    ),
    (
        "lm_forward_bf16_ctx128.pickle",
        &["dominant_role:parameters", "fragmentation"],
        "321 MiB free in 20 MiB pieces, for 30 MiB requests: really stranded; the weights are 67% of a bf16 forward's peak",
    ),
    (
        "lm_medium_ctx128_inference.pickle",
        &["dominant_role:parameters"],
        "3% of reserved free; inference: the weights are the peak",
    ),
    (
        "lm_medium_ctx128_training.pickle",
        &["dominant_role:optimizer_state"],
        "6% of reserved free; AdamW's state is half the peak",
    ),
    (
        "small_mem_snapshot.pickle",
        &["dominant_role:temporaries"],
        "3.49 GiB cached in 512 MiB pieces, for 512 MiB requests; an attention benchmark whose softmax temporaries are 83% of the peak",
    ),
    (
        "snapviewer_sample.pickle",
        &["phase_retains_memory", "dominant_role:temporaries"],
        "Annotation1 keeps 655 MiB it created; the peak is almost all freed within its stage",
    ),
];

/// The snapshots committed in tests/real, found by the team (SOURCES.md there).
const OWN: &[(&str, &[&str], &str)] = &[
    (
        "cs336_lm_large_step_nothanmin.pickle",
        &["dominant_role:optimizer_state"],
        "7.29 GiB cached, the largest piece 50 MiB, for 48 MiB requests; AdamW's state is a third of the peak, just above the activations",
    ),
    (
        "cs336_lm_train_bcrafton.pickle",
        &["dominant_role:optimizer_state"],
        "1.08 GiB cached, the largest piece 148 MiB, for 148 MiB requests; the peak is in AdamW's step, half of it the state it keeps",
    ),
    (
        "cs336_lm_train_magma27.pickle",
        &["dominant_role:activations"],
        "11.9 GiB cached, the largest piece 314 MiB, for 312 MiB requests; activations are 85% of the peak",
    ),
    (
        "tinyllama_int8_lora_notebook_ftcourse.pickle",
        &["dominant_site", "dominant_role:activations", "fragmentation"],
        "a notebook cell runs the whole forward (77% of the peak at its line); 3.89 GiB free after backward, the largest piece 124 MiB, for 250 MiB requests: fragmented",
    ),
];

/// The findings' kinds, with the role of those about one (`dominant_role:parameters`).
fn kinds(report: &Value) -> Vec<String> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| match f["role"].as_str() {
            Some(role) => format!("{}:{role}", f["kind"].as_str().unwrap()),
            None => f["kind"].as_str().unwrap().to_string(),
        })
        .collect()
}

#[test]
fn every_real_snapshot_gets_exactly_the_findings_it_should() {
    let files = fixture_files();
    for path in &files {
        let name = path.file_name().unwrap().to_str().unwrap();
        let report = run_json(&["analyze", "--json", path.to_str().unwrap()]);
        let got = kinds(&report);
        match EXPECTED.iter().find(|(n, _, _)| *n == name) {
            Some((_, want, why)) => assert_eq!(got, *want, "{name} ({why})"),
            None => {
                // A snapshot added to the shared folder after this table was written:
                // no healthy run should be told to change its allocator settings.
                let advice: Vec<&String> = got
                    .iter()
                    .filter(|k| *k == "fragmentation" || *k == "reserved_overhead")
                    .collect();
                assert!(
                    advice.is_empty() || report["devices"].to_string().contains("\"ooms\":[{"),
                    "{name}: allocator advice {advice:?} on a run without an OOM; add it to EXPECTED if it is right"
                );
            }
        }
    }
    // Every entry in the table names a file that is there, where the folder is.
    if !files.is_empty() {
        for (name, _, _) in EXPECTED {
            assert!(
                files.iter().any(|p| p.ends_with(name)),
                "{name} is in EXPECTED but not among the fixtures"
            );
        }
    }
}

#[test]
fn our_own_real_snapshots_get_exactly_the_findings_they_should() {
    let files = own_fixture_files();
    assert_eq!(files.len(), OWN.len(), "tests/real and OWN disagree");
    for path in &files {
        let name = path.file_name().unwrap().to_str().unwrap();
        let (_, want, why) = OWN
            .iter()
            .find(|(n, _, _)| *n == name)
            .unwrap_or_else(|| panic!("{name} is not in OWN"));
        let report = run_json(&["analyze", "--json", path.to_str().unwrap()]);
        assert_eq!(kinds(&report), *want, "{name} ({why})");
    }
}

#[test]
fn the_demo_still_names_every_planted_problem() {
    let report = run_json(&["analyze", "--json", demo_file().to_str().unwrap()]);
    let got = kinds(&report);
    for kind in ["oom_capacity", "fragmentation"] {
        assert!(got.iter().any(|k| k == kind), "demo lost {kind}: {got:?}");
    }
}
