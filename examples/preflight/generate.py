"""Generation with a Hugging Face model, for `oomkit preflight` (docs/preflight.md).

A Llama-shaped model built from its config (no download), a batch of
prompts, and `generate()` with a dynamic or a static key-value cache:

    oomkit preflight --capacity 24GiB -- python examples/preflight/generate.py --max-new-tokens 64

With --size 7b the model has Llama-2-7B's shape (BENCHMARKS.md times it).
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--size", choices=["small", "7b"], default="small", help="7b: Llama-2-7B's shape")
    args = parser.parse_args()
    shape = (
        dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
        if args.size == "7b"
        else dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, vocab_size=4000)
    )
    config = LlamaConfig(
        num_hidden_layers=32 if args.size == "7b" else args.layers,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **shape,
    )
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts = torch.randint(3, config.vocab_size, (args.batch, args.prompt)).cuda()
    extra = {"cache_implementation": "static"} if args.cache == "static" else {}
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=config.pad_token_id,
            **extra,
        )
    print(f"generated {tuple(out.shape)}")


if __name__ == "__main__":
    main()
