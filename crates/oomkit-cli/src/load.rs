//! Reading the files the reports are made of: a snapshot or a run log,
//! told apart by their first bytes, with a progress bar for large snapshots.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oomkit_compare::{FileAnalysis, Report, RunFile};
use oomkit_snapshot::{Options, Snapshot};
use std::io::IsTerminal;
use std::path::Path;

/// Files larger than this get a progress bar when stderr is a terminal.
const PROGRESS_MIN_BYTES: u64 = 50 << 20;

/// Whether a loaded file keeps its raw data beside its analysis.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Only the analysis: what text and JSON need; a large snapshot is freed at once.
    Analysis,
    /// The snapshot or the run log's records too: what the HTML page and the trace draw from.
    Raw,
}

/// What a file is, from its size and first bytes.
struct Opened {
    shown: String,
    bytes: u64,
    run_log: bool,
}

/// Looks at a file before reading it: a snapshot or a run log (`logs`), or one line saying what it is instead.
fn open(path: &Path, logs: bool) -> Result<Opened, String> {
    let shown = path.display().to_string();
    let what = if logs {
        "a snapshot or run log"
    } else {
        "a snapshot"
    };
    let bytes = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => return Err(format!("{shown}: is a directory, not {what}")),
        Ok(m) => m.len(),
        Err(e) => return Err(format!("{shown}: {}", io_problem(&e))),
    };
    let head = first_bytes(path);
    let run_log = oomkit_runlog::is_run_log(&head);
    if !run_log && head.first() != Some(&PICKLE_PROTO) {
        return Err(format!(
            "{shown}: not a PyTorch memory snapshot{}: it starts with {}; \
             record a snapshot with torch.cuda.memory._dump_snapshot(\"snap.pickle\") \
             (README, \"Record a snapshot in PyTorch\")",
            if logs { " or an oomkit run log" } else { "" },
            preview(&head)
        ));
    }
    Ok(Opened {
        shown,
        bytes,
        run_log,
    })
}

/// Reads and analyzes one file, or says in one line why it cannot.
pub(crate) fn load(path: &Path, opts: &Options, keep: Keep) -> Result<Report, String> {
    let Opened {
        shown,
        bytes: file_bytes,
        run_log,
    } = open(path, true)?;
    if run_log {
        let run = oomkit_runlog::Run::read(path).map_err(|e| format!("{shown}: {e}"))?;
        let analysis = oomkit_runlog::analyze(&run);
        return Ok(Report::Run(Box::new(RunFile {
            path: shown,
            analysis,
            run: (keep == Keep::Raw).then_some(run),
        })));
    }
    let snap = read_snapshot(path, &shown, file_bytes, opts.device)?;
    let fa = match keep {
        Keep::Raw => FileAnalysis::keeping(shown, file_bytes, snap, opts),
        Keep::Analysis => FileAnalysis::new(shown, file_bytes, &snap, opts),
    };
    Ok(Report::Snapshot(Box::new(fa)))
}

/// Reads a snapshot, with a progress bar when large, and checks that it
/// holds the device asked for.
fn read_snapshot(
    path: &Path,
    shown: &str,
    file_bytes: u64,
    device: Option<i64>,
) -> Result<Snapshot, String> {
    let bar = (file_bytes >= PROGRESS_MIN_BYTES && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::with_draw_target(Some(file_bytes), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(format!("reading {shown}"));
        b
    });
    let snap = Snapshot::load(path, &mut |pos, _| {
        if let Some(b) = &bar {
            b.set_position(pos as u64);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let snap = snap.map_err(|e| format!("{shown}: {e}"))?;
    if let Some(want) = device {
        let held = snap.devices();
        if !held.contains(&want) {
            let list: Vec<String> = held.iter().map(|d| d.to_string()).collect();
            return Err(format!(
                "{shown}: --device {want}: the snapshot holds {}",
                if list.is_empty() {
                    "no device".to_string()
                } else {
                    format!("device {} only", list.join(", "))
                }
            ));
        }
    }
    Ok(snap)
}

/// Reads a file that must be a snapshot (not a run log), or says in one
/// line why it cannot; `why` says what a run log lacks for the command.
pub(crate) fn load_snapshot(
    path: &Path,
    device: Option<i64>,
    why: &str,
) -> Result<Snapshot, String> {
    let o = open(path, false)?;
    if o.run_log {
        return Err(format!("{}: is an oomkit run log; {why}", o.shown));
    }
    read_snapshot(path, &o.shown, o.bytes, device)
}

/// Every snapshot PyTorch writes is a pickle of protocol 2 or later, which starts with PROTO.
const PICKLE_PROTO: u8 = 0x80;

/// Whether a file starts as a snapshot does (what `load` reads it as).
pub(crate) fn is_snapshot(path: &Path) -> bool {
    first_bytes(path).first() == Some(&PICKLE_PROTO)
}

/// The first bytes of a file, empty where it cannot be read.
fn first_bytes(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut head = vec![0u8; 64];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    head.truncate(n);
    head
}

/// What a file starts with, for a message: its text where it is text, else its bytes in hex.
fn preview(head: &[u8]) -> String {
    let shown = &head[..head.len().min(24)];
    if shown.is_empty() {
        return "nothing (it is empty)".into();
    }
    match std::str::from_utf8(shown) {
        Ok(t) if t.chars().all(|c| !c.is_control() || c == '\n' || c == '\t') => {
            format!("{:?}", t)
        }
        _ => shown
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// An I/O failure in the words a user needs, without the OS error number.
fn io_problem(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}
