//! What a replay tells, per device and per scenario: the fields of
//! `oomkit whatif --json` (docs/json.md).

use crate::rules::PoolKind;
use serde::Serialize;

/// A segment the allocator took from the driver (or pages it mapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentOut {
    /// The index, in the device's trace, of the entry that made it necessary.
    pub event: usize,
    /// Bytes.
    pub size: u64,
    /// The stream, as an index into the snapshot's streams (0: the default stream).
    pub stream: u16,
    /// The pool it serves.
    pub pool: PoolKind,
    /// In a private pool (a CUDA graph's or a `MemPool`'s).
    pub private: bool,
    /// `segment_alloc` (a `cudaMalloc`) or `segment_map` (pages of an expandable segment).
    pub action: &'static str,
}

/// An allocation that fails under a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct OomOut {
    /// The trace entry; `None` while placing the blocks live before the trace.
    pub event: Option<usize>,
    /// The bytes asked for, rounded as the allocator rounds them.
    pub size: u64,
    /// The segment it needed from the driver (or, with expandable segments, the pages).
    pub segment_bytes: u64,
    /// Reserved when it failed, after freeing every cached block it could.
    pub reserved_bytes: u64,
    /// Reserved but not in use when it failed.
    pub free_in_segments_bytes: u64,
    /// The largest cached block of the pool it needed.
    pub largest_free_block_bytes: u64,
    /// The trace recorded an OOM at this entry too.
    pub recorded: bool,
}

/// Whether an OOM the trace recorded happens under a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedOom {
    /// The trace entry of the recorded OOM.
    pub event: usize,
    /// The bytes it asked for.
    pub size: u64,
    /// True if the allocation fails here under the scenario too.
    pub happens: bool,
}

/// How the blocks live before the trace are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StartKind {
    /// As the recorded run had them: its segments, its free gaps.
    AsRecorded,
    /// Placed afresh under the scenario's settings, in address order, with
    /// nothing cached: the trace cannot show how other settings would
    /// have placed them.
    Fresh,
}

/// The trace replayed under one scenario.
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioOut {
    /// The scenario's name; the first is `as recorded`.
    pub name: String,
    /// The allocator settings replayed, in `PYTORCH_CUDA_ALLOC_CONF`'s syntax (empty: PyTorch's defaults).
    pub settings: String,
    /// The bytes the allocator could hold, or `None` for no limit.
    pub capacity_bytes: Option<u64>,
    /// Where the capacity comes from: `trace_oom`, `given` or `none`.
    pub capacity_source: &'static str,
    /// Share the micro-batch's activations, temporaries and inputs were scaled by, if any.
    pub batch_scale: Option<f64>,
    /// How the blocks live before the trace were laid out.
    pub start: StartKind,
    /// The scenario its figures are compared with: `as recorded` where it
    /// starts from the recorded state, `as recorded, fresh start` where it
    /// starts from an empty cache as a new run does; `None` for those two.
    pub baseline: Option<String>,
    /// The segments the model allocates, in trace order.
    pub segments: Vec<SegmentOut>,
    /// Segments (or pages) the model gives back.
    pub segment_frees: usize,
    /// The most reserved at any moment.
    pub peak_reserved_bytes: u64,
    /// The most allocated (handed out, in block sizes) at any moment.
    pub peak_allocated_bytes: u64,
    /// Reserved but not in use when reserved peaked.
    pub free_in_segments_at_peak_bytes: u64,
    /// The trace entry where reserved first peaked; `None` if at the start.
    pub peak_event: Option<usize>,
    /// Reserved after the last entry.
    pub reserved_at_end_bytes: u64,
    /// Trace positions of the allocations that fail (the program would stop at the first).
    pub ooms: Vec<usize>,
    /// Each failure in detail.
    pub oom_details: Vec<OomOut>,
    /// The OOMs the trace recorded, and whether each still happens.
    pub recorded_ooms: Vec<RecordedOom>,
    /// Trace entries the model could not follow (frees of blocks it does
    /// not hold, unknown actions); the figures are not vouched for when above 0.
    pub unfollowed: u64,
    /// Reserved bytes at the sample entries asked for (for drawing).
    #[serde(skip)]
    pub reserved_samples: Vec<u64>,
    /// Reserved once the blocks from before the trace are laid out, before its first entry (for drawing).
    #[serde(skip)]
    pub start_reserved_bytes: u64,
}

/// How far the model's segments for the recorded run agree with the trace's own.
#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    /// Segment allocations the trace recorded.
    pub recorded: usize,
    /// Segment allocations the model made.
    pub simulated: usize,
    /// Recorded ones the model made too, at the same entry with the same size.
    pub matched: usize,
    /// `matched` over the larger of the two counts (1 where both are empty).
    pub share: f64,
    /// The first place the two lists differ, if they do.
    pub first_divergence: Option<Divergence>,
    /// Share of the trace's allocations the model put at the address the trace recorded.
    pub placed_at_recorded_address: f64,
}

/// Where the model's segment list first differs from the trace's.
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    /// The position in the two lists.
    pub index: usize,
    /// The trace's segment there, if any.
    pub recorded: Option<SegmentOut>,
    /// The model's, if any.
    pub simulated: Option<SegmentOut>,
}

/// One device's what-ifs.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceWhatIf {
    /// The CUDA device index.
    pub device: i64,
    /// Entries in its trace.
    pub events: usize,
    /// Reserved when the trace began.
    pub reserved_at_start_bytes: u64,
    /// Reserved but free when the trace began (the cache from before it).
    pub cached_at_start_bytes: u64,
    /// The segments the trace recorded itself, in the same form as each scenario's.
    pub recorded_segments: Vec<SegmentOut>,
    /// The most reserved the trace itself shows.
    pub recorded_peak_reserved_bytes: u64,
    /// The model against the trace's own segments.
    pub agreement: Agreement,
    /// The scenarios, the trace as recorded first.
    pub scenarios: Vec<ScenarioOut>,
    /// What the model had to assume or leave out, in words.
    pub notes: Vec<String>,
}

/// The what-ifs of one snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct WhatIf {
    /// The settings the run had, as recorded (empty: PyTorch's defaults).
    pub recorded_settings: String,
    /// False when the snapshot does not record its settings and the defaults were assumed.
    pub settings_recorded: bool,
    /// Per device with a trace.
    pub devices: Vec<DeviceWhatIf>,
}
