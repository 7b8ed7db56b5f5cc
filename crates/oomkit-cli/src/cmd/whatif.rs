//! `oomkit whatif`: a snapshot's trace replayed through the model of
//! PyTorch's caching allocator, as recorded and under other settings,
//! another capacity or a smaller micro-batch, side by side.

use crate::args::FormatArgs;
use crate::exit::{EXIT_INPUT, EXIT_OK};
use crate::load::load_snapshot;
use crate::output::{print, say};
use oomkit_allocator::{what_if, Options, Scenario};
use std::path::PathBuf;

/// Flags of `oomkit whatif`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// A snapshot with an allocation trace (torch.cuda.memory._dump_snapshot after _record_memory_history).
    file: PathBuf,
    /// Other allocator settings, as PYTORCH_CUDA_ALLOC_CONF writes them
    /// (expandable_segments:True,max_split_size_mb:128); repeat for more
    /// scenarios. Default, with no scenario given: expandable_segments flipped.
    #[arg(long, value_name = "SETTINGS")]
    alloc_conf: Vec<String>,
    /// Another capacity: what the allocator may hold (80GiB), or a GPU
    /// (H100, H200, B200, A100, A100-40GB, L4, L40S, A10G, V100, T4, RTX-4090,
    /// ... docs/whatif.md has them all: its total less 1.25 GiB of CUDA
    /// context); repeat for more.
    #[arg(long, value_name = "SIZE | GPU")]
    capacity: Vec<String>,
    /// A smaller micro-batch: activations, temporaries and inputs scaled by
    /// this share (0.5 or 4/8), an approximation; repeat for more.
    #[arg(long, value_name = "SHARE")]
    batch_scale: Vec<String>,
    /// Only this CUDA device index.
    #[arg(long, value_name = "D")]
    device: Option<i64>,
    #[command(flatten)]
    format: FormatArgs,
}

/// `oomkit whatif`.
pub(crate) fn run(a: Args) -> u8 {
    let mut scenarios: Vec<Scenario> = a
        .alloc_conf
        .iter()
        .map(|c| Scenario::alloc_conf(c))
        .collect();
    for c in &a.capacity {
        match Scenario::capacity(c) {
            Ok(s) => scenarios.push(s),
            Err(e) => {
                say(&e.to_string());
                return EXIT_INPUT;
            }
        }
    }
    for b in &a.batch_scale {
        match Scenario::batch_scale(b) {
            Ok(s) => scenarios.push(s),
            Err(e) => {
                say(&e.to_string());
                return EXIT_INPUT;
            }
        }
    }
    let snap = match load_snapshot(
        &a.file,
        a.device,
        "whatif replays each allocation of a snapshot's trace, which a run log does not record",
    ) {
        Ok(s) => s,
        Err(msg) => {
            say(&msg);
            return EXIT_INPUT;
        }
    };
    let shown = a.file.display().to_string();
    if snap.traces.iter().all(|t| t.events.is_empty()) {
        say(&format!(
            "{shown}: holds no allocation trace to replay; record one with torch.cuda.memory._record_memory_history(max_entries=1_000_000) before the run"
        ));
        return EXIT_INPUT;
    }
    if scenarios.is_empty() {
        let recorded = snap
            .allocator_settings
            .as_ref()
            .and_then(|s| s.get("expandable_segments"))
            .and_then(|v| v.as_bool())
            .unwrap_or_else(|| snap.segments.iter().any(|s| s.is_expandable));
        scenarios.push(Scenario::alloc_conf(if recorded {
            "expandable_segments:False"
        } else {
            "expandable_segments:True"
        }));
    }
    let opts = Options {
        device: a.device,
        samples: Vec::new(),
        no_baseline: false,
    };
    match what_if(&snap, &scenarios, &opts) {
        Ok(w) => {
            print(
                a.format.output(),
                &oomkit_report::WhatIfReport {
                    file: &shown,
                    whatif: &w,
                },
            );
            EXIT_OK
        }
        Err(e) => {
            say(&format!("--alloc-conf: {e}"));
            EXIT_INPUT
        }
    }
}
