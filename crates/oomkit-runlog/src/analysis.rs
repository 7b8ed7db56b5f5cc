//! What a run log says: stage table, leaks, eval spikes, gradients, components.

use crate::record::{Components, MeasureKind, Plan, Run};
use oomkit_advice::Cause;
use oomkit_snapshot::human_bytes;
use serde::Serialize;
use std::collections::BTreeMap;

/// Memory statistics of one stage, phase, or of whole steps.
#[derive(Clone, Debug, Serialize)]
pub struct StageStats {
    /// `stage`, `step` or `phase`.
    pub kind: MeasureKind,
    /// `forward`, `backward`, `optimizer`, `step`, or the phase's name.
    pub name: String,
    /// How many times it ran.
    pub count: u64,
    /// Mean of its peaks.
    pub mean_peak_bytes: u64,
    /// Largest peak.
    pub max_peak_bytes: u64,
    /// Mean of end minus start: what it leaves allocated (negative: frees).
    pub mean_delta_bytes: i64,
    /// Mean of peak minus start: what it needs on top of what was there.
    pub mean_rise_bytes: u64,
    /// Mean wall time in seconds.
    pub mean_seconds: f64,
}

/// The stage that needs the most memory on top of what was there when it began.
#[derive(Clone, Debug, Serialize)]
pub struct StageGrowth {
    /// Its kind.
    pub kind: MeasureKind,
    /// Its name.
    pub name: String,
    /// Mean of peak minus start.
    pub mean_rise_bytes: u64,
    /// Share of the step's peak it accounts for, 0 to 1.
    pub share_of_peak: f64,
}

/// Sustained growth of end-of-step memory.
#[derive(Clone, Debug, Serialize)]
pub struct Leak {
    /// Bytes added per step (least-squares slope).
    pub bytes_per_step: f64,
    /// R² of the linear fit, 0 to 1.
    pub confidence: f64,
    /// First step of the fitted window (after warm-up).
    pub first_step: u64,
    /// Last step of the window.
    pub last_step: u64,
    /// Memory at the end of the first step of the window.
    pub start_bytes: u64,
    /// Memory at the end of the last step.
    pub end_bytes: u64,
    /// The step at which the device would be full at this rate, when its capacity is known.
    pub full_at_step: Option<u64>,
}

/// One OOM, as the log recorded it.
#[derive(Clone, Debug, Serialize)]
pub struct OomSummary {
    /// When it happened, seconds since the epoch, if the log says.
    pub time: Option<f64>,
    /// The step.
    pub step: Option<u64>,
    /// The stage or phase that was running.
    pub stage: Option<String>,
    /// Bytes the failed allocation asked for.
    pub requested_bytes: Option<u64>,
    /// Bytes held by tensors then.
    pub allocated_bytes: u64,
    /// Bytes reserved by the allocator then.
    pub reserved_bytes: u64,
    /// Why it failed, decided from the allocator's figures as `oomkit explain` decides it.
    pub cause: Cause,
    /// The snapshot dumped at the OOM, if any.
    pub snapshot: Option<String>,
}

/// A conclusion with its evidence and what to change.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// Stable identifier; see the README for the vocabulary.
    pub kind: &'static str,
    /// What was found, with numbers.
    pub message: String,
    /// What to change.
    pub advice: String,
    /// The bytes at stake, where they apply.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Bytes added per step, for leaks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_step: Option<f64>,
    /// The step it concerns, where one does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
}

/// A limit of the evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Warning {
    /// Stable identifier.
    pub kind: &'static str,
    /// What is missing or doubtful.
    pub message: String,
}

/// Everything oomkit concludes from one run log.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// Always `run`, to tell it from a snapshot's analysis.
    pub kind: &'static str,
    /// Steps recorded.
    pub steps: u64,
    /// Rank of the process that wrote the log.
    pub rank: u32,
    /// `cuda:N` or `cpu`.
    pub device: String,
    /// Device capacity in bytes, when known.
    pub capacity_bytes: Option<u64>,
    /// Largest step peak.
    pub peak_bytes: u64,
    /// The most bytes the allocator held reserved at the end of any stage, step or phase (0 on CPU).
    pub peak_reserved_bytes: u64,
    /// Per stage, step and phase.
    pub stages: Vec<StageStats>,
    /// The stage that needs the most on top of what was there.
    pub largest_growth: Option<StageGrowth>,
    /// Sustained growth across steps, when found.
    pub leak: Option<Leak>,
    /// The latest component count.
    pub components: Option<Components>,
    /// Gradient checks that found NaN or Inf.
    pub grad_nonfinite_checks: u64,
    /// OOMs.
    pub ooms: Vec<OomSummary>,
    /// The latest batch plan an integration recorded, or null.
    pub plan: Option<Plan>,
    /// Conclusions, most urgent first.
    pub findings: Vec<Finding>,
    /// Limits of the evidence.
    pub warnings: Vec<Warning>,
}

const MIB: u64 = 1 << 20;

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0u64), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Fits y = a + b·x by least squares; returns (slope, R²).
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let mx = mean(points.iter().map(|p| p.0));
    let my = mean(points.iter().map(|p| p.1));
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    if sxx == 0.0 {
        return (0.0, 0.0);
    }
    let slope = sxy / sxx;
    let r2 = if syy == 0.0 {
        0.0
    } else {
        (sxy * sxy) / (sxx * syy)
    };
    (slope, r2)
}

/// Least steps after warm-up for a leak verdict.
const LEAK_MIN_STEPS: usize = 6;
/// Least R² for a leak verdict: the growth must be steady, not noise.
const LEAK_MIN_R2: f64 = 0.8;

fn leak(run: &Run, capacity: Option<u64>) -> Option<Leak> {
    let steps: Vec<(u64, u64)> = run
        .steps()
        .enumerate()
        .map(|(i, m)| (m.step.unwrap_or(i as u64), m.end_bytes))
        .collect();
    // The first steps allocate gradients and optimizer state for good.
    let warmup = (steps.len() / 10).max(2);
    let window = steps.get(warmup..)?;
    if window.len() < LEAK_MIN_STEPS {
        return None;
    }
    let pts: Vec<(f64, f64)> = window.iter().map(|&(s, b)| (s as f64, b as f64)).collect();
    let (slope, r2) = fit(&pts);
    let (first, last) = (window[0], window[window.len() - 1]);
    let growth = last.1.saturating_sub(first.1);
    let level = window.iter().map(|w| w.1).max().unwrap_or(0);
    if slope <= 0.0 || r2 < LEAK_MIN_R2 || growth < MIB || growth * 100 < level {
        return None;
    }
    let full_at_step = capacity.map(|c| {
        let left = c.saturating_sub(last.1) as f64;
        last.0 + (left / slope).ceil() as u64
    });
    Some(Leak {
        bytes_per_step: slope,
        confidence: r2,
        first_step: first.0,
        last_step: last.0,
        start_bytes: first.1,
        end_bytes: last.1,
        full_at_step,
    })
}

fn stage_table(run: &Run) -> Vec<StageStats> {
    let mut groups: BTreeMap<(MeasureKind, String), Vec<&crate::record::Measure>> = BTreeMap::new();
    for (k, m) in &run.measures {
        groups.entry((*k, m.name.clone())).or_default().push(m);
    }
    let order = |name: &str| match name {
        "forward" => 0,
        "backward" => 1,
        "optimizer" => 2,
        _ => 3,
    };
    let mut v: Vec<StageStats> = groups
        .into_iter()
        .map(|((kind, name), ms)| StageStats {
            kind,
            count: ms.len() as u64,
            mean_peak_bytes: mean(ms.iter().map(|m| m.peak_bytes as f64)) as u64,
            max_peak_bytes: ms.iter().map(|m| m.peak_bytes).max().unwrap_or(0),
            mean_delta_bytes: mean(ms.iter().map(|m| m.end_bytes as f64 - m.start_bytes as f64))
                as i64,
            mean_rise_bytes: mean(
                ms.iter()
                    .map(|m| m.peak_bytes.saturating_sub(m.start_bytes) as f64),
            ) as u64,
            mean_seconds: mean(ms.iter().map(|m| m.seconds)),
            name,
        })
        .collect();
    v.sort_by_key(|s| (s.kind, order(&s.name), s.name.clone()));
    v
}

fn cause(requested: Option<u64>, allocated: u64, reserved: u64, capacity: Option<u64>) -> Cause {
    oomkit_advice::decide(&oomkit_advice::Figures {
        requested,
        capacity,
        reserved_unallocated: Some(reserved.saturating_sub(allocated)),
        ..Default::default()
    })
}

/// A phase must peak this much above the training before it to be a spike:
/// 10% is above the step-to-step noise of the allocator and of RSS, which
/// the tracker sees at stage boundaries only.
const EVAL_SPIKE_RATIO: f64 = 1.1;
/// ... and by at least this many bytes, so tiny runs do not report noise.
const EVAL_SPIKE_MIN_BYTES: u64 = MIB;

/// The worst occurrence of a phase that peaked above the training before it.
struct Spike<'r> {
    name: &'r str,
    peak: u64,
    baseline: u64,
    step: Option<u64>,
}

/// Each phase's worst spike above the training peak *before* it.
///
/// Comparing with the all-time training peak would miss the bug it looks
/// for: memory an eval phase keeps stays counted in the steps after it
/// (the caching allocator keeps its reserve on CUDA, glibc keeps the RSS on
/// CPU), so the later steps' peaks already include the spike. A phase that
/// runs before any training is compared with the whole run's training peak.
fn eval_spikes(run: &Run, train_peak: u64) -> Vec<Spike<'_>> {
    let mut so_far = 0u64;
    let mut worst: BTreeMap<&str, Spike<'_>> = BTreeMap::new();
    for (kind, m) in &run.measures {
        if *kind != MeasureKind::Phase {
            so_far = so_far.max(m.peak_bytes);
            continue;
        }
        let baseline = if so_far > 0 { so_far } else { train_peak };
        if baseline == 0
            || m.peak_bytes < baseline + EVAL_SPIKE_MIN_BYTES
            || (m.peak_bytes as f64) <= baseline as f64 * EVAL_SPIKE_RATIO
        {
            continue;
        }
        let over = m.peak_bytes - baseline;
        let e = worst.entry(&m.name).or_insert(Spike {
            name: &m.name,
            peak: baseline,
            baseline,
            step: m.step,
        });
        if over > e.peak - e.baseline {
            *e = Spike {
                name: &m.name,
                peak: m.peak_bytes,
                baseline,
                step: m.step,
            };
        }
    }
    worst.into_values().collect()
}

/// Analyzes a run log.
pub fn analyze(run: &Run) -> Analysis {
    let start = run.start.clone().unwrap_or_default();
    let cuda = start.device.starts_with("cuda");
    let capacity = start.capacity_bytes.filter(|&c| c > 0);
    let stages = stage_table(run);
    let step_peak = run.steps().map(|m| m.peak_bytes).max().unwrap_or(0);
    let train_peak = run
        .measures
        .iter()
        .filter(|(k, _)| *k != MeasureKind::Phase)
        .map(|(_, m)| m.peak_bytes)
        .max()
        .unwrap_or(0);
    let largest_growth = stages
        .iter()
        .filter(|s| s.kind != MeasureKind::Step)
        .max_by_key(|s| s.mean_rise_bytes)
        .map(|s| StageGrowth {
            kind: s.kind,
            name: s.name.clone(),
            mean_rise_bytes: s.mean_rise_bytes,
            share_of_peak: if train_peak > 0 {
                s.mean_rise_bytes as f64 / train_peak as f64
            } else {
                0.0
            },
        });
    let components = run
        .components
        .last()
        .cloned()
        .or_else(|| run.start.as_ref().map(|s| s.components.clone()));
    let leak = leak(run, capacity);
    let ooms: Vec<OomSummary> = run
        .ooms
        .iter()
        .map(|o| OomSummary {
            time: o.time,
            step: o.step,
            stage: o.stage.clone().or_else(|| o.phase.clone()),
            requested_bytes: o.requested_bytes,
            allocated_bytes: o.memory.allocated_bytes,
            reserved_bytes: o.memory.reserved_bytes,
            cause: cause(
                o.requested_bytes,
                o.memory.allocated_bytes,
                o.memory.reserved_bytes,
                o.memory.capacity_bytes,
            ),
            snapshot: o.snapshot.clone(),
        })
        .collect();

    let mut findings = Vec::new();
    for o in &ooms {
        findings.push(oom_finding(o, &start.device));
    }
    if let Some(l) = &leak {
        let full = match l.full_at_step {
            Some(s) => format!("; at this rate the device is full at step {s}"),
            None => String::new(),
        };
        findings.push(Finding {
            kind: "leak",
            message: format!(
                "end-of-step memory grows by {}/step from step {} to {} ({} -> {}, R² {:.2}){full}",
                human_bytes(l.bytes_per_step as u64),
                l.first_step,
                l.last_step,
                human_bytes(l.start_bytes),
                human_bytes(l.end_bytes),
                l.confidence
            ),
            advice: "something keeps tensors from each step alive: a list that collects losses or \
                     outputs without .item() or .detach() keeps every step's autograd graph; \
                     accumulate `loss.item()` or `loss.detach()` instead"
                .into(),
            bytes: Some(l.end_bytes.saturating_sub(l.start_bytes)),
            bytes_per_step: Some(l.bytes_per_step),
            step: Some(l.last_step),
        });
    }
    if let Some(d) = run
        .duplicates
        .iter()
        .filter(|d| d.bytes > 0)
        .max_by_key(|d| d.bytes)
    {
        let groups: Vec<String> = d
            .groups
            .iter()
            .map(|g| {
                format!(
                    "{} tensors of {} on {} ({}, mirroring {} of {} parameters)",
                    g.tensors,
                    g.dtype,
                    g.device,
                    human_bytes(g.bytes),
                    g.params_matched,
                    g.params_total
                )
            })
            .collect();
        findings.push(Finding {
            kind: "duplicate_copy",
            message: format!(
                "{} of live tensors mirror the model's parameters but belong to no tracked module, \
                 optimizer or gradient: {}",
                human_bytes(d.bytes),
                groups.join("; ")
            ),
            advice: "a second copy of the model is alive, typically the fp32 original kept after \
                     `model.to(torch.bfloat16)` or a copy made for EMA or evaluation; drop the \
                     reference (`del`) or convert in place"
                .into(),
            bytes: Some(d.bytes),
            bytes_per_step: None,
            step: d.step,
        });
    }
    for spike in eval_spikes(run, train_peak) {
        findings.push(Finding {
            kind: "eval_spike",
            message: format!(
                "phase '{}' peaks at {}, {} above the training peak of {} before it",
                spike.name,
                human_bytes(spike.peak),
                human_bytes(spike.peak - spike.baseline),
                human_bytes(spike.baseline)
            ),
            advice: "run it under `torch.no_grad()` (or `torch.inference_mode()`), move \
                     outputs you keep to the CPU, and chunk long generations or large eval \
                     batches"
                .into(),
            bytes: Some(spike.peak - spike.baseline),
            bytes_per_step: None,
            step: spike.step,
        });
    }
    let nonfinite: Vec<_> = run
        .grads
        .iter()
        .filter(|g| g.nan_params + g.inf_params > 0)
        .collect();
    if let Some(first) = nonfinite.first() {
        findings.push(Finding {
            kind: "grad_nonfinite",
            message: format!(
                "{} of {} gradient checks found non-finite gradients, first at step {} \
                 ({} parameters with NaN, {} with Inf)",
                nonfinite.len(),
                run.grads.len(),
                first.step,
                first.nan_params,
                first.inf_params
            ),
            advice: "lower the learning rate or clip gradients (`clip_grad_norm_`), use bf16 or a \
                     GradScaler with fp16, and look for log/sqrt/division of values that can be zero"
                .into(),
            bytes: None,
            bytes_per_step: None,
            step: Some(first.step),
        });
    }
    grad_spike(run, &mut findings);
    if let Some(c) = &components {
        component_findings(c, cuda, train_peak, capacity, run, &mut findings);
    }
    findings.sort_by_key(|f| rank(f.kind));

    let mut warnings = Vec::new();
    if run.start.is_none() {
        warnings.push(Warning {
            kind: "no_start",
            message: "the log has no 'start' record: device, capacity and components are unknown"
                .into(),
        });
    }
    if run.torn_last_line {
        warnings.push(Warning {
            kind: "torn_last_line",
            message: "the last line was cut short: the process was killed while writing it".into(),
        });
    } else if !run.closed && run.ooms.is_empty() {
        warnings.push(Warning {
            kind: "not_closed",
            message: "the log has no 'end' record: the run is still going, crashed, or \
                      tracker.close() was not called"
                .into(),
        });
    }
    if !run.tracker_errors.is_empty() {
        warnings.push(Warning {
            kind: "tracker_errors",
            message: format!(
                "the tracker caught {} error(s) of its own, first: {}",
                run.tracker_errors.len(),
                run.tracker_errors[0]
            ),
        });
    }
    if !cuda && !start.device.is_empty() {
        warnings.push(Warning {
            kind: "cpu_memory",
            message: "on CPU, memory is the process's resident set (RSS), which also holds \
                      Python, libraries and the allocator's caches"
                .into(),
        });
    }
    Analysis {
        kind: "run",
        steps: run.steps().count() as u64,
        rank: start.rank,
        device: start.device.clone(),
        capacity_bytes: capacity,
        peak_bytes: step_peak,
        peak_reserved_bytes: run
            .measures
            .iter()
            .map(|(_, m)| m.reserved_bytes)
            .max()
            .unwrap_or(0),
        stages,
        largest_growth,
        leak,
        components,
        grad_nonfinite_checks: nonfinite.len() as u64,
        ooms,
        plan: run.plans.last().cloned(),
        findings,
        warnings,
    }
}

fn rank(kind: &str) -> usize {
    [
        "oom",
        "leak",
        "duplicate_copy",
        "eval_spike",
        "grad_nonfinite",
        "grad_spike",
        "activations_dominate",
        "optimizer_state_large",
        "grads_held_between_steps",
        "ema_on_device",
    ]
    .iter()
    .position(|k| *k == kind)
    .unwrap_or(usize::MAX)
}

fn oom_finding(o: &OomSummary, device: &str) -> Finding {
    let asked = o
        .requested_bytes
        .map(|r| format!("asking for {}", human_bytes(r)))
        .unwrap_or_else(|| "request size unknown".into());
    let where_ = match (&o.stage, o.step) {
        (Some(s), Some(n)) => format!("in {s} of step {n}"),
        (Some(s), None) => format!("in {s}"),
        (None, Some(n)) => format!("in step {n}"),
        (None, None) => "outside any step".into(),
    };
    let advice = if o.cause == Cause::Fragmentation {
        "the allocator had enough reserved but unallocated memory in pieces too small: set \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            .to_string()
    } else {
        match o.stage.as_deref() {
            Some("forward" | "backward") => "activations do not fit: halve the micro-batch and \
                 double gradient accumulation (`oomkit run` does this and keeps the effective \
                 batch), enable gradient checkpointing, or train in bf16/AMP"
                .into(),
            Some("optimizer") => "the optimizer step does not fit: 8-bit optimizer states \
                 (bitsandbytes) or a fused/foreach=False step lower its peak"
                .into(),
            Some(_) => "this phase does not fit: run it under torch.no_grad(), use a smaller \
                 eval batch, and chunk generation"
                .into(),
            None => "reduce the micro-batch and raise gradient accumulation".into(),
        }
    };
    Finding {
        kind: "oom",
        message: format!(
            "out of memory on {} {where_}, {asked}, with {} allocated and {} reserved ({})",
            if device.is_empty() {
                "the device"
            } else {
                device
            },
            human_bytes(o.allocated_bytes),
            human_bytes(o.reserved_bytes),
            o.cause
        ),
        advice,
        bytes: o.requested_bytes,
        bytes_per_step: None,
        step: o.step,
    }
}

fn grad_spike(run: &Run, findings: &mut Vec<Finding>) {
    let mut norms: Vec<f64> = run
        .grads
        .iter()
        .filter_map(|g| g.total_norm)
        .filter(|n| n.is_finite())
        .collect();
    if norms.len() < 5 {
        return;
    }
    norms.sort_by(f64::total_cmp);
    let median = norms[norms.len() / 2];
    if median <= 0.0 {
        return;
    }
    let spike = run
        .grads
        .iter()
        .filter(|g| {
            g.total_norm
                .is_some_and(|n| n.is_finite() && n > 10.0 * median)
        })
        .max_by(|a, b| {
            a.total_norm
                .unwrap_or(0.0)
                .total_cmp(&b.total_norm.unwrap_or(0.0))
        });
    if let Some(g) = spike {
        findings.push(Finding {
            kind: "grad_spike",
            message: format!(
                "gradient norm {:.4} at step {} is {:.0}x the median {:.4}",
                g.total_norm.unwrap_or(0.0),
                g.step,
                g.total_norm.unwrap_or(0.0) / median,
                median
            ),
            advice: "clip gradients (`torch.nn.utils.clip_grad_norm_`) and check that batch for \
                     outliers"
                .into(),
            bytes: None,
            bytes_per_step: None,
            step: Some(g.step),
        });
    }
}

fn component_findings(
    c: &Components,
    cuda: bool,
    train_peak: u64,
    capacity: Option<u64>,
    run: &Run,
    findings: &mut Vec<Finding>,
) {
    let base = capacity.unwrap_or(train_peak).max(1);
    let pct = |b: u64| 100.0 * b as f64 / base as f64;
    let against = if capacity.is_some() {
        "of the device"
    } else {
        "of the peak"
    };
    if c.optimizer_state_bytes > 0
        && (c.optimizer_state_bytes * 10 >= base * 3
            || c.optimizer_state_bytes >= 2 * c.params_bytes.max(1))
        && cuda
    {
        findings.push(Finding {
            kind: "optimizer_state_large",
            message: format!(
                "optimizer state holds {} ({:.0}% {against}), {:.1}x the parameters",
                human_bytes(c.optimizer_state_bytes),
                pct(c.optimizer_state_bytes),
                c.optimizer_state_bytes as f64 / c.params_bytes.max(1) as f64
            ),
            advice: "8-bit optimizer states (bitsandbytes AdamW8bit) cut them about 4x; ZeRO/FSDP \
                     shards them across ranks"
                .into(),
            bytes: Some(c.optimizer_state_bytes),
            bytes_per_step: None,
            step: c.step,
        });
    }
    if c.ema_bytes > 0
        && c.ema_device
            .as_deref()
            .is_some_and(|d| d.starts_with("cuda"))
    {
        findings.push(Finding {
            kind: "ema_on_device",
            message: format!(
                "the EMA copy holds {} ({:.0}% {against}) on {}",
                human_bytes(c.ema_bytes),
                pct(c.ema_bytes),
                c.ema_device.as_deref().unwrap_or("")
            ),
            advice: "keep the EMA on the CPU and update it every few steps, or in bf16".into(),
            bytes: Some(c.ema_bytes),
            bytes_per_step: None,
            step: c.step,
        });
    }
    if !cuda || train_peak == 0 {
        // Resident memory on CPU holds far more than tensors, so what is
        // left after the components says nothing about activations.
        return;
    }
    let fixed = c.params_bytes + c.buffers_bytes + c.optimizer_state_bytes + c.ema_bytes;
    let activations = train_peak.saturating_sub(fixed + c.trainable_bytes);
    if activations * 2 >= train_peak {
        findings.push(Finding {
            kind: "activations_dominate",
            message: format!(
                "activations and temporaries take about {} of the {} peak ({:.0}%): peak minus \
                 parameters, gradients, optimizer state, buffers and EMA",
                human_bytes(activations),
                human_bytes(train_peak),
                100.0 * activations as f64 / train_peak as f64
            ),
            advice: "halve the micro-batch and double gradient accumulation, enable gradient \
                     checkpointing, or use bf16/AMP autocast"
                .into(),
            bytes: Some(activations),
            bytes_per_step: None,
            step: None,
        });
    }
    // With set_to_none=True, a step starts without gradients.
    let starts: Vec<u64> = run.steps().skip(2).map(|m| m.start_bytes).collect();
    if let Some(&low) = starts.iter().min() {
        let held = low.saturating_sub(fixed);
        if c.trainable_bytes >= 16 * MIB && held * 10 >= c.trainable_bytes * 9 {
            findings.push(Finding {
                kind: "grads_held_between_steps",
                message: format!(
                    "every step starts with {} beyond parameters and optimizer state, about the \
                     size of the gradients ({})",
                    human_bytes(held),
                    human_bytes(c.trainable_bytes)
                ),
                advice: "call `optimizer.zero_grad(set_to_none=True)` so gradients are freed \
                         between steps"
                    .into(),
                bytes: Some(held),
                bytes_per_step: None,
                step: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(ends: &[u64]) -> String {
        let mut s = String::from(
            r#"{"type":"start","version":1,"device":"cuda:0","capacity_bytes":1073741824}"#,
        );
        s.push('\n');
        for (i, e) in ends.iter().enumerate() {
            s.push_str(&format!(
                "{{\"type\":\"step\",\"step\":{i},\"start_bytes\":{e},\"end_bytes\":{e},\"peak_bytes\":{}}}\n",
                e + 1000
            ));
        }
        s.push_str("{\"type\":\"end\"}\n");
        s
    }

    /// A CPU run whose eval keeps 1 GiB of outputs: RSS stays up after it, so
    /// the steps after the eval peak above the eval itself.
    fn eval_keeps_outputs() -> String {
        let mut s = String::from(r#"{"type":"start","version":1,"device":"cpu"}"#);
        s.push('\n');
        let step = |s: &mut String, i: u64, level: u64| {
            s.push_str(&format!(
                "{{\"type\":\"step\",\"step\":{i},\"start_bytes\":{level},\"end_bytes\":{level},\"peak_bytes\":{}}}\n",
                level + 100 * MIB
            ));
        };
        for i in 0..5 {
            step(&mut s, i, 700 * MIB);
        }
        s.push_str(&format!(
            "{{\"type\":\"phase\",\"step\":4,\"name\":\"eval\",\"start_bytes\":{},\"end_bytes\":{},\"peak_bytes\":{}}}\n",
            700 * MIB,
            1700 * MIB,
            1780 * MIB
        ));
        for i in 5..10 {
            step(&mut s, i, 1700 * MIB);
        }
        s.push_str("{\"type\":\"end\"}\n");
        s
    }

    #[test]
    fn an_eval_spike_is_measured_against_the_steps_before_it() {
        let a = analyze(&Run::parse(eval_keeps_outputs().as_bytes()).unwrap());
        let spike = a
            .findings
            .iter()
            .find(|f| f.kind == "eval_spike")
            .expect("eval_spike");
        // 1780 MiB against the 800 MiB peak of the steps before it, though later steps reach 1800.
        assert_eq!(spike.bytes, Some(980 * MIB));
        assert_eq!(spike.step, Some(4));
    }

    #[test]
    fn an_eval_below_the_training_before_it_is_no_spike() {
        let quiet =
            eval_keeps_outputs().replace(&(1780 * MIB).to_string(), &(810 * MIB).to_string());
        let a = analyze(&Run::parse(quiet.as_bytes()).unwrap());
        assert!(
            a.findings.iter().all(|f| f.kind != "eval_spike"),
            "{:?}",
            a.findings
        );
    }

    #[test]
    fn steady_growth_is_a_leak_with_its_rate() {
        let ends: Vec<u64> = (0..30).map(|i| 100 * MIB + i * 4 * MIB).collect();
        let a = analyze(&Run::parse(log(&ends).as_bytes()).unwrap());
        let l = a.leak.expect("leak");
        assert!((l.bytes_per_step - (4 * MIB) as f64).abs() < 1.0);
        assert!(l.confidence > 0.99);
        // (1 GiB - 216 MiB) / 4 MiB = 202 more steps after step 29.
        assert_eq!(l.full_at_step, Some(29 + 202));
        assert_eq!(a.findings[0].kind, "leak");
    }

    #[test]
    fn flat_or_noisy_memory_is_not_a_leak() {
        let flat: Vec<u64> = (0..30).map(|i| 100 * MIB + (i % 3) * 100_000).collect();
        let a = analyze(&Run::parse(log(&flat).as_bytes()).unwrap());
        assert!(a.leak.is_none(), "{:?}", a.leak);
        assert!(a.findings.iter().all(|f| f.kind != "leak"));
    }

    #[test]
    fn warm_up_growth_alone_is_not_a_leak() {
        let mut ends = vec![10 * MIB, 300 * MIB];
        ends.extend(std::iter::repeat_n(500 * MIB, 20));
        let a = analyze(&Run::parse(log(&ends).as_bytes()).unwrap());
        assert!(a.leak.is_none());
    }

    #[test]
    fn torn_last_line_is_tolerated_but_a_bad_middle_line_is_not() {
        let mut s = log(&[1, 2, 3]);
        s.push_str("{\"type\":\"st");
        let run = Run::parse(s.as_bytes()).unwrap();
        assert!(run.torn_last_line);
        assert_eq!(run.steps().count(), 3);
        let bad = "{\"type\":\"start\"}\nnot json\n{\"type\":\"end\"}\n";
        let e = Run::parse(bad.as_bytes()).unwrap_err().to_string();
        assert!(e.starts_with("line 2:"), "{e}");
        let e = Run::parse(b"hello\n").unwrap_err().to_string();
        assert!(e.starts_with("not an oomkit run log"), "{e}");
    }
}
