//! An estimate calibrated from the user's own measured steps.
//!
//! A training step's peak grows in proportion to the micro-batch on top of a
//! fixed part (weights, gradients, optimizer state, the CUDA context), so two
//! measured peaks at different micro-batches pin down `fixed + per_sample x
//! batch` for that exact model, code and GPU, which no formula can: kernels,
//! fusion and the allocator's rounding are all in the measurement. With peaks
//! at one micro-batch only, the formula's per-sample cost splits it.

use crate::{Estimate, EstimateError};
use oomkit_advice::{Role, RoleBytes};
use serde::Serialize;

/// One measured peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Measured {
    /// The micro-batch it ran at.
    pub micro_batch: u64,
    /// Its largest step peak.
    pub peak_bytes: u64,
    /// Where it came from: a file, and what in it.
    pub source: String,
    /// The peak by role, where the measurement tells roles (a snapshot).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub roles: Option<RoleBytes>,
}

/// One role of the estimate beside what a snapshot measured.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Term {
    /// The role.
    pub role: Role,
    /// What the formulas give it at the measured micro-batch.
    pub estimated_bytes: u64,
    /// What the snapshot held in it at its peak.
    pub measured_bytes: u64,
}

/// A snapshot's peak compared with the estimate term by term.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Terms {
    /// The measurement's source.
    pub source: String,
    /// Its micro-batch.
    pub micro_batch: u64,
    /// Each role either side holds, in the order reports list roles.
    pub roles: Vec<Term>,
}

/// How the split between fixed and per-sample memory was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fit {
    /// A least-squares line through peaks at two or more micro-batches.
    Line,
    /// Peaks at one micro-batch, split by the formula's per-sample cost.
    FormulaSplit,
}

/// The budget the measurements give, beside what the formulas alone said.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// How the split was found.
    pub fit: Fit,
    /// Memory that does not grow with the micro-batch.
    pub fixed_bytes: u64,
    /// Memory each sample of the micro-batch adds.
    pub per_sample_bytes: u64,
    /// The largest distance of a measured peak from the fitted line (0 for a formula split).
    pub max_error_bytes: u64,
    /// The memory to fit in, if known.
    pub capacity_bytes: Option<u64>,
    /// The largest micro-batch whose calibrated peak, plus the error of the fit, the allocator's reserve and the estimate's overhead, fits; null without a capacity.
    pub max_batch: Option<u64>,
    /// The formulas' fixed part, for comparison.
    pub formula_fixed_bytes: u64,
    /// The formulas' per-sample cost, for comparison.
    pub formula_per_sample_bytes: u64,
    /// The formulas' largest micro-batch (at their high figure), for comparison.
    pub formula_max_batch: Option<u64>,
    /// The measurements, in the order given.
    pub measured: Vec<Measured>,
    /// For each measurement that tells roles (a snapshot), the estimate's
    /// terms beside the measured ones.
    pub terms: Vec<Terms>,
}

/// Fits the measured peaks, using `formula` where one micro-batch is all there is.
pub fn calibrate(
    measured: Vec<Measured>,
    formula: &Estimate,
    capacity: Option<u64>,
) -> Result<Calibration, EstimateError> {
    if measured.is_empty() {
        return Err(EstimateError::Invalid(
            "nothing measured to calibrate from".into(),
        ));
    }
    let mut batches: Vec<u64> = measured.iter().map(|m| m.micro_batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let (fit, fixed, per_sample) = if batches.len() >= 2 {
        let n = measured.len() as f64;
        let xs: Vec<f64> = measured.iter().map(|m| m.micro_batch as f64).collect();
        let ys: Vec<f64> = measured.iter().map(|m| m.peak_bytes as f64).collect();
        let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
        let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
        let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
        let slope = sxy / sxx;
        if slope <= 0.0 {
            return Err(EstimateError::Invalid(format!(
                "the measured peaks do not grow with the micro-batch ({}): measure full training steps at each",
                describe(&measured)
            )));
        }
        let fixed = (my - slope * mx).max(0.0);
        (Fit::Line, fixed as u64, slope.round() as u64)
    } else {
        let per_sample = formula.per_sample_bytes;
        let peak = measured.iter().map(|m| m.peak_bytes).max().unwrap_or(0);
        (
            Fit::FormulaSplit,
            peak.saturating_sub(per_sample * batches[0]),
            per_sample,
        )
    };
    let max_error_bytes = if fit == Fit::Line {
        measured
            .iter()
            .map(|m| {
                let predicted = fixed as f64 + per_sample as f64 * m.micro_batch as f64;
                (m.peak_bytes as f64 - predicted).abs() as u64
            })
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    let formula_fixed = formula
        .total_bytes
        .saturating_sub(formula.per_sample_bytes * formula.inputs.batch);
    Ok(Calibration {
        fit,
        fixed_bytes: fixed,
        per_sample_bytes: per_sample,
        max_error_bytes,
        capacity_bytes: capacity,
        // A measured peak is what PyTorch's tensors held: the CUDA context
        // (the estimate's overhead) and the caching allocator's reserve come
        // on top of it, and the error of the fit is taken against the run.
        max_batch: capacity.map(|c| {
            let reserve = 1.0 + crate::ALLOCATOR_RESERVE;
            let fixed_high = ((fixed + max_error_bytes) as f64 * reserve) as u64;
            c.saturating_sub(fixed_high + formula.inputs.overhead_bytes)
                / ((per_sample as f64 * reserve).ceil() as u64).max(1)
        }),
        terms: measured
            .iter()
            .filter_map(|m| {
                let got = m.roles.as_ref()?;
                let want = formula.roles(m.micro_batch);
                Some(Terms {
                    source: m.source.clone(),
                    micro_batch: m.micro_batch,
                    roles: want
                        .beside(got)
                        .into_iter()
                        .map(|(role, estimated_bytes, measured_bytes)| Term {
                            role,
                            estimated_bytes,
                            measured_bytes,
                        })
                        .collect(),
                })
            })
            .collect(),
        formula_fixed_bytes: formula_fixed,
        formula_per_sample_bytes: formula.per_sample_bytes,
        formula_max_batch: formula.max_batch,
        measured,
    })
}

fn describe(measured: &[Measured]) -> String {
    measured
        .iter()
        .map(|m| {
            format!(
                "{} at micro-batch {}",
                crate::budget::gib(m.peak_bytes),
                m.micro_batch
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
