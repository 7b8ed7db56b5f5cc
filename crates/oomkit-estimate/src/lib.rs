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
//!
//! The shape comes from a Hugging Face `config.json` (`config.rs`) or a
//! parameter count; the formulas are in `budget.rs`, and measured peaks
//! calibrate them in [`calibrate`].
//!
//! ```
//! use oomkit_estimate::{estimate, Architecture, Dtype, Inputs, Optimizer, Sharding};
//! let arch = Architecture::from_hf_config(
//!     r#"{"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}"#,
//! )
//! .unwrap();
//! assert_eq!(arch.params(), 124_439_808); // GPT-2 small, as transformers builds it
//! let e = estimate(Inputs {
//!     params: arch.params(),
//!     arch,
//!     dtype: Dtype::Bf16,
//!     mixed_precision: false,
//!     optimizer: Optimizer::AdamW,
//!     batch: 8,
//!     seq: 1024,
//!     grad_checkpointing: false,
//!     flash_attention: true,
//!     ema: false,
//!     lora_rank: None,
//!     load_in_4bit: false,
//!     overhead_bytes: oomkit_estimate::DEFAULT_OVERHEAD_BYTES,
//!     capacity_bytes: Some(80 << 30),
//!     gpus: 1,
//!     sharding: Sharding::None,
//! })
//! .unwrap();
//! assert_eq!(e.weights_bytes, 2 * 124_439_808);
//! assert!(e.total_bytes < 80 << 30);
//! ```

pub mod calibrate;

mod architecture;
mod budget;
mod config;
mod error;

pub use architecture::Architecture;
pub use budget::{
    estimate, Dtype, Estimate, Inputs, Sharding, Verdict, ACTIVATION_SPREAD, ALLOCATOR_RESERVE,
    DEFAULT_OVERHEAD_BYTES, GATHERED_LAYERS, MAX_BUDGET_BYTES, MAX_PARAMS,
};
pub use error::EstimateError;

/// The optimizer vocabulary lives with the roles it sizes; the estimate names it from here too.
pub use oomkit_advice::Optimizer;
