//! What a what-if changes: allocator settings, the device's capacity, or
//! the micro-batch; and the capacities of GPUs by name.

use crate::error::AllocatorError;

/// One condition to replay the trace under, beside the trace as recorded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scenario {
    /// How reports name it (`expandable_segments:True`, `capacity 80 GiB`, `batch x0.5`).
    pub label: String,
    /// Settings applied on top of the recorded ones, in `PYTORCH_CUDA_ALLOC_CONF`'s syntax.
    pub alloc_conf: Option<String>,
    /// The bytes the allocator may hold, instead of what the trace's OOMs imply.
    pub capacity: Option<u64>,
    /// Activations, temporaries and inputs scaled by this share (0.5 for half the micro-batch).
    pub batch_scale: Option<f64>,
}

impl Scenario {
    /// Other allocator settings.
    pub fn alloc_conf(conf: &str) -> Scenario {
        Scenario {
            label: conf.to_string(),
            alloc_conf: Some(conf.to_string()),
            ..Scenario::default()
        }
    }

    /// Another capacity, as a size or a GPU's name.
    pub fn capacity(text: &str) -> Result<Scenario, AllocatorError> {
        let (bytes, label) = parse_capacity(text)?;
        Ok(Scenario {
            label,
            capacity: Some(bytes),
            ..Scenario::default()
        })
    }

    /// A smaller (or larger) micro-batch: `0.5` or `4/8`.
    pub fn batch_scale(text: &str) -> Result<Scenario, AllocatorError> {
        let bad = || AllocatorError::BatchScale(text.to_string());
        let v = match text.split_once('/') {
            Some((a, b)) => {
                let (a, b): (f64, f64) = (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                );
                if b == 0.0 {
                    return Err(bad());
                }
                a / b
            }
            None => text.trim().parse().map_err(|_| bad())?,
        };
        if !(v.is_finite() && v > 0.0) {
            return Err(bad());
        }
        Ok(Scenario {
            label: format!("micro-batch x{}", trim_float(v)),
            batch_scale: Some(v),
            ..Scenario::default()
        })
    }
}

/// A float without trailing zeros (0.5, 2, 0.333).
fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The CUDA context and kernels outside the allocator, taken off a GPU's
/// total when a GPU is named (the figure `oomkit estimate` uses, measured on a V100).
pub const CONTEXT_BYTES: u64 = 1280 << 20;

/// GPUs by name, with the total capacity PyTorch reports for each in its
/// out-of-memory message (sources in docs/whatif.md).
pub const GPUS: [(&str, u64); 5] = [
    ("H100", gib_hundredths(7911)),
    ("H100-NVL", gib_hundredths(9300)),
    ("A100-40GB", gib_hundredths(3950)),
    ("RTX-4090", gib_hundredths(2364)),
    ("T4", gib_hundredths(1475)),
];

/// Hundredths of a GiB as bytes, the precision of PyTorch's message.
const fn gib_hundredths(h: u64) -> u64 {
    h * (1 << 30) / 100
}

/// Reads a capacity: a size (`80GiB`) is what the allocator may hold; a
/// GPU's name is its total less [`CONTEXT_BYTES`]. Returns the bytes and a label.
pub fn parse_capacity(text: &str) -> Result<(u64, String), AllocatorError> {
    if let Ok(b) = oomkit_units::parse_bytes(text) {
        if b > 0 {
            return Ok((b, format!("capacity {}", oomkit_units::human_bytes(b))));
        }
    }
    let want = text.trim().to_ascii_uppercase().replace(['_', ' '], "-");
    match GPUS.iter().find(|(n, _)| *n == want) {
        // The label stays short for a table's column; docs/whatif.md gives the arithmetic.
        Some((name, total)) => Ok((total - CONTEXT_BYTES, format!("capacity {name}"))),
        None => Err(AllocatorError::Capacity(
            text.to_string(),
            GPUS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_are_sizes_or_gpus() {
        assert_eq!(parse_capacity("80GiB").unwrap().0, 80 << 30);
        let (h100, label) = parse_capacity("h100").unwrap();
        assert_eq!(h100, gib_hundredths(7911) - CONTEXT_BYTES);
        assert_eq!(label, "capacity H100");
        assert!(parse_capacity("rtx 4090").is_ok());
        let e = parse_capacity("B300").unwrap_err().to_string();
        assert!(e.contains("H100") && e.contains("B300"), "{e}");
        assert!(parse_capacity("0").is_err());
    }

    #[test]
    fn batch_scales_are_fractions() {
        assert_eq!(Scenario::batch_scale("0.5").unwrap().batch_scale, Some(0.5));
        assert_eq!(Scenario::batch_scale("4/8").unwrap().batch_scale, Some(0.5));
        assert_eq!(
            Scenario::batch_scale("4/8").unwrap().label,
            "micro-batch x0.5"
        );
        for bad in ["0", "-1", "x", "4/0", "nan"] {
            assert!(Scenario::batch_scale(bad).is_err(), "{bad}");
        }
    }
}
