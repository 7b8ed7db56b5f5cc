//! Analyses of a snapshot: state at snapshot time, trace replay, the live
//! set at the peak by allocation site, OOM events, phases, and advice.

use crate::findings::{findings, OOMS_DETAILED};
use crate::model::{Action, BlockState, Snapshot};
use crate::replay::{
    exact_totals, live_at, relative_totals, scan_trace, windows, Totals, TraceScan, WindowStats,
};
use crate::report::{
    Analysis, DeviceReport, Fragmentation, OomReport, Options, PhaseReport, SiteBytes, Warning,
};
use crate::sites::{group, label, site_key, Live};
use oomkit_units::human_bytes;
use std::collections::BTreeMap;

/// How to record a snapshot with a timeline, for the warnings that need one.
const RECORD_CALL: &str = "torch.cuda.memory._record_memory_history(max_entries=1_000_000) before the run, then torch.cuda.memory._dump_snapshot(\"snap.pickle\")";

/// Analyzes a snapshot.
pub fn analyze(snap: &Snapshot, opts: &Options) -> Analysis {
    let mut warnings = Vec::new();
    let devices: Vec<i64> = snap
        .devices()
        .into_iter()
        .filter(|d| opts.device.is_none_or(|want| want == *d))
        .collect();
    if snap.traces.iter().all(|t| t.events.is_empty()) {
        warnings.push(Warning {
            kind: "no_trace",
            device: None,
            message: "the snapshot holds no allocation history, so there is no timeline: the peak and sites shown are those at snapshot time".into(),
            fix: format!("call {RECORD_CALL}"),
        });
    }
    let reports: Vec<DeviceReport> = devices
        .iter()
        .map(|&d| analyze_device(snap, d, opts, &mut warnings))
        .collect();
    let expandable = snap
        .allocator_settings
        .as_ref()
        .and_then(|s| s.get("expandable_segments"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let findings = findings(&reports, expandable);
    Analysis {
        verdict: verdict(&reports, &findings, expandable),
        findings,
        devices: reports,
        allocator_settings: snap.allocator_settings.clone(),
        warnings,
    }
}

/// The verdict: the first OOM of any device (by time where every device
/// with one recorded it, else the first device's), or the largest peak.
fn verdict(
    reports: &[DeviceReport],
    findings: &[oomkit_advice::Finding],
    expandable: bool,
) -> oomkit_advice::Verdict {
    let ooms: Vec<(&DeviceReport, &OomReport)> = reports
        .iter()
        .filter_map(|d| d.ooms.first().map(|o| (d, o)))
        .collect();
    let first = if ooms.iter().all(|(_, o)| o.time_us.is_some()) {
        ooms.iter().min_by_key(|(_, o)| o.time_us)
    } else {
        ooms.first()
    };
    if let Some((d, o)) = first {
        let failure = crate::findings::failure(d.device, o, expandable);
        return oomkit_advice::Verdict::failed(&failure, o.cause);
    }
    let top = reports.iter().max_by_key(|d| d.peak_active_bytes);
    oomkit_advice::Verdict::healthy(
        top.map_or(0, |d| d.peak_active_bytes),
        oomkit_advice::Place {
            device: top.map(|d| format!("cuda:{}", d.device)),
            ..Default::default()
        },
        findings,
    )
}

/// Traces at least this long get their first two passes on two cores.
pub(crate) const PARALLEL_MIN_EVENTS: usize = 100_000;

fn analyze_device(
    snap: &Snapshot,
    device: i64,
    opts: &Options,
    warnings: &mut Vec<Warning>,
) -> DeviceReport {
    let stacks = &snap.stacks;
    let segs: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.device == device)
        .collect();
    let events = snap.events(device);

    // State at snapshot time, as the allocator reported it.
    let reserved: u64 = segs.iter().map(|s| s.total_size).sum();
    let active: u64 = segs.iter().map(|s| s.active_size).sum();
    let allocated: u64 = segs.iter().map(|s| s.allocated_size).sum();
    let requested: u64 = segs.iter().map(|s| s.requested_size).sum();
    let mut frag = Fragmentation::default();
    let mut pending = 0;
    for b in segs.iter().flat_map(|s| &s.blocks) {
        match b.state {
            BlockState::Inactive => {
                frag.external_bytes += b.size;
                frag.free_blocks += 1;
                frag.largest_free_block_bytes = frag.largest_free_block_bytes.max(b.size);
            }
            s if s.is_active() => {
                frag.internal_bytes += b.size.saturating_sub(b.requested_size);
                if s == BlockState::ActivePendingFree {
                    pending += b.size;
                }
            }
            _ => {}
        }
    }
    if reserved > 0 {
        frag.external_fraction = frag.external_bytes as f64 / reserved as f64;
    }

    // Blocks active at the end, from the blocks themselves (the replay's ground truth).
    let final_blocks: Vec<(u64, Live)> = segs
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state.is_active())
        .map(|b| {
            let live = Live {
                size: b.size,
                stack: b.stack,
                before_recording: false,
            };
            (b.address, live)
        })
        .collect();
    let final_active: u64 = final_blocks.iter().map(|(_, l)| l.size).sum();

    // The two first passes are independent, since the totals pass counts
    // from zero and the starting totals are added once known, so on a
    // large trace the totals run on a second core.
    let ranges = ranges(snap, device);
    let windows = windows(&ranges, events);
    let (scan, rel) = if events.len() >= PARALLEL_MIN_EVENTS {
        std::thread::scope(|sc| {
            let totals = sc.spawn(|| relative_totals(events, &windows));
            let scan = scan_trace(events);
            // A panic in the totals thread is a bug; rethrowing it keeps it one.
            let rel = totals
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (scan, rel)
        })
    } else {
        (scan_trace(events), relative_totals(events, &windows))
    };
    let mut base_active = final_active as i128 - scan.net_active;
    let mut base_reserved = reserved as i128 - scan.net_reserved;
    if !events.is_empty() && (base_active < 0 || base_reserved < 0) {
        warnings.push(Warning {
            kind: "inconsistent_trace",
            device: Some(device),
            message: format!(
                "cuda:{device}: the trace frees more than the segments can account for ({} active, {} reserved); the timeline starts at zero",
                human_bytes(base_active.unsigned_abs() as u64),
                human_bytes(base_reserved.unsigned_abs() as u64)
            ),
            fix: "record the snapshot with one _dump_snapshot() call, without editing it".into(),
        });
        base_active = base_active.max(0);
        base_reserved = base_reserved.max(0);
    }
    let base_active = base_active as u64;
    let base_reserved = base_reserved as u64;

    // Running totals, the peaks, and active bytes after each entry.
    let Totals {
        peak,
        peak_idx,
        peak_res,
        oom_idx,
        oom_live,
        reserved_after,
        windows: window_stats,
    } = rel
        .absolute(base_active, base_reserved)
        .unwrap_or_else(|| exact_totals(events, &windows, base_active, base_reserved));

    // Pass 2: the live set at the peak and at every OOM.
    let before: Vec<Live> = final_blocks
        .iter()
        .filter(|(addr, _)| !scan.open.contains_key(addr))
        .map(|(_, l)| Live {
            before_recording: true,
            ..*l
        })
        .collect();
    let mut top_sites = Vec::new();
    let mut holders: Vec<Vec<SiteBytes>> = Vec::new();
    // Each OOM's holders cost a pass over the live set, so a trace that
    // records an OOM at every step would take quadratic time, and a finding
    // per OOM would bury the rest.
    let mut targets: Vec<usize> = oom_idx.iter().take(OOMS_DETAILED).copied().collect();
    if oom_idx.len() > OOMS_DETAILED {
        warnings.push(Warning {
            kind: "many_ooms",
            device: Some(device),
            message: format!(
                "cuda:{device}: the trace records {} OOM entries; the holders of memory and the findings cover the first {OOMS_DETAILED}",
                oom_idx.len()
            ),
            fix: "fix the first OOM: a loop that retries after each one records the same failure again".into(),
        });
    }
    if let Some(p) = peak_idx {
        targets.push(p);
    }
    targets.sort_unstable();
    targets.dedup();
    let oom_holders_top = opts.top.min(5);
    if peak_idx.is_none() && !events.is_empty() {
        // The peak is the start: what predates the trace.
        let orphans = scan.orphans.iter().map(|(_, l)| *l);
        top_sites = group(stacks, orphans.chain(before.iter().copied()), opts.top);
    }
    live_at(events, &scan, &before, &targets, |i, live| {
        if Some(i) == peak_idx {
            let live: Vec<Live> = live.collect();
            if events[i].action == Action::Oom && holders.len() < OOMS_DETAILED {
                holders.push(group(stacks, live.iter().copied(), oom_holders_top));
            }
            top_sites = group(stacks, live.into_iter(), opts.top);
        } else {
            holders.push(group(stacks, live, oom_holders_top));
        }
    });
    let top_sites_at = if events.is_empty() {
        // No trace: the live set now is all there is.
        // The replay started from final_active, so that is already the peak.
        top_sites = group(stacks, final_blocks.iter().map(|(_, l)| *l), opts.top);
        "snapshot"
    } else {
        "peak"
    };

    let t0 = events.iter().find_map(|e| e.time_us());
    let peak_time = peak_idx.and_then(|i| events[i].time_us());
    let phases = phases(&ranges, &window_stats);
    let peak_phase = peak_time.and_then(|pt| innermost_phase(&ranges, pt));

    // OOM events.
    let mut ooms = Vec::new();
    for (k, &i) in oom_idx.iter().enumerate() {
        let e = &events[i];
        let live_bytes = oom_live[k];
        let res = reserved_after[k];
        let unalloc = res.saturating_sub(live_bytes);
        // A snapshot records neither the device's capacity nor other processes.
        let cause = oomkit_advice::decide(&oomkit_advice::Figures {
            requested: Some(e.size),
            free: Some(e.addr),
            reserved_unallocated: Some(unalloc),
            ..Default::default()
        });
        let key = site_key(
            stacks,
            &Live {
                size: e.size,
                stack: e.stack,
                before_recording: false,
            },
        );
        let (site, label_text) = label(stacks, &key);
        ooms.push(OomReport {
            event_index: i as u64,
            time_us: e.time_us(),
            requested_bytes: e.size,
            free_bytes: e.addr,
            live_bytes,
            reserved_bytes: res,
            reserved_unallocated_bytes: unalloc,
            cause,
            site,
            label: label_text,
            phase: e.time_us().and_then(|t| innermost_phase(&ranges, t)),
            top_holders: holders.get(k).cloned().unwrap_or_default(),
        });
    }

    warnings.extend(evidence_warnings(
        snap,
        device,
        &scan,
        events.len(),
        t0.is_some(),
    ));
    frag.largest_request_bytes = scan
        .largest_alloc
        .max(final_blocks.iter().map(|(_, l)| l.size).max().unwrap_or(0));

    let actions = Action::ALL
        .iter()
        .zip(scan.action_counts)
        .filter(|(_, n)| *n > 0)
        .map(|(a, n)| (a.name().to_string(), n))
        .collect();
    DeviceReport {
        device,
        events: events.len() as u64,
        actions,
        segments: segs.len() as u64,
        reserved_bytes: reserved,
        active_bytes: active,
        allocated_bytes: allocated,
        requested_bytes: requested,
        pending_free_bytes: pending,
        fragmentation: frag,
        peak_active_bytes: peak,
        peak_event_index: peak_idx.map(|i| i as u64),
        peak_time_us: peak_time,
        peak_offset_s: peak_time.zip(t0).map(|(p, s)| (p - s) as f64 / 1e6),
        peak_phase,
        peak_reserved_bytes: peak_res,
        pre_trace_active_bytes: if events.is_empty() { 0 } else { base_active },
        pre_trace_reserved_bytes: if events.is_empty() { 0 } else { base_reserved },
        top_sites_at,
        top_sites,
        ooms,
        phases,
    }
}

/// What the trace cannot show and how to record one that can: blocks from
/// before its first entry, allocations without stacks, phases without
/// times, and entries this version does not know.
fn evidence_warnings(
    snap: &Snapshot,
    device: i64,
    scan: &TraceScan,
    entries: usize,
    timed: bool,
) -> Vec<Warning> {
    let mut warnings = Vec::new();
    let TraceScan {
        orphans,
        missing_frames,
        allocs,
        ..
    } = scan;
    let (missing_frames, allocs) = (*missing_frames, *allocs);
    if !orphans.is_empty() {
        let bytes: u64 = orphans.iter().map(|(_, l)| l.size).sum();
        warnings.push(Warning {
            kind: "ring_buffer_overflow",
            device: Some(device),
            message: format!(
                // A snapshot does not say whether recording started late or
                // max_entries dropped the oldest entries; both look the same.
                "cuda:{device}: the trace starts mid-run: {} ({}) freed in its {} {} allocated before its first one (recording started after them, or max_entries dropped the oldest entries)",
                oomkit_units::count(orphans.len() as u64, "block", "blocks"),
                human_bytes(bytes),
                oomkit_units::count(entries as u64, "entry", "entries"),
                if orphans.len() == 1 { "was" } else { "were" }
            ),
            fix: format!("start recording before the model is built, with room for the whole run: {RECORD_CALL}"),
        });
    }
    if allocs > 0 && missing_frames > 0 {
        warnings.push(Warning {
            kind: "frames_missing",
            device: Some(device),
            message: format!(
                "cuda:{device}: {missing_frames} of {allocs} allocations have no stack, so their sites are unknown"
            ),
            fix: "record stacks: torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=\"all\", stacks=\"python\")".into(),
        });
    }
    if entries > 0 && !timed && snap.annotations.iter().any(|a| a.device == device) {
        warnings.push(Warning {
            kind: "no_times",
            device: Some(device),
            message: format!("cuda:{device}: trace entries carry no time_us, so phases cannot be placed on the timeline"),
            fix: "record with torch 2.2 or newer".into(),
        });
    }
    if let Some(t) = snap.traces.get(device as usize) {
        for (name, n) in &t.unknown_actions {
            warnings.push(Warning {
                kind: "unknown_action",
                device: Some(device),
                message: format!("cuda:{device}: {n} trace entries have the unknown action '{name}' and were counted but not replayed"),
                fix: "update oomkit if a newer PyTorch wrote this snapshot".into(),
            });
        }
    }

    warnings
}

/// Closed `[start, end]` ranges of each annotated phase on a device; a
/// range still open at snapshot time ends at the end of time.
fn ranges(snap: &Snapshot, device: i64) -> Vec<(String, i64, i64)> {
    crate::timeline::phase_ranges(snap, device)
        .into_iter()
        .map(|r| (r.name, r.start_us, r.end_us.unwrap_or(i64::MAX)))
        .collect()
}

fn innermost_phase(ranges: &[(String, i64, i64)], t: i64) -> Option<String> {
    ranges
        .iter()
        .filter(|(_, s, e)| *s <= t && t <= *e)
        .min_by_key(|(_, s, e)| e.saturating_sub(*s))
        .map(|(n, _, _)| n.clone())
}

fn phases(ranges: &[(String, i64, i64)], stats: &[WindowStats]) -> Vec<PhaseReport> {
    let mut by_name: BTreeMap<String, PhaseReport> = BTreeMap::new();
    for ((name, _, _), w) in ranges.iter().zip(stats) {
        let (at_start, at_end, p, pi) =
            (w.at_start, w.at_end, w.peak, w.peak_idx.map(|i| i as u64));
        let r = by_name.entry(name.clone()).or_insert(PhaseReport {
            name: name.clone(),
            occurrences: 0,
            peak_active_bytes: 0,
            peak_event_index: None,
            max_growth_bytes: 0,
            retained_bytes: 0,
        });
        // Ranges come in time order per name, so the last one wins.
        r.retained_bytes = at_end as i64 - at_start as i64;
        r.occurrences += 1;
        if p > r.peak_active_bytes || r.occurrences == 1 {
            r.peak_active_bytes = p;
            r.peak_event_index = pi;
        }
        r.max_growth_bytes = r.max_growth_bytes.max(p - at_start);
    }
    let mut v: Vec<PhaseReport> = by_name.into_values().collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.peak_active_bytes));
    v
}
