//! The `oomkit` command: a thin shell over the oomkit libraries.
//!
//! The binary and the Python package's console script both call [`main`].
//!
//! ```
//! // The bundled example, analyzed as `oomkit demo --json` would (output on stdout).
//! let code = oomkit_cli::main(["oomkit", "demo", "--json", "--top", "1"].map(Into::into));
//! assert_eq!(code, oomkit_cli::EXIT_OK);
//! ```
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod args;
mod cmd;
mod exit;
mod hub;
mod load;
mod output;

use clap::{Parser, Subcommand};
use std::ffi::OsString;

pub use exit::{
    EXIT_INPUT, EXIT_INTERNAL, EXIT_NOTHING_FITS, EXIT_NO_GPU, EXIT_OK, EXIT_UNMEASURED,
    EXIT_WAIT_TIMEOUT,
};

#[derive(Parser)]
#[command(
    name = "oomkit",
    version,
    about = "Find out why PyTorch ran out of GPU memory."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Analyze PyTorch memory snapshots (torch.cuda.memory._dump_snapshot) or oomkit run logs.
    Analyze(cmd::analyze::Args),
    /// List the GPUs: memory, utilization and processes.
    Gpus(cmd::gpus::Args),
    /// Run a training command on the freest GPU, retrying after an OOM with a smaller micro-batch.
    Run(cmd::run::Args),
    /// Find the largest micro-batch that fits, in a few runs of the command.
    FindBatch(cmd::find_batch::Args),
    /// Explain a PyTorch out-of-memory message (an argument, or a whole log on stdin).
    Explain(cmd::explain::Args),
    /// Estimate the memory a training run needs, before running it.
    Estimate(cmd::estimate::Args),
    /// Export a snapshot or run log for another viewer (Perfetto, chrome://tracing).
    Export(cmd::export::Args),
    /// Compare two snapshots, two run logs, or one of each, such as before and after a fix.
    ///
    /// With --json: {"kind", "file_a", "file_b", "devices": [...]}, each device
    /// with its peaks in A and B, each role's bytes at the peaks, and the
    /// sites that changed (snapshots) or each stage's peak (run logs); a
    /// snapshot and a run log compare by role; docs/commands.md lists every
    /// field.
    Diff(cmd::diff::Args),
    /// Write a self-contained HTML report (charts, tables, findings) that opens offline.
    Report(cmd::report::Args),
    /// Analyze the snapshot bundled in oomkit, to see a report with no set-up.
    Demo(cmd::demo::Args),
    /// Replay a snapshot's trace through a model of PyTorch's caching allocator: what other settings, a larger GPU or a smaller micro-batch would have done.
    Whatif(cmd::whatif::Args),
    /// Run a training script on tensors without memory (no GPU) for a few steps: whether it fits, what holds the peak, the largest micro-batch.
    Preflight(cmd::preflight::Args),
}

/// Runs the command line `args` (program name first) and returns the exit code.
pub fn main(args: impl IntoIterator<Item = OsString>) -> u8 {
    // A bug must end in one line and exit code 1, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("oomkit: internal error{at}: {msg} (please report this)");
    }));
    let args: Vec<OsString> = args.into_iter().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            if !e.use_stderr() {
                return EXIT_OK;
            }
            // `oomkit run` passes its command's codes through, so its own
            // usage errors take a code no training script uses for itself.
            let is_run = args.get(1).is_some_and(|a| a == "run");
            return if is_run { exit::RUN_FAILED } else { EXIT_INPUT };
        }
    };
    std::panic::catch_unwind(|| run(cli)).unwrap_or(EXIT_INTERNAL)
}

/// Hands the parsed command to its module.
fn run(cli: Cli) -> u8 {
    match cli.command {
        Command::Analyze(a) => cmd::analyze::run(a),
        Command::Gpus(a) => cmd::gpus::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::FindBatch(a) => cmd::find_batch::run(a),
        Command::Explain(a) => cmd::explain::run(a),
        Command::Estimate(a) => cmd::estimate::run(a),
        Command::Export(a) => cmd::export::run(a),
        Command::Diff(a) => cmd::diff::run(a),
        Command::Report(a) => cmd::report::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Whatif(a) => cmd::whatif::run(a),
        Command::Preflight(a) => cmd::preflight::run(a),
    }
}
