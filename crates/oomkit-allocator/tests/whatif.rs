//! What-ifs end to end on traces written entry by entry as PyTorch's
//! allocator writes them (CUDACachingAllocator.cpp: `segment_alloc`
//! before the `alloc` it serves, `free_requested` then `free_completed`,
//! an `oom` entry carrying the driver's free bytes).

use oomkit_allocator::{what_if, Options, Scenario, StartKind};
use oomkit_snapshot::{
    Action, Block, BlockState, DeviceTrace, Segment, Snapshot, StackId, TraceEvent,
};

const MIB: u64 = 1 << 20;
const BASE: u64 = 0x7f00_0000_0000;

fn empty() -> Snapshot {
    // pickle.dumps({"segments": [], "device_traces": []}, protocol=4)
    Snapshot::from_bytes(b"\x80\x04\x95$\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94u.").unwrap()
}

fn ev(action: Action, addr: u64, size: u64) -> TraceEvent {
    TraceEvent::new(action, addr, size)
}

fn block(address: u64, size: u64, state: BlockState) -> Block {
    Block {
        address,
        size,
        requested_size: size,
        state,
        stack: StackId::EMPTY,
    }
}

/// Six 8 MiB tensors in three 20 MiB segments, every other one freed, then
/// a 12 MiB request: 36 MiB free in segments and none of it in one piece.
fn fragmented() -> Snapshot {
    let mut snap = empty();
    let mut events = Vec::new();
    for s in 0..3 {
        let seg = BASE + s * 32 * MIB;
        events.push(ev(Action::SegmentAlloc, seg, 20 * MIB));
        events.push(ev(Action::Alloc, seg, 8 * MIB));
        events.push(ev(Action::Alloc, seg + 8 * MIB, 8 * MIB));
    }
    for s in 0..3 {
        let seg = BASE + s * 32 * MIB;
        events.push(ev(Action::FreeRequested, seg, 8 * MIB));
        events.push(ev(Action::FreeCompleted, seg, 8 * MIB));
    }
    // The flush frees nothing (every segment is split), then the OOM: the
    // driver had 2 MiB free, so the device let the allocator hold 62 MiB.
    events.push(ev(Action::Oom, 2 * MIB, 12 * MIB));
    snap.traces.push(DeviceTrace {
        events,
        ..Default::default()
    });
    for s in 0..3 {
        let seg = BASE + s * 32 * MIB;
        snap.segments.push(Segment {
            device: 0,
            address: seg,
            total_size: 20 * MIB,
            allocated_size: 8 * MIB,
            active_size: 8 * MIB,
            requested_size: 8 * MIB,
            stream: 0,
            segment_type: "large".into(),
            is_expandable: false,
            private_pool: false,
            pool: 0,
            blocks: vec![
                block(seg, 8 * MIB, BlockState::Inactive),
                block(seg + 8 * MIB, 8 * MIB, BlockState::ActiveAllocated),
                block(seg + 16 * MIB, 4 * MIB, BlockState::Inactive),
            ],
        });
    }
    snap
}

#[test]
fn a_fragmentation_oom_is_replayed_and_expandable_segments_avoid_it() {
    let snap = fragmented();
    let w = what_if(
        &snap,
        &[Scenario::alloc_conf("expandable_segments:True")],
        &Options::default(),
    )
    .unwrap();
    let d = &w.devices[0];
    assert_eq!(d.agreement.matched, 3);
    assert_eq!(d.agreement.share, 1.0);
    assert_eq!(d.agreement.placed_at_recorded_address, 1.0);
    let rec = &d.scenarios[0];
    assert_eq!(rec.name, "as recorded");
    assert_eq!(rec.capacity_bytes, Some(62 * MIB));
    assert_eq!(rec.capacity_source, "trace_oom");
    assert_eq!(rec.ooms, [15]);
    assert!(rec.recorded_ooms[0].happens);
    let o = rec.oom_details[0];
    assert_eq!(
        (
            o.reserved_bytes,
            o.free_in_segments_bytes,
            o.largest_free_block_bytes
        ),
        (60 * MIB, 36 * MIB, 8 * MIB)
    );
    assert_eq!(rec.peak_reserved_bytes, 60 * MIB);

    let exp = &d.scenarios[1];
    assert_eq!(
        exp.start,
        StartKind::AsRecorded,
        "nothing predates the trace"
    );
    assert!(exp.ooms.is_empty());
    assert!(!exp.recorded_ooms[0].happens);
    assert_eq!(exp.peak_reserved_bytes, 60 * MIB);
    assert!(exp.segments.iter().all(|s| s.action == "segment_map"));
}

#[test]
fn a_larger_device_avoids_it_and_a_smaller_one_fails_sooner() {
    let snap = fragmented();
    let w = what_if(
        &snap,
        &[
            Scenario::capacity("80MiB").unwrap(),
            Scenario::capacity("50MiB").unwrap(),
        ],
        &Options::default(),
    )
    .unwrap();
    let d = &w.devices[0];
    assert!(!d.scenarios[1].recorded_ooms[0].happens);
    assert_eq!(d.scenarios[1].capacity_source, "given");
    // 50 MiB holds two 20 MiB segments: the fifth 8 MiB tensor (entry 7) fails, and the sixth.
    assert_eq!(d.scenarios[2].ooms, [7, 8, 15]);
}

#[test]
fn an_empty_cache_call_is_replayed_where_the_trace_shows_it() {
    let mut snap = empty();
    let a = BASE;
    let b = BASE + 64 * MIB;
    snap.traces.push(DeviceTrace {
        events: vec![
            ev(Action::SegmentAlloc, a, 30 * MIB),
            ev(Action::Alloc, a, 30 * MIB),
            ev(Action::FreeRequested, a, 30 * MIB),
            ev(Action::FreeCompleted, a, 30 * MIB),
            // torch.cuda.empty_cache(): the cached segment goes back...
            ev(Action::SegmentFree, a, 30 * MIB),
            // ...so the next request needs a segment of its own.
            ev(Action::SegmentAlloc, b, 30 * MIB),
            ev(Action::Alloc, b, 30 * MIB),
        ],
        ..Default::default()
    });
    snap.segments.push(Segment {
        device: 0,
        address: b,
        total_size: 30 * MIB,
        allocated_size: 30 * MIB,
        active_size: 30 * MIB,
        requested_size: 30 * MIB,
        stream: 0,
        segment_type: "large".into(),
        is_expandable: false,
        private_pool: false,
        pool: 0,
        blocks: vec![block(b, 30 * MIB, BlockState::ActiveAllocated)],
    });
    let w = what_if(&snap, &[], &Options::default()).unwrap();
    let d = &w.devices[0];
    assert_eq!(d.agreement.matched, 2, "{:?}", d.agreement);
    assert_eq!(d.scenarios[0].segment_frees, 1);
    assert_eq!(d.scenarios[0].peak_reserved_bytes, 30 * MIB);
    assert_eq!(
        d.notes.len(),
        1,
        "only that the settings are assumed: {:?}",
        d.notes
    );
    assert!(!w.settings_recorded);
}

#[test]
fn a_trace_that_begins_mid_run_starts_from_what_was_held() {
    // A 100 MiB block from before the trace, freed in it; a 40 MiB request
    // then splits its cached segment instead of asking the driver.
    let mut snap = empty();
    snap.traces.push(DeviceTrace {
        events: vec![
            ev(Action::FreeRequested, BASE, 100 * MIB),
            ev(Action::FreeCompleted, BASE, 100 * MIB),
            ev(Action::Alloc, BASE, 40 * MIB),
        ],
        ..Default::default()
    });
    snap.segments.push(Segment {
        device: 0,
        address: BASE,
        total_size: 100 * MIB,
        allocated_size: 40 * MIB,
        active_size: 40 * MIB,
        requested_size: 40 * MIB,
        stream: 0,
        segment_type: "large".into(),
        is_expandable: false,
        private_pool: false,
        pool: 0,
        blocks: vec![
            block(BASE, 40 * MIB, BlockState::ActiveAllocated),
            block(BASE + 40 * MIB, 60 * MIB, BlockState::Inactive),
        ],
    });
    let w = what_if(
        &snap,
        &[Scenario::alloc_conf("expandable_segments:True")],
        &Options::default(),
    )
    .unwrap();
    let d = &w.devices[0];
    assert_eq!(d.reserved_at_start_bytes, 100 * MIB);
    assert_eq!(d.cached_at_start_bytes, 0);
    assert_eq!(d.agreement.recorded, 0);
    assert_eq!(d.agreement.simulated, 0);
    assert_eq!(d.agreement.placed_at_recorded_address, 1.0);
    assert_eq!(d.scenarios[0].peak_reserved_bytes, 100 * MIB);
    // Other settings place the 100 MiB block afresh, beside a baseline that does the same.
    assert_eq!(d.scenarios[1].name, "as recorded, fresh start");
    assert_eq!(d.scenarios[1].start, StartKind::Fresh);
    assert_eq!(d.scenarios[2].start, StartKind::Fresh);
}

#[test]
fn bad_settings_are_refused_before_replaying() {
    let e = what_if(
        &fragmented(),
        &[Scenario::alloc_conf("expandable_segments:maybe")],
        &Options::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("expandable_segments takes True or False"), "{e}");
}

#[test]
fn frees_of_blocks_nobody_allocated_are_counted_not_fatal() {
    let mut snap = fragmented();
    let t = &mut snap.traces[0].events;
    t.insert(0, ev(Action::FreeRequested, 0x1234_5000, 512));
    t.insert(1, ev(Action::FreeCompleted, 0x1234_5000, 512));
    t.insert(2, ev(Action::Unknown, 0, 0));
    let w = what_if(&snap, &[], &Options::default()).unwrap();
    let d = &w.devices[0];
    // The request and the completion of the stray free, and the unknown action.
    assert_eq!(d.scenarios[0].unfollowed, 3);
    assert!(
        d.notes
            .iter()
            .any(|n| n.contains("lie in no segment held when it began")),
        "{:?}",
        d.notes
    );
}

/// Found by fuzzing: end segments that overlap (no real allocator writes
/// them) once left free blocks the model could not account for, and a
/// later request split a block smaller than itself.
#[test]
fn overlapping_segments_are_left_out_with_a_note() {
    let mut snap = fragmented();
    // Two segments held from before the trace began, the second starting
    // inside the first.
    for shift in [200 * MIB, 204 * MIB] {
        let mut held = snap.segments[0].clone();
        held.address += shift;
        for b in &mut held.blocks {
            b.address += shift;
        }
        snap.segments.push(held);
    }
    for scenario in [
        Scenario::alloc_conf("expandable_segments:True"),
        Scenario::alloc_conf("max_split_size_mb:32"),
    ] {
        let w = what_if(&snap, &[scenario], &Options::default()).unwrap();
        let d = &w.devices[0];
        assert!(
            d.notes.iter().any(|n| n.contains("overlap another held")),
            "{:?}",
            d.notes
        );
    }
}

/// A warm trace made as PyTorch makes one: the program runs warm-up steps,
/// then the recording starts, so the trace holds only the last step and
/// begins with the cache the warm-up left. The steps are served through
/// the model (`realize`), and the snapshot is cut as `_dump_snapshot` cuts it.
fn warm_trace() -> (Snapshot, u64, u64) {
    use oomkit_allocator::{realize, AllocatorConfig, Op};
    let mut ops = Vec::new();
    // 60 MiB of weights, held throughout.
    for _ in 0..3 {
        ops.push(Op::Alloc {
            size: 20 * MIB,
            stream: 0,
        });
    }
    let mut step_starts = Vec::new();
    for step in 0..4u64 {
        step_starts.push(ops.len());
        // Activations of a shape that changes with the step (the warm-up's
        // sequences were longer), so that the cache the warm-up leaves is
        // larger than the recorded step needs.
        let first = ops.len();
        for k in 0..6u64 {
            ops.push(Op::Alloc {
                size: (20 + 4 * ((step + k) % 3) + 6 * (3 - step)) * MIB,
                stream: 0,
            });
        }
        for k in 0..6 {
            ops.push(Op::Free { alloc: first + k });
        }
    }
    let r = realize(&ops, AllocatorConfig::default(), None);
    let warm_from = step_starts[3];
    let entries: Vec<TraceEvent> = r
        .entries
        .iter()
        .filter(|e| e.op >= warm_from)
        .map(|e| ev(e.action, e.addr, e.size))
        .collect();
    let mut snap = empty();
    snap.traces.push(DeviceTrace {
        events: entries,
        ..Default::default()
    });
    for s in &r.segments {
        let blocks: Vec<Block> = s
            .blocks
            .iter()
            .map(|b| Block {
                address: b.addr,
                size: b.size,
                requested_size: b.requested,
                state: if b.allocated {
                    BlockState::ActiveAllocated
                } else {
                    BlockState::Inactive
                },
                stack: StackId::EMPTY,
            })
            .collect();
        let allocated: u64 = s
            .blocks
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.size)
            .sum();
        snap.segments.push(Segment {
            device: 0,
            address: s.addr,
            total_size: s.size,
            allocated_size: allocated,
            active_size: allocated,
            requested_size: allocated,
            stream: 0,
            segment_type: "large".into(),
            is_expandable: false,
            private_pool: false,
            pool: 0,
            blocks,
        });
    }
    (snap, r.peak_allocated, r.peak_reserved)
}

#[test]
fn a_warm_trace_under_a_smaller_capacity_runs_out_or_gives_its_cache_back() {
    let (snap, allocated, reserved) = warm_trace();
    let w = what_if(&snap, &[], &Options::default()).unwrap();
    let d = &w.devices[0];
    // Warm: the recorded step takes no segment; the cache was there before it.
    assert_eq!(d.agreement.recorded, 0);
    assert_eq!(d.agreement.simulated, 0);
    let step_allocated = d.scenarios[0].peak_allocated_bytes;
    assert!(
        step_allocated <= allocated && reserved > step_allocated,
        "{step_allocated} {allocated} {reserved}"
    );
    assert_eq!(d.reserved_at_start_bytes, reserved);

    // Below what the step holds: an OOM, whatever the cache.
    let below = step_allocated - 10 * MIB;
    // Between what it holds and what the warm cache reserved.
    let between = step_allocated / 2 + reserved / 2;
    let w = what_if(
        &snap,
        &[
            Scenario::capacity(&below.to_string()).unwrap(),
            Scenario::capacity(&between.to_string()).unwrap(),
        ],
        &Options::default(),
    )
    .unwrap();
    let d = &w.devices[0];
    let names: Vec<&str> = d.scenarios.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names[1], "as recorded, fresh start", "{names:?}");
    let (low, mid) = (&d.scenarios[2], &d.scenarios[3]);
    for s in [low, mid] {
        // A new run: the cache from before the trace is not carried over.
        assert_eq!(s.start, StartKind::Fresh);
        assert_eq!(s.baseline.as_deref(), Some("as recorded, fresh start"));
        assert!(s.peak_reserved_bytes <= s.capacity_bytes.unwrap(), "{s:?}");
    }
    assert!(!low.ooms.is_empty(), "{low:?}");
    assert!(low.oom_details.iter().all(|o| !o.recorded));
    assert!(mid.ooms.is_empty(), "{mid:?}");
    assert!(mid.peak_reserved_bytes < reserved);
}

/// Half the micro-batch on a real warm trace (one training step of a
/// 36-layer LM, recorded after warm-up with 22.2 GiB reserved at its first
/// entry): a new run, from an empty cache, against a new run as recorded.
/// Before, the warm segments were kept, and half the batch "reserved" all of them.
#[test]
fn half_the_micro_batch_on_a_warm_trace_reserves_less() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../oomkit-cli/tests/real/cs336_lm_large_step_nothanmin.pickle"
    );
    let snap = Snapshot::from_bytes(&std::fs::read(file).unwrap()).unwrap();
    let w = what_if(
        &snap,
        &[Scenario::batch_scale("0.5").unwrap()],
        &Options::default(),
    )
    .unwrap();
    let d = &w.devices[0];
    assert_eq!(
        d.agreement.recorded, 0,
        "warm: the step takes no new segment"
    );
    let (rec, fresh, half) = (&d.scenarios[0], &d.scenarios[1], &d.scenarios[2]);
    assert_eq!(fresh.name, "as recorded, fresh start");
    assert_eq!(half.start, StartKind::Fresh);
    assert_eq!(half.baseline.as_deref(), Some(fresh.name.as_str()));
    assert!(half.peak_allocated_bytes < rec.peak_allocated_bytes);
    assert!(
        half.peak_reserved_bytes < fresh.peak_reserved_bytes
            && half.peak_reserved_bytes < d.reserved_at_start_bytes,
        "{} against {} fresh and {} at the start",
        half.peak_reserved_bytes,
        fresh.peak_reserved_bytes,
        d.reserved_at_start_bytes
    );
}
