//! `oomkit preflight -- python train.py ARGS`: the user's unchanged training
//! script run on meta tensors (no GPU), stopped after a few optimizer
//! steps, and answered with the peak, what held it, whether it fits, and
//! (with `{batch}` in the command) the largest micro-batch that does.
//!
//! The work is done in the script's own Python by `oomkit.preflight.script`,
//! started from a `sitecustomize` module this command puts first on the
//! script's `PYTHONPATH`; the answer comes back as a JSON file.

use crate::args::FormatArgs;
use crate::exit::{EXIT_INPUT, EXIT_NOTHING_FITS, EXIT_OK, EXIT_SPAWN};
use crate::output::{print, say};
use oomkit_report::{FixRow, OutOfMemory, PreflightReport, PreflightRun, Recipe, Replayed};
use oomkit_supervise::search::{largest_that_fits, Measured};
use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use warm::Ended;

mod recipe;
mod shared;
mod warm;

/// What `{batch}` in the command is replaced with.
const BATCH: &str = "{batch}";

/// The GPUs the sharding fix spreads a one-GPU script over: one node's worth.
const SHARD_OVER_GPUS: u32 = 8;

/// A run is not started with less of the command's time limit left than this.
const LEAST_RUN_SECONDS: f64 = 1.0;

/// The most runs of the script the fixes make at once: each is a Python
/// process of its own, holding up to a few GiB of bookkeeping for a large model.
const MOST_RUNS_AT_ONCE: usize = 4;

/// The hook the script's interpreter imports at start: it starts the
/// preflight where `OOMKIT_PREFLIGHT` is set, then hands over to any other
/// `sitecustomize` the environment has.
const SITECUSTOMIZE: &str = r#"# Written by `oomkit preflight` for the run it starts; removed after it.
import os as _os
import sys as _sys

if _os.environ.get("OOMKIT_PREFLIGHT"):
    try:
        from oomkit.preflight.script import install as _install
    except ImportError as _e:
        # The answer is this one line, which the command prints as it prints any.
        _said = f"this Python ({_sys.executable}) cannot import oomkit's preflight ({_e}); install oomkit where the script runs"
        try:
            import json as _json

            with open(_json.loads(_os.environ["OOMKIT_PREFLIGHT"])["result"], "w") as _f:
                _json.dump({"error": _said}, _f)
        except Exception:
            _sys.stderr.write(f"oomkit preflight: {_said}\n")
        _os._exit(2)
    _install()

# Hand over to the environment's own sitecustomize, if it has one.
_here = _os.path.dirname(_os.path.abspath(__file__))
try:
    import importlib.machinery as _machinery
    import importlib.util as _util

    _spec = _machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
    )
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(_util.module_from_spec(_spec))
except Exception as _e:
    _sys.stderr.write(f"oomkit preflight: the environment's sitecustomize failed: {_e}\n")
"#;

/// Flags of `oomkit preflight`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// What the allocator may hold (80GiB), or a GPU (H100, H200, B200, A100,
    /// A100-40GB, L4, L40S, A10G, V100, T4, RTX-4090, ... docs/whatif.md has
    /// them all: its total less 1.25 GiB of CUDA context).
    #[arg(long, value_name = "SIZE | GPU", default_value = "H100")]
    capacity: String,
    /// Optimizer steps to run before answering (the first creates the optimizer's state).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Write the step's snapshot here, in PyTorch's format (never over a file that exists).
    #[arg(long, value_name = "PATH")]
    snapshot: Option<PathBuf>,
    /// Allocator settings, as PYTORCH_CUDA_ALLOC_CONF writes them (default: that variable's value).
    #[arg(long, value_name = "SETTINGS")]
    alloc_conf: Option<String>,
    /// The micro-batch to put for {batch} in the command.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    micro_batch: u64,
    /// Search the largest micro-batch up to N that fits, running the
    /// command with each one tried in place of {batch}.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_micro_batch: Option<u64>,
    /// Search the largest value of a placeholder of the command that fits,
    /// from LO up to HI: NAME=LO..HI puts each value tried for {NAME}
    /// (--search seq=512..32768 with --seq-len {seq} in the command).
    #[arg(long, value_name = "NAME=LO..HI", value_parser = knob, conflicts_with = "max_micro_batch")]
    search: Option<Knob>,
    /// Run the script as rank 0 of N GPUs (a fake process group answers its
    /// init_process_group, so FSDP shards as it would across N).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    gpus: u32,
    /// Say what would make it fit, each change run on the script: done when
    /// it does not fit, and with this flag when it does.
    #[arg(long)]
    fixes: bool,
    /// Give the answer alone, one run, even when it does not fit: the fixes
    /// run the script again once for each change.
    #[arg(long, conflicts_with = "fixes")]
    no_fixes: bool,
    /// Stop the script after this many seconds on tensors without data: a
    /// loop that waits on a value the step does not have would never end.
    #[arg(long, value_name = "SECONDS", default_value_t = 300.0, value_parser = positive_seconds)]
    time_limit: f64,
    /// When the command started: `--time-limit` bounds the whole command, each run
    /// given what is left of it.
    #[arg(skip)]
    started: Option<std::time::Instant>,
    /// The warm interpreter the runs after the first are forked from.
    #[arg(skip)]
    warm: warm::Warm,
    #[command(flatten)]
    format: FormatArgs,
    /// The training command, after `--`: python train.py ARGS.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// A placeholder of the command to search, and the range searched.
#[derive(Clone, Debug)]
pub(crate) struct Knob {
    /// The placeholder's name, `seq` for `{seq}`.
    name: String,
    /// The smallest value, run first.
    lo: u64,
    /// The largest value worth trying.
    hi: u64,
}

/// Reads `NAME=LO..HI`.
fn knob(text: &str) -> Result<Knob, String> {
    let bad =
        || format!("{text:?}: give NAME=LO..HI, as seq=512..32768, with {{NAME}} in the command");
    let (name, range) = text.split_once('=').ok_or_else(bad)?;
    let (lo, hi) = range.split_once("..").ok_or_else(bad)?;
    let (lo, hi): (u64, u64) = (
        lo.trim().parse().map_err(|_| bad())?,
        hi.trim().parse().map_err(|_| bad())?,
    );
    let name = name.trim();
    if name.is_empty()
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        || lo == 0
        || hi < lo
    {
        return Err(bad());
    }
    Ok(Knob {
        name: name.to_string(),
        lo,
        hi,
    })
}

/// A time limit: a positive number of seconds.
fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{text:?} is not a positive number of seconds")),
    }
}

/// Why a run gave no answer.
enum Failure {
    /// The command could not be started.
    Spawn(String),
    /// It started and gave no answer; the line says why.
    NoAnswer(String),
    /// The GPU ran out as it ran and the script stopped (a run that refuses what the GPU
    /// would): its figures are of a run cut short; the same run refusing nothing answers.
    Refused(OutOfMemory),
}

/// `oomkit preflight`.
pub(crate) fn run(mut a: Args) -> u8 {
    a.started = Some(std::time::Instant::now());
    // A capacity refused here is one line, before any script runs.
    if let Err(e) = oomkit_allocator::parse_capacity(&a.capacity) {
        say(&format!("preflight: {e}"));
        return EXIT_INPUT;
    }
    let has_batch = a.command.iter().any(|w| w.contains(BATCH));
    if a.max_micro_batch.is_some() && !has_batch {
        say("preflight: --max-micro-batch needs {batch} in the command where the micro-batch goes (python train.py --batch-size {batch})");
        return EXIT_INPUT;
    }
    if let Some(k) = &a.search {
        let placeholder = format!("{{{}}}", k.name);
        if !a.command.iter().any(|w| w.contains(&placeholder)) {
            say(&format!(
                "preflight: --search {}: the command has no {placeholder} where the value goes (python generate.py --max-new-tokens {placeholder})",
                k.name
            ));
            return EXIT_INPUT;
        }
    }
    if let Some(s) = a.snapshot.as_ref().filter(|s| s.exists()) {
        say(&format!(
            "{}: exists; preflight never overwrites a file",
            s.display()
        ));
        return EXIT_INPUT;
    }
    let alloc_conf = a
        .alloc_conf
        .clone()
        .or_else(|| std::env::var("PYTORCH_CUDA_ALLOC_CONF").ok())
        .filter(|c| !c.is_empty());
    let batch = has_batch.then_some(a.micro_batch);
    let knob = a.search.as_ref().map(|k| (k.name.as_str(), k.lo));
    let base = Variant {
        batch,
        alloc_conf: alloc_conf.as_deref(),
        ..Variant::default()
    };
    // The expandable-segments fix needs no run of its own: the first run's step
    // is replayed by the allocator model with those settings, where fixes will be wanted.
    let replay_conf = expandable_conf(alloc_conf.as_deref());
    let first_run = Variant {
        knob,
        snapshot: a.snapshot.as_deref(),
        replay: (!a.no_fixes).then_some((&replay_conf, a.fixes)),
        // The script sees CUDA's error where the GPU would run out, and may act on it (halve
        // its batch, skip one); a search runs each value it tries whole instead.
        refuse: a.max_micro_batch.is_none() && a.search.is_none(),
        ..base
    };
    // Runs known to follow the first: it too is forked from the warm interpreter they share.
    if a.fixes || a.max_micro_batch.is_some() || a.search.is_some() {
        a.warm.want();
    } else if !a.no_fixes {
        // The fixes follow where the step does not fit: the interpreter they fork from
        // imports beside the first run, not after it.
        a.warm.start_early(&a.command);
    }
    let first = match first_answer(&a, &first_run) {
        Ok(r) => r,
        Err(f) => return failed(f),
    };
    let mut report = PreflightReport {
        command: a.command.clone(),
        run: first,
        ..Default::default()
    };
    // The snapshot as the user named it (the script was given it made absolute).
    if let (Some(given), Some(_)) = (&a.snapshot, &report.run.snapshot) {
        report.run.snapshot = Some(given.display().to_string());
    }
    // The project's one search (oomkit-supervise), over the micro-batch
    // (--max-micro-batch) or any placeholder (--search), the run made above
    // reused as its first value.
    let searched = match (a.max_micro_batch, &a.search) {
        (Some(max), _) => Some(("batch", a.micro_batch, max)),
        (None, Some(k)) => Some((k.name.as_str(), k.lo, k.hi)),
        (None, None) => None,
    };
    if let Some((name, lo, hi)) = searched {
        let first = measured(&report.run);
        let mut measure = |v: u64| -> Result<Measured, Failure> {
            if v == lo {
                return Ok(first);
            }
            let variant = if a.search.is_some() {
                Variant {
                    knob: Some((name, v)),
                    ..base
                }
            } else {
                Variant {
                    batch: Some(v),
                    ..base
                }
            };
            run_once(&a, &variant).map(|r| measured(&r))
        };
        match largest_that_fits(lo, hi, report.run.capacity_bytes, &mut measure) {
            Ok((best, tried)) => {
                if a.search.is_none() {
                    report.largest_micro_batch = best;
                }
                report.searched = Some(name.to_string());
                report.largest = Some(best);
                report.tried = tried;
            }
            Err(f) => return failed(f),
        }
    }
    if a.fixes || (!report.run.fits && !a.no_fixes) {
        a.warm.want();
        let replayed = report.run.replayed.take();
        let script = AsWritten {
            accumulation: report.run.grad_accum.unwrap_or(1),
            already: std::mem::take(&mut report.run.in_script),
            recipe: report.run.recipe.take(),
            peak_allocated_bytes: report.run.peak_allocated_bytes,
            peak_reserved_bytes: report.run.peak_reserved_bytes,
            fits: report.run.fits,
        };
        report.fixes = fixes(
            &a,
            &base,
            knob,
            &script,
            replayed.as_ref(),
            &mut report.fix_notes,
        );
    } else {
        // No run follows the first: what started beside it for the fixes is stopped.
        a.warm.stop_early();
    }
    print(a.format.output(), &report);
    let fits = match &report.largest {
        Some(best) => best.is_some(),
        None => report.run.fits,
    };
    if fits {
        EXIT_OK
    } else {
        EXIT_NOTHING_FITS
    }
}

impl Change {
    /// Whether the change is the allocator's settings alone, which a replay of the recorded step answers.
    fn replayable(&self) -> bool {
        self.expandable
            && self.inside.is_empty()
            && self.args.is_empty()
            && self.drop.is_empty()
            && !self.halved
            && self.gpus.is_none()
    }
}

/// A change tried for "what would make it fit", as the script is run with it.
#[derive(Default)]
struct Change {
    /// In words, for the report.
    change: String,
    /// What it costs, in words.
    cost: &'static str,
    /// Changes made inside the script.
    inside: Vec<&'static str>,
    /// The allocator's expandable segments.
    expandable: bool,
    /// Half the micro-batch (and twice the accumulation).
    halved: bool,
    /// The GPUs it runs as rank 0 of, where it spreads the model over more than the script's.
    gpus: Option<u32>,
    /// Words added to the command (a recipe's overrides: `compile=True`).
    args: Vec<String>,
    /// Words of the command taken off it, by how they begin (`optimizer.fused=`).
    drop: Vec<String>,
    /// Why the script already makes it, where its recipe's config says so.
    already: Option<String>,
    /// It takes one backward per optimizer step (torchtune's `optimizer_in_bwd`), so it is
    /// not made together with a change that accumulates more.
    one_backward: bool,
    /// It accumulates more backward passes per optimizer step (half the batch).
    accumulates: bool,
}

/// The script as written, as its run found it: what the changes are weighed against.
struct AsWritten {
    /// Its own accumulation: backward passes per optimizer step.
    accumulation: u64,
    /// The changes it already makes, by name, each with why it would change nothing.
    already: BTreeMap<String, String>,
    /// The framework recipe it is (torchtune's), whose own switches are the changes.
    recipe: Option<Recipe>,
    /// Its peaks, and whether it fits.
    peak_allocated_bytes: u64,
    peak_reserved_bytes: u64,
    fits: bool,
}

impl AsWritten {
    /// Why `c` would change nothing in this script, if it would.
    fn already_makes(&self, c: &Change) -> Option<String> {
        if c.already.is_some() {
            return c.already.clone();
        }
        if c.expandable && c.inside.is_empty() && c.args.is_empty() {
            // The allocator settings in force (given, or set by the script), as its run found.
            return self.already.get(EXPANDABLE_IN_SCRIPT).cloned();
        }
        match c.inside.as_slice() {
            [name] => self.already.get(*name).cloned(),
            _ => None,
        }
    }

    /// The row of a change the script already makes: its own figures, and why.
    fn row(&self, c: &Change, why: String) -> FixRow {
        FixRow {
            change: c.change.clone(),
            peak_allocated_bytes: self.peak_allocated_bytes,
            peak_reserved_bytes: self.peak_reserved_bytes,
            fits: self.fits,
            cost: c.cost.into(),
            skipped: Vec::new(),
            already: Some(why),
        }
    }
}

/// The name the script's run gives allocator settings in force that already expand segments.
const EXPANDABLE_IN_SCRIPT: &str = "expandable_segments";

/// The changes preflight can make without editing the script, each run on
/// it, then all of them together: the fixes of the answer, measured. A change
/// the script already makes is a row saying so, with the script's own figures.
fn fixes(
    a: &Args,
    base: &Variant<'_>,
    knob: Option<(&str, u64)>,
    script: &AsWritten,
    replayed: Option<&Replayed>,
    notes: &mut Vec<String>,
) -> Vec<FixRow> {
    let (changes, sharded) = match script.recipe.as_ref() {
        Some(r) if r.framework == recipe::TORCHTUNE => {
            (recipe::changes(r, &a.command, notes), None)
        }
        _ => (script_changes(base, script), Some(sharded_change(a))),
    };
    // Each change alone, the sharding, and all of them together run side by side.
    // The run of all of them skips what cannot be made here (autocast the script
    // already has, no bitsandbytes), as the changes alone find it; where those find
    // otherwise, it is run again with the changes that ran alone.
    // A change the script already makes is not run: its row says so.
    let already: Vec<Option<String>> = changes.iter().map(|c| script.already_makes(c)).collect();
    let to_run: Vec<&Change> = changes
        .iter()
        .zip(&already)
        .filter(|(_, why)| why.is_none())
        .map(|(c, _)| c)
        .collect();
    let sharded_already = sharded.as_ref().and_then(|c| script.already_makes(c));
    let everything = together(&to_run);
    let mut jobs: Vec<&Change> = to_run.clone();
    if let Some(c) = sharded.as_ref().filter(|_| sharded_already.is_none()) {
        jobs.push(c);
    }
    jobs.push(&everything);
    let mut outcomes = side_by_side(a, base, knob, replayed, &jobs).into_iter();
    let not_run = |c: &Change| Err(format!("{}: not measured", c.change));
    let mut rows = Vec::new();
    let mut measured_changes = Vec::new();
    for (c, why) in changes.iter().zip(already) {
        if let Some(why) = why {
            rows.push(script.row(c, why));
            continue;
        }
        match outcomes.next().unwrap_or_else(|| not_run(c)) {
            Ok(row) => {
                rows.push(row);
                measured_changes.push(c);
            }
            Err(note) => notes.push(note),
        }
    }
    // After the changes alone, the sharding's outcome and all of them together's.
    let sharded_outcome = sharded.as_ref().map(|c| match sharded_already {
        Some(why) => Ok(script.row(c, why)),
        None => outcomes.next().unwrap_or_else(|| not_run(c)),
    });
    let everything_outcome = outcomes.next().unwrap_or_else(|| not_run(&everything));
    // Together only what ran alone: a change that cannot run here would sink the rest.
    if measured_changes.len() >= 2 {
        let wanted = together(&measured_changes);
        let outcome = match everything_outcome {
            Ok(row) if made(&everything, &row.skipped) == made(&wanted, &[]) => Ok(row),
            _ => measure_change(a, base, knob, None, &wanted),
        };
        match outcome {
            Ok(row) => rows.push(row),
            Err(note) => notes.push(note),
        }
    }
    match sharded_outcome {
        Some(Ok(row)) => rows.push(row),
        Some(Err(note)) => notes.push(note),
        None => {}
    }
    rows
}

/// The changes preflight makes to a script of the user's own (not a framework's recipe):
/// inside it (checkpointing, autocast, an 8-bit AdamW), the allocator's settings, and half
/// the micro-batch where the command has `{batch}`.
fn script_changes(base: &Variant<'_>, script: &AsWritten) -> Vec<Change> {
    let mut changes = vec![
        Change {
            change: "activation checkpointing of the model's repeated blocks".into(),
            cost: "each block's forward run again in backward (about a third more compute)",
            inside: vec!["checkpoint"],
            ..Change::default()
        },
        Change {
            change: "bf16 autocast around the model's forward".into(),
            cost: "matmuls in bfloat16 (the weights and the optimizer stay float32)",
            inside: vec!["autocast"],
            ..Change::default()
        },
        Change {
            change: "8-bit AdamW (bitsandbytes) for torch.optim.AdamW".into(),
            cost: "the optimizer's moments in 8 bits, with bitsandbytes installed",
            inside: vec!["adamw8bit"],
            ..Change::default()
        },
        expandable_change(),
    ];
    if let Some(b) = base.batch.filter(|&b| b > 1) {
        changes.push(Change {
            // Twice the script's own accumulation keeps its effective batch; the peak is the
            // half micro-batch's, however many of them accumulate.
            change: if script.accumulation > 1 {
                format!(
                    "micro-batch {} x accumulation {} (twice the script's {})",
                    b / 2,
                    2 * script.accumulation,
                    script.accumulation
                )
            } else {
                format!("micro-batch {} x accumulation 2", b / 2)
            },
            cost: HALF_THE_BATCH_COST,
            halved: true,
            accumulates: true,
            ..Change::default()
        });
    }
    changes
}

/// What half the micro-batch with twice the accumulation costs.
const HALF_THE_BATCH_COST: &str = "twice the forward and backward passes per optimizer step";

/// The allocator's expandable segments, a change to any script.
fn expandable_change() -> Change {
    Change {
        change: "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True".into(),
        cost: "none to speak of: the allocator maps pages instead of whole segments",
        expandable: true,
        ..Change::default()
    }
}

/// More GPUs, another kind of change: its own row, after the ones on the script's GPUs
/// (which it may not combine with: bitsandbytes' 8-bit step takes no sharded tensors).
fn sharded_change(a: &Args) -> Change {
    let over = if a.gpus > 1 { a.gpus } else { SHARD_OVER_GPUS };
    Change {
        change: format!("FSDP over {over} GPUs (fully_shard of each block)"),
        cost: "a GPU per rank; each gathers a block's weights as it runs it, and gradients are reduce-scattered",
        inside: vec!["fsdp"],
        gpus: Some(over),
        ..Change::default()
    }
}

/// What a run of `c` changed, less the changes inside the script it `skipped`.
fn made(c: &Change, skipped: &[String]) -> (Vec<&'static str>, bool, bool, Vec<String>) {
    let mut inside: Vec<&'static str> = c
        .inside
        .iter()
        .copied()
        .filter(|name| !skipped.iter().any(|s| s == name))
        .collect();
    inside.sort_unstable();
    (inside, c.expandable, c.halved, c.args.clone())
}

/// The changes made together, on the script's own GPUs ("all of the above").
/// A change that takes one backward per optimizer step leaves out one that accumulates more.
fn together(changes: &[&Change]) -> Change {
    let one_backward = changes.iter().any(|c| c.one_backward);
    let made: Vec<&&Change> = changes
        .iter()
        .filter(|c| !(one_backward && c.accumulates))
        .collect();
    Change {
        change: "all of the above".into(),
        cost: "each of the costs above",
        inside: made.iter().flat_map(|c| c.inside.clone()).collect(),
        expandable: made.iter().any(|c| c.expandable),
        halved: made.iter().any(|c| c.halved),
        // Sharding over more GPUs is a row of its own.
        gpus: None,
        args: made.iter().flat_map(|c| c.args.clone()).collect(),
        drop: made.iter().flat_map(|c| c.drop.clone()).collect(),
        one_backward,
        ..Change::default()
    }
}

/// Runs each change on the script, as many at once as the machine has cores
/// (at most [`MOST_RUNS_AT_ONCE`]), and gives their outcomes in the order given.
fn side_by_side(
    a: &Args,
    base: &Variant<'_>,
    knob: Option<(&str, u64)>,
    replayed: Option<&Replayed>,
    changes: &[&Change],
) -> Vec<Result<FixRow, String>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = cores.clamp(1, MOST_RUNS_AT_ONCE).min(changes.len());
    let next = AtomicUsize::new(0);
    let mut found: Vec<(usize, Result<FixRow, String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(c) = changes.get(i) else { break };
                        done.push((i, measure_change(a, base, knob, replayed, c)));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                // A worker only runs processes and reads their answers; a panic there is a bug to surface.
                h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
            })
            .collect()
    });
    found.sort_by_key(|(i, _)| *i);
    found.into_iter().map(|(_, outcome)| outcome).collect()
}

/// The allocator settings of the expandable-segments fix: the run's own, with expandable segments on.
fn expandable_conf(theirs: Option<&str>) -> String {
    match theirs {
        Some(theirs) if !theirs.is_empty() => format!("{theirs},expandable_segments:True"),
        _ => "expandable_segments:True".to_string(),
    }
}

/// One change measured on the script: its row, or the note saying why it could not be
/// measured. A change of the allocator's settings alone that the first run replayed
/// (`replayed`) needs no run.
fn measure_change(
    a: &Args,
    base: &Variant<'_>,
    knob: Option<(&str, u64)>,
    replayed: Option<&Replayed>,
    c: &Change,
) -> Result<FixRow, String> {
    let row = |peak_allocated_bytes, peak_reserved_bytes, fits, skipped| FixRow {
        change: c.change.clone(),
        peak_allocated_bytes,
        peak_reserved_bytes,
        fits,
        cost: c.cost.into(),
        skipped,
        already: None,
    };
    let conf = c.expandable.then(|| expandable_conf(base.alloc_conf));
    if let Some(r) = replayed.filter(|r| c.replayable() && Some(&r.alloc_conf) == conf.as_ref()) {
        return Ok(row(
            r.peak_allocated_bytes,
            r.peak_reserved_bytes,
            r.fits,
            Vec::new(),
        ));
    }
    let v = Variant {
        knob,
        batch: if c.halved {
            base.batch.map(|b| (b / 2).max(1))
        } else {
            base.batch
        },
        alloc_conf: conf.as_deref().or(base.alloc_conf),
        alloc_conf_fixed: c.expandable,
        fixes: &c.inside,
        args: &c.args,
        drop: &c.drop,
        snapshot: None,
        gpus: c.gpus,
        // The script's output was shown by its own run; runs side by side would interleave it.
        quiet: true,
        replay: None,
        // Each change is measured whole, as the script runs with it.
        refuse: false,
        // Several changes at once skip what cannot be made, and say so.
        skip_what_cannot: c.inside.len() > 1,
    };
    match run_once(a, &v) {
        Ok(r) => Ok(row(
            r.peak_allocated_bytes,
            r.peak_reserved_bytes,
            r.fits,
            r.fixes_skipped,
        )),
        Err(Failure::Spawn(m) | Failure::NoAnswer(m)) => Err(format!(
            "{}: not measured: {}",
            c.change,
            m.trim_start_matches("preflight: ")
        )),
        Err(Failure::Refused(o)) => Err(format!(
            "{}: not measured: the script stopped when the GPU ran out at {}",
            c.change, o.first_at
        )),
    }
}

fn failed(f: Failure) -> u8 {
    match f {
        Failure::Spawn(msg) => {
            say(&msg);
            EXIT_SPAWN
        }
        Failure::NoAnswer(msg) => {
            say(&msg);
            EXIT_INPUT
        }
        // (Only a run that refuses ends so, and it is run again refusing nothing.)
        Failure::Refused(o) => {
            say(&format!(
                "preflight: the script stopped when the GPU ran out at {}",
                o.first_at
            ));
            EXIT_INPUT
        }
    }
}

/// The first run's answer: where the GPU ran out and the script stopped, the same run
/// again refusing nothing, for the figures of the whole step, told where it ran out.
fn first_answer(a: &Args, first_run: &Variant<'_>) -> Result<PreflightRun, Failure> {
    match run_once(a, first_run) {
        Err(Failure::Refused(oom)) => {
            // From the warm interpreter the fixes will use too.
            a.warm.want();
            let mut r = run_once(
                a,
                &Variant {
                    refuse: false,
                    ..*first_run
                },
            )?;
            r.out_of_memory = Some(oom);
            Ok(r)
        }
        outcome => outcome,
    }
}

/// What a run measured, as the search reads it: whether it fits, and the
/// most it reserved (within the capacity where it fits, else without a limit).
fn measured(r: &PreflightRun) -> Measured {
    Measured {
        fits: r.fits,
        peak_bytes: if r.fits {
            (r.capacity_bytes as i64 - r.margin_bytes).max(0) as u64
        } else {
            r.peak_reserved_bytes
        },
    }
}

/// What one run of the command is given: the values of its placeholders,
/// where its snapshot goes, its allocator settings and the fixes tried in it.
#[derive(Clone, Copy, Default)]
struct Variant<'v> {
    /// The micro-batch for `{batch}`.
    batch: Option<u64>,
    /// A searched placeholder and its value (`("seq", 4096)` for `{seq}`).
    knob: Option<(&'v str, u64)>,
    snapshot: Option<&'v Path>,
    alloc_conf: Option<&'v str>,
    /// The settings are oomkit's (a fix tried), not the script's to override.
    alloc_conf_fixed: bool,
    /// Changes made inside the script (`oomkit.preflight.fixes`: checkpoint, autocast, adamw8bit, fsdp).
    fixes: &'v [&'v str],
    /// Words added to the end of the command (a recipe's overrides).
    args: &'v [String],
    /// Words of the command taken off it, by how they begin.
    drop: &'v [String],
    /// The GPUs it runs as rank 0 of, where a fix spreads the model over other than `--gpus`.
    gpus: Option<u32>,
    /// The script's own output is dropped (a fix's run), not shown.
    quiet: bool,
    /// Allocator settings to replay the recorded step with as well, and whether
    /// always (else only where the step does not fit, when fixes follow).
    replay: Option<(&'v str, bool)>,
    /// Changes inside the script that cannot be made are skipped and said, not the run's end.
    skip_what_cannot: bool,
    /// The step's allocations the GPU would refuse raise CUDA's error in the script.
    refuse: bool,
}

/// Runs the command once, as `v` says, and reads its answer.
fn run_once(a: &Args, v: &Variant<'_>) -> Result<PreflightRun, Failure> {
    let (batch, knob, snapshot, alloc_conf) = (v.batch, v.knob, v.snapshot, v.alloc_conf);
    // The warm interpreter's imports, where it starts now, are the command's time, not the run's.
    a.warm.prepare(&a.command);
    // What is left of the command's time limit is this run's.
    let spent = a.started.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let left = a.time_limit - spent;
    if left < LEAST_RUN_SECONDS {
        return Err(Failure::NoAnswer(format!(
            "preflight: the command's time limit ({} s, --time-limit) was spent before this run",
            a.time_limit
        )));
    }
    // To a tenth of a second, so that the limit a stopped run reports reads plainly (the
    // first run, started at once, reports the limit given).
    let left = (left * 10.0).round() / 10.0;
    let dir = Scratch::new().map_err(|e| {
        Failure::NoAnswer(format!(
            "preflight: cannot make a scratch folder in {}: {e}",
            std::env::temp_dir().display()
        ))
    })?;
    let hook = dir.0.join("sitecustomize.py");
    let result = dir.0.join("result.json");
    std::fs::write(&hook, SITECUSTOMIZE).map_err(|e| {
        Failure::NoAnswer(format!("preflight: cannot write {}: {e}", hook.display()))
    })?;
    let settings = serde_json::json!({
        "result": result,
        "steps": a.steps,
        "capacity": a.capacity,
        "snapshot": snapshot.map(|s| std::path::absolute(s).unwrap_or_else(|_| s.to_path_buf())),
        "alloc_conf": alloc_conf,
        // Given on the command line, it wins over what the script sets for itself.
        "alloc_conf_given": a.alloc_conf.is_some() || v.alloc_conf_fixed,
        "world_size": v.gpus.unwrap_or(a.gpus),
        // Launched as torchrun launches it only where the command says so (`--gpus`).
        "torchrun": a.gpus > 1,
        "time_limit": left,
        "fixes": v.fixes,
        "replay": v.replay.map(|(conf, always)| serde_json::json!({"alloc_conf": conf, "always": always})),
        "fixes_skip": v.skip_what_cannot,
        "out_of_memory": if v.refuse { "raise" } else { "measure" },
    });
    let words: Vec<String> = a
        .command
        .iter()
        .filter(|w| !v.drop.iter().any(|d| w.starts_with(d.as_str())))
        .chain(v.args)
        .map(|w| {
            let w = match batch {
                Some(b) => w.replace(BATCH, &b.to_string()),
                None => w.clone(),
            };
            match knob {
                Some((name, v)) => w.replace(&format!("{{{name}}}"), &v.to_string()),
                None => w,
            }
        })
        .collect();
    let mut path = std::ffi::OsString::from(dir.0.as_os_str());
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let settings = OsString::from(settings.to_string());
    let env = [("PYTHONPATH", &path), ("OOMKIT_PREFLIGHT", &settings)];
    // A run the warm interpreter could not take, or one whose script set what its imports had
    // already read (it left a mark and stopped), starts fresh.
    let ended = match a.warm.run(&words, &env, v.quiet) {
        Some(ended) if !dir.0.join(warm::FRESH).exists() => ended,
        Some(_) => {
            // What the stopped run printed is on the screen already, and the fresh run prints
            // it again: the reader is told why it repeats.
            if !v.quiet {
                let name = std::fs::read_to_string(dir.0.join(warm::FRESH)).unwrap_or_default();
                say(&warm::restarted(name.trim()));
            }
            spawn(&words, &env, v.quiet)?
        }
        None => spawn(&words, &env, v.quiet)?,
    };
    if !result.exists() {
        return Err(Failure::NoAnswer(format!(
            "preflight: `{}` exited with {} before preflight could answer; it must be a Python script that trains (oomkit preflight -- python train.py)",
            words.join(" "),
            match ended {
                Ended::Code(c) => format!("code {c}"),
                Ended::Signal => "a signal".to_string(),
            }
        )));
    }
    let no_answer = |e: String| Failure::NoAnswer(format!("preflight: {e}"));
    let doc = answer_doc(&result).map_err(no_answer)?;
    // The GPU ran out and the script stopped: the figures are of a run cut short.
    if let Some(oom) = doc
        .get("refused")
        .and_then(|r| serde_json::from_value(r.clone()).ok())
    {
        return Err(Failure::Refused(oom));
    }
    let mut run = run_of(&doc).map_err(no_answer)?;
    run.micro_batch = batch;
    Ok(run)
}

/// Starts `words` as a fresh process with `env` added, and waits for its end.
fn spawn(words: &[String], env: &[(&str, &OsString)], quiet: bool) -> Result<Ended, Failure> {
    let mut cmd = Command::new(&words[0]);
    // A killed oomkit ends the script too: it would otherwise run on for minutes, unanswered.
    oomkit_supervise::child::end_with_parent(&mut cmd);
    let status = cmd
        .args(&words[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        // The script's own prints go to stderr: stdout is the answer alone.
        .stdout(if quiet {
            Stdio::null()
        } else {
            Stdio::from(std::io::stderr())
        })
        .stderr(if quiet {
            Stdio::null()
        } else {
            Stdio::inherit()
        })
        .status()
        .map_err(|e| Failure::Spawn(format!("preflight: cannot run {}: {e}", words[0])))?;
    Ok(status.code().map_or(Ended::Signal, Ended::Code))
}

/// The document the Python side wrote: `{"result"}`, `{"error"}`, or `{"refused"}` where the
/// GPU ran out and the script stopped.
fn answer_doc(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("no answer ({e})"))?;
    serde_json::from_str(&text).map_err(|e| format!("the answer is not JSON ({e})"))
}

/// The run an answer holds, or the one line it gave instead.
fn run_of(doc: &Value) -> Result<PreflightRun, String> {
    if let Some(err) = doc.get("error").and_then(Value::as_str) {
        return Err(err.to_string());
    }
    doc.get("result")
        .cloned()
        .and_then(|r| serde_json::from_value(r).ok())
        .ok_or_else(|| "the answer has no result".to_string())
}

/// The Python that runs oomkit's preflight for `estimate --trace`:
/// `OOMKIT_PYTHON` (which the `oomkit` pip installs sets to its own
/// interpreter), else `python3`.
pub(crate) fn python() -> std::ffi::OsString {
    std::env::var_os("OOMKIT_PYTHON")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// Traces the training step of a Hugging Face config with preflight
/// (`python -m oomkit.preflight.config`), given the estimate's settings.
pub(crate) fn trace_config(mut settings: Value) -> Result<PreflightRun, String> {
    let dir = Scratch::new().map_err(|e| format!("cannot make a scratch folder: {e}"))?;
    let result = dir.0.join("result.json");
    settings["result"] = Value::String(result.display().to_string());
    let py = python();
    let mut cmd = Command::new(&py);
    oomkit_supervise::child::end_with_parent(&mut cmd);
    let out = cmd
        .args(["-m", "oomkit.preflight.config"])
        .env("OOMKIT_PREFLIGHT_CONFIG", settings.to_string())
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| format!("cannot run {}: {e}", py.to_string_lossy()))?;
    if !result.exists() {
        return Err(format!(
            "{} -m oomkit.preflight.config exited with {} and no answer (is oomkit installed for it? set OOMKIT_PYTHON)",
            py.to_string_lossy(),
            out.code().map_or("a signal".to_string(), |c| format!("code {c}"))
        ));
    }
    run_of(&answer_doc(&result)?)
}

/// A scratch folder removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> std::io::Result<Scratch> {
        let base = std::env::temp_dir();
        for n in 0..1000u32 {
            let p = base.join(format!("oomkit-preflight-{}-{n}", std::process::id()));
            match std::fs::create_dir(&p) {
                Ok(()) => return Ok(Scratch(p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("no free name"))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
