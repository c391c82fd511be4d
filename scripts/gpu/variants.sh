#!/usr/bin/env bash
# Does a libtorch setting make our prefill (and HF's) faster on the H200? One device call:
# the Llama-3.1-8B-shaped model, HF's baseline and our prefill under each setting, then one
# end-to-end capture (+ verify) and the bf16 parity check under the fastest setting for us.
#   bash gpu-run/variants.sh          (staged by scripts/gpu/prepare.sh; results in $OUT)
set -uo pipefail
source "$(dirname "$0")/env.sh"
W=/tmp/hslake-tp
mkdir -p $W
python3 "$HERE/make_llama8b.py" --out $W/llama8b --inputs $W/in.jsonl --samples ${SAMPLES:-640} --seq 2048 2>&1 | tail -2 | tee "$OUT/make.txt"
declare -A SETTING=(
  [default]=""
  [cublaslt]="TORCH_BLAS_PREFER_CUBLASLT=1"
  [expandable]="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
  [cublaslt+expandable]="TORCH_BLAS_PREFER_CUBLASLT=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
best=default; best_tps=0
for name in default cublaslt expandable cublaslt+expandable; do
  echo "--- $name: ${SETTING[$name]}" | tee -a "$OUT/variants.txt"
  if [ "$name" = default ] || [ "$name" = cublaslt ]; then
    env ${SETTING[$name]} python3 "$HERE/hf_baseline.py" --batch 8 --seq 2048 --capture 2,16,29,31 2>&1 | grep prefill | sed "s/^/hf /" | tee -a "$OUT/variants.txt"
  fi
  tps=$(env ${SETTING[$name]} "$BIN" prefill --model $W/llama8b --batch 8 --seq 2048 --iters ${ITERS:-10} --layers 2,16,29,31 2>&1 | tee -a "$OUT/variants.txt" | awk '/prefill tokens/ {print $NF}')
  if [ "${tps:-0}" -gt "$best_tps" ]; then best=$name; best_tps=$tps; fi
done
echo "fastest for us: $best ($best_tps tokens/s)" | tee -a "$OUT/variants.txt"
rm -rf $W/ds
env ${SETTING[$best]} "$BIN" capture --model $W/llama8b --input $W/in.jsonl --output file://$W/ds --layers 2,16,29,31 \
  --device cuda --dtype bf16 --max-tokens-per-batch 16384 --queue-depth 4 --no-progress 2>&1 | tail -7 | tee "$OUT/ours_capture.txt"
"$BIN" verify file://$W/ds 2>&1 | tail -2 | tee -a "$OUT/ours_capture.txt"
env ${SETTING[$best]} python3 "$HERE/parity_bf16.py" --bin "$BIN" --work /tmp/hslake-parity 2>&1 | grep -v "it/s" | tee "$OUT/parity.txt"
