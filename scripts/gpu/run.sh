#!/usr/bin/env bash
# GPU checks for hslake capture, run on the H200 machine from the repository root with the
# release `gpu` example binary in gpu-run/ (see scripts/gpu/prepare.sh, which builds and stages it).
#   bash gpu-run/run.sh checks       NCCL one-rank check + bf16 parity vs transformers per architecture
#   bash gpu-run/run.sh throughput   Llama-3.1-8B shapes: HF baseline, our prefill, our capture+write
# Logs and results go to $OUT (or ./gpu-out).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SITE=$(python3 -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))')
CUDART=$(dirname "$(find "$SITE/nvidia" -name 'libcudart.so.13*' | head -1)")
# torch's own NVIDIA folders first: the system NCCL must not be the one loaded.
export LD_LIBRARY_PATH=$SITE/torch/lib:$SITE/nvidia/nccl/lib:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BIN=$HERE/gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)' | tee -a "$OUT/gpu.txt"

case "${1:-checks}" in
checks)
  "$BIN" nccl-check 2>&1 | tee "$OUT/nccl.txt"
  python3 "$HERE/parity_bf16.py" --bin "$BIN" --work /tmp/hslake-parity 2>&1 | tee "$OUT/parity.txt"
  ;;
throughput)
  W=/tmp/hslake-tp
  mkdir -p $W
  python3 "$HERE/make_llama8b.py" --out $W/llama8b --inputs $W/in.jsonl --samples ${SAMPLES:-192} --seq 2048 2>&1 | tail -3 | tee "$OUT/make.txt"
  python3 "$HERE/hf_baseline.py" --batch 8 --seq 2048 --capture 2,16,29,31 2>&1 | tee "$OUT/hf_baseline.txt"
  "$BIN" prefill --model $W/llama8b --batch 8 --seq 2048 --iters 5 --layers 2,16,29,31 2>&1 | tee "$OUT/ours_prefill.txt"
  rm -rf $W/ds
  "$BIN" capture --model $W/llama8b --input $W/in.jsonl --output file://$W/ds --layers 2,16,29,31 \
    --device cuda --dtype bf16 --max-tokens-per-batch 16384 --writers ${WRITERS:-8} --queue-depth 4 \
    --no-progress 2>&1 | tee "$OUT/ours_capture.txt"
  du -sb $W/ds | tee -a "$OUT/ours_capture.txt"
  ;;
esac
