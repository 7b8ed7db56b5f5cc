//! The estimate against published, measured peak memory of real training
//! runs; VALIDATION.md shows the same table with its sources. Every case
//! must be within [`TOLERANCE`], and no run that is known to have run out
//! of memory may be judged "fits".

use oomkit_estimate::{estimate, Architecture, Dtype, Estimate, Inputs, Optimizer, Verdict};

/// The largest error allowed between the estimate and a measurement.
const TOLERANCE: f64 = 0.15;

const MIB: u64 = 1 << 20;

/// What a published figure counts.
#[derive(Clone, Copy, PartialEq)]
enum Counts {
    /// `nvidia-smi` (NVML's used memory): the CUDA context, the allocator's reserve and every tensor.
    NvidiaSmi,
    /// `torch.cuda.max_memory_allocated()`: the tensors only.
    PeakAllocated,
}

/// One published measurement.
struct Case {
    /// The row's name in VALIDATION.md.
    name: &'static str,
    /// Where the figure comes from (a key into VALIDATION.md's sources).
    source: &'static str,
    config: &'static str,
    dtype: Dtype,
    mixed_precision: bool,
    optimizer: Optimizer,
    batch: u64,
    seq: u64,
    grad_checkpointing: bool,
    flash_attention: bool,
    lora_rank: Option<u64>,
    load_in_4bit: bool,
    /// The device's memory.
    capacity: u64,
    /// The measured peak in bytes, or None where the run ran out of memory.
    measured: Option<u64>,
    counts: Counts,
}

// Configs as published on the Hugging Face Hub (the fields the estimate reads).
const BERT_LARGE: &str = r#"{"model_type": "bert", "architectures": ["BertForSequenceClassification"], "hidden_size": 1024,
    "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}"#;
const LLAMA2_7B: &str = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": false}"#;
const MISTRAL_7B: &str = r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": false}"#;
const LLAMA3_8B: &str = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": false}"#;
const TINYLLAMA: &str = r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
    "num_hidden_layers": 22, "num_key_value_heads": 4, "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": false}"#;
const GEMMA_2B: &str = r#"{"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000, "hidden_act": "gelu"}"#;
const GEMMA_7B: &str = r#"{"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000, "hidden_act": "gelu"}"#;
// LitGPT's GPT has no dropout, so its StableLM keeps no dropout masks.
const STABLELM_3B: &str = r#"{"model_type": "gpt_neox", "hidden_size": 4096, "intermediate_size": 16384, "num_attention_heads": 32,
    "num_hidden_layers": 16, "vocab_size": 50688, "hidden_act": "gelu", "tie_word_embeddings": false,
    "hidden_dropout": 0.0, "attention_dropout": 0.0}"#;

/// A case with the usual defaults: bf16, AdamW, no options.
const fn case(name: &'static str, source: &'static str, config: &'static str) -> Case {
    Case {
        name,
        source,
        config,
        dtype: Dtype::Bf16,
        mixed_precision: false,
        optimizer: Optimizer::AdamW,
        batch: 1,
        seq: 512,
        grad_checkpointing: false,
        flash_attention: false,
        lora_rank: None,
        load_in_4bit: false,
        capacity: 0,
        measured: None,
        counts: Counts::PeakAllocated,
    }
}

/// Hugging Face's single-GPU guide: bert-large-uncased as a sequence
/// classifier, sequences of 512, the Trainer on a 16 GB V100, `nvidia-smi`.
const fn hf(name: &'static str, batch: u64, mib: u64) -> Case {
    Case {
        dtype: Dtype::Fp32,
        batch,
        capacity: 16160 * MIB,
        measured: Some(mib * MIB),
        counts: Counts::NvidiaSmi,
        ..case(name, "hf-single-gpu", BERT_LARGE)
    }
}

/// LitGPT: bf16-true, PyTorch's SDPA (flash) attention, LoRA, AdamW, `max_memory_allocated`.
const fn litgpt(
    name: &'static str,
    source: &'static str,
    config: &'static str,
    gb: Option<f64>,
) -> Case {
    Case {
        flash_attention: true,
        measured: match gb {
            Some(g) => Some((g * 1e9) as u64),
            None => None,
        },
        ..case(name, source, config)
    }
}

/// LitGPT's resource tables: LoRA rank 8 on one A100-40GB, at the longest Alpaca example.
const fn resources(
    name: &'static str,
    config: &'static str,
    batch: u64,
    seq: u64,
    gb: Option<f64>,
) -> Case {
    Case {
        batch,
        seq,
        lora_rank: Some(8),
        capacity: A100_40GB,
        ..litgpt(name, "litgpt-resources", config, gb)
    }
}

/// LitGPT's config hub: sequences of at most 512 on one A10G (24 GB).
const fn hub(
    name: &'static str,
    config: &'static str,
    batch: u64,
    rank: u64,
    gb: Option<f64>,
) -> Case {
    Case {
        batch,
        lora_rank: Some(rank),
        capacity: A10G_24GB,
        ..litgpt(name, "litgpt-config-hub", config, gb)
    }
}

const A100_40GB: u64 = 40536 * MIB;
const A10G_24GB: u64 = 23028 * MIB;

fn cases() -> Vec<Case> {
    vec![
        hf("bert-large fp32 AdamW b4", 4, 14949),
        hf("bert-large fp32 AdamW b1", 1, 8681),
        Case {
            grad_checkpointing: true,
            ..hf("bert-large fp32 AdamW b1 checkpointing", 1, 6775)
        },
        Case {
            mixed_precision: true,
            dtype: Dtype::Fp16,
            ..hf("bert-large fp16 autocast AdamW b4", 4, 13939)
        },
        Case {
            mixed_precision: true,
            dtype: Dtype::Fp16,
            grad_checkpointing: true,
            ..hf("bert-large fp16 autocast AdamW b1 checkpointing", 1, 7275)
        },
        Case {
            optimizer: Optimizer::Adafactor,
            ..hf("bert-large fp32 Adafactor b4", 4, 12295)
        },
        Case {
            optimizer: Optimizer::AdamW8bit,
            ..hf("bert-large fp32 8-bit Adam b4", 4, 13085)
        },
        Case {
            optimizer: Optimizer::Adafactor,
            mixed_precision: true,
            dtype: Dtype::Fp16,
            grad_checkpointing: true,
            ..hf(
                "bert-large fp16 autocast Adafactor b1 checkpointing",
                1,
                4847,
            )
        },
        Case {
            optimizer: Optimizer::AdamW8bit,
            mixed_precision: true,
            dtype: Dtype::Fp16,
            grad_checkpointing: true,
            ..hf(
                "bert-large fp16 autocast 8-bit Adam b1 checkpointing",
                1,
                5363,
            )
        },
        // The resource tables: the longest Alpaca example is 1304 Llama 2 tokens, 1034 StableLM ones.
        resources("Llama-2-7B LoRA r8 b1", LLAMA2_7B, 1, 1304, Some(21.30)),
        resources("Llama-2-7B LoRA r8 b2", LLAMA2_7B, 2, 1304, Some(29.07)),
        resources(
            "Llama-2-7B LoRA r8 b4 (ran out on 40 GB)",
            LLAMA2_7B,
            4,
            1304,
            None,
        ),
        Case {
            load_in_4bit: true,
            ..resources(
                "Llama-2-7B QLoRA (NF4) r8 b1",
                LLAMA2_7B,
                1,
                1304,
                Some(14.14),
            )
        },
        resources("StableLM-3B LoRA r8 b1", STABLELM_3B, 1, 1034, Some(9.69)),
        resources("StableLM-3B LoRA r8 b2", STABLELM_3B, 2, 1034, Some(12.10)),
        resources("StableLM-3B LoRA r8 b4", STABLELM_3B, 4, 1034, Some(16.92)),
        Case {
            load_in_4bit: true,
            ..resources(
                "StableLM-3B QLoRA (NF4) r8 b1",
                STABLELM_3B,
                1,
                1034,
                Some(6.35),
            )
        },
        // The config hub: max_seq_length 512 on a 24 GB A10G.
        hub("Llama-2-7B LoRA r32 b2", LLAMA2_7B, 2, 32, Some(19.77)),
        hub("Mistral-7B LoRA r32 b2", MISTRAL_7B, 2, 32, Some(20.66)),
        hub("Llama-3-8B LoRA r32 b1", LLAMA3_8B, 1, 32, Some(19.73)),
        hub("Gemma-2B LoRA r16 b2", GEMMA_2B, 2, 16, Some(12.62)),
        hub(
            "Gemma-7B LoRA r16 b1 (ran out on 24 GB)",
            GEMMA_7B,
            1,
            16,
            None,
        ),
        Case {
            lora_rank: None,
            ..hub("TinyLlama-1.1B full bf16 b4", TINYLLAMA, 4, 0, Some(14.10))
        },
    ]
}

fn run(c: &Case) -> Estimate {
    let arch = Architecture::from_hf_config(c.config).expect("config");
    let params = arch.params();
    estimate(Inputs {
        arch,
        params,
        dtype: c.dtype,
        mixed_precision: c.mixed_precision,
        optimizer: c.optimizer,
        batch: c.batch,
        seq: c.seq,
        grad_checkpointing: c.grad_checkpointing,
        flash_attention: c.flash_attention,
        ema: false,
        lora_rank: c.lora_rank,
        load_in_4bit: c.load_in_4bit,
        overhead_bytes: oomkit_estimate::DEFAULT_OVERHEAD_BYTES,
        capacity_bytes: Some(c.capacity),
        gpus: 1,
        sharding: oomkit_estimate::Sharding::None,
    })
    .expect("estimate")
}

/// The estimate's figure that the measurement counts.
fn comparable(c: &Case, e: &Estimate) -> u64 {
    match c.counts {
        Counts::NvidiaSmi => e.total_bytes,
        Counts::PeakAllocated => e.total_bytes - e.overhead_bytes,
    }
}

/// The row of VALIDATION.md for a case.
fn row(c: &Case, e: &Estimate) -> String {
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    let counts = match c.counts {
        Counts::NvidiaSmi => "nvidia-smi",
        Counts::PeakAllocated => "peak allocated",
    };
    let verdict = match e.verdict {
        Some(Verdict::Fits) => "fits",
        Some(Verdict::MayNotFit) => "may not fit",
        Some(Verdict::DoesNotFit) => "does not fit",
        None => "-",
    };
    match c.measured {
        Some(m) => {
            let ours = comparable(c, e);
            let err = 100.0 * (ours as f64 - m as f64) / m as f64;
            format!(
                "| {} | {} | {} | {} | {} | {err:+.1}% | {} | {verdict} |",
                c.name,
                c.source,
                counts,
                gb(m),
                gb(ours),
                gb(e.high_bytes)
            )
        }
        None => format!(
            "| {} | {} | {} | ran out | {} | - | {} | {verdict} |",
            c.name,
            c.source,
            counts,
            gb(comparable(c, e)),
            gb(e.high_bytes)
        ),
    }
}

#[test]
fn every_published_case_is_within_tolerance_and_no_known_oom_fits() {
    let mut failures = Vec::new();
    for c in cases() {
        let e = run(&c);
        match c.measured {
            Some(m) => {
                let err = (comparable(&c, &e) as f64 - m as f64) / m as f64;
                if err.abs() > TOLERANCE {
                    failures.push(format!("{}: {:+.1}% off", c.name, 100.0 * err));
                }
            }
            None => {
                if e.verdict == Some(Verdict::Fits) {
                    failures.push(format!("{}: said it fits; it ran out", c.name));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn validation_md_shows_these_figures() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../VALIDATION.md"))
        .expect("VALIDATION.md");
    let missing: Vec<String> = cases()
        .iter()
        .map(|c| row(c, &run(c)))
        .filter(|r| !doc.contains(r.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "VALIDATION.md lacks these rows (or shows old figures):\n{}",
        missing.join("\n")
    );
}
