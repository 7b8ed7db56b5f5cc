//! The one error type of the estimate.

/// Why an estimate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    /// The model config lacks a field the estimate needs.
    #[error("the config has no {0} (looked for {1})")]
    MissingField(&'static str, &'static str),
    /// The config is not a JSON object.
    #[error("not a Hugging Face model config: {0}")]
    NotAConfig(String),
    /// A value is out of range.
    #[error("{0}")]
    Invalid(String),
}
