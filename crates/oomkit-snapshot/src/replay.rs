//! Replaying a device's trace: which blocks predate it, the running totals,
//! the peaks, each phase's window, and the live set at chosen entries.

use crate::hash::FastState;
use crate::model::{Action, TraceEvent};
use crate::sites::Live;
use crate::stacks::StackId;
use std::collections::HashMap;

/// Applies one trace entry to the running active and reserved totals.
///
/// Blocks count as active from `alloc` to `free_completed`, which is how the
/// allocator itself counts them; segments count from `segment_alloc` (or
/// `segment_map`) to `segment_free` (or `segment_unmap`).
pub(crate) fn apply(action: Action, size: u64, active: &mut u64, reserved: &mut u64) {
    match action {
        Action::Alloc => *active += size,
        Action::FreeCompleted => *active = active.saturating_sub(size),
        Action::SegmentAlloc | Action::SegmentMap => *reserved += size,
        Action::SegmentFree | Action::SegmentUnmap => *reserved = reserved.saturating_sub(size),
        _ => {}
    }
}

/// What one pass over a trace learns about blocks that predate it, and
/// which entry ends which allocation.
pub(crate) struct TraceScan {
    /// Addresses the trace allocated and had not freed by its end, with the
    /// entry that allocated each.
    pub(crate) open: HashMap<u64, u32, FastState>,
    /// For each entry, one more than the index of the earlier allocation it
    /// ends, or 0: a free ends the allocation at its address, and an
    /// allocation at an address still held ends the one there before it.
    /// (Zero for none lets the table start as untouched zeroed pages.)
    ///
    /// Entry indices fit in 32 bits because each trace entry is a claimed
    /// object or a slab cell, both numbered with 32 bits by the parser.
    pub(crate) link: Vec<u32>,
    /// Blocks freed by the trace that it never allocated, with the entry
    /// that freed each.
    pub(crate) orphans: Vec<(usize, Live)>,
    pub(crate) net_active: i128,
    pub(crate) net_reserved: i128,
    pub(crate) action_counts: [u64; Action::ALL.len()],
    pub(crate) missing_frames: u64,
    pub(crate) allocs: u64,
    pub(crate) largest_alloc: u64,
}

/// Finds which blocks predate the trace: frees without an alloc before
/// them, and (through `open`) blocks alive at the end that the trace never
/// allocated. It also links each free to its allocation, so that the live
/// set at any entry can be rebuilt later without looking addresses up again.
pub(crate) fn scan_trace(events: &[TraceEvent]) -> TraceScan {
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
                            requested: e.size,
                            stack: StackId::EMPTY,
                            before_recording: true,
                            private_pool: false,
                            at: Live::freed_by(i),
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
pub(crate) fn live_at(
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
                            requested: a.size,
                            stack: a.stack,
                            before_recording: false,
                            private_pool: false,
                            at: (w * 64 + b) as u32,
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
pub(crate) type Window = (usize, usize);

/// Finds the entries of each range, or none at all when the trace has no
/// times to place them by.
pub(crate) fn windows(ranges: &[(String, i64, i64)], events: &[TraceEvent]) -> Vec<Window> {
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
pub(crate) struct WindowStats {
    pub(crate) at_start: u64,
    pub(crate) at_end: u64,
    pub(crate) peak: u64,
    pub(crate) peak_idx: Option<usize>,
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
pub(crate) struct Totals {
    pub(crate) peak: u64,
    pub(crate) peak_idx: Option<usize>,
    pub(crate) peak_res: u64,
    pub(crate) oom_idx: Vec<usize>,
    /// Active bytes when each OOM entry was recorded.
    pub(crate) oom_live: Vec<u64>,
    pub(crate) reserved_after: Vec<u64>,
    pub(crate) windows: Vec<WindowStats>,
}

/// The running totals counted from zero, before the starting totals are known.
pub(crate) struct RelativeTotals<'w> {
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
pub(crate) fn relative_totals<'w>(
    events: &[TraceEvent],
    windows: &'w [Window],
) -> RelativeTotals<'w> {
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
    pub(crate) fn absolute(self, base_active: u64, base_reserved: u64) -> Option<Totals> {
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
pub(crate) fn exact_totals(
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
            apply(e.action, e.size, &mut cur, &mut cur_res);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{analyze, PARALLEL_MIN_EVENTS};
    use crate::model::Snapshot;
    use crate::report::Options;
    use crate::stacks::Stacks;
    use std::collections::BTreeMap;

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
                apply(e.action, e.size, &mut cur, &mut res);
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
                    requested: 4096 * a,
                    stack: StackId(a as u32 % 5),
                    before_recording: true,
                    private_pool: false,
                    at: Live::UNTRACED,
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
                        requested: e.size,
                        stack: e.stack,
                        before_recording: false,
                        private_pool: false,
                        at: i as u32,
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
            streams: vec![0],
            pools: vec![(0, 0)],
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
