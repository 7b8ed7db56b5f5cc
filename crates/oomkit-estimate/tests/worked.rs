//! Worked examples, computed by hand from the formulas in the crate docs.

use oomkit_estimate::{estimate, Architecture, Dtype, Inputs, Optimizer};

const GB: f64 = 1e9;

fn base(arch: Architecture, params: u64) -> Inputs {
    Inputs {
        arch,
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
        overhead_bytes: 1 << 30,
        capacity_bytes: None,
        gpus: 1,
        sharding: oomkit_estimate::Sharding::None,
    }
}

/// The issue's case: a 3B seq2seq model, bf16 AdamW, batch 8, comes out near 28 GB.
#[test]
fn three_billion_bf16_adamw_batch_8_is_near_28_gb() {
    let e = estimate(base(Architecture::guess(3_000_000_000), 3_000_000_000)).unwrap();
    // 8 bytes per parameter: bf16 weights, bf16 gradients, two bf16 AdamW moments.
    assert_eq!(
        e.weights_bytes + e.gradients_bytes + e.optimizer_bytes,
        24_000_000_000
    );
    let total = e.total_bytes as f64 / GB;
    assert!((26.5..=29.5).contains(&total), "total {total:.2} GB");
}

/// The same 3B budget from a T5-3B-shaped config (encoder-decoder, d_ff = 16 x d_model).
#[test]
fn t5_3b_config() {
    let config = r#"{
        "model_type": "t5", "is_encoder_decoder": true, "d_model": 1024, "d_ff": 16384,
        "d_kv": 128, "num_heads": 32, "num_layers": 24, "num_decoder_layers": 24,
        "vocab_size": 32128, "feed_forward_proj": "relu", "tie_word_embeddings": true
    }"#;
    let arch = Architecture::from_hf_config(config).unwrap();
    assert_eq!(arch.attention_width, 4096);
    assert_eq!(arch.decoder_layers, 24);
    let params = arch.params();
    // T5-3B has 2.85B parameters.
    assert!((2.7e9..3.0e9).contains(&(params as f64)), "{params}");
    let e = estimate(base(arch, params)).unwrap();
    // Its MLP is 16 x d_model wide, so activations outweigh the GPT-shaped
    // guess's; the total stays within 15% of 28 GB.
    let total = e.total_bytes as f64 / GB;
    assert!((23.8..=32.2).contains(&total), "total {total:.2} GB");
    assert!(
        e.activations_bytes > 6_000_000_000,
        "{}",
        e.activations_bytes
    );
}

/// Llama-2-7B from its config: the gated MLP and untied embeddings count.
#[test]
fn llama_7b_config_params() {
    let config = r#"{"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
        "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": false}"#;
    let arch = Architecture::from_hf_config(config).unwrap();
    assert!(arch.gated_mlp);
    let p = arch.params() as f64;
    assert!((6.6e9..6.9e9).contains(&p), "{p}");
}

/// Mixed-precision AdamW is 18 bytes per parameter (fp32 weights and their 16-bit autocast copy,
/// fp32 gradients, two fp32 moments); full fine-tuning of 7B needs 126 GB before activations.
#[test]
fn mixed_precision_7b_does_not_fit_80gib() {
    let mut i = base(Architecture::guess(7_000_000_000), 7_000_000_000);
    i.mixed_precision = true;
    i.capacity_bytes = Some(80 << 30);
    let e = estimate(i).unwrap();
    assert_eq!(
        e.weights_bytes + e.gradients_bytes + e.optimizer_bytes,
        126_000_000_000
    );
    assert_eq!(e.max_batch, Some(0));
}

/// Checkpointing and flash attention shrink activations in the documented proportions.
#[test]
fn activation_options() {
    let mut i = base(Architecture::guess(1_300_000_000), 1_300_000_000);
    i.seq = 2048;
    // The loss head (14 bytes per token and vocabulary entry in bf16) is the same in all three.
    let head = i.batch * i.seq * i.arch.vocab * 14;
    let layers = |i: &Inputs| estimate(i.clone()).unwrap().activations_bytes - head;
    let plain = layers(&i);
    i.flash_attention = true;
    let flash = layers(&i);
    i.grad_checkpointing = true;
    let ckpt = layers(&i);
    assert!(
        flash < plain / 2,
        "s=2048 makes the 5as/h term dominate: {flash} vs {plain}"
    );
    assert!(ckpt < flash / 4, "{ckpt} vs {flash}");
}

#[test]
fn config_errors_name_the_missing_field() {
    let err = Architecture::from_hf_config(r#"{"hidden_size": 10}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("attention head count"), "{err}");
    assert!(Architecture::from_hf_config("[1,2]").is_err());
}

/// Parameter counts from the published configs, against the published sizes:
/// grouped-query attention (num_key_value_heads) and Gemma's gated MLP
/// (hidden_act "gelu") must be counted.
#[test]
fn published_model_sizes_from_their_configs() {
    let cases = [
        // Llama-3-8B: 8.03B.
        (
            r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256, "hidden_act": "silu",
            "tie_word_embeddings": false}"#,
            8.03e9,
        ),
        // Mistral-7B-v0.1: 7.24B.
        (
            r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu",
            "tie_word_embeddings": false}"#,
            7.24e9,
        ),
        // TinyLlama-1.1B: 1.10B.
        (
            r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
            "num_key_value_heads": 4, "num_hidden_layers": 22, "vocab_size": 32000, "hidden_act": "silu",
            "tie_word_embeddings": false}"#,
            1.10e9,
        ),
        // Gemma-7B: 8.54B, with 16 heads of 256 and a gated GeGLU MLP.
        (
            r#"{"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
            "num_key_value_heads": 16, "head_dim": 256, "num_hidden_layers": 28, "vocab_size": 256000,
            "hidden_act": "gelu"}"#,
            8.54e9,
        ),
        // Llama-2-7B: 6.74B.
        (
            r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
            "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": false}"#,
            6.74e9,
        ),
        // Mixtral-8x7B: 46.7B, eight experts of Mistral's MLP width per layer.
        (
            r#"{"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu",
            "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": false}"#,
            46.7e9,
        ),
        // Qwen1.5-MoE-A2.7B: 14.3B, 60 narrow experts and a shared one.
        (
            r#"{"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
            "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24, "vocab_size": 151936,
            "hidden_act": "silu", "tie_word_embeddings": false}"#,
            14.3e9,
        ),
        // DeepSeek-V2-Lite: 15.7B, one dense layer, then 64 routed and 2 shared experts.
        (
            r#"{"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "first_k_dense_replace": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
            "num_hidden_layers": 27, "vocab_size": 102400, "hidden_act": "silu", "tie_word_embeddings": false}"#,
            15.7e9,
        ),
        // DeepSeek-V3: 671B, three dense layers, then 256 routed experts and a shared one.
        (
            r#"{"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128,
            "num_hidden_layers": 61, "vocab_size": 129280, "hidden_act": "silu", "tie_word_embeddings": false}"#,
            671e9,
        ),
        // OLMoE-1B-7B: 6.9B, 64 experts whose width is intermediate_size.
        (
            r#"{"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_experts": 64,
            "num_experts_per_tok": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 16,
            "vocab_size": 50304, "hidden_act": "silu", "tie_word_embeddings": false}"#,
            6.92e9,
        ),
    ];
    for (config, published) in cases {
        let arch = Architecture::from_hf_config(config).unwrap();
        let p = arch.params() as f64;
        assert!(
            (p / published - 1.0).abs() < 0.01,
            "{p:.3e} vs {published:.3e} for {config}"
        );
    }
}

/// Small GPT-2-style models are counted to the parameter, learned position
/// embeddings and biases included: figures from transformers' own models
/// built from these configs (`sum(p.numel() for p in model.parameters())`).
#[test]
fn gpt2_and_opt_counted_to_the_parameter() {
    let cases = [
        // A tiny GPT-2 a CPU test trains: 172,288 (162,816 without the 128 x 64 position table and the biases).
        (
            r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128, "vocab_size": 1000}"#,
            172_288.0,
        ),
        // GPT-2 small: 124,439,808.
        (
            r#"{"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}"#,
            124_439_808.0,
        ),
        // OPT-125m: 125,239,296, with OPT's two offset positions.
        (
            r#"{"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072, "num_attention_heads": 12,
            "max_position_embeddings": 2048, "vocab_size": 50272}"#,
            125_239_296.0,
        ),
    ];
    for (config, built) in cases {
        let p = Architecture::from_hf_config(config).unwrap().params() as f64;
        assert!(
            (p / built - 1.0).abs() < 1e-6,
            "{p} vs {built} for {config}"
        );
    }
}

/// A Llama layer keeps about 45 bytes per token and hidden unit (measured),
/// not the 34 of the GPT-style formula.
#[test]
fn llama_layers_keep_about_45_bytes_per_hidden_unit() {
    let config = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu",
        "tie_word_embeddings": false}"#;
    let arch = Architecture::from_hf_config(config).unwrap();
    assert!(arch.llama_style);
    let mut i = base(arch.clone(), arch.params());
    i.batch = 1;
    i.flash_attention = true;
    let head = i.seq * arch.vocab * 14;
    let per_layer = (estimate(i.clone()).unwrap().activations_bytes - head) / arch.layers;
    let bytes_per_hidden = per_layer as f64 / (i.seq * arch.hidden) as f64;
    assert!(
        (43.0..48.0).contains(&bytes_per_hidden),
        "{bytes_per_hidden}"
    );
}

/// A sequence classifier has no vocabulary head: no logits over the vocabulary, one embedding matrix.
#[test]
fn a_sequence_classifier_has_no_vocabulary_head() {
    let lm = r#"{"model_type": "bert", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
        "num_hidden_layers": 12, "vocab_size": 30522, "hidden_act": "gelu", "tie_word_embeddings": false,
        "architectures": ["BertForMaskedLM"]}"#;
    let cls = lm.replace("BertForMaskedLM", "BertForSequenceClassification");
    let lm = Architecture::from_hf_config(lm).unwrap();
    let cls = Architecture::from_hf_config(&cls).unwrap();
    assert!(lm.lm_head && !cls.lm_head);
    assert_eq!(lm.params() - cls.params(), 30522 * 768);
    let act = |a: &Architecture| {
        estimate(base(a.clone(), a.params()))
            .unwrap()
            .activations_bytes
    };
    assert_eq!(act(&lm) - act(&cls), 8 * 128 * 30522 * 14);
}

/// The model states per GPU that the ZeRO paper gives for its running
/// example (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
/// Training Trillion Parameter Models", Figure 1): 7.5B parameters, mixed
/// precision Adam (16-bit weights and gradients, K = 12 bytes of optimizer
/// state with the fp32 master weights) over N_d = 64 GPUs, in GB (10^9
/// bytes); and its formulas, `(2 + 2 + K)Ψ` split by stage, at other sizes.
#[test]
fn zero_stages_keep_the_papers_model_states_per_gpu() {
    let states = |params: u64, gpus: u64, stage: u8| {
        let mut i = base(Architecture::guess(params), params);
        i.dtype = Dtype::Fp16;
        i.mixed_precision = true;
        i.gpus = gpus;
        i.sharding = oomkit_estimate::Sharding::from_stage(stage).unwrap();
        let e = estimate(i).unwrap();
        if stage == 3 {
            // What it gathers to compute comes on top, and is far smaller.
            assert!(e.gathered_bytes > 0 && e.gathered_bytes < e.weights_bytes * gpus / 4);
        }
        (e.weights_bytes + e.gradients_bytes + e.optimizer_bytes) as f64
    };
    // Figure 1, as published (rounded to the digit shown).
    for (stage, gb) in [(1, 31.4), (2, 16.6), (3, 1.9)] {
        let got = states(7_500_000_000, 64, stage) / 1e9;
        assert!(
            (got - gb).abs() <= 0.05,
            "ZeRO-{stage}: {got:.3} GB, the paper {gb}"
        );
    }
    // The formulas: P_os 4Ψ + KΨ/N, P_os+g 2Ψ + (2+K)Ψ/N, P_os+g+p (4+K)Ψ/N.
    for (params, gpus) in [(1_300_000_000u64, 8u64), (70_000_000_000, 256)] {
        let (p, n) = (params as f64, gpus as f64);
        let want = [4.0 * p + 12.0 * p / n, 2.0 * p + 14.0 * p / n, 16.0 * p / n];
        for (stage, w) in (1..=3).zip(want) {
            let got = states(params, gpus, stage);
            assert!(
                (got - w).abs() <= 3.0,
                "{params} on {gpus}, ZeRO-{stage}: {got} vs {w}"
            );
        }
    }
}

#[test]
fn sharding_needs_several_gpus_and_keeps_the_rest_whole() {
    let p = 7_000_000_000;
    let mut i = base(Architecture::guess(p), p);
    i.sharding = oomkit_estimate::Sharding::Full;
    assert!(
        estimate(i.clone()).is_err(),
        "ZeRO-3 on one GPU shards nothing"
    );
    i.gpus = 8;
    i.sharding = oomkit_estimate::Sharding::None;
    let ddp = estimate(i.clone()).unwrap();
    let mut one = i.clone();
    one.gpus = 1;
    assert_eq!(
        ddp.total_bytes,
        estimate(one).unwrap().total_bytes,
        "DDP keeps everything"
    );
    i.sharding = oomkit_estimate::Sharding::OptimizerState;
    let z1 = estimate(i.clone()).unwrap();
    assert_eq!(z1.optimizer_bytes, ddp.optimizer_bytes.div_ceil(8));
    assert_eq!(
        (z1.weights_bytes, z1.gradients_bytes),
        (ddp.weights_bytes, ddp.gradients_bytes)
    );
    assert_eq!(
        z1.activations_bytes, ddp.activations_bytes,
        "each GPU runs its own micro-batch"
    );
}

/// A mixture of experts keeps every expert's weights but runs each token
/// through a few: the weights count all of them, the activations only
/// those a token runs through (and a dense model is one expert of one).
#[test]
fn a_mixture_of_experts_keeps_every_expert_and_runs_a_few() {
    let dense = r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000,
        "hidden_act": "silu", "tie_word_embeddings": false}"#;
    let moe = dense.replace(
        r#""hidden_act""#,
        r#""num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act""#,
    );
    let (d, m) = (
        Architecture::from_hf_config(dense).unwrap(),
        Architecture::from_hf_config(&moe).unwrap(),
    );
    assert_eq!((d.experts, d.experts_per_token), (1, 1));
    assert_eq!((m.experts, m.experts_per_token, m.ffn), (8, 2, 14336));
    let mlp = 3 * 4096 * 14336 * 32;
    let router = 8 * 4096 * 32;
    assert_eq!(m.params() - d.params(), 7 * mlp + router);
    let act = |a: &Architecture| {
        let mut i = base(a.clone(), a.params());
        i.flash_attention = true;
        i.batch = 1;
        estimate(i).unwrap().activations_bytes
    };
    // Llama-style layers keep 8 bytes per token and MLP unit: twice the MLP width for two experts.
    assert_eq!(act(&m) - act(&d), 8 * 128 * 14336 * 32);
}

/// Sizes no model has are refused with one line, never wrapped into a
/// budget that fits: a config's field past 2^31, a zero, a sequence or
/// batch whose activations pass 1 EiB.
#[test]
fn absurd_sizes_are_refused_not_wrapped() {
    let huge = r#"{"hidden_size": 18446744073709551615, "num_attention_heads": 1, "num_hidden_layers": 2}"#;
    let e = Architecture::from_hf_config(huge).unwrap_err().to_string();
    assert!(e.contains("hidden_size is 18446744073709551615"), "{e}");
    // Found whatever other large integer comes before it (here a token id).
    let after = r#"{"bos_token_id": 4294967296, "hidden_size": 4294967296, "num_attention_heads": 1, "num_hidden_layers": 2}"#;
    let e = Architecture::from_hf_config(after).unwrap_err().to_string();
    assert!(e.contains("hidden_size is 4294967296"), "{e}");
    let zero = r#"{"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 0}"#;
    let e = Architecture::from_hf_config(zero).unwrap_err().to_string();
    assert!(e.contains("layer count is 0"), "{e}");
    // Each field within bounds, their product far past any model.
    let wide = r#"{"hidden_size": 2147483648, "num_attention_heads": 1, "num_hidden_layers": 2147483648,
        "intermediate_size": 2147483648, "num_local_experts": 2147483648}"#;
    let arch = Architecture::from_hf_config(wide).unwrap();
    assert!(estimate(base(arch.clone(), arch.params())).is_err());
    let p = 7_000_000_000;
    let mut i = base(Architecture::guess(p), p);
    i.capacity_bytes = Some(80 << 30);
    i.seq = 100_000_000;
    let e = estimate(i.clone()).unwrap_err().to_string();
    assert!(e.contains("beyond 1 EiB"), "{e}");
    i.seq = 1024;
    i.batch = u64::MAX;
    assert!(estimate(i).is_err());
}
