//! A warm interpreter for the runs after the first: one Python that has
//! imported torch once (`oomkit.preflight.warm`), forking a process
//! for each run of the script the fixes and searches ask for, so that each
//! starts at the script's first line instead of several seconds of imports.
//! Where runs may follow the first (the fixes, where the step does not fit), it
//! imports beside that first run, and is stopped where none follows.
//!
//! Only a command that runs Python on a script is run this way: `python
//! train.py ARGS`, `python -m MODULE ARGS`, or a program whose first line
//! starts Python on it (pip's console scripts: `tune run`, `litgpt`); any
//! other (a shell script, interpreter flags) is started as a fresh process,
//! as is every run where the warm interpreter could not start or has gone.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;

use super::shared;

/// What the interpreter runs to serve the runs: `oomkit.preflight.warm`'s `main`, where that
/// module imports. Not `python -m`: an interpreter without oomkit would print Python's own
/// "Error while finding module specification" beside the one line the fresh run then says,
/// and an interpreter that started importing beside the first run must stay quiet. It exits
/// with 3 there, as the module does where it cannot import what runs need.
const BOOTSTRAP: &str = "import importlib, sys
try:
    warm = importlib.import_module('oomkit.preflight.warm')
except Exception:
    sys.exit(3)
warm.main()
";

/// The file a forked run leaves in its folder where it must run again as a fresh process
/// (its script set a compiler setting that the warm interpreter's imports had read).
pub(super) const FRESH: &str = "fresh";

/// What the command says where a forked run stopped to start again fresh: `name` is the
/// variable its script set (the text of the [`FRESH`] mark), which PyTorch's compiler had
/// read when the warm interpreter imported it.
pub(super) fn restarted(name: &str) -> String {
    let what = if name.is_empty() {
        "a compiler setting"
    } else {
        name
    };
    format!(
        "preflight: the script sets {what}, which PyTorch reads as it is imported: the run starts again as a fresh process, and what it printed above is printed again"
    )
}

/// How a run forked from the warm interpreter ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ended {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it (which one, no message says).
    Signal,
}

/// The runs still going, each waiting for how it ended.
type Waiting = Arc<Mutex<HashMap<u64, mpsc::Sender<Ended>>>>;

/// The warm interpreter of one command: asked for once more runs are known to follow.
/// Where the environment names a shared one (`OOMKIT_PREFLIGHT_SERVER`), every run is
/// asked of that first, and this command starts its own only once that one refused a run.
#[derive(Default)]
pub(super) struct Warm {
    /// Whether runs go through it (set once a second run is known to come).
    wanted: AtomicBool,
    /// Whether the shared interpreter refused a run of this command (it is not asked again).
    refused: AtomicBool,
    /// The interpreter, started by the first run that goes through it; None where it could not start.
    server: OnceLock<Option<Server>>,
    /// An interpreter started beside the first run, still importing, for the runs that may follow it.
    early: Mutex<Option<Starting>>,
}

/// A warm interpreter started and importing, not yet asked whether it is ready.
struct Starting {
    /// The interpreter it runs.
    python: String,
    /// Taken by [`Starting::ready`]; one still here when it is dropped is stopped.
    child: Option<Child>,
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

    /// Starts the warm interpreter's imports now, beside the first run of `command`, where more
    /// runs may follow it (the fixes, where the step does not fit): those then start at once
    /// instead of after several seconds of imports. Not used, it is stopped ([`Warm::stop_early`]).
    /// Nothing starts where a shared interpreter takes the runs or the command is no Python script.
    pub(super) fn start_early(&self, command: &[String]) {
        if self.server.get().is_some() || shared::socket().is_some() {
            return;
        }
        let Some(script) = python_script(command) else {
            return;
        };
        let mut early = lock(&self.early);
        if early.is_none() {
            *early = Starting::spawn(&script.python);
        }
    }

    /// Stops the interpreter [`Warm::start_early`] started, where no run will go through it.
    pub(super) fn stop_early(&self) {
        lock(&self.early).take();
    }

    /// Starts the warm interpreter for `command` where runs are wanted from it and the
    /// command is one it can take, waiting until it has imported; a second call finds it
    /// started. Called before a run's time is counted, so that the wait is not the run's.
    pub(super) fn prepare(&self, command: &[String]) {
        // Once started (or found not to start), there is nothing to look up again.
        if !self.wanted.load(Ordering::Relaxed) || self.server.get().is_some() {
            return;
        }
        // A shared interpreter takes the runs while it takes them.
        if shared::socket().is_some() && !self.refused.load(Ordering::Relaxed) {
            return;
        }
        if let Some(script) = python_script(command) {
            self.server.get_or_init(|| {
                // The one started beside the first run, where it runs the same interpreter.
                let early = lock(&self.early)
                    .take()
                    .filter(|e| e.python == script.python);
                early.map_or_else(|| Server::start(&script.python), Starting::ready)
            });
        }
    }

    /// Runs `words` (`python train.py ARGS`) forked from the shared warm interpreter or
    /// this command's, with `env` added to the command's environment, and says how it
    /// ended; None where this run cannot go through either (not prepared, not a Python
    /// script, refused, or the interpreter is gone), for the caller to start it fresh.
    pub(super) fn run(
        &self,
        words: &[String],
        env: &[(&str, &OsString)],
        quiet: bool,
    ) -> Option<Ended> {
        let script = python_script(words)?;
        if let Some(socket) = shared::socket().filter(|_| !self.refused.load(Ordering::Relaxed)) {
            if let Some(run) = script.shared() {
                match shared::run(&socket, &run, env, quiet) {
                    shared::Asked::Ran(code) => {
                        return Some(code.map_or(Ended::Signal, Ended::Code))
                    }
                    shared::Asked::Refused(why) => {
                        shared::tell_refused(&socket, &why);
                        self.refused.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
        let server = self.server.get()?.as_ref()?;
        if script.python != server.python {
            return None;
        }
        server.run(&script, env, quiet)
    }
}

/// A command the warm interpreter can take: a Python script and its arguments.
#[derive(Debug, PartialEq, Eq)]
struct Script<'w> {
    /// The interpreter that runs it, as the command or the script's first line names it.
    python: String,
    /// What Python runs: a file, as it is given it (`sys.argv[0]`), or a module (`-m`).
    main: Main,
    args: &'w [String],
}

impl Script<'_> {
    /// The run as the shared interpreter is asked for it, its interpreter named in full
    /// (the server compares it with its own); None where it is not found.
    fn shared(&self) -> Option<shared::Run<'_>> {
        let python = std::path::absolute(on_path(&self.python)?).ok()?;
        Some(shared::Run {
            python: python.to_str()?.to_string(),
            main: match &self.main {
                Main::File(path) => ("script", path.as_str()),
                Main::Module(name) => ("module", name.as_str()),
            },
            args: self.args,
        })
    }
}

/// What a Python command runs as `__main__`.
#[derive(Debug, PartialEq, Eq)]
enum Main {
    /// A script file: `python train.py`.
    File(String),
    /// A module: `python -m torchtune._cli.tune`.
    Module(String),
}

/// `words` as a Python script: an interpreter and a script file or `-m MODULE` after it,
/// nothing between (`python train.py ARGS`, `python -m torchtune._cli.tune run ...`), or a
/// program whose first line starts Python on it (a console script pip installed: `tune run
/// ...`, `litgpt finetune ...`), which the system would run as `PYTHON PROGRAM ARGS`. None
/// for anything else.
fn python_script(words: &[String]) -> Option<Script<'_>> {
    let (first, rest) = words.split_first()?;
    if is_python(first) {
        let (script, args) = rest.split_first()?;
        if script == "-m" {
            let (module, args) = args.split_first()?;
            return Some(Script {
                python: first.clone(),
                main: Main::Module(module.clone()),
                args,
            });
        }
        return (script.ends_with(".py") && Path::new(script).is_file()).then(|| Script {
            python: first.clone(),
            main: Main::File(script.clone()),
            args,
        });
    }
    let program = on_path(first)?;
    let python = shebang_python(&program)?;
    Some(Script {
        python,
        main: Main::File(program.to_str()?.to_string()),
        args: rest,
    })
}

/// Whether a program's name is a Python interpreter's: `python`, `python3`, `python3.11`.
fn is_python(program: &str) -> bool {
    let name = Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("");
    name.strip_prefix("python")
        .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
}

/// The file a program's name runs, as the system finds it: the name itself where it has
/// a `/`, else the first match on `PATH`.
fn on_path(program: &str) -> Option<std::path::PathBuf> {
    if program.contains('/') {
        return Path::new(program).is_file().then(|| program.into());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// The Python interpreter a program's first line starts it with (`#!/venv/bin/python`,
/// `#!/usr/bin/env python3`), where it is one.
fn shebang_python(program: &Path) -> Option<String> {
    use std::io::Read;
    let mut head = [0u8; 512];
    let n = std::fs::File::open(program).ok()?.read(&mut head).ok()?;
    let line = std::str::from_utf8(&head[..n]).ok()?.lines().next()?;
    let mut words = line.strip_prefix("#!")?.split_whitespace();
    let mut interpreter = words.next()?;
    if Path::new(interpreter).file_name().and_then(|n| n.to_str()) == Some("env") {
        interpreter = words.next()?;
    }
    // Interpreter flags on the line (`-u`, `-E`) would be lost in a fork: such a program runs fresh.
    (is_python(interpreter) && words.next().is_none()).then(|| interpreter.to_string())
}

impl Starting {
    /// Starts the interpreter on [`BOOTSTRAP`] without waiting for its imports; None where it cannot.
    fn spawn(python: &str) -> Option<Starting> {
        let child = Command::new(python)
            .args(["-c", BOOTSTRAP])
            .env_remove("OOMKIT_PREFLIGHT")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .ok()?;
        Some(Starting {
            python: python.to_string(),
            child: Some(child),
        })
    }

    /// Waits until it has imported, and gives the interpreter that serves runs; None where it cannot.
    fn ready(mut self) -> Option<Server> {
        let mut child = self.child.take()?;
        let python = std::mem::take(&mut self.python);
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
            python,
            requests: Mutex::new(child.stdin.take()),
            child: Mutex::new(child),
            waiting,
            next: AtomicU64::new(0),
        })
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        // Started for runs that did not come: its imports are stopped, not waited for.
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Server {
    /// Starts the interpreter on [`BOOTSTRAP`] and waits until it has imported; None where it cannot.
    fn start(python: &str) -> Option<Server> {
        Starting::spawn(python)?.ready()
    }

    /// Asks for one run and waits for its end; None where the interpreter is gone.
    fn run(&self, script: &Script<'_>, env: &[(&str, &OsString)], quiet: bool) -> Option<Ended> {
        let vars = shared::env_json(env)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (key, main) = match &script.main {
            Main::File(path) => ("script", path),
            Main::Module(name) => ("module", name),
        };
        let mut request = serde_json::json!({
            "id": id,
            "args": script.args,
            "env": vars,
            "quiet": quiet,
        });
        request[key] = Value::String(main.clone());
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
            Ok(c) if c < 0 => Ended::Signal,
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

    /// Writes a file in a test's scratch folder (removed at the test's end) and gives its path.
    fn file(dir: &super::super::Scratch, name: &str, text: &str) -> String {
        let path = dir.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    }

    #[test]
    fn a_restart_names_the_setting_or_a_compiler_setting_where_the_mark_is_empty() {
        assert!(restarted("TORCHINDUCTOR_MAX_AUTOTUNE")
            .starts_with("preflight: the script sets TORCHINDUCTOR_MAX_AUTOTUNE, which"));
        assert!(restarted("").starts_with("preflight: the script sets a compiler setting, which"));
    }

    #[test]
    fn only_a_python_and_a_script_file_or_module_go_through_it() {
        let dir = super::super::Scratch::new().unwrap();
        let s = file(&dir, "train.py", "print(1)\n");
        let taken =
            |w: &[&str]| python_script(&words(w)).map(|s| (s.python, s.main, s.args.to_vec()));
        assert_eq!(
            taken(&["python", &s, "--batch", "4"]),
            Some((
                "python".into(),
                Main::File(s.clone()),
                words(&["--batch", "4"])
            ))
        );
        assert!(taken(&["/usr/bin/python3.11", &s]).is_some());
        assert_eq!(taken(&["python", "-u", &s]), None);
        assert_eq!(
            taken(&["python3", "-m", "torchtune._cli.tune", "run"]),
            Some((
                "python3".into(),
                Main::Module("torchtune._cli.tune".into()),
                words(&["run"])
            ))
        );
        assert_eq!(taken(&["python", "-m"]), None);
        assert_eq!(taken(&["python", "-X", "importtime", &s]), None);
        assert_eq!(taken(&["pythonw", &s]), None);
        assert_eq!(taken(&["python", &file(&dir, "notes.txt", "")]), None);
        assert_eq!(
            taken(&["python", &format!("{}/missing.py", dir.0.display())]),
            None
        );
        assert_eq!(taken(&["python"]), None);
    }

    #[test]
    fn a_program_that_starts_python_on_itself_goes_through_it_as_the_system_runs_it() {
        let dir = super::super::Scratch::new().unwrap();
        let tune = file(&dir, "tune", "#!/venv/bin/python3.11\nimport sys\n");
        let env = file(&dir, "litgpt", "#!/usr/bin/env python3\nimport sys\n");
        let flagged = file(&dir, "flagged", "#!/venv/bin/python -u\nimport sys\n");
        let shell = file(&dir, "launch", "#!/bin/sh\nexec python \"$@\"\n");
        let taken =
            |w: &[&str]| python_script(&words(w)).map(|s| (s.python, s.main, s.args.to_vec()));
        assert_eq!(
            taken(&[&tune, "run", "lora_finetune_single_device"]),
            Some((
                "/venv/bin/python3.11".into(),
                Main::File(tune.clone()),
                words(&["run", "lora_finetune_single_device"])
            ))
        );
        assert_eq!(
            taken(&[&env, "finetune"]).map(|t| t.0),
            Some("python3".into())
        );
        assert_eq!(taken(&[&flagged]), None);
        assert_eq!(taken(&[&shell, "train.py"]), None);
        assert_eq!(taken(&["no-such-program-anywhere"]), None);
    }

    #[test]
    fn a_run_not_wanted_yet_is_started_fresh() {
        let dir = super::super::Scratch::new().unwrap();
        let command = words(&["python", &file(&dir, "train.py", "print(1)\n")]);
        let w = Warm::default();
        w.prepare(&command);
        assert!(
            w.server.get().is_none(),
            "nothing started before it is wanted"
        );
        assert_eq!(w.run(&command, &[], true), None);
    }

    /// A stand-in interpreter in `dir`: it says it is ready, gives its process id, and serves until its input ends.
    fn standin_python(dir: &super::super::Scratch) -> String {
        use std::os::unix::fs::PermissionsExt;
        let pid = dir.0.join("pid");
        let python = file(
            dir,
            "python3",
            &format!(
                "#!/bin/sh\necho $$ > {}.tmp && mv {0}.tmp {0}\necho '{{\"ready\": true}}'\nexec cat > /dev/null\n",
                pid.display()
            ),
        );
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        python
    }

    /// The stand-in's process id, once it has started.
    fn standin_pid(dir: &super::super::Scratch) -> u32 {
        let path = dir.0.join("pid");
        for _ in 0..500 {
            if let Ok(text) = std::fs::read_to_string(&path) {
                return text.trim().parse().unwrap();
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("the stand-in interpreter did not start");
    }

    #[test]
    fn an_interpreter_started_early_serves_the_runs_once_they_are_wanted() {
        if shared::socket().is_some() {
            return; // A shared interpreter takes the runs instead: nothing starts early.
        }
        let dir = super::super::Scratch::new().unwrap();
        let command = words(&[&standin_python(&dir), &file(&dir, "train.py", "print(1)\n")]);
        let w = Warm::default();
        w.start_early(&command);
        assert!(lock(&w.early).is_some(), "it imports beside the first run");
        w.prepare(&command);
        assert!(
            w.server.get().is_none(),
            "the first run is not forked from it: it is not wanted yet"
        );
        w.want();
        w.prepare(&command);
        assert!(
            matches!(w.server.get(), Some(Some(_))),
            "the runs after the first go through it"
        );
        assert!(
            lock(&w.early).is_none(),
            "the one started early is the one serving"
        );
    }

    #[test]
    fn an_interpreter_started_early_and_not_needed_is_stopped() {
        if shared::socket().is_some() {
            return;
        }
        let dir = super::super::Scratch::new().unwrap();
        let command = words(&[&standin_python(&dir), &file(&dir, "train.py", "print(1)\n")]);
        let w = Warm::default();
        w.start_early(&command);
        let pid = standin_pid(&dir);
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        w.stop_early();
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "stopped and reaped, not left importing"
        );
        assert!(w.server.get().is_none());
    }
}
