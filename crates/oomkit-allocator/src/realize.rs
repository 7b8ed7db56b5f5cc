//! A program's allocations and frees, recorded without a GPU (preflight),
//! served as the CUDA caching allocator would serve them: the addresses,
//! the segment entries and the end state that a real snapshot records.

use crate::config::AllocatorConfig;
use crate::model::{Allocator, BlockId, SegmentOp, State};
use crate::rules::PoolKind;
use oomkit_snapshot::Action;
use std::collections::BTreeMap;

/// Where the first segment is placed: a typical CUDA virtual address, so
/// that a realized snapshot reads like a recorded one.
pub const FIRST_SEGMENT_ADDRESS: u64 = 0x7f00_0000_0000;

/// One thing the program did to device memory, in program order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A tensor's storage of `size` bytes was allocated on `stream`.
    Alloc {
        /// The bytes asked for.
        size: u64,
        /// The stream it was allocated on (0 is the default stream).
        stream: u16,
    },
    /// The storage allocated by the operation at index `alloc` was freed.
    Free {
        /// The index in the operations of the allocation freed.
        alloc: usize,
    },
    /// `torch.cuda.empty_cache()`.
    EmptyCache,
    /// An allocation of `size` bytes on `stream` that failed for the memory
    /// the program was run against, which the program caught and went on
    /// from: the allocator released its cache and held nothing.
    Refused {
        /// The bytes asked for.
        size: u64,
        /// The stream it was asked on.
        stream: u16,
    },
}

/// One entry of the realized trace, as `_dump_snapshot` writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// What happened (`alloc`, `free_requested`, `segment_alloc`, `oom`...).
    pub action: Action,
    /// The block's or segment's address; for `oom`, the bytes the device had free.
    pub addr: u64,
    /// The bytes: asked for (allocations and frees) or reserved (segments).
    pub size: u64,
    /// The stream.
    pub stream: u16,
    /// The index of the operation that led to it.
    pub op: usize,
}

/// A block of a segment held at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndBlock {
    /// Its address.
    pub addr: u64,
    /// Its size, rounded as the allocator rounds.
    pub size: u64,
    /// The bytes asked for (0 for a cached block).
    pub requested: u64,
    /// Handed out (true) or cached (false).
    pub allocated: bool,
    /// The allocation it holds, by operation index.
    pub op: Option<usize>,
}

/// A segment held at the end, as the snapshot's `segments` list shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndSegment {
    /// Its address.
    pub addr: u64,
    /// Its size.
    pub size: u64,
    /// The stream it serves.
    pub stream: u16,
    /// Small or large pool.
    pub kind: PoolKind,
    /// A mapped range of an expandable segment.
    pub expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<EndBlock>,
}

/// The operations served: the trace, the end state and the figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Realized {
    /// The trace, in order.
    pub entries: Vec<Entry>,
    /// The segments held after the last operation.
    pub segments: Vec<EndSegment>,
    /// The most the allocator reserved.
    pub peak_reserved: u64,
    /// The most handed out at once (rounded block sizes, as `allocated_bytes`).
    pub peak_allocated: u64,
    /// The operation at which reserved memory first reached its peak.
    pub peak_op: Option<usize>,
    /// Reserved but not handed out at that moment.
    pub free_at_peak: u64,
    /// Allocations that failed for the capacity, by operation index.
    pub ooms: Vec<usize>,
    /// Bytes handed out (rounded blocks) after each operation, as `torch.cuda.memory_allocated()` would say then.
    pub allocated_after: Vec<u64>,
    /// Bytes reserved after each operation, as `torch.cuda.memory_reserved()` would say then.
    pub reserved_after: Vec<u64>,
    /// Allocations retried after releasing the whole cache, counted up to each operation (`num_alloc_retries`).
    pub retries_after: Vec<u64>,
}

/// Serves `ops` through a model of the allocator with `config`, failing
/// allocations that `capacity` cannot hold (after the flush and retry the
/// real allocator makes); a failed allocation is recorded as an `oom`
/// entry and its later free is ignored, so the rest still runs.
pub fn realize(ops: &[Op], config: AllocatorConfig, capacity: Option<u64>) -> Realized {
    let mut server = Server::new(config, capacity);
    for &op in ops {
        server.push(op);
    }
    server.finish()
}

/// Why the allocator refused an allocation: the figures PyTorch's
/// out-of-memory message gives, after the cache was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The segment it needed (`Tried to allocate`).
    pub alloc_size: u64,
    /// Reserved by the allocator when it gave up.
    pub reserved: u64,
    /// Handed out to tensors then.
    pub allocated: u64,
}

/// Operations served one at a time, as a running program makes them: what
/// [`realize`] does for a whole list, kept open so that a program run
/// without a GPU can ask after each allocation whether the GPU had room.
pub struct Server {
    m: Allocator,
    capacity: Option<u64>,
    /// Each operation's bytes, for an allocation (the size its free reports).
    sizes: Vec<Option<u64>>,
    /// The block each allocation holds until it is freed.
    held: Vec<Option<BlockId>>,
    /// Whether the trace entries and per-operation figures are kept (a lean
    /// server, asked only whether allocations fit, keeps neither).
    keep: bool,
    out: Realized,
}

impl Server {
    /// A server that keeps everything [`realize`] returns.
    pub fn new(config: AllocatorConfig, capacity: Option<u64>) -> Server {
        let mut m = Allocator::new(config, capacity);
        m.addresses.fresh = FIRST_SEGMENT_ADDRESS;
        Server {
            m,
            capacity,
            sizes: Vec::new(),
            held: Vec::new(),
            keep: true,
            out: Realized::default(),
        }
    }

    /// A server that keeps no trace and no per-operation figures: only whether each allocation fits.
    pub fn lean(config: AllocatorConfig, capacity: Option<u64>) -> Server {
        Server {
            keep: false,
            ..Server::new(config, capacity)
        }
    }

    /// Operations served so far.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// Whether no operation was served yet.
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// Limits what the allocator may hold from the next operation on (a
    /// program that caps itself with `set_per_process_memory_fraction`).
    pub fn set_capacity(&mut self, capacity: Option<u64>) {
        self.capacity = capacity;
        self.m.capacity = capacity;
    }

    /// Serves the next operation; an allocation the capacity cannot hold is
    /// refused, with what the allocator saw then. A free of an operation
    /// that is not an allocation still held is ignored.
    pub fn push(&mut self, op: Op) -> Option<Refusal> {
        let i = self.sizes.len();
        let m = &mut self.m;
        m.entry = i;
        let before = m.events.len();
        let mut refused = None;
        // Segment entries come before the entry they served, as in PyTorch's trace.
        let mut tail = None;
        match op {
            Op::Alloc { size, stream } => match m.malloc(size, stream, 0) {
                Ok(id) => {
                    m.bm(id).key = i as u64;
                    self.held.push(Some(id));
                    tail = Some((Action::Alloc, m.b(id).addr, size, stream));
                }
                Err(f) => {
                    self.held.push(None);
                    refused = Some(Refusal {
                        alloc_size: f.alloc_size,
                        reserved: f.reserved,
                        allocated: m.totals.allocated,
                    });
                    tail = Some(self.oom(f.reserved, size, stream));
                }
            },
            Op::Refused { size, stream } => {
                // The program saw this allocation fail and went on: the GPU's allocator had
                // released its cache and retried before it gave up.
                self.held.push(None);
                m.release_cached_blocks();
                m.totals.alloc_retries += 1;
                let reserved = m.totals.reserved;
                tail = Some(self.oom(reserved, size, stream));
            }
            Op::Free { alloc } => {
                self.held.push(None);
                if let Some(id) = self.held.get_mut(alloc).and_then(Option::take) {
                    let (addr, stream) = (m.b(id).addr, m.b(id).stream);
                    let size = self.sizes[alloc].unwrap_or(0);
                    if self.keep {
                        self.out
                            .entries
                            .push(entry(Action::FreeRequested, addr, size, stream, i));
                    }
                    m.free_requested(id);
                    m.free_completed(id);
                    tail = Some((Action::FreeCompleted, addr, size, stream));
                }
            }
            Op::EmptyCache => {
                self.held.push(None);
                m.empty_cache();
            }
        }
        self.sizes.push(match op {
            Op::Alloc { size, .. } => Some(size),
            _ => None,
        });
        let m = &mut self.m;
        if self.keep {
            for e in &m.events[before..] {
                let action = match e.op {
                    SegmentOp::Alloc => Action::SegmentAlloc,
                    SegmentOp::Free => Action::SegmentFree,
                    SegmentOp::Map => Action::SegmentMap,
                    SegmentOp::Unmap => Action::SegmentUnmap,
                };
                self.out
                    .entries
                    .push(entry(action, e.addr, e.size, e.stream, i));
            }
            if let Some((action, addr, size, stream)) = tail {
                self.out.entries.push(entry(action, addr, size, stream, i));
            }
            self.out.allocated_after.push(m.totals.allocated);
            self.out.reserved_after.push(m.totals.reserved);
            self.out.retries_after.push(m.totals.alloc_retries);
        } else {
            // Only the trace reads the segment events; a lean server would keep them all.
            m.events.clear();
        }
        refused
    }

    /// Records an allocation that failed at operation `len()`; returns its `oom` entry's
    /// fields (the address is the driver's free memory).
    fn oom(&mut self, reserved: u64, size: u64, stream: u16) -> (Action, u64, u64, u16) {
        self.out.ooms.push(self.sizes.len());
        let free = self.capacity.unwrap_or(0).saturating_sub(reserved);
        (Action::Oom, free, size, stream)
    }

    /// The peaks, the state at the end and, where kept, the trace.
    pub fn finish(mut self) -> Realized {
        let m = &mut self.m;
        m.settle_peak();
        let mut out = self.out;
        out.peak_reserved = m.totals.peak_reserved;
        out.peak_allocated = m.totals.peak_allocated;
        out.peak_op = m.totals.peak_entry;
        out.free_at_peak = m.totals.free_at_peak;
        out.segments = end_segments(m, &self.held, &self.sizes);
        out
    }
}

fn entry(action: Action, addr: u64, size: u64, stream: u16, op: usize) -> Entry {
    Entry {
        action,
        addr,
        size,
        stream,
        op,
    }
}

/// The segments held at the end with their blocks: every live block is
/// handed out (in `held`) or cached, mapped or not, in its pool.
fn end_segments(m: &Allocator, held: &[Option<BlockId>], sizes: &[Option<u64>]) -> Vec<EndSegment> {
    let mut by_segment: BTreeMap<u32, Vec<(BlockId, Option<usize>)>> = BTreeMap::new();
    for (i, id) in held.iter().enumerate() {
        if let Some(id) = *id {
            by_segment
                .entry(m.b(id).segment)
                .or_default()
                .push((id, Some(i)));
        }
    }
    for p in &m.pools {
        for k in p.blocks.iter() {
            by_segment
                .entry(m.b(k.3).segment)
                .or_default()
                .push((k.3, None));
        }
        for &(_, _, id) in &p.unmapped {
            by_segment
                .entry(m.b(id).segment)
                .or_default()
                .push((id, None));
        }
    }
    let mut out = Vec::new();
    for (_, mut blocks) in by_segment {
        blocks.sort_by_key(|(id, _)| m.b(*id).addr);
        let first = m.b(blocks[0].0);
        let expandable = m.segment_of(blocks[0].0).page > 0;
        let (stream, kind) = (first.stream, m.kind(first.pool));
        // An expandable segment shows as one segment per mapped range.
        let mut current: Option<EndSegment> = None;
        for (id, op) in blocks {
            let b = m.b(id);
            if !b.mapped {
                out.extend(current.take());
                continue;
            }
            let requested = op.and_then(|i| sizes[i]).unwrap_or(0);
            let block = EndBlock {
                addr: b.addr,
                size: b.size,
                requested,
                allocated: b.state != State::Free,
                op,
            };
            let seg = current.get_or_insert_with(|| EndSegment {
                addr: b.addr,
                size: 0,
                stream,
                kind,
                expandable,
                blocks: Vec::new(),
            });
            seg.size += b.size;
            seg.blocks.push(block);
        }
        out.extend(current);
    }
    out.sort_by_key(|s| s.addr);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn conf(text: &str) -> AllocatorConfig {
        let mut c = AllocatorConfig::default();
        c.apply(text).unwrap();
        c
    }

    fn actions(r: &Realized) -> Vec<Action> {
        r.entries.iter().map(|e| e.action).collect()
    }

    #[test]
    fn the_counters_after_each_operation_are_what_memory_allocated_and_reserved_say() {
        let alloc = |size| Op::Alloc { size, stream: 0 };
        // 4 MiB and 1000 bytes, the 4 MiB freed, the cache emptied.
        let ops = [
            alloc(4 * MIB),
            alloc(1000),
            Op::Free { alloc: 0 },
            Op::EmptyCache,
        ];
        let r = realize(&ops, AllocatorConfig::default(), None);
        // A request of 1-10 MiB gets a 20 MiB segment; 1000 bytes round to
        // 1024 in a 2 MiB segment of the small pool.
        assert_eq!(r.allocated_after, [4 * MIB, 4 * MIB + 1024, 1024, 1024]);
        assert_eq!(r.reserved_after, [20 * MIB, 22 * MIB, 22 * MIB, 2 * MIB]);
        assert_eq!(r.allocated_after.iter().max(), Some(&r.peak_allocated));
        assert_eq!(r.reserved_after.iter().max(), Some(&r.peak_reserved));
        let held: u64 = r.segments.iter().map(|s| s.size).sum();
        assert_eq!(r.reserved_after.last(), Some(&held));
        assert_eq!(r.retries_after, [0, 0, 0, 0]);
    }

    #[test]
    fn a_lean_server_refuses_where_the_whole_list_fails_and_says_what_it_saw() {
        let alloc = |size| Op::Alloc { size, stream: 0 };
        // Within 60 MiB: 24 MiB and 24 MiB fit; a third 24 MiB does not.
        let ops = [alloc(24 * MIB), alloc(24 * MIB), alloc(24 * MIB)];
        let whole = realize(&ops, AllocatorConfig::default(), Some(60 * MIB));
        assert_eq!(whole.ooms, [2]);
        let mut lean = Server::lean(AllocatorConfig::default(), Some(60 * MIB));
        let said: Vec<_> = ops.iter().map(|&op| lean.push(op)).collect();
        assert_eq!(
            said,
            [
                None,
                None,
                Some(Refusal {
                    alloc_size: 24 * MIB,
                    reserved: 48 * MIB,
                    allocated: 48 * MIB,
                })
            ]
        );
        assert_eq!(lean.len(), 3);
        // A lean server keeps no trace; its peaks are those of the whole list.
        let r = lean.finish();
        assert!(r.entries.is_empty() && r.allocated_after.is_empty());
        assert_eq!(r.peak_reserved, whole.peak_reserved);
        // Capped lower from the next operation on, the same list fails sooner.
        let mut capped = Server::lean(AllocatorConfig::default(), Some(60 * MIB));
        assert_eq!(capped.push(ops[0]), None);
        capped.set_capacity(Some(30 * MIB));
        assert!(capped.push(ops[1]).is_some());
    }

    #[test]
    fn a_refused_allocation_holds_nothing_and_releases_the_cache_as_the_gpu_did() {
        let alloc = |size| Op::Alloc { size, stream: 0 };
        // 24 MiB freed (cached), then 50 MiB refused at the capacity the
        // program ran against, then 10 MiB: the program went on.
        let ops = [
            alloc(24 * MIB),
            Op::Free { alloc: 0 },
            Op::Refused {
                size: 50 * MIB,
                stream: 0,
            },
            alloc(10 * MIB),
        ];
        for capacity in [None, Some(60 * MIB)] {
            let r = realize(&ops, AllocatorConfig::default(), capacity);
            // The cached segment went back before the failure; nothing was held for it.
            assert_eq!(r.reserved_after, [24 * MIB, 24 * MIB, 0, 10 * MIB]);
            assert_eq!(r.allocated_after, [24 * MIB, 0, 0, 10 * MIB]);
            assert_eq!(r.retries_after, [0, 0, 1, 1]);
            assert_eq!(r.ooms, [2]);
            use Action::*;
            assert_eq!(
                actions(&r),
                [
                    SegmentAlloc,
                    Alloc,
                    FreeRequested,
                    FreeCompleted,
                    SegmentFree,
                    Oom,
                    SegmentAlloc,
                    Alloc
                ]
            );
            // The `oom` entry's address is what the driver had free.
            let oom = r.entries.iter().find(|e| e.action == Oom).unwrap();
            assert_eq!(oom.addr, capacity.unwrap_or(0));
            assert_eq!(r.peak_allocated, 24 * MIB);
        }
    }

    #[test]
    fn a_retry_after_releasing_the_cache_is_counted_as_num_alloc_retries() {
        // Within 30 MiB: the cached 20 MiB segment of the freed 4 MiB cannot
        // serve 25 MiB, and both do not fit, so the cache is released and the
        // allocation retried (PyTorch's `isRetry`), and then it fits.
        let ops = [
            Op::Alloc {
                size: 4 * MIB,
                stream: 0,
            },
            Op::Free { alloc: 0 },
            Op::Alloc {
                size: 25 * MIB,
                stream: 0,
            },
        ];
        let r = realize(&ops, AllocatorConfig::default(), Some(30 * MIB));
        assert!(r.ooms.is_empty());
        assert_eq!(r.retries_after, [0, 0, 1]);
        assert_eq!(r.reserved_after, [20 * MIB, 20 * MIB, 26 * MIB]);
    }

    #[test]
    fn allocations_get_segments_addresses_and_an_end_state() {
        let ops = [
            Op::Alloc {
                size: 6 * MIB,
                stream: 0,
            },
            Op::Alloc {
                size: 1000,
                stream: 0,
            },
            Op::Alloc {
                size: 6 * MIB,
                stream: 0,
            },
            Op::Free { alloc: 0 },
        ];
        let r = realize(&ops, AllocatorConfig::default(), None);
        use Action::*;
        assert_eq!(
            actions(&r),
            [
                SegmentAlloc,
                Alloc,
                SegmentAlloc,
                Alloc,
                Alloc,
                FreeRequested,
                FreeCompleted
            ]
        );
        // One 20 MiB large segment for both 6 MiB tensors, one 2 MiB small one.
        assert_eq!(r.entries[0].size, 20 * MIB);
        assert_eq!(r.entries[0].addr, FIRST_SEGMENT_ADDRESS);
        assert_eq!(r.entries[1].addr, FIRST_SEGMENT_ADDRESS);
        assert_eq!(r.entries[4].addr, FIRST_SEGMENT_ADDRESS + 6 * MIB);
        // The request, not the rounded block, as PyTorch's trace records it.
        assert_eq!(r.entries[3].size, 1000);
        assert_eq!(r.peak_reserved, 22 * MIB);
        assert_eq!(r.peak_allocated, 12 * MIB + 1024);
        assert_eq!(r.segments.len(), 2);
        let large = &r.segments[0];
        assert_eq!(large.size, 20 * MIB);
        let states: Vec<(bool, u64)> = large.blocks.iter().map(|b| (b.allocated, b.size)).collect();
        assert_eq!(
            states,
            [(false, 6 * MIB), (true, 6 * MIB), (false, 8 * MIB)]
        );
        assert_eq!(large.blocks[1].op, Some(2));
        assert_eq!(large.blocks[1].requested, 6 * MIB);
        assert_eq!(r.segments[1].kind, PoolKind::Small);
    }

    #[test]
    fn a_capacity_too_small_records_the_oom_and_goes_on() {
        let ops = [
            Op::Alloc {
                size: 30 * MIB,
                stream: 0,
            },
            Op::Alloc {
                size: 30 * MIB,
                stream: 0,
            },
            Op::Free { alloc: 1 },
            Op::Free { alloc: 0 },
            Op::Alloc {
                size: 8 * MIB,
                stream: 0,
            },
        ];
        let r = realize(&ops, AllocatorConfig::default(), Some(40 * MIB));
        assert_eq!(r.ooms, [1]);
        let oom = r.entries.iter().find(|e| e.action == Action::Oom).unwrap();
        assert_eq!(oom.addr, 10 * MIB);
        // The free of the failed allocation is ignored; the rest runs.
        assert_eq!(r.entries.last().unwrap().action, Action::Alloc);
        assert!(r.peak_reserved <= 40 * MIB);
    }

    #[test]
    fn empty_cache_gives_segments_back_and_expandable_segments_map_pages() {
        let ops = [
            Op::Alloc {
                size: 30 * MIB,
                stream: 0,
            },
            Op::Free { alloc: 0 },
            Op::EmptyCache,
        ];
        let r = realize(&ops, AllocatorConfig::default(), None);
        assert_eq!(r.entries.last().unwrap().action, Action::SegmentFree);
        assert!(r.segments.is_empty());
        let r = realize(&ops[..1], conf("expandable_segments:True"), None);
        assert_eq!(r.entries[0].action, Action::SegmentMap);
        assert_eq!(r.segments.len(), 1);
        assert!(r.segments[0].expandable);
        assert_eq!(r.segments[0].size, r.peak_reserved);
    }
}
