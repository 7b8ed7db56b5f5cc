//! `oomkit export --perfetto`: a snapshot or run log as a trace another viewer opens.

use crate::load::{load, Keep};
use crate::output::write_output_with;
use crate::{EXIT_INPUT, EXIT_OK};
use oomkit_snapshot::Options;
use std::path::{Path, PathBuf};

/// The trace formats `export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TraceFormat {
    /// Chrome trace-event JSON.
    Perfetto,
}

/// Flags of `oomkit export`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The trace format: Chrome trace-event JSON, which ui.perfetto.dev and chrome://tracing open.
    #[arg(long, value_enum, default_value = "perfetto", value_name = "FORMAT")]
    format: TraceFormat,
    /// The same as --format perfetto.
    #[arg(long)]
    perfetto: bool,
    /// The snapshot or run log.
    file: PathBuf,
    /// Where to write the trace; `-` for standard output.
    #[arg(short, long, value_name = "PATH")]
    output: PathBuf,
    /// Most memory samples per device; more are thinned by min/max buckets (0 keeps all).
    #[arg(long, default_value_t = oomkit_report::TRACE_MAX_POINTS, value_name = "N")]
    max_points: usize,
    /// Replace the output file if it exists.
    #[arg(long)]
    force: bool,
}

/// `oomkit export`.
pub(crate) fn run(a: Args) -> u8 {
    // --perfetto names the one format there is, which --format also names.
    let TraceFormat::Perfetto = a.format;
    let _ = a.perfetto;
    match export(&a.file, a.max_points).and_then(|trace| {
        // Written as it is encoded: a trace that keeps every entry of a
        // large snapshot runs to hundreds of megabytes.
        write_output_with(&a.output, a.force, &mut |w| {
            serde_json::to_writer(&mut *w, &trace).map_err(std::io::Error::from)
        })
    }) {
        Ok(()) => EXIT_OK,
        Err(msg) => {
            eprintln!("oomkit: {msg}");
            EXIT_INPUT
        }
    }
}

/// Builds the Perfetto trace of a snapshot or run log.
fn export(path: &Path, max_points: usize) -> Result<oomkit_report::Trace, String> {
    let report = load(path, &Options::default(), Keep::Raw)?;
    oomkit_report::trace(&report, max_points)
}
