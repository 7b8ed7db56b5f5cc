//! The `oomkit` command: a thin shell over the oomkit libraries.
//!
//! The binary and the Python package's console script both call [`main`].
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod commands;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oomkit_report::{FileAnalysis, HtmlInput, RankSource, Report, RunFile};
use oomkit_snapshot::{Options, Snapshot};
use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

/// The snapshot that `oomkit demo` analyzes; made by scripts/make_demo_snapshot.py.
const DEMO: &[u8] = include_bytes!("../assets/demo_snapshot.pickle");
const DEMO_NAME: &str = "demo_snapshot.pickle (bundled)";
/// Files larger than this get a progress bar when stderr is a terminal.
const PROGRESS_MIN_BYTES: u64 = 50 << 20;

/// Exit code for success.
pub const EXIT_OK: u8 = 0;
/// Exit code for a bug in oomkit.
pub const EXIT_INTERNAL: u8 = 1;
/// Exit code for bad input or usage.
pub const EXIT_INPUT: u8 = 2;
/// Exit code when a GPU is needed and the machine has none (or no driver).
pub const EXIT_NO_GPU: u8 = 3;
/// Exit code when no GPU qualified before `--wait` ran out.
pub const EXIT_WAIT_TIMEOUT: u8 = 4;
/// Exit code from `find-batch` when not even the smallest micro-batch fits.
pub const EXIT_NOTHING_FITS: u8 = 5;

#[derive(Parser)]
#[command(
    name = "oomkit",
    version,
    about = "Find out why PyTorch ran out of GPU memory."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Analyze PyTorch memory snapshots (torch.cuda.memory._dump_snapshot) or oomkit run logs.
    Analyze {
        /// Snapshot files or run logs (the format is detected); several files give one report each.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        report: ReportArgs,
    },
    /// List the GPUs: memory, utilization and processes.
    Gpus {
        /// Print JSON: a list of GPUs.
        #[arg(long)]
        json: bool,
    },
    /// Run a training command on the freest GPU, retrying after an OOM with a smaller micro-batch.
    Run(commands::RunArgs),
    /// Find the largest micro-batch that fits, in a few runs of the command.
    FindBatch(commands::FindBatchArgs),
    /// Explain a PyTorch out-of-memory message (an argument, or a whole log on stdin).
    Explain(commands::ExplainArgs),
    /// Estimate the memory a training run needs, before running it.
    Estimate(commands::EstimateArgs),
    /// Export a snapshot or run log for another viewer (Perfetto, chrome://tracing).
    Export {
        /// Write Chrome trace-event JSON, which ui.perfetto.dev and chrome://tracing open.
        #[arg(long, required = true)]
        perfetto: bool,
        /// The snapshot or run log.
        file: PathBuf,
        /// Where to write the trace; `-` for standard output.
        #[arg(short, long, value_name = "PATH")]
        output: PathBuf,
        /// Most memory samples per device; more are thinned by min/max buckets (0 keeps all).
        #[arg(long, default_value_t = 200_000, value_name = "N")]
        max_points: usize,
        /// Replace the output file if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Compare two snapshots or two run logs, such as before and after a fix.
    Diff {
        /// The first file ("before").
        a: PathBuf,
        /// The second file ("after"), of the same kind.
        b: PathBuf,
        /// Print JSON: {"devices": [...]}.
        #[arg(long)]
        json: bool,
        /// How many changed sites to list per device (JSON lists them all).
        #[arg(long, default_value_t = 10, value_name = "N")]
        top: usize,
        /// Only this CUDA device index.
        #[arg(long, value_name = "D")]
        device: Option<i64>,
    },
    /// Write a self-contained HTML report (charts, tables, findings) that opens offline.
    Report {
        /// Snapshots or run logs; several files (one per rank) are also compared side by side.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Where to write the page.
        #[arg(short, long, value_name = "PATH")]
        output: PathBuf,
        /// Most memory samples per device in the page; more are thinned by min/max buckets (0 keeps all).
        #[arg(long, default_value_t = 50_000, value_name = "N")]
        max_points: usize,
        /// How many allocation sites to list.
        #[arg(long, default_value_t = 20, value_name = "N")]
        top: usize,
        /// Only this CUDA device index.
        #[arg(long, value_name = "D")]
        device: Option<i64>,
        /// Replace the output file if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Analyze the snapshot bundled in oomkit, to see a report with no set-up.
    Demo {
        #[command(flatten)]
        report: ReportArgs,
        /// Also write the bundled snapshot to this new file (never overwrites).
        #[arg(long, value_name = "PATH")]
        save: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct ReportArgs {
    /// Print JSON: one object for one file, an array for several.
    #[arg(long)]
    json: bool,
    /// How many allocation sites to list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,
    /// Only this CUDA device index.
    #[arg(long, value_name = "D")]
    device: Option<i64>,
}

/// Runs the command line `args` (program name first) and returns the exit code.
pub fn main(args: impl IntoIterator<Item = OsString>) -> u8 {
    // A bug must end in one line and exit code 1, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("oomkit: internal error{at}: {msg} (please report this)");
    }));
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { EXIT_INPUT } else { EXIT_OK };
        }
    };
    std::panic::catch_unwind(|| run(cli)).unwrap_or(EXIT_INTERNAL)
}

fn options(r: &ReportArgs) -> Options {
    Options {
        top: r.top,
        device: r.device,
    }
}

fn run(cli: Cli) -> u8 {
    match cli.command {
        Command::Gpus { json } => commands::gpus(json),
        Command::Run(args) => commands::run(args),
        Command::FindBatch(args) => commands::find_batch(args),
        Command::Explain(args) => commands::explain(args),
        Command::Estimate(args) => commands::estimate(args),
        Command::Analyze { files, report } => {
            let mut results = Vec::new();
            let mut failed = false;
            for path in &files {
                match load(path, &options(&report)) {
                    Ok(fa) => results.push(Ok(fa)),
                    Err(msg) => {
                        eprintln!("oomkit: {msg}");
                        failed = true;
                        results.push(Err((path.display().to_string(), msg)));
                    }
                }
            }
            emit(&results, &report);
            if failed {
                EXIT_INPUT
            } else {
                EXIT_OK
            }
        }
        Command::Export {
            perfetto: _,
            file,
            output,
            max_points,
            force,
        } => match export(&file, max_points).and_then(|trace| {
            // Written as it is encoded: a trace that keeps every entry of a
            // large snapshot runs to hundreds of megabytes.
            write_output_with(&output, force, &mut |w| {
                serde_json::to_writer(&mut *w, &trace).map_err(std::io::Error::from)
            })
        }) {
            Ok(()) => EXIT_OK,
            Err(msg) => {
                eprintln!("oomkit: {msg}");
                EXIT_INPUT
            }
        },
        Command::Diff {
            a,
            b,
            json,
            top,
            device,
        } => {
            // Every site, so that one below a cut does not look vanished.
            let opts = Options {
                top: usize::MAX,
                device,
            };
            let (ra, rb) = match (load(&a, &opts), load(&b, &opts)) {
                (Ok(x), Ok(y)) => (x, y),
                (Err(msg), _) | (_, Err(msg)) => {
                    eprintln!("oomkit: {msg}");
                    return EXIT_INPUT;
                }
            };
            let diff = match (&ra, &rb) {
                (Report::Snapshot(x), Report::Snapshot(y)) => oomkit_report::diff_snapshots(x, y),
                (Report::Run(x), Report::Run(y)) => oomkit_report::diff_runs(x, y),
                _ => {
                    eprintln!(
                        "oomkit: cannot compare {} with {}: one is a snapshot and the other a run log",
                        a.display(),
                        b.display()
                    );
                    return EXIT_INPUT;
                }
            };
            let mut out = std::io::stdout().lock();
            if json {
                let doc = serde_json::to_value(&diff).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "{}",
                    serde_json::to_string_pretty(&doc).unwrap_or_default()
                );
            } else {
                let _ = write!(out, "{}", oomkit_report::diff_text(&diff, top));
            }
            EXIT_OK
        }
        Command::Report {
            files,
            output,
            max_points,
            top,
            device,
            force,
        } => {
            let opts = Options { top, device };
            let mut loaded = Vec::new();
            for path in &files {
                match load_full(path, &opts) {
                    Ok(l) => loaded.push(l),
                    Err(msg) => {
                        eprintln!("oomkit: {msg}");
                        return EXIT_INPUT;
                    }
                }
            }
            let inputs: Vec<HtmlInput> = loaded.iter().map(Loaded::html_input).collect();
            let page = oomkit_report::html_report(&inputs, max_points);
            match write_output(&output, page.as_bytes(), force) {
                Ok(()) => EXIT_OK,
                Err(msg) => {
                    eprintln!("oomkit: {msg}");
                    EXIT_INPUT
                }
            }
        }
        Command::Demo { report, save } => {
            if let Some(path) = save {
                if let Err(msg) = save_new(&path, DEMO) {
                    eprintln!("oomkit: {msg}");
                    return EXIT_INPUT;
                }
                eprintln!("oomkit: wrote the demo snapshot to {}", path.display());
            }
            match Snapshot::from_bytes(DEMO) {
                Ok(snap) => {
                    let fa = FileAnalysis::new(
                        DEMO_NAME.into(),
                        DEMO.len() as u64,
                        &snap,
                        &options(&report),
                    );
                    emit(&[Ok(Report::Snapshot(Box::new(fa)))], &report);
                    EXIT_OK
                }
                Err(e) => {
                    eprintln!("oomkit: internal error: the bundled snapshot is unreadable: {e}");
                    EXIT_INTERNAL
                }
            }
        }
    }
}

/// Builds the Perfetto trace of a snapshot or run log.
fn export(path: &Path, max_points: usize) -> Result<oomkit_report::Trace, String> {
    let shown = path.display().to_string();
    if looks_like_run_log(path) {
        let run = oomkit_runlog::Run::read(path).map_err(|e| format!("{shown}: {e}"))?;
        return Ok(oomkit_report::run_trace(&shown, &run));
    }
    let snap = Snapshot::load(path, &mut |_, _| {}).map_err(|e| format!("{shown}: {e}"))?;
    let analysis = oomkit_snapshot::analyze(&snap, &Options::default());
    Ok(oomkit_report::snapshot_trace(
        &shown, &snap, &analysis, max_points,
    ))
}

/// Writes a document to `path`, or to standard output for `-`.
fn write_output(path: &Path, text: &[u8], force: bool) -> Result<(), String> {
    write_output_with(path, force, &mut |w| w.write_all(text))
}

/// Writes what `fill` produces to `path`, or to standard output for `-`.
fn write_output_with(
    path: &Path,
    force: bool,
    fill: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), String> {
    if path.as_os_str() == "-" {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        return fill(&mut out)
            .and_then(|_| out.write_all(b"\n"))
            .and_then(|_| out.flush())
            .map_err(|e| format!("standard output: {e}"));
    }
    let written = write_file_with(path, force, "pass --force to replace it", fill)?;
    eprintln!(
        "oomkit: wrote {} ({})",
        path.display(),
        oomkit_units::human_bytes(written)
    );
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file beside it, so that a
/// failure never leaves half a file behind. An existing file is replaced
/// only when `replace` is set; otherwise the error says so, with `hint`.
fn write_file(path: &Path, bytes: &[u8], replace: bool, hint: &str) -> Result<(), String> {
    write_file_with(path, replace, hint, &mut |w| w.write_all(bytes)).map(|_| ())
}

/// Counts the bytes that pass through it.
struct Counted<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes what `fill` produces to `path` as [`write_file`] does, returning
/// how many bytes it wrote.
fn write_file_with(
    path: &Path,
    replace: bool,
    hint: &str,
    fill: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
) -> Result<u64, String> {
    let shown = path.display();
    // Creating the target first claims its name, so that a file appearing
    // meanwhile is never replaced by the rename below.
    let claimed = !replace;
    if claimed {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(format!("{shown}: already exists ({hint})"))
            }
            Err(e) => return Err(format!("{shown}: {e}")),
        }
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".oomkit-{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp).and_then(|f| {
        let mut out = Counted {
            inner: std::io::BufWriter::new(f),
            bytes: 0,
        };
        fill(&mut out)?;
        out.flush()?;
        Ok(out.bytes)
    });
    match written.and_then(|n| std::fs::rename(&tmp, path).map(|_| n)) {
        Ok(n) => Ok(n),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            if claimed {
                let _ = std::fs::remove_file(path);
            }
            Err(format!("{shown}: {e}"))
        }
    }
}

/// Writes `bytes` to a file that must not exist yet.
fn save_new(path: &Path, bytes: &[u8]) -> Result<(), String> {
    write_file(path, bytes, false, "oomkit never overwrites a file")
}

/// A file read for a report: its analysis and what the charts need.
enum Loaded {
    Snapshot(Box<(FileAnalysis, Snapshot)>),
    Run(Box<(RunFile, oomkit_runlog::Run)>),
}

impl Loaded {
    fn html_input(&self) -> HtmlInput<'_> {
        match self {
            Loaded::Snapshot(b) => HtmlInput::Snapshot(&b.0, &b.1),
            Loaded::Run(b) => HtmlInput::Run(&b.0, &b.1),
        }
    }
}

fn load(path: &Path, opts: &Options) -> Result<Report, String> {
    Ok(match load_full(path, opts)? {
        Loaded::Snapshot(b) => Report::Snapshot(Box::new(b.0)),
        Loaded::Run(b) => Report::Run(Box::new(b.0)),
    })
}

fn load_full(path: &Path, opts: &Options) -> Result<Loaded, String> {
    let shown = path.display().to_string();
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if looks_like_run_log(path) {
        let run = oomkit_runlog::Run::read(path).map_err(|e| format!("{shown}: {e}"))?;
        let rf = RunFile {
            path: shown,
            analysis: oomkit_runlog::analyze(&run),
        };
        return Ok(Loaded::Run(Box::new((rf, run))));
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
    let fa = FileAnalysis::new(shown, file_bytes, &snap, opts);
    Ok(Loaded::Snapshot(Box::new((fa, snap))))
}

/// The lines that head a report of several files: which one failed first, and its verdict.
fn job_verdict(order: &[&Report], first_known: bool) -> String {
    let verdicts: Vec<_> = order.iter().map(|r| (r.path(), r.verdict())).collect();
    let failed = verdicts.iter().filter(|(_, v)| v.failed).count();
    let mut out = format!("== verdict ({} files)\n", verdicts.len());
    match verdicts.first() {
        Some((path, v)) if v.failed => {
            let which = if first_known || failed == 1 {
                "failed first"
            } else {
                "failed (the files do not tell which was first)"
            };
            let others = if failed > 1 {
                format!("; {} of {} files recorded an OOM", failed, verdicts.len())
            } else {
                String::new()
            };
            out.push_str(&format!("{path} {which}{others}\n{}", v.text()));
        }
        _ => out.push_str(&format!("no OOM in any of the {} files\n", verdicts.len())),
    }
    out.push('\n');
    out
}

/// Pickles start with the PROTO opcode; run logs with a JSON object.
fn looks_like_run_log(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 64];
    let n = std::fs::File::open(path)
        .and_then(|mut f| f.read(&mut head))
        .unwrap_or(0);
    oomkit_runlog::is_run_log(&head[..n])
}

type Outcome = Result<Report, (String, String)>;

fn emit(results: &[Outcome], report: &ReportArgs) {
    let mut out = std::io::stdout().lock();
    let ok: Vec<&Report> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let ranks =
        oomkit_report::rank_table(&ok.iter().map(|r| RankSource::from(*r)).collect::<Vec<_>>());
    let logs: Vec<&oomkit_runlog::Analysis> = ok
        .iter()
        .filter_map(|r| match r {
            Report::Run(rf) => Some(&rf.analysis),
            Report::Snapshot(_) => None,
        })
        .collect();
    // Only a job that stepped down has attempts worth a table.
    let attempts = Some(oomkit_runlog::attempts(&logs)).filter(|a| a.len() > 1);
    if report.json {
        let values: Vec<serde_json::Value> = results
            .iter()
            .map(|r| match r {
                Ok(rep) => {
                    let mut v = rep.json();
                    if let (false, Some(m)) = (ranks.is_empty(), v.as_object_mut()) {
                        let mine: Vec<_> =
                            ranks.iter().filter(|row| row.file == rep.path()).collect();
                        m.insert("multi_rank".into(), serde_json::json!(mine));
                    }
                    if let (Report::Run(_), Some(a), Some(m)) = (rep, &attempts, v.as_object_mut())
                    {
                        m.insert("attempts".into(), serde_json::json!(a));
                    }
                    v
                }
                Err((file, error)) => serde_json::json!({"file": file, "error": error}),
            })
            .collect();
        let doc = if values.len() == 1 {
            values.into_iter().next().unwrap_or_default()
        } else {
            serde_json::Value::Array(values)
        };
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).unwrap_or_default()
        );
    } else {
        // Several files: the job's verdict first, then the file that failed first.
        let first = ranks
            .iter()
            .find(|r| r.failed_first)
            .map(|r| r.file.clone());
        let mut order: Vec<&Report> = ok.clone();
        order.sort_by_key(|r| Some(r.path().to_string()) != first);
        if ok.len() > 1 {
            let _ = write!(out, "{}", job_verdict(&order, first.is_some()));
        }
        for (i, r) in order.iter().enumerate() {
            if i > 0 {
                let _ = writeln!(out);
            }
            let _ = write!(out, "{}", r.text());
        }
        if !ranks.is_empty() {
            let _ = write!(out, "\n{}", oomkit_report::rank_text(&ranks));
        }
        if let Some(a) = &attempts {
            let _ = write!(out, "\n{}", oomkit_report::attempts_text(a));
        }
    }
}
