//! Reading the files the reports are made of: a snapshot or a run log,
//! told apart by their first bytes, with a progress bar for large snapshots.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oomkit_report::{FileAnalysis, Report, RunFile};
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

/// Reads and analyzes one file, or says in one line why it cannot.
pub(crate) fn load(path: &Path, opts: &Options, keep: Keep) -> Result<Report, String> {
    let shown = path.display().to_string();
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if looks_like_run_log(path) {
        let run = oomkit_runlog::Run::read(path).map_err(|e| format!("{shown}: {e}"))?;
        let analysis = oomkit_runlog::analyze(&run);
        return Ok(Report::Run(Box::new(RunFile {
            path: shown,
            analysis,
            run: (keep == Keep::Raw).then_some(run),
        })));
    }
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
    let fa = match keep {
        Keep::Raw => FileAnalysis::keeping(shown, file_bytes, snap, opts),
        Keep::Analysis => FileAnalysis::new(shown, file_bytes, &snap, opts),
    };
    Ok(Report::Snapshot(Box::new(fa)))
}

/// Pickles start with the PROTO opcode; run logs with a JSON object.
pub(crate) fn looks_like_run_log(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 64];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    oomkit_runlog::is_run_log(&head[..n])
}
