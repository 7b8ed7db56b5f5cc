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

/// A GPU people rent, by the names they give it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Its name in reports (`H100`), first, and the other names people use for it (`H100-SXM`).
    pub names: &'static [&'static str],
    /// The total memory CUDA reports for it (`total_memory`, the total of its out-of-memory message).
    pub total: u64,
    /// Its CUDA compute capability (major, minor): which cuBLAS workspace and attention kernels it gets.
    pub capability: (u8, u8),
}

impl Gpu {
    /// The name reports give it.
    pub fn name(&self) -> &'static str {
        self.names[0]
    }
}

/// GPUs by name, with the total memory CUDA reports for each (PyTorch's
/// out-of-memory message where one was found, else `nvidia-smi`'s total;
/// sources in docs/whatif.md) and the compute capability of its generation.
#[rustfmt::skip] // One GPU a line: the table reads as docs/whatif.md's.
pub const GPUS: [Gpu; 18] = [
    gpu(&["H100", "H100-SXM", "H100-80GB", "H100-SXM5", "H100-PCIE"], 7911, (9, 0)),
    gpu(&["H100-NVL", "H100-94GB"], 9300, (9, 0)),
    gpu(&["H200", "H200-141GB", "H200-SXM"], 13980, (9, 0)),
    gpu(&["B200", "B200-180GB"], 17835, (10, 0)),
    gpu(&["A100", "A100-80GB", "A100-SXM4-80GB", "A100-PCIE-80GB"], 7914, (8, 0)),
    gpu(&["A100-40GB", "A100-SXM4-40GB", "A100-PCIE-40GB"], 3950, (8, 0)),
    gpu(&["A30", "A30-24GB"], 2353, (8, 0)),
    gpu(&["L40S", "L40S-48GB"], 4440, (8, 9)),
    gpu(&["L40", "L40-48GB"], 4440, (8, 9)),
    gpu(&["L4", "L4-24GB"], 2249, (8, 9)),
    gpu(&["A10G", "A10", "A10-24GB"], 2249, (8, 6)),
    gpu(&["A6000", "RTX-A6000"], 4799, (8, 6)),
    gpu(&["V100-32GB", "V100-SXM2-32GB", "V100-PCIE-32GB"], 3175, (7, 0)),
    gpu(&["V100", "V100-16GB", "V100-SXM2-16GB", "V100-PCIE-16GB"], 1578, (7, 0)),
    gpu(&["T4"], 1475, (7, 5)),
    gpu(&["RTX-3090", "GEFORCE-RTX-3090"], 2369, (8, 6)),
    gpu(&["RTX-4090", "GEFORCE-RTX-4090"], 2364, (8, 9)),
    gpu(&["RTX-5090", "GEFORCE-RTX-5090"], 3184, (12, 0)),
];

/// GPUs oomkit knows by name whose memory it does not model: AMD's, whose
/// ROCm allocator and kernels are not CUDA's. Named, they get a refusal that says so.
const NOT_MODELLED: [&str; 3] = ["MI300X", "MI250X", "MI325X"];

/// A table entry: the names, the total in hundredths of a GiB, the compute capability.
const fn gpu(names: &'static [&'static str], total_hundredths: u64, capability: (u8, u8)) -> Gpu {
    Gpu {
        names,
        total: gib_hundredths(total_hundredths),
        capability,
    }
}

/// The GPU a name gives (`h100`, `A100 80GB`, `rtx 4090`), or None.
pub fn gpu_named(text: &str) -> Option<&'static Gpu> {
    let want = normalized(text);
    GPUS.iter().find(|g| g.names.iter().any(|n| *n == want))
}

/// A GPU's name as the table writes it: upper case, words joined by `-`, a leading `NVIDIA` left out.
fn normalized(text: &str) -> String {
    let upper = text.trim().to_ascii_uppercase().replace(['_', ' '], "-");
    upper.strip_prefix("NVIDIA-").unwrap_or(&upper).to_string()
}

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
    if let Some(g) = gpu_named(text) {
        // The label stays short for a table's column; docs/whatif.md gives the arithmetic.
        return Ok((g.total - CONTEXT_BYTES, format!("capacity {}", g.name())));
    }
    let want = normalized(text);
    if NOT_MODELLED.iter().any(|n| want.starts_with(n)) {
        return Err(AllocatorError::NotModelled(format!(
            "--capacity {text:?}: an AMD GPU, whose ROCm allocator and kernels oomkit does not model; give its memory as a size (192GB) for a figure from CUDA's"
        )));
    }
    Err(AllocatorError::Capacity(
        text.to_string(),
        GPUS.iter().map(|g| g.name()).collect::<Vec<_>>().join(", "),
    ))
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
    fn gpus_are_found_by_the_names_people_use() {
        // A100 alone means the 80 GB one, as clouds rent it; the 40 GB one is named.
        let a100 = gpu_named("A100").unwrap();
        assert_eq!((a100.name(), a100.total), ("A100", gib_hundredths(7914)));
        assert_eq!(gpu_named("a100 40gb").unwrap().name(), "A100-40GB");
        assert_eq!(gpu_named("NVIDIA H100 SXM").unwrap().name(), "H100");
        assert_eq!(gpu_named("h200").unwrap().capability, (9, 0));
        assert_eq!(gpu_named("B200").unwrap().capability, (10, 0));
        assert_eq!(gpu_named("a10g").unwrap().capability, (8, 6));
        assert_eq!(gpu_named("V100-32GB").unwrap().total, gib_hundredths(3175));
        // A bare number is a size in bytes, never a GPU's name.
        assert_eq!(parse_capacity("4090").unwrap().0, 4090);
        assert_eq!(
            gpu_named("NVIDIA GeForce RTX 4090").unwrap().name(),
            "RTX-4090"
        );
        // Every name is found, each belongs to one GPU, and every total is below what it is sold as.
        let mut seen = std::collections::HashSet::new();
        for g in GPUS {
            assert!(g.total < 200 << 30 && g.total > 14 << 30, "{}", g.name());
            for n in g.names {
                assert!(seen.insert(*n), "{n} twice");
                assert_eq!(gpu_named(n), Some(&g));
            }
        }
    }

    #[test]
    fn an_amd_gpu_is_refused_with_what_to_give_instead() {
        let e = parse_capacity("MI300X").unwrap_err().to_string();
        assert!(e.contains("ROCm") && e.contains("192GB"), "{e}");
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
