#!/bin/bash
# A hub model's fine-tune from its config alone, side by side with what a user would otherwise run:
# accelerate's sizes (what `accelerate estimate-memory` reports, which needs the hub itself) and
# PyTorch's MemTracker (one step under FakeTensorMode, its way without a GPU). Wall time and peak
# resident set of each whole command. The configs are Llama 3.1 8B's and 70B's shapes, in folders
# holding config.json alone. Usage: bash scripts/bench_from_config.sh [python]
set -euo pipefail
py=${1:-python}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/llama-8b" "$work/llama-70b"
cat > "$work/llama-8b/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false,
 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
 "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}
JSON
sed -e 's/"hidden_size": 4096/"hidden_size": 8192/' -e 's/"intermediate_size": 14336/"intermediate_size": 28672/' \
    -e 's/"num_attention_heads": 32/"num_attention_heads": 64/' -e 's/"num_hidden_layers": 32/"num_hidden_layers": 80/' \
    "$work/llama-8b/config.json" > "$work/llama-70b/config.json"
# Each command's wall time and peak resident set, said after its own output.
timed() { /usr/bin/time -o "$work/time" -f "  wall %e s, peak RSS %M KB" "$@"; }
# The answer alone: a capacity the step fits (a run that does not fit goes on to measure its fixes).
peaks='import json,sys; r=json.load(sys.stdin)["run"]; print("  peak allocated %.2f GiB, reserved %.2f GiB" % (r["peak_allocated_bytes"]/2**30, r["peak_reserved_bytes"]/2**30))'
for size in 8b 70b; do
  m="$work/llama-$size"
  echo "== Llama 3.1 ${size^^} shape, 1 x 2,048 tokens"
  if [ "$size" = 8b ]; then
    echo "-- oomkit preflight, full fine-tune (bf16, checkpointed, fused AdamW)"
    timed oomkit preflight --json --capacity 1024GiB -- "$py" "$here/from_config/finetune.py" "$m" full 2048 > "$work/out" 2>/dev/null
    "$py" -c "$peaks" < "$work/out"; cat "$work/time"
  fi
  echo "-- oomkit preflight, QLoRA (NF4, double quantization, LoRA r16)"
  timed oomkit preflight --json --capacity 1024GiB -- "$py" "$here/from_config/finetune.py" "$m" qlora 2048 > "$work/out" 2>/dev/null
  "$py" -c "$peaks" < "$work/out"; cat "$work/time"
  echo "-- accelerate's sizes (estimate-memory's numbers)"
  timed "$py" "$here/from_config/accelerate_sizes.py" "$m"; cat "$work/time"
  if [ "$size" = 8b ]; then
    echo "-- PyTorch MemTracker, the full fine-tune under FakeTensorMode (CPU kernels)"
    timed "$py" "$here/from_config/memtracker_step.py" "$m" 2048 2>/dev/null; cat "$work/time"
  fi
done
