//! Running one child command: its own process group, output teed and
//! scanned for OOM messages, and signals passed on to the whole group.

use crate::oom::detect;
use crate::SuperviseError;
use oomkit_gpu::host::{OomKill, OomKillWatch};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The signals passed on to the child; a second one of the same kind escalates to SIGKILL.
const FORWARDED: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
/// How long group members left behind by the child get between SIGTERM and SIGKILL.
const STRAGGLER_GRACE: Duration = Duration::from_secs(3);
/// Longest line kept for OOM parsing; PyTorch's message is under 1 KiB.
const MAX_LINE: usize = 64 << 10;

/// A command to run, with what to add to its environment.
#[derive(Clone, Debug, Default)]
pub struct Spec {
    /// The program and its arguments.
    pub argv: Vec<OsString>,
    /// Variables to set.
    pub env: Vec<(OsString, OsString)>,
    /// Pass the command's standard output on to oomkit's standard error, so
    /// that oomkit's own stdout carries JSON alone (`--json`), as cargo does
    /// with `--message-format json`.
    pub stdout_to_stderr: bool,
    /// The most private memory the command may map (`RLIMIT_DATA`): past it,
    /// its allocations fail as on a machine with that much memory.
    pub data_limit: Option<u64>,
}

/// How a child ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The exit code, or 128 + n when a signal killed it (the shell's convention).
    pub exit_code: i32,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    /// The first OOM message line in its output, if any.
    pub oom_line: Option<String>,
    /// The command's own error, as its standard error last put it: the last
    /// line naming an exception (Python's `ModuleNotFoundError: ...`), else
    /// the last line written there; `None` where it wrote nothing. Where both
    /// streams go to one place they are read as one, as the user sees them.
    pub error_line: Option<String>,
    /// The signal oomkit received and passed on, if the user stopped the run.
    pub interrupted_by: Option<i32>,
    /// Wall time.
    pub duration: Duration,
    /// The largest resident set of the command or any descendant it waited for, as the kernel counted it.
    pub max_rss_bytes: Option<u64>,
    /// Set when SIGKILL ended the command while the kernel recorded an OOM kill: it ran out of host memory.
    pub oom_kill: Option<OomKill>,
}

/// The last forwardable signal received, or 0; shared by every child this process runs.
fn pending_signal() -> &'static Arc<AtomicUsize> {
    static FLAG: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicUsize::new(0));
        for sig in FORWARDED {
            // Registration fails only for forbidden signals, which these are not.
            let _ = signal_hook::flag::register_usize(sig, Arc::clone(&flag), sig as usize);
        }
        flag
    })
}

/// Starts catching SIGINT, SIGTERM and SIGHUP, so they reach children instead of ending oomkit.
pub fn catch_signals() {
    let _ = pending_signal();
}

/// The signal received since the last call, if any (0 when none).
pub fn take_signal() -> Option<i32> {
    match pending_signal().swap(0, Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
    }
}

/// Makes the process `cmd` starts get SIGTERM when the thread that started it ends (on Linux;
/// elsewhere nothing), so that an oomkit killed by a time limit or a scheduler leaves no
/// script running behind it.
///
/// The kernel ties the signal to the thread that forked, not to the process: that thread
/// must wait for the child, as [`Command::status`] does.
pub fn end_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getpid touches no memory.
        let parent = unsafe { libc::getpid() };
        // SAFETY: between fork and exec only prctl and getppid run, both async-signal-safe;
        // the error is made from a number, without allocating.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Where oomkit ended before the line above, no signal would come: start nothing.
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

fn signal_group(pgid: i32, sig: i32) -> bool {
    // SAFETY: kill on a negative pid signals the process group; no memory is involved.
    unsafe { libc::kill(-pgid, sig) == 0 }
}

/// What the child's output said, read as it passes.
#[derive(Debug, Default)]
struct Heard {
    /// The first OOM message line, on either stream.
    oom: Option<String>,
    /// The last line of standard error naming an exception.
    error: Option<String>,
    /// The last line of standard error that was not blank.
    last: Option<String>,
}

/// Whether a line of standard error names an exception as Python prints
/// one at the end of a traceback (`ModuleNotFoundError: No module named 'x'`,
/// `torch.OutOfMemoryError: ...`, a bare `AssertionError`).
fn names_an_exception(line: &str) -> bool {
    static PATTERN: OnceLock<regex::Regex> = OnceLock::new();
    PATTERN
        .get_or_init(|| {
            regex::Regex::new(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)(:.*)?$")
                .expect("a valid pattern")
        })
        .is_match(line)
}

/// Copies one of the child's streams to ours, noting the first OOM line it
/// carries and, for standard error, the command's own error.
fn tee(
    mut from: impl Read,
    mut to: impl Write,
    heard: Arc<Mutex<Heard>>,
    is_stderr: bool,
    done: mpsc::Sender<()>,
) {
    let mut buf = vec![0u8; 16 << 10];
    let mut line: Vec<u8> = Vec::new();
    let scan = |line: &[u8]| {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end();
        let oom = detect(text).is_some();
        if !(oom || is_stderr) || text.trim().is_empty() {
            return;
        }
        if let Ok(mut h) = heard.lock() {
            if oom && h.oom.is_none() {
                h.oom = Some(text.to_string());
            }
            if is_stderr {
                if names_an_exception(text) {
                    h.error = Some(text.to_string());
                }
                h.last = Some(text.to_string());
            }
        }
    };
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        // A closed terminal must not stop the child's output from being drained.
        let _ = to.write_all(&buf[..n]);
        let _ = to.flush();
        for &b in &buf[..n] {
            if b == b'\n' || b == b'\r' {
                scan(&line);
                line.clear();
            } else if line.len() < MAX_LINE {
                line.push(b);
            }
        }
    }
    if !line.is_empty() {
        scan(&line);
    }
    let _ = done.send(());
}

/// The variables that hand GPUs `ids` (NVML indices) to a CUDA program.
pub fn visible_devices(ids: &[u32]) -> [(OsString, OsString); 2] {
    let list: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    [
        // NVML numbers GPUs in PCI bus order; CUDA's default order differs.
        ("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()),
        ("CUDA_VISIBLE_DEVICES".into(), list.join(",").into()),
    ]
}

/// Runs `spec` to the end, teeing its output and passing on signals; `tick` is called every 20 ms while it runs.
pub fn run(spec: &Spec, tick: &mut dyn FnMut(u32)) -> Result<Outcome, SuperviseError> {
    catch_signals();
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(SuperviseError::Usage("no command given".into()));
    };
    let started = Instant::now();
    // The OOM-kill counters before the command runs, to compare after a SIGKILL.
    let watch = OomKillWatch::start();
    let mut cmd = Command::new(program);
    if std::env::var_os("PYTHONUNBUFFERED").is_none() {
        // Through a pipe Python buffers its output; the OOM line must arrive before the exit.
        cmd.env("PYTHONUNBUFFERED", "1");
    }
    cmd.args(args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::inherit())
        // Its own group, so one kill reaches torchrun and every worker it starts.
        .process_group(0);
    // Where oomkit itself is killed (SIGKILL, which it cannot pass on), the command is told
    // to stop: torchrun passes that to its workers, as it does the signals passed on below.
    end_with_parent(&mut cmd);
    // Where both of the command's streams end up in one place, one pipe keeps
    // them in the order the command wrote them; two relayed pipes would let
    // a line of one overtake a line of the other.
    let cannot_start = |e: std::io::Error| SuperviseError::Spawn {
        program: program.to_string_lossy().into_owned(),
        message: e.to_string(),
    };
    let merged = if spec.stdout_to_stderr || same_destination(1, 2) {
        let (reader, writer) = std::io::pipe().map_err(cannot_start)?;
        let copy = writer.try_clone().map_err(cannot_start)?;
        cmd.stdout(copy).stderr(writer);
        Some(reader)
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        None
    };
    if let Some(limit) = spec.data_limit {
        let limit = limit as libc::rlim_t;
        // SAFETY: between fork and exec only setrlimit runs, which is
        // async-signal-safe and touches nothing of the parent's.
        unsafe {
            cmd.pre_exec(move || {
                let rl = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: limit,
                };
                if libc::setrlimit(libc::RLIMIT_DATA, &rl) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().map_err(cannot_start)?;
    // The command's copies of the shared pipe's write end live in `cmd`; the
    // reader sees the end of the output only once they are closed here.
    drop(cmd);
    let pgid = child.id() as i32;
    let heard = Arc::new(Mutex::new(Heard::default()));
    let (done_tx, done_rx) = mpsc::channel();
    let mut readers = 0;
    // The shared pipe is read as standard error: the command's own error is looked for in it.
    if let Some(both) = merged {
        relay(both, spec.stdout_to_stderr, true, &heard, &done_tx);
        readers += 1;
    }
    if let Some(out) = child.stdout.take() {
        relay(out, spec.stdout_to_stderr, false, &heard, &done_tx);
        readers += 1;
    }
    if let Some(err) = child.stderr.take() {
        relay(err, true, true, &heard, &done_tx);
        readers += 1;
    }
    drop(done_tx);

    let mut interrupted_by = None;
    let (status, rusage) = loop {
        if let Some(sig) = take_signal() {
            // The same signal twice means the user wants it over now.
            let escalate = interrupted_by == Some(sig);
            signal_group(pgid, if escalate { libc::SIGKILL } else { sig });
            interrupted_by = Some(sig);
        }
        match try_wait4(pgid) {
            Ok(Some(done)) => break done,
            Ok(None) => {
                tick(pgid as u32);
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                signal_group(pgid, libc::SIGKILL);
                return Err(SuperviseError::Wait(e.to_string()));
            }
        }
    };
    reap_group(pgid);
    // Output still buffered in the pipes is drained; a process that left the
    // group and holds them open must not hang oomkit.
    for _ in 0..readers {
        if done_rx.recv_timeout(Duration::from_secs(2)).is_err() {
            break;
        }
    }
    let (oom_line, error_line) = match heard.lock() {
        Ok(mut h) => (h.oom.take(), h.error.take().or_else(|| h.last.take())),
        Err(_) => (None, None),
    };
    let signal = status.signal();
    // Only a SIGKILL nobody here sent can be the kernel's OOM killer.
    let oom_kill = (signal == Some(libc::SIGKILL) && interrupted_by.is_none())
        .then(|| watch.since())
        .flatten();
    Ok(Outcome {
        exit_code: status.code().unwrap_or_else(|| 128 + signal.unwrap_or(0)),
        signal,
        oom_line,
        error_line,
        interrupted_by,
        duration: started.elapsed(),
        // Linux reports ru_maxrss in KiB.
        max_rss_bytes: (rusage.ru_maxrss > 0).then(|| rusage.ru_maxrss as u64 * 1024),
        oom_kill,
    })
}

/// Copies one of the child's pipes to our standard error (`to_stderr`) or output on a thread
/// of its own; `is_stderr`: the pipe carries the command's standard error.
fn relay(
    from: impl Read + Send + 'static,
    to_stderr: bool,
    is_stderr: bool,
    heard: &Arc<Mutex<Heard>>,
    done: &mpsc::Sender<()>,
) {
    let (heard, done) = (Arc::clone(heard), done.clone());
    if to_stderr {
        std::thread::spawn(move || tee(from, std::io::stderr(), heard, is_stderr, done));
    } else {
        std::thread::spawn(move || tee(from, std::io::stdout(), heard, is_stderr, done));
    }
}

/// Whether two of our file descriptors write to the same file, pipe or
/// terminal (`2>&1`, or both on one terminal), as `fstat` tells.
fn same_destination(a: i32, b: i32) -> bool {
    let stat = |fd: i32| {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a whole `stat` into the buffer on success and
        // touches nothing else; a closed descriptor only returns -1.
        (unsafe { libc::fstat(fd, st.as_mut_ptr()) } == 0)
            .then(|| unsafe { st.assume_init() })
            .map(|st| (st.st_dev, st.st_ino))
    };
    matches!((stat(a), stat(b)), (Some(x), Some(y)) if x == y)
}

/// `wait4` without blocking: the child's status and its resource use once it has ended.
///
/// std's `try_wait` drops the resource use; `wait4` returns it with the
/// status, including the largest resident set of the child and of the
/// descendants it waited for, which is the peak `oomkit find-batch` needs
/// when no tracker reports one.
fn try_wait4(pid: i32) -> std::io::Result<Option<(std::process::ExitStatus, libc::rusage)>> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: an all-zero rusage is a valid value; wait4 writes both out-parameters and nothing else.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        match r {
            0 => return Ok(None),
            r if r == pid => {
                return Ok(Some((std::process::ExitStatus::from_raw(status), usage)));
            }
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Ends whatever is left of the child's process group: SIGTERM, a grace period, then SIGKILL.
fn reap_group(pgid: i32) {
    if !signal_group(pgid, 0) {
        return;
    }
    signal_group(pgid, libc::SIGTERM);
    let deadline = Instant::now() + STRAGGLER_GRACE;
    while Instant::now() < deadline {
        if !signal_group(pgid, 0) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    signal_group(pgid, libc::SIGKILL);
}
