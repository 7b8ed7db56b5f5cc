//! The terminal form of a memory budget: the terms, the range, the verdict
//! and, when measured peaks were given, the calibration beside the formulas.

use oomkit_estimate::calibrate::{Calibration, Fit};
use oomkit_estimate::{Estimate, Sharding, Verdict, ACTIVATION_SPREAD, ALLOCATOR_RESERVE};
use oomkit_units::human_bytes;
use std::fmt::Write;

/// Below this, a size in GiB with two decimals would read 0.00: smaller
/// figures take the unit that shows them (MiB, KiB).
const GIB_FROM: u64 = (1 << 30) / 100;

/// Formats bytes in GiB with two decimals, the unit people plan GPU memory
/// in, or in a smaller unit where that would round to nothing.
fn gib(b: u64) -> String {
    if b >= GIB_FROM {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        oomkit_units::human_bytes(b)
    }
}

/// A parameter count as people write it: 7.24B, 124M (as 0.12B), 25.3M, or whole below a million.
fn params(n: u64) -> String {
    if n >= 100_000_000 {
        format!("{:.2}B", n as f64 / 1e9)
    } else if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else {
        // Thousands grouped, so that 172288 reads 172,288.
        let digits = n.to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    }
}

/// The budget as a table for the terminal.
pub fn estimate(e: &Estimate) -> String {
    let i = &e.inputs;
    let a = &i.arch;
    let mut out = String::new();
    let prec = if i.mixed_precision && i.sharding != Sharding::None {
        "mixed precision (16-bit weights and gradients, fp32 master weights and state in the optimizer)".to_string()
    } else if i.mixed_precision {
        "mixed precision (fp32 weights, 16-bit autocast)".to_string()
    } else {
        format!("{:?}", i.dtype).to_lowercase()
    };
    let _ = writeln!(
        out,
        "{} parameters ({} trainable), {prec}, {:?}, micro-batch {} x {} tokens",
        params(e.params),
        params(e.trainable_params),
        i.optimizer,
        i.batch,
        i.seq
    );
    let experts = if a.experts > 1 {
        format!(
            ", {} experts of {} ({} per token{})",
            a.experts,
            a.ffn,
            a.experts_per_token,
            if a.shared_ffn > 0 {
                format!(", shared {}", a.shared_ffn)
            } else {
                String::new()
            }
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "shape ({}): hidden {}, {} layers{}, {} heads, vocab {}{experts}",
        a.source,
        a.hidden,
        a.layers,
        if a.decoder_layers > 0 {
            format!(" + {} decoder layers", a.decoder_layers)
        } else {
            String::new()
        },
        a.heads,
        a.vocab
    );
    if i.gpus > 1 {
        let what = match i.sharding {
            Sharding::None => "nothing sharded (DDP): every GPU keeps everything",
            Sharding::OptimizerState => "ZeRO-1: optimizer state sharded",
            Sharding::Gradients => {
                "ZeRO-2 (FSDP SHARD_GRAD_OP): optimizer state and gradients sharded"
            }
            Sharding::Full => {
                "ZeRO-3 (FSDP FULL_SHARD): optimizer state, gradients and weights sharded"
            }
        };
        let _ = writeln!(out, "{} GPUs, {what}; figures per GPU", i.gpus);
    }
    if i.load_in_4bit {
        let _ = writeln!(
            out,
            "weights: linear layers in 4 bits (NF4), embeddings and head in {:?}",
            i.dtype
        );
    }
    let _ = writeln!(out);
    let rows = [
        ("weights", e.weights_bytes),
        ("gradients", e.gradients_bytes),
        ("optimizer state", e.optimizer_bytes),
        ("EMA", e.ema_bytes),
        ("gathered in full (sharding)", e.gathered_bytes),
        ("activations", e.activations_bytes),
        ("CUDA context and overhead", e.overhead_bytes),
    ];
    for (label, b) in rows {
        // Only a sharded run gathers: the row would be noise otherwise.
        if label.starts_with("gathered") && i.sharding < Sharding::Gradients {
            continue;
        }
        let share = 100.0 * b as f64 / e.total_bytes.max(1) as f64;
        let _ = writeln!(out, "  {label:<27} {:>12}  {share:>5.1}%", gib(b));
    }
    let _ = writeln!(
        out,
        "  {:<27} {:>12}",
        "total (expected)",
        gib(e.total_bytes)
    );
    let _ = writeln!(
        out,
        "  {:<27} {:>12}  activations +{:.0}%, allocator reserve +{:.0}%",
        "total (high)",
        gib(e.high_bytes),
        100.0 * ACTIVATION_SPREAD,
        100.0 * ALLOCATOR_RESERVE
    );
    if let (Some(c), Some(v)) = (e.capacity_bytes, e.verdict) {
        let verdict = match v {
            Verdict::Fits => "fits, even at the high figure",
            Verdict::MayNotFit => "may NOT fit: the expected figure fits, the high one does not",
            Verdict::DoesNotFit => "does NOT fit",
        };
        let _ = writeln!(out, "  {:<27} {:>12}  {verdict}", "capacity", gib(c));
        match e.max_batch {
            Some(0) => {
                let how = if i.sharding == Sharding::Full {
                    "shard it over more GPUs (--gpus), or train LoRA adapters"
                } else {
                    "shard it over several GPUs (--gpus N with --zero 3, ZeRO-3 or FSDP FULL_SHARD; --zero 1 shards the optimizer state alone), or train LoRA adapters"
                };
                let _ = writeln!(
                    out,
                    "\nThe fixed part alone ({}) exceeds the capacity: {how}.",
                    gib(e.total_bytes - e.activations_bytes)
                );
            }
            Some(m) => {
                let _ = writeln!(
                    out,
                    "\nLargest micro-batch that fits at the high figure: {m} (each sample adds {} to {}).",
                    gib(e.per_sample_bytes),
                    gib(e.high_per_sample_bytes)
                );
            }
            None => {}
        }
    }
    out
}

/// The calibration for the terminal, beside what the formulas said.
pub fn calibration(c: &Calibration) -> String {
    let mut out = String::new();
    let batches: Vec<String> = c
        .measured
        .iter()
        .map(|m| m.micro_batch.to_string())
        .collect();
    let distinct = {
        let mut b: Vec<u64> = c.measured.iter().map(|m| m.micro_batch).collect();
        b.sort_unstable();
        b.dedup();
        b.len()
    };
    let how = match c.fit {
        // Through two points a line is exact by construction: no error was measured.
        Fit::Line if distinct < 3 => format!(
            "a line through {} measured peaks (exact through two; a third micro-batch would test it)",
            c.measured.len()
        ),
        Fit::Line => format!(
            "a line through {} measured peaks (largest error {})",
            c.measured.len(),
            gib(c.max_error_bytes)
        ),
        Fit::FormulaSplit => {
            "one micro-batch measured: split by the formula's per-sample cost; measure a second micro-batch for a fitted split".into()
        }
    };
    let _ = writeln!(
        out,
        "Calibrated from micro-batch {}: {how}",
        batches.join(", ")
    );
    let row = |out: &mut String, label: &str, fixed: u64, per: u64, max: Option<u64>| {
        let _ = writeln!(
            out,
            "  {label:<12} fixed {:>10}   per sample {:>10}   largest micro-batch {}",
            gib(fixed),
            gib(per),
            max.map_or("-".to_string(), |m| m.to_string())
        );
    };
    row(
        &mut out,
        "measured",
        c.fixed_bytes,
        c.per_sample_bytes,
        c.max_batch,
    );
    row(
        &mut out,
        "formulas",
        c.formula_fixed_bytes,
        c.formula_per_sample_bytes,
        c.formula_max_batch,
    );
    if let Some(c) = c.capacity_bytes {
        let _ = writeln!(out, "  on {}", gib(c));
    }
    for t in &c.terms {
        let _ = writeln!(
            out,
            "  by role at micro-batch {}, {}:",
            t.micro_batch, t.source
        );
        let _ = writeln!(
            out,
            "    {:<16} {:>10} {:>10}",
            "role", "estimated", "measured"
        );
        for r in &t.roles {
            let _ = writeln!(
                out,
                "    {:<16} {:>10} {:>10}",
                r.role.words(),
                gib(r.estimated_bytes),
                gib(r.measured_bytes)
            );
        }
    }
    out
}

/// The step traced with preflight beside the formula's expected figure, or why it was not traced.
pub fn traced(e: &Estimate, t: &Result<crate::PreflightRun, String>) -> String {
    let run = match t {
        Ok(run) => run,
        Err(why) => return format!("Traced: {why}\n"),
    };
    // The formula's expected total counts the context; the trace's peak is the allocator's.
    let formula = e.total_bytes.saturating_sub(e.overhead_bytes);
    let diff = (run.peak_reserved_bytes as f64 / formula.max(1) as f64 - 1.0) * 100.0;
    let mut out = format!(
        "Traced (oomkit preflight, the step run on tensors without memory): peak reserved {}, allocated {}; the formula's tensors: {} ({diff:+.0}%)\n",
        human_bytes(run.peak_reserved_bytes),
        human_bytes(run.peak_allocated_bytes),
        human_bytes(formula),
    );
    let roles: Vec<String> = oomkit_advice::Role::ALL
        .iter()
        .filter_map(|r| {
            let b = *run.by_role.get(r.key())?;
            (b > 0).then(|| format!("{} {}", r.words(), human_bytes(b)))
        })
        .collect();
    if !roles.is_empty() {
        let _ = writeln!(out, "  at the traced peak: {}", roles.join(", "));
    }
    for n in &run.notes {
        let _ = writeln!(out, "  note: {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_figures_never_read_as_zero() {
        assert_eq!(gib(0), "0 B");
        assert_eq!(gib(672 << 10), "672 KiB");
        assert_eq!(gib(3 << 30), "3.00 GiB");
        assert_eq!(params(172_288), "172,288");
        assert_eq!(params(999), "999");
        assert_eq!(params(25_300_000), "25.3M");
        assert_eq!(params(124_439_808), "0.12B");
        assert_eq!(params(7_241_732_096), "7.24B");
    }
}
