#!/usr/bin/env bash
# GPU checks for hslake capture, run on the H200 machine from the repository root with the
# release `hslake` binary (capture feature only) in gpu-run/ (see scripts/gpu/prepare.sh, which
# builds and stages it).
#   bash gpu-run/run.sh checks       NCCL one-rank check + bf16 parity vs transformers per architecture
#   bash gpu-run/run.sh throughput   Llama-3.1-8B shapes: HF baseline, our prefill, our capture+write
#   bash gpu-run/run.sh all          both, in one call
# Knobs: SAMPLES (2048-token samples, default 192), ITERS (prefill iterations, default 5),
# VARIANTS=0 skips the two diagnostic capture variants (malloc heap, memory://).
# Logs and results go to $OUT (or ./gpu-out).
set -uo pipefail
source "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)' | tee -a "$OUT/gpu.txt"

case "${1:-checks}" in
all)
  bash "$0" checks
  bash "$0" throughput
  ;;
checks)
  "$BIN" debug nccl-check 2>&1 | tee "$OUT/nccl.txt"
  python3 "$HERE/parity_bf16.py" --bin "$BIN" --work /tmp/hslake-parity 2>&1 | tee "$OUT/parity.txt"
  ;;
throughput)
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
  ;;
esac
