//! Value parsers and the flags several commands share.

use oomkit_gpu::Wait;
use oomkit_report::Output;
use std::time::Duration;

/// A size as people write it (`80GiB`, `512MB`).
pub(crate) fn size(s: &str) -> Result<u64, String> {
    oomkit_units::parse_bytes(s).map_err(|e| e.to_string())
}

/// A duration as people write it (`30s`, `10m`, `2h`).
pub(crate) fn duration(s: &str) -> Result<Duration, String> {
    oomkit_units::parse_duration(s).map_err(|e| e.to_string())
}

/// A count as people write it (`7B`, `350M`).
pub(crate) fn count(s: &str) -> Result<u64, String> {
    oomkit_units::parse_count(s).map_err(|e| e.to_string())
}

/// A whole number of at least 1.
pub(crate) fn positive(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

/// Options shared by the commands that take a GPU.
#[derive(clap::Args)]
pub(crate) struct WaitArgs {
    /// Wait this long for a GPU to qualify (30s, 10m, 2h); 0 looks once.
    #[arg(long, value_parser = duration, default_value = "0s", value_name = "DURATION")]
    pub(crate) wait: Duration,
    /// How often to look while waiting.
    #[arg(long, value_parser = duration, default_value = "30s", value_name = "DURATION")]
    pub(crate) poll: Duration,
}

impl WaitArgs {
    /// The wait these flags ask for, polling no faster than ten times a second.
    pub(crate) fn wait(&self) -> Wait {
        Wait {
            timeout: self.wait,
            poll: self.poll.max(Duration::from_millis(100)),
        }
    }
}

/// The formats the commands that render files offer (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum FileFormat {
    /// A report for people.
    Text,
    /// JSON alone on standard output, the contract for scripts (docs/json.md lists its fields).
    Json,
    /// The self-contained HTML page `oomkit report` writes, on standard output.
    Html,
    /// The Perfetto trace `oomkit export` writes, on standard output (one file).
    Perfetto,
}

/// The formats every command offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Plain {
    /// A report for people.
    Text,
    /// JSON alone on standard output, the contract for scripts (docs/json.md lists its fields).
    Json,
}

/// `--format text|json`, with `--json` as its short form.
#[derive(clap::Args)]
pub(crate) struct FormatArgs {
    /// How to print the result.
    #[arg(long, value_enum, value_name = "FORMAT", default_value = "text")]
    format: Plain,
    /// Print JSON: the same as --format json.
    #[arg(long)]
    json: bool,
}

impl FormatArgs {
    /// The output these flags choose: the one place it is decided.
    pub(crate) fn output(&self) -> Output {
        match (self.json, self.format) {
            (true, _) | (false, Plain::Json) => Output::Json,
            (false, Plain::Text) => Output::Text,
        }
    }

    /// True when the result is to be printed as JSON (the command's own output then goes to stderr).
    pub(crate) fn json(&self) -> bool {
        self.output() == Output::Json
    }
}

/// `--format text|json|html|perfetto` for the commands that render files, with `--json` as a short form.
#[derive(clap::Args)]
pub(crate) struct FileFormatArgs {
    /// How to print the result.
    #[arg(long, value_enum, value_name = "FORMAT", default_value = "text")]
    format: FileFormat,
    /// Print JSON: the same as --format json.
    #[arg(long)]
    json: bool,
}

impl FileFormatArgs {
    /// The output these flags choose: the one place it is decided. The page
    /// and the trace keep their commands' default number of samples.
    pub(crate) fn output(&self) -> Output {
        if self.json {
            return Output::Json;
        }
        match self.format {
            FileFormat::Text => Output::Text,
            FileFormat::Json => Output::Json,
            FileFormat::Html => Output::Html {
                max_points: oomkit_report::PAGE_MAX_POINTS,
            },
            FileFormat::Perfetto => Output::Perfetto {
                max_points: oomkit_report::TRACE_MAX_POINTS,
            },
        }
    }
}
