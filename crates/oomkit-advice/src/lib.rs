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

mod cause;
mod finding;
mod optimizer;
mod role;
mod verdict;

pub use cause::{decide, Cause, Figures, LARGEST_DEVICE_BYTES};
pub use finding::{rank, Finding, FindingKind};
pub use optimizer::Optimizer;
pub use role::{Evidence, PerRole, Role, RoleBytes, RoleEvidence, RolesAt, Told};
pub use verdict::{first_fix, Failure, Place, Verdict};
