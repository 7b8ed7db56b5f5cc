//! The one error type of the comparison crate.

/// Why what the comparison crate holds cannot serve a request.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// A format that draws from a file's raw data (the HTML page, the trace)
    /// was handed the file loaded without it: a bug in the caller.
    #[error("{file}: internal error: loaded without the raw data this format draws from")]
    NotKept {
        /// The path as the user gave it.
        file: String,
    },
}
