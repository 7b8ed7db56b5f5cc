//! Analyses of a snapshot: state at snapshot time, trace replay, the live
//! set at the peak by allocation site, OOM events, phases, and advice.

use crate::hash::FastState;
use crate::model::{Action, BlockState, Snapshot, TraceEvent};
use crate::stacks::{Frame, Site, StackId, Stacks};
pub use oomkit_units::human_bytes;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// What to analyze and how much to report.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many allocation sites to list.
    pub top: usize,
    /// Analyze only this device.
    pub device: Option<i64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            top: 10,
            device: None,
        }
    }
}

/// Where an allocation came from: the user frame, or why there is none.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum SiteKey {
    Frame(u32),
    Native(u32),
    NoPythonFrame,
    NoStack,
    BeforeRecording,
}

/// Bytes held by one allocation site.
#[derive(Clone, Debug, Serialize)]
pub struct SiteBytes {
    /// The frame that asked for the memory, or null when unknown.
    pub site: Option<Frame>,
    /// A short description of the site, always present.
    pub label: String,
    /// Bytes live from this site.
    pub bytes: u64,
    /// Number of live allocations from this site.
    pub count: u64,
    /// The full stack of the largest of those allocations, innermost first.
    pub stack: Vec<Frame>,
}

/// One out-of-memory event from the trace.
#[derive(Clone, Debug, Serialize)]
pub struct OomReport {
    /// Index of the `oom` entry in the device's trace.
    pub event_index: u64,
    /// When it happened, microseconds since the epoch.
    pub time_us: Option<i64>,
    /// Bytes the failed allocation asked for.
    pub requested_bytes: u64,
    /// Bytes the driver reported free on the device.
    pub free_bytes: u64,
    /// Bytes in active blocks at that moment.
    pub live_bytes: u64,
    /// Bytes reserved by the allocator at that moment.
    pub reserved_bytes: u64,
    /// Reserved but unallocated bytes at that moment.
    pub reserved_unallocated_bytes: u64,
    /// Why it failed, decided as `oomkit explain` decides it from the replayed figures.
    pub cause: oomkit_advice::Cause,
    /// The frame that asked for the memory.
    pub site: Option<Frame>,
    /// A short description of that frame.
    pub label: String,
    /// The largest holders of memory at that moment.
    pub top_holders: Vec<SiteBytes>,
}

/// Peak memory within one named `record_function` range.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseReport {
    /// The range name.
    pub name: String,
    /// How many times the range ran.
    pub occurrences: u64,
    /// Highest active bytes seen inside any occurrence.
    pub peak_active_bytes: u64,
    /// Trace index of that peak.
    pub peak_event_index: Option<u64>,
    /// Largest growth of active bytes within one occurrence.
    pub max_growth_bytes: u64,
    /// Active bytes at the end of the last occurrence minus those at its
    /// start: memory created in the phase that outlives it.
    pub retained_bytes: i64,
}

/// Free memory inside segments, split by cause.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Fragmentation {
    /// Bytes lost to the allocator's rounding of active blocks.
    pub internal_bytes: u64,
    /// Bytes in inactive blocks: reserved but not allocated.
    pub external_bytes: u64,
    /// The largest single inactive block.
    pub largest_free_block_bytes: u64,
    /// Number of inactive blocks.
    pub free_blocks: u64,
    /// External bytes as a fraction of reserved bytes.
    pub external_fraction: f64,
    /// The largest block this program asked for: the largest allocation in
    /// the trace, or the largest active block where there is no trace. Free
    /// memory is fragmented only where no free block could serve it.
    pub largest_request_bytes: u64,
}

/// Free memory inside segments is reported as fragmentation only from this
/// share of the reserved memory: below it, the cache's rounding and the
/// blocks kept for reuse are ordinary allocator behaviour.
const FRAGMENTED_MIN_FRACTION: f64 = 0.2;
/// ... and from this many bytes, below which no setting would change what fits.
const FRAGMENTED_MIN_BYTES: u64 = 256 << 20;
/// A phase that keeps this many bytes alive past its end (and 5% of the peak)
/// is reported: less is the noise of caches and small buffers.
const RETAINED_MIN_BYTES: u64 = 256 << 20;

/// Everything learned about one device.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceReport {
    /// CUDA device index.
    pub device: i64,
    /// Number of trace entries.
    pub events: u64,
    /// Trace entries by action.
    pub actions: BTreeMap<String, u64>,
    /// Segments at snapshot time.
    pub segments: u64,
    /// Bytes reserved from the driver at snapshot time.
    pub reserved_bytes: u64,
    /// Bytes in active blocks (pending frees included) at snapshot time.
    pub active_bytes: u64,
    /// Bytes in allocated blocks at snapshot time.
    pub allocated_bytes: u64,
    /// Bytes the program asked for in active blocks at snapshot time.
    pub requested_bytes: u64,
    /// Bytes freed by the program but held for other streams.
    pub pending_free_bytes: u64,
    /// Free memory inside segments.
    pub fragmentation: Fragmentation,
    /// Highest active bytes over the trace, or at snapshot time without one.
    pub peak_active_bytes: u64,
    /// Trace index after which the peak held; null without a trace or when
    /// the peak was before the first entry.
    pub peak_event_index: Option<u64>,
    /// Time of the peak, microseconds since the epoch.
    pub peak_time_us: Option<i64>,
    /// Seconds from the trace's first entry to the peak.
    pub peak_offset_s: Option<f64>,
    /// The innermost annotated phase that contains the peak.
    pub peak_phase: Option<String>,
    /// Highest reserved bytes over the trace.
    pub peak_reserved_bytes: u64,
    /// Active bytes live before the trace's first entry.
    pub pre_trace_active_bytes: u64,
    /// Reserved bytes before the trace's first entry.
    pub pre_trace_reserved_bytes: u64,
    /// `peak` when `top_sites` is the live set at the peak, `snapshot` when
    /// it is the live set at snapshot time (no trace).
    pub top_sites_at: &'static str,
    /// The largest allocation sites in that live set.
    pub top_sites: Vec<SiteBytes>,
    /// Out-of-memory events.
    pub ooms: Vec<OomReport>,
    /// Peaks within annotated phases.
    pub phases: Vec<PhaseReport>,
}

/// A conclusion with the change that addresses it.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// Stable identifier, e.g. `oom_capacity`.
    pub kind: &'static str,
    /// The device it is about.
    pub device: Option<i64>,
    /// What was found, with numbers.
    pub message: String,
    /// What to change.
    pub advice: String,
    /// The bytes at stake, for ranking.
    pub bytes: u64,
}

/// A limit of the evidence, with how to get better evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Warning {
    /// Stable identifier, e.g. `no_trace`.
    pub kind: &'static str,
    /// The device it is about.
    pub device: Option<i64>,
    /// What is missing or doubtful.
    pub message: String,
    /// How to record a better snapshot.
    pub fix: String,
}

/// The full analysis of one snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// One report per device.
    pub devices: Vec<DeviceReport>,
    /// The allocator settings in force, when recorded.
    pub allocator_settings: Option<serde_json::Value>,
    /// Conclusions: OOMs first, then what explains them, then by bytes.
    pub findings: Vec<Finding>,
    /// Limits of the evidence.
    pub warnings: Vec<Warning>,
}

const RECORD_CALL: &str = "torch.cuda.memory._record_memory_history(max_entries=1_000_000) before the run, then torch.cuda.memory._dump_snapshot(\"snap.pickle\")";
const GIB: f64 = (1u64 << 30) as f64;

/// Analyzes a snapshot.
pub fn analyze(snap: &Snapshot, opts: &Options) -> Analysis {
    let mut warnings = Vec::new();
    let mut findings = Vec::new();
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
        .map(|&d| analyze_device(snap, d, opts, &mut warnings, &mut findings))
        .collect();
    advise_settings(snap, &reports, &mut findings);
    // OOMs first, then what explains them, then the rest by bytes.
    let rank = |k: &str| match k {
        "oom_capacity" | "oom_fragmentation" => 0,
        "phase_retains_memory" => 1,
        "dominant_site" => 2,
        _ => 3,
    };
    findings.sort_by(|a, b| rank(a.kind).cmp(&rank(b.kind)).then(b.bytes.cmp(&a.bytes)));
    Analysis {
        devices: reports,
        allocator_settings: snap.allocator_settings.clone(),
        findings,
        warnings,
    }
}

/// A live allocation during replay.
#[derive(Clone, Copy)]
struct Live {
    size: u64,
    stack: StackId,
    before_recording: bool,
}

fn site_key(stacks: &Stacks, live: &Live) -> SiteKey {
    if live.before_recording && live.stack == StackId::EMPTY {
        return SiteKey::BeforeRecording;
    }
    if live.stack == StackId::EMPTY {
        return SiteKey::NoStack;
    }
    match stacks.site(live.stack) {
        Site::Frame(f) => SiteKey::Frame(f),
        Site::Native(n) => SiteKey::Native(n),
        Site::Unknown => SiteKey::NoPythonFrame,
    }
}

fn label(stacks: &Stacks, key: &SiteKey) -> (Option<Frame>, String) {
    match key {
        SiteKey::Frame(f) => {
            let fr = stacks.frame(*f).clone();
            let short = fr.filename.rsplit('/').next().unwrap_or(&fr.filename);
            let text = format!("{short}:{} {}", fr.line, fr.name);
            (Some(fr), text)
        }
        SiteKey::Native(n) => (None, format!("<{}>", stacks.native_name(*n))),
        SiteKey::NoPythonFrame => (None, "<no Python frame: native code only>".into()),
        SiteKey::NoStack => (None, "<no stack recorded>".into()),
        SiteKey::BeforeRecording => (None, "<allocated before recording started>".into()),
    }
}

/// Describes where the allocation with this stack came from, in the same
/// words the site tables use.
pub fn stack_label(stacks: &Stacks, stack: StackId) -> String {
    let live = Live {
        size: 0,
        stack,
        before_recording: false,
    };
    label(stacks, &site_key(stacks, &live)).1
}

/// Groups live allocations by site, largest first.
fn group(stacks: &Stacks, live: impl Iterator<Item = Live>, top: usize) -> Vec<SiteBytes> {
    let mut groups: HashMap<SiteKey, (u64, u64, Live)> = HashMap::new();
    for l in live {
        let e = groups.entry(site_key(stacks, &l)).or_insert((0, 0, l));
        e.0 += l.size;
        e.1 += 1;
        // The first of equal sizes stays, so the stack shown does not
        // depend on hashing: live sets come oldest allocation first.
        if l.size > e.2.size {
            e.2 = l;
        }
    }
    // Ties go by label, not by interning order, so the report does not
    // depend on the order in which the reader met the stacks.
    let mut v: Vec<_> = groups
        .into_iter()
        .map(|(key, g)| (label(stacks, &key), key, g))
        .collect();
    v.sort_by(|a, b| {
        b.2 .0
            .cmp(&a.2 .0)
            .then_with(|| a.0 .1.cmp(&b.0 .1))
            .then(a.1.cmp(&b.1))
    });
    v.into_iter()
        .take(top)
        .map(|((site, label), _, (bytes, count, largest))| SiteBytes {
            site,
            label,
            bytes,
            count,
            stack: stacks
                .stack(largest.stack)
                .iter()
                .map(|&f| stacks.frame(f).clone())
                .collect(),
        })
        .collect()
}

/// Most OOM entries of a trace that get their holders of memory and a
/// finding; the rest are listed with their own figures only.
const OOMS_DETAILED: usize = 32;

/// Traces at least this long get their first two passes on two cores.
const PARALLEL_MIN_EVENTS: usize = 100_000;

/// What one pass over a trace learns about blocks that predate it, and
/// which entry ends which allocation.
struct TraceScan {
    /// Addresses the trace allocated and had not freed by its end, with the
    /// entry that allocated each.
    open: HashMap<u64, u32, FastState>,
    /// For each entry, one more than the index of the earlier allocation it
    /// ends, or 0: a free ends the allocation at its address, and an
    /// allocation at an address still held ends the one there before it.
    /// (Zero for none lets the table start as untouched zeroed pages.)
    ///
    /// Entry indices fit in 32 bits because each trace entry is a claimed
    /// object or a slab cell, both numbered with 32 bits by the parser.
    link: Vec<u32>,
    /// Blocks freed by the trace that it never allocated, with the entry
    /// that freed each.
    orphans: Vec<(usize, Live)>,
    net_active: i128,
    net_reserved: i128,
    action_counts: [u64; Action::ALL.len()],
    missing_frames: u64,
    allocs: u64,
    largest_alloc: u64,
}

/// Finds which blocks predate the trace: frees without an alloc before
/// them, and (through `open`) blocks alive at the end that the trace never
/// allocated. It also links each free to its allocation, so that the live
/// set at any entry can be rebuilt later without looking addresses up again.
fn scan_trace(events: &[TraceEvent]) -> TraceScan {
    let mut s = TraceScan {
        open: HashMap::default(),
        link: vec![0; events.len()],
        orphans: Vec::new(),
        net_active: 0,
        net_reserved: 0,
        action_counts: [0; Action::ALL.len()],
        missing_frames: 0,
        allocs: 0,
        largest_alloc: 0,
    };
    for (i, e) in events.iter().enumerate() {
        s.action_counts[e.action as usize] += 1;
        match e.action {
            Action::Alloc => {
                s.net_active += e.size as i128;
                if let Some(earlier) = s.open.insert(e.addr, i as u32) {
                    s.link[i] = earlier + 1;
                }
                s.allocs += 1;
                s.largest_alloc = s.largest_alloc.max(e.size);
                s.missing_frames += (e.stack == StackId::EMPTY) as u64;
            }
            Action::FreeCompleted => {
                s.net_active -= e.size as i128;
                match s.open.remove(&e.addr) {
                    Some(alloc) => s.link[i] = alloc + 1,
                    None => s.orphans.push((
                        i,
                        Live {
                            size: e.size,
                            stack: StackId::EMPTY,
                            before_recording: true,
                        },
                    )),
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => s.net_reserved += e.size as i128,
            Action::SegmentFree | Action::SegmentUnmap => s.net_reserved -= e.size as i128,
            _ => {}
        }
    }
    s
}

/// Calls `visit` with each entry of `targets` (sorted, no repeats) and the
/// allocations live just after that entry: the trace's own, oldest first,
/// then the blocks that predate the trace and are not yet freed.
///
/// The trace's allocations are followed in a bit set indexed by entry, with
/// the frees already matched to their allocations by [`scan_trace`], so this
/// pass does no lookups by address.
fn live_at(
    events: &[TraceEvent],
    scan: &TraceScan,
    before: &[Live],
    targets: &[usize],
    mut visit: impl FnMut(usize, &mut dyn Iterator<Item = Live>),
) {
    let Some(&last) = targets.last() else {
        return;
    };
    // A second level marks the words with a bit set, so that a visit costs
    // about the live allocations, not a walk over the trace's whole bit set:
    // a file with many OOM entries must not take quadratic time.
    let mut alive = vec![0u64; last / 64 + 1];
    let mut words = vec![0u64; alive.len().div_ceil(64)];
    let mut next = targets.iter().peekable();
    for (i, e) in events[..=last].iter().enumerate() {
        if let Some(ended) = scan.link[i].checked_sub(1) {
            let w = ended as usize / 64;
            alive[w] &= !(1 << (ended % 64));
            if alive[w] == 0 {
                words[w / 64] &= !(1 << (w % 64));
            }
        }
        if e.action == Action::Alloc {
            alive[i / 64] |= 1 << (i % 64);
            words[i / 4096] |= 1 << (i / 64 % 64);
        }
        while next.next_if_eq(&&i).is_some() {
            let alive = &alive;
            let mut in_trace = words.iter().enumerate().flat_map(|(ww, &set)| {
                Bits(set).flat_map(move |b| {
                    let w = ww * 64 + b;
                    Bits(alive[w]).map(move |b| {
                        let a = &events[w * 64 + b];
                        Live {
                            size: a.size,
                            stack: a.stack,
                            before_recording: false,
                        }
                    })
                })
            });
            // Orphans are in the order they were freed; those still live
            // are the ones freed after this entry.
            let from = scan.orphans.partition_point(|&(freed, _)| freed <= i);
            let orphans = scan.orphans[from..].iter().map(|(_, l)| *l);
            visit(
                i,
                &mut (&mut in_trace).chain(orphans).chain(before.iter().copied()),
            );
        }
    }
}

/// The positions of the set bits of a word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(b)
    }
}

/// Where an annotated range starts and ends in a trace: the entries
/// `first..last`, as found by time.
type Window = (usize, usize);

/// Finds the entries of each range, or none at all when the trace has no
/// times to place them by.
fn windows(ranges: &[(String, i64, i64)], events: &[TraceEvent]) -> Vec<Window> {
    if events.iter().all(|e| e.time_us().is_none()) {
        return Vec::new();
    }
    ranges
        .iter()
        .map(|&(_, start, end)| {
            let first = events.partition_point(|e| e.time_us().is_none_or(|t| t < start));
            let last = events.partition_point(|e| e.time_us().is_none_or(|t| t <= end));
            (first, last)
        })
        .collect()
}

/// Active bytes of one range: before its first entry, after its last, and
/// its peak, the entry that first reached it (`None` if none rose above the
/// start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WindowStats {
    at_start: u64,
    at_end: u64,
    peak: u64,
    peak_idx: Option<usize>,
}

/// Follows the ranges through one pass of running totals, so that no total
/// per entry has to be kept (eight bytes per entry, the analysis's largest
/// table after the events themselves).
///
/// The pass runs from one range boundary (a first or last entry) to the
/// next, and hands over only the highest total of each such span: between
/// boundaries the set of open ranges does not change, so one comparison per
/// open range and span replaces one per open range and entry.
struct Sweep<'w> {
    windows: &'w [Window],
    /// Range numbers by first entry.
    by_first: Vec<usize>,
    /// (entry, range, whether it is the range's start) by entry: the totals
    /// before that entry are the range's start or end.
    probes: Vec<(usize, usize, bool)>,
    next_first: usize,
    next_probe: usize,
    open: Vec<usize>,
    /// Start, end, peak and the entry of the peak, per range.
    stats: Vec<(i128, i128, i128, Option<usize>)>,
}

impl<'w> Sweep<'w> {
    fn new(windows: &'w [Window]) -> Self {
        let mut by_first: Vec<usize> = (0..windows.len()).collect();
        by_first.sort_by_key(|&w| windows[w].0);
        let mut probes: Vec<(usize, usize, bool)> = windows
            .iter()
            .enumerate()
            .flat_map(|(w, &(first, last))| [(first, w, true), (last, w, false)])
            .collect();
        // Starts before ends at one entry, so that an empty range's peak is its start.
        probes.sort_by_key(|&(at, _, start)| (at, !start));
        Sweep {
            windows,
            by_first,
            probes,
            next_first: 0,
            next_probe: 0,
            open: Vec::new(),
            stats: vec![(0, 0, 0, None); windows.len()],
        }
    }

    /// Takes the totals before entry `i` (after the last entry for `i == n`)
    /// and returns the next entry after `i` where a range starts or ends.
    fn before(&mut self, i: usize, v: i128) -> usize {
        while let Some(&(at, w, start)) = self.probes.get(self.next_probe) {
            if at != i {
                break;
            }
            if start {
                self.stats[w].0 = v;
                self.stats[w].2 = v;
            } else {
                self.stats[w].1 = v;
            }
            self.next_probe += 1;
        }
        while let Some(&w) = self.by_first.get(self.next_first) {
            if self.windows[w].0 != i {
                break;
            }
            if self.windows[w].0 < self.windows[w].1 {
                self.open.push(w);
            }
            self.next_first += 1;
        }
        self.probes
            .get(self.next_probe)
            .map_or(usize::MAX, |&(at, _, _)| at)
    }

    /// Takes the highest total after the entries before `end` since the
    /// last boundary, reached first after entry `at`.
    fn span(&mut self, end: usize, peak: i128, at: usize) {
        let (windows, stats) = (self.windows, &mut self.stats);
        self.open.retain(|&w| {
            let s = &mut stats[w];
            if peak > s.2 {
                s.2 = peak;
                s.3 = Some(at);
            }
            end < windows[w].1
        });
    }

    /// Returns each range's figures with `base` added.
    fn finish(self, base: u64) -> Vec<WindowStats> {
        let abs = |v: i128| (base as i128 + v) as u64;
        self.stats
            .into_iter()
            .map(|(a, e, p, pi)| WindowStats {
                at_start: abs(a),
                at_end: abs(e),
                peak: abs(p),
                peak_idx: pi,
            })
            .collect()
    }
}

/// The peaks of a trace's running totals, and its OOM entries with the
/// totals there.
struct Totals {
    peak: u64,
    peak_idx: Option<usize>,
    peak_res: u64,
    oom_idx: Vec<usize>,
    /// Active bytes when each OOM entry was recorded.
    oom_live: Vec<u64>,
    reserved_after: Vec<u64>,
    windows: Vec<WindowStats>,
}

/// The running totals counted from zero, before the starting totals are known.
struct RelativeTotals<'w> {
    max_active: i128,
    min_active: i128,
    max_reserved: i128,
    min_reserved: i128,
    peak_idx: Option<usize>,
    oom_idx: Vec<usize>,
    /// Active and reserved bytes at each OOM, relative to the start.
    at_oom: Vec<(i128, i128)>,
    sweep: Sweep<'w>,
}

/// Counts the totals of a trace from zero, with their extremes, the OOM
/// entries, and the figures of each range in `windows`.
fn relative_totals<'w>(events: &[TraceEvent], windows: &'w [Window]) -> RelativeTotals<'w> {
    let (mut active, mut reserved) = (0i128, 0i128);
    let mut r = RelativeTotals {
        max_active: 0,
        min_active: 0,
        max_reserved: 0,
        min_reserved: 0,
        peak_idx: None,
        oom_idx: Vec::new(),
        at_oom: Vec::new(),
        sweep: Sweep::new(windows),
    };
    let mut i = 0;
    loop {
        let end = r.sweep.before(i, active).min(events.len());
        if i == events.len() {
            break;
        }
        let (mut span_peak, mut span_at) = (i128::MIN, i);
        for (i, e) in events[i..end].iter().enumerate().map(|(k, e)| (i + k, e)) {
            match e.action {
                Action::Alloc => active += e.size as i128,
                Action::FreeCompleted => active -= e.size as i128,
                Action::SegmentAlloc | Action::SegmentMap => reserved += e.size as i128,
                Action::SegmentFree | Action::SegmentUnmap => reserved -= e.size as i128,
                Action::Oom => {
                    r.oom_idx.push(i);
                    r.at_oom.push((active, reserved));
                }
                _ => {}
            }
            if active > span_peak {
                span_peak = active;
                span_at = i;
            }
            r.min_active = r.min_active.min(active);
            r.max_reserved = r.max_reserved.max(reserved);
            r.min_reserved = r.min_reserved.min(reserved);
        }
        r.sweep.span(end, span_peak, span_at);
        if span_peak > r.max_active {
            r.max_active = span_peak;
            r.peak_idx = Some(span_at);
        }
        i = end;
    }
    r
}

impl RelativeTotals<'_> {
    /// Adds the starting totals, or returns `None` where a total would have
    /// gone below zero: the replay clamps at zero there, and only a replay
    /// that knows the start can follow it.
    fn absolute(self, base_active: u64, base_reserved: u64) -> Option<Totals> {
        if base_active as i128 + self.min_active < 0
            || base_reserved as i128 + self.min_reserved < 0
        {
            return None;
        }
        let abs = |base: u64, v: i128| (base as i128 + v) as u64;
        Some(Totals {
            peak: abs(base_active, self.max_active),
            peak_idx: self.peak_idx,
            peak_res: abs(base_reserved, self.max_reserved),
            oom_idx: self.oom_idx,
            oom_live: self
                .at_oom
                .iter()
                .map(|&(a, _)| abs(base_active, a))
                .collect(),
            reserved_after: self
                .at_oom
                .iter()
                .map(|&(_, r)| abs(base_reserved, r))
                .collect(),
            windows: self.sweep.finish(base_active),
        })
    }
}

/// Replays the totals from the start, clamping at zero as the allocator's
/// own counters would; used where a trace frees more than it could hold.
fn exact_totals(
    events: &[TraceEvent],
    windows: &[Window],
    base_active: u64,
    base_reserved: u64,
) -> Totals {
    let mut cur = base_active;
    let mut cur_res = base_reserved;
    let mut sweep = Sweep::new(windows);
    let mut t = Totals {
        peak: base_active,
        peak_idx: None,
        peak_res: base_reserved,
        oom_idx: Vec::new(),
        oom_live: Vec::new(),
        reserved_after: Vec::new(),
        windows: Vec::new(),
    };
    let mut i = 0;
    loop {
        let end = sweep.before(i, cur as i128).min(events.len());
        if i == events.len() {
            break;
        }
        let mut span: Option<(u64, usize)> = None;
        for (i, e) in events[i..end].iter().enumerate().map(|(k, e)| (i + k, e)) {
            crate::timeline::apply(e.action, e.size, &mut cur, &mut cur_res);
            if e.action == Action::Oom {
                t.oom_idx.push(i);
                t.oom_live.push(cur);
                t.reserved_after.push(cur_res);
            }
            if span.is_none_or(|(peak, _)| cur > peak) {
                span = Some((cur, i));
            }
            t.peak_res = t.peak_res.max(cur_res);
        }
        if let Some((peak, at)) = span {
            sweep.span(end, peak as i128, at);
            if peak > t.peak {
                t.peak = peak;
                t.peak_idx = Some(at);
            }
        }
        i = end;
    }
    t.windows = sweep.finish(0);
    t
}

fn analyze_device(
    snap: &Snapshot,
    device: i64,
    opts: &Options,
    warnings: &mut Vec<Warning>,
    findings: &mut Vec<Finding>,
) -> DeviceReport {
    let stacks = &snap.stacks;
    let segs: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.device == device)
        .collect();
    let trace = snap.traces.get(device as usize);
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
            top_holders: holders.get(k).cloned().unwrap_or_default(),
        });
    }

    // Warnings about the evidence.
    let TraceScan {
        orphans,
        action_counts,
        missing_frames,
        allocs,
        ..
    } = scan;
    if !orphans.is_empty() {
        let bytes: u64 = orphans.iter().map(|(_, l)| l.size).sum();
        warnings.push(Warning {
            kind: "ring_buffer_overflow",
            device: Some(device),
            message: format!(
                // A snapshot does not say whether recording started late or
                // max_entries dropped the oldest entries; both look the same.
                "cuda:{device}: the trace starts mid-run: {} blocks ({}) freed in its {} entries were allocated before its first one (recording started after them, or max_entries dropped the oldest entries)",
                orphans.len(),
                human_bytes(bytes),
                events.len()
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
    if !events.is_empty() && t0.is_none() && snap.annotations.iter().any(|a| a.device == device) {
        warnings.push(Warning {
            kind: "no_times",
            device: Some(device),
            message: format!("cuda:{device}: trace entries carry no time_us, so phases cannot be placed on the timeline"),
            fix: "record with torch 2.2 or newer".into(),
        });
    }
    if let Some(t) = trace {
        for (name, n) in &t.unknown_actions {
            warnings.push(Warning {
                kind: "unknown_action",
                device: Some(device),
                message: format!("cuda:{device}: {n} trace entries have the unknown action '{name}' and were counted but not replayed"),
                fix: "update oomkit if a newer PyTorch wrote this snapshot".into(),
            });
        }
    }

    // Findings.
    for o in ooms.iter().take(OOMS_DETAILED) {
        let (kind, advice) = if o.cause == oomkit_advice::Cause::Fragmentation {
            ("oom_fragmentation", "the memory was there but in pieces: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or call torch.cuda.empty_cache() before the failing phase")
        } else {
            ("oom_capacity", "the device was full: lower the micro-batch (keep the effective batch with gradient accumulation), enable activation checkpointing, or shard the model")
        };
        findings.push(Finding {
            kind,
            device: Some(device),
            message: format!(
                "cuda:{device}: out of memory at event {}: {} requested at {} with {} live, {} reserved but unallocated, {} free on the device",
                o.event_index,
                human_bytes(o.requested_bytes),
                o.label,
                human_bytes(o.live_bytes),
                human_bytes(o.reserved_unallocated_bytes),
                human_bytes(o.free_bytes)
            ),
            advice: advice.into(),
            bytes: o.requested_bytes,
        });
    }
    if let Some(top) = top_sites.first() {
        if peak > 0 && top.bytes * 10 >= peak * 4 && top.site.is_some() {
            findings.push(Finding {
                kind: "dominant_site",
                device: Some(device),
                message: format!(
                    "cuda:{device}: {} holds {} ({:.0}% of the {} peak) in {} allocations",
                    top.label,
                    human_bytes(top.bytes),
                    100.0 * top.bytes as f64 / peak as f64,
                    human_bytes(peak),
                    top.count
                ),
                advice: "start there: free or shrink what this line keeps alive at the peak (activations saved for backward, cached outputs, optimizer state)".into(),
                bytes: top.bytes,
            });
        }
    }
    for p in &phases {
        // Forward keeps activations for backward by design; anything else
        // that ends with much more live than it began is holding tensors.
        let retained = p.retained_bytes.max(0) as u64;
        // An optimizer's first step creates its state (AdamW: two tensors per
        // parameter) and keeps it: by design, not a leak.
        let name = p.name.to_lowercase();
        let creates_state =
            p.occurrences == 1 && (name.contains("optim") || name.contains(".step"));
        if !name.contains("forward")
            && !creates_state
            && retained >= RETAINED_MIN_BYTES
            && retained * 20 >= peak
        {
            findings.push(Finding {
                kind: "phase_retains_memory",
                device: Some(device),
                message: format!(
                    "cuda:{device}: phase '{}' ended with {} more live than it started with: tensors created there outlive it",
                    p.name,
                    human_bytes(retained)
                ),
                advice: "keep only what you need from that phase and move it off the GPU (.item(), .detach().cpu()); run evaluation under torch.no_grad()".into(),
                bytes: retained,
            });
        }
    }
    frag.largest_request_bytes = scan
        .largest_alloc
        .max(final_blocks.iter().map(|(_, l)| l.size).max().unwrap_or(0));
    // Cached memory is not fragmentation: free blocks that can serve the
    // largest request this program makes are the cache doing its job. Only
    // free memory that in total could hold that request, with no piece that
    // can, makes the allocator reserve more than it needs.
    let stranded = frag.largest_free_block_bytes < frag.largest_request_bytes
        && frag.external_bytes >= frag.largest_request_bytes;
    if stranded
        && frag.external_fraction >= FRAGMENTED_MIN_FRACTION
        && frag.external_bytes >= FRAGMENTED_MIN_BYTES
    {
        findings.push(Finding {
            kind: "fragmentation",
            device: Some(device),
            message: format!(
                "cuda:{device}: {} ({:.0}% of reserved) is free inside segments in {} pieces, the largest {}, smaller than the {} blocks this program asks for: such a request needs new memory though the total is there",
                human_bytes(frag.external_bytes),
                100.0 * frag.external_fraction,
                frag.free_blocks,
                human_bytes(frag.largest_free_block_bytes),
                human_bytes(frag.largest_request_bytes)
            ),
            advice: "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so freed blocks can be merged and reused".into(),
            bytes: frag.external_bytes,
        });
    }
    if pending >= 64 << 20 {
        findings.push(Finding {
            kind: "pending_free",
            device: Some(device),
            message: format!("cuda:{device}: {} is freed but held for other streams (record_stream)", human_bytes(pending)),
            advice: "synchronize the side stream earlier, or avoid Tensor.record_stream on large tensors".into(),
            bytes: pending,
        });
    }

    let actions = Action::ALL
        .iter()
        .zip(action_counts)
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

fn advise_settings(snap: &Snapshot, reports: &[DeviceReport], findings: &mut Vec<Finding>) {
    let expandable = snap
        .allocator_settings
        .as_ref()
        .and_then(|s| s.get("expandable_segments"))
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    if expandable {
        // Advice to enable what is already on would be noise.
        findings.retain(|f| f.kind != "fragmentation");
        for f in findings
            .iter_mut()
            .filter(|f| f.kind == "oom_fragmentation")
        {
            f.advice = "expandable segments are already on: call torch.cuda.empty_cache() before the failing phase, or lower the peak".into();
        }
    }
    for r in reports {
        let gap = r.peak_reserved_bytes.saturating_sub(r.peak_active_bytes);
        if r.events > 0 && gap as f64 >= GIB && gap * 2 >= r.peak_active_bytes {
            findings.push(Finding {
                kind: "reserved_overhead",
                device: Some(r.device),
                message: format!(
                    "cuda:{}: the allocator reserved up to {} for a peak of {} active, {} more than needed",
                    r.device,
                    human_bytes(r.peak_reserved_bytes),
                    human_bytes(r.peak_active_bytes),
                    human_bytes(gap)
                ),
                advice: "cached segments are not being reused: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True".into(),
                bytes: gap,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(action: Action, addr: u64, size: u64) -> TraceEvent {
        let mut e = TraceEvent::BLANK;
        e.action = action;
        e.addr = addr;
        e.size = size;
        e
    }

    /// A trace of allocs, frees, segment changes and OOMs from a fixed seed,
    /// consistent with starting from `start_active` live bytes.
    fn trace(seed: u64, n: usize, start_active: u64) -> Vec<TraceEvent> {
        let mut x = seed;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut live: Vec<(u64, u64)> = vec![(1, start_active)];
        let mut out = Vec::new();
        for i in 0..n as u64 {
            let r = next();
            match r % 7 {
                0..=2 => {
                    let size = 512 * (1 + next() % 4096);
                    live.push((1000 + i, size));
                    out.push(ev(Action::Alloc, 1000 + i, size));
                }
                3 | 4 if !live.is_empty() => {
                    let (a, s) = live.swap_remove((next() as usize) % live.len());
                    out.push(ev(Action::FreeCompleted, a, s));
                }
                _ if r % 499 == 6 => out.push(ev(Action::Oom, 0, 1 << 30)),
                _ => out.push(ev(Action::SegmentAlloc, 0, 2 << 20)),
            }
        }
        out
    }

    fn same(a: &Totals, b: &Totals) -> bool {
        (
            a.peak,
            a.peak_idx,
            a.peak_res,
            &a.oom_idx,
            &a.oom_live,
            &a.reserved_after,
            &a.windows,
        ) == (
            b.peak,
            b.peak_idx,
            b.peak_res,
            &b.oom_idx,
            &b.oom_live,
            &b.reserved_after,
            &b.windows,
        )
    }

    /// Ranges of every kind from a seed: nested, overlapping, empty,
    /// reversed (ending before they start), and reaching the end.
    fn some_windows(seed: u64, n: usize) -> Vec<Window> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move |m: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (m as u64 + 1)) as usize
        };
        let mut w: Vec<Window> = (0..30)
            .map(|_| {
                let a = next(n);
                (a, (a + next(n / 4)).min(n))
            })
            .collect();
        w.extend([(0, n), (n / 2, n / 2), (n / 2 + 10, n / 3), (0, 0), (n, n)]);
        w
    }

    /// The figures of each range the way the analysis first computed them,
    /// from the totals after every entry.
    fn windows_by_brute_force(
        events: &[TraceEvent],
        windows: &[Window],
        base: u64,
    ) -> Vec<WindowStats> {
        let (mut cur, mut res) = (base, 0u64);
        let after: Vec<u64> = events
            .iter()
            .map(|e| {
                crate::timeline::apply(e.action, e.size, &mut cur, &mut res);
                cur
            })
            .collect();
        let before = |p: usize| if p == 0 { base } else { after[p - 1] };
        windows
            .iter()
            .map(|&(first, last)| {
                let (mut peak, mut peak_idx) = (before(first), None);
                for (i, &a) in after.iter().enumerate().take(last).skip(first) {
                    if a > peak {
                        peak = a;
                        peak_idx = Some(i);
                    }
                }
                WindowStats {
                    at_start: before(first),
                    at_end: before(last),
                    peak,
                    peak_idx,
                }
            })
            .collect()
    }

    #[test]
    fn relative_totals_match_the_exact_replay() {
        for seed in 1..40u64 {
            let base = seed * 1_000_000;
            let events = trace(seed, 2000, base);
            let windows = some_windows(seed, events.len());
            let rel = relative_totals(&events, &windows)
                .absolute(base, 7 << 20)
                .unwrap();
            let exact = exact_totals(&events, &windows, base, 7 << 20);
            assert!(same(&rel, &exact), "seed {seed}");
            assert_eq!(
                rel.windows,
                windows_by_brute_force(&events, &windows, base),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn a_trace_that_frees_too_much_takes_the_exact_replay() {
        // Frees 3 MiB from a start of 1 MiB: the replay clamps at zero, which
        // starting totals added afterwards cannot reproduce.
        let events = vec![
            ev(Action::Alloc, 1, 1 << 20),
            ev(Action::FreeCompleted, 2, 3 << 20),
            ev(Action::Alloc, 3, 1 << 20),
        ];
        let windows = [(0, 3), (1, 2), (2, 3)];
        assert!(relative_totals(&events, &windows)
            .absolute(1 << 20, 0)
            .is_none());
        let exact = exact_totals(&events, &windows, 1 << 20, 0);
        assert_eq!((exact.peak, exact.peak_idx), (2 << 20, Some(0)));
        // The totals after each entry are 2, 0 and 1 MiB.
        assert_eq!(
            exact.windows,
            windows_by_brute_force(&events, &windows, 1 << 20)
        );
        assert_eq!(exact.windows[1].at_end, 0);
    }

    /// A consistent trace with history: blocks at addresses 100 to 100 + `n`
    /// predate it, some freed once by the trace (which makes them orphans)
    /// and the rest alive at the end, returned as the snapshot's blocks;
    /// each trace allocation gets a stack numbered after its address.
    fn with_history(seed: u64, n: u64) -> (Vec<TraceEvent>, Vec<(u64, Live)>) {
        let mut events = trace(seed, 3000, 0);
        let mut freed = std::collections::HashSet::new();
        for (k, e) in events.iter_mut().enumerate() {
            if e.action == Action::Alloc {
                e.stack = StackId((e.addr % 17) as u32);
            }
            // Frees of pre-trace blocks, spread over the trace.
            let a = 100 + (k as u64 * 7 + seed) % n;
            if e.action == Action::SegmentAlloc && !a.is_multiple_of(3) && freed.insert(a) {
                *e = ev(Action::FreeCompleted, a, 4096 * a);
            }
        }
        let finals = (100..100 + n)
            .filter(|a| !freed.contains(a))
            .map(|a| {
                let live = Live {
                    size: 4096 * a,
                    stack: StackId(a as u32 % 5),
                    before_recording: true,
                };
                (a, live)
            })
            .collect();
        (events, finals)
    }

    /// The live set after each target the way the analysis first found it:
    /// a map by address, filled with the blocks that predate the trace and
    /// then replayed.
    fn live_by_address(
        events: &[TraceEvent],
        orphans: &[(usize, Live)],
        finals: &[(u64, Live)],
        targets: &[usize],
    ) -> Vec<Vec<(u64, u32, bool)>> {
        let mut live: HashMap<u64, Live> = HashMap::new();
        for &(i, l) in orphans {
            live.insert(events[i].addr, l);
        }
        live.extend(finals.iter().copied());
        let mut out = Vec::new();
        for (i, e) in events.iter().enumerate() {
            match e.action {
                Action::Alloc => {
                    let l = Live {
                        size: e.size,
                        stack: e.stack,
                        before_recording: false,
                    };
                    live.insert(e.addr, l);
                }
                Action::FreeCompleted => {
                    live.remove(&e.addr);
                }
                _ => {}
            }
            if targets.contains(&i) {
                out.push(sorted(live.values().copied()));
            }
        }
        out
    }

    fn sorted(live: impl Iterator<Item = Live>) -> Vec<(u64, u32, bool)> {
        let mut v: Vec<_> = live
            .map(|l| (l.size, l.stack.0, l.before_recording))
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn live_sets_rebuilt_from_linked_frees_match_a_replay_by_address() {
        for seed in 1..30u64 {
            let (events, finals) = with_history(seed, 40);
            let scan = scan_trace(&events);
            assert!(!scan.orphans.is_empty(), "seed {seed}");
            let before: Vec<Live> = finals
                .iter()
                .filter(|(a, _)| !scan.open.contains_key(a))
                .map(|(_, l)| *l)
                .collect();
            assert_eq!(before.len(), finals.len(), "seed {seed}");
            assert!(!before.is_empty(), "seed {seed}");
            // Every OOM, and entries of every kind besides.
            let mut targets: Vec<usize> = (0..events.len())
                .filter(|&i| events[i].action == Action::Oom || i % 97 == seed as usize)
                .collect();
            targets.push(events.len() - 1);
            targets.dedup();
            let mut ours = Vec::new();
            live_at(&events, &scan, &before, &targets, |_, live| {
                ours.push(sorted(live))
            });
            let theirs = live_by_address(&events, &scan.orphans, &finals, &targets);
            assert_eq!(ours.len(), targets.len(), "seed {seed}");
            for ((t, a), b) in targets.iter().zip(&ours).zip(&theirs) {
                assert!(a == b, "seed {seed}, entry {t}: {a:?} != {b:?}");
            }
        }
    }

    #[test]
    fn long_traces_analyzed_on_two_cores_find_the_exact_peak() {
        // A trace that frees all it allocated and returns every segment, so
        // that it is consistent with a snapshot holding nothing.
        let mut events = trace(7, PARALLEL_MIN_EVENTS + 5000, 0);
        let mut live = std::collections::HashMap::new();
        let mut segments = 0;
        for e in &events {
            match e.action {
                Action::Alloc => {
                    live.insert(e.addr, e.size);
                }
                Action::FreeCompleted => {
                    live.remove(&e.addr);
                }
                Action::SegmentAlloc => segments += 1,
                _ => {}
            }
        }
        let mut rest: Vec<_> = live.into_iter().collect();
        rest.sort();
        events.extend(rest.iter().map(|&(a, s)| ev(Action::FreeCompleted, a, s)));
        events.extend((0..segments).map(|_| ev(Action::SegmentFree, 0, 2 << 20)));
        let exact = exact_totals(&events, &[], 0, 0);
        let snap = Snapshot {
            segments: Vec::new(),
            traces: vec![crate::model::DeviceTrace {
                events,
                unknown_actions: BTreeMap::new(),
            }],
            allocator_settings: None,
            annotations: Vec::new(),
            stacks: Stacks::default(),
            layout: crate::model::Layout::default(),
        };
        let a = analyze(&snap, &Options::default());
        let d = &a.devices[0];
        assert!(a.warnings.iter().all(|w| w.kind != "inconsistent_trace"));
        assert_eq!(d.peak_active_bytes, exact.peak);
        assert_eq!(d.peak_event_index, exact.peak_idx.map(|i| i as u64));
        assert_eq!(d.peak_reserved_bytes, exact.peak_res);
        assert!(!exact.oom_idx.is_empty());
        assert_eq!(d.ooms.len(), exact.oom_idx.len());
        assert!(d
            .ooms
            .iter()
            .zip(&exact.reserved_after)
            .all(|(o, &r)| o.reserved_bytes == r));
    }
}
