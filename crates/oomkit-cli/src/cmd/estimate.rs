//! `oomkit estimate`: the memory budget of a training run before it runs, calibrated from measured runs.

use crate::args::FormatArgs;
use crate::args::{count, positive, size};
use crate::exit::{EXIT_INPUT, EXIT_OK};
use crate::load::{load, Keep};
use crate::output::{print, say};
use oomkit_compare::Report;
use oomkit_estimate::calibrate::{calibrate, Measured};
use oomkit_estimate::{Architecture, Dtype, Inputs, Optimizer, Sharding};
use oomkit_snapshot::Options;
use std::path::{Path, PathBuf};

/// Flags of `oomkit estimate`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("model").required(true).multiple(true).args(["params", "config"])))]
pub(crate) struct Args {
    /// Parameter count (7B, 350M, 1.3B); or give --config.
    #[arg(long, value_parser = count, value_name = "N")]
    params: Option<u64>,
    /// A Hugging Face config.json for the model's shape (and its parameter count): the file, a
    /// model folder holding it, or a hub id (its config alone is read from the hub's cache, or
    /// fetched); or give --params.
    #[arg(long, value_name = "FILE|FOLDER|HUB_ID")]
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
    /// Data-parallel GPUs that --zero shards the model states across (all nodes together).
    #[arg(long, value_parser = positive, default_value_t = 1, value_name = "N")]
    gpus: u64,
    /// Shard across --gpus as ZeRO stage 1 (optimizer state), 2 (and
    /// gradients: FSDP's SHARD_GRAD_OP) or 3 (and weights: FSDP's
    /// FULL_SHARD); 0 shards nothing (DDP). Figures are per GPU.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3), default_value_t = 0, value_name = "STAGE")]
    zero: u8,
    /// GPU memory to fit in (80GiB); default: the largest GPU here, if any.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    gpu: Option<u64>,
    /// The CUDA context and kernels outside the tensors (1.25 GiB, as measured on a V100).
    #[arg(long, value_parser = size, default_value = "1.25GiB", value_name = "SIZE")]
    overhead: u64,
    /// Also run the training step on tensors without memory (oomkit preflight,
    /// needs PyTorch and transformers) and show its measured peak beside the formula's.
    #[arg(long, requires = "config")]
    trace: bool,
    /// Calibrate from measured runs: run logs (FILE, or FILE=MICRO_BATCH when
    /// the log has no plan record), `find-batch --json` output, or snapshots
    /// (FILE=MICRO_BATCH), which are also compared with the estimate role by role.
    #[arg(long, num_args = 1.., value_name = "FILE[=B]")]
    calibrate: Vec<String>,
    #[command(flatten)]
    format: FormatArgs,
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
    // A snapshot: its peak, and that peak by role, for the estimate's terms
    // one by one; read and analyzed as `analyze` reads it.
    if crate::load::is_snapshot(Path::new(file)) {
        let micro_batch = batch.ok_or_else(|| {
            format!("{file}: a snapshot does not record its micro-batch; give it as {file}=B")
        })?;
        let Report::Snapshot(fa) = load(Path::new(file), &Options::default(), Keep::Analysis)?
        else {
            return Err(format!("{file}: not a snapshot"));
        };
        let top = fa
            .analysis
            .devices
            .iter()
            .max_by_key(|d| d.peak_active_bytes)
            .ok_or_else(|| format!("{file}: the snapshot holds no device's memory"))?;
        return Ok((
            vec![Measured {
                micro_batch,
                peak_bytes: top.peak_active_bytes,
                source: format!("{file} (snapshot, cuda:{})", top.device),
                roles: Some(top.roles.peak),
            }],
            None,
        ));
    }
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
                        roles: None,
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
            roles: None,
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

/// `oomkit estimate`.
pub(crate) fn run(a: Args) -> u8 {
    let config = match a
        .config
        .as_deref()
        .map(|c| crate::hub::config_file(c, &super::preflight::python()))
    {
        Some(Err(msg)) => {
            say(&msg);
            return EXIT_INPUT;
        }
        Some(Ok(file)) => Some(file),
        None => None,
    };
    let arch = match &config {
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
        gpus: a.gpus,
        sharding: Sharding::from_stage(a.zero).unwrap_or(Sharding::None),
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
            let traced = a.trace.then(|| traced(&a, config.as_deref(), capacity));
            print(
                a.format.output(),
                &oomkit_report::Budget {
                    estimate: &e,
                    calibration: calibration.as_ref(),
                    traced: traced.as_ref(),
                },
            );
            EXIT_OK
        }
        Err(e) => {
            say(&e.to_string());
            EXIT_INPUT
        }
    }
}

/// The step traced with preflight, with the settings the formula used, or why not.
fn traced(
    a: &Args,
    config: Option<&Path>,
    capacity: Option<u64>,
) -> Result<oomkit_report::PreflightRun, String> {
    let config = config.map(|p| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()));
    let settings = serde_json::json!({
        "config": config,
        "dtype": value_name(a.dtype),
        "mixed_precision": a.mixed_precision,
        "optimizer": value_name(a.optimizer),
        "batch": a.batch,
        "seq": a.seq,
        "grad_checkpointing": a.grad_checkpointing,
        "flash_attention": a.flash_attention,
        "ema": a.ema,
        "lora_rank": a.lora_rank,
        "load_in_4bit": a.load_in_4bit,
        "gpus": a.gpus,
        "zero": a.zero,
        // What the allocator may hold: the GPU less the context, as the formula's verdict counts it.
        "capacity": capacity.map_or("80GiB".to_string(), |c| format!("{}B", c.saturating_sub(a.overhead))),
    });
    super::preflight::trace_config(settings)
}

/// A flag's value as it is typed (`bf16`, `adamw8bit`).
fn value_name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .map_or(String::new(), |p| p.get_name().to_string())
}
