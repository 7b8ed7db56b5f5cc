//! The terminal form of a comparison: each device's peak before and after,
//! each role's bytes at the peaks, the sites that changed and each stage's peak.

use oomkit_compare::{Diff, SiteDelta};
use oomkit_runlog::MeasureKind;
use oomkit_units::human_bytes;
use std::fmt::Write;

fn signed(d: i64) -> String {
    let s = human_bytes(d.unsigned_abs());
    match d.signum() {
        1 => format!("+{s}"),
        -1 => format!("-{s}"),
        _ => "±0 B".into(),
    }
}

fn relative(a: u64, d: i64) -> String {
    if a == 0 {
        return String::new();
    }
    format!(" ({:+.0}%)", 100.0 * d as f64 / a as f64)
}

/// Renders a comparison for a terminal, listing at most `top` sites per device.
pub fn diff(diff: &Diff, top: usize) -> String {
    let mut out = String::new();
    let of = |attempt: Option<u64>| {
        attempt
            .map(|n| format!(" (attempt {n})"))
            .unwrap_or_default()
    };
    let _ = writeln!(
        out,
        "== A: {}{}\n== B: {}{}",
        diff.file_a,
        of(diff.attempt_a),
        diff.file_b,
        of(diff.attempt_b)
    );
    for d in &diff.devices {
        let _ = write!(
            out,
            "\n{}: peak {} -> {}, {}{}; reserved {} -> {}; OOMs {} -> {}",
            d.device,
            human_bytes(d.peak_active_bytes_a),
            human_bytes(d.peak_active_bytes_b),
            signed(d.peak_active_bytes_delta),
            relative(d.peak_active_bytes_a, d.peak_active_bytes_delta),
            human_bytes(d.peak_reserved_bytes_a),
            human_bytes(d.peak_reserved_bytes_b),
            d.ooms_a,
            d.ooms_b
        );
        match d.only_in {
            Some(which) => {
                let _ = writeln!(out, " (only in {})", which.to_uppercase());
            }
            None => out.push('\n'),
        }
        if !d.roles.is_empty() {
            let _ = writeln!(
                out,
                "  {:<16} {:>11} {:>11} {:>11}",
                "role", "at peak A", "at peak B", "delta"
            );
            for r in &d.roles {
                let _ = writeln!(
                    out,
                    "  {:<16} {:>11} {:>11} {:>11}",
                    r.role.words(),
                    human_bytes(r.bytes_a),
                    human_bytes(r.bytes_b),
                    signed(r.delta_bytes)
                );
            }
        }
        let changed: Vec<&SiteDelta> = d.sites.iter().filter(|s| s.delta_bytes != 0).collect();
        if !d.sites.is_empty() {
            if changed.is_empty() {
                let _ = writeln!(out, "  the same sites hold the same bytes at both peaks");
            } else {
                let _ = writeln!(
                    out,
                    "  {:<9} {:>11} {:>21}  site (live at the peak)",
                    "change", "delta", "A -> B"
                );
            }
            for s in changed.iter().take(top) {
                let _ = writeln!(
                    out,
                    "  {:<9} {:>11} {:>21}  {}",
                    s.change,
                    signed(s.delta_bytes),
                    format!("{} -> {}", human_bytes(s.bytes_a), human_bytes(s.bytes_b)),
                    s.site
                );
            }
            if changed.len() > top {
                let _ = writeln!(
                    out,
                    "  ... {} more changed sites (--top)",
                    changed.len() - top
                );
            }
        }
        if !d.stages.is_empty() {
            let _ = writeln!(
                out,
                "  {:<6} {:<12} {:>11} {:>11} {:>11}",
                "kind", "stage", "max peak A", "max peak B", "delta"
            );
            for s in &d.stages {
                // A peak under an earlier high-water mark is a lower bound.
                let show = |v: Option<u64>, at_least: bool| {
                    v.map_or("-".into(), |b| {
                        format!("{}{}", if at_least { ">=" } else { "" }, human_bytes(b))
                    })
                };
                let kind = match s.kind {
                    MeasureKind::Stage => "stage",
                    MeasureKind::Step => "step",
                    MeasureKind::Phase => "phase",
                };
                let _ = writeln!(
                    out,
                    "  {:<6} {:<12} {:>11} {:>11} {:>11}",
                    kind,
                    s.name,
                    show(s.max_peak_bytes_a, s.at_least_a),
                    show(s.max_peak_bytes_b, s.at_least_b),
                    signed(s.delta_bytes)
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_sizes_read_plainly() {
        assert_eq!(signed(1 << 20), "+1.00 MiB");
        assert_eq!(signed(-(3 << 30)), "-3.00 GiB");
        assert_eq!(signed(0), "±0 B");
        assert_eq!(relative(200, -50), " (-25%)");
        assert_eq!(relative(0, 5), "");
    }
}
