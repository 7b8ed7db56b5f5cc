//! The terminal form of `oomkit preflight`: the verdict against the
//! capacity first, then the peaks, what held them by role and by line,
//! the search, and what the preflight assumed.

use crate::preflight::PreflightReport;
use oomkit_advice::Role;
use oomkit_units::human_bytes;
use std::fmt::Write;

/// Lines of the user's code listed.
const LINES_SHOWN: usize = 5;

/// Host memory held for the GPU is a line of its own from this much (or any pinned): a
/// loss or a few logits read back are not worth one.
const HOST_SHOWN_BYTES: u64 = 1 << 20;

/// A preflight for the terminal.
pub fn preflight(r: &PreflightReport) -> String {
    let run = &r.run;
    let mut out = String::new();
    let accum = |a: Option<u64>| match a {
        Some(a) if a > 1 => format!(" x accumulation {a}"),
        _ => String::new(),
    };
    let micro = run
        .micro_batch
        .map(|b| format!("micro-batch {b}{}", accum(run.grad_accum)));
    // With a search over another placeholder, the run reported is the one at its smallest value.
    let knob = r
        .searched
        .as_deref()
        .filter(|&name| name != "batch")
        .zip(r.tried.first())
        .map(|(name, &(lo, _))| format!("{name}={lo}"));
    let batch = match (micro, knob) {
        (Some(m), Some(k)) => format!("{m}, {k}"),
        (Some(m), None) => m,
        (None, Some(k)) => k,
        (None, None) => "the script's micro-batch".to_string(),
    };
    let verdict = if run.fits { "fits" } else { "does NOT fit" };
    let margin = run.margin_bytes.unsigned_abs();
    let _ = writeln!(
        out,
        "{batch} {verdict} {} ({} for the allocator): {} {}",
        run.capacity,
        human_bytes(run.capacity_bytes),
        human_bytes(margin),
        if run.margin_bytes >= 0 {
            "to spare"
        } else {
            "short"
        },
    );
    let ran = if run.mode == "inference" {
        format!(
            "{} forward(s) of the model and no backward (inference)",
            run.forwards
        )
    } else {
        format!("{} step(s)", run.steps)
    };
    let _ = writeln!(
        out,
        "  peak reserved {}, peak allocated {}, {} free inside segments at the peak; {ran}, {} allocations on meta tensors",
        human_bytes(run.peak_reserved_bytes),
        human_bytes(run.peak_allocated_bytes),
        human_bytes(run.free_in_segments_at_peak_bytes),
        run.allocations,
    );
    if run.host_peak_bytes >= HOST_SHOWN_BYTES || run.host_pinned_peak_bytes > 0 {
        let _ = writeln!(
            out,
            "  host memory held for the GPU: {} at most, {} of it pinned (copies of GPU tensors and pinned buffers, outside the GPU's figures)",
            human_bytes(run.host_peak_bytes),
            human_bytes(run.host_pinned_peak_bytes),
        );
    }
    if run.host_paged_peak_bytes > 0 {
        let _ = writeln!(
            out,
            "  paged (unified) memory: {} at most (paged optimizer state: on the GPU while there is room, moved to the host when not; outside PyTorch's allocator and the peaks above)",
            human_bytes(run.host_paged_peak_bytes),
        );
    }
    if let Some(&eval) = run.phase_peaks.get("eval") {
        let _ = writeln!(
            out,
            "  evaluation (forwards without gradients) peaks at {} allocated, training at {}",
            human_bytes(eval),
            human_bytes(
                run.phase_peaks
                    .iter()
                    .filter(|(k, _)| k.as_str() != "eval")
                    .map(|(_, v)| *v)
                    .max()
                    .unwrap_or(0)
            )
        );
    }
    ran_out(&mut out, run);
    steps(&mut out, run);
    roles(&mut out, run);
    if !run.by_line.is_empty() {
        let _ = writeln!(out, "\n  Lines holding the most at the peak");
        for l in run.by_line.iter().take(LINES_SHOWN) {
            let _ = writeln!(
                out,
                "    {:>10}  {:<16} {}",
                human_bytes(l.bytes),
                l.role.replace('_', " "),
                l.line
            );
        }
    }
    if !r.tried.is_empty() {
        let tried: Vec<String> = r
            .tried
            .iter()
            .map(|(b, ok)| format!("{b} {}", if *ok { "fits" } else { "no" }))
            .collect();
        let _ = writeln!(out);
        // A placeholder other than `{batch}` (`--search NAME=LO..HI`), or the micro-batch.
        let line = match (
            r.searched.as_deref().filter(|n| *n != "batch"),
            r.largest.flatten(),
        ) {
            (Some(name), Some(v)) => format!("largest {name} that fits: {v}"),
            (Some(name), None) => format!("no {name} tried fits"),
            (None, _) => match r.largest_micro_batch {
                Some(b) => format!(
                    "largest micro-batch that fits: {b}{}",
                    r.largest_grad_accum
                        .map_or(String::new(), |a| format!(" x accumulation {a}"))
                ),
                None => "no micro-batch tried fits".to_string(),
            },
        };
        let _ = writeln!(out, "{line} (tried {})", tried.join(", "));
    }
    fixes(&mut out, r);
    if !run.notes.is_empty() {
        let _ = writeln!(out);
        for n in &run.notes {
            let _ = writeln!(out, "note: {n}");
        }
    }
    if let Some(s) = &run.snapshot {
        let _ = writeln!(
            out,
            "snapshot: {s} (oomkit analyze, report and whatif open it)"
        );
    }
    out
}

/// What would make it fit: each change run on the script, with its peaks and cost.
fn fixes(out: &mut String, r: &PreflightReport) {
    if r.fixes.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nWhat would make it fit, each change run on the script (peaks against {}):",
        human_bytes(r.run.capacity_bytes)
    );
    let width = r.fixes.iter().map(|f| f.change.len()).max().unwrap_or(0);
    let _ = writeln!(
        out,
        "  {:width$}  {:>13}  {:>14}  {:<4}  cost",
        "change", "peak reserved", "peak allocated", "fits"
    );
    for f in &r.fixes {
        let _ = writeln!(
            out,
            "  {:width$}  {:>13}  {:>14}  {:<4}  {}",
            f.change,
            human_bytes(f.peak_reserved_bytes),
            human_bytes(f.peak_allocated_bytes),
            if f.fits { "yes" } else { "no" },
            // A change the script already makes was not run: its figures are the script's own.
            f.already.as_deref().unwrap_or(&f.cost)
        );
    }
    for n in &r.fix_notes {
        let _ = writeln!(out, "  note: {n}");
    }
}

/// Where the GPU ran out as the script ran: whether the figures are of what it ran after, or of
/// a second run with nothing refused.
fn ran_out(out: &mut String, run: &crate::preflight::PreflightRun) {
    let Some(o) = &run.out_of_memory else {
        return;
    };
    let first = format!(
        "tried to allocate {} at {}",
        human_bytes(o.first_bytes),
        o.first_at
    );
    if o.went_on {
        let _ = writeln!(
            out,
            "  the GPU ran out {} time(s) and the script caught it and went on (first: {first}): the figures are of what it ran after",
            o.raised
        );
    } else {
        let caught = if o.raised > 1 {
            format!(", after catching {} and trying again", o.raised - 1)
        } else {
            String::new()
        };
        let ended = o
            .ended
            .as_deref()
            .map_or(String::new(), |e| format!("; it then ended: {e}"));
        let _ = writeln!(
            out,
            "  on this GPU the script stops with CUDA out of memory ({first}{caught}{ended}); the figures are of a second run with nothing refused"
        );
    }
}

/// Each step's own peak, where they differ: the figure a script that resets the peak at every
/// step logs (the first usually runs without the optimizer's state).
fn steps(out: &mut String, run: &crate::preflight::PreflightRun) {
    let peaks = &run.step_peaks;
    if peaks.len() < 2 || peaks.iter().all(|&p| p == peaks[0]) {
        return;
    }
    let each: Vec<String> = peaks
        .iter()
        .enumerate()
        .map(|(i, &p)| format!("step {} {}", i + 1, human_bytes(p)))
        .collect();
    let _ = writeln!(out, "  peak allocated step by step: {}", each.join(", "));
}

/// Preflight's role for a copy of the weights kept in step with them (an EMA, an averaged model).
const PREFLIGHT_EMA: &str = "ema";

/// What held the peak by role, as shares of the peak allocated they add up to.
fn roles(out: &mut String, run: &crate::preflight::PreflightRun) {
    let total: u64 = run.by_role.values().sum();
    if total > 0 {
        // Shares of the headline's figure, which the roles add up to (each
        // allocation counted as the block the allocator handed it).
        let whole = run.peak_allocated_bytes.max(1);
        let _ = writeln!(out, "\n  By role at the peak");
        // The vocabulary's roles in their order, with those only preflight
        // tells where they belong (an EMA after the optimizer's state), and
        // any other after the activations (a generation's cache).
        let mut order: Vec<(&str, String)> = Vec::new();
        for role in Role::ALL {
            order.push((role.key(), role.words().to_string()));
            if role == Role::OptimizerState {
                order.push((PREFLIGHT_EMA, "EMA".to_string()));
            }
            if role == Role::Activations {
                for key in run.by_role.keys() {
                    if key != PREFLIGHT_EMA && Role::ALL.iter().all(|r| r.key() != key) {
                        order.push((key, key.replace('_', " ")));
                    }
                }
            }
        }
        for (key, words) in order {
            if let Some(&b) = run.by_role.get(key).filter(|&&b| b > 0) {
                let _ = writeln!(
                    out,
                    "    {:<18} {:>10} {:>5.0}%",
                    words,
                    human_bytes(b),
                    b as f64 * 100.0 / whole as f64
                );
            }
        }
        if total != run.peak_allocated_bytes {
            // Only an answer written before the roles were counted in blocks differs.
            let _ = writeln!(
                out,
                "    the roles add up to {}, not the peak allocated {}: they count what each tensor asked for, the peak the blocks it was handed",
                human_bytes(total),
                human_bytes(run.peak_allocated_bytes)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preflight::{LineBytes, OutOfMemory, PreflightRun};

    #[test]
    fn a_knob_search_names_the_value_its_run_was_at() {
        let gib = 1u64 << 30;
        let run = PreflightRun {
            capacity_bytes: 24 * gib,
            capacity: "24GiB".into(),
            fits: true,
            margin_bytes: 20 * gib as i64,
            ..Default::default()
        };
        let r = PreflightReport {
            run: run.clone(),
            tried: vec![(512, true), (1024, true), (2048, false)],
            searched: Some("seq".into()),
            largest: Some(Some(1024)),
            ..Default::default()
        };
        assert!(
            preflight(&r).starts_with("seq=512 fits 24GiB"),
            "{}",
            preflight(&r)
        );
        let both = PreflightReport {
            run: PreflightRun {
                micro_batch: Some(8),
                ..run
            },
            ..r
        };
        assert!(
            preflight(&both).starts_with("micro-batch 8, seq=512 fits 24GiB"),
            "{}",
            preflight(&both)
        );
    }

    #[test]
    fn where_the_gpu_ran_out_says_whether_the_figures_are_after_it_or_a_second_run() {
        let gib = 1u64 << 30;
        let report = |o: OutOfMemory| PreflightReport {
            run: PreflightRun {
                capacity: "2GiB".into(),
                capacity_bytes: 2 * gib,
                fits: o.went_on,
                out_of_memory: Some(o),
                ..Default::default()
            },
            ..Default::default()
        };
        let caught = OutOfMemory {
            raised: 2,
            first_bytes: gib,
            first_at: "halving.py:27 (train_step)".into(),
            went_on: true,
            ended: None,
        };
        let text = preflight(&report(caught.clone()));
        assert!(
            text.contains("the GPU ran out 2 time(s) and the script caught it and went on (first: tried to allocate 1.00 GiB at halving.py:27 (train_step)): the figures are of what it ran after"),
            "{text}"
        );
        let stopped = OutOfMemory {
            went_on: false,
            ended: Some("RuntimeError: no batch size fits (at train.py:9 (<module>))".into()),
            ..caught
        };
        let text = preflight(&report(stopped));
        assert!(
            text.contains("on this GPU the script stops with CUDA out of memory (tried to allocate 1.00 GiB at halving.py:27 (train_step), after catching 1 and trying again; it then ended: RuntimeError: no batch size fits (at train.py:9 (<module>))); the figures are of a second run with nothing refused"),
            "{text}"
        );
        assert!(!preflight(&PreflightReport::default()).contains("ran out"));
    }

    #[test]
    fn each_steps_peak_is_shown_only_where_the_steps_differ() {
        let gib = 1u64 << 30;
        let report = |step_peaks: Vec<u64>| PreflightReport {
            run: PreflightRun {
                steps: step_peaks.len() as u64,
                capacity: "24GiB".into(),
                capacity_bytes: 24 * gib,
                fits: true,
                step_peaks,
                ..Default::default()
            },
            ..Default::default()
        };
        let text = preflight(&report(vec![4 * gib, 5 * gib]));
        assert!(
            text.contains("peak allocated step by step: step 1 4.00 GiB, step 2 5.00 GiB"),
            "{text}"
        );
        for same in [vec![5 * gib, 5 * gib], vec![5 * gib], vec![]] {
            assert!(!preflight(&report(same)).contains("step by step"));
        }
    }

    #[test]
    fn the_verdict_comes_first_and_roles_follow_oomkits_order() {
        let gib = 1u64 << 30;
        let run = PreflightRun {
            micro_batch: Some(8),
            steps: 2,
            peak_allocated_bytes: 70 * gib,
            peak_reserved_bytes: 82 * gib,
            capacity_bytes: 78 * gib,
            capacity: "H100".into(),
            fits: false,
            margin_bytes: -(4 * gib as i64),
            by_role: [
                ("activations".to_string(), 40 * gib),
                ("kv_cache".to_string(), 5 * gib),
                ("ema".to_string(), 5 * gib),
                ("parameters".to_string(), 20 * gib),
            ]
            .into(),
            by_line: vec![LineBytes {
                line: "train.py:28 (forward)".into(),
                role: "activations".into(),
                bytes: 30 * gib,
            }],
            ..Default::default()
        };
        let r = PreflightReport {
            run,
            tried: vec![(8, false), (4, true)],
            largest_micro_batch: Some(4),
            ..Default::default()
        };
        let t = preflight(&r);
        assert!(
            t.starts_with(
                "micro-batch 8 does NOT fit H100 (78.0 GiB for the allocator): 4.00 GiB short"
            ),
            "{t}"
        );
        assert!(
            t.find("parameters").unwrap() < t.find("activations").unwrap(),
            "{t}"
        );
        // Preflight's own roles where they belong: the EMA beside the weights, the cache after the activations.
        let at = |s: &str| t.find(s).unwrap();
        assert!(
            at("    EMA ") < at("activations") && at("activations") < at("kv cache"),
            "{t}"
        );
        assert!(
            t.contains("largest micro-batch that fits: 4 (tried 8 no, 4 fits)"),
            "{t}"
        );
    }
}
