//! A model of PyTorch's CUDA caching allocator, replayed over a snapshot's
//! trace: the segments it reserves, the memory free inside them, the OOMs
//! it hits for a capacity, and the same under other settings, another
//! capacity or a smaller micro-batch.
//!
//! The model follows `c10/cuda/CUDACachingAllocator.cpp` step by step
//! (`rules.rs` its sizes, `model.rs` its `malloc` and `free`,
//! `expandable.rs` its expandable segments); [`what_if`] feeds a device's
//! allocations and frees through it in trace order, from the state the
//! trace began with (`start.rs`, `layout.rs`), and compares the model's
//! segments for the recorded run with the trace's own.
//!
//! ```
//! use oomkit_allocator::{what_if, Options, Scenario};
//! use oomkit_snapshot::{Action, DeviceTrace, Snapshot, TraceEvent};
//!
//! // A trace of two 6 MiB tensors, the second allocated after the first is freed.
//! let mut snap = Snapshot::from_bytes(b"\x80\x04\x95$\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94u.").unwrap();
//! let mib = 1 << 20;
//! snap.traces.push(DeviceTrace {
//!     events: vec![
//!         TraceEvent::new(Action::SegmentAlloc, 1 << 32, 20 * mib),
//!         TraceEvent::new(Action::Alloc, 1 << 32, 6 * mib),
//!         TraceEvent::new(Action::FreeCompleted, 1 << 32, 6 * mib),
//!         TraceEvent::new(Action::Alloc, 1 << 32, 6 * mib),
//!     ],
//!     ..Default::default()
//! });
//! let w = what_if(&snap, &[Scenario::alloc_conf("expandable_segments:True")], &Options::default()).unwrap();
//! let d = &w.devices[0];
//! // The model makes the one 20 MiB segment the trace recorded, for the first allocation.
//! assert_eq!(d.agreement.matched, 1);
//! assert_eq!(d.scenarios[0].peak_reserved_bytes, 20 * mib);
//! // With expandable segments it maps one 20 MiB page of the large pool instead.
//! assert_eq!(d.scenarios[1].segments[0].action, "segment_map");
//! assert_eq!(d.scenarios[1].peak_reserved_bytes, 20 * mib);
//! ```

mod config;
mod error;
mod expandable;
mod free;
mod layout;
mod model;
mod realize;
mod replay;
mod report;
mod rules;
mod scenario;
mod start;
#[cfg(test)]
mod tests;

pub use config::AllocatorConfig;
pub use error::AllocatorError;
pub use realize::{
    realize, EndBlock, EndSegment, Entry, Op, Realized, Refusal, Server, FIRST_SEGMENT_ADDRESS,
};
pub use replay::{what_if, Options, AS_RECORDED, FRESH_BASELINE};
pub use report::{
    Agreement, DeviceWhatIf, Divergence, OomOut, RecordedOom, ScenarioOut, SegmentOut, StartKind,
    WhatIf,
};
pub use rules::{
    allocation_size, division_class, next_power2_division, round_size, should_split, PoolKind,
    K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER,
    K_SMALL_SIZE, ROUNDUP_INTERVALS,
};
pub use scenario::{gpu_named, parse_capacity, Gpu, Scenario, CONTEXT_BYTES, GPUS};
