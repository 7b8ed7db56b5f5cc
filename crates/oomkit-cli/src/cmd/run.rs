//! `oomkit run`: a training command supervised, on the freest GPU, retried after an OOM by its cause.

use crate::args::FormatArgs;
use crate::args::{positive, size, WaitArgs};
use crate::output::{must_be_new, print, say};
use oomkit_gpu::ClaimDir;
use oomkit_report::{Output, Render};
use oomkit_supervise::RunOptions;
use std::ffi::OsString;
use std::path::PathBuf;

/// Flags of `oomkit run`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// How many GPUs to give the command; 0 leaves CUDA_VISIBLE_DEVICES alone.
    #[arg(long, default_value_t = 1, value_name = "N")]
    gpus: usize,
    /// Free memory each GPU must have (80GiB, 20GB); without it a GPU is taken whole.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    min_free: Option<u64>,
    #[command(flatten)]
    wait: WaitArgs,
    /// Fail (exit 125) instead of running without a GPU when the machine has none.
    #[arg(long)]
    require_gpu: bool,
    /// The first micro-batch; fills {batch_size} and OOMKIT_MICRO_BATCH, and enables retries.
    #[arg(long, value_parser = positive, value_name = "B")]
    batch_size: Option<u64>,
    /// The first gradient accumulation.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "N")]
    grad_accum: u64,
    /// The effective batch to keep (default: batch size x accumulation).
    #[arg(long, value_parser = positive, value_name = "N")]
    effective_batch: Option<u64>,
    /// The smallest micro-batch to retry with.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "B")]
    min_batch_size: u64,
    /// Reruns allowed after the first attempt.
    #[arg(long, default_value_t = 3, value_name = "N")]
    max_retries: u32,
    /// After the last OOM on the GPU, run once more on the CPU.
    #[arg(long)]
    cpu_fallback: bool,
    /// Do not set OOMKIT_AUTO_CALLBACK=1, which has Lightning add oomkit's callback by itself.
    #[arg(long)]
    no_auto_callback: bool,
    /// Start from --batch-size even when a smaller plan finished last time for this command.
    #[arg(long)]
    fresh: bool,
    /// Cap the command's private memory (RLIMIT_DATA, e.g. 2GiB): it runs out of host memory as on a smaller machine, to rehearse OOM recovery on CPU.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    host_memory_limit: Option<u64>,
    /// Write the attempts as JSON to this new file.
    #[arg(long, value_name = "FILE")]
    summary_json: Option<PathBuf>,
    #[command(flatten)]
    format: FormatArgs,
    /// The training command, after `--`.
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// `oomkit run`.
pub(crate) fn run(a: Args) -> u8 {
    if let Err(msg) = must_be_new(&a.summary_json) {
        say(&msg);
        return crate::exit::RUN_FAILED;
    }
    let opts = RunOptions {
        command: a.command,
        gpus: a.gpus,
        min_free: a.min_free,
        wait: a.wait.wait(),
        require_gpu: a.require_gpu,
        batch_size: a.batch_size,
        grad_accum: a.grad_accum,
        effective_batch: a.effective_batch,
        min_batch_size: a.min_batch_size,
        max_retries: a.max_retries,
        cpu_fallback: a.cpu_fallback,
        auto_callback: !a.no_auto_callback,
        memory: oomkit_supervise::remember::PlanMemory::default_location(),
        fresh: a.fresh,
        claims: ClaimDir::default_location(),
        child_stdout_to_stderr: a.format.json(),
        host_memory_limit: a.host_memory_limit,
    };
    let summary = match oomkit_supervise::supervise(&opts, &mut |m| say(m)) {
        Ok(s) => s,
        Err(e) => {
            say(&e.to_string());
            return crate::exit::run_exit(&e);
        }
    };
    // The table goes to standard error, beside the training command's own output.
    eprint!("{}", summary.text());
    if let Some(path) = &a.summary_json {
        let body = serde_json::to_string_pretty(&summary).unwrap_or_default();
        if let Err(msg) = crate::output::save_new(path, format!("{body}\n").as_bytes()) {
            say(&msg);
        }
    }
    if a.format.json() {
        print(Output::Json, &summary);
    }
    (summary.exit_code & 0xff) as u8
}
