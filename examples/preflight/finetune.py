"""A causal language model fine-tuned from a folder or hub id, written for CUDA: full, LoRA, or QLoRA.

    python examples/preflight/finetune.py --model examples/preflight/llama_1b --seq 2048
    python examples/preflight/finetune.py --model examples/preflight/llama_1b --seq 2048 --lora 16
    python examples/preflight/finetune.py --model examples/preflight/llama_1b --seq 2048 --lora 16 --4bit

The folder `examples/preflight/llama_1b` holds only a config (a Llama of
about 1.2 B parameters, in Llama 3.2 1B's published shape): `oomkit
preflight -- python examples/preflight/finetune.py ...` answers from it
with no weights, and on a GPU the script needs a folder with weights in it
(scripts/gpu_validate.py writes random ones beside the same config).
Weights load in bfloat16; LoRA adapts every linear layer through PEFT;
`--4bit` loads them as bitsandbytes' NF4 with double quantisation.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a folder with config.json (and weights, on a GPU), or a hub id")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lora", type=int, default=0, help="LoRA's rank; 0 fine-tunes every weight")
    p.add_argument("--4bit", dest="four_bit", action="store_true", help="QLoRA: the frozen weights in 4 bits (needs --lora)")
    p.add_argument("--checkpointing", action="store_true", help="recompute each layer's activations in the backward")
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    if args.four_bit and not args.lora:
        # 4-bit weights cannot be trained: without adapters the optimizer would get no parameters.
        p.error("--4bit needs --lora (QLoRA trains adapters over the frozen 4-bit weights)")

    loading = {"dtype": torch.bfloat16, "device_map": "cuda"}
    if args.four_bit:
        from transformers import BitsAndBytesConfig

        loading["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
        )
    model = AutoModelForCausalLM.from_pretrained(args.model, **loading)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if args.four_bit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing)
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear", task_type="CAUSAL_LM"))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    print(f"{sum(p.numel() for p in trained) / 1e6:.1f}M trained parameters, batch {args.batch} x {args.seq} tokens")
    model.train()
    for step in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
