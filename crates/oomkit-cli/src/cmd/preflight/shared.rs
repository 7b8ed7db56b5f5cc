//! A warm interpreter shared by many commands: `python -m oomkit.preflight.warm --serve
//! SOCKET`, started by whoever runs many preflights on one machine (CI, a sweep), and named
//! to each command by `OOMKIT_PREFLIGHT_SERVER=SOCKET`. Every run of such a command, the
//! first included, is asked of it first; it forks the run where the run would see there what
//! a fresh Python shows it (the same interpreter and environment), and refuses otherwise,
//! saying why, and the command goes on as it would without it.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use serde_json::Value;

use crate::output::say;

/// The environment variable that names the shared interpreter's socket.
pub(super) const SERVER_ENV: &str = "OOMKIT_PREFLIGHT_SERVER";

/// A run to ask for: what `python -m oomkit.preflight.warm --serve` forks.
pub(super) struct Run<'r> {
    /// The interpreter the command names, as a full path.
    pub(super) python: String,
    /// `("script", path)` or `("module", name)`: what the run runs as `__main__`.
    pub(super) main: (&'static str, &'r str),
    /// The arguments after it.
    pub(super) args: &'r [String],
}

/// How a run asked of the shared interpreter went.
pub(super) enum Asked {
    /// It ran there and exited with this code (None: a signal ended it).
    Ran(Option<i32>),
    /// The interpreter would not take it, for this reason (or could not be reached).
    Refused(String),
}

/// The socket the command's environment names, where it names one.
pub(super) fn socket() -> Option<PathBuf> {
    std::env::var_os(SERVER_ENV)
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// Asks the shared interpreter at `socket` to run `script` with `env` added to the
/// command's environment; its output is copied to standard error (or dropped, `quiet`), as a
/// fresh run's is.
pub(super) fn run(
    socket: &std::path::Path,
    script: &Run<'_>,
    env: &[(&str, &OsString)],
    quiet: bool,
) -> Asked {
    match ask(socket, script, env, quiet) {
        Ok(asked) => asked,
        Err(AskError::Unreachable(e)) => Asked::Refused(format!("cannot reach it: {e}")),
        Err(AskError::Broken(why)) => Asked::Refused(why),
    }
}

/// Why a run could not be asked of the shared interpreter.
enum AskError {
    /// The socket could not be connected to, written or read before an answer.
    Unreachable(std::io::Error),
    /// It answered, but not as the protocol says, or went away during the run: the reason.
    Broken(String),
}

fn ask(
    socket: &std::path::Path,
    script: &Run<'_>,
    env: &[(&str, &OsString)],
    quiet: bool,
) -> Result<Asked, AskError> {
    let Some(request) = request(script, env, quiet) else {
        return Ok(Asked::Refused(
            "the command's environment or folder is not text".to_string(),
        ));
    };
    let mut answers = BufReader::new(
        (|| {
            let mut conn = UnixStream::connect(socket)?;
            writeln!(conn, "{request}")?;
            Ok(conn)
        })()
        .map_err(AskError::Unreachable)?,
    );
    let mut first = String::new();
    answers
        .read_line(&mut first)
        .map_err(AskError::Unreachable)?;
    let first: Value = serde_json::from_str(&first)
        .map_err(|_| AskError::Broken("it answered no JSON line".to_string()))?;
    if let Some(why) = first.get("refused").and_then(Value::as_str) {
        return Ok(Asked::Refused(why.to_string()));
    }
    relay(answers, quiet).map_err(|e| AskError::Broken(format!("it went away during a run ({e})")))
}

/// Copies a taken run's output to standard error (unless `quiet`) until its end, and says how it ended.
fn relay(mut answers: impl Read, quiet: bool) -> std::io::Result<Asked> {
    let mut stderr = std::io::stderr();
    loop {
        let mut kind = [0u8; 1];
        answers.read_exact(&mut kind)?;
        let mut word = [0u8; 4];
        answers.read_exact(&mut word)?;
        match kind[0] {
            b'O' => {
                let mut data = vec![0u8; u32::from_be_bytes(word) as usize];
                answers.read_exact(&mut data)?;
                if !quiet {
                    // Where the command's stderr is gone, the run's output is nobody's: it goes on.
                    let _ = stderr.write_all(&data);
                }
            }
            b'E' => {
                let code = i32::from_be_bytes(word);
                return Ok(Asked::Ran((code >= 0).then_some(code)));
            }
            _ => return Err(std::io::Error::other("it sent a frame of no known kind")),
        }
    }
}

/// The line that asks for the run: what `python -m oomkit.preflight.warm` forks, with the
/// interpreter, folder and whole environment the run must have; None where one is not text.
fn request(script: &Run<'_>, env: &[(&str, &OsString)], quiet: bool) -> Option<Value> {
    let mut environ = serde_json::Map::new();
    for (name, value) in std::env::vars_os() {
        environ.insert(
            name.into_string().ok()?,
            Value::String(value.into_string().ok()?),
        );
    }
    let added = env_json(env)?;
    let (key, main) = script.main;
    let mut request = serde_json::json!({
        "python": script.python,
        "cwd": std::env::current_dir().ok()?.to_str()?,
        "environ": environ,
        "args": script.args,
        "env": added,
        "quiet": quiet,
    });
    request[key] = Value::String(main.to_string());
    Some(request)
}

/// What a run adds to the command's environment, as every warm Python is told it (the
/// shared one and a command's own); None where a value is not text.
pub(super) fn env_json(env: &[(&str, &OsString)]) -> Option<serde_json::Map<String, Value>> {
    env.iter()
        .map(|(name, value)| {
            Some((
                (*name).to_string(),
                Value::String(value.to_str()?.to_string()),
            ))
        })
        .collect()
}

/// Says once per command why the shared interpreter did not take its runs.
pub(super) fn tell_refused(socket: &std::path::Path, why: &str) {
    say(&format!(
        "preflight: the warm Python at {} ({SERVER_ENV}) did not take this command's runs: {why}; they start here",
        socket.display()
    ));
}
