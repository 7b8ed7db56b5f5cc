//! Analyses of a snapshot: state at snapshot time, trace replay, the live
//! set at the peak by allocation site, OOM events, phases, and advice.

use crate::findings::{findings, OOMS_DETAILED};
use crate::frame_kinds::{kinds, Kinds};
use crate::model::{Action, BlockState, Snapshot, TraceEvent};
use crate::replay::{
    exact_totals, live_at, relative_totals, scan_trace, windows, Totals, TraceScan, Window,
    WindowStats,
};
use crate::report::UnknownReason;
use crate::report::{
    Analysis, DeviceReport, Fragmentation, OomReport, Options, PeakAndEnd, PhaseReport, SiteBytes,
    Warning,
};
use crate::roles::{Context, DeviceRoles, Moment, UNKNOWN_WARN_SHARE};
use crate::sites::{group, label, site_key, Live};
use oomkit_advice::{Role, RoleBytes};
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
    let kinds = kinds(&snap.stacks);
    let reports: Vec<DeviceReport> = devices
        .iter()
        .map(|&d| analyze_device(snap, d, opts, &kinds, &mut warnings))
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
    let mut v = oomkit_advice::Verdict::healthy(
        top.map_or(0, |d| d.peak_active_bytes),
        oomkit_advice::Place {
            device: top.map(|d| format!("cuda:{}", d.device)),
            ..Default::default()
        },
        findings,
    );
    v.role = top.and_then(|d| crate::findings::largest_role(&d.roles.peak).map(|(r, _)| r));
    v
}

/// Traces at least this long get their first two passes on two cores.
pub(crate) const PARALLEL_MIN_EVENTS: usize = 100_000;

/// One device's report: the state at snapshot time, the first pass (the
/// trace's scan and running totals, on two cores for a long trace), the
/// totals from before the trace, pass 2 ([`live_sets`]), the OOMs
/// ([`oom_reports`]) and the warnings.
///
/// Long on purpose: it is the order of the analysis, each step a call, and
/// a quarter of it the report's fields set from what the steps found.
fn analyze_device(
    snap: &Snapshot,
    device: i64,
    opts: &Options,
    kinds: &Kinds,
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
    let AtSnapshot {
        reserved,
        active,
        allocated,
        requested,
        pending,
        mut frag,
    } = at_snapshot(&segs);

    // Blocks active at the end, from the blocks themselves (the replay's ground truth).
    let final_blocks = final_blocks(snap, device);
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
    // The trace records the bytes asked for, the blocks their rounded size:
    // the blocks it allocated that are still alive count at their requested
    // size in the replay, so that the live set at any entry adds up to the
    // totals there.
    let rounding: u64 = final_blocks
        .iter()
        .filter_map(|(addr, l)| {
            let a = *scan.open.get(addr)?;
            Some(l.size.saturating_sub(events[a as usize].size))
        })
        .sum();
    let (base_active, base_reserved) = starting_totals(
        device,
        !events.is_empty(),
        final_active as i128 - rounding as i128 - scan.net_active,
        reserved as i128 - scan.net_reserved,
        warnings,
    );

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

    // Pass 2: the live set at the peak and at every OOM, and their roles.
    let LiveSets {
        mut top_sites,
        holders,
        oom_roles,
        peak_roles,
        mut end_roles,
    } = live_sets(
        &Traced {
            snap,
            device,
            kinds,
            events,
            scan: &scan,
            final_blocks: &final_blocks,
            ranges: &ranges,
            windows: &windows,
        },
        peak_idx,
        &oom_idx,
        opts,
        warnings,
    );
    // A file whose segments count more active bytes than their blocks list
    // (edited, or written mid-update) has bytes no block accounts for.
    end_roles.add_unlisted(active.saturating_sub(final_active));
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

    let ooms = oom_reports(
        stacks,
        events,
        &ranges,
        &OomFigures {
            at: &oom_idx,
            live: &oom_live,
            reserved_after: &reserved_after,
            holders: &holders,
            roles: &oom_roles,
        },
    );

    warnings.extend(unknown_warning(device, &peak_roles));
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
        roles: PeakAndEnd {
            peak: peak_roles.roles.bytes,
            end: end_roles.roles.bytes,
        },
        roles_evidence: PeakAndEnd {
            peak: peak_roles.roles.evidence,
            end: end_roles.roles.evidence,
        },
        roles_unknown_reason: PeakAndEnd {
            peak: peak_roles.main_reason(),
            end: end_roles.main_reason(),
        },
    }
}

/// One device's trace and what the first pass made of it.
#[derive(Clone, Copy)]
struct Traced<'a> {
    snap: &'a Snapshot,
    device: i64,
    kinds: &'a Kinds,
    events: &'a [TraceEvent],
    scan: &'a TraceScan,
    final_blocks: &'a [(u64, Live)],
    ranges: &'a [(String, i64, i64)],
    windows: &'a [Window],
}

/// What the live sets at the peak and at the OOMs hold: the sites, and the roles.
struct LiveSets {
    top_sites: Vec<SiteBytes>,
    holders: Vec<Vec<SiteBytes>>,
    oom_roles: Vec<Moment>,
    peak_roles: Moment,
    end_roles: Moment,
}

/// Pass 2: rebuilds the live set at the peak and at each OOM (the first
/// [`OOMS_DETAILED`]), groups them by site, and counts their roles, deciding
/// the roles on a second core where the trace is long.
fn live_sets(
    t: &Traced<'_>,
    peak_idx: Option<usize>,
    oom_idx: &[usize],
    opts: &Options,
    warnings: &mut Vec<Warning>,
) -> LiveSets {
    let Traced {
        snap,
        device,
        kinds,
        events,
        scan,
        final_blocks,
        ranges,
        windows,
    } = *t;
    let stacks = &snap.stacks;
    let (before, end) = before_and_end(final_blocks, scan);
    let mut top_sites = Vec::new();
    let mut holders: Vec<Vec<SiteBytes>> = Vec::new();
    // The live set at the peak, where its roles are counted after pass 2.
    let mut peak_live: Option<Vec<Live>> = None;
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
        let live: Vec<Live> = orphans.chain(before.iter().copied()).collect();
        top_sites = group(stacks, live.iter().copied(), opts.top);
        peak_live = Some(live);
    }
    let decide = || {
        let context = context(snap, device, ranges, windows);
        DeviceRoles::new(kinds, events, scan, &context, &before, &end)
    };
    // Pass 2 counts each live set's roles on the spot when the roles are
    // decided; otherwise it keeps the peak's live set for later.
    let mut oom_roles: Vec<Moment> = Vec::new();
    let mut peak_roles: Option<Moment> = None;
    let mut pass2 = |roles: Option<&DeviceRoles>, peak_live: &mut Option<Vec<Live>>| {
        live_at(events, scan, &before, &targets, |i, live| {
            let live: Vec<Live> = live.collect();
            let oom = Some(i) != peak_idx
                || (events[i].action == Action::Oom && holders.len() < OOMS_DETAILED);
            if oom {
                holders.push(group(stacks, live.iter().copied(), oom_holders_top));
                if let Some(r) = roles {
                    oom_roles.push(r.at(live.iter().copied()));
                }
            }
            if Some(i) == peak_idx {
                top_sites = group(stacks, live.iter().copied(), opts.top);
                match roles {
                    Some(r) => peak_roles = Some(r.at(live.into_iter())),
                    None => *peak_live = Some(live),
                }
            }
        })
    };
    // Deciding the roles reads the whole trace again; on a long one without
    // OOM entries (whose live sets would have to wait in memory) it runs on
    // the second core while the live set at the peak is rebuilt.
    let roles = if events.len() >= PARALLEL_MIN_EVENTS && oom_idx.is_empty() {
        std::thread::scope(|sc| {
            let roles = sc.spawn(decide);
            pass2(None, &mut peak_live);
            // A panic in the roles thread is a bug; rethrowing it keeps it one.
            roles
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    } else {
        let roles = decide();
        pass2(Some(&roles), &mut peak_live);
        roles
    };
    if let Some(l) = peak_live.take() {
        peak_roles = Some(roles.at(l.into_iter()));
    }
    let end_roles = roles.at(end.iter().copied());
    let peak_roles = peak_roles.unwrap_or_else(|| roles.at(end.iter().copied()));
    LiveSets {
        top_sites,
        holders,
        oom_roles,
        peak_roles,
        end_roles,
    }
}

/// What the segments say at snapshot time: the allocator's own totals, the
/// active blocks pending a free, and the fragmentation.
struct AtSnapshot {
    reserved: u64,
    active: u64,
    allocated: u64,
    requested: u64,
    pending: u64,
    frag: Fragmentation,
}

/// Sums the segments of one device as the allocator reported them.
fn at_snapshot(segs: &[&crate::model::Segment]) -> AtSnapshot {
    let reserved: u64 = segs.iter().map(|s| s.total_size).sum();
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
    AtSnapshot {
        reserved,
        active: segs.iter().map(|s| s.active_size).sum(),
        allocated: segs.iter().map(|s| s.allocated_size).sum(),
        requested: segs.iter().map(|s| s.requested_size).sum(),
        pending,
        frag,
    }
}

/// The active and reserved bytes live before the trace's first entry, from
/// what the segments hold at its end less the trace's net effect; a trace
/// that frees more than the segments account for starts at zero, with a
/// warning.
fn starting_totals(
    device: i64,
    traced: bool,
    active: i128,
    reserved: i128,
    warnings: &mut Vec<Warning>,
) -> (u64, u64) {
    if traced && (active < 0 || reserved < 0) {
        warnings.push(Warning {
            kind: "inconsistent_trace",
            device: Some(device),
            message: format!(
                "cuda:{device}: the trace frees more than the segments can account for ({} active, {} reserved); the timeline starts at zero",
                human_bytes(active.unsigned_abs() as u64),
                human_bytes(reserved.unsigned_abs() as u64)
            ),
            fix: "record the snapshot with one _dump_snapshot() call, without editing it".into(),
        });
    }
    (active.max(0) as u64, reserved.max(0) as u64)
}

/// What the replay and pass 2 found at each OOM entry, in order.
struct OomFigures<'a> {
    /// The entries.
    at: &'a [usize],
    /// Active bytes at each.
    live: &'a [u64],
    /// Reserved bytes at each.
    reserved_after: &'a [u64],
    /// The sites holding the memory, for the first few.
    holders: &'a [Vec<SiteBytes>],
    /// The roles of the live set, for the first few.
    roles: &'a [Moment],
}

/// One report per OOM entry: the request, what was free and held, the cause, the site and the holders.
fn oom_reports(
    stacks: &crate::stacks::Stacks,
    events: &[TraceEvent],
    ranges: &[(String, i64, i64)],
    f: &OomFigures<'_>,
) -> Vec<OomReport> {
    let mut ooms = Vec::new();
    for (k, &i) in f.at.iter().enumerate() {
        let e = &events[i];
        let live_bytes = f.live[k];
        let res = f.reserved_after[k];
        let unalloc = res.saturating_sub(live_bytes);
        // A snapshot records neither the device's capacity nor other processes.
        let cause = oomkit_advice::decide(&oomkit_advice::Figures {
            requested: Some(e.size),
            free: Some(e.addr),
            reserved_unallocated: Some(unalloc),
            // The allocator reads what the driver has free as the request fails.
            free_at_failure: true,
            ..Default::default()
        });
        let key = site_key(
            stacks,
            &Live {
                size: e.size,
                requested: e.size,
                stack: e.stack,
                before_recording: false,
                private_pool: false,
                at: Live::UNTRACED,
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
            phase: e.time_us().and_then(|t| innermost_phase(ranges, t)),
            top_holders: f.holders.get(k).cloned().unwrap_or_default(),
            roles: f.roles.get(k).map(|m| m.roles.bytes).unwrap_or(RoleBytes {
                unknown: live_bytes,
                ..Default::default()
            }),
            roles_evidence: f.roles.get(k).map(|m| m.roles.evidence).unwrap_or_default(),
            roles_unknown_reason: match f.roles.get(k) {
                Some(m) => m.main_reason(),
                None => Some(UnknownReason::NotExamined),
            },
        });
    }
    ooms
}

/// The blocks active at snapshot time on a device, by address.
fn final_blocks(snap: &Snapshot, device: i64) -> Vec<(u64, Live)> {
    snap.segments
        .iter()
        .filter(|s| s.device == device)
        .flat_map(|s| s.blocks.iter().map(move |b| (s.private_pool, b)))
        .filter(|(_, b)| b.state.is_active())
        .map(|(private_pool, b)| {
            let live = Live {
                size: b.size,
                // Files before torch 2.1 record no requested size.
                requested: if b.requested_size > 0 {
                    b.requested_size
                } else {
                    b.size
                },
                stack: b.stack,
                before_recording: false,
                private_pool,
                at: Live::UNTRACED,
            };
            (b.address, live)
        })
        .collect()
}

/// The blocks from before the trace still alive at its end, and every
/// block alive at the end with the entry that allocated it.
fn before_and_end(final_blocks: &[(u64, Live)], scan: &TraceScan) -> (Vec<Live>, Vec<Live>) {
    let before: Vec<Live> = final_blocks
        .iter()
        .filter(|(addr, _)| !scan.open.contains_key(addr))
        .map(|(_, l)| Live {
            before_recording: true,
            ..*l
        })
        .collect();
    let end: Vec<Live> = final_blocks
        .iter()
        .map(|(addr, l)| Live {
            at: scan.open.get(addr).copied().unwrap_or(Live::UNTRACED),
            ..*l
        })
        .collect();
    (before, end)
}

/// What a device says about its trace besides the trace: the optimizer
/// steps and evaluation ranges among its `record_function` ranges (and their
/// entries, `windows`), and its private-pool segments.
fn context(
    snap: &Snapshot,
    device: i64,
    ranges: &[(String, i64, i64)],
    windows: &[crate::replay::Window],
) -> Context {
    let named = |keep: fn(&str) -> bool| -> Vec<_> {
        ranges
            .iter()
            .zip(windows)
            .filter(|((name, _, _), _)| keep(name))
            .map(|(_, w)| *w)
            .collect()
    };
    let mut private: Vec<(u64, u64)> = snap
        .segments
        .iter()
        .filter(|s| s.device == device && s.private_pool)
        .map(|s| (s.address, s.address.saturating_add(s.total_size)))
        .collect();
    private.sort_unstable();
    Context {
        optimizer_steps: named(|n| n.starts_with(OPTIMIZER_STEP_RANGE)),
        evals: named(is_eval_range),
        has_optimizer: ranges
            .iter()
            .any(|(name, _, _)| name.starts_with(OPTIMIZER_RANGE)),
        private,
    }
}

/// The live bytes by role after each chosen entry of a device's trace
/// (`None`: before the first), for a chart stacked by role; each adds up to
/// the replayed active bytes there; and at each, the role its entry adds
/// to (an allocation) or takes from (a completed free), if any.
///
/// Each block keeps one role for its whole life, the one the analysis gives
/// it; frameless allocations made during the trace, which the analysis
/// matches by size moment by moment, are drawn as unknown.
pub fn role_timeline(
    snap: &Snapshot,
    device: i64,
    at: &[Option<u64>],
) -> (Vec<RoleBytes>, Vec<Option<Role>>) {
    let events = snap.events(device);
    let kinds = kinds(&snap.stacks);
    let scan = scan_trace(events);
    let ranges = ranges(snap, device);
    let windows = windows(&ranges, events);
    let final_blocks = final_blocks(snap, device);
    let (before, end) = before_and_end(&final_blocks, &scan);
    let context = context(snap, device, &ranges, &windows);
    let roles = DeviceRoles::new(&kinds, events, &scan, &context, &before, &end);
    let mut now = RoleBytes::default();
    let orphans = scan.orphans.len();
    let mut orphan_role = vec![Role::Unknown; orphans];
    let start = scan
        .orphans
        .iter()
        .map(|(_, l)| *l)
        .chain(before.iter().copied());
    roles.each(start, |k, l, told| {
        let r = told.map_or(Role::Unknown, |(r, _)| r);
        *now.get_mut(r) += l.size;
        if k < orphans {
            orphan_role[k] = r;
        }
    });
    let mut series = Vec::with_capacity(at.len());
    let mut entry_roles = Vec::with_capacity(at.len());
    let mut wanted = at.iter().peekable();
    while wanted.next_if(|w| w.is_none()).is_some() {
        series.push(now);
        entry_roles.push(None);
    }
    let mut next_orphan = 0;
    for (i, e) in events.iter().enumerate() {
        // Only completed frees lower the totals, as in the replay.
        let role = match e.action {
            Action::Alloc => Some(roles.traced_role(i)),
            Action::FreeCompleted => match scan.link[i].checked_sub(1) {
                Some(a) => Some(roles.traced_role(a as usize)),
                None => {
                    let r = orphan_role.get(next_orphan).copied();
                    next_orphan += 1;
                    r
                }
            },
            _ => None,
        };
        if let Some(r) = role {
            let b = now.get_mut(r);
            *b = if e.action == Action::Alloc {
                *b + e.size
            } else {
                b.saturating_sub(e.size)
            };
        }
        while wanted.next_if(|w| **w == Some(i as u64)).is_some() {
            series.push(now);
            entry_roles.push(role);
        }
    }
    (series, entry_roles)
}

/// The role of each allocation of a device's trace, by entry: what the
/// analysis tells from the allocating frames and the block's lifetime
/// (`Role::Unknown` for entries that allocate nothing, and for frameless
/// allocations, which the analysis only matches by size moment by moment).
pub fn traced_roles(snap: &Snapshot, device: i64) -> Vec<Role> {
    let events = snap.events(device);
    let kinds = kinds(&snap.stacks);
    let scan = scan_trace(events);
    let ranges = ranges(snap, device);
    let windows = windows(&ranges, events);
    let final_blocks = final_blocks(snap, device);
    let (before, end) = before_and_end(&final_blocks, &scan);
    let context = context(snap, device, &ranges, &windows);
    let roles = DeviceRoles::new(&kinds, events, &scan, &context, &before, &end);
    events
        .iter()
        .enumerate()
        .map(|(i, e)| match e.action {
            Action::Alloc => roles.traced_role(i),
            _ => Role::Unknown,
        })
        .collect()
}

/// The name PyTorch's optimizers give their step's `record_function` range.
const OPTIMIZER_STEP_RANGE: &str = "Optimizer.step";
/// The start of every range PyTorch's optimizers record (`step`, `zero_grad`).
const OPTIMIZER_RANGE: &str = "Optimizer.";

/// Whether a range's name says it evaluates (no backward follows its forward).
fn is_eval_range(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["eval", "valid", "test", "predict", "generat", "inference"]
        .iter()
        .any(|w| n.contains(w))
}

/// Says why much of the peak has no role, and how to record a file that tells.
fn unknown_warning(device: i64, peak: &Moment) -> Option<Warning> {
    let total = peak.roles.bytes.total();
    let unknown = peak.roles.bytes.unknown;
    if total == 0 || (unknown as f64) < UNKNOWN_WARN_SHARE * total as f64 {
        return None;
    }
    let why = peak.main_reason()?;
    let fix = match why {
        crate::report::UnknownReason::NoEvidence => format!("record with stacks from before the model is built, so that parameters and optimizer state have frames: {RECORD_CALL}"),
        _ => "record a whole training step (forward, backward and optimizer step) with stacks: torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=\"all\")".into(),
    };
    Some(Warning {
        kind: "roles_unknown",
        device: Some(device),
        message: format!(
            "cuda:{device}: {} of the peak ({:.0}%) has no role: most of it because {}",
            human_bytes(unknown),
            100.0 * unknown as f64 / total as f64,
            why.words()
        ),
        fix,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Block, DeviceTrace, Segment, TraceEvent};
    use crate::stacks::{Frame, Stacks};

    fn stack(stacks: &mut Stacks, frames: &[(&str, &str)]) -> crate::stacks::StackId {
        let ids = frames
            .iter()
            .map(|(f, n)| {
                stacks.intern_frame(Frame {
                    filename: (*f).into(),
                    line: 1,
                    name: (*n).into(),
                })
            })
            .collect();
        stacks.intern_stack(ids)
    }

    /// Blocks in a private pool's segment (a CUDA graph's) are other, the
    /// trace's allocations there too.
    #[test]
    fn a_private_pool_holds_other_memory() {
        let mut stacks = Stacks::default();
        let fwd = stack(&mut stacks, &[("/home/me/model.py", "forward")]);
        let mut e = TraceEvent::BLANK;
        (e.action, e.addr, e.size, e.stack) = (Action::Alloc, 0x10_0000 + 512, 512, fwd);
        let block = |address, stack| Block {
            address,
            size: 512,
            requested_size: 512,
            state: crate::model::BlockState::ActiveAllocated,
            stack,
        };
        let segment = |address, private_pool, blocks| Segment {
            device: 0,
            address,
            total_size: 2048,
            allocated_size: 1024,
            active_size: 1024,
            requested_size: 1024,
            stream: 0,
            segment_type: "small".into(),
            is_expandable: false,
            private_pool,
            pool: private_pool as u8,
            blocks,
        };
        let snap = Snapshot {
            segments: vec![
                segment(
                    0x10_0000,
                    true,
                    vec![block(0x10_0000, fwd), block(0x10_0000 + 512, fwd)],
                ),
                segment(
                    0x20_0000,
                    false,
                    vec![block(0x20_0000, fwd), block(0x20_0000 + 512, fwd)],
                ),
            ],
            traces: vec![DeviceTrace {
                events: vec![e],
                ..Default::default()
            }],
            allocator_settings: None,
            annotations: Vec::new(),
            stacks,
            layout: Default::default(),
            streams: vec![0],
            pools: vec![(0, 0)],
        };
        let a = analyze(&snap, &Options::default());
        let end = a.devices[0].roles.end;
        assert_eq!(end.other, 1024, "{end:?}");
        assert_eq!(end.total(), 2048);
    }

    /// A trace long enough to decide the roles on the second core gives the
    /// roles that deciding them first gives.
    #[test]
    fn roles_decided_beside_the_second_pass_are_the_same() {
        let mut stacks = Stacks::default();
        let fwd = stack(&mut stacks, &[("/home/me/model.py", "forward")]);
        let bwd = stack(
            &mut stacks,
            &[("??", "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)")],
        );
        let ev = |action, addr, size, stack| {
            let mut e = TraceEvent::BLANK;
            (e.action, e.addr, e.size, e.stack) = (action, addr, size, stack);
            e
        };
        let mut events = Vec::new();
        // Steps of forward (kept for backward) then backward, each leaving
        // one backward result behind, which outlives its pass.
        let steps = PARALLEL_MIN_EVENTS as u64 / 5 + 1;
        for k in 0..steps {
            let (a, b, g) = (3 * k + 1, 3 * k + 2, 3 * k + 3);
            events.push(ev(Action::Alloc, a << 12, 4096 + k % 7, fwd));
            events.push(ev(Action::Alloc, b << 12, 2048, bwd));
            events.push(ev(Action::FreeCompleted, b << 12, 2048, bwd));
            events.push(ev(Action::FreeCompleted, a << 12, 4096 + k % 7, fwd));
            events.push(ev(Action::Alloc, g << 12, 512, bwd));
        }
        let blocks: Vec<Block> = (0..steps)
            .map(|k| Block {
                address: (3 * k + 3) << 12,
                size: 512,
                requested_size: 512,
                state: crate::model::BlockState::ActiveAllocated,
                stack: bwd,
            })
            .collect();
        let total = 512 * steps;
        let snap = Snapshot {
            segments: vec![Segment {
                device: 0,
                address: 1 << 12,
                total_size: total,
                allocated_size: total,
                active_size: total,
                requested_size: total,
                stream: 0,
                segment_type: "large".into(),
                is_expandable: false,
                private_pool: false,
                pool: 0,
                blocks,
            }],
            traces: vec![DeviceTrace {
                events: events.clone(),
                ..Default::default()
            }],
            allocator_settings: None,
            annotations: Vec::new(),
            stacks,
            layout: Default::default(),
            streams: vec![0],
            pools: vec![(0, 0)],
        };
        assert!(events.len() >= PARALLEL_MIN_EVENTS);
        let a = analyze(&snap, &Options::default());
        let d = &a.devices[0];
        assert_eq!(d.roles.peak.total(), d.peak_active_bytes);
        // The same roles, decided first and counted on the peak's live set.
        let kinds = kinds(&snap.stacks);
        let scan = scan_trace(&events);
        let finals = final_blocks(&snap, 0);
        let (before, end) = before_and_end(&finals, &scan);
        let roles = DeviceRoles::new(&kinds, &events, &scan, &Context::default(), &before, &end);
        let peak = d.peak_event_index.unwrap() as usize;
        let mut want = None;
        live_at(&events, &scan, &before, &[peak], |_, live| {
            want = Some(roles.at(live))
        });
        assert_eq!(d.roles.peak, want.unwrap().roles.bytes);
        assert!(d.roles.peak.activations > 0 && d.roles.peak.gradients > 0);
        assert_eq!(d.roles.end.gradients, total);
    }
}
