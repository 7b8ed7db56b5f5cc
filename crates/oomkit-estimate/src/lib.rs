//! Training memory budgets from a model's shape and the training choices.
//!
//! Per parameter: the weights in their storage dtype, gradients in the same
//! dtype, and optimizer state (AdamW keeps two moments in the parameter's
//! dtype, as `torch.optim.AdamW` does; mixed precision keeps fp32 weights,
//! gradients and moments). Activations per transformer layer follow
//! Korthikanti et al. 2022, generalised to any attention width and MLP width:
//! `s*b*(10h + 8*d_attn + 4*f) + 5*a*s^2*b` bytes at 16 bits, which is their
//! `s*b*h*(34 + 5*a*s/h)` when `d_attn = h` and `f = 4h`. Flash attention drops
//! the `s^2` term; full recomputation keeps `2*s*b*h` per layer plus one
//! layer's activations while it is recomputed.

pub mod calibrate;

use serde::Serialize;

/// Why an estimate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    /// The model config lacks a field the estimate needs.
    #[error("the config has no {0} (looked for {1})")]
    MissingField(&'static str, &'static str),
    /// The config is not a JSON object.
    #[error("not a Hugging Face model config: {0}")]
    NotAConfig(String),
    /// A value is out of range.
    #[error("{0}")]
    Invalid(String),
}

/// The shape of a transformer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Architecture {
    /// Hidden size (d_model).
    pub hidden: u64,
    /// Encoder layers, or all layers of a decoder-only model.
    pub layers: u64,
    /// Decoder layers of an encoder-decoder model, 0 otherwise.
    pub decoder_layers: u64,
    /// Attention heads.
    pub heads: u64,
    /// Heads x head size, which is the hidden size in most models.
    pub attention_width: u64,
    /// Key/value heads x head size: smaller than `attention_width` with
    /// grouped-query attention (`num_key_value_heads`: Llama 3, Mistral, TinyLlama).
    pub kv_width: u64,
    /// MLP inner size (of each expert, in a mixture of experts).
    pub ffn: u64,
    /// Experts per MLP layer: 1 for a dense model, 8 for Mixtral-8x7B.
    pub experts: u64,
    /// Experts each token runs through (1 for a dense model).
    pub experts_per_token: u64,
    /// Inner size of the shared experts every token also runs through
    /// (Qwen-MoE's, DeepSeek's), 0 without any.
    pub shared_ffn: u64,
    /// Leading layers of a mixture of experts whose MLP is dense instead
    /// (DeepSeek's `first_k_dense_replace`), 0 otherwise.
    pub dense_layers: u64,
    /// Inner size of those dense layers' MLP.
    pub dense_ffn: u64,
    /// Whether the MLP is gated (SwiGLU and the like), with three matrices instead of two.
    pub gated_mlp: bool,
    /// Llama-style layers: RMSNorm, rotary embeddings and no dropout, which
    /// keep more per token than the GPT-style layer the Korthikanti formula counts.
    pub llama_style: bool,
    /// Whether the model ends in a vocabulary head (a language model), not a small classifier.
    pub lm_head: bool,
    /// Whether its linear layers carry biases (GPT-2, BERT, OPT), which Llama-style layers drop.
    pub biases: bool,
    /// Whether the layers apply dropout, whose one-byte masks are kept for
    /// backward: false when every dropout probability in the config is 0.
    pub dropout: bool,
    /// Vocabulary size.
    pub vocab: u64,
    /// Rows of learned absolute position embeddings (GPT-2's `wpe`, BERT's
    /// position and token-type tables, OPT's and BART's offset tables), over
    /// all such tables; 0 for rotary, ALiBi or relative positions, which have
    /// no such weights.
    pub positions: u64,
    /// Whether the output projection shares the embedding's weights.
    pub tied_embeddings: bool,
    /// Where the shape came from: "config" or "guessed from the parameter count".
    pub source: String,
}

impl Architecture {
    /// Parameters implied by the shape (`u64::MAX` for a shape beyond it).
    pub fn params(&self) -> u64 {
        // In floating point, so that a config's absurd sizes cannot wrap
        // around to a plausible count; exact below 2^53 (9 quadrillion).
        let n = |x: u64| x as f64;
        let (hidden, layers) = (n(self.hidden), n(self.layers));
        // Q and O are attention_width wide; K and V only kv_width under grouped-query attention.
        let attn = 2.0 * hidden * n(self.attention_width) + 2.0 * hidden * n(self.kv_width);
        let matrices = if self.gated_mlp { 3.0 } else { 2.0 };
        // Every expert's weights, the shared experts' and the router's.
        let router = if self.experts > 1 {
            n(self.experts) * hidden
        } else {
            0.0
        };
        let mlp = matrices * hidden * (n(self.experts) * n(self.ffn) + n(self.shared_ffn)) + router;
        let norms = 4.0 * hidden;
        // Biases of Q, K, V and O, and of each expert's two MLP matrices.
        let (attn_bias, mlp_bias, dense_bias) = if self.biases {
            (
                n(self.attention_width) + 2.0 * n(self.kv_width) + hidden,
                n(self.experts) * (n(self.ffn) + hidden),
                n(self.dense_ffn) + hidden,
            )
        } else {
            (0.0, 0.0, 0.0)
        };
        let (attn, mlp) = (attn + attn_bias, mlp + mlp_bias);
        // Dense layers before the experts start trade the experts for one MLP.
        let dense = n(self.dense_layers.min(self.layers));
        let dense_mlp = matrices * hidden * n(self.dense_ffn) + dense_bias;
        let enc = (layers - dense) * (attn + mlp + norms) + dense * (attn + dense_mlp + norms);
        let dec = n(self.decoder_layers) * (2.0 * attn + mlp + norms);
        let emb = n(self.embedding_params());
        let positions = n(self.positions) * hidden;
        // The norm after the last layer: LayerNorm's weight and bias, RMSNorm's weight.
        let final_norm = if self.llama_style {
            hidden
        } else {
            2.0 * hidden
        };
        // A float past u64's range converts to u64::MAX.
        (enc + dec + emb + positions + final_norm) as u64
    }

    /// Parameters of the token embedding and, when untied, the vocabulary
    /// head (a classifier has none): `u64::MAX` for a shape beyond it.
    pub fn embedding_params(&self) -> u64 {
        let matrices = if self.tied_embeddings || !self.lm_head {
            1
        } else {
            2
        };
        self.vocab
            .saturating_mul(self.hidden)
            .saturating_mul(matrices)
    }

    /// A GPT-style shape for a parameter count, from the GPT-3 paper's table of model sizes.
    pub fn guess(params: u64) -> Architecture {
        // (parameters, hidden, layers, heads)
        const TABLE: [(f64, u64, u64, u64); 10] = [
            (125e6, 768, 12, 12),
            (350e6, 1024, 24, 16),
            (760e6, 1536, 24, 16),
            (1.3e9, 2048, 24, 32),
            (2.7e9, 2560, 32, 32),
            (6.7e9, 4096, 32, 32),
            (13e9, 5120, 40, 40),
            (30e9, 6656, 60, 52),
            (70e9, 8192, 80, 64),
            (175e9, 12288, 96, 96),
        ];
        let p = (params.max(1) as f64).ln();
        let &(_, hidden, layers, heads) = TABLE
            .iter()
            .min_by(|a, b| {
                (a.0.ln() - p)
                    .abs()
                    .partial_cmp(&(b.0.ln() - p).abs())
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
            .unwrap_or(&TABLE[0]);
        Architecture {
            hidden,
            layers,
            decoder_layers: 0,
            heads,
            attention_width: hidden,
            kv_width: hidden,
            ffn: 4 * hidden,
            experts: 1,
            experts_per_token: 1,
            shared_ffn: 0,
            dense_layers: 0,
            dense_ffn: 0,
            gated_mlp: false,
            llama_style: false,
            lm_head: true,
            biases: false,
            dropout: true,
            vocab: 50257,
            // The shape stands for a count the user gave: no table is added to it.
            positions: 0,
            tied_embeddings: true,
            source: "guessed from the parameter count".into(),
        }
    }

    /// Reads the shape from a Hugging Face `config.json` (GPT-2, Llama, Mistral, T5, BART and most others).
    pub fn from_hf_config(text: &str) -> Result<Architecture, EstimateError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| EstimateError::NotAConfig(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| EstimateError::NotAConfig("not a JSON object".into()))?;
        // Multimodal configs keep the language model under text_config.
        let cfg = obj
            .get("text_config")
            .and_then(|t| t.as_object())
            .unwrap_or(obj);
        // A size past 2^31 is no model's (the widest have 2^17 hidden units
        // and 2^18 vocabulary entries): say so, before products of two wrap.
        if let Some((k, n)) = cfg
            .iter()
            .filter(|(k, _)| SIZE_FIELDS.contains(&k.as_str()))
            .filter_map(|(k, x)| Some((k, x.as_u64()?)))
            .find(|&(_, n)| n > MAX_CONFIG_SIZE)
        {
            return Err(EstimateError::Invalid(format!(
                "the config's {k} is {n}, beyond any model's (at most {MAX_CONFIG_SIZE})"
            )));
        }
        let get = |keys: &[&str]| {
            keys.iter()
                .find_map(|k| cfg.get(*k).and_then(|x| x.as_u64()))
        };
        let need = |name: &'static str, keys: &'static str| {
            let list: Vec<&str> = keys.split(", ").collect();
            match get(&list) {
                Some(0) => Err(EstimateError::Invalid(format!(
                    "the config's {name} is 0 (read from {keys})"
                ))),
                Some(n) => Ok(n),
                None => Err(EstimateError::MissingField(name, keys)),
            }
        };
        let hidden = need("hidden size", "hidden_size, d_model, n_embd, dim")?;
        let heads = need(
            "attention head count",
            "num_attention_heads, num_heads, n_head, encoder_attention_heads",
        )?;
        let layers = need(
            "layer count",
            "num_hidden_layers, num_layers, n_layer, encoder_layers",
        )?;
        let is_enc_dec = cfg
            .get("is_encoder_decoder")
            .and_then(|x| x.as_bool())
            .unwrap_or(false);
        let decoder_layers = if is_enc_dec {
            get(&["num_decoder_layers", "decoder_layers"]).unwrap_or(layers)
        } else {
            0
        };
        let head_dim = get(&["head_dim", "d_kv"]).unwrap_or(hidden / heads.max(1));
        // A mixture of experts: how many, how many each token runs
        // through, and the width of each (Mixtral's intermediate_size is
        // its experts'; Qwen-MoE and DeepSeek name it apart).
        let experts = get(&["num_local_experts", "num_experts", "n_routed_experts"])
            .unwrap_or(1)
            .max(1);
        let experts_per_token = if experts > 1 {
            get(&["num_experts_per_tok", "moe_topk", "num_selected_experts"])
                .unwrap_or(2)
                .clamp(1, experts)
        } else {
            1
        };
        let moe_ffn = (experts > 1)
            .then(|| get(&["moe_intermediate_size", "expert_intermediate_size"]))
            .flatten();
        let shared_ffn = if experts > 1 {
            get(&["shared_expert_intermediate_size"])
                .unwrap_or_else(|| get(&["n_shared_experts"]).unwrap_or(0) * moe_ffn.unwrap_or(0))
        } else {
            0
        };
        let dense_layers = if experts > 1 && moe_ffn.is_some() {
            get(&["first_k_dense_replace"]).unwrap_or(0).min(layers)
        } else {
            0
        };
        let dense_ffn = if dense_layers > 0 {
            get(&["intermediate_size"]).unwrap_or(4 * hidden)
        } else {
            0
        };
        let ffn = moe_ffn
            .or_else(|| {
                get(&[
                    "intermediate_size",
                    "d_ff",
                    "n_inner",
                    "ffn_dim",
                    "encoder_ffn_dim",
                ])
            })
            .unwrap_or(4 * hidden);
        let act = cfg
            .get("hidden_act")
            .or_else(|| cfg.get("feed_forward_proj"))
            .and_then(|x| x.as_str())
            .unwrap_or("");
        let model_type = cfg.get("model_type").and_then(|x| x.as_str()).unwrap_or("");
        // Dropout keeps a mask for backward; a config whose every dropout
        // probability is 0 keeps none. Without any such field, assume it is on.
        let rates: Vec<f64> = DROPOUT_FIELDS
            .iter()
            .filter_map(|k| cfg.get(*k).and_then(|x| x.as_f64()))
            .collect();
        let dropout = rates.is_empty() || rates.iter().any(|&r| r > 0.0);
        let llama_style = LLAMA_STYLE.contains(&model_type);
        // Gemma's hidden_act is "gelu", but its MLP is gated like Llama's:
        // the family decides, the activation only where the family is unknown.
        let gated_mlp = llama_style
            || act.contains("gated")
            || ((act == "silu" || act == "swiglu") && !NOT_GATED.contains(&model_type));
        let kv_heads = get(&["num_key_value_heads", "num_kv_heads", "n_head_kv"]).unwrap_or(heads);
        let classifier = cfg
            .get("architectures")
            .and_then(|x| x.as_array())
            .is_some_and(|a| {
                a.iter().filter_map(|x| x.as_str()).any(|n| {
                    n.ends_with("ForSequenceClassification")
                        || n.ends_with("ForTokenClassification")
                        || n.ends_with("ForMultipleChoice")
                })
            });
        Ok(Architecture {
            hidden,
            layers,
            decoder_layers,
            heads,
            attention_width: heads * head_dim,
            kv_width: kv_heads * head_dim,
            ffn,
            experts,
            experts_per_token,
            shared_ffn,
            dense_layers,
            dense_ffn,
            gated_mlp,
            llama_style,
            lm_head: !classifier,
            // Llama-style layers drop the biases; a config can say so for any family.
            biases: !llama_style
                && !["bias", "use_bias", "add_bias_linear"]
                    .iter()
                    .any(|k| cfg.get(*k).and_then(|x| x.as_bool()) == Some(false)),
            dropout,
            vocab: get(&["vocab_size", "padded_vocab_size"]).unwrap_or(32000),
            positions: learned_positions(model_type, &get),
            tied_embeddings: cfg
                .get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                .unwrap_or(true),
            source: "config".into(),
        })
    }
}

/// Families with learned absolute position embeddings: the config field
/// that gives the table's rows, the rows every table adds to it (OPT and
/// BART offset their positions by 2), and how many tables (BART's encoder
/// and decoder each have one). Rotary, ALiBi and relative positions hold no
/// such weights. From each family's `modeling_*.py` in transformers.
const LEARNED_POSITIONS: &[(&str, &str, u64, u64)] = &[
    ("gpt2", "n_positions", 0, 1),
    ("gpt_bigcode", "n_positions", 0, 1),
    ("gpt_neo", "max_position_embeddings", 0, 1),
    ("opt", "max_position_embeddings", 2, 1),
    ("biogpt", "max_position_embeddings", 2, 1),
    ("bart", "max_position_embeddings", 2, 2),
    ("mbart", "max_position_embeddings", 2, 2),
    ("bert", "max_position_embeddings", 0, 1),
    ("roberta", "max_position_embeddings", 0, 1),
    ("xlm-roberta", "max_position_embeddings", 0, 1),
    ("electra", "max_position_embeddings", 0, 1),
    ("distilbert", "max_position_embeddings", 0, 1),
];

/// Families whose embeddings add a learned token-type table (`type_vocab_size` rows, 2 in BERT).
const TOKEN_TYPES: &[&str] = &["bert", "roberta", "xlm-roberta", "electra"];

/// Rows of learned position (and token-type) embeddings for `model_type`, from the config.
fn learned_positions(model_type: &str, get: &dyn Fn(&[&str]) -> Option<u64>) -> u64 {
    let Some(&(_, field, offset, tables)) = LEARNED_POSITIONS
        .iter()
        .find(|(family, ..)| *family == model_type)
    else {
        return 0;
    };
    let rows = get(&[field]).map_or(0, |r| (r + offset) * tables);
    let types = if TOKEN_TYPES.contains(&model_type) {
        get(&["type_vocab_size"]).unwrap_or(2)
    } else {
        0
    };
    rows + types
}

/// The largest size a config field may give (2^31).
const MAX_CONFIG_SIZE: u64 = 1 << 31;

/// The config fields read as sizes and counts, checked against
/// [`MAX_CONFIG_SIZE`]: every key `from_hf_config` reads as a size belongs
/// here too (a large value in any of them is refused, read or not).
const SIZE_FIELDS: &[&str] = &[
    "hidden_size",
    "d_model",
    "n_embd",
    "dim",
    "num_attention_heads",
    "num_heads",
    "n_head",
    "encoder_attention_heads",
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "encoder_layers",
    "num_decoder_layers",
    "decoder_layers",
    "head_dim",
    "d_kv",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_topk",
    "num_selected_experts",
    "moe_intermediate_size",
    "expert_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "intermediate_size",
    "d_ff",
    "n_inner",
    "ffn_dim",
    "encoder_ffn_dim",
    "num_key_value_heads",
    "num_kv_heads",
    "n_head_kv",
    "vocab_size",
    "padded_vocab_size",
    "n_positions",
    "max_position_embeddings",
    "type_vocab_size",
];

/// Model families whose layers are Llama's: RMSNorm, a gated (SwiGLU or
/// GeGLU) MLP, rotary embeddings and no dropout.
const LLAMA_STYLE: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo",
    "olmo2",
    "cohere",
    "internlm2",
    "stablelm",
    "granite",
];

/// The config fields that hold dropout probabilities, across families.
const DROPOUT_FIELDS: &[&str] = &[
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_dropout",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "attn_pdrop",
    "embd_pdrop",
    "dropout",
    "dropout_rate",
    "activation_dropout",
];

/// Families with SiLU activations but a plain two-matrix MLP.
const NOT_GATED: &[&str] = &["starcoder2", "phi", "gpt_neox", "falcon"];

/// The optimizer vocabulary lives with the roles it sizes; the estimate names it from here too.
pub use oomkit_advice::Optimizer;

/// The dtype the weights are kept and computed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit floats.
    Fp32,
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Fp32 => 4,
            Dtype::Fp16 | Dtype::Bf16 => 2,
        }
    }
}

/// How much of the model states data parallelism splits across the GPUs:
/// the stages of ZeRO (Rajbhandari et al. 2020), which PyTorch FSDP's
/// sharding strategies match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Every GPU keeps everything (DDP, FSDP's NO_SHARD; ZeRO stage 0).
    None,
    /// ZeRO-1: each GPU keeps 1/N of the optimizer state.
    OptimizerState,
    /// ZeRO-2, FSDP's SHARD_GRAD_OP: the optimizer state and the gradients.
    Gradients,
    /// ZeRO-3, FSDP's FULL_SHARD: the optimizer state, gradients and weights.
    Full,
}

impl Sharding {
    /// The sharding of a ZeRO stage (0 to 3).
    pub fn from_stage(stage: u8) -> Option<Sharding> {
        [
            Sharding::None,
            Sharding::OptimizerState,
            Sharding::Gradients,
            Sharding::Full,
        ]
        .get(stage as usize)
        .copied()
    }

    /// The ZeRO stage (0 to 3).
    pub fn stage(self) -> u8 {
        self as u8
    }
}

/// Full layers a fully sharded run holds gathered at once: the one it
/// computes and the next, which FSDP and ZeRO-3 prefetch while it runs.
pub const GATHERED_LAYERS: u64 = 2;

/// Everything an estimate depends on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Inputs {
    /// The model's shape.
    pub arch: Architecture,
    /// Parameters; the shape's own count unless given.
    pub params: u64,
    /// The compute dtype.
    pub dtype: Dtype,
    /// fp32 weights, gradients and optimizer state with 16-bit autocast (torch.autocast).
    pub mixed_precision: bool,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Micro-batch size.
    pub batch: u64,
    /// Sequence length in tokens.
    pub seq: u64,
    /// Full activation recomputation.
    pub grad_checkpointing: bool,
    /// Memory-efficient attention (no s^2 scores kept).
    pub flash_attention: bool,
    /// An exponential moving average of the weights on the GPU.
    pub ema: bool,
    /// LoRA rank on the attention projections; the base weights are frozen.
    pub lora_rank: Option<u64>,
    /// QLoRA: the frozen linear weights are stored in 4 bits (bitsandbytes NF4), the rest in `dtype`.
    pub load_in_4bit: bool,
    /// CUDA context, cuBLAS workspaces and allocator slack outside the tensors.
    pub overhead_bytes: u64,
    /// Device memory to fit in.
    pub capacity_bytes: Option<u64>,
    /// Data-parallel GPUs the model states are sharded across (1: one GPU).
    pub gpus: u64,
    /// What each GPU keeps only its share of.
    pub sharding: Sharding,
}

/// The budget, line by line.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// Parameters in the model.
    pub params: u64,
    /// Parameters that receive gradients.
    pub trainable_params: u64,
    /// Model weights.
    pub weights_bytes: u64,
    /// Gradients of the trainable parameters.
    pub gradients_bytes: u64,
    /// Optimizer state, including fp32 master weights where kept.
    pub optimizer_bytes: u64,
    /// The EMA copy of the weights.
    pub ema_bytes: u64,
    /// What a sharded run holds in full for a while: the weights of the
    /// layers it gathers ([`GATHERED_LAYERS`], ZeRO-3) and one layer's
    /// gradients before they are reduced and scattered (ZeRO-2 and 3).
    pub gathered_bytes: u64,
    /// Activations kept for backward, and the logits.
    pub activations_bytes: u64,
    /// CUDA context and other memory outside tensors.
    pub overhead_bytes: u64,
    /// The sum of the above.
    pub total_bytes: u64,
    /// Device memory, if known.
    pub capacity_bytes: Option<u64>,
    /// Activation bytes each additional sample adds.
    pub per_sample_bytes: u64,
    /// The high end of the range: activations [`ACTIVATION_SPREAD`] higher and
    /// the caching allocator's reserve ([`ALLOCATOR_RESERVE`]) on every tensor.
    pub high_bytes: u64,
    /// What each sample adds at the high end.
    pub high_per_sample_bytes: u64,
    /// Whether it fits the capacity: judged on the high figure, never on the expected one; null without a capacity.
    pub verdict: Option<Verdict>,
    /// The largest micro-batch whose high figure fits the capacity, if known; 0 when even the fixed part does not fit.
    pub max_batch: Option<u64>,
    /// The inputs, as used.
    pub inputs: Inputs,
}

impl Estimate {
    /// The estimate's tensors at `micro_batch` in the roles a snapshot's
    /// blocks are told by: weights as parameters, the EMA copy as other,
    /// and the activations (the CUDA context is no tensor, so it has none).
    pub fn roles(&self, micro_batch: u64) -> oomkit_advice::RoleBytes {
        oomkit_advice::RoleBytes {
            parameters: self.weights_bytes + self.gathered_bytes,
            gradients: self.gradients_bytes,
            optimizer_state: self.optimizer_bytes,
            activations: self.per_sample_bytes * micro_batch,
            other: self.ema_bytes,
            ..Default::default()
        }
    }
}

/// The CUDA context and kernels that `nvidia-smi` shows before any tensor:
/// 1343 MiB measured by Hugging Face on a V100 ("Model training anatomy":
/// `torch.ones((1, 1)).to("cuda")`), which is 1.25 GiB once rounded.
pub const DEFAULT_OVERHEAD_BYTES: u64 = 1280 << 20;

/// How an estimate compares with the capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Even the high figure fits.
    Fits,
    /// The expected figure fits and the high one does not: the run may run out of memory.
    MayNotFit,
    /// The expected figure alone exceeds the capacity.
    DoesNotFit,
}

/// The largest budget worked out: 1 EiB, a million 1 TiB devices. Past it
/// a figure means a wrong input (a sequence or a size off by powers of ten),
/// and 64-bit arithmetic would soon wrap to one that fits.
pub const MAX_BUDGET_BYTES: u64 = 1 << 60;

/// The most parameters a model may have: 10^15, a thousand times today's largest.
pub const MAX_PARAMS: u64 = 1_000_000_000_000_000;

/// How far activations can exceed the formulas: kernels, fusion and
/// attention implementations move them by about a quarter (a Llama-style
/// layer measures 45 bytes per token and hidden unit where the Korthikanti
/// formula counts 34).
pub const ACTIVATION_SPREAD: f64 = 0.25;

/// What PyTorch's caching allocator reserves above the live tensors at the
/// peak, as a fraction of them: the median of the training-step snapshots in
/// `../shared/fixtures/snapshots` and `crates/oomkit-cli/tests/real` (peak
/// reserved over peak active: 1.02, 1.03, 1.09, 1.10, 1.11, 1.15, 1.16).
/// `nvidia-smi` shows it; the tensors alone do not.
pub const ALLOCATOR_RESERVE: f64 = 0.10;

/// Bytes per parameter of a 4-bit (NF4) weight: half a byte, plus one fp32
/// absmax constant per block of 64 (bitsandbytes' default, without double
/// quantization: 0.5 bits per parameter; Dettmers et al. 2023, "QLoRA").
const NF4_BYTES_PER_PARAM: f64 = 0.5 + 4.0 / 64.0;

/// Bytes one Llama-style layer keeps for backward per token and hidden unit
/// is about 45 (measured), against the 34 of the Korthikanti formula: the
/// gated MLP keeps four wide tensors (gate, up, their activation, the
/// product), RMSNorm keeps its input and output, rotary embeddings keep the
/// rotated queries and keys, and there are no dropout masks.
fn llama_layer(s: f64, h: f64, d: f64, kv: f64, f: f64) -> f64 {
    let attention = 2.0 * s * h + 6.0 * s * d + 6.0 * s * kv;
    let mlp = 2.0 * s * h + 8.0 * s * f;
    let norms = 2.0 * (2.0 * s * h + 2.0 * s * h);
    attention + mlp + norms
}

/// Activation bytes of autocast relative to pure 16-bit training: autocast
/// keeps norms, softmax and the residual stream in fp32, so BERT-like models
/// measure nearer 0.8x of fp32 (1.6x of 16-bit) than the 0.5x a cast of
/// everything would give (Hugging Face's single-GPU training measurements).
const AUTOCAST_ACTIVATION_SCALE: f64 = 1.6;

/// Activation bytes for one sequence of the micro-batch (batch 1).
fn activations_per_sample(i: &Inputs) -> Option<u64> {
    let a = &i.arch;
    // In floating point: a long sequence squared, times heads and layers,
    // runs past 64 bits, where integers would wrap to a figure that fits.
    let n = |x: u64| x as f64;
    // A token keeps the MLP activations of each expert it runs through.
    let f = n(a.experts_per_token) * n(a.ffn) + n(a.shared_ffn);
    let (s, h, d, heads) = (n(i.seq), n(a.hidden), n(a.attention_width), n(a.heads));
    let kv = n(a.kv_width);
    let (layers, decoder_layers) = (n(a.layers), n(a.decoder_layers));
    let scores = if i.flash_attention {
        0.0
    } else if a.llama_style || !a.dropout {
        // Scores and softmax output in 16 bits; no dropout mask.
        4.0 * heads * s * s
    } else {
        5.0 * heads * s * s
    };
    let layer = if a.llama_style {
        llama_layer(s, h, d, kv, f) + scores
    } else {
        // Korthikanti et al. (2022), "Reducing Activation Recomputation in
        // Large Transformer Models": 34sh + 5as^2 bytes per layer for f = 4h.
        let mlp = 3.0 * s * h
            + if a.gated_mlp {
                6.0 * s * f
            } else {
                4.0 * s * f
            };
        let attn_linear = 3.0 * s * h + 8.0 * s * d;
        let norms = 4.0 * s * h;
        // The one-byte dropout masks after attention and after the MLP.
        let masks = if a.dropout { 0.0 } else { 2.0 * s * h };
        attn_linear + scores + mlp + norms - masks
    };
    let cross = 3.0 * s * h + 8.0 * s * d + scores;
    let full = layers * layer + decoder_layers * (layer + cross);
    let kept = if i.grad_checkpointing {
        // Layer inputs are kept; one layer at a time is rebuilt during backward.
        2.0 * s * h * (layers + decoder_layers)
            + layer
            + if a.decoder_layers > 0 { cross } else { 0.0 }
    } else {
        full
    };
    // The formulas count 16-bit activations; fp32 training doubles them.
    let scale = if i.dtype == Dtype::Fp32 {
        2.0
    } else if i.mixed_precision {
        AUTOCAST_ACTIVATION_SCALE
    } else {
        1.0
    };
    // The loss head: logits in the compute dtype, then PyTorch's cross-entropy
    // upcasts them to fp32 (16-bit training only), keeps the fp32 log-softmax
    // for backward, and backward makes an fp32 gradient of the same size: 14
    // bytes per token and vocabulary entry in bf16, 12 in fp32. A sequence
    // classifier has no vocabulary head.
    let logits = if a.lm_head {
        let upcast = if i.dtype == Dtype::Fp32 { 0 } else { 4 };
        s * n(a.vocab) * n(i.dtype.bytes() + upcast + 4 + 4)
    } else {
        0.0
    };
    let bytes = (kept * scale).trunc() + logits;
    (bytes <= MAX_BUDGET_BYTES as f64).then_some(bytes as u64)
}

/// Works out the budget for `inputs`.
pub fn estimate(inputs: Inputs) -> Result<Estimate, EstimateError> {
    if inputs.batch == 0 || inputs.seq == 0 {
        return Err(EstimateError::Invalid(
            "--batch and --seq must be at least 1".into(),
        ));
    }
    if inputs.load_in_4bit && inputs.lora_rank.is_none() {
        return Err(EstimateError::Invalid(
            "4-bit weights are frozen: give --lora-rank R to train adapters on them (QLoRA)".into(),
        ));
    }
    if inputs.load_in_4bit && inputs.mixed_precision {
        return Err(EstimateError::Invalid(
            "--load-in-4bit computes in --dtype; it does not combine with --mixed-precision".into(),
        ));
    }
    if inputs.gpus == 0 {
        return Err(EstimateError::Invalid("--gpus must be at least 1".into()));
    }
    if inputs.params == 0 || inputs.params > MAX_PARAMS {
        return Err(EstimateError::Invalid(format!(
            "the model has {} parameters by its sizes (--config or --params): expected 1 to 10^15",
            inputs.params
        )));
    }
    if inputs.overhead_bytes > MAX_BUDGET_BYTES {
        return Err(EstimateError::Invalid("--overhead is beyond 1 EiB".into()));
    }
    let too_large = || {
        EstimateError::Invalid(format!(
            "the activations alone would be beyond 1 EiB at --seq {} and --batch {}: check them and the model's sizes",
            inputs.seq, inputs.batch
        ))
    };
    if inputs.sharding != Sharding::None && inputs.gpus == 1 {
        return Err(EstimateError::Invalid(format!(
            "ZeRO stage {} shards across GPUs: give --gpus N above 1",
            inputs.sharding.stage()
        )));
    }
    let a = &inputs.arch;
    let p = inputs.params;
    let trainable = match inputs.lora_rank {
        // A and B matrices on the four attention projections of every layer.
        // A and B on Q and O (hidden -> attention_width) and on K and V (hidden -> kv_width).
        // In floating point, as a rank past the model's width must not wrap:
        // adapters never train more than the model has.
        Some(r) => ((a.layers as f64 + 2.0 * a.decoder_layers as f64)
            * 2.0
            * r as f64
            * (2.0 * a.hidden as f64 + a.attention_width as f64 + a.kv_width as f64))
            .min(p as f64) as u64,
        None => p,
    };
    // Sharded mixed precision is ZeRO's: 16-bit weights and gradients, and
    // the optimizer keeps fp32 master weights beside its fp32 state (16
    // bytes per parameter with AdamW, 12 of them the optimizer's).
    let zero_mixed = inputs.mixed_precision && inputs.sharding != Sharding::None;
    // Unsharded mixed precision is torch.autocast's.
    let autocast = inputs.mixed_precision && !zero_mixed;
    // Storage dtype: autocast keeps fp32 parameters; pure 16-bit training keeps them 16-bit.
    let store = if autocast { 4 } else { inputs.dtype.bytes() };
    // Autocast keeps a 16-bit copy of every weight it casts for the whole
    // step, so mixed-precision AdamW is 18 bytes per parameter, not 16
    // (DeepSpeed's ZeRO paper and Hugging Face's model-memory anatomy count 18).
    let cast_copy = if autocast { 2 * p } else { 0 };
    let adapters = if inputs.lora_rank.is_some() {
        trainable * store
    } else {
        0
    };
    let weights = if inputs.load_in_4bit {
        // bitsandbytes quantizes the linear layers only: the embeddings, the
        // vocabulary head and the norms stay in the compute dtype. The layer
        // being run is dequantized to the compute dtype for its matmul.
        let unquantized = a.embedding_params().min(p);
        let quantized = p - unquantized;
        let dequantized = a.hidden * a.ffn.max(a.hidden) * inputs.dtype.bytes();
        (quantized as f64 * NF4_BYTES_PER_PARAM) as u64
            + unquantized * inputs.dtype.bytes()
            + dequantized
            + adapters
    } else {
        p * store + cast_copy + adapters
    };
    let gradients = trainable * store;
    let state_store = if zero_mixed { 4 } else { store };
    let mut optimizer = trainable * inputs.optimizer.state_bytes_per_param(state_store);
    if inputs.optimizer == Optimizer::Adafactor {
        // A row and a column of fp32 statistics per h x k matrix: about 2/h of the parameters.
        optimizer = trainable * 2 * 4 / a.hidden.max(1);
    }
    if zero_mixed {
        optimizer += trainable * 4;
    }
    let ema = if inputs.ema { p * store } else { 0 };
    // Each GPU keeps 1/N of what its stage shards, and holds some of it in
    // full while it computes.
    let n = inputs.gpus;
    let share = |bytes: u64, from: Sharding| {
        if inputs.sharding >= from {
            bytes.div_ceil(n)
        } else {
            bytes
        }
    };
    let layers = (a.layers + a.decoder_layers).max(1);
    let gathered = if n > 1 {
        let embedding = a.embedding_params().min(p);
        let layer = (p - embedding) / layers;
        // FSDP wraps each block and the embeddings apart: the largest
        // unit is gathered at once, and the next one with it.
        let unit = layer.max(a.vocab * a.hidden);
        let weights_full = if inputs.sharding >= Sharding::Full {
            GATHERED_LAYERS * unit * inputs.dtype.bytes()
        } else {
            0
        };
        let grads_full = if inputs.sharding >= Sharding::Gradients {
            trainable / layers * store
        } else {
            0
        };
        weights_full + grads_full
    } else {
        0
    };
    let weights = share(weights, Sharding::Full);
    let gradients = share(gradients, Sharding::Gradients);
    let optimizer = share(optimizer, Sharding::OptimizerState);
    let per_sample = activations_per_sample(&inputs).ok_or_else(too_large)?;
    let activations = per_sample
        .checked_mul(inputs.batch)
        .filter(|&b| b <= MAX_BUDGET_BYTES)
        .ok_or_else(too_large)?;
    let fixed = weights + gradients + optimizer + ema + gathered + inputs.overhead_bytes;
    let total = fixed + activations;
    // The high end: more activations, and the allocator's reserve on every tensor.
    let reserve = 1.0 + ALLOCATOR_RESERVE;
    let high_fixed =
        ((fixed - inputs.overhead_bytes) as f64 * reserve) as u64 + inputs.overhead_bytes;
    let high_per_sample = (per_sample as f64 * (1.0 + ACTIVATION_SPREAD) * reserve).ceil() as u64;
    let high = high_fixed + high_per_sample * inputs.batch;
    let verdict = inputs.capacity_bytes.map(|c| {
        if high <= c {
            Verdict::Fits
        } else if total <= c {
            Verdict::MayNotFit
        } else {
            Verdict::DoesNotFit
        }
    });
    let max_batch = inputs
        .capacity_bytes
        .map(|c| c.saturating_sub(high_fixed) / high_per_sample.max(1));
    Ok(Estimate {
        params: p,
        trainable_params: trainable,
        weights_bytes: weights,
        gradients_bytes: gradients,
        optimizer_bytes: optimizer,
        ema_bytes: ema,
        gathered_bytes: gathered,
        activations_bytes: activations,
        overhead_bytes: inputs.overhead_bytes,
        total_bytes: total,
        capacity_bytes: inputs.capacity_bytes,
        per_sample_bytes: per_sample,
        high_bytes: high,
        high_per_sample_bytes: high_per_sample,
        verdict,
        max_batch,
        inputs,
    })
}

/// Formats bytes in GiB with two decimals, the unit people plan GPU memory in.
fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(params: u64) -> Inputs {
        Inputs {
            arch: Architecture::guess(params),
            params,
            dtype: Dtype::Bf16,
            mixed_precision: false,
            optimizer: Optimizer::AdamW,
            batch: 8,
            seq: 128,
            grad_checkpointing: false,
            flash_attention: false,
            ema: false,
            lora_rank: None,
            load_in_4bit: false,
            overhead_bytes: 512 << 20,
            capacity_bytes: Some(80 << 30),
            gpus: 1,
            sharding: Sharding::None,
        }
    }

    #[test]
    fn korthikanti_formula_for_standard_shapes() {
        let mut i = inputs(1_300_000_000);
        i.batch = 1;
        let a = i.arch.clone();
        let (s, h, heads) = (i.seq, a.hidden, a.heads);
        let layer = s * h * 34 + 5 * heads * s * s;
        // bf16 logits, their fp32 upcast, the fp32 log-softmax and its gradient.
        let logits = s * a.vocab * 14;
        assert_eq!(activations_per_sample(&i), Some(a.layers * layer + logits));
        i.flash_attention = true;
        assert_eq!(
            activations_per_sample(&i),
            Some(a.layers * s * h * 34 + logits)
        );
    }

    #[test]
    fn per_parameter_bytes() {
        let p = 1_000_000_000;
        let e = estimate(inputs(p)).expect("estimate");
        // Pure bf16 AdamW: 2 + 2 + 4 bytes per parameter.
        assert_eq!(
            e.weights_bytes + e.gradients_bytes + e.optimizer_bytes,
            8 * p
        );
        let mut i = inputs(p);
        i.mixed_precision = true;
        let e = estimate(i).expect("estimate");
        // fp32 weights, their 16-bit autocast copy, fp32 gradients, two fp32 moments.
        assert_eq!(
            e.weights_bytes + e.gradients_bytes + e.optimizer_bytes,
            18 * p
        );
        let mut i = inputs(p);
        i.optimizer = Optimizer::AdamW8bit;
        i.ema = true;
        let e = estimate(i).expect("estimate");
        assert_eq!(e.optimizer_bytes, 2 * p);
        assert_eq!(e.ema_bytes, 2 * p);
    }

    #[test]
    fn max_batch_fits_and_the_next_does_not() {
        let e = estimate(inputs(6_700_000_000)).expect("estimate");
        let m = e.max_batch.expect("capacity given");
        let mut i = inputs(6_700_000_000);
        i.batch = m;
        let at = estimate(i.clone()).expect("e");
        assert!(at.high_bytes <= 80 << 30);
        assert_eq!(at.verdict, Some(Verdict::Fits));
        i.batch = m + 1;
        let past = estimate(i).expect("e");
        assert!(past.high_bytes > 80 << 30);
        // One sample past the high figure's limit, the expected figure still fits: "may not fit".
        assert_eq!(past.verdict, Some(Verdict::MayNotFit));
    }

    #[test]
    fn the_high_figure_adds_the_spread_and_the_reserve() {
        let e = estimate(inputs(1_300_000_000)).expect("estimate");
        let tensors = (e.total_bytes - e.overhead_bytes) as f64;
        let extra = e.activations_bytes as f64 * ACTIVATION_SPREAD;
        let high = (tensors + extra) * (1.0 + ALLOCATOR_RESERVE) + e.overhead_bytes as f64;
        assert!(
            (e.high_bytes as f64 - high).abs() < 1e-6 * high,
            "{} vs {high}",
            e.high_bytes
        );
    }

    #[test]
    fn four_bit_weights_cost_about_a_quarter_of_bf16() {
        let mut i = inputs(6_700_000_000);
        i.lora_rank = Some(16);
        let bf16 = estimate(i.clone()).expect("estimate");
        i.load_in_4bit = true;
        let q = estimate(i.clone()).expect("estimate");
        // 4.5 bits for the linear layers, 16 for embeddings, one layer dequantized.
        let ratio = q.weights_bytes as f64 / bf16.weights_bytes as f64;
        assert!((0.28..0.33).contains(&ratio), "{ratio}");
        assert_eq!(q.gradients_bytes, bf16.gradients_bytes);
        i.lora_rank = None;
        assert!(estimate(i).is_err(), "4-bit weights need adapters");
    }

    #[test]
    fn lora_trains_a_sliver() {
        let mut i = inputs(6_700_000_000);
        i.lora_rank = Some(16);
        let e = estimate(i).expect("estimate");
        assert!(e.trainable_params < e.params / 100);
        assert!(e.optimizer_bytes < e.weights_bytes / 50);
    }
}
