#!/usr/bin/env bash
# Runs, on one GPU, the Llama-3.1-8B-shaped model (random bf16 weights, made by make_llama8b.py):
# transformers' reference (hf_baseline.py), our prefill alone, and our capture + write + verify
# end to end, then the same capture with large allocations kept on the malloc heap, on disk and
# in memory://, to show where the writer side spends its time.
#   bash gpu-run/llama8b.sh       (from the repository root, staged by benchmarks/gpu/stage.sh)
# Knobs: SAMPLES (2048-token samples, default 192), ITERS (prefill iterations, default 5),
# VARIANTS=0 skips the two malloc-heap variants. Logs and results go to $OUT (or ./gpu-out).
# Needs one CUDA GPU that holds the 8B model in bf16 with batches of 8 x 2048 tokens (an H200),
# torch and transformers.
set -uo pipefail
source "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)' | tee -a "$OUT/gpu.txt"

W=/tmp/hslake-tp
mkdir -p $W
python3 "$HERE/make_llama8b.py" --out $W/llama8b --inputs $W/in.jsonl --samples ${SAMPLES:-192} --seq 2048 2>&1 | tail -3 | tee "$OUT/make.txt"
python3 "$HERE/hf_baseline.py" --batch 8 --seq 2048 --capture 2,16,29,31 2>&1 | tee "$OUT/hf_baseline.txt"
"$BIN" debug prefill --model $W/llama8b --batch 8 --seq 2048 --iters ${ITERS:-5} --layers 2,16,29,31 2>&1 | tee "$OUT/ours_prefill.txt"
rm -rf $W/ds
"$BIN" capture --model $W/llama8b --input $W/in.jsonl --output file://$W/ds --layers 2,16,29,31 \
  --device cuda --dtype bf16 --max-tokens-per-batch 16384 --queue-depth 4 \
  --no-progress 2>&1 | tee "$OUT/ours_capture.txt"
du -sb $W/ds | tee -a "$OUT/ours_capture.txt"
"$BIN" verify file://$W/ds 2>&1 | tail -3 | tee -a "$OUT/ours_capture.txt"
[ "${VARIANTS:-1}" = 0 ] && exit 0
# Where does the writer side spend its time? Same run with large allocations kept on the
# malloc heap (no page faults per sample), then also without the disk (memory:// dataset).
rm -rf $W/ds
echo "--- variant: GLIBC_TUNABLES mmap_threshold=32MiB, file://" | tee -a "$OUT/ours_capture.txt"
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296 \
"$BIN" capture --model $W/llama8b --input $W/in.jsonl --output file://$W/ds --layers 2,16,29,31 \
  --device cuda --dtype bf16 --max-tokens-per-batch 16384 --queue-depth 4 --no-progress 2>&1 | tail -6 | tee -a "$OUT/ours_capture.txt"
rm -rf $W/ds
echo "--- variant: GLIBC_TUNABLES, memory://" | tee -a "$OUT/ours_capture.txt"
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296 \
"$BIN" capture --model $W/llama8b --input $W/in.jsonl --output memory://bench --layers 2,16,29,31 \
  --device cuda --dtype bf16 --max-tokens-per-batch 16384 --queue-depth 4 --no-progress 2>&1 | tail -6 | tee -a "$OUT/ours_capture.txt"
