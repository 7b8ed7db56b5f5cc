//! Laying the start state into the model: each segment held when the
//! trace began, its live blocks, and the free gaps between them (for an
//! expandable segment, the unmapped space around its mapped ranges too).

use crate::model::{Allocator, Block, BlockId, Segment, State};
use crate::start::{Start, StartBlock, StartSegment};
use oomkit_snapshot::FastState;
use std::collections::HashMap;

/// Expandable ranges share a segment when they share these: stream, private pool, pool kind.
type GroupKey = (u16, u8, crate::rules::PoolKind);
/// A mapped range of an expandable segment with the live blocks inside it.
type Range<'a> = (&'a StartSegment, Vec<&'a StartBlock>);

/// A piece of a segment, in address order.
enum Piece<'a> {
    Unmapped(u64, u64),
    Free(u64, u64),
    Live(&'a StartBlock),
}

/// Lays the start state into an empty model, registering each live block under its address.
pub(crate) fn lay_out(
    m: &mut Allocator,
    start: &Start,
    live: &mut HashMap<u64, BlockId, FastState>,
) {
    let mut blocks = start.blocks.iter().peekable();
    let mut expandable: Vec<&StartSegment> = Vec::new();
    let mut mapped: Vec<(&StartSegment, Vec<&StartBlock>)> = Vec::new();
    for s in &start.segments {
        // Blocks before this segment lie in none; start_state dropped those.
        while blocks.next_if(|b| b.addr < s.addr).is_some() {}
        let mut inside = Vec::new();
        while let Some(b) = blocks.next_if(|b| b.addr < s.addr + s.size) {
            inside.push(b);
        }
        if s.expandable {
            expandable.push(s);
            mapped.push((s, inside));
        } else {
            let pool = m.pool_index(s.private, s.kind);
            let pieces = pieces(s.addr, s.size, &inside);
            let seg = m.add_segment(Segment {
                addr: s.addr,
                size: s.size,
                page: 0,
            });
            m.reserve(s.size);
            chain(m, seg, pool, s.stream, &pieces, live);
        }
    }
    // The mapped ranges of expandable segments, one segment per stream and pool.
    let mut groups: Vec<(GroupKey, Vec<Range<'_>>)> = Vec::new();
    for (s, inside) in mapped {
        let key = (s.stream, s.private, s.kind);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push((s, inside)),
            None => groups.push((key, vec![(s, inside)])),
        }
    }
    for ((stream, private, kind), ranges) in groups {
        let pool = m.pool_index(private, kind);
        let page = kind.page();
        let base = ranges[0].0.addr;
        let last = ranges.last().map_or(base, |(s, _)| s.addr + s.size);
        let size = m
            .expandable_reservation(page)
            .max((last - base).div_ceil(page) * page);
        let mut all = Vec::new();
        let mut at = base;
        for (s, inside) in &ranges {
            if s.addr > at {
                all.push(Piece::Unmapped(at, s.addr - at));
            }
            all.extend(pieces(s.addr, s.size, inside));
            m.reserve(s.size);
            at = s.addr + s.size;
        }
        if base + size > at {
            all.push(Piece::Unmapped(at, base + size - at));
        }
        let seg = m.add_segment(Segment {
            addr: base,
            size,
            page,
        });
        chain(m, seg, pool, stream, &all, live);
    }
}

/// The live blocks of a range with the free gaps between them.
fn pieces<'a>(addr: u64, size: u64, inside: &[&'a StartBlock]) -> Vec<Piece<'a>> {
    let mut out = Vec::new();
    let mut at = addr;
    for b in inside {
        if b.addr > at {
            out.push(Piece::Free(at, b.addr - at));
        }
        out.push(Piece::Live(b));
        at = b.addr + b.size;
    }
    let end = addr + size;
    if end > at {
        out.push(Piece::Free(at, end - at));
    }
    out
}

/// Makes the blocks of a segment from its pieces, linked in order.
fn chain(
    m: &mut Allocator,
    segment: u32,
    pool: u16,
    stream: u16,
    pieces: &[Piece<'_>],
    live: &mut HashMap<u64, BlockId, FastState>,
) {
    let mut prev: Option<BlockId> = None;
    for p in pieces {
        let (addr, size, state, mapped) = match p {
            Piece::Unmapped(a, s) => (*a, *s, State::Free, false),
            Piece::Free(a, s) => (*a, *s, State::Free, true),
            Piece::Live(b) => (
                b.addr,
                b.size,
                if b.pending {
                    State::Pending
                } else {
                    State::Allocated
                },
                true,
            ),
        };
        let id = m.new_block(Block {
            addr,
            size,
            stream,
            pool,
            state,
            mapped,
            prev,
            next: None,
            segment,
            gc_base: 0,
            key: addr,
        });
        if let Some(p) = prev {
            m.bm(p).next = Some(id);
        }
        prev = Some(id);
        match p {
            Piece::Unmapped(..) => {
                m.pools[pool as usize].unmapped.insert((stream, addr, id));
            }
            Piece::Free(..) => m.insert_free(id),
            Piece::Live(b) => {
                m.totals.active += size;
                if b.pending {
                    m.pending.push(id);
                } else {
                    m.totals.allocated += size;
                }
                live.insert(b.addr, id);
            }
        }
    }
}
