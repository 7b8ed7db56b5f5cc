//! The allocator's state when a trace begins: the segments it held and the
//! blocks live in them, worked back from the snapshot's segments at its end
//! and the trace between.
//!
//! Segments come from the end state with the trace's own `segment_*`
//! entries undone, newest first. Blocks live at the start are those live at
//! the end that the trace did not allocate (sizes exact), and those the
//! trace frees without allocating them (sizes from their requests, rounded
//! as the recorded settings round, and widened by a remainder too small to
//! have been split off). Free space is the gaps between them, as the
//! allocator keeps its free neighbours merged.

use crate::config::AllocatorConfig;
use crate::rules::{PoolKind, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE};
use oomkit_snapshot::{Action, BlockState, FastState, Snapshot, TraceEvent};
use std::collections::{BTreeMap, HashSet};

/// A segment held when the trace begins.
#[derive(Clone, Debug)]
pub(crate) struct StartSegment {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: u16,
    pub(crate) kind: PoolKind,
    pub(crate) private: u8,
    /// A mapped range of an expandable segment.
    pub(crate) expandable: bool,
}

/// A block live when the trace begins.
#[derive(Clone, Debug)]
pub(crate) struct StartBlock {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    /// The bytes asked for, for placing it afresh under other settings.
    pub(crate) requested: u64,
    pub(crate) stream: u16,
    pub(crate) private: u8,
    /// Freed by the program but not yet completed.
    pub(crate) pending: bool,
}

/// The state a trace begins from.
#[derive(Clone, Debug, Default)]
pub(crate) struct Start {
    /// Segments, by address.
    pub(crate) segments: Vec<StartSegment>,
    /// Live blocks, by address.
    pub(crate) blocks: Vec<StartBlock>,
    /// What could not be placed, in words, for the replay's notes.
    pub(crate) notes: Vec<String>,
}

impl Start {
    /// Bytes reserved at the start.
    pub(crate) fn reserved(&self) -> u64 {
        self.segments.iter().map(|s| s.size).sum()
    }

    /// Bytes reserved and not held by a live block at the start: the cache.
    pub(crate) fn cached(&self) -> u64 {
        let live: u64 = self.blocks.iter().map(|b| b.size).sum();
        self.reserved().saturating_sub(live)
    }
}

/// A block the trace frees without having allocated it.
struct Orphan {
    addr: u64,
    requested: u64,
    stream: u16,
    pool: u8,
    pending: bool,
}

/// Works out the state a device's trace begins from, under the settings the run had.
pub(crate) fn start_state(snap: &Snapshot, device: i64, config: &AllocatorConfig) -> Start {
    let events = snap.events(device);
    let mut notes = Vec::new();
    let segments = start_segments(snap, device, &mut notes);
    let (open, orphans) = trace_holdings(events);
    let mut blocks = exact_blocks(snap, device, &open);
    let within = Within::new(&segments);
    let placed = place_orphans(orphans, &blocks, &within, config, &mut notes);
    size_orphans(placed, &mut blocks, &within, config, &mut notes);
    let blocks = without_overlaps(blocks, &within, &mut notes);
    Start {
        segments,
        blocks,
        notes,
    }
}

/// Which addresses the trace allocates and still holds at its end, and the
/// blocks it frees without having allocated them (from before it began).
fn trace_holdings(events: &[TraceEvent]) -> (HashSet<u64, FastState>, Vec<Orphan>) {
    let any_requested = events.iter().any(|e| e.action == Action::FreeRequested);
    let mut open: HashSet<u64, FastState> = HashSet::default();
    let mut requested_before: HashSet<u64, FastState> = HashSet::default();
    let mut orphans = Vec::new();
    for e in events {
        match e.action {
            Action::Alloc => {
                open.insert(e.addr);
            }
            Action::FreeRequested if !open.contains(&e.addr) => {
                requested_before.insert(e.addr);
            }
            // The guard closes the trace's own allocation where there is one;
            // a free with none before it is of a block from before the trace.
            Action::FreeCompleted if !open.remove(&e.addr) => orphans.push(Orphan {
                addr: e.addr,
                requested: e.size,
                stream: e.stream,
                pool: e.pool,
                // Freed but not completed when recording began, unless the
                // trace shows the request (or never records requests at all).
                pending: any_requested && !requested_before.contains(&e.addr),
            }),
            _ => {}
        }
    }
    (open, orphans)
}

/// The blocks live at the end that the trace did not allocate: their sizes exact.
fn exact_blocks(snap: &Snapshot, device: i64, open: &HashSet<u64, FastState>) -> Vec<StartBlock> {
    let mut blocks: Vec<StartBlock> = Vec::new();
    for s in snap.segments.iter().filter(|s| s.device == device) {
        let stream = snap.stream_index(s.stream as i64).unwrap_or(0);
        for b in &s.blocks {
            if b.state.is_active() && !open.contains(&b.address) {
                blocks.push(StartBlock {
                    addr: b.address,
                    size: b.size,
                    requested: b.requested_size,
                    stream,
                    private: s.pool,
                    pending: b.state == BlockState::ActivePendingFree,
                });
            }
        }
    }
    blocks
}

/// The segments held at the start, found by address.
struct Within<'s> {
    segments: &'s [StartSegment],
    by_addr: BTreeMap<u64, usize>,
}

impl<'s> Within<'s> {
    fn new(segments: &'s [StartSegment]) -> Within<'s> {
        let by_addr = segments
            .iter()
            .enumerate()
            .map(|(i, s)| (s.addr, i))
            .collect();
        Within { segments, by_addr }
    }

    /// The segment that holds `addr`, if any.
    fn containing(&self, addr: u64) -> Option<&'s StartSegment> {
        let (_, &i) = self.by_addr.range(..=addr).next_back()?;
        let s = &self.segments[i];
        (addr < s.addr + s.size).then_some(s)
    }
}

/// The blocks freed without being allocated, placed where they were in
/// the segment that holds them (with that segment's end), at the size
/// their request rounds to; sized against what follows them by [`size_orphans`].
fn place_orphans(
    mut orphans: Vec<Orphan>,
    exact: &[StartBlock],
    within: &Within<'_>,
    config: &AllocatorConfig,
    notes: &mut Vec<String>,
) -> Vec<(StartBlock, u64)> {
    let exact: HashSet<u64, FastState> = exact.iter().map(|b| b.addr).collect();
    // Their sizes need the next boundary, so they are placed sorted.
    orphans.sort_by_key(|o| o.addr);
    let mut unplaced = 0usize;
    let mut placed = Vec::new();
    for o in orphans {
        if exact.contains(&o.addr) {
            continue;
        }
        match within.containing(o.addr) {
            Some(s) => placed.push((
                StartBlock {
                    addr: o.addr,
                    size: config.round(o.requested),
                    requested: o.requested,
                    stream: o.stream,
                    private: if o.pool != 0 { o.pool } else { s.private },
                    pending: o.pending,
                },
                s.addr + s.size,
            )),
            None => unplaced += 1,
        }
    }
    if unplaced > 0 {
        notes.push(format!(
            "{unplaced} block(s) the trace frees lie in no segment held when it began; their frees are left out"
        ));
    }
    placed
}

/// Sizes each block freed before the trace against what follows it (the
/// next block or its segment's end), widened by a remainder too small to
/// have been split off, and adds it to `blocks`.
fn size_orphans(
    placed: Vec<(StartBlock, u64)>,
    blocks: &mut Vec<StartBlock>,
    within: &Within<'_>,
    config: &AllocatorConfig,
    notes: &mut Vec<String>,
) {
    let mut starts: Vec<u64> = blocks.iter().map(|b| b.addr).collect();
    starts.extend(placed.iter().map(|(b, _)| b.addr));
    starts.sort_unstable();
    let mut clipped = 0usize;
    for (mut b, seg_end) in placed {
        let next = starts.binary_search(&(b.addr + 1)).unwrap_or_else(|i| i);
        let limit = starts.get(next).copied().unwrap_or(u64::MAX).min(seg_end);
        let room = limit - b.addr;
        if b.size > room {
            b.size = room;
            clipped += 1;
        } else {
            let gap = room - b.size;
            let kind = within
                .containing(b.addr)
                .map_or(PoolKind::Large, |s| s.kind);
            // A remainder too small to split off stayed with the block.
            let stays = match kind {
                _ if b.size >= config.max_split_size => true,
                PoolKind::Small => gap < K_MIN_BLOCK_SIZE,
                PoolKind::Large if config.expandable_segments => gap < K_MIN_BLOCK_SIZE,
                PoolKind::Large => gap <= K_SMALL_SIZE,
            };
            if stays {
                b.size = room;
            }
        }
        blocks.push(b);
    }
    if clipped > 0 {
        notes.push(format!(
            "{clipped} block(s) freed by the trace overlap the next block when rounded; they are taken as ending there"
        ));
    }
}

/// The live blocks in address order, without those that overlap an
/// earlier one or lie outside every segment held at the start (a snapshot
/// where they do is kept whole by dropping them, with a note).
fn without_overlaps(
    mut blocks: Vec<StartBlock>,
    within: &Within<'_>,
    notes: &mut Vec<String>,
) -> Vec<StartBlock> {
    blocks.sort_by_key(|b| b.addr);
    let mut kept: Vec<StartBlock> = Vec::with_capacity(blocks.len());
    let mut dropped = 0usize;
    for b in blocks {
        match kept.last() {
            Some(p) if p.addr + p.size > b.addr => dropped += 1,
            _ => kept.push(b),
        }
    }
    if dropped > 0 {
        notes.push(format!(
            "{dropped} live block(s) overlap another at the start and are left out"
        ));
    }
    let before = kept.len();
    kept.retain(|b| {
        within
            .containing(b.addr)
            .is_some_and(|s| b.addr + b.size <= s.addr + s.size)
    });
    if kept.len() < before {
        notes.push(format!(
            "{} live block(s) lie outside every segment held at the start and are left out",
            before - kept.len()
        ));
    }
    kept
}

/// The segments held when the trace begins: those at the end with the
/// trace's segment entries undone, newest first.
fn start_segments(snap: &Snapshot, device: i64, notes: &mut Vec<String>) -> Vec<StartSegment> {
    let events = snap.events(device);
    // Address to (size, stream, kind, private, expandable); mapped ranges of
    // expandable segments are kept one per range, as snapshots list them.
    let mut segs: BTreeMap<u64, StartSegment> = BTreeMap::new();
    for s in snap.segments.iter().filter(|s| s.device == device) {
        let kind = match s.segment_type.as_str() {
            "small" => PoolKind::Small,
            "large" => PoolKind::Large,
            _ if s.total_size == K_SMALL_BUFFER => PoolKind::Small,
            _ => PoolKind::Large,
        };
        segs.insert(
            s.address,
            StartSegment {
                addr: s.address,
                size: s.total_size,
                stream: snap.stream_index(s.stream as i64).unwrap_or(0),
                kind,
                private: s.pool,
                expandable: s.is_expandable,
            },
        );
    }
    let mut missing = 0usize;
    // What each segment entry served, for the pool of a freed segment the end state no longer shows.
    let kind_of = |size: u64| {
        if size == K_SMALL_BUFFER {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    };
    for e in events.iter().rev() {
        match e.action {
            // The guard undoes the allocation; one of a segment not held is counted.
            Action::SegmentAlloc if segs.remove(&e.addr).is_none() => missing += 1,
            Action::SegmentFree => {
                segs.insert(
                    e.addr,
                    StartSegment {
                        addr: e.addr,
                        size: e.size,
                        stream: e.stream,
                        kind: kind_of(e.size),
                        private: e.pool,
                        expandable: false,
                    },
                );
            }
            Action::SegmentMap => {
                unmap_range(&mut segs, e.addr, e.size);
            }
            Action::SegmentUnmap => {
                let kind = segs
                    .range(..e.addr)
                    .next_back()
                    .filter(|(_, s)| s.expandable)
                    .map_or(kind_of(e.size), |(_, s)| s.kind);
                map_range(
                    &mut segs,
                    StartSegment {
                        addr: e.addr,
                        size: e.size,
                        stream: e.stream,
                        kind,
                        private: e.pool,
                        expandable: true,
                    },
                );
            }
            _ => {}
        }
    }
    if missing > 0 {
        notes.push(format!(
            "{missing} segment(s) the trace allocates are not among those at its end or freed later; the trace and the segments disagree"
        ));
    }
    // Segments cannot overlap; a file where they do keeps the first of each clash.
    let mut kept: Vec<StartSegment> = Vec::with_capacity(segs.len());
    let mut clashes = 0usize;
    for s in segs.into_values() {
        match kept.last() {
            Some(p) if p.addr.saturating_add(p.size) > s.addr => clashes += 1,
            _ => kept.push(s),
        }
    }
    if clashes > 0 {
        notes.push(format!(
            "{clashes} segment(s) overlap another held when the trace began and are left out"
        ));
    }
    kept
}

/// Removes `[addr, addr+size)` from the mapped ranges of expandable segments.
fn unmap_range(segs: &mut BTreeMap<u64, StartSegment>, addr: u64, size: u64) {
    let end = addr + size;
    let hit: Vec<u64> = segs
        .range(..end)
        .rev()
        .take_while(|(_, s)| s.addr + s.size > addr)
        .filter(|(_, s)| s.expandable)
        .map(|(&a, _)| a)
        .collect();
    for a in hit {
        let s = segs.remove(&a).expect("listed above");
        if s.addr < addr {
            segs.insert(
                s.addr,
                StartSegment {
                    size: addr - s.addr,
                    ..s.clone()
                },
            );
        }
        if s.addr + s.size > end {
            segs.insert(
                end,
                StartSegment {
                    addr: end,
                    size: s.addr + s.size - end,
                    ..s
                },
            );
        }
    }
}

/// Adds a mapped range, joining the ranges it touches.
fn map_range(segs: &mut BTreeMap<u64, StartSegment>, mut r: StartSegment) {
    if let Some((&a, prev)) = segs.range(..r.addr).next_back() {
        if prev.expandable && prev.addr + prev.size == r.addr && prev.stream == r.stream {
            let p = segs.remove(&a).expect("found above");
            r.size += p.size;
            r.addr = p.addr;
        }
    }
    let end = r.addr + r.size;
    if let Some(next) = segs.get(&end) {
        if next.expandable && next.stream == r.stream {
            let n = segs.remove(&end).expect("found above");
            r.size += n.size;
        }
    }
    segs.insert(r.addr, r);
}
