#!/usr/bin/env bash
# LitGPT's published memory tables, each row run through LitGPT's own command
# (`python -m litgpt finetune_lora` / `finetune_full`) under `oomkit preflight`, from the model's
# config alone: each checkpoint folder holds the `model_config.yaml` LitGPT writes for the model
# and a small tokenizer, and no `lit_model.pth` (preflight keeps the model as LitGPT built it).
# - the config hub's table (config_hub/finetune/README.md, April 2024, one A10G: 512 tokens,
#   bf16-true, LoRA alpha 16 and dropout 0.05), at the A10G's 23,028 MiB less its context;
# - the resource tables (tutorials/resource-tables.md, October 2023, one A100-SXM4-40GB:
#   bf16-true, LoRA r8 alpha 16 dropout 0.05 on query and value, at the longest Alpaca example:
#   1304 Llama 2 tokens, 1034 StableLM ones), at the A100's 40 GiB less its context.
# The data are instruction rows longer than each table's sequence, so every sample is cut to it.
# Needs litgpt 0.5 and jsonargparse importable, transformers' tokenizers.
# Usage: scripts/litgpt_tables.sh [WORKDIR]; prints one line per row. LITGPT_ROWS="gemma-2b
# gemma-7b" runs only the rows of those models (the test runs Gemma 2B's).
set -euo pipefail
work=${1:-$(mktemp -d)}
mkdir -p "$work"
cd "$work"
python - <<'PY'
import json
from pathlib import Path

from litgpt import Config
from litgpt.utils import save_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

words = [f"w{i}" for i in range(500)]
vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
for name in ("Llama-2-7b-hf", "Mistral-7B-v0.1", "Meta-Llama-3-8B", "gemma-2b", "gemma-7b", "tiny-llama-1.1b", "stablelm-base-alpha-3b"):
    folder = Path(name)
    folder.mkdir(exist_ok=True)
    save_config(Config.from_name(name), folder)
    fast.save_pretrained(folder)
rows = [
    {"instruction": " ".join(words[(i * 3 + j) % 500] for j in range(300)), "input": "",
     "output": " ".join(words[(i * 7 + j) % 500] for j in range(1400))}
    for i in range(40)
]
Path("data.json").write_text(json.dumps(rows))
PY
common=(--data JSON --data.json_path data.json --data.val_split_fraction 0.1 --train.max_steps 2
  --train.global_batch_size 8 --precision bf16-true --devices 1
  --eval.interval 1000 --eval.initial_validation false --eval.final_validation false)
lora=(--lora_alpha 16 --lora_dropout 0.05)
every=(--lora_query true --lora_key true --lora_value true --lora_projection true --lora_mlp true --lora_head true)
row() {
  local name=$1 capacity=$2 command=$3 model=$4; shift 4
  if [ -n "${LITGPT_ROWS:-}" ] && [[ " $LITGPT_ROWS " != *" $model "* ]]; then return; fi
  local code=0
  # Exit 5: an answer, that the step does not fit.
  HF_HUB_OFFLINE=1 oomkit preflight --json --capacity "$capacity" -- python -m litgpt "$command" "$model" \
    "${common[@]}" --out_dir "out-$model" "$@" > row.json 2> "$model.err" || code=$?
  [ "$code" = 0 ] || [ "$code" = 5 ] || { echo "$name: no answer (see $work/$model.err)"; return; }
  python -c "import json,sys; r=json.load(open('row.json'))['run']; print('%-40s peak allocated %6.2f GB, fits: %s' % (sys.argv[1], r['peak_allocated_bytes']/1e9, r['fits']))" "$name"
}
# The config hub's rows: 512 tokens on an A10G.
hub=(21748MiB --train.max_seq_length 512)
row "Llama-2-7B LoRA r32 b2 (19.77)" "${hub[0]}" finetune_lora Llama-2-7b-hf "${hub[@]:1}" --train.micro_batch_size 2 --lora_r 32 "${lora[@]}"
row "Mistral-7B LoRA r32 b2 (20.66)" "${hub[0]}" finetune_lora Mistral-7B-v0.1 "${hub[@]:1}" --train.micro_batch_size 2 --lora_r 32 "${lora[@]}"
row "Llama-3-8B LoRA r32 b1 (19.73)" "${hub[0]}" finetune_lora Meta-Llama-3-8B "${hub[@]:1}" --train.micro_batch_size 1 --lora_r 32 "${lora[@]}"
row "Gemma-2B LoRA r16 b2 (12.62)" "${hub[0]}" finetune_lora gemma-2b "${hub[@]:1}" --train.micro_batch_size 2 --lora_r 8 "${lora[@]}" "${every[@]}"
row "Gemma-7B LoRA r16 b1 (ran out)" "${hub[0]}" finetune_lora gemma-7b "${hub[@]:1}" --train.micro_batch_size 1 --lora_r 16 "${lora[@]}" "${every[@]}"
row "TinyLlama-1.1B full b4 (14.10)" "${hub[0]}" finetune_full tiny-llama-1.1b "${hub[@]:1}" --train.micro_batch_size 4
# The resource tables' LoRA rows: r8 on query and value at the longest Alpaca example, on an A100-40GB.
a100=A100-40GB
qv=(--lora_r 8 "${lora[@]}" --lora_query true --lora_value true)
row "Llama-2-7B LoRA r8 b1 (21.30)" $a100 finetune_lora Llama-2-7b-hf --train.max_seq_length 1304 --train.micro_batch_size 1 "${qv[@]}"
row "Llama-2-7B LoRA r8 b2 (29.07)" $a100 finetune_lora Llama-2-7b-hf --train.max_seq_length 1304 --train.micro_batch_size 2 "${qv[@]}"
row "Llama-2-7B LoRA r8 b4 (ran out)" $a100 finetune_lora Llama-2-7b-hf --train.max_seq_length 1304 --train.micro_batch_size 4 "${qv[@]}"
row "StableLM-3B LoRA r8 b1 (9.69)" $a100 finetune_lora stablelm-base-alpha-3b --train.max_seq_length 1034 --train.micro_batch_size 1 "${qv[@]}"
row "StableLM-3B LoRA r8 b2 (12.10)" $a100 finetune_lora stablelm-base-alpha-3b --train.max_seq_length 1034 --train.micro_batch_size 2 "${qv[@]}"
row "StableLM-3B LoRA r8 b4 (16.92)" $a100 finetune_lora stablelm-base-alpha-3b --train.max_seq_length 1034 --train.micro_batch_size 4 "${qv[@]}"
