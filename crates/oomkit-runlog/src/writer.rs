//! Appending records to a run log.

use crate::error::{Error, Result};
use serde_json::Value;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Record types after which the log is flushed: a crash, or the kernel's
/// OOM killer, loses at most the stage in progress, so that a killed run's
/// last records are as near its death as they can be (a write per stage
/// costs microseconds against a step's milliseconds).
const FLUSH_AFTER: &[&str] = &[
    "start",
    "stage",
    "step",
    "phase",
    "oom",
    "duplicates",
    "end",
    "error",
];

/// Appends run-log records to a new file, one JSON object per line.
pub struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    records: u64,
}

impl Writer {
    /// Creates the log file, with its parent folders; an existing file is never overwritten.
    pub fn create(path: &Path) -> Result<Writer> {
        let io = |source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io)?;
        Ok(Writer {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(64 << 10, file),
            records: 0,
        })
    }

    /// Returns the log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Returns how many records were written.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Appends one record (a JSON object with a string `type`), flushing at stage and step boundaries.
    pub fn write(&mut self, record: &Value) -> Result<()> {
        let kind = record
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Record("a record needs a string 'type'".into()))?;
        let flush = FLUSH_AFTER.contains(&kind);
        let io = |source| Error::Io {
            path: self.path.display().to_string(),
            source,
        };
        serde_json::to_writer(&mut self.out, record).map_err(|e| Error::Record(e.to_string()))?;
        self.out.write_all(b"\n").map_err(io)?;
        self.records += 1;
        if flush {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes buffered records to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|source| Error::Io {
            path: self.path.display().to_string(),
            source,
        })
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}
