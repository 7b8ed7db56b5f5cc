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
    // Runs of expandable ranges next to each other in address order, of
    // one stream and pool: each run is one expandable segment (a segment
    // between them would sit inside its address space, which cannot be).
    let mut groups: Vec<(GroupKey, Vec<Range<'_>>)> = Vec::new();
    let mut open_group = false;
    for s in &start.segments {
        // Blocks before this segment lie in none; start_state dropped those.
        while blocks.next_if(|b| b.addr < s.addr).is_some() {}
        let mut inside = Vec::new();
        while let Some(b) = blocks.next_if(|b| b.addr < s.addr + s.size) {
            inside.push(b);
        }
        if s.expandable {
            let key = (s.stream, s.private, s.kind);
            match groups.last_mut() {
                Some((k, v)) if open_group && *k == key => v.push((s, inside)),
                _ => groups.push((key, vec![(s, inside)])),
            }
            open_group = true;
        } else {
            open_group = false;
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
    let starts: Vec<u64> = start.segments.iter().map(|s| s.addr).collect();
    for ((stream, private, kind), ranges) in groups {
        let pool = m.pool_index(private, kind);
        let page = kind.page();
        let base = ranges[0].0.addr;
        let last = ranges.last().map_or(base, |(s, _)| s.addr + s.size);
        // The address space stops short of the next segment held, where
        // ranges of other streams or pools (or a plain segment) follow.
        let next = starts
            .iter()
            .copied()
            .filter(|&a| a >= last)
            .find(|a| !ranges.iter().any(|(s, _)| s.addr == *a))
            .unwrap_or(u64::MAX);
        let extent = (last - base).div_ceil(page) * page;
        let room = next.saturating_sub(base) / page * page;
        let size = m.expandable_reservation(page).min(room).max(extent);
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
