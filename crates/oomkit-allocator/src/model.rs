//! The device allocator: blocks, pools and segments, and the paths of
//! `DeviceCachingAllocator::malloc` and `free` in `CUDACachingAllocator.cpp`,
//! step by step under the same names. Expandable segments are in
//! `expandable.rs`.

use crate::config::AllocatorConfig;
use crate::free::{FreeKey, FreeSet};
use crate::rules::{allocation_size, PoolKind, K_ROUND_LARGE};
use std::collections::{BTreeMap, BTreeSet};

/// A block's index in the arena.
pub(crate) type BlockId = u32;

/// Where a block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Cached: in its pool's free set (or, unmapped, its unmapped set).
    Free,
    /// Handed out.
    Allocated,
    /// Freed by the program, held until other streams finish (`free_requested`
    /// seen, `free_completed` not yet): active, not allocated, never merged.
    Pending,
}

/// A block: a piece of a segment, as `struct Block` in the source.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: u16,
    pub(crate) pool: u16,
    pub(crate) state: State,
    /// False for the unmapped address space of an expandable segment.
    pub(crate) mapped: bool,
    pub(crate) prev: Option<BlockId>,
    pub(crate) next: Option<BlockId>,
    /// The segment it belongs to.
    pub(crate) segment: u32,
    /// The pool's `get_free_blocks_call_count` when the block was cached, for garbage collection.
    pub(crate) gc_base: u64,
    /// The trace's address for the allocation it holds, so that an early
    /// completion can be told to the replay.
    pub(crate) key: u64,
}

impl Block {
    pub(crate) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// One of the allocator's block pools (`BlockPool`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Pool {
    pub(crate) kind: Option<PoolKind>,
    /// The private pool it belongs to (an index of the snapshot's pools; 0 is the default).
    pub(crate) private: u8,
    pub(crate) blocks: FreeSet,
    /// Unmapped address space of expandable segments, by stream and address.
    pub(crate) unmapped: BTreeSet<(u16, u64, BlockId)>,
    /// `get_free_blocks_call_count`, counted only while garbage collection is on.
    pub(crate) gc_calls: u64,
}

/// A segment the model holds: one `cudaMalloc`, or one expandable segment's address space.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    /// For an expandable segment, its page size; 0 for a `cudaMalloc` segment.
    pub(crate) page: u64,
}

/// How a segment came and went, for the replay's report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SegmentOp {
    /// `cudaMalloc` (`segment_alloc`).
    Alloc,
    /// `cudaFree` (`segment_free`).
    Free,
    /// Pages mapped into an expandable segment (`segment_map`).
    Map,
    /// Pages unmapped from one (`segment_unmap`).
    Unmap,
}

/// A segment operation of the model, with the trace entry it served.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SegmentEvent {
    pub(crate) entry: usize,
    pub(crate) op: SegmentOp,
    /// Where the segment (or the range mapped or unmapped) begins.
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: u16,
    pub(crate) kind: PoolKind,
    pub(crate) private: bool,
}

/// What an allocation that failed saw, after freeing every cached block it could.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Failure {
    /// The bytes asked for (rounded).
    pub(crate) size: u64,
    /// The segment it would have needed.
    pub(crate) alloc_size: u64,
    pub(crate) reserved: u64,
    pub(crate) active: u64,
    /// The largest free block of the pool it needed.
    pub(crate) largest_free: u64,
}

/// The running totals `DeviceStats` keeps, with the moment of the reserved peak.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Totals {
    pub(crate) reserved: u64,
    /// Block bytes handed out and not yet freed by the program (`allocated_bytes`).
    pub(crate) allocated: u64,
    /// Allocated plus freed-but-pending (`active_bytes`).
    pub(crate) active: u64,
    pub(crate) peak_reserved: u64,
    pub(crate) peak_allocated: u64,
    /// Reserved minus active when reserved peaked (the first time it did).
    pub(crate) free_at_peak: u64,
    /// The trace entry where reserved first reached its peak.
    pub(crate) peak_entry: Option<usize>,
    /// Allocations retried after the whole cache was released (`num_alloc_retries`).
    pub(crate) alloc_retries: u64,
}

/// Where new segments are placed: the trace's own addresses where the
/// replay offers them, else fresh ones above everything seen.
#[derive(Clone, Debug, Default)]
pub(crate) struct Addresses {
    /// Addresses the trace recorded for the segments of the entry now replayed: (address, size).
    pub(crate) offered: Vec<(u64, u64)>,
    /// The next fresh address.
    pub(crate) fresh: u64,
}

/// The model of one device's caching allocator.
pub(crate) struct Allocator {
    pub(crate) config: AllocatorConfig,
    /// What the allocator may hold (the driver's limit), if any.
    pub(crate) capacity: Option<u64>,
    pub(crate) blocks: Vec<Block>,
    spare: Vec<BlockId>,
    pub(crate) pools: Vec<Pool>,
    pub(crate) segments: Vec<Option<Segment>>,
    /// Live segments by address, to keep new ones apart.
    pub(crate) by_addr: BTreeMap<u64, u64>,
    /// Blocks freed by the program and not yet completed.
    pub(crate) pending: Vec<BlockId>,
    pub(crate) totals: Totals,
    pub(crate) events: Vec<SegmentEvent>,
    pub(crate) addresses: Addresses,
    /// The trace entry now replayed.
    pub(crate) entry: usize,
    /// Trace addresses whose pending frees the model completed early (an OOM's flush).
    pub(crate) completed_early: Vec<u64>,
    /// A new reserved peak was reached by the operation under way.
    peak_unsettled: bool,
}

impl Allocator {
    pub(crate) fn new(config: AllocatorConfig, capacity: Option<u64>) -> Self {
        Allocator {
            config,
            capacity,
            blocks: Vec::new(),
            spare: Vec::new(),
            pools: Vec::new(),
            segments: Vec::new(),
            by_addr: BTreeMap::new(),
            pending: Vec::new(),
            totals: Totals::default(),
            events: Vec::new(),
            addresses: Addresses::default(),
            entry: 0,
            completed_early: Vec::new(),
            peak_unsettled: false,
        }
    }

    // ---- the arena ----

    pub(crate) fn new_block(&mut self, b: Block) -> BlockId {
        match self.spare.pop() {
            Some(id) => {
                self.blocks[id as usize] = b;
                id
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    fn drop_block(&mut self, id: BlockId) {
        self.spare.push(id);
    }

    /// Whether an arena slot is unused (for the tests' walk over every block).
    #[cfg(test)]
    pub(crate) fn is_spare(&self, id: BlockId) -> bool {
        self.spare.contains(&id)
    }

    pub(crate) fn b(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }

    pub(crate) fn bm(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    /// The pool of a kind in a private pool (0: the default pools), made on first use.
    pub(crate) fn pool_index(&mut self, private: u8, kind: PoolKind) -> u16 {
        let i = private as usize * 2 + (kind == PoolKind::Small) as usize;
        if self.pools.len() <= i {
            self.pools.resize_with(i + 1, Pool::default);
        }
        let p = &mut self.pools[i];
        p.kind = Some(kind);
        p.private = private;
        i as u16
    }

    pub(crate) fn kind(&self, pool: u16) -> PoolKind {
        self.pools[pool as usize].kind.unwrap_or(PoolKind::Large)
    }

    /// Caches a free block in its pool (`insert_into_blocks`).
    pub(crate) fn insert_free(&mut self, id: BlockId) {
        let pool = self.b(id).pool as usize;
        let calls = self.pools[pool].gc_calls;
        let b = self.bm(id);
        b.gc_base = calls;
        let (stream, size, addr) = (b.stream, b.size, b.addr);
        self.pools[pool].blocks.insert(stream, size, addr, id);
    }

    pub(crate) fn remove_free(&mut self, id: BlockId) {
        let b = self.b(id);
        let (pool, stream, size, addr) = (b.pool as usize, b.stream, b.size, b.addr);
        self.pools[pool].blocks.remove(stream, size, addr);
    }

    pub(crate) fn gc_enabled(&self) -> bool {
        self.config.memory_fraction.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    /// What the allocator may hold: the device's limit, lowered by a memory fraction.
    pub(crate) fn allowed(&self) -> Option<u64> {
        match (self.capacity, self.config.memory_fraction) {
            (Some(c), Some(f)) => Some((c as f64 * f) as u64),
            (c, _) => c,
        }
    }

    /// Whether the driver would give `bytes` more.
    pub(crate) fn fits(&self, bytes: u64) -> bool {
        self.allowed()
            .is_none_or(|cap| self.totals.reserved.saturating_add(bytes) <= cap)
    }

    // ---- the totals ----

    pub(crate) fn reserve(&mut self, bytes: u64) {
        self.totals.reserved += bytes;
        self.note_peak();
    }

    pub(crate) fn unreserve(&mut self, bytes: u64) {
        self.totals.reserved = self.totals.reserved.saturating_sub(bytes);
    }

    fn note_peak(&mut self) {
        let t = &mut self.totals;
        if t.reserved > t.peak_reserved {
            t.peak_reserved = t.reserved;
            t.peak_entry = Some(self.entry);
            self.peak_unsettled = true;
        }
    }

    /// Takes the free memory at a new peak once the operation that reached
    /// it is done: a segment is reserved before its block is handed out.
    pub(crate) fn settle_peak(&mut self) {
        if self.peak_unsettled {
            let t = &mut self.totals;
            t.free_at_peak = t.reserved.saturating_sub(t.active);
            self.peak_unsettled = false;
        }
    }

    pub(crate) fn record(&mut self, op: SegmentOp, addr: u64, size: u64, stream: u16, pool: u16) {
        let p = &self.pools[pool as usize];
        self.events.push(SegmentEvent {
            entry: self.entry,
            op,
            addr,
            size,
            stream,
            kind: p.kind.unwrap_or(PoolKind::Large),
            private: p.private != 0,
        });
    }

    // ---- segments ----

    /// An address for a new segment of `size`: one the trace recorded for
    /// this entry, where free, else a fresh one.
    pub(crate) fn place(&mut self, size: u64) -> u64 {
        let offered = std::mem::take(&mut self.addresses.offered);
        let mut chosen = None;
        let mut rest = Vec::with_capacity(offered.len());
        for (a, s) in offered {
            if chosen.is_none() && s == size && self.is_free_range(a, size) {
                chosen = Some(a);
            } else {
                rest.push((a, s));
            }
        }
        self.addresses.offered = rest;
        chosen.unwrap_or_else(|| {
            let a = self.addresses.fresh;
            // Fresh addresses stay 2 MiB aligned, as the driver's are.
            self.addresses.fresh = (a + size).div_ceil(K_ROUND_LARGE) * K_ROUND_LARGE;
            a
        })
    }

    fn is_free_range(&self, addr: u64, size: u64) -> bool {
        let end = addr.saturating_add(size);
        let before = self.by_addr.range(..end).next_back();
        before.is_none_or(|(&a, &s)| a.saturating_add(s) <= addr)
    }

    pub(crate) fn add_segment(&mut self, s: Segment) -> u32 {
        self.by_addr.insert(s.addr, s.size);
        let end = s.addr.saturating_add(s.size);
        if end > self.addresses.fresh {
            self.addresses.fresh = end.div_ceil(K_ROUND_LARGE) * K_ROUND_LARGE;
        }
        self.segments.push(Some(s));
        (self.segments.len() - 1) as u32
    }

    fn remove_segment(&mut self, seg: u32) {
        if let Some(s) = self.segments[seg as usize].take() {
            self.by_addr.remove(&s.addr);
        }
    }

    // ---- malloc ----

    /// `malloc`: a block of `orig` bytes on `stream` in the given private pool,
    /// or what the failed attempt saw.
    pub(crate) fn malloc(
        &mut self,
        orig: u64,
        stream: u16,
        private: u8,
    ) -> Result<BlockId, Failure> {
        let size = self.config.round(orig);
        let kind = PoolKind::of(size);
        let pool = self.pool_index(private, kind);
        let alloc_size = allocation_size(size);
        let mut found = self.get_free_block(pool, stream, size);
        if found.is_none() {
            if self.gc_enabled() {
                self.garbage_collect_cached_blocks();
            }
            found = self.alloc_block(pool, stream, size, alloc_size);
            if found.is_none() && self.release_available_cached_blocks(pool, stream, size) {
                found = self.alloc_block(pool, stream, size, alloc_size);
            }
            // Allocations into a private pool are made while a CUDA graph is
            // captured, when the allocator may not synchronize to flush its cache.
            if found.is_none() && private == 0 {
                self.release_cached_blocks();
                // PyTorch counts the retry (`isRetry`) whether or not it succeeds.
                self.totals.alloc_retries += 1;
                found = self.alloc_block(pool, stream, size, alloc_size);
            }
        }
        let Some(block) = found else {
            self.settle_peak();
            let largest_free = self.pools[pool as usize].blocks.largest_size();
            return Err(Failure {
                size,
                alloc_size,
                reserved: self.totals.reserved,
                active: self.totals.active,
                largest_free,
            });
        };
        let split = self.config.splits(kind, self.b(block).size, size);
        let id = self.alloc_found_block(block, size, split);
        self.settle_peak();
        Ok(id)
    }

    /// `get_free_block`: the smallest cached block of the stream that fits,
    /// unless it is oversize for the request; taken out of the pool.
    fn get_free_block(&mut self, pool: u16, stream: u16, size: u64) -> Option<BlockId> {
        if self.gc_enabled() {
            self.pools[pool as usize].gc_calls += 1;
        }
        let cur = self.best_fit(pool, stream, size)?;
        let max_split = self.config.max_split_size;
        let bsize = cur.1;
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size.saturating_add(self.config.max_non_split_rounding) {
            return None;
        }
        self.pools[pool as usize].blocks.remove(cur.0, cur.1, cur.2);
        Some(cur.3)
    }

    /// The smallest cached block of the stream with `size` bytes, where an
    /// expandable block counts as the size it can grow to.
    fn best_fit(&self, pool: u16, stream: u16, size: u64) -> Option<FreeKey> {
        let mut it = self.pools[pool as usize].blocks.from(stream, size);
        let mut cur = it.next()?;
        if cur.0 != stream {
            return None;
        }
        if self.segment_of(cur.3).page > 0 {
            if self.config.expandable_segments {
                // A larger block that can grow less may be the better fit.
                for next in it {
                    if next.0 != stream
                        || self.segment_of(cur.3).page == 0
                        || self.expandable_size(next.3) >= self.expandable_size(cur.3)
                    {
                        break;
                    }
                    cur = next;
                }
            } else {
                // Expandable segments turned off later: only other blocks serve.
                cur = it.find(|k| k.0 != stream || self.segment_of(k.3).page == 0)?;
                if cur.0 != stream {
                    return None;
                }
            }
        }
        Some(cur)
    }

    pub(crate) fn segment_of(&self, id: BlockId) -> &Segment {
        self.segments[self.b(id).segment as usize]
            .as_ref()
            .expect("a live block's segment is live")
    }

    fn expandable_size(&self, id: BlockId) -> u64 {
        let b = self.b(id);
        b.size
            + b.next
                .filter(|&n| !self.b(n).mapped)
                .map_or(0, |n| self.b(n).size)
    }

    /// `alloc_block`: a new segment from the driver (or pages mapped into an
    /// expandable one), if the capacity allows.
    fn alloc_block(
        &mut self,
        pool: u16,
        stream: u16,
        size: u64,
        alloc_size: u64,
    ) -> Option<BlockId> {
        if self.config.memory_fraction.is_some() && !self.fits(alloc_size) {
            return None;
        }
        if self.config.expandable_segments {
            return self.try_allocate_expandable_block(pool, stream, size);
        }
        if !self.fits(alloc_size) {
            return None;
        }
        let addr = self.place(alloc_size);
        let seg = self.add_segment(Segment {
            addr,
            size: alloc_size,
            page: 0,
        });
        self.reserve(alloc_size);
        self.record(SegmentOp::Alloc, addr, alloc_size, stream, pool);
        Some(self.new_block(Block {
            addr,
            size: alloc_size,
            stream,
            pool,
            state: State::Free,
            mapped: true,
            prev: None,
            next: None,
            segment: seg,
            gc_base: 0,
            key: 0,
        }))
    }

    /// `alloc_found_block`: hands out `size` of the block, caching the rest when split.
    fn alloc_found_block(&mut self, block: BlockId, size: u64, split: bool) -> BlockId {
        let id = if split {
            let r = self.b(block).clone();
            let front = self.new_block(Block {
                size,
                next: Some(block),
                ..r
            });
            if let Some(p) = r.prev {
                self.bm(p).next = Some(front);
            }
            let rem = self.bm(block);
            rem.prev = Some(front);
            rem.addr += size;
            rem.size -= size;
            self.insert_free(block);
            front
        } else {
            block
        };
        let b = self.bm(id);
        b.state = State::Allocated;
        let bytes = b.size;
        self.totals.allocated += bytes;
        self.totals.active += bytes;
        self.totals.peak_allocated = self.totals.peak_allocated.max(self.totals.allocated);
        id
    }

    // ---- free ----

    /// `free` of a block the program let go, before other streams are done
    /// with it (`free_requested`).
    pub(crate) fn free_requested(&mut self, id: BlockId) {
        let b = self.bm(id);
        if b.state == State::Allocated {
            b.state = State::Pending;
            let bytes = b.size;
            self.totals.allocated = self.totals.allocated.saturating_sub(bytes);
            self.pending.push(id);
        }
    }

    /// The free completes (`free_completed`): the block is cached, merged with free neighbours.
    pub(crate) fn free_completed(&mut self, id: BlockId) {
        match self.b(id).state {
            State::Allocated => {
                let bytes = self.b(id).size;
                self.totals.allocated = self.totals.allocated.saturating_sub(bytes);
            }
            State::Pending => {
                if let Some(i) = self.pending.iter().rposition(|&p| p == id) {
                    self.pending.swap_remove(i);
                }
            }
            State::Free => return,
        }
        self.free_block(id);
    }

    /// `free_block`: merges with free neighbours and caches the result.
    fn free_block(&mut self, id: BlockId) {
        let bytes = self.b(id).size;
        self.bm(id).state = State::Free;
        self.totals.active = self.totals.active.saturating_sub(bytes);
        if let Some(p) = self.b(id).prev {
            self.try_merge_blocks(id, p);
        }
        if let Some(n) = self.b(id).next {
            self.try_merge_blocks(id, n);
        }
        self.insert_free(id);
    }

    /// `try_merge_blocks`: folds a free neighbour `src` into `dst`,
    /// returning the bytes it took, or 0 when `src` is in use or differently mapped.
    pub(crate) fn try_merge_blocks(&mut self, dst: BlockId, src: BlockId) -> u64 {
        let s = self.b(src).clone();
        if s.state != State::Free || s.mapped != self.b(dst).mapped {
            return 0;
        }
        if s.mapped {
            self.remove_free(src);
        } else {
            self.pools[s.pool as usize]
                .unmapped
                .remove(&(s.stream, s.addr, src));
        }
        if self.b(dst).prev == Some(src) {
            let d = self.bm(dst);
            d.addr = s.addr;
            d.prev = s.prev;
            if let Some(p) = s.prev {
                self.bm(p).next = Some(dst);
            }
        } else {
            self.bm(dst).next = s.next;
            if let Some(n) = s.next {
                self.bm(n).prev = Some(dst);
            }
        }
        self.bm(dst).size += s.size;
        self.drop_block(src);
        s.size
    }

    // ---- giving memory back ----

    /// `release_block`: `cudaFree` of a whole cached segment.
    fn release_block(&mut self, id: BlockId) {
        let b = self.b(id).clone();
        self.remove_free(id);
        self.record(SegmentOp::Free, b.addr, b.size, b.stream, b.pool);
        self.unreserve(b.size);
        self.remove_segment(b.segment);
        self.drop_block(id);
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, frees
    /// oversize cached segments of the stream, the smallest that covers the
    /// request, else the largest ones until their sum does.
    fn release_available_cached_blocks(&mut self, pool: u16, stream: u16, size: u64) -> bool {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key = size.max(max_split);
        let p = &self.pools[pool as usize];
        let fit = p.blocks.from(stream, key).next();
        match fit {
            Some(k)
                if k.0 == stream && self.segment_of(k.3).page == 0 && !self.b(k.3).is_split() =>
            {
                self.release_block(k.3);
                true
            }
            _ => {
                // The largest oversize blocks of the stream, largest first.
                let below: Vec<FreeKey> = p
                    .blocks
                    .below(stream, key)
                    .take_while(|k| k.0 == stream && k.1 >= max_split)
                    .collect();
                let mut released = 0;
                for k in below {
                    if released >= key {
                        break;
                    }
                    if self.segment_of(k.3).page == 0 && !self.b(k.3).is_split() {
                        released += k.1;
                        self.release_block(k.3);
                    }
                }
                released >= key
            }
        }
    }

    /// `release_cached_blocks`: completes the pending frees, then returns
    /// every unsplit cached segment of the default pools to the driver.
    pub(crate) fn release_cached_blocks(&mut self) {
        self.synchronize_and_free_events();
        for i in 0..self.pools.len().min(2) {
            self.release_blocks(i as u16);
        }
    }

    /// `synchronize_and_free_events`: every pending free completes now.
    fn synchronize_and_free_events(&mut self) {
        for id in std::mem::take(&mut self.pending) {
            if self.b(id).state == State::Pending {
                let key = self.b(id).key;
                self.completed_early.push(key);
                self.free_block(id);
            }
        }
    }

    /// `release_blocks`: frees the pool's unsplit cached segments and unmaps
    /// the free pages of its expandable ones.
    fn release_blocks(&mut self, pool: u16) {
        // Nothing put in since the last pass: it left only blocks it does not release. A
        // model near its capacity passes here at every failed allocation; PyTorch walks the
        // whole pool each time, which here was most of a replay's time.
        if !self.pools[pool as usize].blocks.take_inserted() {
            debug_assert!(self.nothing_to_release(pool), "pool {pool}");
            return;
        }
        let all: Vec<FreeKey> = self.pools[pool as usize].blocks.iter().collect();
        let mut to_unmap = Vec::new();
        for k in all {
            let id = k.3;
            if self.segment_of(id).page > 0 {
                to_unmap.push(id);
            } else if !self.b(id).is_split() {
                self.release_block(id);
            }
        }
        for id in to_unmap {
            // Unmapping merges only unmapped neighbours, so every block
            // gathered here is still a mapped free block.
            if self.b(id).state == State::Free && self.b(id).mapped {
                self.unmap_block(id);
                if !self.b(id).is_split() && !self.b(id).mapped {
                    self.release_expandable_segment(id);
                }
            }
        }
    }

    /// Whether a pass of `release_blocks` over the pool would release or unmap nothing.
    fn nothing_to_release(&self, pool: u16) -> bool {
        self.pools[pool as usize].blocks.iter().all(|k| {
            let id = k.3;
            if self.segment_of(id).page > 0 {
                !(self.b(id).state == State::Free
                    && self.b(id).mapped
                    && self.whole_pages(id).is_some())
            } else {
                self.b(id).is_split()
            }
        })
    }

    /// `garbage_collect_cached_blocks`: above the threshold share of the
    /// allowed memory, frees unsplit cached large segments, oldest first by
    /// how many searches they sat through.
    fn garbage_collect_cached_blocks(&mut self) {
        let Some(allowed) = self.allowed() else {
            return;
        };
        let threshold = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        if self.totals.reserved <= threshold {
            return;
        }
        let target = self.totals.reserved - threshold;
        let large = self.pool_index(0, PoolKind::Large) as usize;
        let calls = self.pools[large].gc_calls;
        let age = |s: &Self, id: BlockId| calls.saturating_sub(s.b(id).gc_base);
        let mut freeable: Vec<BlockId> = self.pools[large]
            .blocks
            .iter()
            .map(|k| k.3)
            .filter(|&id| !self.b(id).is_split() && self.segment_of(id).page == 0)
            .collect();
        let mut total_age: u64 = freeable.iter().map(|&id| age(self, id)).sum();
        let mut reclaimed = 0;
        while reclaimed < target && !freeable.is_empty() {
            let threshold_age = total_age as f64 / freeable.len() as f64;
            let (old, young): (Vec<BlockId>, Vec<BlockId>) = freeable
                .into_iter()
                .partition(|&id| age(self, id) as f64 >= threshold_age);
            if old.is_empty() {
                break;
            }
            for id in old {
                reclaimed += self.b(id).size;
                total_age -= age(self, id);
                self.release_block(id);
            }
            freeable = young;
        }
    }

    /// Forgets a block and the segment it was the last of.
    pub(crate) fn drop_segment_block(&mut self, id: BlockId, segment: u32) {
        self.remove_segment(segment);
        self.drop_block(id);
    }

    /// `emptyCache`: the program called `torch.cuda.empty_cache()`.
    pub(crate) fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }
}
