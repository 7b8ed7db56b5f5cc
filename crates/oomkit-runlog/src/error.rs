//! The one error type of this crate.

/// What can go wrong reading or writing a run log.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A line in the middle of the log is not a JSON object.
    #[error("line {line}: {problem}")]
    Line {
        /// One-based line number.
        line: usize,
        /// What is wrong with it.
        problem: String,
    },
    /// The file holds no run-log records at all.
    #[error("not an oomkit run log: {0}")]
    NotARunLog(String),
    /// A record handed to the writer is not an object with a string `type`.
    #[error("invalid record: {0}")]
    Record(String),
}

/// This crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
