//! `oomkit analyze`: the terminal or JSON report of snapshots and run logs,
//! with the verdict first and, for several files, the ranks and attempts.

use crate::args::FormatArgs;
use crate::load::{load, Keep};
use crate::{EXIT_INPUT, EXIT_OK};
use oomkit_report::Report;
use oomkit_snapshot::Options;
use std::io::Write;
use std::path::PathBuf;

/// Flags of `oomkit analyze`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Snapshot files or run logs (the format is detected); several files give one report each.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
}

/// The flags `analyze` and `demo` share: the format, how many sites, which device.
#[derive(clap::Args)]
pub(crate) struct ReportArgs {
    #[command(flatten)]
    format: FormatArgs,
    /// How many allocation sites to list.
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,
    /// Only this CUDA device index.
    #[arg(long, value_name = "D")]
    device: Option<i64>,
}

/// The analysis options these flags ask for.
pub(crate) fn options(r: &ReportArgs) -> Options {
    Options {
        top: r.top,
        device: r.device,
    }
}

/// `oomkit analyze`.
pub(crate) fn run(a: Args) -> u8 {
    let mut results = Vec::new();
    let mut failed = false;
    for path in &a.files {
        match load(path, &options(&a.report), Keep::Analysis) {
            Ok(fa) => results.push(Ok(fa)),
            Err(msg) => {
                eprintln!("oomkit: {msg}");
                failed = true;
                results.push(Err((path.display().to_string(), msg)));
            }
        }
    }
    emit(&results, &a.report);
    if failed {
        EXIT_INPUT
    } else {
        EXIT_OK
    }
}

/// A file analyzed, or its path and what was wrong with it.
pub(crate) type Outcome = Result<Report, (String, String)>;

/// Prints the reports: JSON alone, or the verdict, each file, the ranks and the attempts.
pub(crate) fn emit(results: &[Outcome], report: &ReportArgs) {
    let mut out = std::io::stdout().lock();
    let ok: Vec<&Report> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let ranks = oomkit_report::rank_table(&ok);
    let logs: Vec<&oomkit_runlog::Analysis> = ok
        .iter()
        .filter_map(|r| match r {
            Report::Run(rf) => Some(&rf.analysis),
            Report::Snapshot(_) => None,
        })
        .collect();
    // Only a job that stepped down has attempts worth a table.
    let attempts = Some(oomkit_runlog::attempts(&logs)).filter(|a| a.len() > 1);
    if report.format.json() {
        let values: Vec<serde_json::Value> = results
            .iter()
            .map(|r| match r {
                Ok(rep) => {
                    let mut v = rep.json();
                    if let (false, Some(m)) = (ranks.is_empty(), v.as_object_mut()) {
                        let mine: Vec<_> =
                            ranks.iter().filter(|row| row.file == rep.path()).collect();
                        m.insert("multi_rank".into(), serde_json::json!(mine));
                    }
                    if let (Report::Run(_), Some(a), Some(m)) = (rep, &attempts, v.as_object_mut())
                    {
                        m.insert("attempts".into(), serde_json::json!(a));
                    }
                    v
                }
                Err((file, error)) => serde_json::json!({"file": file, "error": error}),
            })
            .collect();
        let doc = if values.len() == 1 {
            values.into_iter().next().unwrap_or_default()
        } else {
            serde_json::Value::Array(values)
        };
        let _ = writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&doc).unwrap_or_default()
        );
    } else {
        // Several files: the job's verdict first, then the file that failed first.
        let first = ranks
            .iter()
            .find(|r| r.failed_first)
            .map(|r| r.file.clone());
        let mut order: Vec<&Report> = ok.clone();
        order.sort_by_key(|r| Some(r.path().to_string()) != first);
        if ok.len() > 1 {
            let _ = write!(out, "{}", job_verdict(&order, first.is_some()));
        }
        for (i, r) in order.iter().enumerate() {
            if i > 0 {
                let _ = writeln!(out);
            }
            let _ = write!(out, "{}", r.text());
        }
        if !ranks.is_empty() {
            let _ = write!(out, "\n{}", oomkit_report::rank_text(&ranks));
        }
        if let Some(a) = &attempts {
            let _ = write!(out, "\n{}", oomkit_report::attempts_text(a));
        }
    }
}

/// The lines that head a report of several files: which one failed first, and its verdict.
fn job_verdict(order: &[&Report], first_known: bool) -> String {
    let verdicts: Vec<_> = order.iter().map(|r| (r.path(), r.verdict())).collect();
    let failed = verdicts.iter().filter(|(_, v)| v.failed).count();
    let mut out = format!("== verdict ({} files)\n", verdicts.len());
    match verdicts.first() {
        Some((path, v)) if v.failed => {
            let which = if first_known || failed == 1 {
                "failed first"
            } else {
                "failed (the files do not tell which was first)"
            };
            let others = if failed > 1 {
                format!("; {} of {} files recorded an OOM", failed, verdicts.len())
            } else {
                String::new()
            };
            out.push_str(&format!("{path} {which}{others}\n{}", v.text()));
        }
        _ => out.push_str(&format!("no OOM in any of the {} files\n", verdicts.len())),
    }
    out.push('\n');
    out
}
