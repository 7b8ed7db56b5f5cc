//! `oomkit find-batch`: runs the command at chosen micro-batches and reports
//! the largest that fits, measuring each run's peak from the tracker's probe
//! file or, without one, by sampling the GPU.

use crate::child::{self, Spec};
use crate::child_env;
use crate::search::{search, SearchConfig, SearchResult, Trial};
use crate::{fill_placeholders, BatchPlan, SuperviseError};
use oomkit_gpu::procinfo::process_group;
use oomkit_gpu::{acquire, probe, ClaimDir, GpuError, Request, Wait};
use oomkit_units::human_bytes;
use serde::Serialize;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How often the GPU is sampled when the child writes no probe file.
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// What `oomkit find-batch` was asked to do.
#[derive(Clone, Debug)]
pub struct FindBatchOptions {
    /// The command, with `{batch_size}` where the micro-batch goes.
    pub command: Vec<OsString>,
    /// The first micro-batch to try.
    pub start: u64,
    /// The largest micro-batch worth trying.
    pub max: u64,
    /// The fraction of memory to leave free.
    pub margin: f64,
    /// The effective batch to reach by accumulation, if any.
    pub effective: Option<u64>,
    /// Memory available, instead of the chosen GPU's free memory.
    pub capacity: Option<u64>,
    /// How long to wait for a GPU.
    pub wait: Wait,
    /// Where GPU claims are kept.
    pub claims: ClaimDir,
    /// Send the command's standard output to stderr, keeping stdout for oomkit's JSON.
    pub child_stdout_to_stderr: bool,
}

/// One run as reported.
#[derive(Clone, Debug, Serialize)]
pub struct TrialReport {
    /// The micro-batch tried.
    pub batch: u64,
    /// Whether it ran and stayed within the budget.
    pub ok: bool,
    /// Whether it ran out of memory or failed.
    pub oom: bool,
    /// Its measured peak.
    pub peak_bytes: Option<u64>,
    /// Where the peak came from: "probe" (the tracker), "nvml", or null.
    pub peak_source: Option<&'static str>,
    /// The command's exit code.
    pub exit_code: i32,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// What `oomkit find-batch` found.
#[derive(Clone, Debug, Serialize)]
pub struct FindBatchReport {
    /// Every run, in order.
    pub trials: Vec<TrialReport>,
    /// The largest micro-batch within the budget, or null when none fits.
    pub recommended_batch: Option<u64>,
    /// Accumulation for the effective batch (1 without --effective).
    pub grad_accum: Option<u64>,
    /// The micro-batch to pair with `grad_accum`: the smallest that covers the effective batch at that accumulation, never above the recommended batch.
    pub micro_batch_for_effective: Option<u64>,
    /// The effective batch asked for.
    pub effective_batch: Option<u64>,
    /// Memory available to the command.
    pub capacity_bytes: u64,
    /// Capacity less the margin.
    pub budget_bytes: u64,
    /// The margin used.
    pub margin: f64,
    /// The GPU the runs used, if one was chosen.
    pub gpu: Option<u32>,
    /// The fitted fixed memory.
    pub fixed_bytes: Option<f64>,
    /// The fitted memory per sample.
    pub per_sample_bytes: Option<f64>,
    /// "model" or "bisection".
    pub method: &'static str,
}

/// Memory the child's process group holds on `gpu_index`, or the GPU's growth over `baseline`.
fn sample(gpu_index: u32, pgid: u32, baseline: u64) -> Option<u64> {
    let gpus = probe().ok()?;
    let g = gpus.iter().find(|g| g.index == gpu_index)?;
    let ours: u64 = g
        .processes
        .iter()
        .filter(|p| process_group(p.pid) == Some(u64::from(pgid)))
        .filter_map(|p| p.used_bytes)
        .sum();
    if ours > 0 {
        Some(ours)
    } else {
        // NVML shows host pids inside containers; fall back to the device's growth.
        Some(g.used_bytes.saturating_sub(baseline)).filter(|b| *b > 0)
    }
}

fn read_probe(path: &PathBuf) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("peak_bytes")?.as_u64()
}

/// Runs the search; `say` hears each trial as it ends.
pub fn find_batch(
    opts: &FindBatchOptions,
    say: &mut dyn FnMut(&str),
) -> Result<FindBatchReport, SuperviseError> {
    if opts.command.is_empty() {
        return Err(SuperviseError::Usage("no command given after --".into()));
    }
    if !(0.0..0.95).contains(&opts.margin) {
        return Err(SuperviseError::Usage(
            "--margin must be between 0 and 0.95".into(),
        ));
    }
    child::catch_signals();
    let req = Request {
        count: 1,
        min_free: None,
        exclude: Vec::new(),
    };
    let acquired = match acquire(&req, &opts.claims, opts.wait, &mut |m| say(m), &|| false) {
        Ok(a) => Some(a),
        Err(e) if e.is_absent() && opts.capacity.is_some() => None,
        Err(e) if e.is_absent() => {
            return Err(GpuError::Unsatisfiable(format!(
                "{e}; give --capacity to search against a stated memory size"
            ))
            .into())
        }
        Err(e) => return Err(e.into()),
    };
    let gpu = acquired.as_ref().and_then(|a| a.gpus.first().cloned());
    let capacity = match (opts.capacity, &gpu) {
        (Some(c), _) => c,
        (None, Some(g)) => g.free_bytes,
        // Only reachable if a successful acquire returned no GPU.
        (None, None) => {
            return Err(SuperviseError::Usage(
                "no GPU was chosen and no --capacity given".into(),
            ))
        }
    };
    let cfg = SearchConfig {
        start: opts.start,
        max: opts.max,
        capacity_bytes: capacity,
        margin: opts.margin,
    };
    say(&format!(
        "searching for the largest micro-batch within {} ({} less a {:.0}% margin){}",
        human_bytes(cfg.budget()),
        human_bytes(capacity),
        opts.margin * 100.0,
        gpu.as_ref()
            .map(|g| format!(" on GPU {} ({})", g.index, g.name))
            .unwrap_or_default()
    ));
    let mut reports: Vec<TrialReport> = Vec::new();
    let mut failure: Option<SuperviseError> = None;
    let mut run_one = |b: u64| -> Trial {
        let bad = Trial {
            batch: b,
            ok: false,
            oom: true,
            peak_bytes: None,
        };
        if failure.is_some() {
            return bad;
        }
        let n = reports.len() + 1;
        let probe_path =
            std::env::temp_dir().join(format!("oomkit-probe-{}-{n}.json", std::process::id()));
        let _ = std::fs::remove_file(&probe_path);
        let baseline = gpu
            .as_ref()
            .and_then(|g| probe().ok()?.into_iter().find(|x| x.index == g.index))
            .map(|g| g.used_bytes)
            .unwrap_or(0);
        let plan = BatchPlan::new(b, opts.effective.unwrap_or(b));
        let mut env = vec![
            (
                OsString::from(child_env::PROBE_FILE),
                probe_path.clone().into_os_string(),
            ),
            (child_env::MICRO_BATCH.into(), b.to_string().into()),
            (
                child_env::GRAD_ACCUM.into(),
                plan.grad_accum.to_string().into(),
            ),
            (
                child_env::BASELINE_USED_BYTES.into(),
                baseline.to_string().into(),
            ),
            (child_env::ATTEMPT.into(), n.to_string().into()),
        ];
        if let Some(g) = &gpu {
            env.extend(child::visible_devices(&[g.index]));
        }
        let spec = Spec {
            argv: opts
                .command
                .iter()
                .map(|a| fill_placeholders(a, Some(&plan), n as u32))
                .collect(),
            env,
            stdout_to_stderr: opts.child_stdout_to_stderr,
        };
        let mut sampled: Option<u64> = None;
        let mut last = Instant::now() - SAMPLE_EVERY;
        let gpu_index = gpu.as_ref().map(|g| g.index);
        let outcome = child::run(&spec, &mut |pgid| {
            if let Some(idx) = gpu_index {
                if last.elapsed() >= SAMPLE_EVERY {
                    last = Instant::now();
                    if let Some(s) = sample(idx, pgid, baseline) {
                        sampled = Some(sampled.unwrap_or(0).max(s));
                    }
                }
            }
        });
        let out = match outcome {
            Ok(o) => o,
            Err(e) => {
                failure = Some(e);
                return bad;
            }
        };
        if let Some(sig) = out.interrupted_by {
            failure = Some(SuperviseError::Interrupted(sig));
            return bad;
        }
        let (peak, source) = match read_probe(&probe_path) {
            Some(p) => (Some(p), Some("probe")),
            None => (sampled, sampled.map(|_| "nvml")),
        };
        let _ = std::fs::remove_file(&probe_path);
        let ran = out.exit_code == 0;
        let fits_budget = peak.is_none_or(|p| p <= cfg.budget());
        let t = Trial {
            batch: b,
            ok: ran && fits_budget,
            oom: !ran,
            peak_bytes: peak,
        };
        let verdict = if !ran && out.oom_line.is_some() {
            "out of memory".to_string()
        } else if !ran {
            format!(
                "failed with exit code {} (counted as too large)",
                out.exit_code
            )
        } else if !fits_budget {
            "ran, but over the budget".to_string()
        } else {
            "fits".to_string()
        };
        say(&format!(
            "trial {n}: micro-batch {b}: {verdict}{}",
            peak.map(|p| format!(", peak {}", human_bytes(p)))
                .unwrap_or_default()
        ));
        reports.push(TrialReport {
            batch: b,
            ok: t.ok,
            oom: t.oom,
            peak_bytes: peak,
            peak_source: source,
            exit_code: out.exit_code,
            seconds: out.duration.as_secs_f64(),
        });
        t
    };
    let result: SearchResult = search(&cfg, &mut run_one);
    if let Some(e) = failure {
        return Err(e);
    }
    drop(acquired);
    // Fewest accumulation steps the largest batch allows, then the smallest
    // micro-batch that still covers the effective batch with them.
    let grad_accum = result
        .recommended_batch
        .map(|b| opts.effective.map_or(1, |e| e.div_ceil(b)));
    let micro_batch_for_effective = match (opts.effective, grad_accum, result.recommended_batch) {
        (Some(e), Some(a), Some(_)) => Some(e.div_ceil(a)),
        (None, _, b) => b,
        _ => None,
    };
    Ok(FindBatchReport {
        trials: reports,
        recommended_batch: result.recommended_batch,
        grad_accum,
        micro_batch_for_effective,
        effective_batch: opts.effective,
        capacity_bytes: capacity,
        budget_bytes: cfg.budget(),
        margin: opts.margin,
        gpu: gpu.map(|g| g.index),
        fixed_bytes: result.fixed_bytes,
        per_sample_bytes: result.per_sample_bytes,
        method: result.method,
    })
}
