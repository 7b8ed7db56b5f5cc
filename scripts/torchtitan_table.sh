#!/usr/bin/env bash
# torchtitan's published Llama 3.1 memory (benchmarks/llama3_h100_202412_torchtitan.md: H100s of
# 96 GB, sequences of 8,192 tokens, "Memory" the peak reserved), each row run through torchtitan
# 0.3.0's own trainer (`python -m torchtitan.train`) under `oomkit preflight --gpus N`, as rank 0.
# torchtitan 0.3.0 computes the loss in chunks of the sequence; the benchmark (December 2024)
# computed it over the whole vocabulary at once, so each row runs a config of this script's own
# (a module of three functions, written below) that takes torchtitan's and sets that loss.
# The rows with Float8 in the table run without it (torchtitan's float8 converter imports torchao's
# MoE Triton kernels, which no torchao in the registry defines under this PyTorch's Triton), and
# without the CUDA graphs 0.3.0 adds by default (the table's torchtitan had none).
# Stand-ins for the downloads: a word-level tokenizer and generated text, in the folders torchtitan's
# `c4_test` data set names. Needs torchtitan 0.3.0 importable (scripts/test.sh installs it into
# .venv/torchtitan-site: PYTHONPATH=.venv/torchtitan-site) and the tokenizers package.
# Usage: scripts/torchtitan_table.sh [WORKDIR]; prints one line per row.
set -euo pipefail
work=${1:-$(mktemp -d)}
mkdir -p "$work/tests/assets/tokenizer" "$work/tests/assets/c4_test" "$work/cfg"
python - "$work" <<'PY'
import json, random, sys
from tokenizers import Tokenizer, models, pre_tokenizers
work = sys.argv[1]
words = ("memory", "batch", "layer", "token", "gpu", "step", "model", "train", "data", "of", "the", "attention")
vocab = {w: i for i, w in enumerate(("<unk>", "<|begin_of_text|>", "<|end_of_text|>", *words))}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(f"{work}/tests/assets/tokenizer/tokenizer.json")
json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, open(f"{work}/tests/assets/tokenizer/tokenizer_config.json", "w"))
rng = random.Random(0)
with open(f"{work}/tests/assets/c4_test/data.json", "w") as f:
    for _ in range(256):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(9000))}) + "\n")
PY
cat > "$work/cfg/whole_vocabulary.py" <<'PY'
"""torchtitan 0.3.0's Llama 3.1 configs with the loss over the whole vocabulary at once, as the
December 2024 benchmark computed it (0.3.0 computes it in chunks of the sequence)."""
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import config_registry, model_registry


def _whole(config):
    config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    return config


def llama3_8b():
    return _whole(config_registry.llama3_8b())


def llama3_70b():
    return _whole(config_registry.llama3_70b())


def llama3_405b():
    # torchtitan's 405B config builds Float8's converter (torchao) as it is made: the 70B's layout
    # (tensor parallelism over 8, full activation checkpointing, eager) with the 405B model instead.
    config = config_registry.llama3_70b()
    config.model_spec = model_registry("405B")
    return _whole(config)
PY
row() {
  local name=$1 gpus=$2 config=$3; shift 3
  (cd "$work" && PYTHONPATH="$work/cfg:${PYTHONPATH:-}" HF_DATASETS_OFFLINE=1 oomkit preflight --json --gpus "$gpus" --capacity 96GiB \
    --time-limit 900 -- python -m torchtitan.train --module whole_vocabulary --config "$config" --training.steps 2 \
    --training.disable_cuda_graphs --hf_assets_path ./tests/assets/tokenizer --dataloader.dataset c4_test \
    --profiler.no-enable-profiling --metrics.no-enable-tensorboard "$@" > "$work/row.json" 2> "$work/row.err") \
    || { echo "$name: no answer (see $work/row.err)"; return; }
  python -c "import json,sys; r=json.load(open(sys.argv[1]))['run']; G=2**30; print('%-44s peak reserved %6.2f GiB, allocated %6.2f GiB' % (sys.argv[2], r['peak_reserved_bytes']/G, r['peak_allocated_bytes']/G))" "$work/row.json" "$name"
}
row "8B, FSDP 8, eager (82.4)" 8 llama3_8b --training.local_batch_size 2
row "8B, FSDP 8, blocks compiled (77.0)" 8 llama3_8b --training.local_batch_size 2 --compile.enable --compile.components model
row "70B, FSDP 32 x TP 8 (71.9)" 256 llama3_70b --training.local_batch_size 16
row "405B, FSDP 8 x TP 8 x PP 8, 1F1B (82.5)" 512 llama3_405b --training.local_batch_size 32 \
  --parallelism.pipeline_parallel_degree 8 --parallelism.pipeline_parallel_schedule 1F1B
row "405B, the same, interleaved 1F1B (72.7)" 512 llama3_405b --training.local_batch_size 32 \
  --parallelism.pipeline_parallel_degree 8 --parallelism.pipeline_parallel_schedule Interleaved1F1B
