//! `oomkit diff`: two snapshots or two run logs compared, before and after a fix.

use crate::args::FormatArgs;
use crate::exit::{EXIT_INPUT, EXIT_OK};
use crate::load::{load, Keep};
use crate::output::print;
use oomkit_compare::Report;
use oomkit_snapshot::Options;
use std::path::PathBuf;

/// Flags of `oomkit diff`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The first file ("before").
    a: PathBuf,
    /// The second file ("after"): of the same kind, or a snapshot against a run log (compared by role).
    b: PathBuf,
    #[command(flatten)]
    format: FormatArgs,
    /// How many changed sites to list per device (JSON lists them all).
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,
    /// Only this CUDA device index.
    #[arg(long, value_name = "D")]
    device: Option<i64>,
}

/// `oomkit diff`.
pub(crate) fn run(args: Args) -> u8 {
    // Every site, so that one below a cut does not look vanished.
    let opts = Options {
        top: usize::MAX,
        device: args.device,
    };
    let (ra, rb) = match (
        load(&args.a, &opts, Keep::Analysis),
        load(&args.b, &opts, Keep::Analysis),
    ) {
        (Ok(x), Ok(y)) => (x, y),
        (Err(msg), _) | (_, Err(msg)) => {
            eprintln!("oomkit: {msg}");
            return EXIT_INPUT;
        }
    };
    let diff = match (&ra, &rb) {
        (Report::Snapshot(x), Report::Snapshot(y)) => oomkit_compare::diff_snapshots(x, y),
        (Report::Run(x), Report::Run(y)) => oomkit_compare::diff_runs(x, y),
        // A snapshot and a run log share only their roles.
        _ => match oomkit_compare::diff_mixed(&ra, &rb) {
            Some(d) => d,
            None => unreachable!("two files are two snapshots, two run logs, or one of each"),
        },
    };
    print(
        args.format.output(),
        &oomkit_report::Compared {
            diff: &diff,
            top: args.top,
        },
    );
    EXIT_OK
}
