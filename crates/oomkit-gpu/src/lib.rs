//! What the GPUs on this machine hold, which one a job should take, and
//! claims that stop two jobs from taking the same one.
//!
//! [`probe`] reads the GPUs through NVML, which is loaded at run time so one
//! binary works with and without a driver. Setting `OOMKIT_FAKE_GPUS` to a JSON
//! file replaces NVML with that file's contents, which is how every GPU code
//! path is tested on machines without one.
//!
//! ```
//! use oomkit_gpu::{choose, Gpu, Request};
//! let gpu = |index: u32, free_gib: u64| Gpu {
//!     index,
//!     name: "NVIDIA H100 80GB HBM3".into(),
//!     uuid: None,
//!     total_bytes: 80 << 30,
//!     free_bytes: free_gib << 30,
//!     used_bytes: (80 - free_gib) << 30,
//!     utilization_percent: None,
//!     processes: Vec::new(),
//! };
//! let gpus = [gpu(0, 10), gpu(1, 70)];
//! let req = Request { count: 1, min_free: Some(40 << 30), exclude: Vec::new() };
//! // The freest GPU with at least 40 GiB free.
//! assert_eq!(choose(&gpus, &[], &req).unwrap()[0].index, 1);
//! ```

mod claim;
mod fake;
pub mod host;
mod nvml;
pub mod procinfo;
mod select;

pub use claim::{Claim, ClaimDir, Held};
pub use select::{acquire, choose, Acquired, Request, Wait};

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The environment variable that selects the fake backend.
pub const FAKE_ENV: &str = "OOMKIT_FAKE_GPUS";

/// One GPU and what it holds right now.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Gpu {
    /// The NVML index, which is the PCI bus order that `CUDA_DEVICE_ORDER=PCI_BUS_ID` gives.
    pub index: u32,
    /// The product name, such as "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// The GPU's UUID, stable across reboots and renumbering.
    #[serde(default)]
    pub uuid: Option<String>,
    /// Memory on the board.
    pub total_bytes: u64,
    /// Memory no process holds.
    pub free_bytes: u64,
    /// Memory held by processes and the driver.
    pub used_bytes: u64,
    /// Percent of the last sample period in which a kernel ran, where NVML reports it.
    #[serde(default)]
    pub utilization_percent: Option<u32>,
    /// The processes using the GPU.
    #[serde(default)]
    pub processes: Vec<GpuProcess>,
}

/// A process that holds memory on a GPU.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GpuProcess {
    /// The process id as NVML reports it (the host's, inside containers).
    pub pid: u32,
    /// The owner's user name, where the process is visible from here.
    #[serde(default)]
    pub user: Option<String>,
    /// The command line, where the process is visible from here.
    #[serde(default)]
    pub command: Option<String>,
    /// GPU memory the process holds, where the driver reports it.
    #[serde(default)]
    pub used_bytes: Option<u64>,
}

/// Why the GPUs could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The NVIDIA driver library is not installed or cannot be loaded.
    #[error("no NVIDIA GPU driver on this machine ({0})")]
    NoDriver(String),
    /// The driver loaded but reports no GPU.
    #[error("the NVIDIA driver reports no GPU")]
    NoGpu,
    /// NVML answered with an error.
    #[error("NVML: {0}")]
    Nvml(String),
    /// The fake backend's file could not be used.
    #[error("{path}: {message} (set by {FAKE_ENV})")]
    Fake {
        /// The file named by `OOMKIT_FAKE_GPUS`.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The claim directory could not be used.
    #[error("{path}: {message}")]
    Claims {
        /// The claim directory or file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// No GPU qualified before the wait ran out.
    #[error("{0}")]
    TimedOut(String),
    /// The caller asked the wait to end.
    #[error("stopped while waiting for a GPU")]
    Stopped,
    /// The request can never be met on this machine, so waiting is pointless.
    #[error("{0}")]
    Unsatisfiable(String),
}

impl GpuError {
    /// True when the machine simply has no GPU, as opposed to a GPU that could not be read.
    pub fn is_absent(&self) -> bool {
        matches!(self, GpuError::NoDriver(_) | GpuError::NoGpu)
    }
}

/// Reads every GPU, from the fake backend when `OOMKIT_FAKE_GPUS` is set and from NVML otherwise.
pub fn probe() -> Result<Vec<Gpu>, GpuError> {
    let gpus = match std::env::var_os(FAKE_ENV) {
        Some(path) if !path.is_empty() => fake::read(PathBuf::from(path).as_path())?,
        _ => nvml::read()?,
    };
    if gpus.is_empty() {
        return Err(GpuError::NoGpu);
    }
    Ok(gpus)
}

/// The key a claim uses for a GPU: its UUID where known, its index otherwise.
pub fn gpu_key(gpu: &Gpu) -> String {
    gpu.uuid
        .clone()
        .unwrap_or_else(|| format!("index-{}", gpu.index))
}
