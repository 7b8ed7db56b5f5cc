#!/bin/bash
# A diffusion fine-tune from its configs alone (Stable Diffusion 1.5's shapes: UNet, VAE, CLIP text
# encoder, scheduler, each folder holding its config and no weights), beside what a user would
# otherwise have: the calculators' arithmetic on the same configs (trained weights, gradients and
# AdamW's moments at 16 bytes a weight, the frozen models in fp16; no activations). Wall time and peak
# resident set of each whole command. Needs diffusers importable (scripts/test.sh installs it into
# .venv/diffusers-site: PYTHONPATH=.venv/diffusers-site). Usage: bash scripts/bench_diffusers_from_config.sh [python]
set -euo pipefail
py=${1:-python}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/sd15/unet" "$work/sd15/vae" "$work/sd15/text_encoder" "$work/sd15/scheduler"
cat > "$work/sd15/unet/config.json" <<'JSON'
{"_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
 "cross_attention_dim": 768, "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
 "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"], "downsample_padding": 1,
 "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4, "out_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1,
 "norm_eps": 1e-05, "norm_num_groups": 32, "sample_size": 64}
JSON
cat > "$work/sd15/vae/config.json" <<'JSON'
{"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "in_channels": 3, "out_channels": 3,
 "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
 "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
 "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "sample_size": 512}
JSON
cat > "$work/sd15/text_encoder/config.json" <<'JSON'
{"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_size": 768, "intermediate_size": 3072,
 "num_attention_heads": 12, "num_hidden_layers": 12, "max_position_embeddings": 77, "vocab_size": 49408, "hidden_act": "quick_gelu",
 "projection_dim": 768, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
JSON
cat > "$work/sd15/scheduler/scheduler_config.json" <<'JSON'
{"_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
 "num_train_timesteps": 1000, "set_alpha_to_one": false, "skip_prk_steps": true, "steps_offset": 1}
JSON
timed() { /usr/bin/time -o "$work/time" -f "  wall %e s, peak RSS %M KB" "$@"; }
peaks='import json,sys; r=json.load(sys.stdin)["run"]; print("  peak allocated %.2f GiB, reserved %.2f GiB" % (r["peak_allocated_bytes"]/2**30, r["peak_reserved_bytes"]/2**30))'
echo "== Stable Diffusion 1.5's shapes, 1 x 512 x 512, fp32 UNet with AdamW"
echo "oomkit preflight (A10G)"
HF_HUB_OFFLINE=1 timed oomkit preflight --json --capacity A10G -- "$py" "$here/from_config/text_to_image_finetune.py" "$work/sd15" 1 2>/dev/null | "$py" -c "$peaks"
cat "$work/time"
echo "the calculators' arithmetic on the configs"
timed "$py" - "$work/sd15" <<'PY' 2>/dev/null
import sys, torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel
repo = sys.argv[1]
with torch.device("meta"):
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(repo, subfolder="unet"))
    vae = AutoencoderKL.from_config(AutoencoderKL.load_config(repo, subfolder="vae"))
    text = CLIPTextModel(CLIPTextConfig.from_pretrained(repo, subfolder="text_encoder"))
trained = sum(p.numel() for p in unet.parameters())
frozen = sum(p.numel() for m in (vae, text) for p in m.parameters())
print("  %.2f GiB: UNet %.0f M weights x 16 bytes (fp32 weight, gradient, two moments), frozen %.0f M x 2 bytes" % (
    (16 * trained + 2 * frozen) / 2**30, trained / 1e6, frozen / 1e6))
PY
cat "$work/time"
