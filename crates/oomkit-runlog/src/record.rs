//! Reading a run log back into typed records.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// Memory measured over one stage, step or phase.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Measure {
    /// The training step, when the measure belongs to one.
    pub step: Option<u64>,
    /// `forward`, `backward`, `optimizer`, `step`, or a phase's name.
    pub name: String,
    /// Bytes in use when it began.
    pub start_bytes: u64,
    /// Bytes in use when it ended.
    pub end_bytes: u64,
    /// Most bytes in use while it ran.
    pub peak_bytes: u64,
    /// Bytes the allocator reserved from the device at its end (0 on CPU).
    pub reserved_bytes: u64,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Where part of it ran while the process stayed under an earlier
    /// high-water mark, that mark: its true peak lies between `peak_bytes`
    /// and this (the tracker never resets the process's peak counters).
    pub peak_at_most_bytes: Option<u64>,
    /// A step the tracker opened itself from the optimizer's steps, in a loop that marks none.
    pub auto: bool,
}

impl Measure {
    /// True when `peak_bytes` is only a lower bound of its peak.
    pub fn peak_is_bound(&self) -> bool {
        self.peak_at_most_bytes.is_some_and(|m| m > self.peak_bytes)
    }
}

/// Whether a measure is a stage inside a step, a whole step, or a named phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MeasureKind {
    /// Forward, backward or optimizer step, found by hooks.
    Stage,
    /// A whole `tracker.step()`.
    Step,
    /// A `tracker.phase(name)` such as eval.
    Phase,
}

/// What the model's tensors cost, as the tracker counted them.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Components {
    /// The step after which it was counted (absent: at start).
    pub step: Option<u64>,
    /// Parameter bytes, each storage counted once.
    pub params_bytes: u64,
    /// Number of parameter elements.
    pub params_count: u64,
    /// Bytes of parameters that require gradients.
    pub trainable_bytes: u64,
    /// Bytes of parameters that do not.
    pub frozen_bytes: u64,
    /// Buffer bytes (batch-norm statistics, rotary tables, ...).
    pub buffers_bytes: u64,
    /// Gradient bytes held when counted.
    pub grads_bytes: u64,
    /// Optimizer state bytes (Adam's moments, momentum, ...).
    pub optimizer_state_bytes: u64,
    /// Bytes of EMA copies.
    pub ema_bytes: u64,
    /// Where the EMA copy lives, e.g. `cuda:0` or `cpu`.
    pub ema_device: Option<String>,
    /// Per top-level submodule.
    pub by_module: Vec<ModuleCost>,
}

/// Parameters of one top-level submodule.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct ModuleCost {
    /// The submodule's attribute name.
    pub name: String,
    /// Its parameter bytes.
    pub params_bytes: u64,
    /// Of which trainable.
    pub trainable_bytes: u64,
    /// True when none of its parameters require gradients.
    pub frozen: bool,
}

/// Gradient health at one step.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Grad {
    /// The step.
    pub step: u64,
    /// Parameters that had a gradient.
    pub params_with_grad: u64,
    /// Gradient bytes.
    pub grad_bytes: u64,
    /// L2 norm over all gradients (NaN when one is not finite).
    pub total_norm: Option<f64>,
    /// Parameters whose gradient holds a NaN.
    pub nan_params: u64,
    /// Parameters whose gradient holds an infinity (and no NaN).
    pub inf_params: u64,
}

/// Tensors that mirror the model's parameters but belong to nothing tracked.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct DuplicateGroup {
    /// Their dtype, e.g. `torch.float32`.
    pub dtype: String,
    /// Their device, e.g. `cuda:0`.
    pub device: String,
    /// How many tensors.
    pub tensors: u64,
    /// Their bytes, each storage counted once.
    pub bytes: u64,
    /// Parameters whose shape one of them mirrors.
    pub params_matched: u64,
    /// Parameters of the model.
    pub params_total: u64,
}

/// One duplicate check.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Duplicates {
    /// `start`, `manual` or `oom`.
    pub when: String,
    /// The step at the time, if any.
    pub step: Option<u64>,
    /// Total bytes of all groups.
    pub bytes: u64,
    /// Groups by dtype and device.
    pub groups: Vec<DuplicateGroup>,
}

/// Memory state at an OOM, as the tracker read it.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct OomMemory {
    /// Bytes held by tensors.
    pub allocated_bytes: u64,
    /// Bytes reserved by the caching allocator.
    pub reserved_bytes: u64,
    /// Peak bytes in the stage that failed.
    pub peak_bytes: u64,
    /// The device's capacity, when known.
    pub capacity_bytes: Option<u64>,
    /// The process's own cap ("N allowed" in PyTorch's message), where one was set.
    pub allowed_bytes: Option<u64>,
    /// What the driver had free when the request failed, as the message says it.
    pub free_bytes: Option<u64>,
}

/// An out-of-memory error that left `tracker.step()` or `tracker.phase()`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Oom {
    /// When it happened, seconds since the epoch (absent in older logs).
    pub time: Option<f64>,
    /// The step, if inside one.
    pub step: Option<u64>,
    /// The stage that was running: forward, backward, optimizer, or the phase's name.
    pub stage: Option<String>,
    /// The phase, if inside one.
    pub phase: Option<String>,
    /// Bytes the failed allocation asked for, parsed from the message.
    pub requested_bytes: Option<u64>,
    /// The error's first line.
    pub message: String,
    /// Memory at that moment.
    pub memory: OomMemory,
    /// The snapshot dumped at the OOM, when history was recorded.
    pub snapshot: Option<String>,
}

/// The micro-batch and accumulation a run used, as a framework integration applied or read them.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Plan {
    /// Samples per forward pass on one process.
    pub micro_batch: Option<u64>,
    /// Micro-batches per optimizer step.
    pub grad_accum: Option<u64>,
    /// Micro-batch x accumulation: samples per optimizer step on one process.
    pub effective_batch: Option<u64>,
    /// The attempt's number, from 1: `oomkit run`'s, or the torchrun job's after a restart.
    pub attempt: Option<u64>,
    /// Who chose it: `oomkit run`, or the framework's own arguments.
    pub source: String,
    /// The framework the plan was applied to, e.g. `transformers` or `lightning`.
    pub framework: String,
    /// When the try with this plan started, seconds since the epoch.
    pub time: Option<f64>,
    /// Whether the plan was applied: true or false where an integration
    /// checked what the training really runs, null where nothing could tell
    /// (the tracker's record of what `oomkit run` handed a plain loop).
    pub applied: Option<bool>,
    /// Why the plan handed down could not be applied, where it was not.
    pub not_applied: Option<String>,
}

impl Plan {
    /// True for the record the tracker writes of `oomkit run`'s attempt before any integration speaks (`applied` null).
    pub fn is_handed_down_only(&self) -> bool {
        self.applied.is_none() && self.source == "oomkit run"
    }
}

/// What the tracker's hooks saw over the whole run, inside steps or not.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Seen {
    /// Forward passes of the tracked model.
    pub forward: u64,
    /// Backward passes through its outputs.
    pub backward: u64,
    /// Steps of the tracked optimizer.
    pub optimizer: u64,
}

/// The `end` record: how the run ended, written by the tracker when it closes, or by `oomkit run` after a kill.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct End {
    /// When it was written, seconds since the epoch.
    pub time: Option<f64>,
    /// Steps the tracker counted.
    pub steps: Option<u64>,
    /// `closed` (tracker.close()), `exit` (the interpreter exited with the tracker open),
    /// `exception` (an uncaught exception ended the program), or `killed` (a signal, written by `oomkit run`).
    pub ended: Option<String>,
    /// The uncaught exception's type and message, for `exception`.
    pub exception: Option<String>,
    /// The signal that ended the process, for `killed`.
    pub signal: Option<i32>,
    /// True when the kernel recorded an OOM kill while the process ran, for `killed`.
    pub oom_kill: Option<bool>,
    /// The memory cgroup's limit at the kill, where one was set.
    pub limit_bytes: Option<u64>,
    /// What the hooks saw.
    pub seen: Option<Seen>,
    /// The process's high-water mark as the tracker last read it.
    pub peak_bytes: Option<u64>,
    /// Who wrote it, where not the tracker (`oomkit run`).
    pub written_by: Option<String>,
}

impl End {
    /// True when the kernel's OOM killer ended the process.
    pub fn killed_for_memory(&self) -> bool {
        self.ended.as_deref() == Some("killed") && self.oom_kill == Some(true)
    }
}

/// The newest run-log format this reader knows (`version` in the `start`
/// record; docs/run-log.md). A newer log is still read, its new record types
/// and fields ignored, and the analysis warns.
pub const LOG_VERSION: u32 = 1;

/// The `start` record: who ran, where, and what the model costs.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Start {
    /// Log format version.
    pub version: u32,
    /// Rank in a distributed run.
    pub rank: u32,
    /// Ranks in all.
    pub world_size: u32,
    /// `cuda:N` or `cpu`.
    pub device: String,
    /// Device memory in bytes (for CPU, the machine's memory, or the memory cgroup's limit where lower).
    pub capacity_bytes: Option<u64>,
    /// Where the capacity came from: `device`, `physical` or `cgroup`.
    pub capacity_source: Option<String>,
    /// `high_water` where stage peaks come from the process's high-water mark, unreset; `reset` where the tracker reset it at every boundary.
    pub peaks: Option<String>,
    /// The attempt `oomkit run` (or `find-batch`) ran the process as.
    pub attempt: Option<u64>,
    /// Seconds since the epoch.
    pub time: f64,
    /// torch's version.
    pub torch: String,
    /// How often gradient health is checked, in steps.
    pub grad_every: u64,
    /// The model's components at start.
    pub components: Components,
}

/// A whole run log.
#[derive(Clone, Debug, Default)]
pub struct Run {
    /// The `start` record, if the log has one.
    pub start: Option<Start>,
    /// Stages, steps and phases in order.
    pub measures: Vec<(MeasureKind, Measure)>,
    /// Component counts after the start (the optimizer's state appears after its first step).
    pub components: Vec<Components>,
    /// Gradient checks.
    pub grads: Vec<Grad>,
    /// Duplicate checks.
    pub duplicates: Vec<Duplicates>,
    /// OOMs.
    pub ooms: Vec<Oom>,
    /// Batch plans, in order (a framework that retries in-process writes one per attempt).
    pub plans: Vec<Plan>,
    /// Messages of failures inside the tracker, which it logged instead of raising.
    pub tracker_errors: Vec<String>,
    /// The `end` record, where the log has one.
    pub end: Option<End>,
    /// True when the log has an `end` record (the tracker was closed).
    pub closed: bool,
    /// True when the last line was cut short, as by a crash mid-write.
    pub torn_last_line: bool,
    /// Records of types this reader does not know.
    pub unknown_records: u64,
}

/// Folds the tracker's record of `oomkit run`'s attempt into the plan an
/// integration wrote after it for the same attempt: one attempt, one plan.
///
/// Under `oomkit run` the tracker writes what it was handed (with `applied`
/// null); an integration then writes what it applied. Both describe one
/// try, so the integration's record stands, keeping the attempt's number
/// and the time the try started.
fn merge_handed_down(plans: Vec<Plan>) -> Vec<Plan> {
    let mut out: Vec<Plan> = Vec::with_capacity(plans.len());
    for mut p in plans {
        if let Some(prev) = out.last() {
            let same = p.attempt.is_none() || p.attempt == prev.attempt;
            if prev.is_handed_down_only() && same {
                let prev = out.pop().expect("checked");
                p.attempt = p.attempt.or(prev.attempt);
                p.time = prev.time.or(p.time);
            }
        }
        out.push(p);
    }
    out
}

/// Returns true when `head` (the start of a file) looks like a run log.
pub fn is_run_log(head: &[u8]) -> bool {
    let s = head.iter().position(|b| !b.is_ascii_whitespace());
    matches!(s.map(|i| head[i]), Some(b'{'))
}

fn typed<T: serde::de::DeserializeOwned>(v: Value, line: usize) -> Result<T> {
    serde_json::from_value(v).map_err(|e| Error::Line {
        line,
        problem: e.to_string(),
    })
}

impl Run {
    /// Reads a run log file.
    pub fn read(path: &Path) -> Result<Run> {
        let text = std::fs::read(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        Run::parse(&text)
    }

    /// Parses the text of a run log.
    pub fn parse(text: &[u8]) -> Result<Run> {
        let mut run = Run::default();
        let lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
        let last_nonempty = lines.iter().rposition(|l| !l.trim_ascii().is_empty());
        // A line torn by a kill, behind which `oomkit run` wrote the end record
        // (and only `oomkit run`, which says so: any other bad line is an error).
        let torn_before_end = last_nonempty.and_then(|last| {
            let v: Value = serde_json::from_slice(lines[last].trim_ascii()).ok()?;
            let by_run = v.get("type").and_then(Value::as_str) == Some("end")
                && v.get("written_by").and_then(Value::as_str) == Some("oomkit run");
            by_run.then(|| {
                lines[..last]
                    .iter()
                    .rposition(|l| !l.trim_ascii().is_empty())
            })?
        });
        let mut records = 0usize;
        for (i, raw) in lines.iter().enumerate() {
            let line = raw.trim_ascii();
            if line.is_empty() {
                continue;
            }
            let value: Value = match serde_json::from_slice(line) {
                Ok(v) => v,
                // A crash mid-write leaves a torn last line; the rest is good.
                Err(_) if Some(i) == last_nonempty && !text.ends_with(b"\n") && records > 0 => {
                    run.torn_last_line = true;
                    continue;
                }
                Err(_) if Some(i) == torn_before_end && records > 0 => {
                    run.torn_last_line = true;
                    continue;
                }
                Err(e) => {
                    return Err(if records == 0 {
                        Error::NotARunLog(format!("line {} is not JSON ({e})", i + 1))
                    } else {
                        Error::Line {
                            line: i + 1,
                            problem: format!("not a JSON object ({e})"),
                        }
                    })
                }
            };
            let Some(kind) = value.get("type").and_then(Value::as_str).map(str::to_owned) else {
                if records == 0 {
                    return Err(Error::NotARunLog(format!(
                        "line {} has no 'type' field",
                        i + 1
                    )));
                }
                run.unknown_records += 1;
                continue;
            };
            records += 1;
            let n = i + 1;
            match kind.as_str() {
                "start" => run.start = Some(typed(value, n)?),
                "stage" => run.measures.push((MeasureKind::Stage, typed(value, n)?)),
                "step" => {
                    let mut m: Measure = typed(value, n)?;
                    m.name = "step".into();
                    run.measures.push((MeasureKind::Step, m));
                }
                "phase" => run.measures.push((MeasureKind::Phase, typed(value, n)?)),
                "components" => run.components.push(typed(value, n)?),
                "grad" => run.grads.push(typed(value, n)?),
                "duplicates" => run.duplicates.push(typed(value, n)?),
                "oom" => run.ooms.push(typed(value, n)?),
                "plan" => run.plans.push(typed(value, n)?),
                "error" => run.tracker_errors.push(
                    value
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                ),
                "end" => {
                    // Older logs' end records may lack every field: they still close the log.
                    run.end = Some(serde_json::from_value(value).unwrap_or_default());
                    run.closed = true;
                }
                _ => run.unknown_records += 1,
            }
        }
        if run.start.is_none() && run.measures.is_empty() {
            return Err(Error::NotARunLog(
                "no 'start', 'stage' or 'step' record".into(),
            ));
        }
        run.plans = merge_handed_down(std::mem::take(&mut run.plans));
        Ok(run)
    }

    /// Returns the measures of whole steps, in order.
    pub fn steps(&self) -> impl Iterator<Item = &Measure> {
        self.measures
            .iter()
            .filter(|(k, _)| *k == MeasureKind::Step)
            .map(|(_, m)| m)
    }
}
