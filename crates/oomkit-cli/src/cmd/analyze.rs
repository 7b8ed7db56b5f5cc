//! `oomkit analyze`: the report of snapshots and run logs, with the verdict
//! first and, for several files, the ranks and attempts; as text, JSON, the
//! HTML page or a Perfetto trace. `report` and `export` are this command
//! with another output and a file to write it to ([`analyze_files`]).

use crate::args::FileFormatArgs;
use crate::exit::EXIT_INPUT;
use crate::load::{load, Keep};
use crate::output::{emit_job, say, Dest};
use oomkit_compare::{Job, Unreadable};
use oomkit_report::{Needs, Output};
use oomkit_snapshot::Options;
use std::path::PathBuf;

/// Flags of `oomkit analyze`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Snapshot files or run logs (the format is detected); several files give one report each (an array in JSON) and are compared as the ranks of one job.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
}

/// The flags `analyze` and `demo` share: the format, how many sites, which device.
#[derive(clap::Args)]
pub(crate) struct ReportArgs {
    #[command(flatten)]
    pub(crate) format: FileFormatArgs,
    /// How many allocation sites to list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,
    /// Only this CUDA device index.
    #[arg(long, value_name = "D")]
    device: Option<i64>,
}

/// The analysis options these flags ask for.
pub(crate) fn options(r: &ReportArgs) -> Options {
    Options {
        top: r.top,
        device: r.device,
    }
}

/// `oomkit analyze`.
pub(crate) fn run(a: Args) -> u8 {
    analyze_files(
        &a.files,
        &options(&a.report),
        a.report.format.output(),
        Dest::Stdout,
    )
}

/// Reads, analyzes and writes `files` in `output` to `dest`: the body of
/// `analyze`, `report` and `export`.
///
/// A file that cannot be read is named in one line and the exit code is 2;
/// to standard output the others are still reported, while a file is
/// written only when every input was read, so that a page or trace never
/// silently leaves one out.
pub(crate) fn analyze_files(
    files: &[PathBuf],
    opts: &Options,
    output: Output,
    dest: Dest<'_>,
) -> u8 {
    if let Err(e) = output.check_files(files.len()) {
        say(&e.to_string());
        return EXIT_INPUT;
    }
    let keep = match output.needs() {
        Needs::Raw => Keep::Raw,
        Needs::Analysis => Keep::Analysis,
    };
    let mut read = Vec::new();
    let mut failed = false;
    for path in files {
        match load(path, opts, keep) {
            Ok(report) => read.push(Ok(report)),
            Err(msg) => {
                say(&msg);
                failed = true;
                read.push(Err(Unreadable {
                    file: path.display().to_string(),
                    error: msg,
                }));
            }
        }
    }
    if failed && matches!(dest, Dest::File { .. }) {
        return EXIT_INPUT;
    }
    let code = emit_job(&Job::new(read), output, dest);
    if failed {
        EXIT_INPUT
    } else {
        code
    }
}
