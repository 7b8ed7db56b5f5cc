//! `oomkit explain`: why a PyTorch OOM message says memory ran out, and what to change.

use crate::args::FormatArgs;
use crate::exit::{EXIT_INPUT, EXIT_OK};
use crate::output::{print, say};
use std::io::{IsTerminal, Read};

/// Flags of `oomkit explain`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The message, a log file holding it, or `-` (the default) for stdin.
    #[arg(value_name = "MESSAGE | FILE | -")]
    input: Option<String>,
    /// The PYTORCH_CUDA_ALLOC_CONF in force when it failed (default: this shell's).
    #[arg(long, value_name = "SETTINGS")]
    alloc_conf: Option<String>,
    #[command(flatten)]
    format: FormatArgs,
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
    match oomkit_supervise::oom::explain(&text, conf.as_deref()) {
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
