//! The PyO3 module `oomkit._native`: thin wrappers over the oomkit libraries.
//!
//! The Python tracker measures and hands numbers over; this module writes
//! the run log and runs every analysis. It starts no thread and touches no
//! GPU at import. A panic becomes a Python exception (PyO3's default with
//! unwinding), never an abort of the training run.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

// Named under `oomkit`, where users import them, so tracebacks read `oomkit.OomkitError`.
create_exception!(
    oomkit,
    OomkitError,
    PyException,
    "Base class of oomkit's errors."
);
create_exception!(
    oomkit,
    RunLogError,
    OomkitError,
    "A run log could not be written or read."
);

create_exception!(
    oomkit,
    PreflightError,
    OomkitError,
    "A preflight could not run the training step on fake tensors, or was given settings it cannot use."
);

fn runlog_err(e: oomkit_runlog::Error) -> PyErr {
    RunLogError::new_err(e.to_string())
}

/// Converts a Python value made of dicts, lists, strings and numbers to JSON.
fn to_json(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > 32 {
        return Err(RunLogError::new_err("record nested deeper than 32 levels"));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if obj.is_instance_of::<PyBool>() {
        return Ok(Value::Bool(obj.extract()?));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(Value::from(v));
        }
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(Value::from(v));
        }
        return Ok(serde_json::Number::from_f64(obj.extract::<f64>()?)
            .map(Value::Number)
            .unwrap_or(Value::Null));
    }
    if obj.is_instance_of::<PyFloat>() {
        // JSON has no NaN or infinity; null says "not a number" plainly.
        return Ok(serde_json::Number::from_f64(obj.extract()?)
            .map(Value::Number)
            .unwrap_or(Value::Null));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(s.to_cow()?.into_owned()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut m = serde_json::Map::new();
        for (k, v) in d.iter() {
            let key = match k.cast::<PyString>() {
                Ok(s) => s.to_cow()?.into_owned(),
                Err(_) => k.str()?.to_cow()?.into_owned(),
            };
            m.insert(key, to_json(&v, depth + 1)?);
        }
        return Ok(Value::Object(m));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l
            .iter()
            .map(|v| to_json(&v, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .map(|v| to_json(&v, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    Err(RunLogError::new_err(format!(
        "cannot log a value of type {}",
        obj.get_type().name()?
    )))
}

/// A run log opened for appending records.
#[pyclass(module = "oomkit._native")]
struct RunLog {
    writer: Mutex<Option<oomkit_runlog::Writer>>,
    path: PathBuf,
}

impl RunLog {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Option<oomkit_runlog::Writer>>> {
        self.writer
            .lock()
            .map_err(|_| RunLogError::new_err("the run log's lock is poisoned"))
    }
}

#[pymethods]
impl RunLog {
    /// Creates the log file (and its folders); an existing file is never overwritten.
    #[new]
    fn new(path: PathBuf) -> PyResult<Self> {
        let writer = oomkit_runlog::Writer::create(&path).map_err(runlog_err)?;
        Ok(RunLog {
            writer: Mutex::new(Some(writer)),
            path,
        })
    }

    /// Appends one record, a dict with a string "type"; flushes at step boundaries.
    fn write(&self, record: &Bound<'_, PyAny>) -> PyResult<()> {
        let value = to_json(record, 0)?;
        let mut guard = self.lock()?;
        let w = guard
            .as_mut()
            .ok_or_else(|| RunLogError::new_err("the run log is closed"))?;
        w.write(&value).map_err(runlog_err)
    }

    /// Writes buffered records to the file.
    fn flush(&self) -> PyResult<()> {
        let mut guard = self.lock()?;
        match guard.as_mut() {
            Some(w) => w.flush().map_err(runlog_err),
            None => Ok(()),
        }
    }

    /// Flushes and closes the file; later writes raise RunLogError.
    fn close(&self) -> PyResult<()> {
        let mut guard = self.lock()?;
        if let Some(mut w) = guard.take() {
            w.flush().map_err(runlog_err)?;
        }
        Ok(())
    }

    /// The log file's path.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// How many records were written.
    #[getter]
    fn records(&self) -> u64 {
        self.writer
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(|w| w.records()))
            .unwrap_or(0)
    }
}

fn analysis(path: &Path) -> PyResult<oomkit_compare::RunFile> {
    let run = oomkit_runlog::Run::read(path).map_err(runlog_err)?;
    Ok(oomkit_compare::RunFile {
        path: path.display().to_string(),
        analysis: oomkit_runlog::analyze(&run),
        run: None,
    })
}

/// Analyzes a run log and returns the JSON document `oomkit analyze --json` prints.
#[pyfunction]
fn analyze_run_json(path: PathBuf) -> PyResult<String> {
    let file = analysis(&path)?;
    serde_json::to_string(&oomkit_report::json::run(&file))
        .map_err(|e| OomkitError::new_err(e.to_string()))
}

/// Analyzes a run log and returns the report `oomkit analyze` prints.
#[pyfunction]
fn analyze_run_text(path: PathBuf) -> PyResult<String> {
    Ok(oomkit_report::text::run(&analysis(&path)?))
}

/// Returns this process's resident set size in bytes (0 where unknown).
#[pyfunction]
fn process_rss() -> u64 {
    oomkit_runlog::process::rss_bytes()
}

/// Returns this process's peak resident set size in bytes (0 where unknown).
#[pyfunction]
fn process_peak_rss() -> u64 {
    oomkit_runlog::process::peak_rss_bytes()
}

/// Resets the peak resident set size; returns False where the system does not allow it.
#[pyfunction]
fn reset_process_peak_rss() -> bool {
    oomkit_runlog::process::reset_peak_rss()
}

/// Returns (peak RSS since the last reset, or since the start without resets; RSS now) in bytes from one read, resetting the peak when asked; (0, 0) where unknown.
#[pyfunction]
fn process_sample(reset: bool) -> (u64, u64) {
    oomkit_runlog::process::sample_rss(reset).unwrap_or((0, 0))
}

/// Returns (bytes, source) of the memory this process may use: its memory cgroup's limit ("cgroup") where set below the machine's memory ("physical"); None where unknown.
#[pyfunction]
fn host_capacity() -> Option<(u64, String)> {
    let (bytes, source) = oomkit_gpu::host::host_capacity(None)?;
    let source = serde_json::to_value(source)
        .ok()
        .and_then(|v| v.as_str().map(String::from))?;
    Some((bytes, source))
}

/// Runs the oomkit command line (argv with the program name first) and returns its exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| oomkit_cli::main(argv.into_iter().map(Into::into)))
}

/// The kind of out-of-memory failure a message reports ("cuda", "cublas", "cpu", ...), or None.
#[pyfunction]
fn oom_kind(message: &str) -> Option<String> {
    let kind = oomkit_supervise::oom::detect(message)?;
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
}

/// The bytes the failed allocation in an OOM message asked for, or None.
#[pyfunction]
fn oom_requested_bytes(message: &str) -> Option<u64> {
    use oomkit_supervise::oom::{detect, parse_message, OomKind};
    let kind = detect(message).unwrap_or(OomKind::Unspecified);
    parse_message(kind, message).requested_bytes
}

/// The process's own cap ("N allowed") and what the driver had free ("of which N is free") in an OOM message, each None where absent.
#[pyfunction]
fn oom_limits(message: &str) -> (Option<u64>, Option<u64>) {
    use oomkit_supervise::oom::{detect, parse_message, OomKind};
    let kind = detect(message).unwrap_or(OomKind::Unspecified);
    let m = parse_message(kind, message);
    (m.allowed_bytes, m.free_bytes)
}

/// Why an OOM message's allocation failed, as `oomkit explain` decides it ("fragmentation", "capacity", ...), or None.
#[pyfunction]
#[pyo3(signature = (message, alloc_conf=None))]
fn oom_cause(message: &str, alloc_conf: Option<&str>) -> Option<String> {
    let e = oomkit_supervise::explain::explain(message, alloc_conf)?;
    serde_json::to_value(e.cause)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
}

/// The micro-batch and accumulation covering `effective_batch` at `micro_batch`.
#[pyfunction]
fn batch_plan(micro_batch: u64, effective_batch: u64) -> (u64, u64) {
    let p = oomkit_supervise::BatchPlan::new(micro_batch, effective_batch);
    (p.micro_batch, p.grad_accum)
}

/// The next (micro-batch, accumulation) after an OOM, or None at `min_micro_batch`, as `oomkit run`
/// steps: to the largest micro-batch that the capacity OOMs' messages (`earlier`, as (micro-batch,
/// message) pairs, then this one's) say could fit, else half.
#[pyfunction]
#[pyo3(signature = (micro_batch, effective_batch, min_micro_batch, message=None, earlier=Vec::new()))]
fn back_off(
    micro_batch: u64,
    effective_batch: u64,
    min_micro_batch: u64,
    message: Option<&str>,
    earlier: Vec<(u64, String)>,
) -> Option<(u64, u64)> {
    use oomkit_supervise::fit;
    let observe = |b: u64, m: &str| fit::observe(&oomkit_supervise::explain::explain(m, None)?, b);
    // Only a capacity OOM with figures steps by them; any other halves.
    let this = message.and_then(|m| observe(micro_batch, m));
    let observed: Vec<fit::Observation> = earlier
        .iter()
        .filter_map(|(b, m)| observe(*b, m))
        .chain(this)
        .collect();
    let target = this
        .and_then(|_| fit::predicted_fit(&observed))
        .unwrap_or(micro_batch / 2);
    oomkit_supervise::BatchPlan::new(micro_batch, effective_batch)
        .step_to(target, min_micro_batch)
        .map(|p| (p.micro_batch, p.grad_accum))
}

/// The entries of a realized trace as parallel lists: actions, addresses, sizes, streams, operations.
type EntryLists = (Vec<&'static str>, Vec<u64>, Vec<u64>, Vec<u16>, Vec<usize>);

/// A block held at the end: address, size, bytes asked for, handed out, operation.
type EndBlockTuple = (u64, u64, u64, bool, Option<usize>);

/// A segment held at the end: address, size, stream, "small" or "large", expandable, blocks.
type EndSegmentTuple = (u64, u64, u16, &'static str, bool, Vec<EndBlockTuple>);

/// Serves a program's allocations and frees (`kinds` 0 alloc, 1 free, 2
/// empty_cache; `a` the size or the freed allocation's index; `b` the
/// stream) through the model of the caching allocator, and returns the
/// trace, the end segments, the figures (peak reserved, peak allocated,
/// the operation at the reserved peak, free at the peak, the OOMs) and the
/// bytes allocated and reserved, and the retries after releasing the
/// cache counted, after each operation.
#[pyfunction]
#[pyo3(signature = (kinds, a, b, alloc_conf=None, capacity=None))]
#[allow(clippy::type_complexity)]
fn realize_ops(
    kinds: Vec<u8>,
    a: Vec<u64>,
    b: Vec<u64>,
    alloc_conf: Option<&str>,
    capacity: Option<u64>,
) -> PyResult<(
    EntryLists,
    Vec<EndSegmentTuple>,
    (u64, u64, Option<usize>, u64, Vec<usize>),
    (Vec<u64>, Vec<u64>, Vec<u64>),
)> {
    use oomkit_allocator::{realize, PoolKind};
    if kinds.len() != a.len() || kinds.len() != b.len() {
        return Err(PreflightError::new_err(
            "realize_ops: the three lists differ in length",
        ));
    }
    let config = allocator_config(alloc_conf)?;
    let mut ops = Vec::with_capacity(kinds.len());
    for (i, ((&k, &x), &y)) in kinds.iter().zip(&a).zip(&b).enumerate() {
        ops.push(to_op("realize_ops", i, k, x, y, &kinds)?);
    }
    let r = realize(&ops, config, capacity);
    let mut lists: EntryLists = Default::default();
    for e in &r.entries {
        lists.0.push(e.action.name());
        lists.1.push(e.addr);
        lists.2.push(e.size);
        lists.3.push(e.stream);
        lists.4.push(e.op);
    }
    let segments = r
        .segments
        .iter()
        .map(|s| {
            let kind = if s.kind == PoolKind::Small {
                "small"
            } else {
                "large"
            };
            let blocks = s
                .blocks
                .iter()
                .map(|b| (b.addr, b.size, b.requested, b.allocated, b.op))
                .collect();
            (s.addr, s.size, s.stream, kind, s.expandable, blocks)
        })
        .collect();
    Ok((
        lists,
        segments,
        (
            r.peak_reserved,
            r.peak_allocated,
            r.peak_op,
            r.free_at_peak,
            r.ooms,
        ),
        (r.allocated_after, r.reserved_after, r.retries_after),
    ))
}

/// The allocator's settings as `PYTORCH_CUDA_ALLOC_CONF` writes them (the defaults for None).
fn allocator_config(alloc_conf: Option<&str>) -> PyResult<oomkit_allocator::AllocatorConfig> {
    let mut config = oomkit_allocator::AllocatorConfig::default();
    if let Some(conf) = alloc_conf {
        config
            .apply(conf)
            .map_err(|e| PreflightError::new_err(e.to_string()))?;
    }
    Ok(config)
}

/// Operation `i` of a recorded run, `(k, x, y)` as preflight's trace keeps
/// it: 0 an allocation of `x` bytes on stream `y`, 1 the free of operation
/// `x` (an earlier allocation: `kinds` holds the kinds before it), 2
/// `empty_cache`, 3 an allocation of `x` bytes on stream `y` refused.
fn to_op(
    caller: &str,
    i: usize,
    k: u8,
    x: u64,
    y: u64,
    kinds: &[u8],
) -> PyResult<oomkit_allocator::Op> {
    use oomkit_allocator::Op;
    let stream = u16::try_from(y).unwrap_or(u16::MAX);
    Ok(match k {
        0 => Op::Alloc { size: x, stream },
        1 if (x as usize) < i && kinds.get(x as usize) == Some(&0) => Op::Free { alloc: x as usize },
        2 => Op::EmptyCache,
        3 => Op::Refused { size: x, stream },
        _ => {
            return Err(PreflightError::new_err(format!(
                "{caller}: operation {i} ({k}, {x}) is neither an allocation, the free of an earlier one, empty_cache nor a refused allocation"
            )))
        }
    })
}

/// A run's allocations served as they are made, against what the GPU
/// may hold: preflight asks after each allocation whether the GPU had
/// room, so that the script sees CUDA's out-of-memory error where a GPU
/// of that capacity would raise it.
#[pyclass(module = "oomkit._native", unsendable)]
struct AllocatorRun {
    server: oomkit_allocator::Server,
    /// Each operation's kind as served (a refused allocation's is 3), for the frees that follow.
    kinds: Vec<u8>,
}

#[pymethods]
impl AllocatorRun {
    /// Starts serving with the allocator's settings and the bytes it may hold.
    #[new]
    #[pyo3(signature = (alloc_conf, capacity))]
    fn new(alloc_conf: Option<&str>, capacity: u64) -> PyResult<Self> {
        Ok(AllocatorRun {
            server: oomkit_allocator::Server::lean(allocator_config(alloc_conf)?, Some(capacity)),
            kinds: Vec::new(),
        })
    }

    /// Serves the next operations (kinds, sizes or the allocation freed, streams); returns
    /// each allocation refused as (its index, the segment it needed, reserved, allocated).
    fn feed(
        &mut self,
        kinds: Vec<u8>,
        a: Vec<u64>,
        b: Vec<u64>,
    ) -> PyResult<Vec<(usize, u64, u64, u64)>> {
        if kinds.len() != a.len() || kinds.len() != b.len() {
            return Err(PreflightError::new_err(
                "AllocatorRun.feed: the three lists differ in length",
            ));
        }
        let mut refused = Vec::new();
        for ((&k, &x), &y) in kinds.iter().zip(&a).zip(&b) {
            let i = self.kinds.len();
            let op = to_op("AllocatorRun.feed", i, k, x, y, &self.kinds)?;
            let said = self.server.push(op);
            self.kinds.push(if said.is_some() { 3 } else { k });
            if let Some(r) = said {
                refused.push((i, r.alloc_size, r.reserved, r.allocated));
            }
        }
        Ok(refused)
    }

    /// Operations served so far.
    fn __len__(&self) -> usize {
        self.server.len()
    }

    /// Limits what the allocator may hold from the next operation on.
    fn set_capacity(&mut self, capacity: u64) {
        self.server.set_capacity(Some(capacity));
    }
}

/// Reads a capacity, a size (`80GiB`) or a GPU's name (`H100`, its total
/// less the CUDA context), as `oomkit whatif --capacity` does: the bytes
/// the allocator may hold and a label.
#[pyfunction]
fn parse_capacity(text: &str) -> PyResult<(u64, String)> {
    oomkit_allocator::parse_capacity(text).map_err(|e| PreflightError::new_err(e.to_string()))
}

/// The CUDA compute capability (major, minor) of the GPU a capacity names
/// (`H100`: (9, 0)), or None for a size: which cuBLAS workspace and
/// attention kernels preflight gives the step.
#[pyfunction]
fn gpu_capability(text: &str) -> Option<(u8, u8)> {
    oomkit_allocator::gpu_named(text).map(|g| g.capability)
}

/// The largest micro-batch from `start` up to `max` that fits `capacity`:
/// the project's one search (`oomkit_supervise::search::largest_that_fits`),
/// calling `measure(b)` for each micro-batch tried, which returns whether it
/// fits and the most it reserved. An exception `measure` raises ends the
/// search and is raised here. Returns the largest that fits (or None) and
/// every micro-batch tried with whether it fitted, by size.
#[pyfunction]
fn largest_that_fits(
    start: u64,
    max: u64,
    capacity: u64,
    measure: &Bound<'_, PyAny>,
) -> PyResult<oomkit_supervise::search::Largest> {
    use oomkit_supervise::search::Measured;
    oomkit_supervise::search::largest_that_fits(start, max, capacity, &mut |b| {
        let (fits, peak_bytes): (bool, u64) = measure.call1((b,))?.extract()?;
        Ok::<_, PyErr>(Measured { fits, peak_bytes })
    })
}

/// A preflight's answer (`Preflight.as_dict()` as JSON) for the terminal,
/// as `oomkit preflight` prints it: one renderer for both.
#[pyfunction]
fn preflight_text(doc: &str) -> PyResult<String> {
    let bad = |e: serde_json::Error| PreflightError::new_err(format!("preflight_text: {e}"));
    let v: Value = serde_json::from_str(doc).map_err(bad)?;
    let run: oomkit_report::PreflightRun = serde_json::from_value(v.clone()).map_err(bad)?;
    let tried = v["tried"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|p| Some((p.get(0)?.as_u64()?, p.get(1)?.as_bool()?)))
                .collect()
        })
        .unwrap_or_default();
    let report = oomkit_report::PreflightReport {
        command: Vec::new(),
        run,
        tried,
        largest_micro_batch: v["largest_micro_batch"].as_u64(),
        largest_grad_accum: v["largest_grad_accum"].as_u64(),
        ..Default::default()
    };
    Ok(oomkit_report::text::preflight(&report))
}

/// The native half of the oomkit package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("OomkitError", m.py().get_type::<OomkitError>())?;
    m.add("RunLogError", m.py().get_type::<RunLogError>())?;
    m.add("PreflightError", m.py().get_type::<PreflightError>())?;
    m.add_class::<RunLog>()?;
    m.add_class::<AllocatorRun>()?;
    m.add_function(wrap_pyfunction!(analyze_run_json, m)?)?;
    m.add_function(wrap_pyfunction!(analyze_run_text, m)?)?;
    m.add_function(wrap_pyfunction!(process_rss, m)?)?;
    m.add_function(wrap_pyfunction!(process_peak_rss, m)?)?;
    m.add_function(wrap_pyfunction!(reset_process_peak_rss, m)?)?;
    m.add_function(wrap_pyfunction!(process_sample, m)?)?;
    m.add_function(wrap_pyfunction!(host_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(oom_kind, m)?)?;
    m.add_function(wrap_pyfunction!(oom_requested_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(oom_limits, m)?)?;
    m.add_function(wrap_pyfunction!(oom_cause, m)?)?;
    m.add_function(wrap_pyfunction!(batch_plan, m)?)?;
    m.add_function(wrap_pyfunction!(back_off, m)?)?;
    m.add_function(wrap_pyfunction!(realize_ops, m)?)?;
    m.add_function(wrap_pyfunction!(parse_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_capability, m)?)?;
    m.add_function(wrap_pyfunction!(preflight_text, m)?)?;
    m.add_function(wrap_pyfunction!(largest_that_fits, m)?)?;
    Ok(())
}
