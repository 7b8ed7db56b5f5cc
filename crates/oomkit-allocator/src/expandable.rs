//! Expandable segments (`expandable_segments:True`): one address range per
//! stream and pool, reserved up front, with pages mapped in as memory is
//! needed and unmapped when the cache is emptied, as `ExpandableSegment`,
//! `map_block` and `unmap_block` do in `CUDACachingAllocator.cpp`.

use crate::model::{Allocator, Block, BlockId, Segment, SegmentOp, State};

/// The device memory an expandable segment's address space is sized for
/// when no capacity is given (the source reserves 1 1/8 of the device).
pub(crate) const UNKNOWN_DEVICE_BYTES: u64 = 1 << 40;

impl Allocator {
    /// The address space of a new expandable segment: pages for 1 1/8 of the device.
    pub(crate) fn expandable_reservation(&self, page: u64) -> u64 {
        let device = self.capacity.unwrap_or(UNKNOWN_DEVICE_BYTES);
        let want = device.saturating_add(device / 8);
        want.div_ceil(page).saturating_mul(page)
    }

    /// Makes an empty expandable segment of the pool on the stream,
    /// returning its one unmapped block.
    pub(crate) fn new_expandable_segment(
        &mut self,
        pool: u16,
        stream: u16,
        addr: Option<u64>,
    ) -> BlockId {
        let page = self.kind(pool).page();
        let size = self.expandable_reservation(page);
        let addr = addr.unwrap_or_else(|| self.place(size));
        let seg = self.add_segment(Segment { addr, size, page });
        let id = self.new_block(Block {
            addr,
            size,
            stream,
            pool,
            state: State::Free,
            mapped: false,
            prev: None,
            next: None,
            segment: seg,
            gc_base: 0,
            key: 0,
        });
        self.pools[pool as usize]
            .unmapped
            .insert((stream, addr, id));
        id
    }

    /// `find_expandable_block`: the lowest address of the stream's
    /// expandable segments where free and unmapped space add up to `size`,
    /// else a new segment.
    fn find_expandable_block(&mut self, pool: u16, stream: u16, size: u64) -> BlockId {
        let candidates: Vec<BlockId> = self.pools[pool as usize]
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .map(|k| k.2)
            .collect();
        for c in candidates {
            // A free mapped block just before the unmapped space grows into it.
            let start = match self.b(c).prev {
                Some(p) if self.b(p).state == State::Free => p,
                _ => c,
            };
            if self.has_room(start, size) {
                return start;
            }
        }
        self.new_expandable_segment(pool, stream, None)
    }

    /// Whether free blocks from `from` onwards add up to `size`.
    fn has_room(&self, from: BlockId, size: u64) -> bool {
        let mut bytes = 0;
        let mut at = Some(from);
        while bytes < size {
            match at {
                Some(b) if self.b(b).state == State::Free => {
                    bytes += self.b(b).size;
                    at = self.b(b).next;
                }
                _ => break,
            }
        }
        bytes >= size
    }

    /// `map_block`: maps the pages covering the first `size` bytes of an
    /// unmapped block, if the device has them, and caches them merged with
    /// free neighbours.
    fn map_block(&mut self, id: BlockId, size: u64) -> bool {
        let (base, page) = {
            let s = self.segment_of(id);
            (s.addr, s.page)
        };
        let b = self.b(id).clone();
        let begin = (b.addr - base) / page;
        let end = (b.addr + size - base).div_ceil(page);
        let bytes = (end - begin) * page;
        if bytes == 0 || !self.fits(bytes) {
            return false;
        }
        self.pools[b.pool as usize]
            .unmapped
            .remove(&(b.stream, b.addr, id));
        self.bm(id).mapped = true;
        if bytes < b.size {
            let rest = self.new_block(Block {
                addr: b.addr + bytes,
                size: b.size - bytes,
                mapped: false,
                prev: Some(id),
                next: b.next,
                ..b.clone()
            });
            if let Some(n) = b.next {
                self.bm(n).prev = Some(rest);
            }
            self.bm(id).next = Some(rest);
            self.bm(id).size = bytes;
            self.pools[b.pool as usize]
                .unmapped
                .insert((b.stream, b.addr + bytes, rest));
        }
        if let Some(p) = self.b(id).prev {
            self.try_merge_blocks(id, p);
        }
        if let Some(n) = self.b(id).next {
            self.try_merge_blocks(id, n);
        }
        self.insert_free(id);
        self.reserve(bytes);
        self.record(SegmentOp::Map, b.addr, bytes, b.stream, b.pool);
        true
    }

    /// `try_allocate_expandable_block`: maps pages until a free block of the
    /// stream holds `size`, or the device runs out.
    pub(crate) fn try_allocate_expandable_block(
        &mut self,
        pool: u16,
        stream: u16,
        size: u64,
    ) -> Option<BlockId> {
        let mut c = self.find_expandable_block(pool, stream, size);
        if !self.b(c).mapped {
            let want = self.b(c).size.min(size);
            if !self.map_block(c, want) {
                return None;
            }
        }
        while self.b(c).size < size {
            let remaining = size - self.b(c).size;
            let next = self.b(c).next?;
            let want = self.b(next).size.min(remaining);
            if !self.map_block(next, want) {
                return None;
            }
            // Mapping merged the block before it into `next`.
            c = next;
        }
        self.remove_free(c);
        Some(c)
    }

    /// The first and last-plus-one pages of its segment that lie wholly inside the block, or
    /// None where none does (nothing of it can be unmapped).
    pub(crate) fn whole_pages(&self, id: BlockId) -> Option<(u64, u64)> {
        let s = self.segment_of(id);
        let b = self.b(id);
        let begin = (b.addr - s.addr).div_ceil(s.page);
        let end = (b.addr + b.size - s.addr) / s.page;
        (begin < end).then_some((begin, end))
    }

    /// `unmap_block`: gives the whole pages inside a free block back to the
    /// driver, keeping the partial pages at either end as free blocks.
    pub(crate) fn unmap_block(&mut self, id: BlockId) {
        let Some((begin, end)) = self.whole_pages(id) else {
            return;
        };
        let (base, page) = {
            let s = self.segment_of(id);
            (s.addr, s.page)
        };
        let b = self.b(id).clone();
        self.remove_free(id);
        let start = base + begin * page;
        let bytes = (end - begin) * page;
        let before = start - b.addr;
        if before > 0 {
            let f = self.new_block(Block {
                size: before,
                prev: b.prev,
                next: Some(id),
                ..b.clone()
            });
            if let Some(p) = b.prev {
                self.bm(p).next = Some(f);
            }
            self.bm(id).prev = Some(f);
            self.insert_free(f);
        }
        let after = b.size - before - bytes;
        if after > 0 {
            let next = self.b(id).next;
            let f = self.new_block(Block {
                addr: start + bytes,
                size: after,
                prev: Some(id),
                next,
                ..b.clone()
            });
            if let Some(n) = next {
                self.bm(n).prev = Some(f);
            }
            self.bm(id).next = Some(f);
            self.insert_free(f);
        }
        {
            let m = self.bm(id);
            m.addr = start;
            m.size = bytes;
            m.mapped = false;
        }
        if let Some(p) = self.b(id).prev {
            self.try_merge_blocks(id, p);
        }
        if let Some(n) = self.b(id).next {
            self.try_merge_blocks(id, n);
        }
        let u = self.b(id);
        let key = (u.stream, u.addr, id);
        self.pools[b.pool as usize].unmapped.insert(key);
        self.unreserve(bytes);
        self.record(SegmentOp::Unmap, start, bytes, b.stream, b.pool);
    }

    /// `release_expandable_segment`: drops a segment with nothing mapped.
    pub(crate) fn release_expandable_segment(&mut self, id: BlockId) {
        let b = self.b(id).clone();
        self.pools[b.pool as usize]
            .unmapped
            .remove(&(b.stream, b.addr, id));
        self.drop_segment_block(id, b.segment);
    }
}
