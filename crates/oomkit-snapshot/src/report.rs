//! What an analysis of a snapshot reports: the types behind `analyze --json`.

use crate::stacks::Frame;
use oomkit_advice::{Finding, RoleBytes, RoleEvidence};
use serde::Serialize;
use std::collections::BTreeMap;

/// What to analyze and how much to report.
#[derive(Clone, Debug)]
pub struct Options {
    /// How many allocation sites to list.
    pub top: usize,
    /// Analyze only this device.
    pub device: Option<i64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            top: 10,
            device: None,
        }
    }
}

/// Bytes held by one allocation site.
#[derive(Clone, Debug, Serialize)]
pub struct SiteBytes {
    /// The frame that asked for the memory, or null when unknown.
    pub site: Option<Frame>,
    /// A short description of the site, always present.
    pub label: String,
    /// Bytes live from this site.
    pub bytes: u64,
    /// Number of live allocations from this site.
    pub count: u64,
    /// The full stack of the largest of those allocations, innermost first.
    pub stack: Vec<Frame>,
}

/// One out-of-memory event from the trace.
#[derive(Clone, Debug, Serialize)]
pub struct OomReport {
    /// Index of the `oom` entry in the device's trace.
    pub event_index: u64,
    /// When it happened, microseconds since the epoch.
    pub time_us: Option<i64>,
    /// Bytes the failed allocation asked for.
    pub requested_bytes: u64,
    /// Bytes the driver reported free on the device.
    pub free_bytes: u64,
    /// Bytes in active blocks at that moment.
    pub live_bytes: u64,
    /// Bytes reserved by the allocator at that moment.
    pub reserved_bytes: u64,
    /// Reserved but unallocated bytes at that moment.
    pub reserved_unallocated_bytes: u64,
    /// Why it failed, decided as `oomkit explain` decides it from the replayed figures.
    pub cause: oomkit_advice::Cause,
    /// The frame that asked for the memory.
    pub site: Option<Frame>,
    /// A short description of that frame.
    pub label: String,
    /// The innermost `record_function` range running then, if any.
    pub phase: Option<String>,
    /// The largest holders of memory at that moment.
    pub top_holders: Vec<SiteBytes>,
    /// The bytes live at that moment by role; they add up to `live_bytes`.
    pub roles: RoleBytes,
    /// For each role, how many of its bytes frames, lifetimes and sizes told.
    pub roles_evidence: RoleEvidence,
    /// Why most of the `unknown` bytes have no role; null when none are unknown.
    pub roles_unknown_reason: Option<UnknownReason>,
}

/// One value at the peak and one at snapshot time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeakAndEnd<T> {
    /// At the peak (at snapshot time where there is no trace).
    pub peak: T,
    /// At snapshot time.
    pub end: T,
}

/// Peak memory within one named `record_function` range.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseReport {
    /// The range name.
    pub name: String,
    /// How many times the range ran.
    pub occurrences: u64,
    /// Highest active bytes seen inside any occurrence.
    pub peak_active_bytes: u64,
    /// Trace index of that peak.
    pub peak_event_index: Option<u64>,
    /// Largest growth of active bytes within one occurrence.
    pub max_growth_bytes: u64,
    /// Active bytes at the end of the last occurrence minus those at its
    /// start: memory created in the phase that outlives it.
    pub retained_bytes: i64,
}

/// Free memory inside segments, split by cause.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Fragmentation {
    /// Bytes lost to the allocator's rounding of active blocks.
    pub internal_bytes: u64,
    /// Bytes in inactive blocks: reserved but not allocated.
    pub external_bytes: u64,
    /// The largest single inactive block.
    pub largest_free_block_bytes: u64,
    /// Number of inactive blocks.
    pub free_blocks: u64,
    /// External bytes as a fraction of reserved bytes.
    pub external_fraction: f64,
    /// The largest block this program asked for: the largest allocation in
    /// the trace, or the largest active block where there is no trace. Free
    /// memory is fragmented only where no free block could serve it.
    pub largest_request_bytes: u64,
}

/// Everything learned about one device.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceReport {
    /// CUDA device index.
    pub device: i64,
    /// Number of trace entries.
    pub events: u64,
    /// Trace entries by action.
    pub actions: BTreeMap<String, u64>,
    /// Segments at snapshot time.
    pub segments: u64,
    /// Bytes reserved from the driver at snapshot time.
    pub reserved_bytes: u64,
    /// Bytes in active blocks (pending frees included) at snapshot time.
    pub active_bytes: u64,
    /// Bytes in allocated blocks at snapshot time.
    pub allocated_bytes: u64,
    /// Bytes the program asked for in active blocks at snapshot time.
    pub requested_bytes: u64,
    /// Bytes freed by the program but held for other streams.
    pub pending_free_bytes: u64,
    /// Free memory inside segments.
    pub fragmentation: Fragmentation,
    /// Highest active bytes over the trace, or at snapshot time without one.
    pub peak_active_bytes: u64,
    /// Trace index after which the peak held; null without a trace or when
    /// the peak was before the first entry.
    pub peak_event_index: Option<u64>,
    /// Time of the peak, microseconds since the epoch.
    pub peak_time_us: Option<i64>,
    /// Seconds from the trace's first entry to the peak.
    pub peak_offset_s: Option<f64>,
    /// The innermost annotated phase that contains the peak.
    pub peak_phase: Option<String>,
    /// Highest reserved bytes over the trace.
    pub peak_reserved_bytes: u64,
    /// Active bytes live before the trace's first entry.
    pub pre_trace_active_bytes: u64,
    /// Reserved bytes before the trace's first entry.
    pub pre_trace_reserved_bytes: u64,
    /// `peak` when `top_sites` is the live set at the peak, `snapshot` when
    /// it is the live set at snapshot time (no trace).
    pub top_sites_at: &'static str,
    /// The largest allocation sites in that live set.
    pub top_sites: Vec<SiteBytes>,
    /// Out-of-memory events.
    pub ooms: Vec<OomReport>,
    /// Peaks within annotated phases.
    pub phases: Vec<PhaseReport>,
    /// The bytes live at the peak and at snapshot time by role; they add up
    /// to `peak_active_bytes` and `active_bytes`.
    pub roles: PeakAndEnd<RoleBytes>,
    /// For each role, how many of its bytes frames, lifetimes and sizes told.
    pub roles_evidence: PeakAndEnd<RoleEvidence>,
    /// Why most of the `unknown` bytes have no role; null when none are unknown.
    pub roles_unknown_reason: PeakAndEnd<Option<UnknownReason>>,
}

/// A limit of the evidence, with how to get better evidence.
#[derive(Clone, Debug, Serialize)]
pub struct Warning {
    /// Stable identifier, e.g. `no_trace`.
    pub kind: &'static str,
    /// The device it is about.
    pub device: Option<i64>,
    /// What is missing or doubtful.
    pub message: String,
    /// How to record a better snapshot.
    pub fix: String,
}

/// The full analysis of one snapshot.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// What failed, where, why and the first fix; or the peak and the most important finding.
    pub verdict: oomkit_advice::Verdict,
    /// One report per device.
    pub devices: Vec<DeviceReport>,
    /// The allocator settings in force, when recorded.
    pub allocator_settings: Option<serde_json::Value>,
    /// Conclusions: OOMs first, then what explains them, then by bytes.
    pub findings: Vec<Finding>,
    /// Limits of the evidence.
    pub warnings: Vec<Warning>,
}

/// Why bytes stayed `unknown`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownReason {
    /// No frames, and no gradient of their size to match them with.
    NoEvidence,
    /// Made in forward and still held after the backward that followed.
    HeldPastBackward,
    /// Made in forward in a trace without backward, and never freed.
    NoBackward,
    /// Made in backward, with no trace to tell when it was freed.
    Backward,
    /// Alive through a forward-only trace like parameters, but as many per
    /// size as parameters with two optimizer states each.
    ParamsOrState,
    /// Made in an evaluation range and still held after it.
    HeldAfterEval,
    /// An OOM entry past those whose live set the analysis replays.
    NotExamined,
}

impl UnknownReason {
    pub(crate) const ALL: [UnknownReason; 7] = [
        UnknownReason::NoEvidence,
        UnknownReason::HeldPastBackward,
        UnknownReason::NoBackward,
        UnknownReason::Backward,
        UnknownReason::ParamsOrState,
        UnknownReason::HeldAfterEval,
        UnknownReason::NotExamined,
    ];

    /// The reason in a few words, for a table.
    pub fn brief(self) -> &'static str {
        match self {
            UnknownReason::NoEvidence => "no frames, and no gradient of their size",
            UnknownReason::HeldPastBackward => "made in forward, held past backward",
            UnknownReason::NoBackward => "made in forward, no backward recorded",
            UnknownReason::Backward => "made in backward, no trace to say when freed",
            UnknownReason::ParamsOrState => "parameters or optimizer state: sizes fit both",
            UnknownReason::HeldAfterEval => "made in evaluation, held after it",
            UnknownReason::NotExamined => "not examined: past the OOM entries replayed",
        }
    }

    /// The reason in words.
    pub fn words(self) -> &'static str {
        match self {
            UnknownReason::NoEvidence => "they have no frames (allocated before recording started, or recorded with stacks off) and no gradient of their size to match them with",
            UnknownReason::HeldPastBackward => "they were made in forward and are still held after the backward that followed (returned outputs, metrics, or a retained graph)",
            UnknownReason::NoBackward => "they were made in forward in a trace without backward or optimizer and never freed (outputs, caches, or activations whose backward was not recorded)",
            UnknownReason::Backward => "they were made in backward and the snapshot has no trace to tell whether they outlived it",
            UnknownReason::NotExamined => "the OOM entry comes after those whose live set is replayed (the first 32 per device)",
            UnknownReason::HeldAfterEval => "they were made in an evaluation range and are still held after it (outputs or metrics kept on the device)",
            UnknownReason::ParamsOrState => "they were allocated before recording and outlive a forward-only trace, as parameters do, but come three of each size, as parameters with Adam's two states do",
        }
    }
}
