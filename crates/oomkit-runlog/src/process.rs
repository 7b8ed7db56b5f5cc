//! This process's resident memory: the CPU tracker's measure of memory.

/// Returns the process's resident set size in bytes, or 0 where it cannot be read.
pub fn rss_bytes() -> u64 {
    // statm's second field is resident pages; reading it costs one small read.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page_size())
}

/// Returns the process's peak resident set size (VmHWM) in bytes, or 0 where it cannot be read.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

/// Resets the peak resident set size to the current one; returns false where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    // Linux 4.0+: writing 5 to clear_refs resets VmHWM, which gives a true
    // per-stage peak without sampling.
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(unix)]
fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the running system.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

#[cfg(not(unix))]
fn page_size() -> u64 {
    4096
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_grows_with_touched_memory_and_peak_resets() {
        if rss_bytes() == 0 {
            return; // not Linux
        }
        let before = rss_bytes();
        let v = vec![1u8; 64 << 20];
        let during = rss_bytes();
        assert!(during >= before + (60 << 20), "{before} -> {during}");
        assert!(peak_rss_bytes() >= during);
        drop(v);
        if reset_peak_rss() {
            assert!(peak_rss_bytes() < during);
        }
    }
}
