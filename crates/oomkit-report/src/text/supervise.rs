//! The terminal form of what `oomkit run` and `oomkit find-batch` did: the
//! attempts, the trials and the recommendation.

use oomkit_supervise::find_batch::FindBatchReport;
use oomkit_supervise::RunSummary;
use oomkit_units::human_bytes;
use serde::Serialize;
use std::fmt::Write;

/// A vocabulary value as its JSON string.
fn snake<T: Serialize>(v: &T) -> Option<String> {
    serde_json::to_value(v)
        .ok()
        .and_then(|x| x.as_str().map(String::from))
}

fn join(ids: &[u32]) -> String {
    ids.iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The attempts as a table for the terminal.
pub fn run_summary(summary: &RunSummary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "oomkit run: {} after {}",
        summary.outcome,
        oomkit_units::count(summary.attempts.len() as u64, "attempt", "attempts")
    );
    let _ = writeln!(
        out,
        "  {:<3} {:>11} {:>6} {:>9} {:<10} {:>5} {:<24} {:<19} {:>8}",
        "#", "micro-batch", "accum", "effective", "device", "exit", "OOM", "then", "time"
    );
    for a in &summary.attempts {
        let dash = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_else(|| "-".into());
        let device = match (a.device, a.gpus.is_empty()) {
            ("cuda", false) => format!("cuda:{}", join(&a.gpus)),
            (d, _) => d.to_string(),
        };
        let word = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let oom = match (a.oom, a.cause) {
            (false, _) => "no".to_string(),
            (true, None) => "yes".to_string(),
            (true, Some(c)) => word(snake(&c)),
        };
        let _ = writeln!(
            out,
            "  {:<3} {:>11} {:>6} {:>9} {:<10} {:>5} {:<24} {:<19} {:>7.1}s",
            a.attempt,
            dash(a.batch_size),
            dash(a.grad_accum),
            dash(a.effective_batch),
            device,
            a.exit_code,
            oom,
            word(a.action.and_then(|x| snake(&x))),
            a.seconds
        );
        if a.plan_applied == Some(false) {
            let _ = writeln!(
                out,
                "      plan not applied: the command did not train with micro-batch {} x accumulation {}{}",
                dash(a.batch_size),
                dash(a.grad_accum),
                a.plan_not_applied
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            );
        }
    }
    for n in &summary.notes {
        let _ = writeln!(out, "  note: {n}");
    }
    out
}

/// The trials and the recommendation for the terminal.
pub fn find_batch(report: &FindBatchReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  {:<3} {:>11} {:>12} {:<22}",
        "#", "micro-batch", "peak", "result"
    );
    for (i, t) in report.trials.iter().enumerate() {
        let result = if t.ok {
            "fits"
        } else if t.oom {
            "out of memory / failed"
        } else {
            "over budget"
        };
        let _ = writeln!(
            out,
            "  {:<3} {:>11} {:>12} {:<22}",
            i + 1,
            t.batch,
            t.peak_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
            result
        );
    }
    if let (Some(f), Some(p)) = (report.fixed_bytes, report.per_sample_bytes) {
        let _ = writeln!(
            out,
            "fit: memory = {} + {} x batch",
            human_bytes(f.max(0.0) as u64),
            human_bytes(p.max(0.0) as u64)
        );
    }
    match report.recommended_batch {
        Some(b) => {
            let _ = write!(
                out,
                "recommended micro-batch: {b} (within {} of {})",
                human_bytes(report.budget_bytes),
                human_bytes(report.capacity_bytes)
            );
            if let (Some(e), Some(a), Some(m)) = (
                report.effective_batch,
                report.grad_accum,
                report.micro_batch_for_effective,
            ) {
                let _ = write!(
                    out,
                    "; for effective batch {e}: micro-batch {m} x accumulation {a}"
                );
                if a * m != e {
                    let _ = write!(out, " (= {} samples per step)", a * m);
                }
            }
            let _ = writeln!(out, " [{} runs]", report.trials.len());
        }
        None => {
            let _ = writeln!(
                out,
                "no micro-batch fits in {}",
                human_bytes(report.budget_bytes)
            );
        }
    }
    out
}
