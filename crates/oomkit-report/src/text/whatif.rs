//! The terminal form of `oomkit whatif`: per device, what the replay
//! says against what the trace recorded, the scenarios side by side, and
//! one sentence per scenario with the answer.

use oomkit_allocator::{DeviceWhatIf, ScenarioOut, StartKind, WhatIf, FRESH_BASELINE};
use oomkit_units::{count, human_bytes};
use std::fmt::Write;

/// The what-ifs of one snapshot for the terminal.
pub fn whatif(file: &str, w: &WhatIf) -> String {
    let mut out = String::new();
    if w.devices.is_empty() {
        let _ = writeln!(out, "{file}: no device has an allocation trace to replay");
        return out;
    }
    for (i, d) in w.devices.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        device(&mut out, file, w, d);
    }
    out
}

fn device(out: &mut String, file: &str, w: &WhatIf, d: &DeviceWhatIf) {
    let a = &d.agreement;
    let _ = writeln!(
        out,
        "{file}, cuda:{}: {} replayed; settings {}",
        d.device,
        count(d.events as u64, "trace entry", "trace entries"),
        if w.recorded_settings.is_empty() {
            "PyTorch's defaults".to_string()
        } else {
            w.recorded_settings.clone()
        }
    );
    for (sentence, _) in answers(d) {
        let _ = writeln!(out, "  {sentence}");
    }
    out.push('\n');
    table(out, d);
    out.push('\n');
    out.push_str(&model_check(a));
    if d.cached_at_start_bytes > 0 {
        let _ = writeln!(
            out,
            "the trace begins with {} reserved, {} of it cached and free",
            human_bytes(d.reserved_at_start_bytes),
            human_bytes(d.cached_at_start_bytes)
        );
    }
    for s in &d.scenarios {
        if s.unfollowed > 0 {
            let _ = writeln!(
                out,
                "warning: {}: {} could not be followed (frees of blocks the model does not hold, unknown actions); its figures are not vouched for",
                s.name,
                count(s.unfollowed, "entry", "entries")
            );
        }
    }
    for n in &d.notes {
        let _ = writeln!(out, "note: {n}");
    }
}

/// How far the model's replay of the recorded run agrees with the trace's own record.
fn model_check(a: &oomkit_allocator::Agreement) -> String {
    let segs = if a.recorded == 0 && a.simulated == 0 {
        "the trace took no new segment and neither does the model".to_string()
    } else if a.recorded == 0 {
        format!(
            "the trace took no new segment, the model takes {}",
            a.simulated
        )
    } else if a.share == 1.0 {
        format!(
            "it makes the {} the trace recorded, at the same entries",
            count(a.recorded as u64, "segment", "segments")
        )
    } else {
        format!(
            "it makes {} of the {} the trace recorded ({:.0}%, {} of its own)",
            a.matched,
            count(a.recorded as u64, "segment", "segments"),
            100.0 * a.share,
            a.simulated
        )
    };
    let placed = if a.placed_at_recorded_address == 1.0 {
        "it puts every allocation at its recorded address".to_string()
    } else {
        format!(
            "it puts {:.0}% of allocations at their recorded address",
            100.0 * a.placed_at_recorded_address
        )
    };
    let mut out = format!("model check: {segs}; {placed}");
    if let Some(x) = &a.first_divergence {
        let at = |s: &Option<oomkit_allocator::SegmentOut>| {
            s.map_or("none".to_string(), |s| {
                format!("{} at entry {}", human_bytes(s.size), s.event)
            })
        };
        let _ = write!(
            out,
            "; they part at segment {} (trace: {}, model: {}): from there the figures are the model's, not the run's",
            x.index,
            at(&x.recorded),
            at(&x.simulated)
        );
    } else if a.placed_at_recorded_address < 1.0 {
        out.push_str(
            ": the model's blocks are not the run's, so its figures are the model's, not the run's",
        );
    }
    out.push('\n');
    out
}

/// The scenarios side by side.
fn table(out: &mut String, d: &DeviceWhatIf) {
    let names: Vec<String> = d
        .scenarios
        .iter()
        .map(|s| match s.start {
            StartKind::Fresh if s.name != FRESH_BASELINE => format!("{} *", s.name),
            _ => s.name.clone(),
        })
        .collect();
    let width = names.iter().map(|n| n.len()).max().unwrap_or(0).max(12);
    let mut rows: Vec<(String, Vec<String>)> = vec![
        (
            "peak reserved".into(),
            d.scenarios
                .iter()
                .map(|s| human_bytes(s.peak_reserved_bytes))
                .collect(),
        ),
        (
            "peak allocated".into(),
            d.scenarios
                .iter()
                .map(|s| human_bytes(s.peak_allocated_bytes))
                .collect(),
        ),
        (
            "free in segments at peak".into(),
            d.scenarios
                .iter()
                .map(|s| human_bytes(s.free_in_segments_at_peak_bytes))
                .collect(),
        ),
        (
            "segments taken".into(),
            d.scenarios.iter().map(segments).collect(),
        ),
        (
            "capacity".into(),
            d.scenarios
                .iter()
                .map(|s| match (s.capacity_bytes, s.capacity_source) {
                    (Some(c), "trace_oom") => format!("{} (OOM)", human_bytes(c)),
                    // The least the process's own limit can have been.
                    (Some(c), "process_limit") => format!("{} (at least)", human_bytes(c)),
                    (Some(c), _) => human_bytes(c),
                    (None, _) => "no limit".into(),
                })
                .collect(),
        ),
    ];
    if let Some(first) = d.scenarios.first() {
        for (k, r) in first.recorded_ooms.iter().enumerate() {
            rows.push((
                format!("OOM at entry {} ({})", r.event, human_bytes(r.size)),
                d.scenarios
                    .iter()
                    .map(|s| match s.recorded_ooms.get(k) {
                        Some(x) if x.happens => "happens".into(),
                        Some(_) => "avoided".into(),
                        None => "-".into(),
                    })
                    .collect(),
            ));
        }
    }
    if d.scenarios.iter().any(|s| new_ooms(s) > 0) {
        rows.push((
            "OOMs the trace did not have".into(),
            d.scenarios
                .iter()
                .map(|s| match s.oom_details.iter().find(|o| !o.recorded) {
                    Some(o) => match o.event {
                        Some(e) => format!("{}, first at {e}", new_ooms(s)),
                        None => format!("{}, before the trace", new_ooms(s)),
                    },
                    None => "0".into(),
                })
                .collect(),
        ));
    }
    let label = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let _ = write!(out, "  {:label$}", "");
    for n in &names {
        let _ = write!(out, "  {n:>width$}");
    }
    out.push('\n');
    for (l, cells) in rows {
        let _ = write!(out, "  {l:label$}");
        for c in cells {
            let _ = write!(out, "  {c:>width$}");
        }
        out.push('\n');
    }
    if d.scenarios.iter().any(|s| s.start == StartKind::Fresh) {
        let _ = writeln!(
            out,
            "  * a new run: the blocks live before the trace are placed afresh, with nothing cached, and the figures are compared with \"{FRESH_BASELINE}\""
        );
    }
}

fn segments(s: &ScenarioOut) -> String {
    let maps = s
        .segments
        .iter()
        .filter(|x| x.action == "segment_map")
        .count();
    let allocs = s.segments.len() - maps;
    match (allocs, maps) {
        (a, 0) => a.to_string(),
        (0, m) => format!("{m} maps"),
        (a, m) => format!("{a} + {m} maps"),
    }
}

fn new_ooms(s: &ScenarioOut) -> usize {
    s.oom_details.iter().filter(|o| !o.recorded).count()
}

/// One sentence per scenario: whether each recorded OOM still happens,
/// whether new ones do, and the peak against its baseline.
pub(crate) fn answers(d: &DeviceWhatIf) -> Vec<(String, bool)> {
    let Some(rec) = d.scenarios.first() else {
        return Vec::new();
    };
    let fresh = d.scenarios.iter().find(|s| s.name == FRESH_BASELINE);
    let mut out = Vec::new();
    if let Some(first) = rec.recorded_ooms.first() {
        out.push((
            if first.happens {
                format!(
                    "the model reproduces the OOM at entry {} ({} asked for{})",
                    first.event,
                    human_bytes(first.size),
                    rec.oom_details
                        .iter()
                        .find(|o| o.event == Some(first.event))
                        .map(|o| format!(
                            ", {} free in segments, the largest free block {}",
                            human_bytes(o.free_in_segments_bytes),
                            human_bytes(o.largest_free_block_bytes)
                        ))
                        .unwrap_or_default()
                )
            } else {
                format!(
                    "the model does not run out at entry {} where the trace did: the capacity it implies ({}) held more than the replay needed",
                    first.event,
                    rec.capacity_bytes.map(human_bytes).unwrap_or_default()
                )
            },
            true,
        ));
    }
    for s in d.scenarios.iter().skip(1) {
        if s.name == FRESH_BASELINE {
            continue;
        }
        let base = match (s.start, fresh) {
            (StartKind::Fresh, Some(f)) => f,
            _ => rec,
        };
        let peak = format!(
            "{}, against {}",
            oomkit_compare::peak_words(s.peak_reserved_bytes, base.peak_reserved_bytes),
            if std::ptr::eq(base, rec) {
                "the trace as recorded"
            } else {
                "a new run as recorded (fresh start)"
            }
        );
        let recorded: Vec<String> = s
            .recorded_ooms
            .iter()
            .map(|r| {
                format!(
                    "the OOM at entry {} {}",
                    r.event,
                    if r.happens {
                        "still happens"
                    } else {
                        "does not happen"
                    }
                )
            })
            .collect();
        let avoided = s.recorded_ooms.iter().all(|r| !r.happens);
        let mut sentence = format!("with {}: ", s.name);
        if !recorded.is_empty() {
            let _ = write!(sentence, "{}; ", recorded.join(", "));
        }
        match s.oom_details.iter().find(|o| !o.recorded) {
            Some(o) => {
                let _ = write!(
                    sentence,
                    "it runs out {} ({} asked for, {} reserved); ",
                    match o.event {
                        Some(e) => format!("at entry {e}, where the trace did not"),
                        None => "before the trace begins, placing what it held".into(),
                    },
                    human_bytes(o.size),
                    human_bytes(o.reserved_bytes)
                );
            }
            None if rec.recorded_ooms.is_empty() || avoided => {}
            None => {}
        }
        sentence.push_str(&peak);
        out.push((sentence, avoided && new_ooms(s) == 0));
    }
    out
}
