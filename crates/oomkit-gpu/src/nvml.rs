//! The NVML backend.

use crate::procinfo::{describe, user_names};
use crate::{Gpu, GpuError, GpuProcess};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// NVML is initialised once per process: init is slow, and repeated init/shutdown leaks in some drivers.
fn nvml() -> Result<&'static Nvml, GpuError> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| GpuError::NoDriver(e.clone()))
}

fn nvml_err(e: NvmlError) -> GpuError {
    GpuError::Nvml(e.to_string())
}

/// Reads every GPU NVML can see.
pub(crate) fn read() -> Result<Vec<Gpu>, GpuError> {
    let nvml = nvml()?;
    let count = nvml.device_count().map_err(nvml_err)?;
    let users = user_names();
    let mut gpus = Vec::new();
    for i in 0..count {
        let dev = nvml.device_by_index(i).map_err(nvml_err)?;
        let mem = dev.memory_info().map_err(nvml_err)?;
        // Compute and graphics lists overlap for some processes; keep one row per pid.
        let mut procs: BTreeMap<u32, Option<u64>> = BTreeMap::new();
        let lists = [
            dev.running_compute_processes(),
            dev.running_graphics_processes(),
        ];
        for list in lists.into_iter().flatten() {
            for p in list {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                };
                let slot = procs.entry(p.pid).or_insert(None);
                *slot = (*slot).max(used);
            }
        }
        let processes = procs
            .into_iter()
            .map(|(pid, used_bytes)| {
                let (user, command) = describe(pid, &users);
                GpuProcess {
                    pid,
                    user,
                    command,
                    used_bytes,
                }
            })
            .collect();
        gpus.push(Gpu {
            index: dev.index().unwrap_or(i),
            name: dev.name().unwrap_or_else(|_| "unknown GPU".into()),
            uuid: dev.uuid().ok(),
            total_bytes: mem.total,
            free_bytes: mem.free,
            used_bytes: mem.used,
            utilization_percent: dev.utilization_rates().ok().map(|u| u.gpu),
            processes,
        });
    }
    Ok(gpus)
}
