//! Memory over time: the replayed totals after each trace entry, thinned
//! for drawing and export.

use crate::model::{Snapshot, Stage};
use crate::replay::apply;
use crate::report::DeviceReport;
use serde::Serialize;
use std::collections::HashMap;

/// Active and reserved bytes at one moment of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Point {
    /// The trace entry just applied, or `None` for the state before the first.
    pub after_event: Option<u64>,
    /// When that entry was recorded, microseconds since the epoch.
    pub time_us: Option<i64>,
    /// Bytes in active blocks.
    pub active_bytes: u64,
    /// Bytes reserved from the driver.
    pub reserved_bytes: u64,
}

/// One run of an annotated `record_function` range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseRange {
    /// The range's name.
    pub name: String,
    /// When it began, microseconds since the epoch.
    pub start_us: i64,
    /// When it ended, or `None` if the snapshot was taken inside it.
    pub end_us: Option<i64>,
}

/// A device's memory over its trace.
#[derive(Clone, Debug, Serialize)]
pub struct Timeline {
    /// CUDA device index.
    pub device: i64,
    /// Entries in the device's trace.
    pub events: u64,
    /// Whether points were dropped to stay within the limit.
    pub decimated: bool,
    /// The series, in trace order.
    pub points: Vec<Point>,
}

/// Replays a device's trace from the totals the analysis found before its
/// first entry, keeping at most `max_points` points (0 keeps all).
///
/// Thinning splits the trace into equal buckets and keeps, from each, the
/// entries with the least and most active bytes and the most reserved
/// bytes, so every peak and trough survives at any zoom that shows a
/// bucket as a pixel or less. The last entry is always kept.
pub fn timeline(snap: &Snapshot, report: &DeviceReport, max_points: usize) -> Timeline {
    let events = snap.events(report.device);
    let mut active = report.pre_trace_active_bytes;
    let mut reserved = report.pre_trace_reserved_bytes;
    let start = Point {
        after_event: None,
        time_us: events.first().and_then(|e| e.time_us()),
        active_bytes: active,
        reserved_bytes: reserved,
    };
    let mut points = vec![start];
    let keep_all = max_points == 0 || events.len() < max_points;
    let per_bucket = if keep_all {
        1
    } else {
        events.len().div_ceil((max_points / 3).max(1))
    };
    // Candidates of the current bucket: least active, most active, most reserved.
    let mut bucket: [Option<Point>; 3] = [None; 3];
    for (i, e) in events.iter().enumerate() {
        apply(e.action, e.size, &mut active, &mut reserved);
        let p = Point {
            after_event: Some(i as u64),
            time_us: e.time_us(),
            active_bytes: active,
            reserved_bytes: reserved,
        };
        if keep_all {
            points.push(p);
            continue;
        }
        let better = |slot: &Option<Point>, f: &dyn Fn(&Point, &Point) -> bool| {
            slot.as_ref().is_none_or(|q| f(&p, q))
        };
        if better(&bucket[0], &|p, q| p.active_bytes < q.active_bytes) {
            bucket[0] = Some(p);
        }
        if better(&bucket[1], &|p, q| p.active_bytes > q.active_bytes) {
            bucket[1] = Some(p);
        }
        if better(&bucket[2], &|p, q| p.reserved_bytes > q.reserved_bytes) {
            bucket[2] = Some(p);
        }
        if (i + 1) % per_bucket == 0 || i + 1 == events.len() {
            let mut kept: Vec<Point> = bucket.iter_mut().filter_map(|b| b.take()).collect();
            // The last entry is the state at snapshot time, where a chart ends.
            if i + 1 == events.len() {
                kept.push(p);
            }
            kept.sort_by_key(|p| p.after_event);
            kept.dedup();
            points.extend(kept);
        }
    }
    Timeline {
        device: report.device,
        events: events.len() as u64,
        decimated: !keep_all,
        points,
    }
}

/// Returns the runs of the annotated ranges on a device in the order they
/// ended, those still open at snapshot time last.
pub fn phase_ranges(snap: &Snapshot, device: i64) -> Vec<PhaseRange> {
    let mut anns: Vec<_> = snap
        .annotations
        .iter()
        .filter(|a| a.device == device)
        .collect();
    anns.sort_by_key(|a| a.time_us);
    let mut open: HashMap<&str, Vec<i64>> = HashMap::new();
    let mut out = Vec::new();
    for a in anns {
        match a.stage {
            Stage::Start => open.entry(&a.name).or_default().push(a.time_us),
            Stage::End => {
                // An end without a start began before recording: nothing to draw.
                if let Some(start) = open.get_mut(a.name.as_str()).and_then(|v| v.pop()) {
                    out.push(PhaseRange {
                        name: a.name.clone(),
                        start_us: start,
                        end_us: Some(a.time_us),
                    });
                }
            }
        }
    }
    for (name, starts) in open {
        for start_us in starts {
            out.push(PhaseRange {
                name: name.to_string(),
                start_us,
                end_us: None,
            });
        }
    }
    out.sort_by(|a, b| {
        let key = |r: &PhaseRange| (r.end_us.is_none(), r.end_us, r.start_us);
        key(a).cmp(&key(b)).then_with(|| a.name.cmp(&b.name))
    });
    out
}
