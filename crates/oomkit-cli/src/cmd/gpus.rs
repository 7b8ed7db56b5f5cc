//! `oomkit gpus`: the GPUs, their memory, utilization and processes.

use crate::args::FormatArgs;
use crate::exit::gpu_exit;
use crate::output::{print_json, say};
use crate::EXIT_OK;
use std::io::Write;

/// Flags of `oomkit gpus`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    format: FormatArgs,
}

/// `oomkit gpus`.
pub(crate) fn run(a: Args) -> u8 {
    let json = a.format.json();
    match oomkit_gpu::probe() {
        Ok(gpus) => {
            if json {
                print_json(&gpus);
            } else {
                let _ = write!(std::io::stdout().lock(), "{}", oomkit_gpu::table(&gpus));
            }
            EXIT_OK
        }
        Err(e) => {
            say(&e.to_string());
            gpu_exit(&e)
        }
    }
}
