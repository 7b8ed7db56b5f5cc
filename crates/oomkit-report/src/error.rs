//! The one error type of the formats crate.

use oomkit_compare::CompareError;

/// Why a result could not be written in the format asked for.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A format that draws from raw data was handed a file loaded without it.
    #[error(transparent)]
    NotKept(#[from] CompareError),
    /// The format writes one file's timeline and was given several.
    #[error("--format {format}: {what}")]
    OneFile {
        /// The format's name.
        format: &'static str,
        /// What to do instead.
        what: &'static str,
    },
    /// The result has no form in this format (a GPU list as an HTML page).
    #[error("--format {format} is not offered for this result")]
    NotOffered {
        /// The format's name.
        format: &'static str,
    },
    /// Writing failed (a closed pipe, a full disk).
    #[error("{0}")]
    Write(#[from] std::io::Error),
}
