//! Reading a model's shape from its Hugging Face `config.json`, across families.

use crate::{Architecture, EstimateError};

impl Architecture {
    /// Reads the shape from a Hugging Face `config.json` (GPT-2, Llama, Mistral, T5, BART and most others).
    ///
    /// Long on purpose: each field is read in turn under the names the
    /// families give it, with the family tables below deciding what a name
    /// cannot; the reads share the config and the sizes read before them.
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
