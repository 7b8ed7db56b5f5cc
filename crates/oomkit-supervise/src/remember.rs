//! The last plan that finished, per command and GPU model, so that the next
//! `oomkit run` of the same command starts from it instead of failing its
//! way down again.
//!
//! One small JSON file (`plans.json`) in the user's cache directory:
//! `$OOMKIT_CACHE_DIR`, else `$XDG_CACHE_HOME/oomkit`, else
//! `~/.cache/oomkit`. It is written whole through a temporary file and a
//! rename, so a reader never sees half of it; a damaged file is ignored.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

/// Names the folder of the plan memory, for tests and shared machines.
pub const CACHE_ENV: &str = "OOMKIT_CACHE_DIR";

/// How many commands the file keeps; the oldest are dropped beyond it.
const MAX_ENTRIES: usize = 200;

/// A plan that finished.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct Remembered {
    /// The micro-batch it finished with.
    pub micro_batch: u64,
    /// The accumulation it finished with.
    pub grad_accum: u64,
    /// The allocator settings oomkit added, if any.
    pub alloc_conf: Option<String>,
    /// When it finished, seconds since the epoch.
    pub time: u64,
}

/// Where finished plans are kept.
#[derive(Clone, Debug)]
pub struct PlanMemory {
    path: PathBuf,
}

impl PlanMemory {
    /// The memory in the user's cache directory, or `None` where there is no home to keep it in.
    pub fn default_location() -> Option<PlanMemory> {
        let var = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let dir = var(CACHE_ENV)
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("oomkit")))
            .or_else(|| var("HOME").map(|d| d.join(".cache").join("oomkit")))?;
        Some(PlanMemory {
            path: dir.join("plans.json"),
        })
    }

    /// The file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The key of a command on a GPU model for an effective batch: what must match to reuse a plan.
    pub fn key(command: &[OsString], gpu_model: &str, effective_batch: u64) -> String {
        let argv: Vec<String> = command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        format!(
            "{gpu_model} | effective {effective_batch} | {}",
            argv.join(" ")
        )
    }

    fn load(&self) -> BTreeMap<String, Remembered> {
        std::fs::read(&self.path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// The plan that last finished under `key`, if any.
    pub fn recall(&self, key: &str) -> Option<Remembered> {
        self.load().remove(key)
    }

    /// Keeps `plan` as the one that finished under `key`; failures to write are returned, not fatal.
    pub fn remember(&self, key: &str, plan: Remembered) -> std::io::Result<()> {
        let mut all = self.load();
        all.insert(key.to_string(), plan);
        while all.len() > MAX_ENTRIES {
            let oldest = all
                .iter()
                .min_by_key(|(_, r)| r.time)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => all.remove(&k),
                None => break,
            };
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self
            .path
            .with_extension(format!("json.{}.tmp", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec_pretty(&all)?)?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_per_key_survives_a_damaged_file_and_keeps_a_bounded_list() {
        let dir = std::env::temp_dir().join(format!("oomkit-remember-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let memory = PlanMemory {
            path: dir.join("plans.json"),
        };
        let cmd: Vec<OsString> = vec!["python".into(), "train.py".into(), "{batch_size}".into()];
        let key = PlanMemory::key(&cmd, "NVIDIA H100 80GB HBM3", 128);
        assert_eq!(memory.recall(&key), None);
        let plan = Remembered {
            micro_batch: 8,
            grad_accum: 16,
            alloc_conf: Some("expandable_segments:True".into()),
            time: 1,
        };
        memory.remember(&key, plan.clone()).unwrap();
        assert_eq!(memory.recall(&key), Some(plan.clone()));
        assert_eq!(
            memory.recall(&PlanMemory::key(&cmd, "NVIDIA A100", 128)),
            None
        );
        assert_eq!(
            memory.recall(&PlanMemory::key(&cmd, "NVIDIA H100 80GB HBM3", 256)),
            None
        );
        std::fs::write(memory.path(), b"{ not json").unwrap();
        assert_eq!(memory.recall(&key), None);
        for i in 0..(MAX_ENTRIES as u64 + 5) {
            let k = PlanMemory::key(&cmd, &format!("gpu {i}"), 1);
            memory
                .remember(
                    &k,
                    Remembered {
                        time: i,
                        ..plan.clone()
                    },
                )
                .unwrap();
        }
        let kept = memory.load();
        assert_eq!(kept.len(), MAX_ENTRIES);
        assert!(!kept.contains_key(&PlanMemory::key(&cmd, "gpu 0", 1)));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
