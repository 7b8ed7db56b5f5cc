//! Everything oomkit writes: JSON and messages on the standard streams, and
//! files written whole or not at all, never over one that exists unless asked.

use crate::exit::{EXIT_INPUT, EXIT_INTERNAL, EXIT_OK};
use oomkit_compare::Job;
use oomkit_report::{Output, Render};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Prints a result on standard output in the output chosen (text or JSON,
/// the two every command offers; JSON alone on stdout).
pub(crate) fn print(output: Output, result: &dyn Render) {
    // A closed pipe (`oomkit ... | head`) is the reader's choice, not a failure to report.
    let _ = output.write(result, &mut std::io::stdout().lock());
}

/// Where a command writes a document.
#[derive(Clone, Copy)]
pub(crate) enum Dest<'a> {
    /// Standard output.
    Stdout,
    /// A file, written whole or not at all; an existing one only with `force`.
    File {
        /// The file, or `-` for standard output.
        path: &'a Path,
        /// Replace the file if it exists.
        force: bool,
    },
}

/// Writes the files of one command line in the output chosen, to `dest`;
/// returns the exit code for what writing them took: 0, 2 where a file
/// cannot be written (it exists, the folder is missing), 1 for anything else.
pub(crate) fn emit_job(job: &Job, output: Output, dest: Dest<'_>) -> u8 {
    let (path, force) = match dest {
        Dest::Stdout if !output.is_document() => {
            return match output.write_job(job, &mut std::io::stdout().lock()) {
                Ok(()) => EXIT_OK,
                Err(e) => {
                    say(&e.to_string());
                    EXIT_INTERNAL
                }
            };
        }
        Dest::Stdout => (Path::new("-"), false),
        Dest::File { path, force } => (path, force),
    };
    let written = write_output_with(path, force, &mut |w| {
        output
            .write_job(job, w)
            .map_err(|e| std::io::Error::other(e.to_string()))
    });
    match written {
        Ok(()) => EXIT_OK,
        Err(msg) => {
            say(&msg);
            if matches!(dest, Dest::File { .. }) {
                EXIT_INPUT
            } else {
                EXIT_INTERNAL
            }
        }
    }
}

/// One line on standard error, prefixed with `oomkit:`.
pub(crate) fn say(msg: &str) {
    eprintln!("oomkit: {msg}");
}

/// Refuses to start when a file oomkit must create already exists, so nothing is overwritten.
pub(crate) fn must_be_new(path: &Option<PathBuf>) -> Result<(), String> {
    match path {
        Some(p) if p.exists() => Err(format!(
            "{}: already exists (oomkit never overwrites a file)",
            p.display()
        )),
        _ => Ok(()),
    }
}

/// Writes what `fill` produces to `path`, or to standard output for `-`.
pub(crate) fn write_output_with(
    path: &Path,
    force: bool,
    fill: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), String> {
    if path.as_os_str() == "-" {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        return fill(&mut out)
            .and_then(|_| out.write_all(b"\n"))
            .and_then(|_| out.flush())
            .map_err(|e| format!("standard output: {e}"));
    }
    let written = write_file_with(path, force, "pass --force to replace it", fill)?;
    eprintln!(
        "oomkit: wrote {} ({})",
        path.display(),
        oomkit_units::human_bytes(written)
    );
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file beside it, so that a
/// failure never leaves half a file behind. An existing file is replaced
/// only when `replace` is set; otherwise the error says so, with `hint`.
pub(crate) fn write_file(
    path: &Path,
    bytes: &[u8],
    replace: bool,
    hint: &str,
) -> Result<(), String> {
    write_file_with(path, replace, hint, &mut |w| w.write_all(bytes)).map(|_| ())
}

/// Counts the bytes that pass through it.
struct Counted<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes what `fill` produces to `path` as [`write_file`] does, returning
/// how many bytes it wrote.
pub(crate) fn write_file_with(
    path: &Path,
    replace: bool,
    hint: &str,
    fill: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
) -> Result<u64, String> {
    let shown = path.display();
    // Creating the target first claims its name, so that a file appearing
    // meanwhile is never replaced by the rename below.
    let claimed = !replace;
    if claimed {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(format!("{shown}: already exists ({hint})"))
            }
            Err(e) => return Err(format!("{shown}: {e}")),
        }
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".oomkit-{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp).and_then(|f| {
        let mut out = Counted {
            inner: std::io::BufWriter::new(f),
            bytes: 0,
        };
        fill(&mut out)?;
        out.flush()?;
        Ok(out.bytes)
    });
    match written.and_then(|n| std::fs::rename(&tmp, path).map(|_| n)) {
        Ok(n) => Ok(n),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            if claimed {
                let _ = std::fs::remove_file(path);
            }
            Err(format!("{shown}: {e}"))
        }
    }
}

/// Writes `bytes` to a file that must not exist yet.
pub(crate) fn save_new(path: &Path, bytes: &[u8]) -> Result<(), String> {
    write_file(path, bytes, false, "oomkit never overwrites a file")
}
