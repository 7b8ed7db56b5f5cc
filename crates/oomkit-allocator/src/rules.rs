//! The allocator's size rules, named after the constants of
//! `c10/cuda/CUDACachingAllocator.cpp` and `c10/core/AllocatorConfig.cpp`.

/// Every block is rounded up to a multiple of this (`kMinBlockSize`, 512 B).
pub const K_MIN_BLOCK_SIZE: u64 = 512;
/// The largest request the small pool serves (`kSmallSize`, 1 MiB).
pub const K_SMALL_SIZE: u64 = 1 << 20;
/// The segment size of the small pool (`kSmallBuffer`, 2 MiB).
pub const K_SMALL_BUFFER: u64 = 2 << 20;
/// The segment size for large requests under [`K_MIN_LARGE_ALLOC`] (`kLargeBuffer`, 20 MiB).
pub const K_LARGE_BUFFER: u64 = 20 << 20;
/// Requests from this size get a segment of their own size (`kMinLargeAlloc`, 10 MiB).
pub const K_MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Segments for large requests are rounded up to a multiple of this (`kRoundLarge`, 2 MiB).
pub const K_ROUND_LARGE: u64 = 2 << 20;
/// How many size classes `roundup_power2_divisions` sets, from 1 MiB to 64 GiB (`kRoundUpPowerOfTwoIntervals`).
pub const ROUNDUP_INTERVALS: usize = 16;
/// The first size class of `roundup_power2_divisions` is sizes under 2 MiB: log2 of 1 MiB.
const ROUNDUP_FIRST_LOG2: u32 = 20;

/// Which of the allocator's two block pools a request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Requests of up to 1 MiB, packed in 2 MiB segments.
    Small,
    /// Larger requests.
    Large,
}

impl PoolKind {
    /// The pool a rounded request size goes to (`get_pool`).
    pub fn of(rounded: u64) -> PoolKind {
        if rounded <= K_SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// The pool's name as snapshots write it (`segment_type`).
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }

    /// The page size of the pool's expandable segments: 2 MiB small, 20 MiB large.
    pub fn page(self) -> u64 {
        match self {
            PoolKind::Small => K_SMALL_BUFFER,
            PoolKind::Large => K_LARGE_BUFFER,
        }
    }
}

/// The size a request is served with (`round_size`): at least 512 B, a
/// multiple of 512 B, or the next power-of-two division where
/// `roundup_power2_divisions` sets `divisions` above 1 for its size class
/// (`AllocatorConfig::round` looks them up).
pub fn round_size(size: u64, divisions: u64) -> u64 {
    if size < K_MIN_BLOCK_SIZE {
        return K_MIN_BLOCK_SIZE;
    }
    if divisions > 1 && size > K_MIN_BLOCK_SIZE * divisions {
        next_power2_division(size, divisions)
    } else {
        size.div_ceil(K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
    }
}

/// The size class of `roundup_power2_divisions` a size falls in: 0 for
/// sizes under 2 MiB, then one per power of two, 15 for 32 GiB and more.
pub fn division_class(size: u64) -> usize {
    let log2 = 63 - size.max(1).leading_zeros();
    (log2.saturating_sub(ROUNDUP_FIRST_LOG2) as usize).min(ROUNDUP_INTERVALS - 1)
}

/// Rounds up to the next of `divisions` equal steps between the powers of
/// two around `size` (`roundup_power2_next_division`): 1200 with 4
/// divisions is 1280, the second of 1024, 1280, 1536, 1792.
pub fn next_power2_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    // Divisions are powers of two (the parser insists); a step is the floor
    // shifted right by log2 of them.
    let step = floor >> (63 - divisions.max(1).leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let below = size & !(step - 1);
    if below == size {
        size
    } else {
        below + step
    }
}

/// The segment a request that finds no cached block asks the driver for
/// (`get_allocation_size`): 2 MiB for the small pool, 20 MiB under 10 MiB,
/// else the request rounded up to 2 MiB.
pub fn allocation_size(rounded: u64) -> u64 {
    if rounded <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if rounded < K_MIN_LARGE_ALLOC {
        K_LARGE_BUFFER
    } else {
        rounded.div_ceil(K_ROUND_LARGE) * K_ROUND_LARGE
    }
}

/// Whether a free block given to a request is split, the rest staying
/// cached (`should_split`): in the small pool or with expandable segments
/// when at least 512 B remain; in the large pool when the request is under
/// `max_split_size` and more than 1 MiB remains.
pub fn should_split(
    pool: PoolKind,
    block: u64,
    size: u64,
    expandable_segments: bool,
    max_split_size: u64,
) -> bool {
    let remaining = block - size;
    if pool == PoolKind::Small || expandable_segments {
        remaining >= K_MIN_BLOCK_SIZE
    } else {
        size < max_split_size && remaining > K_SMALL_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No `roundup_power2_divisions` (PyTorch's default) and no `max_split_size_mb`.
    const NO_DIVISIONS: u64 = 0;
    const NO_MAX_SPLIT: u64 = u64::MAX;

    #[test]
    fn sizes_round_as_the_source_says() {
        assert_eq!(round_size(1, NO_DIVISIONS), 512);
        assert_eq!(round_size(512, NO_DIVISIONS), 512);
        assert_eq!(round_size(513, NO_DIVISIONS), 1024);
        assert_eq!(round_size(196_608, NO_DIVISIONS), 196_608);
        // The source's own example: 1200 with 4 divisions is 1280.
        assert_eq!(next_power2_division(1200, 4), 1280);
        assert_eq!(next_power2_division(1024, 4), 1024);
        assert_eq!(next_power2_division(1536, 4), 1536);
        // Only above 512 B times the divisions does the power-of-two rule
        // apply; below, sizes round to 512 B as ever.
        assert_eq!(round_size(1200, 4), 1536);
        assert_eq!(round_size(2049 << 10, 4), 2560 << 10);
        assert_eq!(round_size(2049 << 10, 0), 2049 << 10);
        assert_eq!(round_size(5 << 20 | 1, 4), 6 << 20);
    }

    #[test]
    fn classes_cover_one_mebibyte_to_thirty_two_gibibytes() {
        assert_eq!(division_class(1), 0);
        assert_eq!(division_class((2 << 20) - 1), 0);
        assert_eq!(division_class(2 << 20), 1);
        assert_eq!(division_class(1 << 30), 10);
        assert_eq!(division_class(32 << 30), 15);
        assert_eq!(division_class(u64::MAX), 15);
    }

    #[test]
    fn segments_are_sized_by_pool() {
        assert_eq!(allocation_size(512), K_SMALL_BUFFER);
        assert_eq!(allocation_size(K_SMALL_SIZE), K_SMALL_BUFFER);
        assert_eq!(allocation_size(K_SMALL_SIZE + 512), K_LARGE_BUFFER);
        assert_eq!(allocation_size(K_MIN_LARGE_ALLOC - 512), K_LARGE_BUFFER);
        assert_eq!(allocation_size(K_MIN_LARGE_ALLOC), K_MIN_LARGE_ALLOC);
        assert_eq!(allocation_size(K_MIN_LARGE_ALLOC + 1), 12 << 20);
    }

    #[test]
    fn splitting_follows_the_pool() {
        let split = |pool, block, size| should_split(pool, block, size, false, NO_MAX_SPLIT);
        assert!(split(PoolKind::Small, 2 << 20, 1024));
        assert!(!split(PoolKind::Small, 1024, 768));
        assert!(split(PoolKind::Large, 20 << 20, 4 << 20));
        // Exactly 1 MiB left over stays with the block in the large pool.
        assert!(!split(PoolKind::Large, 5 << 20, 4 << 20));
        // max_split_size_mb:128: a larger request never splits a block.
        assert!(!should_split(
            PoolKind::Large,
            300 << 20,
            200 << 20,
            false,
            128 << 20
        ));
        // Expandable segments split whatever remains.
        assert!(should_split(
            PoolKind::Large,
            5 << 20,
            4 << 20,
            true,
            NO_MAX_SPLIT
        ));
    }
}
