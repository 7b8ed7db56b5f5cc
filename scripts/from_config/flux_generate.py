"""Flux.1-dev's text-to-image generation at 1024 x 1024 in bf16, or with its transformer and T5 encoder
quantized by bitsandbytes (NF4 or int8), in the pattern of diffusers' quantization benchmark.

    python scripts/from_config/flux_generate.py FOLDER [bf16|nf4|int8]

It prints the memory after loading and the peak, as the benchmark reports them (GiB); scripts/flux_table.sh
runs it under preflight from a folder of Flux.1-dev's configs alone.
"""
import sys

import torch
from diffusers import FluxPipeline

kwargs = {}
if len(sys.argv) > 2 and sys.argv[2] != "bf16":
    from diffusers.quantizers import PipelineQuantizationConfig
    bits = {"nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16}, "int8": {"load_in_8bit": True}}
    backend = "bitsandbytes_4bit" if sys.argv[2] == "nf4" else "bitsandbytes_8bit"
    kwargs["quantization_config"] = PipelineQuantizationConfig(
        quant_backend=backend, quant_kwargs=bits[sys.argv[2]], components_to_quantize=["transformer", "text_encoder_2"])
pipe = FluxPipeline.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16, **kwargs)
pipe.to("cuda")
loaded = torch.cuda.memory_allocated()
print(f"after loading: {loaded / 2**30:.3f} GiB ({loaded} bytes)", file=sys.stderr)
image = pipe("a photo of an astronaut riding a horse on mars", num_inference_steps=2, guidance_scale=3.5, height=1024, width=1024,
             generator=torch.Generator("cpu").manual_seed(0)).images[0]
peak = torch.cuda.max_memory_allocated()
print(f"peak: {peak / 2**30:.3f} GiB ({peak} bytes)", file=sys.stderr)
