//! The errors of the allocator model.

/// What can go wrong before a replay starts.
#[derive(Debug, thiserror::Error)]
pub enum AllocatorError {
    /// A setting string the allocator would refuse.
    #[error("allocator settings {conf:?}: {problem}")]
    Setting {
        /// The whole string given.
        conf: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Something the model does not follow.
    #[error("{0}")]
    NotModelled(String),
    /// A capacity that is neither a size nor a GPU the model knows.
    #[error("--capacity {0:?}: not a size (80GiB) or a GPU oomkit knows ({1})")]
    Capacity(String, String),
    /// A batch scale that is not a fraction above 0.
    #[error("--batch-scale {0:?}: give a share above 0 (0.5) or a fraction (4/8)")]
    BatchScale(String),
}
