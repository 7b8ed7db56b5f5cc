//! Replaying a device's trace through the model, as recorded and under
//! each scenario: allocations and frees are fed in trace order, the
//! model's own segments, peaks and failures are collected, and the
//! trace's own segment entries are kept to check the model against.

use crate::config::AllocatorConfig;
use crate::error::AllocatorError;
use crate::model::{Allocator, BlockId, Failure, SegmentOp, State};
use crate::report::{
    Agreement, DeviceWhatIf, Divergence, OomOut, RecordedOom, ScenarioOut, SegmentOut, StartKind,
    WhatIf,
};
use crate::rules::PoolKind;
use crate::scenario::Scenario;
use crate::start::{start_state, Start};
use oomkit_snapshot::{Action, FastState, Role, Snapshot, TraceEvent};
use std::collections::{HashMap, HashSet};

/// How to replay.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Only this device.
    pub device: Option<i64>,
    /// Trace entries after which to sample reserved bytes (sorted), for drawing.
    pub samples: Vec<usize>,
    /// Leave out the replay under the recorded settings from a fresh start,
    /// which scenarios placed afresh are compared with (for drawing, which
    /// does not compare).
    pub no_baseline: bool,
}

/// The name of the replay of the trace as it was recorded, from the state it began with.
pub const AS_RECORDED: &str = "as recorded";
/// The name of the replay under the recorded settings from an empty cache:
/// what a new run would do, which scenarios that change a condition are compared with.
pub const FRESH_BASELINE: &str = "as recorded, fresh start";

/// The entry index the model is at while it lays out the start.
const BEFORE_TRACE: usize = usize::MAX;

/// OOMs that imply capacities further apart than this share are noted:
/// something else on the device changed what it had free.
const CAPACITY_SPREAD: f64 = 0.01;

/// Replays every device's trace as recorded and under each scenario.
pub fn what_if(
    snap: &Snapshot,
    scenarios: &[Scenario],
    opts: &Options,
) -> Result<WhatIf, AllocatorError> {
    let (mut recorded, unknown) = match &snap.allocator_settings {
        Some(s) => AllocatorConfig::from_settings(s),
        None => (AllocatorConfig::default(), Vec::new()),
    };
    // Without recorded settings, expandable segments in the end state still
    // say how the run was set.
    let inferred =
        snap.allocator_settings.is_none() && snap.segments.iter().any(|s| s.is_expandable);
    if inferred {
        recorded.expandable_segments = true;
    }
    // Settings are checked before anything is replayed, so a typo costs no time.
    let mut configs = Vec::with_capacity(scenarios.len());
    for s in scenarios {
        let mut c = recorded.clone();
        if let Some(conf) = &s.alloc_conf {
            c.apply(conf)?;
        }
        configs.push(c);
    }
    let mut devices = Vec::new();
    for (d, t) in snap.traces.iter().enumerate() {
        let device = d as i64;
        if t.events.is_empty() || opts.device.is_some_and(|want| want != device) {
            continue;
        }
        let mut out = device_what_if(snap, device, &recorded, scenarios, &configs, opts);
        if snap.allocator_settings.is_none() {
            let assumed = if inferred {
                "PyTorch's defaults with expandable_segments:True (its segments are expandable) are assumed"
            } else {
                "PyTorch's defaults are assumed"
            };
            out.notes.insert(0, format!("the snapshot does not record its allocator settings (torch before 2.5); {assumed}"));
        }
        if !unknown.is_empty() {
            out.notes.push(format!(
                "recorded settings the model does not follow: {}",
                unknown.join(", ")
            ));
        }
        devices.push(out);
    }
    Ok(WhatIf {
        recorded_settings: recorded.describe(),
        settings_recorded: snap.allocator_settings.is_some(),
        devices,
    })
}

/// What every replay of one device shares.
struct Device<'a> {
    events: &'a [TraceEvent],
    start: Start,
    /// For each entry, the next entry that is not a `free_completed`.
    after_completes: Vec<u32>,
    /// For each entry, the next entry that is not a `segment_free` or `segment_unmap`.
    after_releases: Vec<u32>,
    /// The private pool of each allocation, where any segment is private.
    private: Option<Vec<u8>>,
    /// Above every address the snapshot names, where fresh segments go.
    fresh_base: u64,
    samples: &'a [usize],
}

/// Replays one device's trace as recorded and under each scenario, and
/// checks the replay as recorded against the trace's own segments.
fn device_what_if(
    snap: &Snapshot,
    device: i64,
    recorded: &AllocatorConfig,
    scenarios: &[Scenario],
    configs: &[AllocatorConfig],
    opts: &Options,
) -> DeviceWhatIf {
    let d = Device::new(snap, device, recorded, &opts.samples);
    let mut notes = d.start.notes.clone();
    let facts = TraceFacts::of(d.events, recorded, d.start.reserved(), &mut notes);
    let roles = scenarios
        .iter()
        .any(|s| s.batch_scale.is_some())
        .then(|| oomkit_snapshot::traced_roles(snap, device));
    if roles.is_some() {
        notes.push("a micro-batch scenario scales the allocations the analysis tells as activations, temporaries or inputs, and keeps the rest as recorded: an approximation, since a smaller batch can also change which kernels run and their workspaces".into());
    }
    let jobs = jobs(
        &d,
        recorded,
        scenarios,
        configs,
        roles.as_deref(),
        &facts,
        opts,
    );
    let mut results = run_all(&d, &jobs).into_iter();
    let (first, checks) = results.next().expect("the recorded replay is always run");
    let agreement = agree(&facts.segments, &first.segments, checks.placed);
    let outside = outside_recorded(d.events, &d.start);
    if outside > 0 {
        notes.push(format!(
            "{outside} of the trace's allocations lie in no segment it shows: the trace and the segments cannot come from one run of PyTorch's allocator (a generated sample?), so the figures do not describe a run"
        ));
    }
    let fresh_baseline = jobs
        .iter()
        .find(|j| j.start == StartKind::Fresh && j.name == FRESH_BASELINE)
        .map(|j| j.name.clone());
    let outs: Vec<ScenarioOut> = std::iter::once((first, checks))
        .chain(results)
        .zip(&jobs)
        .enumerate()
        .map(|(k, ((o, _), j))| ScenarioOut {
            name: j.name.clone(),
            capacity_source: source(j.capacity.is_some(), j.given, facts.limit.is_some()),
            batch_scale: j.scale.map(|(f, _)| f),
            baseline: match j.start {
                _ if k == 0 || j.name == FRESH_BASELINE => None,
                StartKind::Fresh => fresh_baseline.clone(),
                StartKind::AsRecorded => Some(AS_RECORDED.to_string()),
            },
            ..o
        })
        .collect();
    DeviceWhatIf {
        device,
        events: d.events.len(),
        reserved_at_start_bytes: d.start.reserved(),
        cached_at_start_bytes: d.start.cached(),
        recorded_segments: facts.segments,
        recorded_peak_reserved_bytes: facts.peak,
        agreement,
        scenarios: outs,
        notes,
    }
}

impl<'a> Device<'a> {
    /// What every replay of a device shares: its entries, the state they
    /// began from, where runs of frees and releases end, the private pool of
    /// each allocation, and where fresh segments go.
    fn new(
        snap: &'a Snapshot,
        device: i64,
        recorded: &AllocatorConfig,
        samples: &'a [usize],
    ) -> Device<'a> {
        let events = snap.events(device);
        let n = events.len();
        let mut after_completes = vec![n as u32; n + 1];
        let mut after_releases = vec![n as u32; n + 1];
        for i in (0..n).rev() {
            after_completes[i] = match events[i].action {
                Action::FreeCompleted => after_completes[i + 1],
                _ => i as u32,
            };
            after_releases[i] = match events[i].action {
                Action::SegmentFree | Action::SegmentUnmap => after_releases[i + 1],
                _ => i as u32,
            };
        }
        let mut top = 0u64;
        for s in snap.segments.iter().filter(|s| s.device == device) {
            top = top.max(s.address.saturating_add(s.total_size));
        }
        for e in events {
            if matches!(
                e.action,
                Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap
            ) {
                top = top.max(e.addr.saturating_add(e.size));
            }
        }
        Device {
            events,
            private: private_pools(snap, device),
            start: start_state(snap, device, recorded),
            after_completes,
            after_releases,
            fresh_base: top.div_ceil(1 << 30).saturating_add(1) << 30,
            samples,
        }
    }
}

/// What the trace shows by itself: its own segments, its peak, the
/// capacity its OOMs imply, and the process's own limit where the first
/// OOM had room on the device.
struct TraceFacts {
    segments: Vec<SegmentOut>,
    peak: u64,
    capacity: Option<u64>,
    limit: Option<ProcessLimit>,
}

impl TraceFacts {
    /// Reads the facts off the trace, noting in `notes` a process limit and OOMs that disagree on the capacity.
    fn of(
        events: &[TraceEvent],
        recorded: &AllocatorConfig,
        start_reserved: u64,
        notes: &mut Vec<String>,
    ) -> TraceFacts {
        let (peak, capacities, limit) = recorded_reserved(events, start_reserved);
        if let Some(l) = &limit {
            notes.push(format!(
                "the OOM at entry {} came with {} free on the device, more than the {} asked for: the limit was the process's own (set_per_process_memory_fraction, which the snapshot does not record) or a driver that would not give one piece that large, not the device's free memory; it lay between {} (held before) and {} (held when it failed plus the request), so it is replayed at {}, the least it can be: an OOM avoided there is avoided under the real limit, one that happens there may not (--capacity with the limit, the OOM message's \"allowed\", replays against it)",
                l.event,
                oomkit_units::human_bytes(l.free),
                oomkit_units::human_bytes(l.requested),
                oomkit_units::human_bytes(l.floor),
                oomkit_units::human_bytes(l.ceiling),
                oomkit_units::human_bytes(l.floor),
            ));
        }
        if let (Some(lo), Some(hi)) = (capacities.iter().min(), capacities.iter().max()) {
            if (*hi - *lo) as f64 > CAPACITY_SPREAD * *hi as f64 {
                notes.push(format!(
                    "the trace's OOMs imply capacities from {} to {}: something else on the device changed what was free; the first is used",
                    oomkit_units::human_bytes(*lo),
                    oomkit_units::human_bytes(*hi)
                ));
            }
        }
        TraceFacts {
            segments: recorded_segments(events, recorded),
            peak,
            capacity: capacities.first().copied(),
            limit,
        }
    }
}

/// Every replay to run: the trace as recorded first, then, where a
/// scenario starts afresh, the recorded settings from a fresh start, then
/// each scenario. Each is independent, so a long trace's replays run side by side.
fn jobs<'r>(
    d: &Device<'_>,
    recorded: &AllocatorConfig,
    scenarios: &[Scenario],
    configs: &[AllocatorConfig],
    roles: Option<&'r [Role]>,
    facts: &TraceFacts,
    opts: &Options,
) -> Vec<Job<'r>> {
    let mut jobs: Vec<Job<'r>> = vec![Job {
        name: AS_RECORDED.into(),
        config: recorded.clone(),
        capacity: facts.capacity,
        given: false,
        start: StartKind::AsRecorded,
        scale: None,
    }];
    let empty_start = d.start.segments.is_empty();
    for (s, c) in scenarios.iter().zip(configs) {
        // A changed condition is a new run, which starts with an empty
        // cache: a warm trace's segments would otherwise carry over a cache
        // that another capacity, micro-batch or setting never builds.
        let changed = c != recorded || s.capacity.is_some() || s.batch_scale.is_some();
        let start = if changed && !empty_start {
            StartKind::Fresh
        } else {
            StartKind::AsRecorded
        };
        if start == StartKind::Fresh
            && !opts.no_baseline
            && !jobs.iter().any(|j| j.start == StartKind::Fresh)
        {
            // Compared with a fresh start under the recorded settings, so
            // that dropping the cache from before the trace is not credited
            // to the change: like is compared with like.
            jobs.push(Job {
                name: FRESH_BASELINE.into(),
                config: recorded.clone(),
                capacity: facts.capacity,
                given: false,
                start,
                scale: None,
            });
        }
        jobs.push(Job {
            name: s.label.clone(),
            config: c.clone(),
            capacity: s.capacity.or(facts.capacity),
            given: s.capacity.is_some(),
            start,
            scale: match (s.batch_scale, roles) {
                (Some(f), Some(r)) => Some((f, r)),
                _ => None,
            },
        });
    }
    jobs
}

fn source(known: bool, given: bool, process_limit: bool) -> &'static str {
    match (known, given) {
        (_, true) => "given",
        (true, false) if process_limit => "process_limit",
        (true, false) => "trace_oom",
        (false, false) => "none",
    }
}

/// The private pool of each allocation entry, where the snapshot has
/// private segments: the entry's own pool id (torch 2.8 on), else the
/// private segment at the end that holds its address.
fn private_pools(snap: &Snapshot, device: i64) -> Option<Vec<u8>> {
    let events = snap.events(device);
    let mut ranges: Vec<(u64, u64, u8)> = snap
        .segments
        .iter()
        .filter(|s| s.device == device && s.private_pool)
        .map(|s| (s.address, s.address + s.total_size, s.pool.max(1)))
        .collect();
    if ranges.is_empty() && events.iter().all(|e| e.pool == 0) {
        return None;
    }
    ranges.sort_unstable();
    Some(
        events
            .iter()
            .map(|e| {
                if e.pool != 0 || !matches!(e.action, Action::Alloc | Action::Oom) {
                    return e.pool;
                }
                let i = ranges.partition_point(|r| r.0 <= e.addr);
                match i.checked_sub(1).map(|i| ranges[i]) {
                    Some((a, b, p)) if e.addr >= a && e.addr < b => p,
                    _ => 0,
                }
            })
            .collect(),
    )
}

/// The trace's own segment allocations, each with the entry it served:
/// the allocation (or OOM) that follows it.
fn recorded_segments(events: &[TraceEvent], config: &AllocatorConfig) -> Vec<SegmentOut> {
    let mut out = Vec::new();
    let mut waiting: Vec<(usize, &TraceEvent)> = Vec::new();
    let flush = |out: &mut Vec<SegmentOut>,
                 waiting: &mut Vec<(usize, &TraceEvent)>,
                 at: usize,
                 served: Option<&TraceEvent>| {
        for (i, s) in waiting.drain(..) {
            let kind = match (s.action, served) {
                (Action::SegmentAlloc, _) if s.size == crate::rules::K_SMALL_BUFFER => {
                    PoolKind::Small
                }
                (Action::SegmentAlloc, _) => PoolKind::Large,
                (_, Some(a)) => PoolKind::of(config.round(a.size)),
                (_, None) => PoolKind::Large,
            };
            out.push(SegmentOut {
                event: if served.is_some() { at } else { i },
                size: s.size,
                stream: s.stream,
                pool: kind,
                private: s.pool != 0,
                action: s.action.name(),
            });
        }
    };
    for (i, e) in events.iter().enumerate() {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => waiting.push((i, e)),
            Action::Alloc | Action::Oom => flush(&mut out, &mut waiting, i, Some(e)),
            _ => {}
        }
    }
    flush(&mut out, &mut waiting, 0, None);
    out
}

/// A first OOM that the device had room for: the process's own limit,
/// known only to lie between what it held and what it then asked for.
struct ProcessLimit {
    /// The trace entry of the OOM.
    event: usize,
    /// The bytes it asked for.
    requested: u64,
    /// What the driver had free when it failed.
    free: u64,
    /// The most reserved before it: the limit allowed that much.
    floor: u64,
    /// Reserved when it failed plus the request: the limit was below it.
    ceiling: u64,
}

/// The most reserved the trace shows, the capacity each of its OOMs
/// implies (reserved when it failed plus what the driver had free; for the
/// process's own limit, the most it had held), and that limit if the first
/// OOM was one.
fn recorded_reserved(events: &[TraceEvent], start: u64) -> (u64, Vec<u64>, Option<ProcessLimit>) {
    let mut r = start;
    let mut peak = r;
    let mut caps = Vec::new();
    let mut limit = None;
    for (i, e) in events.iter().enumerate() {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                r += e.size;
                peak = peak.max(r);
            }
            Action::SegmentFree | Action::SegmentUnmap => r = r.saturating_sub(e.size),
            Action::Oom if oomkit_advice::room_on_device(e.size, e.addr) => {
                if caps.is_empty() {
                    limit = Some(ProcessLimit {
                        event: i,
                        requested: e.size,
                        free: e.addr,
                        floor: peak,
                        ceiling: r.saturating_add(e.size),
                    });
                }
                caps.push(peak);
            }
            Action::Oom => caps.push(r.saturating_add(e.addr)),
            _ => {}
        }
    }
    (peak, caps, limit)
}

/// One replay's running state besides the model.
struct Run<'a, 'd> {
    d: &'a Device<'d>,
    m: Allocator,
    /// The model's block for each trace address live now.
    live: HashMap<u64, BlockId, FastState>,
    /// Trace addresses whose allocation failed under the scenario.
    failed: HashSet<u64, FastState>,
    /// Trace addresses the model completed early; their `free_completed` is skipped.
    early: HashSet<u64, FastState>,
    /// `free_completed` entries held back because the allocation that
    /// follows them flushes them itself.
    deferred: Vec<u64>,
    oom_details: Vec<OomOut>,
    recorded_ooms: Vec<RecordedOom>,
    unfollowed: u64,
    placed: u64,
    allocs: u64,
}

/// One replay to run.
struct Job<'r> {
    name: String,
    config: AllocatorConfig,
    capacity: Option<u64>,
    /// The capacity was given rather than implied by the trace.
    given: bool,
    start: StartKind,
    scale: Option<(f64, &'r [Role])>,
}

/// Traces at least this long replay their scenarios on several cores.
const PARALLEL_MIN_EVENTS: usize = 100_000;

/// Runs every job, on as many cores as there are jobs for a long trace.
fn run_all(d: &Device<'_>, jobs: &[Job<'_>]) -> Vec<(ScenarioOut, Checks)> {
    let one = |j: &Job<'_>| run(d, j.config.clone(), j.capacity, j.start, j.scale);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if jobs.len() < 2 || cores < 2 || d.events.len() < PARALLEL_MIN_EVENTS {
        return jobs.iter().map(one).collect();
    }
    let per = jobs.len().div_ceil(cores);
    std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .chunks(per)
            .map(|chunk| sc.spawn(move || chunk.iter().map(one).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// What a replay as recorded checks about the trace itself.
struct Checks {
    /// Share of the allocations the model placed at their recorded address.
    placed: f64,
}

/// How many of the trace's allocations lie in no segment the trace itself
/// accounts for (those held when it began, and those its entries reserve):
/// a record PyTorch's allocator wrote has none.
fn outside_recorded(events: &[TraceEvent], start: &Start) -> u64 {
    let mut held: std::collections::BTreeMap<u64, u64> =
        start.segments.iter().map(|s| (s.addr, s.size)).collect();
    let mut outside = 0;
    for e in events {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                held.insert(e.addr, e.size);
            }
            // A partial unmap leaves the range listed: the check errs towards passing.
            Action::SegmentFree | Action::SegmentUnmap => {
                held.remove(&e.addr);
            }
            Action::Alloc => {
                let inside = held
                    .range(..=e.addr)
                    .next_back()
                    .is_some_and(|(&a, &s)| e.addr < a.saturating_add(s));
                outside += (!inside) as u64;
            }
            _ => {}
        }
    }
    outside
}

/// Replays the trace under one setting; returns the figures and the checks.
fn run(
    d: &Device<'_>,
    config: AllocatorConfig,
    capacity: Option<u64>,
    start: StartKind,
    scaled: Option<(f64, &[Role])>,
) -> (ScenarioOut, Checks) {
    let settings = config.describe();
    let mut r = Run {
        d,
        m: Allocator::new(config, capacity),
        live: HashMap::default(),
        failed: HashSet::default(),
        early: HashSet::default(),
        deferred: Vec::new(),
        oom_details: Vec::new(),
        recorded_ooms: Vec::new(),
        unfollowed: 0,
        placed: 0,
        allocs: 0,
    };
    r.m.addresses.fresh = d.fresh_base;
    r.m.entry = BEFORE_TRACE;
    match start {
        StartKind::AsRecorded => {
            crate::layout::lay_out(&mut r.m, &d.start, &mut r.live);
            r.fit_start();
        }
        StartKind::Fresh => r.place_afresh(),
    }
    r.m.settle_peak();
    r.m.totals.peak_allocated = r.m.totals.allocated;
    let start_reserved_bytes = r.m.totals.reserved;
    let mut samples = d.samples.iter().peekable();
    let mut reserved_samples = Vec::with_capacity(d.samples.len());
    let mut hints: Vec<(u64, u64)> = Vec::new();
    for (i, e) in d.events.iter().enumerate() {
        r.m.entry = i;
        r.step(i, e, &mut hints, scaled);
        while samples.next_if(|&&s| s == i).is_some() {
            reserved_samples.push(r.m.totals.reserved);
        }
    }
    let m = &r.m;
    let segments = m
        .events
        .iter()
        .filter(|s| s.entry != BEFORE_TRACE && matches!(s.op, SegmentOp::Alloc | SegmentOp::Map))
        .map(|s| SegmentOut {
            event: s.entry,
            size: s.size,
            stream: s.stream,
            pool: s.kind,
            private: s.private,
            action: if s.op == SegmentOp::Alloc {
                "segment_alloc"
            } else {
                "segment_map"
            },
        })
        .collect();
    let segment_frees = m
        .events
        .iter()
        .filter(|s| matches!(s.op, SegmentOp::Free | SegmentOp::Unmap))
        .count();
    let placed = if r.allocs == 0 {
        1.0
    } else {
        r.placed as f64 / r.allocs as f64
    };
    (
        ScenarioOut {
            name: String::new(),
            settings,
            capacity_bytes: capacity,
            capacity_source: "none",
            batch_scale: None,
            start,
            baseline: None,
            segments,
            segment_frees,
            peak_reserved_bytes: m.totals.peak_reserved,
            peak_allocated_bytes: m.totals.peak_allocated,
            free_in_segments_at_peak_bytes: m.totals.free_at_peak,
            peak_event: m.totals.peak_entry.filter(|&e| e != BEFORE_TRACE),
            reserved_at_end_bytes: m.totals.reserved,
            ooms: r.oom_details.iter().filter_map(|o| o.event).collect(),
            oom_details: r.oom_details,
            recorded_ooms: r.recorded_ooms,
            unfollowed: r.unfollowed,
            reserved_samples,
            start_reserved_bytes,
        },
        Checks { placed },
    )
}

impl Run<'_, '_> {
    /// Places the blocks live before the trace under the scenario's
    /// settings, in address order, with nothing cached.
    fn place_afresh(&mut self) {
        for b in &self.d.start.blocks {
            match self.m.malloc(b.requested, b.stream, b.private) {
                Ok(id) => {
                    self.m.bm(id).key = b.addr;
                    self.live.insert(b.addr, id);
                    if b.pending {
                        self.m.free_requested(id);
                    }
                }
                Err(f) => {
                    self.fail(None, f, false);
                    self.failed.insert(b.addr);
                }
            }
        }
    }

    /// Checks the state the trace began with against the capacity, as the
    /// allocator checks every request: above it, the cached segments go back
    /// first (as `release_cached_blocks` does before an allocation fails),
    /// and what is still held above it is an OOM before the trace begins.
    fn fit_start(&mut self) {
        if self.m.fits(0) {
            return;
        }
        self.m.release_cached_blocks();
        self.absorb_early();
        let t = &mut self.m.totals;
        // The cache given back never counted: the run could not have held it.
        t.peak_reserved = t.reserved;
        t.peak_entry = None;
        if !self.m.fits(0) {
            let held = self.m.totals.reserved;
            let over = held.saturating_sub(self.m.allowed().unwrap_or(held));
            self.fail(
                None,
                Failure {
                    size: over,
                    alloc_size: over,
                    reserved: held,
                    active: self.m.totals.active,
                    largest_free: 0,
                },
                false,
            );
        }
    }

    fn fail(&mut self, event: Option<usize>, f: Failure, recorded: bool) {
        self.oom_details.push(OomOut {
            event,
            size: f.size,
            segment_bytes: f.alloc_size,
            reserved_bytes: f.reserved,
            free_in_segments_bytes: f.reserved.saturating_sub(f.active),
            largest_free_block_bytes: f.largest_free,
            recorded,
        });
    }

    fn private(&self, i: usize) -> u8 {
        self.d.private.as_ref().map_or(0, |p| p[i])
    }

    /// Whether a `free_completed` at `i` is the flush inside the allocation
    /// that follows: the frees run straight into that allocation's release of cached segments, or its OOM.
    fn is_flush(&self, i: usize) -> bool {
        let j = self.d.after_completes[i] as usize;
        match self.d.events.get(j).map(|e| e.action) {
            Some(Action::Oom) => true,
            Some(Action::SegmentFree | Action::SegmentUnmap) => self.is_internal_release(j),
            _ => false,
        }
    }

    /// Whether a run of segment releases starting at `i` is an allocation
    /// failing (an OOM follows), which the model repeats itself at the OOM.
    ///
    /// Any other run is replayed as a call of `torch.cuda.empty_cache()`:
    /// it is one, or an allocation's flush that then succeeded, which
    /// frees the same unsplit segments; where the trace shows no OOM there
    /// is no capacity for the model to run into, so it could not flush by itself.
    fn is_internal_release(&self, i: usize) -> bool {
        let j = self.d.after_releases[i] as usize;
        matches!(self.d.events.get(j).map(|e| e.action), Some(Action::Oom))
    }

    fn step(
        &mut self,
        i: usize,
        e: &TraceEvent,
        hints: &mut Vec<(u64, u64)>,
        scaled: Option<(f64, &[Role])>,
    ) {
        match e.action {
            Action::SegmentAlloc => hints.push((e.addr, e.size)),
            Action::SegmentFree | Action::SegmentUnmap => {
                let first = i == 0
                    || !matches!(
                        self.d.events[i - 1].action,
                        Action::SegmentFree | Action::SegmentUnmap
                    );
                if first && !self.is_internal_release(i) {
                    self.m.empty_cache();
                    self.absorb_early();
                }
            }
            Action::Alloc => {
                self.m.addresses.offered = std::mem::take(hints);
                self.early.remove(&e.addr);
                if let Some(old) = self.live.remove(&e.addr) {
                    // The trace allocates at an address the model still
                    // holds: the free in between was not recorded.
                    self.unfollowed += 1;
                    self.m.free_completed(old);
                }
                self.failed.remove(&e.addr);
                let size = match scaled {
                    Some((f, roles)) if scales(roles[i]) => {
                        ((e.size as f64 * f).round() as u64).max(1)
                    }
                    _ => e.size,
                };
                match self.m.malloc(size, e.stream, self.private(i)) {
                    Ok(id) => {
                        self.m.bm(id).key = e.addr;
                        self.live.insert(e.addr, id);
                        self.allocs += 1;
                        self.placed += (self.m.b(id).addr == e.addr) as u64;
                    }
                    Err(f) => {
                        self.fail(Some(i), f, false);
                        self.failed.insert(e.addr);
                    }
                }
                self.after_allocation();
            }
            Action::FreeRequested => match self.live.get(&e.addr) {
                Some(&id) => self.m.free_requested(id),
                None if self.failed.contains(&e.addr) || self.early.contains(&e.addr) => {}
                None => self.unfollowed += 1,
            },
            Action::FreeCompleted => {
                if self.early.remove(&e.addr) || self.failed.remove(&e.addr) {
                    return;
                }
                match self.live.get(&e.addr) {
                    Some(&id) if self.m.b(id).state == State::Pending && self.is_flush(i) => {
                        self.deferred.push(e.addr)
                    }
                    Some(&id) => {
                        self.live.remove(&e.addr);
                        self.m.free_completed(id);
                    }
                    None => self.unfollowed += 1,
                }
            }
            Action::Oom => {
                self.m.addresses.offered = std::mem::take(hints);
                let happens = match self.m.malloc(e.size, e.stream, self.private(i)) {
                    Ok(id) => {
                        // The program would have gone on from here; the
                        // trace only shows what it did after failing, so
                        // the block is handed back at once.
                        self.m.free_completed(id);
                        false
                    }
                    Err(f) => {
                        self.fail(Some(i), f, true);
                        true
                    }
                };
                self.recorded_ooms.push(RecordedOom {
                    event: i,
                    size: e.size,
                    happens,
                });
                self.after_allocation();
            }
            Action::Unknown => self.unfollowed += 1,
            _ => {}
        }
    }

    /// Completes the held-back frees the allocation did not flush itself.
    fn after_allocation(&mut self) {
        self.absorb_early();
        for addr in std::mem::take(&mut self.deferred) {
            if let Some(id) = self.live.remove(&addr) {
                self.m.free_completed(id);
            }
        }
    }

    /// Takes note of the pending frees the model completed early.
    fn absorb_early(&mut self) {
        for k in std::mem::take(&mut self.m.completed_early) {
            self.live.remove(&k);
            match self.deferred.iter().position(|&d| d == k) {
                // Its `free_completed` entry has passed already.
                Some(p) => {
                    self.deferred.swap_remove(p);
                }
                None => {
                    self.early.insert(k);
                }
            }
        }
    }
}

/// Whether a role grows and shrinks with the micro-batch.
fn scales(r: Role) -> bool {
    matches!(r, Role::Activations | Role::Temporaries | Role::Inputs)
}

/// The model's segments for the recorded run against the trace's own.
fn agree(recorded: &[SegmentOut], simulated: &[SegmentOut], placed: f64) -> Agreement {
    let mut want: HashMap<(usize, u64), usize> = HashMap::new();
    for s in recorded {
        *want.entry((s.event, s.size)).or_default() += 1;
    }
    let mut matched = 0;
    for s in simulated {
        if let Some(c) = want.get_mut(&(s.event, s.size)) {
            if *c > 0 {
                *c -= 1;
                matched += 1;
            }
        }
    }
    let most = recorded.len().max(simulated.len());
    let first_divergence = (0..most)
        .find(|&i| {
            let a = recorded.get(i).map(|s| (s.event, s.size));
            let b = simulated.get(i).map(|s| (s.event, s.size));
            a != b
        })
        .map(|i| Divergence {
            index: i,
            recorded: recorded.get(i).copied(),
            simulated: simulated.get(i).copied(),
        });
    Agreement {
        recorded: recorded.len(),
        simulated: simulated.len(),
        matched,
        share: if most == 0 {
            1.0
        } else {
            matched as f64 / most as f64
        },
        first_divergence,
        placed_at_recorded_address: placed,
    }
}
