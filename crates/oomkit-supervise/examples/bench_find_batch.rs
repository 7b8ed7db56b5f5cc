//! Counts the runs `oomkit find-batch` needs against Lightning's binsearch on
//! the same memory curves, and how close each gets to the true largest batch.
//!
//! Run: cargo run --release -p oomkit-supervise --example bench_find_batch
#![allow(clippy::print_stdout)]

use oomkit_supervise::search::{lightning_binsearch, search, SearchConfig, SearchResult, Trial};

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

/// A memory curve: peak bytes at each micro-batch.
struct Curve {
    name: &'static str,
    capacity: f64,
    peak: Box<dyn Fn(u64) -> f64>,
}

/// A deterministic jitter in [-1, 1], so runs are reproducible.
fn jitter(b: u64) -> f64 {
    let x = b.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) >> 11;
    (x as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
}

fn curves() -> Vec<Curve> {
    vec![
        Curve {
            name: "7B LoRA, affine (20 GiB + 600 MiB/sample, 80 GiB)",
            capacity: 80.0 * GIB,
            peak: Box::new(|b| 20.0 * GIB + 600.0 * MIB * b as f64),
        },
        Curve {
            name: "ResNet-50, 20 MiB allocator blocks (1.5 GiB + 95 MiB/sample, 24 GiB)",
            capacity: 24.0 * GIB,
            peak: Box::new(|b| 1.5 * GIB + ((95.0 * b as f64) / 20.0).ceil() * 20.0 * MIB),
        },
        Curve {
            name: "GPT-2 small, +-1% noise (3 GiB + 180 MiB/sample, 40 GiB)",
            capacity: 40.0 * GIB,
            peak: Box::new(|b| (3.0 * GIB + 180.0 * MIB * b as f64) * (1.0 + 0.01 * jitter(b))),
        },
        Curve {
            name: "ViT with a quadratic workspace (2 GiB + 40 MiB*b + 0.05 MiB*b^2, 80 GiB)",
            capacity: 80.0 * GIB,
            peak: Box::new(|b| 2.0 * GIB + 40.0 * MIB * b as f64 + 0.05 * MIB * (b * b) as f64),
        },
        Curve {
            name:
                "U-Net, cuDNN switches algorithm above 48 (+3 GiB; 4 GiB + 300 MiB/sample, 48 GiB)",
            capacity: 48.0 * GIB,
            peak: Box::new(|b| {
                4.0 * GIB + 300.0 * MIB * b as f64 + if b > 48 { 3.0 * GIB } else { 0.0 }
            }),
        },
        Curve {
            name: "small MLP, fixed part dominates (6 GiB + 2 MiB/sample, 16 GiB)",
            capacity: 16.0 * GIB,
            peak: Box::new(|b| 6.0 * GIB + 2.0 * MIB * b as f64),
        },
    ]
}

fn probe(curve: &Curve) -> impl FnMut(u64) -> Trial + '_ {
    move |b| {
        let m = (curve.peak)(b);
        let oom = m > curve.capacity;
        Trial {
            batch: b,
            ok: !oom,
            oom,
            peak_bytes: (!oom).then_some(m as u64),
        }
    }
}

fn truth(curve: &Curve, budget: u64, max: u64) -> u64 {
    (1..=max)
        .take_while(|b| (curve.peak)(*b) <= budget as f64)
        .last()
        .unwrap_or(0)
}

fn row(r: &SearchResult, truth: u64) -> String {
    let got = r.recommended_batch.unwrap_or(0);
    let err = 100.0 * (truth as f64 - got as f64) / truth as f64;
    format!("{} runs, batch {got} ({err:.1}% under)", r.trials.len())
}

fn main() {
    let max = 1 << 16;
    println!("| curve | true largest | oomkit find-batch | Lightning binsearch |");
    println!("|---|---|---|---|");
    let (mut ours, mut theirs, mut n) = (0usize, 0usize, 0usize);
    for c in curves() {
        let cfg = SearchConfig {
            start: 1,
            max,
            capacity_bytes: c.capacity as u64,
            margin: 0.1,
            exact: false,
        };
        let t = truth(&c, cfg.budget(), max);
        let a = search(&cfg, &mut probe(&c));
        // Lightning starts at its default init_val of 2.
        let lcfg = SearchConfig { start: 2, ..cfg };
        let b = lightning_binsearch(&lcfg, &mut probe(&c));
        ours += a.trials.len();
        theirs += b.trials.len();
        n += 1;
        println!("| {} | {t} | {} | {} |", c.name, row(&a, t), row(&b, t));
        if std::env::var_os("TRACE").is_some() {
            let runs: Vec<_> = a
                .trials
                .iter()
                .map(|t| (t.batch, t.ok, t.peak_bytes.map(|p| p >> 20)))
                .collect();
            println!("{runs:?}");
        }
    }
    println!(
        "\nmean runs: oomkit {:.1}, Lightning binsearch {:.1} ({:.1}x fewer)",
        ours as f64 / n as f64,
        theirs as f64 / n as f64,
        theirs as f64 / ours as f64
    );
}
