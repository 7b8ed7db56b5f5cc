//! The commands that keep training alive and plan it: gpus, run,
//! find-batch, explain and estimate. Each parses its flags, calls its
//! library, and prints; the work is in oomkit-gpu, oomkit-supervise and
//! oomkit-estimate.

use crate::{
    EXIT_INPUT, EXIT_INTERNAL, EXIT_NOTHING_FITS, EXIT_NO_GPU, EXIT_OK, EXIT_WAIT_TIMEOUT,
};
use oomkit_estimate::calibrate::{calibrate, Measured};
use oomkit_estimate::{Architecture, Dtype, Inputs, Optimizer};
use oomkit_gpu::{ClaimDir, GpuError, Wait};
use oomkit_supervise::find_batch::FindBatchOptions;
use oomkit_supervise::{RunOptions, SuperviseError};
use std::ffi::OsString;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Duration;

/// Exit code when the command could not be started (the shell's "command not found").
const EXIT_SPAWN: u8 = 127;

fn size(s: &str) -> Result<u64, String> {
    oomkit_units::parse_bytes(s).map_err(|e| e.to_string())
}

fn duration(s: &str) -> Result<Duration, String> {
    oomkit_units::parse_duration(s).map_err(|e| e.to_string())
}

fn count(s: &str) -> Result<u64, String> {
    oomkit_units::parse_count(s).map_err(|e| e.to_string())
}

fn positive(s: &str) -> Result<u64, String> {
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
    wait: Duration,
    /// How often to look while waiting.
    #[arg(long, value_parser = duration, default_value = "30s", value_name = "DURATION")]
    poll: Duration,
}

impl WaitArgs {
    fn wait(&self) -> Wait {
        Wait {
            timeout: self.wait,
            poll: self.poll.max(Duration::from_millis(100)),
        }
    }
}

/// Flags of `oomkit run`.
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// How many GPUs to give the command; 0 leaves CUDA_VISIBLE_DEVICES alone.
    #[arg(long, default_value_t = 1, value_name = "N")]
    gpus: usize,
    /// Free memory each GPU must have (80GiB, 20GB); without it a GPU is taken whole.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    min_free: Option<u64>,
    #[command(flatten)]
    wait: WaitArgs,
    /// Fail (exit 3) instead of running without a GPU when the machine has none.
    #[arg(long)]
    require_gpu: bool,
    /// The first micro-batch; fills {batch_size} and OOMKIT_MICRO_BATCH, and enables retries.
    #[arg(long, value_parser = positive, value_name = "B")]
    batch_size: Option<u64>,
    /// The first gradient accumulation.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "N")]
    grad_accum: u64,
    /// The effective batch to keep (default: batch size x accumulation).
    #[arg(long, value_parser = positive, value_name = "N")]
    effective_batch: Option<u64>,
    /// The smallest micro-batch to retry with.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "B")]
    min_batch_size: u64,
    /// Reruns allowed after the first attempt.
    #[arg(long, default_value_t = 3, value_name = "N")]
    max_retries: u32,
    /// After the last OOM on the GPU, run once more on the CPU.
    #[arg(long)]
    cpu_fallback: bool,
    /// Do not set OOMKIT_AUTO_CALLBACK=1, which has Lightning add oomkit's callback by itself.
    #[arg(long)]
    no_auto_callback: bool,
    /// Start from --batch-size even when a smaller plan finished last time for this command.
    #[arg(long)]
    fresh: bool,
    /// Write the attempts as JSON to this new file.
    #[arg(long, value_name = "FILE")]
    summary_json: Option<PathBuf>,
    /// Print the attempts as JSON on stdout when the command has finished.
    #[arg(long)]
    json: bool,
    /// The training command, after `--`.
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// Flags of `oomkit find-batch`.
#[derive(clap::Args)]
pub(crate) struct FindBatchArgs {
    /// The first micro-batch to try.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "B")]
    start: u64,
    /// The largest micro-batch worth trying.
    #[arg(long, value_parser = positive, default_value_t = 4096, value_name = "B")]
    max: u64,
    /// Fraction of memory to leave free.
    #[arg(long, default_value_t = 0.1, value_name = "FRACTION")]
    margin: f64,
    /// Effective batch to reach with gradient accumulation.
    #[arg(long, value_parser = positive, value_name = "N")]
    effective: Option<u64>,
    /// Memory to fit in, instead of the chosen GPU's free memory.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    capacity: Option<u64>,
    #[command(flatten)]
    wait: WaitArgs,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// The command, after `--`, with {batch_size} where the micro-batch goes.
    #[arg(required = true, last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// Flags of `oomkit explain`.
#[derive(clap::Args)]
pub(crate) struct ExplainArgs {
    /// The message, a log file holding it, or `-` (the default) for stdin.
    #[arg(value_name = "MESSAGE | FILE | -")]
    input: Option<String>,
    /// The PYTORCH_CUDA_ALLOC_CONF in force when it failed (default: this shell's).
    #[arg(long, value_name = "SETTINGS")]
    alloc_conf: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Flags of `oomkit estimate`.
#[derive(clap::Args)]
pub(crate) struct EstimateArgs {
    /// Parameter count (7B, 350M, 1.3B).
    #[arg(long, value_parser = count, value_name = "N", required_unless_present = "config")]
    params: Option<u64>,
    /// A Hugging Face config.json for the model's shape.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Dtype of weights and compute.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// fp32 weights, gradients and optimizer state with 16-bit autocast.
    #[arg(long)]
    mixed_precision: bool,
    /// Optimizer.
    #[arg(long, value_enum, default_value = "adamw")]
    optimizer: OptimizerArg,
    /// Micro-batch size.
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "B")]
    batch: u64,
    /// Sequence length in tokens.
    #[arg(long, value_parser = positive, default_value_t = 1024, value_name = "TOKENS")]
    seq: u64,
    /// Full activation recomputation (gradient checkpointing).
    #[arg(long)]
    grad_checkpointing: bool,
    /// Flash or memory-efficient attention.
    #[arg(long)]
    flash_attention: bool,
    /// Keep an EMA copy of the weights on the GPU.
    #[arg(long)]
    ema: bool,
    /// Train LoRA adapters of this rank on the attention projections.
    #[arg(long, value_parser = positive, value_name = "R")]
    lora_rank: Option<u64>,
    /// QLoRA: keep the frozen linear weights in 4 bits (bitsandbytes NF4); needs --lora-rank.
    #[arg(long)]
    load_in_4bit: bool,
    /// GPU memory to fit in (80GiB); default: the largest GPU here, if any.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    gpu: Option<u64>,
    /// The CUDA context and kernels outside the tensors (1.25 GiB, as measured on a V100).
    #[arg(long, value_parser = size, default_value = "1.25GiB", value_name = "SIZE")]
    overhead: u64,
    /// Calibrate from measured runs: run logs (FILE, or FILE=MICRO_BATCH when
    /// the log has no plan record) or `find-batch --json` output.
    #[arg(long, num_args = 1.., value_name = "FILE[=B]")]
    calibrate: Vec<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// The measured peaks in one `--calibrate` argument, and the capacity it names, or one line saying what is wrong.
fn measured_in(arg: &str) -> Result<(Vec<Measured>, Option<u64>), String> {
    let (file, batch) = match arg.rsplit_once('=') {
        Some((f, b)) if !f.is_empty() => match b.parse::<u64>() {
            Ok(b) if b > 0 => (f, Some(b)),
            _ => {
                return Err(format!(
                    "{arg}: the micro-batch after '=' must be a whole number above 0"
                ))
            }
        },
        _ => (arg, None),
    };
    let bytes = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
    // `oomkit find-batch --json` output: one object with the trials.
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
        if let Some(trials) = v.get("trials").and_then(|t| t.as_array()) {
            let measured: Vec<Measured> = trials
                .iter()
                .filter(|t| t["ok"].as_bool() == Some(true))
                .filter_map(|t| {
                    Some(Measured {
                        micro_batch: t["batch"].as_u64()?,
                        peak_bytes: t["peak_bytes"].as_u64()?,
                        source: format!("{file} (find-batch trial)"),
                    })
                })
                .collect();
            if measured.is_empty() {
                return Err(format!(
                    "{file}: find-batch output with no trial that ran and measured a peak"
                ));
            }
            return Ok((measured, v["capacity_bytes"].as_u64()));
        }
    }
    let run = oomkit_runlog::Run::parse(&bytes).map_err(|e| format!("{file}: {e}"))?;
    let start = run.start.clone().unwrap_or_default();
    if !start.device.starts_with("cuda") {
        return Err(format!(
            "{file}: measured on '{}', not a GPU: a CPU run's resident set is no GPU budget",
            start.device
        ));
    }
    let micro_batch = batch
        .or_else(|| run.plans.last().and_then(|p| p.micro_batch))
        .ok_or_else(|| {
            format!("{file}: the log records no micro-batch (no plan record); give it as {file}=B")
        })?;
    let peak = run
        .steps()
        .map(|m| m.peak_bytes)
        .max()
        .ok_or_else(|| format!("{file}: the log has no finished step"))?;
    Ok((
        vec![Measured {
            micro_batch,
            peak_bytes: peak,
            source: format!("{file} (run log)"),
        }],
        start.capacity_bytes,
    ))
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DtypeArg {
    Fp32,
    Fp16,
    Bf16,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OptimizerArg {
    Adamw,
    Adamw8bit,
    Sgd,
    Adafactor,
}

fn print_json(value: &impl serde::Serialize) {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| "null".into());
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

fn say(msg: &str) {
    eprintln!("oomkit: {msg}");
}

fn gpu_exit(e: &GpuError) -> u8 {
    match e {
        GpuError::TimedOut(_) => EXIT_WAIT_TIMEOUT,
        GpuError::Fake { .. } => EXIT_INPUT,
        // Stopped by Ctrl-C while waiting: the shell's code for SIGINT.
        GpuError::Stopped => 130,
        _ => EXIT_NO_GPU,
    }
}

fn supervise_exit(e: &SuperviseError) -> u8 {
    match e {
        SuperviseError::Usage(_) => EXIT_INPUT,
        SuperviseError::Spawn { .. } => EXIT_SPAWN,
        SuperviseError::Wait(_) => EXIT_INTERNAL,
        SuperviseError::Gpu(g) => gpu_exit(g),
        SuperviseError::Interrupted(sig) => 128u8.saturating_add(*sig as u8),
    }
}

/// `oomkit gpus`.
pub(crate) fn gpus(json: bool) -> u8 {
    match oomkit_gpu::probe() {
        Ok(gpus) => {
            if json {
                print_json(&gpus);
            } else {
                let _ = write!(std::io::stdout().lock(), "{}", oomkit_gpu::table(&gpus));
            }
            EXIT_OK
        }
        Err(e) => {
            say(&e.to_string());
            gpu_exit(&e)
        }
    }
}

/// Refuses to start when a file oomkit must create already exists, so nothing is overwritten.
fn must_be_new(path: &Option<PathBuf>) -> Result<(), String> {
    match path {
        Some(p) if p.exists() => Err(format!(
            "{}: already exists (oomkit never overwrites a file)",
            p.display()
        )),
        _ => Ok(()),
    }
}

/// `oomkit run`.
pub(crate) fn run(a: RunArgs) -> u8 {
    if let Err(msg) = must_be_new(&a.summary_json) {
        say(&msg);
        return EXIT_INPUT;
    }
    let opts = RunOptions {
        command: a.command,
        gpus: a.gpus,
        min_free: a.min_free,
        wait: a.wait.wait(),
        require_gpu: a.require_gpu,
        batch_size: a.batch_size,
        grad_accum: a.grad_accum,
        effective_batch: a.effective_batch,
        min_batch_size: a.min_batch_size,
        max_retries: a.max_retries,
        cpu_fallback: a.cpu_fallback,
        auto_callback: !a.no_auto_callback,
        memory: oomkit_supervise::remember::PlanMemory::default_location(),
        fresh: a.fresh,
        claims: ClaimDir::default_location(),
        child_stdout_to_stderr: a.json,
    };
    let summary = match oomkit_supervise::supervise(&opts, &mut |m| say(m)) {
        Ok(s) => s,
        Err(e) => {
            say(&e.to_string());
            return supervise_exit(&e);
        }
    };
    eprint!("{}", summary.text());
    if let Some(path) = &a.summary_json {
        let body = serde_json::to_string_pretty(&summary).unwrap_or_default();
        if let Err(msg) = crate::save_new(path, format!("{body}\n").as_bytes()) {
            say(&msg);
        }
    }
    if a.json {
        print_json(&summary);
    }
    (summary.exit_code & 0xff) as u8
}

/// `oomkit find-batch`.
pub(crate) fn find_batch(a: FindBatchArgs) -> u8 {
    let opts = FindBatchOptions {
        command: a.command,
        start: a.start,
        max: a.max,
        margin: a.margin,
        effective: a.effective,
        capacity: a.capacity,
        wait: a.wait.wait(),
        claims: ClaimDir::default_location(),
        child_stdout_to_stderr: a.json,
    };
    match oomkit_supervise::find_batch::find_batch(&opts, &mut |m| say(m)) {
        Ok(report) => {
            if a.json {
                print_json(&report);
            } else {
                let _ = write!(std::io::stdout().lock(), "{}", report.text());
            }
            if report.recommended_batch.is_some() {
                EXIT_OK
            } else {
                EXIT_NOTHING_FITS
            }
        }
        Err(e) => {
            say(&e.to_string());
            supervise_exit(&e)
        }
    }
}

/// `oomkit explain`.
pub(crate) fn explain(a: ExplainArgs) -> u8 {
    let (source, text) = match a.input.as_deref() {
        None | Some("-") => {
            if std::io::stdin().is_terminal() {
                say("paste the error and press Ctrl-D, or give it as an argument: oomkit explain \"CUDA out of memory. ...\"");
            }
            let mut buf = Vec::new();
            if let Err(e) = std::io::stdin().read_to_end(&mut buf) {
                say(&format!("stdin: {e}"));
                return EXIT_INPUT;
            }
            (
                "stdin".to_string(),
                String::from_utf8_lossy(&buf).into_owned(),
            )
        }
        Some(arg) if !arg.contains('\n') && std::path::Path::new(arg).is_file() => {
            match std::fs::read(arg) {
                Ok(b) => (arg.to_string(), String::from_utf8_lossy(&b).into_owned()),
                Err(e) => {
                    say(&format!("{arg}: {e}"));
                    return EXIT_INPUT;
                }
            }
        }
        Some(arg) => ("the argument".to_string(), arg.to_string()),
    };
    let conf = a.alloc_conf.or_else(|| {
        [
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
            "PYTORCH_HIP_ALLOC_CONF",
        ]
        .iter()
        .find_map(|k| std::env::var(k).ok())
    });
    match oomkit_supervise::oom::explain(&text, conf.as_deref()) {
        Some(ex) => {
            if a.json {
                print_json(&ex);
            } else {
                let _ = write!(std::io::stdout().lock(), "{}", ex.text());
            }
            EXIT_OK
        }
        None => {
            say(&format!("{source}: no PyTorch out-of-memory message found (looked for \"CUDA out of memory\", \"OutOfMemoryError\", CUBLAS_STATUS_ALLOC_FAILED and the other forms)"));
            EXIT_INPUT
        }
    }
}

/// `oomkit estimate`.
pub(crate) fn estimate(a: EstimateArgs) -> u8 {
    let arch = match &a.config {
        Some(path) => {
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) => {
                    say(&format!("{}: {e}", path.display()));
                    return EXIT_INPUT;
                }
            };
            match Architecture::from_hf_config(&text) {
                Ok(arch) => arch,
                Err(e) => {
                    say(&format!("{}: {e}", path.display()));
                    return EXIT_INPUT;
                }
            }
        }
        None => Architecture::guess(a.params.unwrap_or(0)),
    };
    let params = a.params.unwrap_or_else(|| arch.params());
    let mut measured = Vec::new();
    let mut measured_capacity = None;
    for arg in &a.calibrate {
        match measured_in(arg) {
            Ok((m, c)) => {
                measured.extend(m);
                measured_capacity = measured_capacity.or(c);
            }
            Err(msg) => {
                say(&msg);
                return EXIT_INPUT;
            }
        }
    }
    let capacity = a.gpu.or(measured_capacity).or_else(|| {
        oomkit_gpu::probe()
            .ok()
            .and_then(|g| g.iter().map(|g| g.total_bytes).max())
    });
    let inputs = Inputs {
        arch,
        params,
        dtype: match a.dtype {
            DtypeArg::Fp32 => Dtype::Fp32,
            DtypeArg::Fp16 => Dtype::Fp16,
            DtypeArg::Bf16 => Dtype::Bf16,
        },
        mixed_precision: a.mixed_precision,
        optimizer: match a.optimizer {
            OptimizerArg::Adamw => Optimizer::AdamW,
            OptimizerArg::Adamw8bit => Optimizer::AdamW8bit,
            OptimizerArg::Sgd => Optimizer::Sgd,
            OptimizerArg::Adafactor => Optimizer::Adafactor,
        },
        batch: a.batch,
        seq: a.seq,
        grad_checkpointing: a.grad_checkpointing,
        flash_attention: a.flash_attention,
        ema: a.ema,
        lora_rank: a.lora_rank,
        load_in_4bit: a.load_in_4bit,
        overhead_bytes: a.overhead,
        capacity_bytes: capacity,
    };
    match oomkit_estimate::estimate(inputs) {
        Ok(e) => {
            let calibration = if measured.is_empty() {
                None
            } else {
                match calibrate(measured, &e, capacity) {
                    Ok(c) => Some(c),
                    Err(err) => {
                        say(&err.to_string());
                        return EXIT_INPUT;
                    }
                }
            };
            if a.json {
                let mut v = serde_json::to_value(&e).unwrap_or_default();
                if let Some(obj) = v.as_object_mut() {
                    obj.insert(
                        "calibration".into(),
                        serde_json::to_value(&calibration).unwrap_or_default(),
                    );
                }
                print_json(&v);
            } else {
                let mut out = e.text();
                if let Some(c) = &calibration {
                    out.push('\n');
                    out.push_str(&c.text());
                }
                let _ = write!(std::io::stdout().lock(), "{out}");
            }
            EXIT_OK
        }
        Err(e) => {
            say(&e.to_string());
            EXIT_INPUT
        }
    }
}
