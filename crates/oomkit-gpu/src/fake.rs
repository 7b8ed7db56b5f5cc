//! The fake backend: GPUs read from a JSON file, re-read on every probe so a
//! test can change what the "GPUs" hold while a job waits.

use crate::{Gpu, GpuError};
use std::path::Path;

/// Reads the list of GPUs in the file named by `OOMKIT_FAKE_GPUS`.
pub(crate) fn read(path: &Path) -> Result<Vec<Gpu>, GpuError> {
    let fail = |message: String| GpuError::Fake {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let gpus: Vec<Gpu> = serde_json::from_str(&text).map_err(|e| {
        fail(format!(
            "not a JSON list of GPUs as `oomkit gpus --json` prints ({e})"
        ))
    })?;
    for g in &gpus {
        if g.free_bytes > g.total_bytes {
            return Err(fail(format!(
                "GPU {} has free_bytes above total_bytes",
                g.index
            )));
        }
    }
    Ok(gpus)
}
