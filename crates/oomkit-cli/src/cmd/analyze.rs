//! `oomkit analyze`: the report of snapshots and run logs, with the verdict
//! first and, for several files, the ranks and attempts; as text, JSON, the
//! HTML page or a Perfetto trace.

use crate::args::{FileFormatArgs, Format};
use crate::load::{load, Keep};
use crate::output::{print, say, write_output, write_output_with};
use crate::{EXIT_INPUT, EXIT_INTERNAL, EXIT_OK};
use oomkit_compare::{Job, Unreadable};
use oomkit_snapshot::Options;
use std::path::{Path, PathBuf};

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
    let format = a.report.format.format();
    if format == Format::Perfetto && a.files.len() > 1 {
        say("--format perfetto: a trace is one file's timeline; give one file, or run `oomkit export FILE -o TRACE.json` for each");
        return EXIT_INPUT;
    }
    // The page and the trace draw from the raw data; the other formats need only the analysis.
    let keep = match format {
        Format::Html | Format::Perfetto => Keep::Raw,
        Format::Text | Format::Json => Keep::Analysis,
    };
    let mut files = Vec::new();
    let mut failed = false;
    for path in &a.files {
        match load(path, &options(&a.report), keep) {
            Ok(report) => files.push(Ok(report)),
            Err(msg) => {
                say(&msg);
                failed = true;
                files.push(Err(Unreadable {
                    file: path.display().to_string(),
                    error: msg,
                }));
            }
        }
    }
    let code = emit(&Job::new(files), &a.report);
    if failed {
        EXIT_INPUT
    } else {
        code
    }
}

/// Prints the files of one command line in the format asked for, returning
/// the exit code for what printing them took.
pub(crate) fn emit(job: &Job, report: &ReportArgs) -> u8 {
    let stdout = Path::new("-");
    let written = match report.format.format() {
        format @ (Format::Text | Format::Json) => {
            print(format, job);
            Ok(())
        }
        Format::Html => oomkit_report::html_report(&job.read(), oomkit_report::PAGE_MAX_POINTS)
            .and_then(|page| write_output(stdout, page.as_bytes(), false)),
        Format::Perfetto => match job.read().first() {
            Some(r) => oomkit_report::trace(r, oomkit_report::TRACE_MAX_POINTS).and_then(|t| {
                write_output_with(stdout, false, &mut |w| {
                    serde_json::to_writer(&mut *w, &t).map_err(std::io::Error::from)
                })
            }),
            // The one file given could not be read; that was said already.
            None => Ok(()),
        },
    };
    match written {
        Ok(()) => EXIT_OK,
        Err(msg) => {
            say(&msg);
            EXIT_INTERNAL
        }
    }
}
