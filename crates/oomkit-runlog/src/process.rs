//! This process's resident memory: the CPU tracker's measure of memory.

/// The resident set in bytes from the text of `/proc/self/statm` (its second field, in pages).
fn statm_resident(text: &str) -> Option<u64> {
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

/// The peak resident set (VmHWM) in bytes from the text of `/proc/self/status`.
fn status_hwm(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line["VmHWM:".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Returns the process's resident set size in bytes, or 0 where it cannot be read.
pub fn rss_bytes() -> u64 {
    // statm's second field is resident pages; reading it costs one small read.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| statm_resident(&s))
        .unwrap_or(0)
}

/// Returns the process's peak resident set size (VmHWM) in bytes, or 0 where it cannot be read.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| status_hwm(&s))
        .unwrap_or(0)
}

/// Resets the peak resident set size to the current one; returns false where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    // Linux 4.0+: writing 5 to clear_refs resets VmHWM, which gives a true
    // per-stage peak without sampling.
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Open handles on this process's `/proc` files, the pid they belong to,
/// and the most that `getrusage` can report without it being the peak of
/// the interval since the last reset.
#[cfg(unix)]
struct ProcFiles {
    pid: u32,
    status: std::fs::File,
    statm: std::fs::File,
    clear_refs: Option<std::fs::File>,
    /// The least `getrusage` peak read right after a reset: at least the
    /// peak the kernel kept at exec, which it never resets.
    inherited: u64,
    /// The `getrusage` peak at the first sample: at least the peak kept at
    /// exec, so a later reading above it can only be the process's own.
    first: Option<u64>,
}

/// The handles, kept open so that a sample costs a read and a write instead of opens and closes.
#[cfg(unix)]
static PROC_FILES: std::sync::Mutex<Option<ProcFiles>> = std::sync::Mutex::new(None);

/// Largest `/proc/self/status` read; the file is about 1.5 KiB.
const STATUS_BUF: usize = 8192;

#[cfg(unix)]
fn getrusage_peak() -> u64 {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    // Linux reports ru_maxrss in KiB.
    (ru.ru_maxrss.max(0) as u64) * 1024
}

#[cfg(unix)]
fn status_peak(status: &std::fs::File) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; STATUS_BUF];
    let n = status.read_at(&mut buf, 0).ok()?;
    status_hwm(std::str::from_utf8(&buf[..n]).ok()?)
}

#[cfg(unix)]
fn statm_rss(statm: &std::fs::File) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 256];
    let n = statm.read_at(&mut buf, 0).ok()?;
    statm_resident(std::str::from_utf8(&buf[..n]).ok()?)
}

/// Returns the peak resident set size since the last reset and the resident set size now, in
/// bytes, and resets the peak when `reset` is true; `None` where `/proc` cannot be read.
///
/// The peak comes from `getrusage`, which costs no file read, whenever it
/// can only be the process's own: the kernel reports the larger of the
/// resettable peak (VmHWM) and a peak it keeps from exec on (that of the
/// image the process was exec'ed from: its parent's, after vfork), and only
/// changes at exec. Where the second may hide the process's own, the peak
/// is read from `/proc/self/status` instead. Without `reset` the process's
/// peak is never touched: other tools read it too.
#[cfg(unix)]
pub fn sample_rss(reset: bool) -> Option<(u64, u64)> {
    use std::io::Write;
    let mut guard = PROC_FILES.lock().ok()?;
    let pid = std::process::id();
    // A forked child inherits the handles, which still name its parent's files.
    if guard.as_ref().is_none_or(|f| f.pid != pid) {
        *guard = Some(ProcFiles {
            pid,
            status: std::fs::File::open("/proc/self/status").ok()?,
            statm: std::fs::File::open("/proc/self/statm").ok()?,
            clear_refs: std::fs::OpenOptions::new()
                .write(true)
                .open("/proc/self/clear_refs")
                .ok(),
            inherited: u64::MAX,
            first: None,
        });
    }
    let files = guard.as_mut()?;
    let ru = getrusage_peak();
    let now = statm_rss(&files.statm)?;
    // getrusage reports the larger of the process's high-water mark and the
    // peak the kernel kept at exec; above any bound on the second, it is the
    // first, read for free. The first sample's reading is such a bound
    // whether or not peaks are ever reset, so an unreset process that grows
    // past its first reading never needs the status file again.
    let first = *files.first.get_or_insert(ru);
    let peak = if ru > files.inherited || ru > first {
        ru
    } else {
        status_peak(&files.status)?
    };
    if let Some(f) = files.clear_refs.as_mut().filter(|_| reset) {
        // Writing 5 resets VmHWM to the current resident set (Linux 4.0+).
        if f.write_all(b"5").is_ok() {
            // Right after a reset, getrusage shows the larger of the resident
            // set and the kept peak: a bound on the kept peak, which gets
            // tighter each time the resident set is lower at a reset.
            files.inherited = files.inherited.min(getrusage_peak());
        }
    }
    Some((peak.max(now), now))
}

/// Returns `None`: only Linux's `/proc` gives these figures.
#[cfg(not(unix))]
pub fn sample_rss(_reset: bool) -> Option<(u64, u64)> {
    None
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

    /// The process's memory is shared by every test thread: one test measures at a time.
    static MEMORY: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// How far apart two readings of the resident set can be at one moment.
    const SLACK: u64 = 1 << 20;

    fn touched(bytes: usize) -> Vec<u8> {
        vec![1u8; bytes]
    }

    #[test]
    fn rss_grows_with_touched_memory_and_peak_resets() {
        let _one = MEMORY.lock();
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

    #[test]
    fn one_sample_reads_the_peak_and_the_current_set_and_resets() {
        let _one = MEMORY.lock();
        let Some((_, before)) = sample_rss(true) else {
            return; // not Linux
        };
        let v = vec![1u8; 64 << 20];
        let (peak, during) = sample_rss(true).expect("readable");
        assert!(during >= before + (60 << 20), "{before} -> {during}");
        assert!(peak >= during);
        drop(v);
        let (_, after) = sample_rss(false).expect("readable");
        let (peak_after, _) = sample_rss(true).expect("readable");
        if reset_peak_rss() {
            // The peak of the interval since the last reset, not of the process.
            assert!(peak_after < during, "{peak_after} >= {during}");
            assert!(peak_after >= after);
        }
    }

    /// Set in the child that `a_large_parent_does_not_inflate_later_peaks` starts.
    const CHILD_ENV: &str = "OOMKIT_TEST_PEAK_CHILD";

    #[test]
    fn a_large_parent_does_not_inflate_later_peaks() {
        let _one = MEMORY.lock();
        if std::env::var_os(CHILD_ENV).is_some() || sample_rss(true).is_none() || !reset_peak_rss()
        {
            return; // the child itself, or not Linux, or no resettable peak
        }
        // The kernel keeps, for good, the peak of the image a process was
        // exec'ed from (its parent's, after vfork), and getrusage reports it:
        // the child must not mistake it for its own.
        let held = touched(192 << 20);
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "process::tests::child_measures_its_own_peak",
                "--nocapture",
            ])
            .env(CHILD_ENV, "1")
            .output()
            .expect("child runs");
        drop(held);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains("child peaks ok"), "{said}");
    }

    #[test]
    fn child_measures_its_own_peak() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return; // run only as the child of the test above
        }
        let _ = sample_rss(true);
        let _ = sample_rss(true);
        let v = touched(16 << 20);
        let small = rss_bytes();
        drop(v);
        let (peak, now) = sample_rss(true).expect("readable");
        let inherited = getrusage_peak();
        assert!(peak + SLACK >= small, "{peak} < {small}");
        assert!(
            peak < small + (64 << 20),
            "peak {peak} is the parent's ({inherited}), not this interval's ({small}, now {now})"
        );
        // The parent reads this line to know the child's checks ran.
        let line =
            format!("child peaks ok: peak {peak}, interval {small}, inherited {inherited}\n");
        std::io::Write::write_all(&mut std::io::stdout(), line.as_bytes()).expect("stdout");
    }
}
