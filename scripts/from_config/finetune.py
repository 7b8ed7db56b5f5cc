"""A hub model's fine-tune as a user writes it: full (bf16, checkpointed, fused AdamW) or QLoRA
(bitsandbytes NF4 with double quantization, LoRA r16 on the attention projections).

    python finetune.py MODEL full|qlora SEQ
"""

import sys

import torch
import transformers

name, method, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
if method == "qlora":
    import peft

    q = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(name, quantization_config=q, device_map={"": 0}, attn_implementation="sdpa")
    model = peft.prepare_model_for_kbit_training(model)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa").to("cuda")
    model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
for _ in range(2):
    ids = torch.randint(0, 32000, (1, seq), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
