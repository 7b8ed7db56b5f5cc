//! What oomkit concludes, in one vocabulary: why an allocation failed
//! ([`decide`], from the figures every source has in some form: the OOM
//! message PyTorch printed, the snapshot's replayed allocator state at the
//! failing request, the tracker's allocator statistics in a run log), and
//! the findings every reader reports, with one kind vocabulary and one
//! ranking. Each reader fills [`Figures`] or builds [`Finding`]s with what it
//! knows, so the same numbers get the same words in `oomkit explain`,
//! `oomkit analyze` and `oomkit run`.

mod cause;
mod finding;
mod verdict;

pub use cause::{decide, Cause, Figures, LARGEST_DEVICE_BYTES};
pub use finding::{rank, Finding, FindingKind};
pub use verdict::{first_fix, Failure, Place, Verdict};
