//! `oomkit report`: `analyze` as one self-contained HTML page, written to a file.

use super::analyze::analyze_files;
use crate::output::Dest;
use oomkit_report::Output;
use oomkit_snapshot::Options;
use std::path::PathBuf;

/// Flags of `oomkit report`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Snapshots or run logs; several files (one per rank) are also compared side by side.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Where to write the page; `-` for standard output.
    #[arg(short, long, value_name = "PATH")]
    output: PathBuf,
    /// Most memory samples per device in the page; more are thinned by min/max buckets (0 keeps all).
    #[arg(long, default_value_t = oomkit_report::PAGE_MAX_POINTS, value_name = "N")]
    max_points: usize,
    /// How many allocation sites to list (the page has room for more than the terminal's 10).
    #[arg(long, default_value_t = 20, value_name = "N")]
    top: usize,
    /// Only this CUDA device index.
    #[arg(long, value_name = "D")]
    device: Option<i64>,
    /// Replace the output file if it exists.
    #[arg(long)]
    force: bool,
}

/// `oomkit report`.
pub(crate) fn run(a: Args) -> u8 {
    let opts = Options {
        top: a.top,
        device: a.device,
    };
    analyze_files(
        &a.files,
        &opts,
        Output::Html {
            max_points: a.max_points,
        },
        Dest::File {
            path: &a.output,
            force: a.force,
        },
    )
}
