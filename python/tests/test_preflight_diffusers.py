"""diffusers under preflight: a diffusion model's ``from_pretrained`` reads no weight file.

A diffusion fine-tune or generation loads its UNet, VAE and text encoder
from one repository's subfolders. Under preflight each is built from its
config alone: from a folder holding only the configs, from one whose weight
files are not even readable, and from a hub repository whose weight files
are never asked for, with the figures of the same run with the weights
present, and the parameters and optimizer state counted by hand from the
models' own tensors. diffusers and what it imports (Pillow,
importlib_metadata) are installed by scripts/test.sh into their own
folder, `.venv/diffusers-site`, so that the other tests' libraries do not
find Pillow and change what they run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from preflight_cli import OOMKIT, allocator_bytes, pythonpath_with, warm_python_for

SITE = Path(sys.prefix) / "diffusers-site"

#: The scripts that run pipelines from configs, and their stand-in tokenizers.
FROM_CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "from_config"

pytestmark = pytest.mark.skipif(
    not (SITE / "diffusers").is_dir(), reason=f"diffusers is not installed in {SITE} (scripts/test.sh installs it)"
)

#: Builds a small Stable Diffusion of the real architecture (a UNet with cross-attention, a VAE,
#: CLIP's text encoder and tokenizer, a DDPM scheduler), saves it as a pipeline three ways, and
#: prints the bytes of each model's tensors as the scripts below hold them on the GPU.
MAKE = r"""
import json, os, sys, torch
from pathlib import Path
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

out = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from stand_in_tokenizers import clip_bytes
torch.manual_seed(0)
unet = UNet2DConditionModel(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8,
)
vae = AutoencoderKL(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(32, 64), latent_channels=4, norm_num_groups=8, sample_size=64,
)
text = CLIPTextModel(CLIPTextConfig(
    vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
))
# CLIP's byte-level tokenizer with no merges: each byte a token, as the model's vocabulary allows.
tokenizer = clip_bytes(out / "tok")
pipe = StableDiffusionPipeline(
    vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000),
    safety_checker=None, feature_extractor=None, requires_safety_checker=False,
)
pipe.save_pretrained(out / "full")
weights = [p for p in (out / "full").rglob("*") if p.suffix in (".safetensors", ".bin")]
assert len(weights) == 3, weights
# The same repository before its weights are fetched, and with weight files that cannot be read.
for name in ("bare", "garbage"):
    for p in (out / "full").rglob("*"):
        if p.is_file() and p not in weights:
            (out / name / p.relative_to(out / "full")).parent.mkdir(parents=True, exist_ok=True)
            (out / name / p.relative_to(out / "full")).write_bytes(p.read_bytes())
for p in weights:
    (out / "garbage" / p.relative_to(out / "full")).write_bytes(b"not a checkpoint")

def held(model, dtype=None):
    # What .to("cuda", dtype) leaves on the GPU: floating tensors in dtype, the others as they are.
    return [t.numel() * (t.element_size() if dtype is None or not t.is_floating_point() else dtype.itemsize)
            for t in [*model.parameters(), *model.buffers()]]

# The UNet in 4-bit NF4, as diffusers' bitsandbytes quantizer makes it: every linear layer's weight
# packed two to a byte with a float32 scale per 64 and a 16-value code book, the rest in bf16; and
# LoRA adapters of rank 4 (bf16, as the layers' compute dtype) on the attention projections.
linear = [m for m in unet.modules() if isinstance(m, torch.nn.Linear)]
weights = {id(m.weight) for m in linear}
adapted = [m for n, m in unet.named_modules() if n.endswith(("to_q", "to_k", "to_v", "to_out.0"))]
print(json.dumps({
    "unet_linear": [m.weight.numel() for m in linear],
    "unet_rest_bf16": [
        t.numel() * (2 if t.is_floating_point() else t.element_size())
        for t in [*unet.parameters(), *unet.buffers()] if id(t) not in weights
    ],
    "unet_lora": [n * 2 for m in adapted for n in (4 * m.in_features, m.out_features * 4)],
    "unet": held(unet), "unet_params": [p.numel() * p.element_size() for p in unet.parameters()],
    "unet_fp16": held(unet, torch.float16), "vae_fp16": held(vae, torch.float16), "text_fp16": held(text, torch.float16),
    "tensors": {"unet": len(unet.state_dict()), "vae": len(vae.state_dict()), "text_encoder": len(text.state_dict())},
}))
"""

#: A text-to-image fine-tune in the pattern of diffusers' training examples, in this project's
#: words, the one BENCHMARKS.md runs at full size: the VAE and text encoder frozen in fp16, the
#: UNet trained in fp32 on the noise it predicts. Here on batches of 4 images of 64 x 64.
TRAIN = (Path(__file__).resolve().parents[2] / "scripts" / "from_config" / "text_to_image_finetune.py").read_text()
TRAIN_ARGS = ("4", "64")

#: Generation through the pipeline, in fp16, saved as an image.
GENERATE = r"""
import sys, torch
from diffusers import StableDiffusionPipeline

pipe = StableDiffusionPipeline.from_pretrained(sys.argv[1], torch_dtype=torch.float16).to("cuda")
images = pipe(["a red square", "a blue circle"], num_inference_steps=3, height=64, width=64).images
images[0].save("out.png")
"""


#: The warm Python this module's commands are served by, while its fixture is open.
_SERVED: dict[str, str] = {}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath_with(SITE), "HF_HUB_OFFLINE": "1", **_SERVED, **extra}


@pytest.fixture(scope="module", autouse=True)
def _warm_with_diffusers() -> Iterator[None]:
    with warm_python_for(_env(), _SERVED):
        yield


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The saved pipeline's folder (``full``, ``bare``, ``garbage``) and its models' tensors' bytes."""
    out = tmp_path_factory.mktemp("diffusers")
    p = subprocess.run([sys.executable, "-c", MAKE, str(out), str(FROM_CONFIG)], capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads(p.stdout.strip().splitlines()[-1])


def _preflight(folder: Path, script: str, model: str, *args: str, **env: str) -> dict[str, Any]:
    (folder / "script.py").write_text(script)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "H100", "--", sys.executable, "script.py", model, *args],
        capture_output=True, text=True, timeout=300, cwd=folder, env=_env(**env),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout)["run"]


def _bytes(sizes: list[int]) -> int:
    return allocator_bytes(SimpleNamespace(nbytes=n) for n in sizes)


def _built_from_config(run: dict[str, Any], counts: dict[str, int]) -> None:
    for cls, name in (("UNet2DConditionModel", "unet"), ("AutoencoderKL", "vae"), ("CLIPTextModel", "text_encoder")):
        note = f"{cls} was built from its config; no weight file was read (its {counts[name]} tensors,"
        assert any(n.startswith(note) for n in run["notes"]), (note, run["notes"])


def test_a_diffusion_fine_tune_needs_only_its_configs(pipeline: tuple[Path, dict[str, Any]]) -> None:
    out, sizes = pipeline
    runs = {name: _preflight(out, TRAIN, name, *TRAIN_ARGS) for name in ("full", "bare", "garbage")}
    for name, run in runs.items():
        # The weight files are never read: present, absent or unreadable, the same run.
        assert (run["peak_allocated_bytes"], run["by_role"]) == (runs["full"]["peak_allocated_bytes"], runs["full"]["by_role"]), name
        _built_from_config(run, sizes["tensors"])
    run = runs["bare"]
    assert run["steps"] == 2, run
    # The UNet in fp32, the frozen VAE and text encoder in fp16 (their integer buffers as they are).
    expected = _bytes(sizes["unet"]) + _bytes(sizes["vae_fp16"]) + _bytes(sizes["text_fp16"])
    assert run["by_role"]["parameters"] == expected, (run["by_role"], expected)
    # AdamW's two moments of the UNet's weights (its step counts are on the host).
    assert run["by_role"]["optimizer_state"] == 2 * _bytes(sizes["unet_params"]), run["by_role"]


def test_a_diffusion_pipeline_generates_from_its_configs_alone(pipeline: tuple[Path, dict[str, Any]]) -> None:
    out, sizes = pipeline
    full, bare = _preflight(out, GENERATE, "full"), _preflight(out, GENERATE, "bare")
    assert (bare["peak_allocated_bytes"], bare["by_role"]) == (full["peak_allocated_bytes"], full["by_role"])
    assert bare["mode"] == "inference", bare
    _built_from_config(bare, sizes["tensors"])
    # Every model in fp16, as torch_dtype says, on the GPU for the whole run.
    expected = _bytes(sizes["unet_fp16"]) + _bytes(sizes["vae_fp16"]) + _bytes(sizes["text_fp16"])
    assert bare["by_role"]["parameters"] == expected, (bare["by_role"], expected)
    assert (out / "out.png").is_file()


#: A QLoRA fine-tune of the UNet, as diffusers' 4-bit training examples do: loaded in NF4 by
#: bitsandbytes, frozen, LoRA adapters added through PEFT and trained with AdamW.
QLORA = r"""
import sys, torch, torch.nn.functional as F
from diffusers import BitsAndBytesConfig, UNet2DConditionModel
from peft import LoraConfig

nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
unet = UNet2DConditionModel.from_pretrained(sys.argv[1], subfolder="unet", quantization_config=nf4, torch_dtype=torch.bfloat16)
unet.requires_grad_(False)
unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-4)
for step in range(3):
    latents = torch.randn(2, 4, 32, 32, device="cuda", dtype=torch.bfloat16)
    context = torch.randn(2, 77, 32, device="cuda", dtype=torch.bfloat16)
    predicted = unet(latents, torch.tensor([10, 20], device="cuda"), context).sample
    F.mse_loss(predicted.float(), torch.randn_like(predicted).float()).backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_4bit_unet_fine_tuned_with_lora_from_its_configs(pipeline: tuple[Path, dict[str, Any]]) -> None:
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed for this Python")
    pytest.importorskip("peft", reason="peft is not installed for this Python")
    out, sizes = pipeline
    full, bare = _preflight(out, QLORA, "full"), _preflight(out, QLORA, "bare")
    assert (bare["peak_allocated_bytes"], bare["by_role"]) == (full["peak_allocated_bytes"], full["by_role"])
    assert bare["steps"] == 2, bare
    # Half a byte a weight, rounded to the allocator's blocks, a float32 scale per 64 weights and a code book of each.
    nf4 = sum(_bytes([n // 2]) + _bytes([n // 64 * 4]) + _bytes([16 * 4]) for n in sizes["unet_linear"])
    adapters = _bytes(sizes["unet_lora"])
    assert bare["by_role"]["parameters"] == nf4 + _bytes(sizes["unet_rest_bf16"]) + adapters, bare["by_role"]
    assert bare["by_role"]["optimizer_state"] == 2 * adapters, bare["by_role"]


def test_a_hub_repository_is_fetched_without_its_weight_files(pipeline: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from fake_hub import FakeHub

    out, sizes = pipeline
    hub = FakeHub(out / "full", "someorg/tiny-diffusion")
    try:
        run = _preflight(
            out, TRAIN, "someorg/tiny-diffusion", *TRAIN_ARGS,
            HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_XET="1", HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf"),
        )  # fmt: skip
    finally:
        hub.close()
    asked = [path for _, path in hub.log]
    for name in ("unet", "vae", "text_encoder"):
        # (By the revision or by its commit: diffusers asks for the first, transformers for the second.)
        assert any(path.endswith(f"/{name}/config.json") for path in asked), asked
    weights = [path for path in asked if path.endswith((".safetensors", ".bin"))]
    assert weights == [], weights
    assert list((tmp_path / "hf").rglob("*.safetensors")) == [], "a weight file was downloaded"
    _built_from_config(run, sizes["tensors"])
    assert run["by_role"]["parameters"] == _bytes(sizes["unet"]) + _bytes(sizes["vae_fp16"]) + _bytes(sizes["text_fp16"])


#: A Flux pipeline of the real architecture, small (a transformer of one double and one single
#: block, a VAE of four levels, CLIP's and T5's text encoders), saved as configs alone with stand-in
#: tokenizers, as scripts/flux_table.sh saves FLUX.1-dev's; it prints the bytes its models' tensors
#: hold on the GPU in bf16.
MAKE_FLUX = r"""
import json, sys, torch
from pathlib import Path
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

out = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from stand_in_tokenizers import clip_bytes, t5_words

transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                     num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                                     axes_dims_rope=(4, 6, 6))
vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                    block_out_channels=(8, 8, 16, 16), latent_channels=4, norm_num_groups=4, layers_per_block=1,
                    use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1, scaling_factor=0.4)
clip = CLIPTextModel(CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=77, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
t5 = T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=2, feed_forward_proj="gated-gelu",
                             is_encoder_decoder=False))
pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae, text_encoder=clip,
                    tokenizer=clip_bytes(out / "tok"), text_encoder_2=t5, tokenizer_2=t5_words(out / "tok2", ["a", "photo"]),
                    transformer=transformer)
pipe.save_pretrained(out / "flux")
for p in (out / "flux").rglob("*"):
    if p.suffix == ".safetensors":
        p.unlink()

def held(model):
    # Each tensor once (T5's embedding is tied), its buffers too (CLIP's position ids, int64, outside the
    # state dict), floating ones in bf16, each in the allocator's blocks of 512 bytes.
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(-(-t.numel() * (2 if t.is_floating_point() else t.element_size()) // 512) * 512 for t in tensors)

print(json.dumps({"bf16": sum(held(m) for m in (transformer, vae, clip, t5))}))
"""


def test_a_flux_pipeline_generates_from_its_configs_alone_in_bf16_and_int8(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-c", MAKE_FLUX, str(tmp_path), str(FROM_CONFIG)], capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    held = json.loads(p.stdout.strip().splitlines()[-1])
    script = FROM_CONFIG / "flux_generate.py"
    for kind in ("bf16", "int8"):
        run = subprocess.run(
            [OOMKIT, "preflight", "--json", "--capacity", "H100", "--", sys.executable, str(script), str(tmp_path / "flux"), kind],
            capture_output=True, text=True, timeout=300, env=_env(),
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        doc = json.loads(run.stdout)["run"]
        # The script's own reading after loading: what the allocator holds, the models' tensors.
        loaded = int(next(line for line in run.stderr.splitlines() if line.startswith("after loading:")).split("(")[1].split()[0])
        assert all(n.endswith("stand as zeros of their shapes and dtypes)") for n in doc["notes"] if "was built from its config" in n)
        assert sum("was built from its config" in n for n in doc["notes"]) == 4, doc["notes"]
        if kind == "bf16":
            assert loaded == held["bf16"], (held, loaded)
        else:
            # The transformer's and T5's linear layers in a byte a weight: less than in bf16, and the outliers said.
            assert loaded < held["bf16"], (held, loaded)
            assert any("outlier columns" in n for n in doc["notes"]), doc["notes"]
        assert doc["mode"] == "inference" and doc["peak_allocated_bytes"] > loaded
