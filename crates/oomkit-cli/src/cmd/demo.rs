//! `oomkit demo`: the bundled snapshot, analyzed, to see a report with no set-up.

use super::analyze::{options, ReportArgs};
use crate::exit::{EXIT_INPUT, EXIT_INTERNAL};
use crate::output::{emit_job, write_file, Dest};
use oomkit_compare::{FileAnalysis, Job, Report};
use oomkit_report::Needs;
use oomkit_snapshot::Snapshot;
use std::path::PathBuf;

/// The snapshot that `oomkit demo` analyzes; made by scripts/make_demo_snapshot.py.
const DEMO: &[u8] = include_bytes!("../../assets/demo_snapshot.pickle");
const DEMO_NAME: &str = "demo_snapshot.pickle (bundled)";

/// Flags of `oomkit demo`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    report: ReportArgs,
    /// Also write the bundled snapshot to this file; an existing file is kept unless --force.
    #[arg(long, value_name = "PATH")]
    save: Option<PathBuf>,
    /// Replace the --save file if it exists, as report and export do for theirs.
    #[arg(long, requires = "save")]
    force: bool,
}

/// `oomkit demo`.
pub(crate) fn run(a: Args) -> u8 {
    if let Some(path) = a.save {
        if let Err(msg) = write_file(&path, DEMO, a.force, "pass --force to replace it") {
            eprintln!("oomkit: {msg}");
            return EXIT_INPUT;
        }
        eprintln!("oomkit: wrote the demo snapshot to {}", path.display());
    }
    match Snapshot::from_bytes(DEMO) {
        Ok(snap) => {
            let (name, size, opts) = (DEMO_NAME.into(), DEMO.len() as u64, options(&a.report));
            let output = a.report.format.output();
            let fa = match output.needs() {
                Needs::Raw => FileAnalysis::keeping(name, size, snap, &opts),
                Needs::Analysis => FileAnalysis::new(name, size, &snap, &opts),
            };
            emit_job(
                &Job::new(vec![Ok(Report::Snapshot(Box::new(fa)))]),
                output,
                Dest::Stdout,
            )
        }
        Err(e) => {
            eprintln!("oomkit: internal error: the bundled snapshot is unreadable: {e}");
            EXIT_INTERNAL
        }
    }
}
