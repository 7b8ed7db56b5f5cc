//! Claims: small files, written under a lock, that tell other oomkit
//! processes on this machine which GPUs a job has taken.
//!
//! NVML's free memory lags a job's start by seconds to minutes (the CUDA
//! context, then the model, then the first batch). Two jobs that read it in
//! that window both see the GPU as free. A claim covers the window: it stays
//! until the job that wrote it ends, and other jobs subtract what it reserved.

use crate::procinfo::start_time;
use crate::GpuError;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The environment variable that moves the claim directory, for tests and for machines with a private /tmp.
pub(crate) const CLAIMS_ENV: &str = "OOMKIT_CLAIMS_DIR";

/// One job's hold on one GPU.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Claim {
    /// The GPU, as [`crate::gpu_key`] names it.
    pub gpu: String,
    /// The GPU's index when the claim was made, for messages.
    pub index: u32,
    /// The oomkit process that holds the claim.
    pub pid: u32,
    /// That process's start time, so a reused pid does not keep a dead claim alive.
    pub start_time: Option<u64>,
    /// Bytes the job expects to use; `None` takes the whole GPU.
    pub reserved_bytes: Option<u64>,
    /// The GPU's free memory when the claim was made.
    pub free_at_claim: u64,
}

impl Claim {
    /// Bytes of this claim not yet visible as used memory, given the GPU's free memory now.
    pub fn outstanding(&self, free_now: u64) -> u64 {
        match self.reserved_bytes {
            None => u64::MAX,
            Some(r) => r.saturating_sub(self.free_at_claim.saturating_sub(free_now)),
        }
    }

    fn is_live(&self) -> bool {
        // SAFETY: kill with signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(self.pid as libc::pid_t, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        exists && (self.start_time.is_none() || start_time(self.pid) == self.start_time)
    }
}

/// The directory of claim files shared by every oomkit process on the machine.
#[derive(Clone, Debug)]
pub struct ClaimDir {
    path: PathBuf,
}

/// The held lock on a claim directory; dropping it unlocks.
pub struct Locked<'a> {
    dir: &'a ClaimDir,
    _file: File,
}

/// Claims this process holds; dropping the value releases them.
#[derive(Debug)]
pub struct Held {
    files: Vec<PathBuf>,
}

impl Drop for Held {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl ClaimDir {
    /// The directory named by `OOMKIT_CLAIMS_DIR`, or `oomkit-claims` in the system's temporary directory.
    pub fn default_location() -> ClaimDir {
        let path = std::env::var_os(CLAIMS_ENV)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("oomkit-claims"));
        ClaimDir { path }
    }

    /// A claim directory at `path`.
    pub fn at(path: impl Into<PathBuf>) -> ClaimDir {
        ClaimDir { path: path.into() }
    }

    /// Where the claims live.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn fail(&self, path: &Path, e: impl std::fmt::Display) -> GpuError {
        let _ = self;
        GpuError::Claims {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }

    /// Takes the directory's lock, creating the directory so that every user on the machine can share it.
    pub fn lock(&self) -> Result<Locked<'_>, GpuError> {
        if !self.path.is_dir() {
            std::fs::create_dir_all(&self.path).map_err(|e| self.fail(&self.path, e))?;
            // Sticky and world-writable like /tmp: every user's jobs claim here, none can delete another's.
            let _ = std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o1777));
        }
        let lock_path = self.path.join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o666)
            .open(&lock_path)
            .inspect(|f| {
                // The umask trims the mode; other users' jobs must open it too.
                let _ = f.set_permissions(std::fs::Permissions::from_mode(0o666));
            })
            // Another user's lock file may be read-only to us; flock works on that too.
            .or_else(|_| File::open(&lock_path))
            .map_err(|e| self.fail(&lock_path, e))?;
        loop {
            // SAFETY: flock on a file descriptor we own; it blocks until the lock is ours.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(self.fail(&lock_path, err));
            }
        }
        Ok(Locked {
            dir: self,
            _file: file,
        })
    }
}

impl Locked<'_> {
    /// The claims of live processes; claims left by dead ones are deleted.
    pub fn live_claims(&self) -> Result<Vec<Claim>, GpuError> {
        let dir = &self.dir.path;
        let entries = std::fs::read_dir(dir).map_err(|e| self.dir.fail(dir, e))?;
        let mut claims = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "claim") {
                continue;
            }
            let claim: Option<Claim> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            match claim {
                Some(c) if c.is_live() => claims.push(c),
                // A dead holder's claim, or a torn one from a crash mid-write.
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        claims.sort_by_key(|c| (c.index, c.pid));
        Ok(claims)
    }

    /// Writes claims for this process; they last until the returned value is dropped or the process dies.
    pub fn write(&self, claims: &[Claim]) -> Result<Held, GpuError> {
        let mut held = Held { files: Vec::new() };
        for c in claims {
            let name: String = c
                .gpu
                .chars()
                .map(|ch| {
                    if ch.is_ascii_alphanumeric() || ch == '-' {
                        ch
                    } else {
                        '_'
                    }
                })
                .collect();
            let path = self.dir.path.join(format!("{name}.{}.claim", c.pid));
            let body = serde_json::to_vec(c).map_err(|e| self.dir.fail(&path, e))?;
            std::fs::write(&path, body).map_err(|e| self.dir.fail(&path, e))?;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644));
            held.files.push(path);
        }
        Ok(held)
    }
}

/// A claim on `gpu` for this process.
pub(crate) fn claim_for(gpu: &crate::Gpu, reserved_bytes: Option<u64>) -> Claim {
    let pid = std::process::id();
    Claim {
        gpu: crate::gpu_key(gpu),
        index: gpu.index,
        pid,
        start_time: start_time(pid),
        reserved_bytes,
        free_at_claim: gpu.free_bytes,
    }
}
