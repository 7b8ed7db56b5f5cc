//! `oomkit find-batch`: runs the command at chosen micro-batches and reports
//! the largest that fits, measuring each run's peak from the tracker's probe
//! file or, without one, by sampling the GPU.

use crate::child::{self, Spec};
use crate::child_env;
use crate::search::{search, SearchConfig, SearchResult, Trial};
use crate::{fill_placeholders, BatchPlan, SuperviseError};
use oomkit_gpu::host;
use oomkit_gpu::procinfo::process_group;
use oomkit_gpu::{acquire, probe, ClaimDir, Gpu, GpuError, Request, Wait};
use oomkit_units::human_bytes;
use serde::Serialize;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How often the GPU (or, without one, the command's resident memory) is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// A fitted line is reported only where it passes within this share of every
/// peak it was fitted to: a curve that is not a line (a cliff, steps of the
/// allocator's rounding) has no fixed part and slope worth stating.
const FIT_TOLERANCE: f64 = 0.10;

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
    /// Where the peak came from: "probe" (the tracker), "nvml" (the GPU,
    /// sampled), "rss" (the command's resident memory, read from outside),
    /// or null where none was measured (a run that failed).
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
    /// Where the capacity came from: "capacity_flag" (`--capacity`), "gpu_free" (the chosen GPU's free memory) or
    /// "process_cap" (less than that: the cap a trial's OOM message gave, `set_per_process_memory_fraction`'s "N allowed").
    pub capacity_source: &'static str,
    /// What the peaks measure: "gpu" (the chosen GPU's memory) or "host" (the command's resident memory, with no GPU chosen).
    pub measured_on: &'static str,
    /// Capacity less the margin.
    pub budget_bytes: u64,
    /// The margin used.
    pub margin: f64,
    /// The GPU the runs used, if one was chosen.
    pub gpu: Option<u32>,
    /// The fixed memory of the line fitted (least squares) to every measured
    /// peak of a run that finished; null with fewer than two batches measured,
    /// or where the line misses a measured peak by more than 10%.
    pub fixed_bytes: Option<f64>,
    /// The memory per sample of that line.
    pub per_sample_bytes: Option<f64>,
    /// The batches whose peaks the line was fitted to.
    pub fit_batches: Vec<u64>,
    /// The largest miss of the line at a measured peak, as a share of that peak.
    pub fit_max_error: Option<f64>,
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
    let acquired = take_gpu(opts, say)?;
    let gpu = acquired.as_ref().and_then(|a| a.gpus.first().cloned());
    let mut capacity = match (opts.capacity, &gpu) {
        (Some(c), _) => c,
        (None, Some(g)) => g.free_bytes,
        // Only reachable if a successful acquire returned no GPU.
        (None, None) => {
            return Err(SuperviseError::Usage(
                "no GPU was chosen and no --capacity given".into(),
            ))
        }
    };
    let mut cfg = SearchConfig {
        start: opts.start,
        max: opts.max,
        capacity_bytes: capacity,
        margin: opts.margin,
        exact: false,
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
    let mut runs = Runs::default();
    let mut result: SearchResult =
        search(&cfg, &mut |b| runs.run(opts, gpu.as_ref(), &cfg, b, say));
    if let Some(c) = runs
        .cap
        .filter(|&c| c < capacity && opts.capacity.is_none())
    {
        // The process may hold less than the GPU has free: the budget was
        // wrong, so the search runs again within the cap, its runs reused.
        capacity = c;
        cfg.capacity_bytes = c;
        say(&format!(
            "a trial's OOM message says the process may hold {} (set_per_process_memory_fraction), less than the GPU's {} free: searching again within {} ({:.0}% margin), with the runs so far",
            human_bytes(c),
            human_bytes(gpu.as_ref().map_or(c, |g| g.free_bytes)),
            human_bytes(cfg.budget()),
            opts.margin * 100.0
        ));
        let budget = cfg.budget();
        for r in runs.reports.iter_mut() {
            r.ok = !r.oom && r.peak_bytes.is_some_and(|p| p <= budget);
        }
        result = search(&cfg, &mut |b| runs.run(opts, gpu.as_ref(), &cfg, b, say));
    }
    let Runs {
        reports, failure, ..
    } = runs;
    if let Some(e) = failure {
        return Err(e);
    }
    let fit = fit_line(&reports);
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
        gpu: gpu.as_ref().map(|g| g.index),
        capacity_source: if opts.capacity.is_some() {
            "capacity_flag"
        } else if gpu.as_ref().is_some_and(|g| capacity < g.free_bytes) {
            "process_cap"
        } else {
            "gpu_free"
        },
        measured_on: if gpu.is_some() { "gpu" } else { "host" },
        fixed_bytes: fit.as_ref().map(|f| f.fixed),
        per_sample_bytes: fit.as_ref().map(|f| f.per_sample),
        fit_batches: fit.as_ref().map(|f| f.batches.clone()).unwrap_or_default(),
        fit_max_error: fit.as_ref().map(|f| f.max_error),
        method: result.method,
    })
}

/// The runs of a search so far, what their OOM messages said, and the error that ended it, if any.
#[derive(Default)]
struct Runs {
    reports: Vec<TrialReport>,
    /// The least cap a run's OOM message gave ("N allowed").
    cap: Option<u64>,
    failure: Option<SuperviseError>,
}

impl Runs {
    /// One trial at micro-batch `b`, or the one already run at it (a search
    /// again within a cap reuses the runs); a failure to run ends the search.
    fn run(
        &mut self,
        opts: &FindBatchOptions,
        gpu: Option<&Gpu>,
        cfg: &SearchConfig,
        b: u64,
        say: &mut dyn FnMut(&str),
    ) -> Trial {
        let failed = Trial {
            batch: b,
            ok: false,
            oom: true,
            peak_bytes: None,
        };
        if let Some(r) = self.reports.iter().find(|r| r.batch == b) {
            return Trial {
                batch: b,
                ok: r.ok,
                oom: r.oom,
                peak_bytes: r.peak_bytes,
            };
        }
        if self.failure.is_some() {
            return failed;
        }
        match trial(opts, gpu, cfg.budget(), b, self.reports.len() + 1, say) {
            Ok((t, report, allowed)) => {
                self.reports.push(report);
                if let Some(a) = allowed {
                    self.cap = Some(self.cap.map_or(a, |c| c.min(a)));
                }
                t
            }
            Err(e) => {
                self.failure = Some(e);
                failed
            }
        }
    }
}

/// The GPU the trials run on, claimed; `None` where there is none and `--capacity` was given.
fn take_gpu(
    opts: &FindBatchOptions,
    say: &mut dyn FnMut(&str),
) -> Result<Option<oomkit_gpu::Acquired>, SuperviseError> {
    let req = Request {
        count: 1,
        min_free: None,
        exclude: Vec::new(),
    };
    match acquire(&req, &opts.claims, opts.wait, &mut |m| say(m), &|| false) {
        Ok(a) => Ok(Some(a)),
        Err(e) if e.is_absent() && opts.capacity.is_some() => Ok(None),
        Err(e) if e.is_absent() => Err(GpuError::Unsatisfiable(format!(
            "{e}; give --capacity to search against a stated memory size"
        ))
        .into()),
        Err(e) => Err(e.into()),
    }
}

/// Runs the command once at micro-batch `b` (trial `n`), measures its peak,
/// and says how it went, with the cap its OOM message gave, if any; an error
/// ends the search (a command that cannot start, a signal, or a run that
/// finished with nothing measured).
fn trial(
    opts: &FindBatchOptions,
    gpu: Option<&Gpu>,
    budget: u64,
    b: u64,
    n: usize,
    say: &mut dyn FnMut(&str),
) -> Result<(Trial, TrialReport, Option<u64>), SuperviseError> {
    let probe_path =
        std::env::temp_dir().join(format!("oomkit-probe-{}-{n}.json", std::process::id()));
    let _ = std::fs::remove_file(&probe_path);
    // The tracker records the OOMs it sees here, as under `oomkit run`.
    let events_path =
        std::env::temp_dir().join(format!("oomkit-events-{}-{n}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&events_path);
    let baseline = gpu
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
        (
            child_env::EVENTS_FILE.into(),
            events_path.clone().into_os_string(),
        ),
    ];
    if let Some(g) = gpu {
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
        data_limit: None,
    };
    let mut sampled: Option<u64> = None;
    let mut last = Instant::now() - SAMPLE_EVERY;
    let gpu_index = gpu.map(|g| g.index);
    let out = child::run(&spec, &mut |pgid| {
        if last.elapsed() >= SAMPLE_EVERY {
            last = Instant::now();
            let s = match gpu_index {
                Some(idx) => sample(idx, pgid, baseline),
                // Every process of the command's group: DataLoader workers hold host memory too.
                None => Some(host::group_rss_bytes(pgid)).filter(|b| *b > 0),
            };
            if let Some(s) = s {
                sampled = Some(sampled.unwrap_or(0).max(s));
            }
        }
    })?;
    if let Some(sig) = out.interrupted_by {
        return Err(SuperviseError::Interrupted(sig));
    }
    let probed = read_probe(&probe_path);
    let _ = std::fs::remove_file(&probe_path);
    let events = crate::events::read(&events_path);
    let _ = std::fs::remove_file(&events_path);
    let (peak, source) = measured_peak(gpu.is_some(), probed, sampled, out.max_rss_bytes);
    let ran = out.exit_code == 0;
    let memory = out.oom_line.is_some() || !events.ooms.is_empty() || out.oom_kill.is_some();
    if !ran && !memory {
        // Not a memory failure: the batch says nothing about what fits, and
        // every other batch would fail the same way.
        return Err(SuperviseError::CommandFailed {
            what: format!("trial {n} (micro-batch {b})"),
            exit_code: out.exit_code,
            error: out.error_line.clone(),
        });
    }
    if ran && peak.is_none() {
        // A run that finished with no figure says nothing about the budget.
        return Err(SuperviseError::Unmeasured(format!(
            "trial {n} (micro-batch {b}) finished, but no peak was measured: NVML saw none of its memory and the command wrote no probe; add an oomkit.Tracker to the training script (it writes the peak to $OOMKIT_PROBE_FILE), or run it longer than {} ms, so that find-batch has a figure to compare with the budget",
            SAMPLE_EVERY.as_millis()
        )));
    }
    let fits_budget = peak.is_some_and(|p| p <= budget);
    let t = Trial {
        batch: b,
        ok: ran && fits_budget,
        oom: !ran,
        peak_bytes: peak,
    };
    let verdict = if !ran && out.oom_kill.is_some() && out.oom_line.is_none() {
        "killed by the kernel's OOM killer".to_string()
    } else if !ran {
        "out of memory".to_string()
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
    let report = TrialReport {
        batch: b,
        ok: t.ok,
        oom: t.oom,
        peak_bytes: peak,
        peak_source: source,
        exit_code: out.exit_code,
        seconds: out.duration.as_secs_f64(),
    };
    let allowed = out.oom_line.as_deref().and_then(|line| {
        let kind = crate::oom::detect(line)?;
        crate::oom::parse_message(kind, line).allowed_bytes
    });
    Ok((t, report, allowed))
}

/// A trial's peak and where it came from: on a GPU the tracker's probe, else
/// NVML's samples; without one the command's host memory, read from outside
/// (the group's resident sets, sampled, and the kernel's own peak at exit),
/// or the tracker's own figure where it is higher.
fn measured_peak(
    on_gpu: bool,
    probed: Option<u64>,
    sampled: Option<u64>,
    max_rss: Option<u64>,
) -> (Option<u64>, Option<&'static str>) {
    if on_gpu {
        return match probed {
            Some(p) => (Some(p), Some("probe")),
            None => (sampled, sampled.map(|_| "nvml")),
        };
    }
    match (probed, sampled.max(max_rss)) {
        (Some(p), Some(r)) if p > r => (Some(p), Some("probe")),
        (_, Some(r)) => (Some(r), Some("rss")),
        (Some(p), None) => (Some(p), Some("probe")),
        (None, None) => (None, None),
    }
}

/// A line through the measured peaks, with the batches it rests on and how far it misses them.
struct Fit {
    fixed: f64,
    per_sample: f64,
    batches: Vec<u64>,
    max_error: f64,
}

/// The least-squares line through the peaks of the runs that finished, where
/// two batches or more were measured and the line passes within
/// [`FIT_TOLERANCE`] of every one of them; a run that ran out of memory
/// stopped where it died, so its peak is not what its batch needs.
fn fit_line(trials: &[TrialReport]) -> Option<Fit> {
    let pts: Vec<(f64, f64)> = trials
        .iter()
        .filter(|t| !t.oom)
        .filter_map(|t| Some((t.batch as f64, t.peak_bytes? as f64)))
        .collect();
    let mut batches: Vec<u64> = pts.iter().map(|p| p.0 as u64).collect();
    batches.sort_unstable();
    batches.dedup();
    if batches.len() < 2 {
        return None;
    }
    let n = pts.len() as f64;
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let per_sample = sxy / sxx;
    let fixed = my - per_sample * mx;
    let max_error = pts
        .iter()
        .map(|&(b, p)| ((fixed + per_sample * b) - p).abs() / p.max(1.0))
        .fold(0.0, f64::max);
    (max_error <= FIT_TOLERANCE && per_sample.is_finite()).then_some(Fit {
        fixed,
        per_sample,
        batches,
        max_error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial(batch: u64, peak: u64, oom: bool) -> TrialReport {
        TrialReport {
            batch,
            ok: !oom,
            oom,
            peak_bytes: Some(peak),
            peak_source: Some("rss"),
            exit_code: if oom { 1 } else { 0 },
            seconds: 0.0,
        }
    }

    #[test]
    fn the_line_rests_on_every_finished_run_and_misses_none() {
        let mib = 1u64 << 20;
        let line: Vec<TrialReport> = [1, 2, 8, 30]
            .iter()
            .map(|&b| trial(b, 700 * mib + 20 * mib * b, false))
            .chain([trial(64, 5 * mib, true)])
            .collect();
        let f = fit_line(&line).expect("a line");
        assert!((f.per_sample - (20 * mib) as f64).abs() < 1.0);
        assert!((f.fixed - (700 * mib) as f64).abs() < 16.0);
        // The run that died at batch 64 stopped where it died: not a point of the line.
        assert_eq!(f.batches, vec![1, 2, 8, 30]);
        // A step is no line: the best line through it misses the flat part by 46%.
        let cliff = vec![
            trial(1, 700 * mib, false),
            trial(8, 700 * mib, false),
            trial(9, 1400 * mib, false),
            trial(16, 1400 * mib, false),
        ];
        assert!(fit_line(&cliff).is_none());
        assert!(fit_line(&[trial(4, 800 * mib, false)]).is_none());
    }
}
