//! Feeds arbitrary traces (and end states) through the model of the caching
//! allocator under several scenarios, and arbitrary strings through its
//! settings parser: none may panic, hang or allocate without bound, however
//! inconsistent the trace (frees of blocks never allocated, segments freed
//! twice, allocations outside every segment).
#![no_main]

use libfuzzer_sys::fuzz_target;
use oomkit_allocator::{what_if, AllocatorConfig, Options, Scenario};
use oomkit_snapshot::{
    Action, Block, BlockState, DeviceTrace, Segment, Snapshot, StackId, TraceEvent,
};

const EMPTY: &[u8] = b"\x80\x04\x95$\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94u.";
const CONFS: [&str; 4] = [
    "expandable_segments:True",
    "max_split_size_mb:32,roundup_power2_divisions:4",
    "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9",
    "expandable_segments:False",
];

fuzz_target!(|data: &[u8]| {
    // The settings parser on the bytes as text.
    let mut c = AllocatorConfig::default();
    let _ = c.apply(&String::from_utf8_lossy(data));

    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let mut snap = Snapshot::from_bytes(EMPTY).expect("the empty snapshot reads");
    // Addresses and sizes on a coarse grid, so that entries meet each other.
    let grid = |b: &[u8]| u64::from(u16::from_le_bytes([b[0], b[1]])) << 16;
    let mut events = Vec::new();
    for chunk in rest.chunks_exact(6) {
        let mut e = TraceEvent::new(
            Action::ALL[chunk[0] as usize % Action::ALL.len()],
            grid(&chunk[1..3]),
            grid(&chunk[3..5]).max(1) >> (chunk[5] % 16),
        );
        e.stream = u16::from(chunk[5] >> 6);
        events.push(e);
        if events.len() >= 4096 {
            break;
        }
    }
    // An end state of a few segments with a block or two each.
    for (k, e) in events.iter().take((head % 8) as usize).enumerate() {
        let size = e.size.max(512).next_multiple_of(512) * 2;
        snap.segments.push(Segment {
            device: 0,
            address: e.addr,
            total_size: size,
            allocated_size: size / 2,
            active_size: size / 2,
            requested_size: size / 2,
            stream: 0,
            segment_type: if k % 2 == 0 {
                "large".into()
            } else {
                String::new()
            },
            is_expandable: head & 0x40 != 0,
            private_pool: head & 0x80 != 0,
            pool: 0,
            blocks: vec![
                Block {
                    address: e.addr,
                    size: size / 2,
                    requested_size: size / 3,
                    state: BlockState::ActiveAllocated,
                    stack: StackId::EMPTY,
                },
                Block {
                    address: e.addr + size / 2,
                    size: size / 2,
                    requested_size: 0,
                    state: BlockState::Inactive,
                    stack: StackId::EMPTY,
                },
            ],
        });
    }
    snap.traces.push(DeviceTrace {
        events,
        ..Default::default()
    });
    let scenarios = [
        Scenario::alloc_conf(CONFS[(head >> 4) as usize % CONFS.len()]),
        Scenario::capacity("64MiB").expect("a size"),
        Scenario::batch_scale("1/2").expect("a share"),
    ];
    let _ = what_if(&snap, &scenarios, &Options::default());
    let mut a = oomkit_snapshot::analyze(&snap, &oomkit_snapshot::Options::default());
    oomkit_compare::replay_fixes(&snap, &mut a);
});
