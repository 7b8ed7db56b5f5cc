//! The one input every format renders: a snapshot or a run log, analyzed,
//! with its raw data kept where a format draws from it.

use crate::CompareError;
use oomkit_snapshot::{analyze, Analysis, Layout, Options, Snapshot};

/// The analysis of one input file, with what is needed to present it.
pub struct FileAnalysis {
    /// The path as the user gave it.
    pub path: String,
    /// Size of the file in bytes.
    pub file_bytes: u64,
    /// The snapshot layout that was found.
    pub layout: Layout,
    /// The analysis itself.
    pub analysis: Analysis,
    /// The snapshot, where a format draws from it (the HTML page, the trace);
    /// `None` when only the analysis is needed, so a large one is not held.
    pub snapshot: Option<Snapshot>,
}

impl FileAnalysis {
    /// Analyzes a snapshot read from `path`, a file of `file_bytes` bytes.
    pub fn new(path: String, file_bytes: u64, snap: &Snapshot, opts: &Options) -> FileAnalysis {
        let mut analysis = analyze(snap, opts);
        // A fragmentation finding's fix is checked by replaying the trace with it.
        crate::fixes::replay_fixes(snap, &mut analysis);
        FileAnalysis {
            path,
            file_bytes,
            layout: snap.layout.clone(),
            analysis,
            snapshot: None,
        }
    }

    /// Analyzes a snapshot and keeps it, for the formats that draw from it.
    pub fn keeping(path: String, file_bytes: u64, snap: Snapshot, opts: &Options) -> FileAnalysis {
        let mut fa = FileAnalysis::new(path, file_bytes, &snap, opts);
        fa.snapshot = Some(snap);
        fa
    }

    /// The OOM the verdict is about (its device and trace entry), else the
    /// first OOM of any device; `None` for a file without one.
    pub fn first_oom(&self) -> Option<(i64, &oomkit_snapshot::OomReport)> {
        let v = &self.analysis.verdict;
        let named = self.analysis.devices.iter().find_map(|d| {
            let on = v.place.device.as_deref() == Some(format!("cuda:{}", d.device).as_str());
            d.ooms
                .iter()
                .find(|o| on && v.place.event == Some(o.event_index))
                .map(|o| (d.device, o))
        });
        named.or_else(|| {
            self.analysis
                .devices
                .iter()
                .find_map(|d| d.ooms.first().map(|o| (d.device, o)))
        })
    }

    /// The snapshot kept for a format that draws from it; an internal error
    /// naming the file when it was loaded without it.
    pub fn kept(&self) -> Result<&Snapshot, CompareError> {
        self.snapshot.as_ref().ok_or_else(|| not_kept(&self.path))
    }
}

impl RunFile {
    /// The records kept for a format that draws from them; an internal error
    /// naming the file when it was loaded without them.
    pub fn kept(&self) -> Result<&oomkit_runlog::Run, CompareError> {
        self.run.as_ref().ok_or_else(|| not_kept(&self.path))
    }
}

/// The error for a file loaded without the raw data a format draws from.
fn not_kept(path: &str) -> CompareError {
    CompareError::NotKept {
        file: path.to_string(),
    }
}

/// The analysis of one run log written by the Python tracker.
pub struct RunFile {
    /// The path as the user gave it.
    pub path: String,
    /// The run log's analysis.
    pub analysis: oomkit_runlog::Analysis,
    /// The records, where a format draws from them (the HTML page, the trace).
    pub run: Option<oomkit_runlog::Run>,
}

/// One analyzed input, a snapshot or a run log: what text, JSON, HTML, Perfetto, diff and the rank table all take.
pub enum Report {
    /// A PyTorch memory snapshot.
    Snapshot(Box<FileAnalysis>),
    /// An oomkit run log.
    Run(Box<RunFile>),
}

impl Report {
    /// Returns the path of the file, as the user gave it.
    pub fn path(&self) -> &str {
        match self {
            Report::Snapshot(fa) => &fa.path,
            Report::Run(rf) => &rf.path,
        }
    }

    /// What failed, where, why and the first fix; or the peak and the most important finding.
    pub fn verdict(&self) -> &oomkit_snapshot::Verdict {
        match self {
            Report::Snapshot(fa) => &fa.analysis.verdict,
            Report::Run(rf) => &rf.analysis.verdict,
        }
    }
}
