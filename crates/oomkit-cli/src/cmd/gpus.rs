//! `oomkit gpus`: the GPUs, their memory, utilization and processes.

use crate::args::FormatArgs;
use crate::exit::gpu_exit;
use crate::exit::EXIT_OK;
use crate::output::{print, say};

/// Flags of `oomkit gpus`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    format: FormatArgs,
}

/// `oomkit gpus`.
pub(crate) fn run(a: Args) -> u8 {
    match oomkit_gpu::probe() {
        Ok(gpus) => {
            print(a.format.output(), &oomkit_report::Gpus(&gpus));
            EXIT_OK
        }
        Err(e) => {
            say(&e.to_string());
            gpu_exit(&e)
        }
    }
}
