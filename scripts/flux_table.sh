#!/bin/bash
# VALIDATION.md's Flux.1-dev rows: diffusers' FluxPipeline from a folder holding Flux.1-dev's configs
# (its transformer, VAE, CLIP and T5 text encoders, scheduler) and stand-in tokenizers, no weights,
# generating at 1024 x 1024 under `oomkit preflight --capacity H100`, in bf16 and with bitsandbytes'
# NF4 and int8 on the transformer and T5. Needs diffusers importable (scripts/test.sh installs it:
# PYTHONPATH=.venv/diffusers-site) and bitsandbytes. Usage: bash scripts/flux_table.sh [python]
set -euo pipefail
py=${1:-python}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dev="$work/flux-dev"
mkdir -p "$dev/transformer" "$dev/vae" "$dev/text_encoder" "$dev/text_encoder_2" "$dev/scheduler"
cat > "$dev/model_index.json" <<'JSON'
{"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
 "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
 "tokenizer_2": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
JSON
cat > "$dev/transformer/config.json" <<'JSON'
{"_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "guidance_embeds": true, "in_channels": 64,
 "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768}
JSON
cat > "$dev/vae/config.json" <<'JSON'
{"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
 "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"], "force_upcast": true,
 "in_channels": 3, "latent_channels": 16, "layers_per_block": 2, "mid_block_add_attention": true, "norm_num_groups": 32, "out_channels": 3,
 "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
 "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"], "use_post_quant_conv": false, "use_quant_conv": false}
JSON
cat > "$dev/text_encoder/config.json" <<'JSON'
{"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
 "num_hidden_layers": 12, "max_position_embeddings": 77, "vocab_size": 49408, "hidden_act": "quick_gelu", "projection_dim": 768,
 "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "layer_norm_eps": 1e-05}
JSON
cat > "$dev/text_encoder_2/config.json" <<'JSON'
{"architectures": ["T5EncoderModel"], "model_type": "t5", "d_ff": 10240, "d_kv": 64, "d_model": 4096, "decoder_start_token_id": 0,
 "dense_act_fn": "gelu_new", "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": true, "is_gated_act": true,
 "layer_norm_epsilon": 1e-06, "num_decoder_layers": 24, "num_heads": 64, "num_layers": 24, "pad_token_id": 0,
 "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
 "vocab_size": 32128}
JSON
cat > "$dev/scheduler/scheduler_config.json" <<'JSON'
{"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096,
 "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": true}
JSON
# Stand-in tokenizers: CLIP's byte by byte, T5's a few words; T5 pads every prompt to 512 tokens and CLIP to 77 either way.
"$py" "$here/from_config/stand_in_tokenizers.py" clip "$dev/tokenizer"
"$py" "$here/from_config/stand_in_tokenizers.py" t5 "$dev/tokenizer_2" a photo of an astronaut riding horse on mars
for q in bf16 nf4 int8; do
  echo "== Flux.1-dev, $q"
  HF_HUB_OFFLINE=1 oomkit preflight --json --capacity H100 -- "$py" "$here/from_config/flux_generate.py" "$dev" "$q" 2>"$work/err" >"$work/out.json" \
    || { tail -5 "$work/err"; continue; }
  grep -E "^(after loading|peak):" "$work/err" | sed 's/^/  the script: /'
  "$py" -c 'import json,sys; r=json.load(open(sys.argv[1]))["run"]; print("  preflight: peak allocated %.3f GiB, reserved %.3f GiB" % (r["peak_allocated_bytes"]/2**30, r["peak_reserved_bytes"]/2**30))' "$work/out.json"
done
