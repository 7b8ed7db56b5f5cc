//! The typed snapshot: segments, blocks, trace entries and what a file's layout was.
//! Read from a pickle by `read.rs` (with `claim.rs` turning trace entries into
//! events while the pickle is parsed); dumped to JSON by `dump.rs`.

use crate::stacks::{StackId, Stacks};
use serde::Serialize;
use std::collections::BTreeMap;

/// The state of a block inside a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Handed out to a tensor.
    ActiveAllocated,
    /// Freed by the program but kept until other streams finish with it.
    ActivePendingFree,
    /// Free space inside the segment.
    Inactive,
    /// A state this reader does not know.
    Unknown,
}

impl BlockState {
    /// Returns true if the allocator counts the block as active.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            BlockState::ActiveAllocated | BlockState::ActivePendingFree
        )
    }
}

/// A block of a segment, as the allocator saw it at snapshot time.
#[derive(Clone, Debug)]
pub struct Block {
    /// Device address.
    pub address: u64,
    /// Size after the allocator's rounding.
    pub size: u64,
    /// Size the program asked for.
    pub requested_size: u64,
    /// Allocation state.
    pub state: BlockState,
    /// Stack that allocated it, or the empty stack.
    pub stack: StackId,
}

/// A segment: one `cudaMalloc` (or expandable mapping) held by the caching allocator.
#[derive(Clone, Debug)]
pub struct Segment {
    /// CUDA device index.
    pub device: i64,
    /// Device address of the first byte.
    pub address: u64,
    /// Bytes reserved from the driver.
    pub total_size: u64,
    /// Bytes in `active_allocated` blocks.
    pub allocated_size: u64,
    /// Bytes in active blocks, pending frees included.
    pub active_size: u64,
    /// Bytes the program asked for in active blocks.
    pub requested_size: u64,
    /// The CUDA stream the segment belongs to.
    pub stream: u64,
    /// `large` or `small` pool, empty when not recorded.
    pub segment_type: String,
    /// True for expandable segments.
    pub is_expandable: bool,
    /// The segment belongs to a private pool (`segment_pool_id` other than
    /// `(0, 0)`): a CUDA graph's, or one a `torch.cuda.MemPool` made.
    pub private_pool: bool,
    /// The memory pool, as an index into [`Snapshot::pools`] (0 is the default pool).
    pub pool: u8,
    /// The blocks, in address order.
    pub blocks: Vec<Block>,
}

/// What a trace entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// The program freed a block; other streams may still use it.
    FreeRequested,
    /// The block became free for reuse.
    FreeCompleted,
    /// A segment was reserved with `cudaMalloc`.
    SegmentAlloc,
    /// A segment was released with `cudaFree`.
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// `_snapshot()` was called.
    Snapshot,
    /// An allocation failed: `size` was requested, `addr` holds the driver's free bytes.
    Oom,
    /// A user annotation (`torch.cuda.memory._record_memory_history` metadata).
    Annotate,
    /// An action this reader does not know; counted, not fatal.
    Unknown,
}

impl Action {
    /// Every action, in declaration order, so that `ALL[a as usize] == a`.
    pub const ALL: [Action; 11] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Snapshot,
        Action::Oom,
        Action::Annotate,
        Action::Unknown,
    ];

    pub(crate) fn parse(s: &[u8]) -> Action {
        match s {
            b"alloc" => Action::Alloc,
            b"free_requested" => Action::FreeRequested,
            b"free_completed" => Action::FreeCompleted,
            b"segment_alloc" => Action::SegmentAlloc,
            b"segment_free" => Action::SegmentFree,
            b"segment_map" => Action::SegmentMap,
            b"segment_unmap" => Action::SegmentUnmap,
            b"snapshot" => Action::Snapshot,
            b"oom" => Action::Oom,
            b"annotate" => Action::Annotate,
            _ => Action::Unknown,
        }
    }

    /// Returns the action's name as PyTorch writes it.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::Annotate => "annotate",
            Action::Unknown => "unknown",
        }
    }
}

/// One entry of a device's allocation trace.
#[derive(Clone, Copy)]
pub struct TraceEvent {
    /// What happened.
    pub action: Action,
    /// Address, or for `oom` the bytes the driver reported free.
    pub addr: u64,
    /// Size, or for `oom` the bytes requested.
    pub size: u64,
    /// Stack of the call, or the empty stack.
    pub stack: StackId,
    /// The CUDA stream, as an index into [`Snapshot::streams`] (0 is the
    /// default stream); a `u16` so that the event stays 32 bytes.
    pub stream: u16,
    /// The memory pool, as an index into [`Snapshot::pools`] (0 is the
    /// default pool), where the entry records one (`segment_pool_id`, torch 2.8 on).
    pub pool: u8,
    /// Microseconds since the epoch, or [`NO_TIME`]; an `Option<i64>` would
    /// make every event 40 bytes instead of 32.
    time_us: i64,
}

impl std::fmt::Debug for TraceEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceEvent")
            .field("action", &self.action)
            .field("addr", &self.addr)
            .field("size", &self.size)
            .field("time_us", &self.time_us())
            .field("stack", &self.stack)
            .field("stream", &self.stream)
            .field("pool", &self.pool)
            .finish()
    }
}

/// Marks an entry without `time_us`.
const NO_TIME: i64 = i64::MIN;

impl TraceEvent {
    /// An entry before its fields are read.
    pub(crate) const BLANK: TraceEvent = TraceEvent {
        action: Action::Unknown,
        addr: 0,
        size: 0,
        stack: StackId::EMPTY,
        stream: 0,
        pool: 0,
        time_us: NO_TIME,
    };

    /// An entry with no stack and no time, on the default stream and pool
    /// (for building traces by hand, as tests and simulations do).
    pub fn new(action: Action, addr: u64, size: u64) -> TraceEvent {
        TraceEvent {
            action,
            addr,
            size,
            ..TraceEvent::BLANK
        }
    }

    /// Returns when the entry was recorded, in microseconds since the epoch; absent before torch 2.2.
    pub fn time_us(&self) -> Option<i64> {
        (self.time_us != NO_TIME).then_some(self.time_us)
    }

    pub(crate) fn set_time(&mut self, t: Option<i64>) {
        // i64::MIN is not a plausible time; reading it as absent loses nothing.
        self.time_us = t.unwrap_or(NO_TIME);
    }
}

/// The trace of one device: a ring buffer of the most recent entries.
#[derive(Clone, Debug, Default)]
pub struct DeviceTrace {
    /// Entries, oldest first.
    pub events: Vec<TraceEvent>,
    /// Names and counts of actions this reader did not know.
    pub unknown_actions: BTreeMap<String, u64>,
}

/// Whether an annotation opens or closes a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Stage {
    /// The range starts.
    Start,
    /// The range ends.
    End,
}

/// A `record_function` range boundary from `external_annotations`.
#[derive(Clone, Debug)]
pub struct Annotation {
    /// The range name, e.g. `Optimizer.step#AdamW.step`.
    pub name: String,
    /// Start or end.
    pub stage: Stage,
    /// CUDA device index.
    pub device: i64,
    /// Microseconds since the epoch.
    pub time_us: i64,
}

/// Which of the known file layouts the snapshot used.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Layout {
    /// The pickle protocol.
    pub protocol: u8,
    /// The file is a bare list of segments (`torch.cuda.memory_snapshot()`).
    pub legacy_segment_list: bool,
    /// Blocks carry `history` instead of `address` and `frames` (torch 2.0).
    pub block_history: bool,
    /// Trace entries carry `time_us`.
    pub trace_times: bool,
}

/// A whole PyTorch memory snapshot.
#[derive(Debug)]
pub struct Snapshot {
    /// Segments at snapshot time.
    pub segments: Vec<Segment>,
    /// Allocation traces, indexed by device.
    pub traces: Vec<DeviceTrace>,
    /// `allocator_settings`, as JSON, when present.
    pub allocator_settings: Option<serde_json::Value>,
    /// `external_annotations`, when present.
    pub annotations: Vec<Annotation>,
    /// Interned frames and stacks.
    pub stacks: Stacks,
    /// What layout the file used.
    pub layout: Layout,
    /// The CUDA streams the trace and the segments name, by the index
    /// [`TraceEvent::stream`] holds; the first is always the default stream, 0.
    pub streams: Vec<i64>,
    /// The memory pools the trace names, by the index [`TraceEvent::pool`]
    /// holds; the first is always the default pool, `(0, 0)`.
    pub pools: Vec<(i64, i64)>,
}

/// Most streams a snapshot's events tell apart; any beyond share the last index.
pub const MAX_STREAMS: usize = u16::MAX as usize + 1;
/// Most memory pools a snapshot's events tell apart; any beyond share the last index.
pub const MAX_POOLS: usize = u8::MAX as usize + 1;

/// The streams and pools of a snapshot, each numbered in the order first seen.
#[derive(Clone, Debug)]
pub(crate) struct Interned {
    pub(crate) streams: Vec<i64>,
    pub(crate) pools: Vec<(i64, i64)>,
}

impl Default for Interned {
    fn default() -> Self {
        Interned {
            streams: vec![0],
            pools: vec![(0, 0)],
        }
    }
}

impl Interned {
    /// The index of a stream, numbering it if new.
    pub(crate) fn stream(&mut self, raw: i64) -> u16 {
        // A trace names one to a few streams, so a scan beats a map.
        if let Some(i) = self.streams.iter().position(|&s| s == raw) {
            return i as u16;
        }
        if self.streams.len() < MAX_STREAMS {
            self.streams.push(raw);
        }
        (self.streams.len() - 1) as u16
    }

    /// The index of a memory pool, numbering it if new.
    pub(crate) fn pool(&mut self, id: (i64, i64)) -> u8 {
        if let Some(i) = self.pools.iter().position(|&p| p == id) {
            return i as u8;
        }
        if self.pools.len() < MAX_POOLS {
            self.pools.push(id);
        }
        (self.pools.len() - 1) as u8
    }
}

impl Snapshot {
    /// Returns the index of a raw stream handle in [`Snapshot::streams`], if the snapshot names it.
    pub fn stream_index(&self, raw: i64) -> Option<u16> {
        self.streams
            .iter()
            .position(|&s| s == raw)
            .map(|i| i as u16)
    }

    /// Returns the trace entries of a device, empty where it has none.
    pub fn events(&self, device: i64) -> &[TraceEvent] {
        usize::try_from(device)
            .ok()
            .and_then(|i| self.traces.get(i))
            .map_or(&[], |t| &t.events[..])
    }

    /// Returns the devices that have segments or trace entries, in order.
    pub fn devices(&self) -> Vec<i64> {
        let mut d: Vec<i64> = self.segments.iter().map(|s| s.device).collect();
        for (i, t) in self.traces.iter().enumerate() {
            if !t.events.is_empty() {
                d.push(i as i64);
            }
        }
        d.sort_unstable();
        d.dedup();
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_stays_32_bytes() {
        // A million-entry trace is held whole; each byte more is a megabyte.
        assert_eq!(std::mem::size_of::<TraceEvent>(), 32);
    }

    #[test]
    fn streams_and_pools_are_numbered_in_the_order_seen() {
        let mut i = Interned::default();
        assert_eq!(i.stream(0), 0);
        assert_eq!(i.stream(94_000_000), 1);
        assert_eq!(i.stream(7), 2);
        assert_eq!(i.stream(94_000_000), 1);
        assert_eq!(i.pool((0, 0)), 0);
        assert_eq!(i.pool((1, 0)), 1);
        assert_eq!(i.pool((0, 3)), 2);
        assert_eq!(i.pool((1, 0)), 1);
    }
}
