//! What oomkit concludes, in one vocabulary: why an allocation failed
//! ([`decide`], from the figures every source has in some form: the OOM
//! message PyTorch printed, the snapshot's replayed allocator state at the
//! failing request, the tracker's allocator statistics in a run log), and
//! the findings every reader reports, with one kind vocabulary and one
//! ranking. Each reader fills [`Figures`] or builds [`Finding`]s with what it
//! knows, so the same numbers get the same words in `oomkit explain`,
//! `oomkit analyze` and `oomkit run`; and what memory is for ([`Role`]),
//! in the terms a snapshot's blocks and a run log's components share, with
//! the [`Optimizer`]s whose state sizes both count.
//!
//! ```
//! use oomkit_advice::{decide, Cause, Figures};
//! // 2 GiB asked for, 1 GiB free, but 3 GiB reserved and unused: fragmentation.
//! let f = Figures {
//!     requested: Some(2 << 30),
//!     capacity: Some(80 << 30),
//!     free: Some(1 << 30),
//!     reserved_unallocated: Some(3 << 30),
//!     ..Figures::default()
//! };
//! assert_eq!(decide(&f), Cause::Fragmentation);
//! assert_eq!(decide(&Figures { reserved_unallocated: None, ..f }), Cause::Capacity);
//! ```

mod cause;
mod finding;
mod optimizer;
mod role;
mod verdict;

pub use cause::{
    decide, room_on_device, Cause, Figures, LARGEST_DEVICE_BYTES, PROCESS_LIMIT_SLACK_BYTES,
};
pub use finding::{rank, Finding, FindingKind, Replayed};
pub use optimizer::Optimizer;
pub use role::{Evidence, PerRole, Role, RoleBytes, RoleEvidence, RolesAt, Told};
pub use verdict::{first_fix, Failure, Place, Verdict};
