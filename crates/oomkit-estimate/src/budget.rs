//! The budget formulas: weights, gradients, optimizer state, activations and overhead, from a shape and the training choices.

use crate::{Architecture, EstimateError, Optimizer};
use serde::Serialize;

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
///
/// Long on purpose: it is the budget read top to bottom, one term after
/// another (weights, gradients, optimizer state, EMA, what sharding gathers,
/// activations, overhead, the range and the verdict), each term commented
/// with its source; the terms share the inputs' derived sizes, and the
/// formulas that are reused (activations per sample, a Llama layer) are
/// functions of their own.
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
pub(crate) fn gib(b: u64) -> String {
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
