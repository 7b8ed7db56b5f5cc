//! A pool's cached blocks in the order `BlockComparatorSize` keeps them: by
//! stream, then size, then address. Each key is packed into one `u128`,
//! which the B-tree compares in two instructions instead of a tuple's four.

use std::collections::BTreeMap;

/// A block as this set knows it: its index in the model's arena
/// (`model::BlockId`), which the set stores and hands back untouched.
type BlockId = u32;

/// A cached block as the set orders it: stream, size, address, and the block.
pub(crate) type FreeKey = (u16, u64, u64, BlockId);

/// Sizes are kept in 48 bits (256 TiB), far above any device.
const SIZE_BITS: u32 = 48;
const SIZE_MAX: u64 = (1 << SIZE_BITS) - 1;

fn pack(stream: u16, size: u64, addr: u64) -> u128 {
    ((stream as u128) << (64 + SIZE_BITS)) | ((size.min(SIZE_MAX) as u128) << 64) | addr as u128
}

fn unpack(k: u128, id: BlockId) -> FreeKey {
    (
        (k >> (64 + SIZE_BITS)) as u16,
        ((k >> 64) as u64) & SIZE_MAX,
        k as u64,
        id,
    )
}

/// The cached blocks of one pool.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreeSet {
    map: BTreeMap<u128, BlockId>,
    /// Whether a block was put in since [`FreeSet::take_inserted`] last asked.
    inserted: bool,
}

impl FreeSet {
    pub(crate) fn insert(&mut self, stream: u16, size: u64, addr: u64, id: BlockId) {
        self.map.insert(pack(stream, size, addr), id);
        self.inserted = true;
    }

    /// Whether a block was put in since the last call, which forgets it. A block's
    /// neighbours and mapping change only while it is out of the set (split, merged,
    /// mapped), so a pool with none put in since the allocator last released its cache
    /// holds no block that a release would take.
    pub(crate) fn take_inserted(&mut self) -> bool {
        std::mem::replace(&mut self.inserted, false)
    }

    /// The size of the largest block, of any stream: the last of each stream's run of keys.
    pub(crate) fn largest_size(&self) -> u64 {
        use std::ops::Bound::{Included, Unbounded};
        let mut largest = 0;
        let mut from = Unbounded;
        while let Some((&first, _)) = self.map.range((from, Unbounded)).next() {
            let stream = (first >> (64 + SIZE_BITS)) as u16;
            // The first key of the next stream; none after the last stream there can be.
            let end = stream
                .checked_add(1)
                .map(|next| (next as u128) << (64 + SIZE_BITS));
            let last = match end {
                Some(end) => self.map.range(first..end).next_back(),
                None => self.map.range(first..).next_back(),
            };
            if let Some((&k, &id)) = last {
                largest = largest.max(unpack(k, id).1);
            }
            match end {
                Some(end) => from = Included(end),
                None => break,
            }
        }
        largest
    }

    pub(crate) fn remove(&mut self, stream: u16, size: u64, addr: u64) -> bool {
        self.map.remove(&pack(stream, size, addr)).is_some()
    }

    /// The blocks from the smallest of the stream with at least `size` bytes, in order.
    pub(crate) fn from(&self, stream: u16, size: u64) -> impl Iterator<Item = FreeKey> + '_ {
        self.map
            .range(pack(stream, size, 0)..)
            .map(|(&k, &id)| unpack(k, id))
    }

    /// The blocks before the smallest of the stream with at least `size` bytes, largest first.
    pub(crate) fn below(&self, stream: u16, size: u64) -> impl Iterator<Item = FreeKey> + '_ {
        self.map
            .range(..pack(stream, size, 0))
            .rev()
            .map(|(&k, &id)| unpack(k, id))
    }

    /// Every block, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = FreeKey> + '_ {
        self.map.iter().map(|(&k, &id)| unpack(k, id))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_block_is_the_largest_of_every_streams_last() {
        let mut s = FreeSet::default();
        assert_eq!(s.largest_size(), 0);
        assert!(!s.take_inserted());
        s.insert(0, 10, 1, 0);
        s.insert(0, 30, 2, 1);
        s.insert(3, 20, 3, 2);
        s.insert(u16::MAX, 25, 4, 3);
        assert!(s.take_inserted() && !s.take_inserted());
        let naive = s.iter().map(|k| k.1).max().unwrap();
        assert_eq!((s.largest_size(), naive), (30, 30));
        s.remove(0, 30, 2);
        assert_eq!(s.largest_size(), 25);
        assert!(!s.take_inserted(), "taking a block out is no insertion");
        s.remove(u16::MAX, 25, 4);
        assert_eq!(s.largest_size(), 20);
    }

    #[test]
    fn keys_order_by_stream_then_size_then_address() {
        let mut s = FreeSet::default();
        s.insert(1, 10, 5, 0);
        s.insert(0, 20, 1, 1);
        s.insert(0, 10, 9, 2);
        s.insert(0, 10, 3, 3);
        let ids: Vec<BlockId> = s.iter().map(|k| k.3).collect();
        assert_eq!(ids, [3, 2, 1, 0]);
        assert_eq!(s.from(0, 11).next(), Some((0, 20, 1, 1)));
        assert_eq!(s.from(0, 21).next(), Some((1, 10, 5, 0)));
        assert_eq!(s.below(0, 20).next(), Some((0, 10, 9, 2)));
        assert!(s.remove(0, 10, 9));
        assert!(!s.remove(0, 10, 9));
        assert_eq!(s.len(), 3);
        let big = (1 << 47) + 512;
        s.insert(7, big, u64::MAX, 9);
        assert_eq!(s.iter().last(), Some((7, big, u64::MAX, 9)));
        assert_eq!(s.largest_size(), big);
    }
}
