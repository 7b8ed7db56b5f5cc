//! Typed PyTorch CUDA memory snapshots and the analyses built on them.
//!
//! [`Snapshot::from_bytes`] reads what `torch.cuda.memory._dump_snapshot()`
//! writes, in every layout from torch 2.0 to today, through the safe reader
//! of `oomkit-pickle`. [`analyze`] replays the allocation trace, counting
//! memory that was live before the trace's first entry, and reports per
//! device: the state at snapshot time, the peak with the live set grouped by
//! the user's line that allocated it, every OOM with its cause, the peaks of
//! annotated phases, and findings with advice.
//!
//! ```
//! use oomkit_snapshot::{analyze, Options, Snapshot};
//! // pickle.dumps({"segments": [], "device_traces": []}, protocol=4)
//! let bytes = b"\x80\x04\x95$\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94u.";
//! let snap = Snapshot::from_bytes(bytes).unwrap();
//! let report = analyze(&snap, &Options::default());
//! assert!(report.devices.is_empty());
//! ```

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
mod slots;
mod stack_reader;
mod stacks;
mod timeline;

pub use analysis::{analyze, role_timeline, traced_roles};
pub use dump::{to_json, TO_JSON_MAX_VALUES};
pub use error::{Error, Result};
pub use hash::{FastHasher, FastState};
pub use model::{
    Action, Annotation, Block, BlockState, DeviceTrace, Layout, Segment, Snapshot, Stage,
    TraceEvent, MAX_POOLS, MAX_STREAMS,
};
pub use oomkit_advice::{Finding, FindingKind, Replayed, Role, RoleBytes, RoleEvidence, Verdict};
pub use report::{
    Analysis, DeviceReport, Fragmentation, OomReport, Options, PeakAndEnd, PhaseReport, SiteBytes,
    UnknownReason, Warning,
};
pub use sites::stack_label;
pub use stacks::{classify, Frame, FrameClass, FrameId, Site, StackId, Stacks};
pub use timeline::{phase_ranges, timeline, PhaseRange, Point, Timeline};
