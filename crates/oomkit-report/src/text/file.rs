//! The terminal format: the verdict first, then each device or run, for people.

use oomkit_compare::{FileAnalysis, RunFile};
use oomkit_snapshot::DeviceReport;
use oomkit_units::{count, human_bytes};
use serde_json::Value;
use std::fmt::Write;

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".into();
    }
    format!("{:.0}%", 100.0 * part as f64 / whole as f64)
}

fn headline(d: &DeviceReport) -> String {
    let mut s = format!(
        "peak {} active on cuda:{}",
        human_bytes(d.peak_active_bytes),
        d.device
    );
    match (d.peak_event_index, d.top_sites_at) {
        (_, "snapshot") => s.push_str(" at snapshot time (no trace recorded)"),
        (Some(i), _) => {
            let _ = write!(s, " at event {i}");
            if let Some(t) = d.peak_offset_s {
                let _ = write!(s, " (+{t:.3} s)");
            }
        }
        (None, _) => s.push_str(" before the trace's first entry"),
    }
    if let Some(p) = &d.peak_phase {
        let _ = write!(s, ", in phase {p}");
    }
    s
}

fn device_text(d: &DeviceReport, out: &mut String) {
    let _ = writeln!(out, "{}", headline(d));
    let _ = writeln!(
        out,
        "  now: reserved {} in {}, active {}, allocated {}; peak reserved {}; {}",
        human_bytes(d.reserved_bytes),
        count(d.segments, "segment", "segments"),
        human_bytes(d.active_bytes),
        human_bytes(d.allocated_bytes),
        human_bytes(d.peak_reserved_bytes),
        count(d.events, "trace event", "trace events")
    );
    if d.pre_trace_active_bytes > 0 {
        let _ = writeln!(
            out,
            "  {} was already live before the trace's first entry",
            human_bytes(d.pre_trace_active_bytes)
        );
    }
    let roles = super::roles::role_lines(
        &d.roles.peak,
        &d.roles_evidence.peak,
        d.roles_unknown_reason.peak,
        "    ",
    );
    if !roles.is_empty() {
        let at = if d.top_sites_at == "peak" {
            "at the peak"
        } else {
            "at snapshot time"
        };
        let _ = write!(out, "\n  By role {at}\n{roles}");
    }
    if !d.top_sites.is_empty() {
        let at = if d.top_sites_at == "peak" {
            "at the peak"
        } else {
            "at snapshot time"
        };
        let _ = writeln!(out, "\n  Top allocation sites {at}");
        let _ = writeln!(
            out,
            "  {:>10}  {:>5}  {:>6}  site",
            "bytes", "share", "count"
        );
        for s in &d.top_sites {
            let _ = writeln!(
                out,
                "  {:>10}  {:>5}  {:>6}  {}",
                human_bytes(s.bytes),
                pct(s.bytes, d.peak_active_bytes),
                s.count,
                s.label
            );
        }
    }
    let f = &d.fragmentation;
    let _ = writeln!(
        out,
        "\n  Fragmentation: {} free inside segments ({} of reserved) in {}, largest {}; {} lost to rounding",
        human_bytes(f.external_bytes),
        pct(f.external_bytes, d.reserved_bytes),
        count(f.free_blocks, "block", "blocks"),
        human_bytes(f.largest_free_block_bytes),
        human_bytes(f.internal_bytes)
    );
    if !d.phases.is_empty() {
        let _ = writeln!(out, "\n  Phases (record_function ranges)");
        for p in d.phases.iter().take(8) {
            let _ = writeln!(
                out,
                "  {:>10}  +{:<10} x{:<4} {}",
                human_bytes(p.peak_active_bytes),
                human_bytes(p.max_growth_bytes),
                p.occurrences,
                p.name
            );
        }
    }
    for o in d.ooms.iter().take(OOMS_SHOWN) {
        oom_text(o, out);
    }
    if d.ooms.len() > OOMS_SHOWN {
        let _ = writeln!(
            out,
            "\n  ... and {} more {} (--json lists them all)",
            d.ooms.len() - OOMS_SHOWN,
            if d.ooms.len() - OOMS_SHOWN == 1 {
                "OOM entry"
            } else {
                "OOM entries"
            }
        );
    }
}

/// Most OOM entries a terminal report shows in full.
const OOMS_SHOWN: usize = 10;

fn settings_line(settings: &Value) -> Option<String> {
    let obj = settings.as_object()?;
    let pick = |k: &str| obj.get(k).map(|v| format!("{k}={v}"));
    let mut parts: Vec<String> = [
        "expandable_segments",
        "max_split_size",
        "garbage_collection_threshold",
    ]
    .iter()
    .filter_map(|k| pick(k))
    .collect();
    if let Some(conf) = obj.get("PYTORCH_CUDA_ALLOC_CONF").and_then(|v| v.as_str()) {
        let conf = if conf.is_empty() { "(unset)" } else { conf };
        parts.insert(0, format!("PYTORCH_CUDA_ALLOC_CONF={conf}"));
    }
    Some(parts.join(", "))
}

/// Renders one file's analysis for a terminal.
pub fn snapshot(file: &FileAnalysis) -> String {
    let mut out = String::new();
    let a = &file.analysis;
    let _ = writeln!(out, "== {} ({})", file.path, human_bytes(file.file_bytes));
    if a.devices.is_empty() {
        let _ = writeln!(out, "no device holds any memory in this snapshot");
    } else {
        let _ = writeln!(out, "{}", super::verdict(&a.verdict));
    }
    // The failing device first: the verdict's detail comes before the healthy ones.
    let failing = a.verdict.place.device.clone().filter(|_| a.verdict.failed);
    let mut order: Vec<&DeviceReport> = a.devices.iter().collect();
    order.sort_by_key(|d| Some(format!("cuda:{}", d.device)) != failing);
    for (i, d) in order.into_iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        device_text(d, &mut out);
    }
    if let Some(line) = a.allocator_settings.as_ref().and_then(settings_line) {
        let _ = writeln!(out, "\nAllocator: {line}");
    }
    if !a.findings.is_empty() {
        let _ = writeln!(out, "\nFindings");
        for f in &a.findings {
            let _ = writeln!(out, "  * {}", f.message);
            let _ = writeln!(out, "    -> {}", f.advice);
        }
    }
    if !a.warnings.is_empty() {
        let _ = writeln!(out, "\nWarnings");
        for w in &a.warnings {
            let _ = writeln!(out, "  ! {}", w.message);
            let _ = writeln!(out, "    fix: {}", w.fix);
        }
    }
    out
}

/// A share as a percentage that never rounds a real part to nothing: 12%, 0.4%, <0.1%.
fn share(fraction: f64) -> String {
    let pct = 100.0 * fraction;
    if pct >= 1.0 {
        format!("{pct:.0}%")
    } else if pct >= 0.1 {
        format!("{pct:.1}%")
    } else {
        "<0.1%".to_string()
    }
}

/// One line saying which micro-batch plan the run used and who chose it.
fn plan_line(p: &oomkit_runlog::Plan) -> String {
    let n = |v: Option<u64>| v.map_or_else(|| "?".to_string(), |x| x.to_string());
    let by = match (p.source.as_str(), p.attempt) {
        ("", _) => String::new(),
        (s, Some(a)) => format!(", from {s} (attempt {a})"),
        (s, None) => format!(", from {s}"),
    };
    let on = if p.framework.is_empty() {
        String::new()
    } else {
        format!(" in {}", p.framework)
    };
    let not_applied = match (p.applied, &p.not_applied) {
        (Some(false), Some(why)) => format!("; the plan handed down was not applied: {why}"),
        (Some(false), None) => "; the plan handed down was not applied".to_string(),
        _ => String::new(),
    };
    format!(
        "plan: micro-batch {} x accumulation {} = {} samples per optimizer step{by}{on}{not_applied}",
        n(p.micro_batch),
        n(p.grad_accum),
        n(p.effective_batch)
    )
}

/// Renders a run log's analysis for a terminal.
pub fn run(run: &RunFile) -> String {
    let a = &run.analysis;
    let mut out = String::new();
    let dev = if a.device.is_empty() {
        "unknown device"
    } else {
        &a.device
    };
    let _ = writeln!(out, "== {} (run log, rank {}, {dev})", run.path, a.rank);
    let _ = writeln!(out, "{}", super::verdict(&a.verdict));
    let cap = a
        .capacity_bytes
        .map(|c| format!(" of {}", human_bytes(c)))
        .unwrap_or_default();
    let peak = match a.peak_bytes {
        Some(p) => format!("peak {}{cap}", human_bytes(p)),
        None => "no memory figure recorded".to_string(),
    };
    if a.steps > 0 {
        let _ = writeln!(
            out,
            "{}{}, {peak}",
            count(a.steps, "step", "steps"),
            if a.steps_from_optimizer {
                " (the optimizer's steps: the code marks none)"
            } else {
                ""
            }
        );
    } else if let (Some(why), false) = (&a.no_steps, a.ooms.is_empty()) {
        let _ = writeln!(out, "{why}; {peak}");
    } else {
        let _ = writeln!(out, "no training step; {peak}");
        if let Some(why) = &a.no_steps {
            let _ = writeln!(out, "  {why}");
        }
    }
    if let Some(p) = &a.plan {
        let _ = writeln!(out, "{}", plan_line(p));
    }
    if !a.stages.is_empty() {
        let _ = writeln!(
            out,
            "\n  {:<14} {:>6} {:>10} {:>10} {:>11} {:>9}",
            "stage", "count", "mean peak", "max peak", "mean delta", "mean time"
        );
        for s in &a.stages {
            let label = match s.kind {
                oomkit_runlog::MeasureKind::Phase => format!("[{}]", s.name),
                _ => s.name.clone(),
            };
            let delta = if s.mean_delta_bytes < 0 {
                format!("-{}", human_bytes(s.mean_delta_bytes.unsigned_abs()))
            } else {
                format!("+{}", human_bytes(s.mean_delta_bytes as u64))
            };
            // A peak reached under an earlier high-water mark is a lower bound.
            let mean_peak = if s.peaks_bounded > 0 {
                format!(">={}", human_bytes(s.mean_peak_bytes))
            } else {
                human_bytes(s.mean_peak_bytes)
            };
            let max_peak = if s.max_peak_at_most_bytes.is_some() {
                format!(">={}", human_bytes(s.max_peak_bytes))
            } else {
                human_bytes(s.max_peak_bytes)
            };
            let _ = writeln!(
                out,
                "  {:<14} {:>6} {:>10} {:>10} {:>11} {:>8.1}ms",
                label,
                s.count,
                mean_peak,
                max_peak,
                delta,
                s.mean_seconds * 1000.0
            );
        }
    }
    if a.stages.iter().any(|s| s.peaks_bounded > 0) {
        let _ = writeln!(
            out,
            "\n  >= a lower bound: the tracker reads the process's high-water mark without resetting it (other tools read it too), so a stage that stays under an earlier peak is known only from its start and end up to that peak"
        );
    }
    if let Some(g) = &a.largest_growth {
        let _ = writeln!(
            out,
            "\n  Largest growth: {} adds {}{} on top of what was there ({}{} of the peak)",
            g.name,
            if g.at_least { "at least " } else { "" },
            human_bytes(g.mean_rise_bytes),
            if g.at_least { "at least " } else { "" },
            share(g.share_of_peak)
        );
    }
    if let Some(c) = &a.components {
        let _ = writeln!(
            out,
            "  Components: parameters {} (trainable {}, frozen {}), buffers {}, gradients {}, optimizer state {}, EMA {}",
            human_bytes(c.params_bytes),
            human_bytes(c.trainable_bytes),
            human_bytes(c.frozen_bytes),
            human_bytes(c.buffers_bytes),
            human_bytes(c.grads_bytes),
            human_bytes(c.optimizer_state_bytes),
            human_bytes(c.ema_bytes)
        );
    }
    if !a.findings.is_empty() {
        let _ = writeln!(out, "\nFindings");
        for f in &a.findings {
            let _ = writeln!(out, "  * [{}] {}", f.kind, f.message);
            let _ = writeln!(out, "    -> {}", f.advice);
        }
    } else {
        let _ = writeln!(
            out,
            "\nNo findings: no leak, duplicate copy, eval spike or bad gradient."
        );
    }
    if !a.warnings.is_empty() {
        let _ = writeln!(out, "\nWarnings");
        for w in &a.warnings {
            let _ = writeln!(out, "  ! {}", w.message);
        }
    }
    out
}

/// One OOM entry of a snapshot: what was asked, the cause and its figures,
/// the live bytes by role and the largest holders.
pub(crate) fn oom_text(o: &oomkit_snapshot::OomReport, out: &mut String) {
    let _ = writeln!(
        out,
        "\n  OOM at event {}: {} requested at {}",
        o.event_index,
        human_bytes(o.requested_bytes),
        o.label
    );
    let _ = writeln!(
        out,
        "    cause: {} ({} live, {} reserved but unallocated, {} free on the device)",
        o.cause,
        human_bytes(o.live_bytes),
        human_bytes(o.reserved_unallocated_bytes),
        human_bytes(o.free_bytes)
    );
    let roles = super::roles::role_lines(
        &o.roles,
        &o.roles_evidence,
        o.roles_unknown_reason,
        "      ",
    );
    if !roles.is_empty() {
        let _ = write!(out, "    by role:\n{roles}");
    }
    if !o.top_holders.is_empty() {
        let _ = writeln!(out, "    largest holders:");
    }
    for h in &o.top_holders {
        let _ = writeln!(out, "    {:>10}  {}", human_bytes(h.bytes), h.label);
    }
}

/// A snapshot's first OOM explained (`oomkit explain SNAPSHOT`): the
/// verdict, the OOM in detail and the findings about it.
pub fn snapshot_oom(file: &FileAnalysis) -> String {
    let a = &file.analysis;
    let mut out = super::verdict(&a.verdict);
    if let Some((d, o)) = file.first_oom() {
        oom_text(o, &mut out);
        let about: Vec<_> = a
            .findings
            .iter()
            .filter(|f| {
                f.device == Some(d) && (f.event == Some(o.event_index) || f.replayed.is_some())
            })
            .collect();
        if !about.is_empty() {
            let _ = writeln!(out, "\nFindings about it");
        }
        for f in about {
            let _ = writeln!(out, "  * {}\n    -> {}", f.message, f.advice);
        }
    }
    let _ = writeln!(
        out,
        "\n`oomkit whatif {}` replays the trace under other allocator settings, capacities and micro-batches; `oomkit analyze {}` reports the whole file",
        file.path, file.path
    );
    out
}
