//! The rules that turn a run log's analysis into findings: one function per
//! rule, each with its thresholds named and the numbers it rests on carried
//! into the finding's message and bytes.

use crate::record::{Components, MeasureKind, Run};
use crate::report::{Leak, OomSummary};
use oomkit_advice::{Cause, Finding, FindingKind};
use oomkit_units::human_bytes;
use std::collections::BTreeMap;

const MIB: u64 = 1 << 20;

/// A gradient norm this many times the median is a spike: healthy runs vary
/// by a few times, a bad batch or a blow-up by orders of magnitude.
const GRAD_SPIKE_RATIO: f64 = 10.0;
/// The median needs this many norms to mean anything.
const GRAD_SPIKE_MIN_CHECKS: usize = 5;
/// Optimizer state from this share of the device (or peak) is large...
const OPTIMIZER_STATE_SHARE: f64 = 0.3;
/// ... as is state this many times the parameters (AdamW's two fp32 moments are 2x fp32 weights).
const OPTIMIZER_STATE_PER_PARAM: u64 = 2;
/// Activations dominate from this share of the peak: then the micro-batch,
/// checkpointing and the attention kernel are the levers.
const ACTIVATIONS_SHARE: f64 = 0.5;
/// Gradients of at least this size are worth freeing between steps...
const HELD_GRADS_MIN_BYTES: u64 = 16 * MIB;
/// ... when a step starts with this share of them still allocated: it tells
/// a held gradient set from a few buffers.
const HELD_GRADS_SHARE: f64 = 0.9;
/// Steps skipped before looking for held gradients: the first steps create
/// optimizer state and warm the allocator.
const HELD_GRADS_WARM_UP_STEPS: usize = 2;

/// What the rules look at: the log and what the analysis made of it.
pub(crate) struct Facts<'r> {
    /// The run log.
    pub run: &'r Run,
    /// `cuda:N` or `cpu`, as the log's start record says.
    pub device: &'r str,
    /// Whether the figures are the CUDA allocator's (not the process's RSS).
    pub cuda: bool,
    /// The largest peak of any stage or step.
    pub train_peak: u64,
    /// The device's memory, where known.
    pub capacity: Option<u64>,
    /// The OOMs, with their causes.
    pub ooms: &'r [OomSummary],
    /// The leak, if the end-of-step line climbs.
    pub leak: Option<&'r Leak>,
    /// The latest component count.
    pub components: Option<&'r Components>,
}

/// Every finding for the run, ranked.
pub(crate) fn findings(f: &Facts<'_>) -> Vec<Finding> {
    let mut out: Vec<Finding> = f
        .ooms
        .iter()
        .map(|o| oom(o, f.device, f.capacity))
        .collect();
    out.extend(f.leak.map(leak));
    out.extend(duplicate_copy(f.run));
    out.extend(
        eval_spikes(f.run, f.train_peak, run_floor(f.run, f.cuda))
            .into_iter()
            .map(eval_spike),
    );
    out.extend(grad_nonfinite(f.run));
    out.extend(grad_spike(f.run));
    if let Some(c) = f.components {
        out.extend(optimizer_state_large(f, c));
        out.extend(ema_on_device(f, c));
        out.extend(activations_dominate(f, c));
        out.extend(grads_held_between_steps(f, c));
    }
    oomkit_advice::rank(&mut out);
    out
}

/// An OOM record, with advice for the stage it happened in.
fn oom(o: &OomSummary, device: &str, capacity: Option<u64>) -> Finding {
    if o.killed_by_kernel {
        return Finding::new(
            FindingKind::Oom,
            format!(
                "killed by the kernel's OOM killer on {} {}: host memory ran out{}; {}",
                if device.is_empty() { "the host" } else { device },
                o.step
                    .map_or("before its first record".to_string(), |n| format!("in step {n}")),
                capacity
                    .map(|c| format!(" (capacity {})", human_bytes(c)))
                    .unwrap_or_default(),
                // No record before the kill: no figure, rather than a zero.
                if o.allocated_bytes > 0 {
                    format!("the last records show {} in use", human_bytes(o.allocated_bytes))
                } else {
                    "no record before the kill holds a memory figure".to_string()
                }
            ),
            "lower the micro-batch (`oomkit run` steps it down after such a kill), and keep host copies small: fewer DataLoader workers and a lower prefetch_factor, data loaded lazily or memory-mapped, checkpoints loaded with mmap=True",
        )
        .at_step(o.step);
    }
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
    let fitted;
    let advice = if o.cause == Cause::RequestExceedsCapacity {
        // No batch change helps a request larger than the device.
        fitted = oomkit_advice::first_fix(o.cause, &o.failure(device, None, capacity));
        fitted.as_str()
    } else if o.cause == Cause::Fragmentation {
        "the allocator had enough reserved but unallocated memory in pieces too small: set \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    } else {
        match o.stage.as_deref() {
            Some("forward" | "backward") => {
                "activations do not fit: halve the micro-batch and \
                 double gradient accumulation (`oomkit run` does this and keeps the effective \
                 batch), enable gradient checkpointing, or train in bf16/AMP"
            }
            Some("optimizer") => {
                "the optimizer step does not fit: 8-bit optimizer states \
                 (bitsandbytes) or a fused/foreach=False step lower its peak"
            }
            Some(_) => {
                "this phase does not fit: run it under torch.no_grad(), use a smaller \
                 eval batch, and chunk generation"
            }
            None => "reduce the micro-batch and raise gradient accumulation",
        }
    };
    let mut f = Finding::new(
        FindingKind::Oom,
        format!(
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
    )
    .at_step(o.step);
    f.bytes = o.requested_bytes;
    f
}

/// End-of-step memory that climbs on a line.
fn leak(l: &Leak) -> Finding {
    let full = match l.full_at_step {
        Some(s) => format!("; at this rate the device is full at step {s}"),
        None => String::new(),
    };
    let mut f = Finding::new(
        FindingKind::Leak,
        format!(
            "end-of-step memory grows by {}/step from step {} to {} ({} -> {}, R² {:.2}){full}",
            human_bytes(l.bytes_per_step as u64),
            l.first_step,
            l.last_step,
            human_bytes(l.start_bytes),
            human_bytes(l.end_bytes),
            l.confidence
        ),
        "something keeps tensors from each step alive: a list that collects losses or \
         outputs without .item() or .detach() keeps every step's autograd graph; \
         accumulate `loss.item()` or `loss.detach()` instead",
    )
    .with_bytes(l.end_bytes.saturating_sub(l.start_bytes))
    .at_step(Some(l.last_step));
    f.bytes_per_step = Some(l.bytes_per_step);
    f
}

/// The largest duplicate check that found tensors mirroring the parameters.
fn duplicate_copy(run: &Run) -> Option<Finding> {
    let d = run
        .duplicates
        .iter()
        .filter(|d| d.bytes > 0)
        .max_by_key(|d| d.bytes)?;
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
    Some(
        Finding::new(
            FindingKind::DuplicateCopy,
            format!(
                "{} of live tensors mirror the model's parameters but belong to no tracked module, \
                 optimizer or gradient: {}",
                human_bytes(d.bytes),
                groups.join("; ")
            ),
            "a second copy of the model is alive, typically the fp32 original kept after \
             `model.to(torch.bfloat16)` or a copy made for EMA or evaluation; drop the \
             reference (`del`) or convert in place",
        )
        .with_bytes(d.bytes)
        .at_step(d.step),
    )
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
fn eval_spikes(run: &Run, train_peak: u64, floor: u64) -> Vec<Spike<'_>> {
    let mut so_far = 0u64;
    let mut worst: BTreeMap<&str, Spike<'_>> = BTreeMap::new();
    for (kind, m) in &run.measures {
        if *kind != MeasureKind::Phase {
            so_far = so_far.max(m.peak_bytes);
            continue;
        }
        let baseline = if so_far > 0 { so_far } else { train_peak };
        // The ratio is taken over what the run holds above `floor`.
        let own = |b: u64| b.saturating_sub(floor) as f64;
        if baseline == 0
            || m.peak_bytes < baseline + EVAL_SPIKE_MIN_BYTES
            || own(m.peak_bytes) <= own(baseline) * EVAL_SPIKE_RATIO
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

/// A phase that peaked above the training before it.
fn eval_spike(spike: Spike<'_>) -> Finding {
    Finding::new(
        FindingKind::EvalSpike,
        format!(
            "phase '{}' peaks at {}, {} above the training peak of {} before it",
            spike.name,
            human_bytes(spike.peak),
            human_bytes(spike.peak - spike.baseline),
            human_bytes(spike.baseline)
        ),
        "run it under `torch.no_grad()` (or `torch.inference_mode()`), move \
         outputs you keep to the CPU, and chunk long generations or large eval \
         batches",
    )
    .with_bytes(spike.peak - spike.baseline)
    .at_step(spike.step)
}

/// Gradient checks that found NaN or Inf.
fn grad_nonfinite(run: &Run) -> Option<Finding> {
    let nonfinite: Vec<_> = run
        .grads
        .iter()
        .filter(|g| g.nan_params + g.inf_params > 0)
        .collect();
    let first = nonfinite.first()?;
    Some(
        Finding::new(
            FindingKind::GradNonfinite,
            format!(
                "{} of {} gradient checks found non-finite gradients, first at step {} \
                 ({} parameters with NaN, {} with Inf)",
                nonfinite.len(),
                run.grads.len(),
                first.step,
                first.nan_params,
                first.inf_params
            ),
            "lower the learning rate or clip gradients (`clip_grad_norm_`), use bf16 or a \
             GradScaler with fp16, and look for log/sqrt/division of values that can be zero",
        )
        .at_step(Some(first.step)),
    )
}

/// The largest gradient norm far above the median.
fn grad_spike(run: &Run) -> Option<Finding> {
    let mut norms: Vec<f64> = run
        .grads
        .iter()
        .filter_map(|g| g.total_norm)
        .filter(|n| n.is_finite())
        .collect();
    if norms.len() < GRAD_SPIKE_MIN_CHECKS {
        return None;
    }
    norms.sort_by(f64::total_cmp);
    let median = norms[norms.len() / 2];
    if median <= 0.0 {
        return None;
    }
    let g = run
        .grads
        .iter()
        .filter(|g| {
            g.total_norm
                .is_some_and(|n| n.is_finite() && n > GRAD_SPIKE_RATIO * median)
        })
        .max_by(|a, b| {
            a.total_norm
                .unwrap_or(0.0)
                .total_cmp(&b.total_norm.unwrap_or(0.0))
        })?;
    Some(
        Finding::new(
            FindingKind::GradSpike,
            format!(
                "gradient norm {:.4} at step {} is {:.0}x the median {:.4}",
                g.total_norm.unwrap_or(0.0),
                g.step,
                g.total_norm.unwrap_or(0.0) / median,
                median
            ),
            "clip gradients (`torch.nn.utils.clip_grad_norm_`) and check that batch for \
             outliers",
        )
        .at_step(Some(g.step)),
    )
}

/// Memory that is not the run's: on CPU the resident set when the first
/// step began (Python, torch's libraries: 700 MiB before any tensor), which
/// no tensor grows into, so shares are taken of what lies above it; on
/// CUDA the allocator counts only tensors, and this is 0.
pub(crate) fn run_floor(run: &Run, cuda: bool) -> u64 {
    if cuda {
        0
    } else {
        run.steps().next().map_or(0, |m| m.start_bytes)
    }
}

/// What the components are measured against: the device where its size is known, else the peak.
fn base(f: &Facts<'_>) -> (u64, &'static str) {
    match f.capacity {
        Some(c) => (c.max(1), "of the device"),
        None => (f.train_peak.max(1), "of the peak"),
    }
}

/// Optimizer state that is large against the device or the parameters (CUDA only).
fn optimizer_state_large(f: &Facts<'_>, c: &Components) -> Option<Finding> {
    let (base, against) = base(f);
    let state = c.optimizer_state_bytes;
    let large = state as f64 >= OPTIMIZER_STATE_SHARE * base as f64
        || state >= OPTIMIZER_STATE_PER_PARAM * c.params_bytes.max(1);
    if !f.cuda || state == 0 || !large {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::OptimizerStateLarge,
            format!(
                "optimizer state holds {} ({:.0}% {against}), {:.1}x the parameters",
                human_bytes(state),
                100.0 * state as f64 / base as f64,
                state as f64 / c.params_bytes.max(1) as f64
            ),
            "8-bit optimizer states (bitsandbytes AdamW8bit) cut them about 4x; ZeRO/FSDP \
             shards them across ranks",
        )
        .with_bytes(state)
        .at_step(c.step),
    )
}

/// An EMA copy of the weights kept on a GPU.
fn ema_on_device(f: &Facts<'_>, c: &Components) -> Option<Finding> {
    let device = c.ema_device.as_deref().filter(|d| d.starts_with("cuda"))?;
    if c.ema_bytes == 0 {
        return None;
    }
    let (base, against) = base(f);
    Some(
        Finding::new(
            FindingKind::EmaOnDevice,
            format!(
                "the EMA copy holds {} ({:.0}% {against}) on {device}",
                human_bytes(c.ema_bytes),
                100.0 * c.ema_bytes as f64 / base as f64,
            ),
            "keep the EMA on the CPU and update it every few steps, or in bf16",
        )
        .with_bytes(c.ema_bytes)
        .at_step(c.step),
    )
}

/// Bytes the model's own tensors hold for the whole run: weights, buffers, optimizer state, EMA.
fn fixed_bytes(c: &Components) -> u64 {
    c.params_bytes + c.buffers_bytes + c.optimizer_state_bytes + c.ema_bytes
}

/// Activations and temporaries holding most of the peak (CUDA only: on CPU
/// the resident set holds far more than tensors, so what is left after the
/// components says nothing about activations).
fn activations_dominate(f: &Facts<'_>, c: &Components) -> Option<Finding> {
    if !f.cuda || f.train_peak == 0 {
        return None;
    }
    let activations = f
        .train_peak
        .saturating_sub(fixed_bytes(c) + c.trainable_bytes);
    if (activations as f64) < ACTIVATIONS_SHARE * f.train_peak as f64 {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::ActivationsDominate,
            format!(
                "activations and temporaries take about {} of the {} peak ({:.0}%): peak minus \
                 parameters, gradients, optimizer state, buffers and EMA",
                human_bytes(activations),
                human_bytes(f.train_peak),
                100.0 * activations as f64 / f.train_peak as f64
            ),
            "halve the micro-batch and double gradient accumulation, enable gradient \
             checkpointing, or use bf16/AMP autocast",
        )
        .with_bytes(activations),
    )
}

/// Steps that start with the gradients still allocated (CUDA only); with
/// `zero_grad(set_to_none=True)` a step starts without them.
fn grads_held_between_steps(f: &Facts<'_>, c: &Components) -> Option<Finding> {
    if !f.cuda || f.train_peak == 0 || c.trainable_bytes < HELD_GRADS_MIN_BYTES {
        return None;
    }
    let low = f
        .run
        .steps()
        .skip(HELD_GRADS_WARM_UP_STEPS)
        .map(|m| m.start_bytes)
        .min()?;
    let held = low.saturating_sub(fixed_bytes(c));
    if (held as f64) < HELD_GRADS_SHARE * c.trainable_bytes as f64 {
        return None;
    }
    Some(
        Finding::new(
            FindingKind::GradsHeldBetweenSteps,
            format!(
                "every step starts with {} beyond parameters and optimizer state, about the \
                 size of the gradients ({})",
                human_bytes(held),
                human_bytes(c.trainable_bytes)
            ),
            "call `optimizer.zero_grad(set_to_none=True)` so gradients are freed \
             between steps",
        )
        .with_bytes(held),
    )
}
