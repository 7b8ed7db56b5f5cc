//! Several files given together, taken as the ranks (and attempts) of one
//! job: which ones were read, the rank table, the attempts and the order a
//! report shows them in.

use crate::{rank_table, RankRow, Report};
use oomkit_runlog::Attempt;

/// A file that could not be read, with what was wrong with it.
#[derive(Clone, Debug)]
pub struct Unreadable {
    /// The path as the user gave it.
    pub file: String,
    /// The message that says what was wrong.
    pub error: String,
}

/// The files of one command line, analyzed together.
pub struct Job {
    /// Each file in the order given: its analysis, or why it could not be read.
    pub files: Vec<Result<Report, Unreadable>>,
    /// One row per rank and device, for two files or more (empty otherwise).
    pub ranks: Vec<RankRow>,
    /// The attempts of a job that stepped down (more than one), from its run logs.
    pub attempts: Option<Vec<Attempt>>,
}

/// The attempts of the run logs among `reports`, where they ran more than one: only a job that stepped down has attempts worth a table.
pub fn job_attempts(reports: &[&Report]) -> Option<Vec<Attempt>> {
    let logs: Vec<&oomkit_runlog::Analysis> = reports
        .iter()
        .filter_map(|r| match r {
            Report::Run(rf) => Some(&rf.analysis),
            Report::Snapshot(_) => None,
        })
        .collect();
    Some(oomkit_runlog::attempts(&logs)).filter(|a| a.len() > 1)
}

impl Job {
    /// Works out the rank table and the attempts of the files that were read.
    pub fn new(files: Vec<Result<Report, Unreadable>>) -> Job {
        let read: Vec<&Report> = files.iter().filter_map(|r| r.as_ref().ok()).collect();
        let ranks = rank_table(&read);
        let attempts = job_attempts(&read);
        Job {
            files,
            ranks,
            attempts,
        }
    }

    /// The files that were read, in the order given.
    pub fn read(&self) -> Vec<&Report> {
        self.files.iter().filter_map(|r| r.as_ref().ok()).collect()
    }

    /// The file that ran out of memory before the others, where the files tell.
    pub fn failed_first(&self) -> Option<&str> {
        self.ranks
            .iter()
            .find(|r| r.failed_first)
            .map(|r| r.file.as_str())
    }

    /// The files that were read, the one that failed first at the front.
    pub fn in_report_order(&self) -> Vec<&Report> {
        let first = self.failed_first();
        let mut order = self.read();
        // A stable sort keeps the given order behind the first failure.
        order.sort_by_key(|r| Some(r.path()) != first);
        order
    }

    /// The rows of the rank table that came from `file`.
    pub fn ranks_of(&self, file: &str) -> Vec<&RankRow> {
        self.ranks.iter().filter(|r| r.file == file).collect()
    }
}
