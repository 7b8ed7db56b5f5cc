//! The model's rules one at a time, each against what
//! `CUDACachingAllocator.cpp` does in the same case, and its invariants
//! over random traces.

use crate::config::AllocatorConfig;
use crate::model::{Allocator, BlockId, SegmentOp, State};
use crate::rules::PoolKind;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn model(conf: &str, capacity: Option<u64>) -> Allocator {
    let mut c = AllocatorConfig::default();
    c.apply(conf).unwrap();
    let mut m = Allocator::new(c, capacity);
    m.addresses.fresh = 1 << 40;
    m
}

fn alloc(m: &mut Allocator, bytes: u64) -> BlockId {
    m.malloc(bytes, 0, 0).expect("fits")
}

fn free(m: &mut Allocator, id: BlockId) {
    m.free_requested(id);
    m.free_completed(id);
}

fn ops(m: &Allocator, op: SegmentOp) -> Vec<u64> {
    m.events
        .iter()
        .filter(|e| e.op == op)
        .map(|e| e.size)
        .collect()
}

/// Every segment is tiled by its blocks, the totals add up, free blocks are
/// cached exactly once and free neighbours are merged.
fn check(m: &Allocator) {
    let mut reserved = 0;
    let mut active = 0;
    let mut allocated = 0;
    let mut seen = std::collections::HashSet::new();
    for pool in &m.pools {
        for k in pool.blocks.iter() {
            assert!(seen.insert(k.3), "block {} cached twice", k.3);
            let b = m.b(k.3);
            assert_eq!((b.stream, b.size, b.addr), (k.0, k.1, k.2), "stale key");
            assert_eq!(b.state, State::Free);
            assert!(b.mapped);
        }
    }
    for (sid, s) in m.segments.iter().enumerate() {
        let Some(s) = s else { continue };
        // The blocks of the segment, by walking from one that starts it.
        let head = m
            .blocks
            .iter()
            .enumerate()
            .find(|(i, b)| {
                b.segment == sid as u32
                    && b.prev.is_none()
                    && b.addr == s.addr
                    && !m.is_spare(*i as BlockId)
            })
            .map(|(i, _)| i as BlockId)
            .expect("a segment has a first block");
        let mut at = s.addr;
        let mut cur = Some(head);
        let mut last_free = false;
        while let Some(id) = cur {
            let b = m.b(id);
            assert_eq!(b.addr, at, "blocks tile the segment");
            let free = b.state == State::Free && b.mapped;
            assert!(!(free && last_free), "free neighbours are merged");
            last_free = free;
            if b.mapped {
                reserved += b.size;
            }
            match b.state {
                State::Allocated => {
                    active += b.size;
                    allocated += b.size;
                }
                State::Pending => active += b.size,
                State::Free => {}
            }
            at += b.size;
            if let Some(n) = b.next {
                assert_eq!(m.b(n).prev, Some(id));
            }
            cur = b.next;
        }
        assert_eq!(at, s.addr + s.size, "blocks cover the segment");
    }
    assert_eq!(m.totals.reserved, reserved);
    assert_eq!(m.totals.active, active);
    assert_eq!(m.totals.allocated, allocated);
}

#[test]
fn small_requests_share_two_mebibyte_segments() {
    let mut m = model("", None);
    let a = alloc(&mut m, 1000);
    let b = alloc(&mut m, 300_000);
    assert_eq!(ops(&m, SegmentOp::Alloc), [2 * MIB]);
    assert_eq!(m.b(a).size, 1024);
    assert_eq!(m.b(b).addr, m.b(a).addr + 1024);
    free(&mut m, a);
    free(&mut m, b);
    // Freed neighbours merge back into one cached 2 MiB block.
    assert_eq!(m.pools[1].blocks.len(), 1);
    check(&m);
}

#[test]
fn mid_sized_requests_split_twenty_mebibyte_segments() {
    let mut m = model("", None);
    let a = alloc(&mut m, 8 * MIB);
    let b = alloc(&mut m, 8 * MIB);
    // 4 MiB remain after two 8 MiB blocks: more than 1 MiB, so a third
    // 8 MiB request needs a new segment.
    assert_eq!(m.b(b).addr, m.b(a).addr + 8 * MIB);
    alloc(&mut m, 8 * MIB);
    assert_eq!(ops(&m, SegmentOp::Alloc), [20 * MIB, 20 * MIB]);
    // A 3.5 MiB request takes the 4 MiB remainder whole: 0.5 MiB is too little to split off.
    let c = alloc(&mut m, 3 * MIB + MIB / 2);
    assert_eq!(m.b(c).size, 4 * MIB);
    check(&m);
}

#[test]
fn large_requests_get_their_own_rounded_segment() {
    let mut m = model("", None);
    alloc(&mut m, 33 * MIB + 1);
    assert_eq!(ops(&m, SegmentOp::Alloc), [34 * MIB]);
    check(&m);
}

#[test]
fn streams_and_private_pools_are_kept_apart() {
    let mut m = model("", None);
    let a = alloc(&mut m, 30 * MIB);
    free(&mut m, a);
    // Another stream cannot take the cached block; nor can a CUDA graph's pool.
    let b = m.malloc(30 * MIB, 1, 0).unwrap();
    let c = m.malloc(30 * MIB, 0, 1).unwrap();
    assert_eq!(ops(&m, SegmentOp::Alloc).len(), 3);
    assert_ne!(m.b(b).addr, m.b(a).addr);
    assert_ne!(m.b(c).addr, m.b(a).addr);
    // The default pool, on its own stream, does.
    let d = alloc(&mut m, 30 * MIB);
    assert_eq!(ops(&m, SegmentOp::Alloc).len(), 3);
    assert_eq!(m.b(d).size, 30 * MIB);
    check(&m);
}

#[test]
fn a_pending_free_is_not_reused_until_it_completes() {
    let mut m = model("", None);
    let a = alloc(&mut m, 30 * MIB);
    m.free_requested(a);
    assert_eq!(m.totals.allocated, 0);
    assert_eq!(m.totals.active, 30 * MIB);
    let b = alloc(&mut m, 30 * MIB);
    assert_ne!(m.b(b).addr, m.b(a).addr);
    m.free_completed(a);
    let c = alloc(&mut m, 30 * MIB);
    assert_eq!(ops(&m, SegmentOp::Alloc).len(), 2);
    assert_eq!(m.b(c).state, State::Allocated);
    check(&m);
}

#[test]
fn a_fragmented_device_fails_after_freeing_what_it_can() {
    // Capacity for three 20 MiB segments; six 8 MiB blocks fill them, every
    // other one freed leaves 36 MiB free in 8 MiB and 4 MiB pieces.
    let mut m = model("", Some(60 * MIB));
    let ids: Vec<BlockId> = (0..6).map(|_| alloc(&mut m, 8 * MIB)).collect();
    for id in ids.iter().step_by(2) {
        free(&mut m, *id);
    }
    let f = m.malloc(12 * MIB, 0, 0).unwrap_err();
    assert_eq!(f.reserved, 60 * MIB);
    assert_eq!(f.reserved - f.active, 36 * MIB);
    assert_eq!(f.largest_free, 8 * MIB);
    // Split segments cannot be given back: nothing was released.
    assert!(ops(&m, SegmentOp::Free).is_empty());
    check(&m);

    // With expandable segments the same requests pack one growing segment
    // and the 12 MiB request finds its room at the end.
    let mut e = model("expandable_segments:True", Some(60 * MIB));
    let ids: Vec<BlockId> = (0..6).map(|_| alloc(&mut e, 8 * MIB)).collect();
    for id in ids.iter().step_by(2) {
        free(&mut e, *id);
    }
    assert!(e.malloc(12 * MIB, 0, 0).is_ok());
    assert_eq!(ops(&e, SegmentOp::Map), [20 * MIB, 20 * MIB, 20 * MIB]);
    check(&e);
}

#[test]
fn the_cache_is_flushed_before_failing() {
    let mut m = model("", Some(100 * MIB));
    let a = alloc(&mut m, 30 * MIB);
    let _b = alloc(&mut m, 30 * MIB);
    let _c = alloc(&mut m, 30 * MIB);
    free(&mut m, a);
    // 34 MiB does not fit beside 90 MiB reserved; the cached 30 MiB segment is given back first.
    alloc(&mut m, 34 * MIB);
    assert_eq!(ops(&m, SegmentOp::Free), [30 * MIB]);
    assert_eq!(m.totals.reserved, 94 * MIB);
    check(&m);
}

#[test]
fn oversize_blocks_are_never_split_and_go_back_first() {
    let mut m = model("max_split_size_mb:64", Some(140 * MIB));
    let a = alloc(&mut m, 100 * MIB);
    free(&mut m, a);
    // A request under max_split_size may not take an oversize block.
    let b = alloc(&mut m, 30 * MIB);
    assert_ne!(m.b(b).addr, m.b(a).addr);
    // An oversize request may, if it wastes under max_non_split_rounding (20 MiB).
    let c = alloc(&mut m, 90 * MIB);
    assert_eq!(m.b(c).size, 100 * MIB);
    free(&mut m, c);
    assert!(
        m.malloc(70 * MIB, 0, 0).is_ok(),
        "70 MiB finds room after the 100 MiB block is released"
    );
    assert_eq!(ops(&m, SegmentOp::Free), [100 * MIB]);
    check(&m);
}

#[test]
fn expandable_segments_map_pages_and_unmap_them_on_empty_cache() {
    let mut m = model("expandable_segments:True", None);
    let a = alloc(&mut m, 30 * MIB);
    let b = alloc(&mut m, 5 * MIB);
    // 30 MiB maps two 20 MiB pages; the 5 MiB block takes the rest of the second.
    assert_eq!(ops(&m, SegmentOp::Map), [40 * MIB]);
    assert_eq!(m.b(b).addr, m.b(a).addr + 30 * MIB);
    free(&mut m, a);
    m.empty_cache();
    // The first page is wholly free and goes back; the second holds `b`.
    assert_eq!(ops(&m, SegmentOp::Unmap), [20 * MIB]);
    assert_eq!(m.totals.reserved, 20 * MIB);
    check(&m);
    free(&mut m, b);
    m.empty_cache();
    assert_eq!(m.totals.reserved, 0);
    check(&m);
}

#[test]
fn garbage_collection_frees_old_cached_segments_above_the_threshold() {
    let mut m = model(
        "garbage_collection_threshold:0.5,per_process_memory_fraction:1",
        Some(200 * MIB),
    );
    let a = alloc(&mut m, 60 * MIB);
    free(&mut m, a);
    alloc(&mut m, 70 * MIB);
    // 60 MiB cached, 70 MiB in use: reserved 130 MiB is above half of 200,
    // so the next request that finds no cached block collects the cached
    // segment before asking the driver.
    assert!(ops(&m, SegmentOp::Free).is_empty());
    alloc(&mut m, 80 * MIB);
    assert_eq!(ops(&m, SegmentOp::Free), [60 * MIB]);
    assert_eq!(m.totals.reserved, 150 * MIB);
    check(&m);
}

#[test]
fn the_peak_records_the_cache_inside_it() {
    let mut m = model("", None);
    let a = alloc(&mut m, 30 * MIB);
    free(&mut m, a);
    alloc(&mut m, 40 * MIB);
    assert_eq!(m.totals.peak_reserved, 70 * MIB);
    assert_eq!(m.totals.free_at_peak, 30 * MIB);
    assert_eq!(m.kind(0), PoolKind::Large);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_traces_keep_the_invariants(
        steps in prop::collection::vec((0u8..4, 1u64..(48 * MIB), 0usize..64, 0u16..2), 1..200),
        conf in prop::sample::select(vec!["", "expandable_segments:True", "max_split_size_mb:32", "roundup_power2_divisions:4"]),
        capacity in prop::option::of(64 * MIB..512 * MIB),
    ) {
        let mut m = model(conf, capacity);
        let mut live: Vec<BlockId> = Vec::new();
        let mut pending: Vec<BlockId> = Vec::new();
        for (op, size, pick, stream) in steps {
            match op {
                0 | 1 => {
                    if let Ok(id) = m.malloc(size, stream, 0) {
                        live.push(id);
                    }
                }
                2 if !live.is_empty() => {
                    let id = live.swap_remove(pick % live.len());
                    m.free_requested(id);
                    pending.push(id);
                }
                3 if !pending.is_empty() => {
                    let id = pending.swap_remove(pick % pending.len());
                    m.free_completed(id);
                }
                _ => m.empty_cache(),
            }
            // An early flush completes pending frees itself.
            pending.retain(|&id| m.b(id).state == State::Pending);
            m.completed_early.clear();
            check(&m);
            if let Some(c) = capacity {
                prop_assert!(m.totals.reserved <= c);
            }
        }
    }
}
