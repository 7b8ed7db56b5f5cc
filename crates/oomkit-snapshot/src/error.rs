//! The one error type of this crate.

/// Why a file could not be read as a PyTorch memory snapshot.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The bytes are not a readable, safe pickle.
    #[error(transparent)]
    Pickle(#[from] oomkit_pickle::Error),
    /// The pickle is fine but holds something other than a snapshot.
    #[error("not a PyTorch memory snapshot: {0}")]
    NotASnapshot(String),
    /// A snapshot field has the wrong type or an impossible value.
    #[error("bad snapshot field: {at}: {problem}")]
    Field {
        /// Where the field is, e.g. `segments[3].blocks[2].size`.
        at: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
