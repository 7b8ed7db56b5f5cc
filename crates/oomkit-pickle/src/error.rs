//! The one error type of this crate.

/// Everything that can go wrong while reading a pickle.
///
/// Every variant that comes from the input names the byte offset where the
/// reader stopped, so a user can see how far a damaged file got.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The input ended before the pickle was complete.
    #[error("truncated at byte {offset}: {what}")]
    Truncated {
        /// Offset where more bytes were needed.
        offset: u64,
        /// What the reader was trying to read.
        what: String,
    },
    /// An opcode that could import, call or build Python objects was found.
    #[error("opcode {name} refused at byte {offset}: it {why}; oomkit never executes anything from a file")]
    Refused {
        /// The opcode's name as in CPython's `pickletools`.
        name: &'static str,
        /// Offset of the opcode byte.
        offset: u64,
        /// What the opcode would have done.
        why: &'static str,
    },
    /// A byte that is no opcode this reader knows.
    #[error("unknown opcode 0x{byte:02x} at byte {offset}: this is not a pickle, or uses an unsupported form")]
    UnknownOpcode {
        /// The opcode byte.
        byte: u8,
        /// Offset of the opcode byte.
        offset: u64,
    },
    /// The opcodes are known but do not make a valid pickle.
    #[error("malformed pickle at byte {offset}: {reason}")]
    Malformed {
        /// Offset of the offending opcode.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The input asks for more nesting, stack or memory than the limits allow.
    #[error("limit exceeded at byte {offset}: {what}")]
    Limit {
        /// Offset of the opcode that crossed the limit.
        offset: u64,
        /// Which limit, with its value.
        what: String,
    },
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The path that failed.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Returns the byte offset the error refers to, if it came from the input.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Error::Truncated { offset, .. }
            | Error::Refused { offset, .. }
            | Error::UnknownOpcode { offset, .. }
            | Error::Malformed { offset, .. }
            | Error::Limit { offset, .. } => Some(*offset),
            Error::Io { .. } => None,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
