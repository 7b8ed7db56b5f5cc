#!/usr/bin/env bash
# LitGPT's config-hub memory table (config_hub/finetune/README.md of Lightning-AI/litgpt, measured in
# April 2024 on an A10G: 512 tokens, bf16-true, LoRA alpha 16 and dropout 0.05), each row run
# through LitGPT's own command (`python -m litgpt finetune_lora` / `finetune_full`) under
# `oomkit preflight`, from the model's config alone: each checkpoint folder holds the
# `model_config.yaml` LitGPT writes for the model and a small tokenizer, and no `lit_model.pth`
# (preflight keeps the model as LitGPT built it). The data are instruction rows longer than 512
# tokens, so every sample is cut to the table's 512. The capacity is the A10G's 23,028 MiB less
# its context. Needs litgpt 0.5 and jsonargparse importable, transformers' tokenizers.
# Usage: scripts/litgpt_config_hub.sh [WORKDIR]; prints one line per row. LITGPT_ROWS="gemma-2b
# gemma-7b" runs only the rows of those models (the test runs two).
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
for name in ("Llama-2-7b-hf", "Mistral-7B-v0.1", "Meta-Llama-3-8B", "gemma-2b", "gemma-7b", "tiny-llama-1.1b"):
    folder = Path(name)
    folder.mkdir(exist_ok=True)
    save_config(Config.from_name(name), folder)
    fast.save_pretrained(folder)
rows = [
    {"instruction": " ".join(words[(i * 3 + j) % 500] for j in range(300)), "input": "",
     "output": " ".join(words[(i * 7 + j) % 500] for j in range(400))}
    for i in range(40)
]
Path("data.json").write_text(json.dumps(rows))
PY
common=(--data JSON --data.json_path data.json --data.val_split_fraction 0.1 --train.max_steps 2
  --train.global_batch_size 8 --train.max_seq_length 512 --precision bf16-true --devices 1
  --eval.interval 1000 --eval.initial_validation false --eval.final_validation false)
lora=(--lora_alpha 16 --lora_dropout 0.05)
every=(--lora_query true --lora_key true --lora_value true --lora_projection true --lora_mlp true --lora_head true)
row() {
  local name=$1 command=$2 model=$3; shift 3
  if [ -n "${LITGPT_ROWS:-}" ] && [[ " $LITGPT_ROWS " != *" $model "* ]]; then return; fi
  local code=0
  # Exit 5: an answer, that the step does not fit.
  HF_HUB_OFFLINE=1 oomkit preflight --json --capacity 21748MiB -- python -m litgpt "$command" "$model" \
    "${common[@]}" --out_dir "out-$model" "$@" > row.json 2> "$model.err" || code=$?
  [ "$code" = 0 ] || [ "$code" = 5 ] || { echo "$name: no answer (see $work/$model.err)"; return; }
  python -c "import json,sys; r=json.load(open('row.json'))['run']; print('%-40s peak allocated %6.2f GB, fits: %s' % (sys.argv[1], r['peak_allocated_bytes']/1e9, r['fits']))" "$name"
}
row "Llama-2-7B LoRA r32 b2 (19.77)" finetune_lora Llama-2-7b-hf --train.micro_batch_size 2 --lora_r 32 "${lora[@]}"
row "Mistral-7B LoRA r32 b2 (20.66)" finetune_lora Mistral-7B-v0.1 --train.micro_batch_size 2 --lora_r 32 "${lora[@]}"
row "Llama-3-8B LoRA r32 b1 (19.73)" finetune_lora Meta-Llama-3-8B --train.micro_batch_size 1 --lora_r 32 "${lora[@]}"
row "Gemma-2B LoRA r16 b2 (12.62)" finetune_lora gemma-2b --train.micro_batch_size 2 --lora_r 8 "${lora[@]}" "${every[@]}"
row "Gemma-7B LoRA r16 b1 (ran out)" finetune_lora gemma-7b --train.micro_batch_size 1 --lora_r 16 "${lora[@]}" "${every[@]}"
row "TinyLlama-1.1B full b4 (14.10)" finetune_full tiny-llama-1.1b --train.micro_batch_size 4
