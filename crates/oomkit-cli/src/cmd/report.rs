//! `oomkit report`: one self-contained HTML page of snapshots and run logs.

use crate::load::{load, Keep};
use crate::output::write_output;
use crate::{EXIT_INPUT, EXIT_INTERNAL, EXIT_OK};
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
    /// How many allocation sites to list.
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
    let mut loaded = Vec::new();
    for path in &a.files {
        match load(path, &opts, Keep::Raw) {
            Ok(l) => loaded.push(l),
            Err(msg) => {
                eprintln!("oomkit: {msg}");
                return EXIT_INPUT;
            }
        }
    }
    let page = match oomkit_report::html_report(&loaded.iter().collect::<Vec<_>>(), a.max_points) {
        Ok(p) => p,
        Err(msg) => {
            eprintln!("oomkit: {msg}");
            return EXIT_INTERNAL;
        }
    };
    match write_output(&a.output, page.as_bytes(), a.force) {
        Ok(()) => EXIT_OK,
        Err(msg) => {
            eprintln!("oomkit: {msg}");
            EXIT_INPUT
        }
    }
}
