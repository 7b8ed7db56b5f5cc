#!/usr/bin/env bash
# torchtune's memory ladder (its README: full fine-tuning of Llama-3.2-3B on an A100, batch 2,
# 4,096 tokens packed, bf16, one change per row), each row run through `tune run` unchanged
# under `oomkit preflight`, from the model's config alone: the checkpoint folder holds
# Llama-3.2-3B's config.json and no weight file (preflight gives torchtune's checkpointer zeros of
# the shapes the config describes, never read). Stand-ins for the other downloads: a byte-level
# tokenizer and a small Alpaca-shaped JSON file (packing fills every row to 4,096 tokens).
# Needs torchtune 0.6.1 and torchao 0.15.0 importable (PYTHONPATH is kept), transformers, and
# bitsandbytes for the last row. Usage: scripts/torchtune_ladder.sh [WORKDIR]; prints one line per row.
set -euo pipefail
work=${1:-$(mktemp -d)}
mkdir -p "$work/ckpt"
python - "$work/ckpt" <<'PY'
import base64, json, os, sys
out = sys.argv[1]
# meta-llama/Llama-3.2-3B's config.json, as `tune download` fetches it (the weights are not fetched).
json.dump({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}, open(os.path.join(out, "config.json"), "w"))
with open(os.path.join(out, "tokenizer.model"), "w") as f:
    f.writelines(base64.b64encode(bytes([i])).decode() + f" {i}\n" for i in range(256))
rows = [{"instruction": f"Say something about the number {i} " * 8, "input": "", "output": f"The number {i} is fine. " * 20} for i in range(64)]
json.dump(rows, open(os.path.join(out, "alpaca.json"), "w"))
PY
c=$work/ckpt
common=(checkpointer.checkpoint_dir="$c" "checkpointer.checkpoint_files=[model.safetensors]" tokenizer.path="$c/tokenizer.model"
  tokenizer.max_seq_len=4096 dataset.source=json dataset.data_files="$c/alpaca.json" dataset.split=train output_dir="$work/out"
  max_steps_per_epoch=2 batch_size=2 dataset.packed=True loss._component_=torch.nn.CrossEntropyLoss compile=False
  enable_activation_checkpointing=False optimizer_in_bwd=False enable_activation_offloading=False optimizer._component_=torch.optim.AdamW)
row() {
  local name=$1; shift
  run_recipe "$name" full_finetune_single_device llama3_2/3B_full_single_device "$@"
}
# The LoRA rows: the README's command for its last row, on the LoRA and QLoRA configs.
lora_row() {
  local name=$1 config=$2; shift 2
  run_recipe "$name" lora_finetune_single_device "$config" compile=True loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss \
    enable_activation_checkpointing=True enable_activation_offloading=True gradient_accumulation_steps=1 \
    dataset._component_=torchtune.datasets.alpaca_dataset "$@"
}
run_recipe() {
  local name=$1 recipe=$2 config=$3; shift 3
  rm -rf "$work/out/logs"
  HF_DATASETS_OFFLINE=1 oomkit preflight --json --capacity A100 --steps 2 -- \
    tune run "$recipe" --config "$config" "${common[@]}" "$@" > "$work/row.json" 2> "$work/row.err" \
    || { echo "$name: no answer (see $work/row.err)"; return; }
  # Beside the run's peak, the first step's "peak_memory_active" as the recipe itself logs it
  # (torchtune resets the peak at each log, and preflight answers memory_stats() from its model).
  python - "$work/row.json" "$name" "$work/out/logs" <<'PY'
import glob, json, re, sys
r = json.load(open(sys.argv[1]))["run"]
G = 2**30
logged = [m.group(1) for f in glob.glob(sys.argv[3] + "/*.txt") for m in re.finditer(r"Step 1 \|.*?peak_memory_active:([0-9.]+)", open(f).read())]
step1 = "%6.2f GiB" % float(logged[0]) if logged else "   (none)"
print("%-28s peak allocated %6.2f GiB, paged %5.2f GiB, step 1 logged %s" % (sys.argv[2], r["peak_allocated_bytes"] / G, r["host_paged_peak_bytes"] / G, step1))
PY
}
chunked=loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss
row "+ packed (60.0)"
row "+ compile (51.0)" compile=True
row "+ chunked CE (42.9)" compile=True $chunked
row "+ checkpointing (24.9)" compile=True $chunked enable_activation_checkpointing=True optimizer.fused=True
row "  (foreach AdamW)" compile=True $chunked enable_activation_checkpointing=True
row "+ optimizer in bwd (23.1)" compile=True $chunked enable_activation_checkpointing=True optimizer_in_bwd=True
row "+ offloading (21.8)" compile=True $chunked enable_activation_checkpointing=True optimizer_in_bwd=True enable_activation_offloading=True
row "+ 8-bit AdamW (17.6)" compile=True $chunked enable_activation_checkpointing=True optimizer_in_bwd=True enable_activation_offloading=True optimizer._component_=bitsandbytes.optim.AdamW8bit
row "  (paged)" compile=True $chunked enable_activation_checkpointing=True optimizer_in_bwd=True enable_activation_offloading=True optimizer._component_=bitsandbytes.optim.PagedAdamW8bit
lora_row "LoRA (8.5)" llama3_2/3B_lora_single_device
lora_row "QLoRA (4.6)" llama3_2/3B_qlora_single_device
