//! The one output decision: the format a command's flags chose, made once,
//! which knows what its inputs must be loaded with and writes a result.
//!
//! Every command that prints a report goes through [`Output`]: `analyze`
//! and `demo` with the format their flags name, `report` as `analyze` to an
//! HTML file, `export` as `analyze` to a Perfetto file, and the others
//! (`diff`, `run`, `gpus`, ...) in text or JSON through [`Render`]. A new
//! format is a module beside `text/`, `json.rs`, `html.rs` and `perfetto.rs`
//! and one variant here.

use crate::{html_report, trace, Render, ReportError};
use oomkit_compare::Job;
use std::io::Write;

/// How a command writes what it found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A report for people (`text/`).
    Text,
    /// JSON alone, the contract for scripts (`json.rs`, docs/json.md).
    Json,
    /// The self-contained HTML page (`html.rs`), keeping at most `max_points` samples per device (0 keeps all).
    Html {
        /// Most memory samples per device.
        max_points: usize,
    },
    /// Perfetto's trace of one file (`perfetto.rs`), keeping at most `max_points` samples per device (0 keeps all).
    Perfetto {
        /// Most memory samples per device.
        max_points: usize,
    },
}

/// What the files must be loaded with for an output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// The analysis alone, so that a large snapshot is freed at once.
    Analysis,
    /// The snapshot or the run log's records too, which the page and the trace draw from.
    Raw,
}

impl Output {
    /// The format's name, as `--format` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Output::Text => "text",
            Output::Json => "json",
            Output::Html { .. } => "html",
            Output::Perfetto { .. } => "perfetto",
        }
    }

    /// What the files must be loaded with.
    pub fn needs(&self) -> Needs {
        match self {
            Output::Text | Output::Json => Needs::Analysis,
            Output::Html { .. } | Output::Perfetto { .. } => Needs::Raw,
        }
    }

    /// Refuses a number of files the format cannot write at once (a trace is one file's timeline).
    pub fn check_files(&self, files: usize) -> Result<(), ReportError> {
        match self {
            Output::Perfetto { .. } if files > 1 => Err(ReportError::OneFile {
                format: "perfetto",
                what: "a trace is one file's timeline; give one file, or run `oomkit export FILE -o TRACE.json` for each",
            }),
            _ => Ok(()),
        }
    }

    /// Writes the files of one command line in this format.
    pub fn write_job(&self, job: &Job, w: &mut dyn Write) -> Result<(), ReportError> {
        match *self {
            Output::Text | Output::Json => self.write(job, w),
            Output::Html { max_points } => {
                let page = html_report(&job.read(), max_points)?;
                w.write_all(page.as_bytes())?;
                Ok(())
            }
            Output::Perfetto { max_points } => match job.read().first() {
                Some(r) => {
                    // Written as it is encoded: a trace that keeps every
                    // entry of a large snapshot runs to hundreds of megabytes.
                    let t = trace(r, max_points)?;
                    serde_json::to_writer(&mut *w, &t).map_err(std::io::Error::from)?;
                    Ok(())
                }
                // The one file given could not be read; that was said already.
                None => Ok(()),
            },
        }
    }

    /// Writes a result that has a text and a JSON form.
    pub fn write(&self, result: &dyn Render, w: &mut dyn Write) -> Result<(), ReportError> {
        match self {
            Output::Text => w.write_all(result.text().as_bytes())?,
            Output::Json => {
                let text =
                    serde_json::to_string_pretty(&result.json()).unwrap_or_else(|_| "null".into());
                writeln!(w, "{text}")?;
            }
            Output::Html { .. } | Output::Perfetto { .. } => {
                return Err(ReportError::NotOffered {
                    format: self.name(),
                })
            }
        }
        Ok(())
    }

    /// True for the formats that are documents rather than a report on the
    /// terminal (a page, a trace): written whole, to a file or a pipe.
    pub fn is_document(&self) -> bool {
        matches!(self, Output::Html { .. } | Output::Perfetto { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_says_what_it_needs_loaded() {
        assert_eq!(Output::Text.needs(), Needs::Analysis);
        assert_eq!(Output::Json.needs(), Needs::Analysis);
        assert_eq!(Output::Html { max_points: 0 }.needs(), Needs::Raw);
        assert_eq!(Output::Perfetto { max_points: 0 }.needs(), Needs::Raw);
        assert!(Output::Perfetto { max_points: 0 }.check_files(2).is_err());
        assert!(Output::Html { max_points: 0 }.check_files(2).is_ok());
    }
}
