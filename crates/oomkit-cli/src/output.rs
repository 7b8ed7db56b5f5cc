//! Everything oomkit writes: JSON and messages on the standard streams, and
//! files written whole or not at all, never over one that exists unless asked.

use crate::args::Format;
use oomkit_report::Render;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Prints a value as pretty JSON on standard output, alone.
pub(crate) fn print_json(value: &impl serde::Serialize) {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".into());
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

/// Prints a command's result on standard output as text or JSON, the two
/// formats every command offers; the formats that render files are
/// written by the commands that offer them.
pub(crate) fn print(format: Format, result: &dyn Render) {
    match format {
        Format::Json => print_json(&result.json()),
        Format::Text | Format::Html | Format::Perfetto => {
            let _ = write!(std::io::stdout().lock(), "{}", result.text());
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

/// Writes a document to `path`, or to standard output for `-`.
pub(crate) fn write_output(path: &Path, text: &[u8], force: bool) -> Result<(), String> {
    write_output_with(path, force, &mut |w| w.write_all(text))
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
