"""A text-to-image fine-tune of a diffusers repository, in the pattern of diffusers' training
examples (this project's words): the VAE and text encoder frozen in fp16, the UNet trained in fp32
with AdamW on the noise it predicts. BENCHMARKS.md runs it on Stable Diffusion 1.5's shapes, and
test_preflight_diffusers.py on a small model. Usage: python text_to_image_finetune.py REPO [BATCH] [SIZE]
(SIZE: the images' side in pixels, 512 unless given)."""

import sys

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextModel

repo = sys.argv[1]
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
size = int(sys.argv[3]) if len(sys.argv) > 3 else 512
scheduler = DDPMScheduler.from_pretrained(repo, subfolder="scheduler")
text_encoder = CLIPTextModel.from_pretrained(repo, subfolder="text_encoder")
vae = AutoencoderKL.from_pretrained(repo, subfolder="vae")
unet = UNet2DConditionModel.from_pretrained(repo, subfolder="unet")
vae.requires_grad_(False)
text_encoder.requires_grad_(False)
vae.to("cuda", dtype=torch.float16)
text_encoder.to("cuda", dtype=torch.float16)
unet.to("cuda")
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5)
for _ in range(3):
    pixels = torch.randn(batch, 3, size, size, device="cuda", dtype=torch.float16)
    ids = torch.randint(0, text_encoder.config.vocab_size, (batch, 77), device="cuda")
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
        context = text_encoder(ids)[0]
    noise = torch.randn_like(latents)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), device="cuda")
    predicted = unet(scheduler.add_noise(latents, noise, t).float(), t, context.float()).sample
    F.mse_loss(predicted, noise.float()).backward()
    optimizer.step()
    optimizer.zero_grad()
