//! The self-contained HTML report: the analyses and thinned series as one
//! JSON document, embedded in a page with its script, styles and the
//! vendored uPlot chart library, so that it opens offline.

use oomkit_compare::{rank_table, FileAnalysis, RankRow, Report, RunFile};
use oomkit_runlog::{MeasureKind, Run};
use oomkit_snapshot::{
    phase_ranges, role_timeline, stack_label, timeline, Role, Snapshot, StackId,
};
use serde_json::{json, Map, Value};
use std::collections::HashMap;

const TEMPLATE: &str = include_str!("../assets/report.html");
const APP_JS: &str = include_str!("../assets/report.js");
const APP_CSS: &str = include_str!("../assets/report.css");
const UPLOT_JS: &str = include_str!("../assets/vendor/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/vendor/uplot/uPlot.min.css");
const UPLOT_LICENSE: &str = include_str!("../assets/vendor/uplot/LICENSE");

/// Memory samples per device a page keeps by default: enough for the
/// timeline at full screen width many times over, few enough that a page of
/// a million-event snapshot opens in a browser in a second.
pub const PAGE_MAX_POINTS: usize = 50_000;

/// Segments drawn per device; the rest are summed in one line.
const MAX_SEGMENTS: usize = 200;

/// Renders the report page for one or more files, keeping at most
/// `max_points` memory samples per device (0 keeps all).
///
/// The page draws the timelines from the raw data, so every input must have
/// been loaded keeping it ([`FileAnalysis::keeping`], [`RunFile::run`]);
/// one that was not is named in the error.
pub fn html_report(inputs: &[&Report], max_points: usize) -> Result<String, crate::ReportError> {
    let mut files: Vec<Value> = Vec::new();
    for input in inputs {
        files.push(match input {
            Report::Snapshot(fa) => snapshot_data(fa, fa.kept()?, max_points),
            Report::Run(rf) => run_data(rf, rf.kept()?),
        });
    }
    let ranks: Vec<RankRow> = rank_table(inputs);
    // The attempts of a job that stepped down, as the terminal shows them.
    let attempts = oomkit_compare::job_attempts(inputs);
    let doc = json!({
        "generator": format!("oomkit {}", env!("CARGO_PKG_VERSION")),
        "files": files,
        "ranks": ranks,
        "attempts": attempts,
    });
    let data = script_safe(&doc.to_string());
    // Each piece replaces a marker that occurs once in the template; the
    // data goes last so that nothing inside it is taken for a marker.
    Ok(TEMPLATE
        .replacen("/*@UPLOT_CSS@*/", UPLOT_CSS, 1)
        .replacen("/*@APP_CSS@*/", APP_CSS, 1)
        .replacen("@UPLOT_LICENSE@", &UPLOT_LICENSE.replace("--", "- -"), 1)
        .replacen("/*@UPLOT_JS@*/", UPLOT_JS, 1)
        .replacen("/*@APP_JS@*/", APP_JS, 1)
        .replacen("@DATA@", &data, 1))
}

/// Keeps JSON from closing the `<script>` element it sits in: every `<`
/// of a JSON text is inside a string, where `\u003c` reads the same.
fn script_safe(json: &str) -> String {
    json.replace('<', "\\u003c")
}

/// Encodes a series as its first value and the differences after it,
/// which keeps slowly changing byte counts short in the page.
fn deltas(values: impl IntoIterator<Item = i64>) -> Vec<i64> {
    let mut prev = 0i64;
    values
        .into_iter()
        .map(|v| {
            let d = v.wrapping_sub(prev);
            prev = v;
            d
        })
        .collect()
}

/// Writes a series that rarely changes as its changes only: pairs of
/// (points since the last change, change in value), flattened. A role's
/// bytes change at few of a trace's entries, so this is a fraction of
/// [`deltas`]'s size.
fn changes(values: impl IntoIterator<Item = i64>) -> Vec<i64> {
    let (mut prev, mut last) = (0i64, -1i64);
    let mut out = Vec::new();
    for (i, v) in values.into_iter().enumerate() {
        if v != prev {
            out.push(i as i64 - last);
            out.push(v.wrapping_sub(prev));
            (prev, last) = (v, i as i64);
        }
    }
    out
}

/// Interns strings into a table, returning each one's index.
#[derive(Default)]
struct Table {
    names: Vec<String>,
    index: HashMap<String, usize>,
}

impl Table {
    fn id(&mut self, name: &str) -> usize {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        self.names.push(name.to_string());
        self.index.insert(name.to_string(), self.names.len() - 1);
        self.names.len() - 1
    }
}

/// A snapshot's part of the page's document: per device its analysis, the
/// thinned timeline, the role bands, the segments, the phases and the sites'
/// stacks, in the shape `report.js` reads.
///
/// Long on purpose: it builds one JSON document whose parts share the
/// string tables and the thinned points; each part is a few lines in the
/// order the page draws them.
fn snapshot_data(fa: &FileAnalysis, snap: &Snapshot, max_points: usize) -> Value {
    let devices: Vec<Value> = fa
        .analysis
        .devices
        .iter()
        .map(|d| {
            let events = snap.events(d.device);
            let t0 = events.first().and_then(|e| e.time_us());
            let tl = timeline(snap, d, max_points);
            let at: Vec<Option<u64>> = tl.points.iter().map(|p| p.after_event).collect();
            let (by_role, entry_role) = role_timeline(snap, d.device, &at);
            // Only the roles that hold memory at some point get a band.
            let shown_roles: Vec<Role> = Role::ALL
                .into_iter()
                .filter(|&r| by_role.iter().any(|b| *b.get(r) > 0))
                .collect();
            // With every entry kept, each point changes the bytes of its
            // entry's role only, by the change in active bytes: the page
            // rebuilds the bands from the roles at the start. A thinned
            // timeline skips entries, so it carries each band's changes.
            let role_series: Value = if tl.decimated {
                json!(shown_roles
                    .iter()
                    .map(|&r| changes(by_role.iter().map(|b| *b.get(r) as i64)))
                    .collect::<Vec<_>>())
            } else {
                Value::Null
            };
            let role_start: Vec<u64> = shown_roles
                .iter()
                .map(|&r| by_role.first().map_or(0, |b| *b.get(r)))
                .collect();
            let role_of_point: Vec<i64> = entry_role
                .iter()
                .map(|r| {
                    r.and_then(|r| shown_roles.iter().position(|&s| s == r))
                        .map_or(-1, |k| k as i64)
                })
                .collect();
            let mut sites = Table::default();
            let mut site_of: HashMap<StackId, usize> = HashMap::new();
            let mut actions = Table::default();
            let (mut x, mut t, mut size, mut action, mut site) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for p in &tl.points {
                // x counts entries applied: 0 is the state before the first.
                x.push(p.after_event.map_or(0, |i| i as i64 + 1));
                t.push(match (p.time_us, t0) {
                    (Some(a), Some(b)) => a - b,
                    _ => 0,
                });
                match p.after_event.and_then(|i| events.get(i as usize)) {
                    Some(e) => {
                        size.push(e.size as i64);
                        action.push(actions.id(e.action.name()));
                        let id = *site_of
                            .entry(e.stack)
                            .or_insert_with(|| sites.id(&stack_label(&snap.stacks, e.stack)));
                        site.push(id as i64);
                    }
                    None => {
                        size.push(0);
                        action.push(actions.id("start"));
                        site.push(-1);
                    }
                }
            }
            // Phases are recorded by time; the chart's axis counts entries,
            // so each edge goes to the first entry at or after it.
            let at = |time: i64| events.partition_point(|e| e.time_us().is_some_and(|u| u < time));
            let phases: Vec<Value> = if t0.is_some() {
                phase_ranges(snap, d.device)
                    .into_iter()
                    .map(|r| {
                        json!({
                            "name": r.name,
                            "x0": at(r.start_us),
                            "x1": r.end_us.map_or(events.len(), at),
                            "open": r.end_us.is_none(),
                        })
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let ooms: Vec<Value> = d
                .ooms
                .iter()
                .map(|o| {
                    json!({
                        "x": o.event_index + 1,
                        "requested_bytes": o.requested_bytes,
                        "free_bytes": o.free_bytes,
                        "cause": o.cause,
                        "label": o.label,
                    })
                })
                .collect();
            let mut segs: Vec<_> = snap
                .segments
                .iter()
                .filter(|s| s.device == d.device)
                .collect();
            segs.sort_by(|a, b| {
                b.total_size
                    .cmp(&a.total_size)
                    .then(a.address.cmp(&b.address))
            });
            let shown: Vec<Value> = segs
                .iter()
                .take(MAX_SEGMENTS)
                .map(|s| {
                    let largest_free = s
                        .blocks
                        .iter()
                        .filter(|b| !b.state.is_active())
                        .map(|b| b.size)
                        .max()
                        .unwrap_or(0);
                    json!({
                        "address": format!("{:#x}", s.address),
                        "total_bytes": s.total_size,
                        "allocated_bytes": s.allocated_size,
                        "active_bytes": s.active_size,
                        "requested_bytes": s.requested_size,
                        "blocks": s.blocks.len(),
                        "largest_free_bytes": largest_free,
                        "stream": s.stream,
                        "type": s.segment_type,
                    })
                })
                .collect();
            json!({
                "device": d.device,
                "events": tl.events,
                "decimated": tl.decimated,
                "times": t0.is_some(),
                "x": deltas(x),
                "t": deltas(t),
                "active": deltas(tl.points.iter().map(|p| p.active_bytes as i64)),
                "reserved": deltas(tl.points.iter().map(|p| p.reserved_bytes as i64)),
                "size": size,
                "action": action,
                "site": site,
                "actions": actions.names,
                "sites": sites.names,
                "roles": shown_roles.iter().map(|r| r.words()).collect::<Vec<_>>(),
                "by_role": role_series,
                "role_start": role_start,
                "role": role_of_point,
                "peak": {
                    "x": d.peak_event_index.map_or(0, |i| i + 1),
                    "bytes": d.peak_active_bytes,
                    "phase": d.peak_phase,
                },
                "ooms": ooms,
                "phases": phases,
                "segments": shown,
                "segments_total": segs.len(),
                "replayed": replayed_reserved(snap, fa, d.device, &tl.points),
            })
        })
        .collect();
    json!({
        "kind": "snapshot",
        "file": fa.path,
        "analysis": crate::json::snapshot(fa),
        "devices": devices,
    })
}

/// Reserved bytes at the timeline's points as the model of the allocator
/// replays the trace: with the run's settings (which should retrace the
/// recorded line) and with expandable segments flipped, the setting a
/// fragmentation finding is about; `null` for a device without a trace.
fn replayed_reserved(
    snap: &Snapshot,
    fa: &FileAnalysis,
    device: i64,
    points: &[oomkit_snapshot::Point],
) -> Value {
    if snap.events(device).is_empty() {
        return Value::Null;
    }
    let on = fa
        .analysis
        .allocator_settings
        .as_ref()
        .and_then(|s| s.get("expandable_segments"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let conf = if on {
        "expandable_segments:False"
    } else {
        "expandable_segments:True"
    };
    let opts = oomkit_allocator::Options {
        device: Some(device),
        samples: points
            .iter()
            .filter_map(|p| p.after_event.map(|i| i as usize))
            .collect(),
        no_baseline: true,
    };
    let Ok(w) =
        oomkit_allocator::what_if(snap, &[oomkit_allocator::Scenario::alloc_conf(conf)], &opts)
    else {
        return Value::Null;
    };
    let Some(d) = w.devices.first() else {
        return Value::Null;
    };
    // The point before the first entry takes the state the replay starts from.
    let series = |s: &oomkit_allocator::ScenarioOut| {
        let mut samples = s.reserved_samples.iter();
        deltas(points.iter().map(|p| match p.after_event {
            None => s.start_reserved_bytes as i64,
            Some(_) => samples.next().copied().unwrap_or(0) as i64,
        }))
    };
    let (Some(rec), Some(fix)) = (d.scenarios.first(), d.scenarios.last()) else {
        return Value::Null;
    };
    json!({
        "as_recorded": series(rec),
        "whatif": series(fix),
        "whatif_name": conf,
        "agreement": d.agreement.share,
        "placed": d.agreement.placed_at_recorded_address,
    })
}

/// Per step: the step's own measure and each stage's largest peak.
fn run_data(rf: &RunFile, run: &Run) -> Value {
    let mut steps: Vec<u64> = Vec::new();
    let mut row: HashMap<u64, usize> = HashMap::new();
    for m in run.steps() {
        if let Some(s) = m.step {
            row.entry(s).or_insert_with(|| {
                steps.push(s);
                steps.len() - 1
            });
        }
    }
    let n = steps.len();
    let mut series: Map<String, Value> = Map::new();
    let mut step_cols: [Vec<Option<u64>>; 4] = std::array::from_fn(|_| vec![None; n]);
    let mut stage_peaks: Vec<(String, Vec<Option<u64>>)> = Vec::new();
    let mut phases = Vec::new();
    let mut last_step: Option<u64> = None;
    for (kind, m) in &run.measures {
        if m.step.is_some() {
            last_step = m.step;
        }
        match kind {
            MeasureKind::Step => {
                if let Some(&r) = m.step.and_then(|s| row.get(&s)) {
                    step_cols[0][r] = Some(m.peak_bytes);
                    step_cols[1][r] = Some(m.start_bytes);
                    step_cols[2][r] = Some(m.end_bytes);
                    step_cols[3][r] = Some(m.reserved_bytes);
                }
            }
            MeasureKind::Stage => {
                let Some(&r) = m.step.and_then(|s| row.get(&s)) else {
                    continue;
                };
                let col = match stage_peaks.iter().position(|(name, _)| *name == m.name) {
                    Some(i) => i,
                    None => {
                        stage_peaks.push((m.name.clone(), vec![None; n]));
                        stage_peaks.len() - 1
                    }
                };
                let cell = &mut stage_peaks[col].1[r];
                *cell = Some(cell.map_or(m.peak_bytes, |v| v.max(m.peak_bytes)));
            }
            MeasureKind::Phase => phases.push(json!({
                "name": m.name,
                // A phase outside a step is drawn after the step before it.
                "step": m.step.or(last_step),
                "peak_bytes": m.peak_bytes,
                "start_bytes": m.start_bytes,
                "end_bytes": m.end_bytes,
                "seconds": m.seconds,
            })),
        }
    }
    for (name, col) in ["peak", "start", "end", "reserved"].iter().zip(step_cols) {
        series.insert((*name).into(), json!(col));
    }
    let stages: Vec<Value> = stage_peaks
        .into_iter()
        .map(|(name, peaks)| json!({"name": name, "peak": peaks}))
        .collect();
    let ooms: Vec<Value> = run
        .ooms
        .iter()
        .map(|o| {
            json!({
                "step": o.step,
                "stage": o.stage.as_deref().or(o.phase.as_deref()),
                "requested_bytes": o.requested_bytes,
                "allocated_bytes": o.memory.allocated_bytes,
            })
        })
        .collect();
    json!({
        "kind": "run",
        "file": rf.path,
        "analysis": crate::json::run(rf),
        "steps": steps,
        "series": series,
        "stages": stages,
        "phases": phases,
        "ooms": ooms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_round_trip() {
        let v = [5i64, 7, 7, 2, 1 << 40];
        let d = deltas(v);
        assert_eq!(d[..4], [5, 2, 0, -5]);
        let mut acc = 0;
        let back: Vec<i64> = d
            .iter()
            .map(|x| {
                acc += x;
                acc
            })
            .collect();
        assert_eq!(back, v);
    }

    #[test]
    fn changes_round_trip() {
        let v = [0i64, 0, 5, 5, 5, 2, 2, 1 << 40];
        let c = changes(v);
        assert_eq!(c[..4], [3, 5, 3, -3]);
        // Decoded as the page decodes it.
        let mut back = vec![0i64; v.len()];
        let (mut at, mut acc) = (-1i64, 0i64);
        for pair in c.chunks(2) {
            at += pair[0];
            acc += pair[1];
            for b in &mut back[at as usize..] {
                *b = acc;
            }
        }
        assert_eq!(back, v);
    }

    #[test]
    fn script_text_cannot_close_its_element() {
        let s = script_safe(r#"{"label":"</script><script>alert(1)</script><!--"}"#);
        assert!(!s.contains('<'));
        let v: Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v["label"], "</script><script>alert(1)</script><!--");
    }

    #[test]
    fn embedded_scripts_cannot_end_their_element() {
        for (name, text) in [("uPlot", UPLOT_JS), ("report.js", APP_JS)] {
            let lower = text.to_ascii_lowercase();
            assert!(!lower.contains("</script"), "{name} holds </script");
            assert!(!lower.contains("<!--"), "{name} holds <!--");
        }
    }
}
