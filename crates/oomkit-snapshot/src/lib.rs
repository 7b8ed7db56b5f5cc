//! Typed PyTorch CUDA memory snapshots and the analyses built on them.
//!
//! [`Snapshot::from_bytes`] reads what `torch.cuda.memory._dump_snapshot()`
//! writes, in every layout from torch 2.0 to today, through the safe reader
//! of `oomkit-pickle`. [`analyze`] replays the allocation trace, counting
//! memory that was live before the trace's first entry, and reports per
//! device: the state at snapshot time, the peak with the live set grouped by
//! the user's line that allocated it, every OOM with its cause, the peaks of
//! annotated phases, and findings with advice.

mod analysis;
mod claim;
mod dump;
mod error;
mod findings;
mod frame_kinds;
mod hash;
mod model;
mod read;
mod replay;
mod report;
mod roles;
mod sites;
mod stacks;
mod timeline;

pub use analysis::{analyze, role_timeline};
pub use dump::{to_json, TO_JSON_MAX_VALUES};
pub use error::{Error, Result};
pub use model::{
    Action, Annotation, Block, BlockState, DeviceTrace, Layout, Segment, Snapshot, Stage,
    TraceEvent,
};
pub use oomkit_advice::{Finding, FindingKind, Role, RoleBytes, RoleEvidence, Verdict};
pub use report::{
    Analysis, DeviceReport, Fragmentation, OomReport, Options, PeakAndEnd, PhaseReport, SiteBytes,
    UnknownReason, Warning,
};
pub use sites::stack_label;
pub use stacks::{classify, Frame, FrameClass, FrameId, Site, StackId, Stacks};
pub use timeline::{phase_ranges, timeline, PhaseRange, Point, Timeline};
