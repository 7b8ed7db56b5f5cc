//! A warm interpreter for the runs after the first: one Python that has
//! imported torch once (`python -m oomkit.preflight.warm`), forking a process
//! for each run of the script the fixes and searches ask for, so that each
//! starts at the script's first line instead of several seconds of imports.
//!
//! Only a command that is a Python interpreter and a script file
//! (`python train.py ARGS`) is run this way; any other (a launcher, `python -m`,
//! interpreter flags) is started as a fresh process, as is every run where the
//! warm interpreter could not start or has gone.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;

/// The module the interpreter runs to serve the runs.
const MODULE: &str = "oomkit.preflight.warm";

/// The file a forked run leaves in its folder where it must run again as a fresh process
/// (its script set a compiler setting that the warm interpreter's imports had read).
pub(super) const FRESH: &str = "fresh";

/// How a run forked from the warm interpreter ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
}

/// The runs still going, each waiting for how it ended.
type Waiting = Arc<Mutex<HashMap<u64, mpsc::Sender<Ended>>>>;

/// The warm interpreter of one command: asked for once more runs are known to follow.
#[derive(Default)]
pub(super) struct Warm {
    /// Whether runs go through it (set once a second run is known to come).
    wanted: AtomicBool,
    /// The interpreter, started by the first run that goes through it; None where it could not start.
    server: OnceLock<Option<Server>>,
}

/// A started warm interpreter.
struct Server {
    /// The interpreter it runs, which every run through it must name.
    python: String,
    child: Mutex<Child>,
    /// Where runs are asked for; taken (closed) at the end, when the interpreter exits.
    requests: Mutex<Option<ChildStdin>>,
    waiting: Waiting,
    next: AtomicU64,
}

impl Warm {
    /// Runs from now on go through the warm interpreter.
    pub(super) fn want(&self) {
        self.wanted.store(true, Ordering::Relaxed);
    }

    /// Starts the warm interpreter for `command` where runs are wanted from it and the
    /// command is one it can take, waiting until it has imported; a second call finds it
    /// started. Called before a run's time is counted, so that the wait is not the run's.
    pub(super) fn prepare(&self, command: &[String]) {
        if self.wanted.load(Ordering::Relaxed) && python_script(command) {
            self.server.get_or_init(|| Server::start(&command[0]));
        }
    }

    /// Runs `words` (`python train.py ARGS`) forked from the warm interpreter, with `env`
    /// added to the command's environment, and says how it ended; None where this run
    /// cannot go through it (not prepared, not a Python script, or the interpreter is
    /// gone), for the caller to start it as a fresh process.
    pub(super) fn run(
        &self,
        words: &[String],
        env: &[(&str, &OsString)],
        quiet: bool,
    ) -> Option<Ended> {
        let server = self.server.get()?.as_ref()?;
        if !python_script(words) || server.python != words[0] {
            return None;
        }
        server.run(words, env, quiet)
    }
}

/// Whether `words` is a Python interpreter and a script file after it, nothing between.
fn python_script(words: &[String]) -> bool {
    let [python, script, ..] = words else {
        return false;
    };
    let name = Path::new(python)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("");
    let version = name.strip_prefix("python").unwrap_or("-");
    version.chars().all(|c| c.is_ascii_digit() || c == '.')
        && script.ends_with(".py")
        && Path::new(script).is_file()
}

impl Server {
    /// Starts `python -m oomkit.preflight.warm` and waits until it has imported; None where it cannot.
    fn start(python: &str) -> Option<Server> {
        let mut child = Command::new(python)
            .args(["-m", MODULE])
            .env_remove("OOMKIT_PREFLIGHT")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .ok()?;
        let mut answers = BufReader::new(child.stdout.take()?);
        let mut first = String::new();
        let ready = answers.read_line(&mut first).is_ok()
            && serde_json::from_str::<Value>(&first)
                .ok()
                .and_then(|v| v.get("ready").and_then(Value::as_bool))
                == Some(true);
        if !ready {
            // It could not import what a run needs: every run starts fresh, as without it.
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        let waiting: Waiting = Arc::default();
        let told = Arc::clone(&waiting);
        std::thread::spawn(move || tell_ends(answers, &told));
        Some(Server {
            python: python.to_string(),
            requests: Mutex::new(child.stdin.take()),
            child: Mutex::new(child),
            waiting,
            next: AtomicU64::new(0),
        })
    }

    /// Asks for one run and waits for its end; None where the interpreter is gone.
    fn run(&self, words: &[String], env: &[(&str, &OsString)], quiet: bool) -> Option<Ended> {
        let mut vars = serde_json::Map::new();
        for (name, value) in env {
            vars.insert(
                (*name).to_string(),
                Value::String(value.to_str()?.to_string()),
            );
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let request = serde_json::json!({
            "id": id,
            "script": words[1],
            "args": &words[2..],
            "env": vars,
            "quiet": quiet,
        });
        let (tx, rx) = mpsc::channel();
        lock(&self.waiting).insert(id, tx);
        let sent = lock(&self.requests)
            .as_mut()
            .is_some_and(|w| writeln!(w, "{request}").and_then(|()| w.flush()).is_ok());
        if !sent {
            lock(&self.waiting).remove(&id);
            return None;
        }
        // The reader drops every sender where the interpreter's answers end: None, run it fresh.
        rx.recv().ok()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The end of its requests: it waits for its runs (all ended by now) and exits.
        lock(&self.requests).take();
        let _ = lock(&self.child).wait();
    }
}

/// Reads the interpreter's answers and hands each run's end to the run waiting for it;
/// at the end of them (the interpreter gone), every run still waiting is told so.
fn tell_ends(answers: impl BufRead, waiting: &Waiting) {
    for line in answers.lines() {
        let Ok(line) = line else { break };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let (Some(id), Some(code)) = (
            v.get("id").and_then(Value::as_u64),
            v.get("code").and_then(Value::as_i64),
        ) else {
            continue;
        };
        let ended = match i32::try_from(code) {
            Ok(c) if c < 0 => Ended::Signal(-c),
            Ok(c) => Ended::Code(c),
            Err(_) => continue,
        };
        if let Some(tx) = lock(waiting).remove(&id) {
            let _ = tx.send(ended);
        }
    }
    lock(waiting).clear();
}

/// A lock whose holder panicked is still good here: the maps and pipes stay whole.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(w: &[&str]) -> Vec<String> {
        w.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_a_python_and_a_script_file_go_through_it() {
        let here = file!();
        let dir = std::env::temp_dir().join(format!("oomkit-warm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("train.py");
        std::fs::write(&script, "print(1)\n").unwrap();
        let s = script.to_str().unwrap();
        assert!(python_script(&words(&["python", s, "--batch", "4"])));
        assert!(python_script(&words(&["/usr/bin/python3.11", s])));
        assert!(!python_script(&words(&["python", "-u", s])));
        assert!(!python_script(&words(&["python", "-m", "train"])));
        assert!(!python_script(&words(&["torchrun", s])));
        assert!(!python_script(&words(&["pythonw", s])));
        assert!(!python_script(&words(&[
            "python",
            &dir.join("missing.py").to_string_lossy()
        ])));
        assert!(!python_script(&words(&["python", here])));
        assert!(!python_script(&words(&["python"])));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_run_not_wanted_yet_is_started_fresh() {
        let dir = std::env::temp_dir().join(format!("oomkit-warm-want-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("train.py");
        std::fs::write(&script, "print(1)\n").unwrap();
        let command = words(&["python", script.to_str().unwrap()]);
        let w = Warm::default();
        w.prepare(&command);
        assert!(
            w.server.get().is_none(),
            "nothing started before it is wanted"
        );
        assert_eq!(w.run(&command, &[], true), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
