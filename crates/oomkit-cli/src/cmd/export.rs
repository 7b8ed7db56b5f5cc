//! `oomkit export --perfetto`: `analyze` as a trace another viewer opens, written to a file.

use super::analyze::analyze_files;
use crate::output::Dest;
use oomkit_report::Output;
use oomkit_snapshot::Options;
use std::path::PathBuf;

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
    let output = match a.format {
        TraceFormat::Perfetto => Output::Perfetto {
            max_points: a.max_points,
        },
    };
    let _ = a.perfetto;
    analyze_files(
        std::slice::from_ref(&a.file),
        &Options::default(),
        output,
        Dest::File {
            path: &a.output,
            force: a.force,
        },
    )
}
