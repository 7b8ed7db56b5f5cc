//! The optimizers oomkit knows, and the state each keeps per trainable
//! parameter: what the estimate's formulas and a snapshot's role sizes both
//! count with.

use serde::Serialize;

/// The optimizer, which sets the state kept per trainable parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// Adam or AdamW: two moments.
    AdamW,
    /// bitsandbytes 8-bit AdamW: two one-byte moments.
    AdamW8bit,
    /// SGD with momentum: one buffer.
    Sgd,
    /// Adafactor without momentum: factored second moments, a row and a column per matrix.
    Adafactor,
}

impl Optimizer {
    /// Bytes of state per trainable parameter whose weights are stored in
    /// `store` bytes each; 0 for Adafactor, whose factored state depends on
    /// the matrix shapes (see `oomkit_estimate::estimate`).
    pub fn state_bytes_per_param(self, store: u64) -> u64 {
        match self {
            Optimizer::AdamW => 2 * store,
            // Two one-byte moments, whatever the weights' dtype.
            Optimizer::AdamW8bit => 2,
            Optimizer::Sgd => store,
            Optimizer::Adafactor => 0,
        }
    }
}
