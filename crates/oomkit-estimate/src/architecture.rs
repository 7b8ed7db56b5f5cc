//! The shape of a transformer, and the parameters it implies.

use serde::Serialize;

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
        // Two norms a layer: LayerNorm's weight and bias each, RMSNorm's weight alone.
        let norms = if self.llama_style {
            2.0 * hidden
        } else {
            4.0 * hidden
        };
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
}
