//! `oomkit find-batch`: the largest micro-batch that fits, in a few runs.

use crate::args::FormatArgs;
use crate::args::{positive, size, WaitArgs};
use crate::exit::supervise_exit;
use crate::exit::{EXIT_NOTHING_FITS, EXIT_OK};
use crate::output::{print, say};
use oomkit_gpu::ClaimDir;
use oomkit_supervise::find_batch::FindBatchOptions;
use std::ffi::OsString;

/// Flags of `oomkit find-batch`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The first micro-batch to try.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "B")]
    start: u64,
    /// The largest micro-batch worth trying.
    #[arg(long, value_parser = positive, default_value_t = 4096, value_name = "B")]
    max: u64,
    /// Fraction of memory to leave free.
    #[arg(long, default_value_t = 0.1, value_name = "FRACTION")]
    margin: f64,
    /// Effective batch to reach with gradient accumulation.
    #[arg(long, value_parser = positive, value_name = "N")]
    effective: Option<u64>,
    /// Memory to fit in, instead of the chosen GPU's free memory.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    capacity: Option<u64>,
    #[command(flatten)]
    wait: WaitArgs,
    #[command(flatten)]
    format: FormatArgs,
    /// The command, after `--`, with {batch_size} where the micro-batch goes.
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// `oomkit find-batch`.
pub(crate) fn run(a: Args) -> u8 {
    let opts = FindBatchOptions {
        command: a.command,
        start: a.start,
        max: a.max,
        margin: a.margin,
        effective: a.effective,
        capacity: a.capacity,
        wait: a.wait.wait(),
        claims: ClaimDir::default_location(),
        child_stdout_to_stderr: a.format.json(),
    };
    match oomkit_supervise::find_batch::find_batch(&opts, &mut |m| say(m)) {
        Ok(report) => {
            print(a.format.output(), &report);
            if report.recommended_batch.is_some() {
                EXIT_OK
            } else {
                EXIT_NOTHING_FITS
            }
        }
        Err(e) => {
            say(&e.to_string());
            supervise_exit(&e)
        }
    }
}
