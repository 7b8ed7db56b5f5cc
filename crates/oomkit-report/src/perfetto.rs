//! Chrome trace-event JSON, which ui.perfetto.dev and chrome://tracing open.
//!
//! Memory goes in counter events (`"ph": "C"`), OOMs and the peak in
//! instant events (`"ph": "i"`), and phases or tracker stages in complete
//! events (`"ph": "X"`). Timestamps are microseconds from the first entry.

use oomkit_compare::Report;
use oomkit_runlog::{MeasureKind, Run};
use oomkit_snapshot::{phase_ranges, timeline, Analysis, PhaseRange, Snapshot};
use oomkit_units::human_bytes;
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use serde_json::{json, Value};
use std::collections::HashMap;

/// Memory samples per device a trace keeps by default: Perfetto zooms in
/// further than a page, and still loads a trace of this size in seconds.
pub const TRACE_MAX_POINTS: usize = 200_000;

/// Thread of the memory counters in each process.
const TID_MEMORY: u64 = 0;
/// Thread of the phases or steps.
const TID_PHASES: u64 = 1;
/// Thread of the tracker's stages inside steps.
const TID_STAGES: u64 = 2;

/// A trace document, written out event by event when serialized.
///
/// A snapshot's memory series has two counter events per trace entry kept;
/// holding each as a JSON tree took about 3 KiB per entry (8 GiB for 1.3 M
/// entries), so the series stays as plain numbers until it is written.
pub struct Trace {
    parts: Vec<Part>,
    other: Value,
}

/// A run of the trace's events.
enum Part {
    /// One event as it is written.
    Event(Value),
    /// Active and reserved bytes of a device: time, active, reserved.
    Memory {
        pid: i64,
        samples: Vec<(f64, u64, u64)>,
    },
}

/// One counter event, in the shape `"ph": "C"` needs.
#[derive(Serialize)]
struct Counter {
    ph: &'static str,
    name: &'static str,
    pid: i64,
    tid: u64,
    ts: f64,
    args: CounterArgs,
}

#[derive(Serialize)]
struct CounterArgs {
    bytes: u64,
}

fn counter_event(name: &'static str, pid: i64, ts: f64, bytes: u64) -> Counter {
    Counter {
        ph: "C",
        name,
        pid,
        tid: TID_MEMORY,
        ts,
        args: CounterArgs { bytes },
    }
}

/// The `traceEvents` array, written part by part.
struct Events<'a>(&'a [Part]);

impl Serialize for Events<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(None)?;
        for part in self.0 {
            match part {
                Part::Event(v) => seq.serialize_element(v)?,
                Part::Memory { pid, samples } => {
                    for &(ts, active, reserved) in samples {
                        seq.serialize_element(&counter_event("active", *pid, ts, active))?;
                        seq.serialize_element(&counter_event("reserved", *pid, ts, reserved))?;
                    }
                }
            }
        }
        seq.end()
    }
}

impl Serialize for Trace {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("traceEvents", &Events(&self.parts))?;
        m.serialize_entry("displayTimeUnit", "ms")?;
        m.serialize_entry("otherData", &self.other)?;
        m.end()
    }
}

fn name_meta(ph_name: &str, pid: i64, tid: u64, name: &str) -> Value {
    json!({"ph": "M", "name": ph_name, "pid": pid, "tid": tid, "args": {"name": name}})
}

fn counter(name: &'static str, pid: i64, ts: f64, bytes: u64) -> Value {
    serde_json::to_value(counter_event(name, pid, ts, bytes)).unwrap_or(Value::Null)
}

/// What `otherData` says: where the events came from and what their
/// timestamps count.
fn other_data(file: &str, clock: &str) -> Value {
    json!({"source": "oomkit", "file": file, "clock": clock})
}

/// Converts a snapshot's analysis to a trace, with at most `max_points`
/// memory samples per device (0 keeps every trace entry).
///
/// Snapshots without entry times (before torch 2.2) use the entry's index
/// as its timestamp; `otherData.clock` says which clock was used.
pub fn snapshot_trace(
    file: &str,
    snap: &Snapshot,
    analysis: &Analysis,
    max_points: usize,
) -> Trace {
    let lines: Vec<_> = analysis
        .devices
        .iter()
        .map(|d| (d, timeline(snap, d, max_points)))
        .collect();
    let ranges: HashMap<i64, Vec<PhaseRange>> = analysis
        .devices
        .iter()
        .map(|d| (d.device, phase_ranges(snap, d.device)))
        .collect();
    // Annotations may start before the first entry that the ring buffer kept.
    let t0 = lines
        .iter()
        .flat_map(|(_, t)| t.points.iter().filter_map(|p| p.time_us))
        .min()
        .map(|t| {
            let first_phase = ranges.values().flatten().map(|r| r.start_us).min();
            first_phase.map_or(t, |p| p.min(t))
        });
    let timed = t0.is_some();
    let t0 = t0.unwrap_or(0);
    let mut events = Vec::new();
    for (d, line) in &lines {
        let pid = d.device;
        events.push(Part::Event(name_meta(
            "process_name",
            pid,
            TID_MEMORY,
            &format!("cuda:{pid}"),
        )));
        events.push(Part::Event(name_meta(
            "thread_name",
            pid,
            TID_MEMORY,
            "memory",
        )));
        events.push(Part::Event(name_meta(
            "thread_name",
            pid,
            TID_PHASES,
            "phases",
        )));
        let events_of_device = snap.events(pid);
        // The time of entry `i`, or of the start when `i` is None.
        let ts = |i: Option<u64>| -> f64 {
            if timed {
                let t = i
                    .and_then(|i| events_of_device.get(i as usize))
                    .or(events_of_device.first())
                    .and_then(|e| e.time_us())
                    .unwrap_or(t0);
                (t - t0) as f64
            } else {
                i.map_or(0.0, |i| (i + 1) as f64)
            }
        };
        let mut last_ts = 0.0f64;
        let mut samples = Vec::with_capacity(line.points.len());
        for p in &line.points {
            // Entries without a time keep the last one, so the clock never runs back.
            let t = if timed {
                p.time_us.map_or(last_ts, |t| (t - t0) as f64).max(last_ts)
            } else {
                ts(p.after_event)
            };
            last_ts = t;
            samples.push((t, p.active_bytes, p.reserved_bytes));
        }
        events.push(Part::Memory { pid, samples });
        if let Some(i) = d.peak_event_index {
            events.push(Part::Event(json!({
                "ph": "i", "s": "p", "pid": pid, "tid": TID_MEMORY, "ts": ts(Some(i)),
                "name": format!("peak: {} active", human_bytes(d.peak_active_bytes)),
                "args": {"event_index": i, "active_bytes": d.peak_active_bytes, "phase": d.peak_phase},
            })));
        }
        for o in &d.ooms {
            events.push(Part::Event(json!({
                "ph": "i", "s": "p", "pid": pid, "tid": TID_MEMORY, "ts": ts(Some(o.event_index)),
                "name": format!("OOM: {} requested, {} free ({})", human_bytes(o.requested_bytes), human_bytes(o.free_bytes), o.cause),
                "args": {
                    "event_index": o.event_index,
                    "requested_bytes": o.requested_bytes,
                    "free_bytes": o.free_bytes,
                    "live_bytes": o.live_bytes,
                    "reserved_bytes": o.reserved_bytes,
                    "cause": o.cause,
                    "site": o.label,
                },
            })));
        }
        if timed {
            for r in ranges.get(&pid).into_iter().flatten() {
                let end = r.end_us.unwrap_or(t0 + last_ts as i64);
                events.push(Part::Event(json!({
                    "ph": "X", "pid": pid, "tid": TID_PHASES, "name": r.name.as_str(),
                    "ts": (r.start_us - t0) as f64, "dur": (end - r.start_us).max(0) as f64,
                    "args": {"open_at_snapshot": r.end_us.is_none()},
                })));
            }
        }
    }
    let clock = if timed {
        "microseconds since the first trace entry"
    } else {
        "trace entry index (the snapshot has no times)"
    };
    let mut other = other_data(file, clock);
    other["decimated"] = json!(lines.iter().any(|(_, t)| t.decimated));
    Trace {
        parts: events,
        other,
    }
}

/// The trace of one input: a snapshot's (which must have been loaded keeping
/// it) or a run log's.
pub fn trace(report: &Report, max_points: usize) -> Result<Trace, crate::ReportError> {
    Ok(match report {
        Report::Snapshot(fa) => snapshot_trace(&fa.path, fa.kept()?, &fa.analysis, max_points),
        Report::Run(rf) => run_trace(&rf.path, rf.kept()?),
    })
}

/// Converts a run log to a trace: steps, stages and phases as slices, and
/// the tracker's memory readings as counters.
///
/// Run logs record how long each stage took, not when it started, so the
/// slices are laid end to end from those durations: gaps between steps
/// (data loading, logging) do not appear.
pub fn run_trace(file: &str, run: &Run) -> Trace {
    let pid = run.start.as_ref().map_or(0, |s| s.rank as i64);
    let device = run
        .start
        .as_ref()
        .map_or("?".to_string(), |s| s.device.clone());
    let mut events = vec![
        name_meta(
            "process_name",
            pid,
            TID_MEMORY,
            &format!("rank {pid} ({device})"),
        ),
        name_meta("thread_name", pid, TID_MEMORY, "memory"),
        name_meta("thread_name", pid, TID_PHASES, "steps and phases"),
        name_meta("thread_name", pid, TID_STAGES, "stages"),
    ];
    let mut cursor = 0.0f64;
    let mut stage_cursor = 0.0f64;
    for (kind, m) in &run.measures {
        let dur = (m.seconds * 1e6).max(0.0);
        let (tid, start) = match kind {
            MeasureKind::Stage => (TID_STAGES, stage_cursor),
            _ => (TID_PHASES, cursor),
        };
        events.push(json!({
            "ph": "X", "pid": pid, "tid": tid, "ts": start, "dur": dur,
            "name": if *kind == MeasureKind::Step { format!("step {}", m.step.unwrap_or(0)) } else { m.name.clone() },
            "args": {"step": m.step, "start_bytes": m.start_bytes, "peak_bytes": m.peak_bytes, "end_bytes": m.end_bytes},
        }));
        match kind {
            // Stages end before their step's record, inside the step.
            MeasureKind::Stage => stage_cursor += dur,
            _ => {
                events.push(counter("allocated", pid, start, m.start_bytes));
                events.push(counter("allocated", pid, start + dur / 2.0, m.peak_bytes));
                events.push(counter("allocated", pid, start + dur, m.end_bytes));
                if m.reserved_bytes > 0 {
                    events.push(counter("reserved", pid, start + dur, m.reserved_bytes));
                }
                cursor += dur;
                stage_cursor = cursor;
            }
        }
    }
    for o in &run.ooms {
        let requested = o.requested_bytes.map_or("?".into(), human_bytes);
        events.push(json!({
            "ph": "i", "s": "p", "pid": pid, "tid": TID_MEMORY, "ts": cursor,
            "name": format!("OOM: {requested} requested at step {}", o.step.map_or("?".into(), |s| s.to_string())),
            "args": {"step": o.step, "stage": o.stage, "message": o.message, "snapshot": o.snapshot},
        }));
    }
    Trace {
        parts: events.into_iter().map(Part::Event).collect(),
        other: other_data(
            file,
            "microseconds, slices laid end to end from the recorded durations",
        ),
    }
}
