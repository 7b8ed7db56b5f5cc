#!/bin/sh
# A stand-in for a training script, for the `oomkit find-batch` example of
# docs/commands.md, so that the search can be seen without a GPU: its peak is
# 20 GiB + 600 MiB per sample of the micro-batch given as $1, which it
# reports where oomkit asks (the file named by OOMKIT_PROBE_FILE, as oomkit's
# tracker does), and above 80 GiB it fails with PyTorch's OOM message.
batch=$1
peak=$(( (20 * 1024 + 600 * batch) * 1048576 ))
if [ "$peak" -gt $(( 80 * 1073741824 )) ]; then
  echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 600.00 MiB" >&2
  exit 1
fi
if [ -n "$OOMKIT_PROBE_FILE" ]; then
  echo "{\"peak_bytes\": $peak}" > "$OOMKIT_PROBE_FILE"
fi
