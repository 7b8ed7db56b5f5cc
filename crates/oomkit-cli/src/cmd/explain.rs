//! `oomkit explain`: why a PyTorch OOM message says memory ran out, and what to change.

use crate::args::FormatArgs;
use crate::exit::{EXIT_INPUT, EXIT_OK};
use crate::output::{print, say};
use std::io::{IsTerminal, Read};

/// Flags of `oomkit explain`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The message, a log file holding it, a snapshot (its first OOM, with the fix checked by replaying the trace), or `-` (the default) for stdin.
    #[arg(value_name = "MESSAGE | FILE | -")]
    input: Option<String>,
    /// The PYTORCH_CUDA_ALLOC_CONF in force when it failed (default: this shell's).
    #[arg(long, value_name = "SETTINGS")]
    alloc_conf: Option<String>,
    #[command(flatten)]
    format: FormatArgs,
}

/// `oomkit explain SNAPSHOT`: its first OOM, the cause from the replayed
/// figures, and the fix checked by replaying the trace with it.
fn explain_snapshot(path: &std::path::Path, output: oomkit_report::Output) -> u8 {
    let report = match crate::load::load(
        path,
        &oomkit_snapshot::Options::default(),
        crate::load::Keep::Analysis,
    ) {
        Ok(r) => r,
        Err(msg) => {
            say(&msg);
            return EXIT_INPUT;
        }
    };
    let oomkit_compare::Report::Snapshot(fa) = report else {
        unreachable!("a file that starts as a snapshot is read as one")
    };
    if fa.first_oom().is_none() {
        say(&format!(
            "{}: the snapshot records no out-of-memory error; `oomkit analyze {}` says where its memory went",
            fa.path, fa.path
        ));
        return EXIT_INPUT;
    }
    print(output, &oomkit_report::SnapshotOom(&fa));
    EXIT_OK
}

/// `oomkit explain`.
pub(crate) fn run(a: Args) -> u8 {
    let (source, text) = match a.input.as_deref() {
        None | Some("-") => {
            if std::io::stdin().is_terminal() {
                say("paste the error and press Ctrl-D, or give it as an argument: oomkit explain \"CUDA out of memory. ...\"");
            }
            let mut buf = Vec::new();
            if let Err(e) = std::io::stdin().read_to_end(&mut buf) {
                say(&format!("stdin: {e}"));
                return EXIT_INPUT;
            }
            (
                "stdin".to_string(),
                String::from_utf8_lossy(&buf).into_owned(),
            )
        }
        Some(arg)
            if !arg.contains('\n')
                && std::path::Path::new(arg).is_file()
                && crate::load::is_snapshot(std::path::Path::new(arg)) =>
        {
            return explain_snapshot(std::path::Path::new(arg), a.format.output());
        }
        Some(arg) if !arg.contains('\n') && std::path::Path::new(arg).is_file() => {
            match std::fs::read(arg) {
                Ok(b) => (arg.to_string(), String::from_utf8_lossy(&b).into_owned()),
                Err(e) => {
                    say(&format!("{arg}: {e}"));
                    return EXIT_INPUT;
                }
            }
        }
        Some(arg) => ("the argument".to_string(), arg.to_string()),
    };
    let conf = a.alloc_conf.or_else(|| {
        [
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
            "PYTORCH_HIP_ALLOC_CONF",
        ]
        .iter()
        .find_map(|k| std::env::var(k).ok())
    });
    match oomkit_supervise::explain::explain(&text, conf.as_deref()) {
        Some(ex) => {
            print(a.format.output(), &ex);
            EXIT_OK
        }
        None => {
            say(&format!("{source}: no PyTorch out-of-memory message found (looked for \"CUDA out of memory\", \"OutOfMemoryError\", CUBLAS_STATUS_ALLOC_FAILED and the other forms)"));
            EXIT_INPUT
        }
    }
}
