#!/usr/bin/env bash
# Measures which setting makes our prefill fastest, side by side with transformers' prefill:
# the Llama-3.1-8B-shaped model, transformers' prefill under each libtorch environment tried,
# our prefill under each setting, then one end-to-end capture (+ verify) and the bf16 parity
# check (tests/gpu/parity_bf16.py) under the fastest setting and under the default.
#   NAMES="exact-norm fast-norm" bash gpu-run/variants.sh     (staged by benchmarks/gpu/stage.sh)
# Knobs: SAMPLES, ITERS, PARITY (settings whose parity is checked besides the fastest;
# default "default"), VERIFY=0 skips the verify of the captured dataset.
# Needs one CUDA GPU, torch and transformers.
set -uo pipefail
source "$(dirname "$0")/env.sh"
W=/tmp/hslake-tp
mkdir -p $W
python3 "$HERE/make_llama8b.py" --out $W/llama8b --inputs $W/in.jsonl --samples ${SAMPLES:-640} --seq 2048 2>&1 | tail -2 | tee "$OUT/make.txt"
declare -A ENVS=(
  [exact-norm]=""
  [fast-norm]=""
  [default]=""
  [cublaslt]="TORCH_BLAS_PREFER_CUBLASLT=1"
  [expandable]="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
declare -A FLAGS=(
  [exact-norm]="--norm exact"
  [fast-norm]="--norm fast"
  [default]=""
  [cublaslt]="--norm exact"
  [expandable]="--norm exact"
)
best=default; best_tps=0
declare -A HF_DONE=()
for name in ${NAMES:-default cublaslt expandable}; do
  echo "--- $name: ${ENVS[$name]} ${FLAGS[$name]}" | tee -a "$OUT/variants.txt"
  if [ -z "${HF_DONE["env:${ENVS[$name]}"]+x}" ]; then
    env ${ENVS[$name]} python3 "$HERE/hf_baseline.py" --batch 8 --seq 2048 --capture 2,16,29,31 2>&1 | grep prefill | sed "s/^/hf /" | tee -a "$OUT/variants.txt"
    HF_DONE["env:${ENVS[$name]}"]=1
  fi
  tps=$(env ${ENVS[$name]} "$BIN" debug prefill --model $W/llama8b --batch 8 --seq 2048 --iters ${ITERS:-10} --layers 2,16,29,31 ${FLAGS[$name]} 2>&1 | tee -a "$OUT/variants.txt" | awk '/prefill tokens/ {print $NF}')
  if [ "${tps:-0}" -gt "$best_tps" ]; then best=$name; best_tps=$tps; fi
done
echo "fastest for us: $best ($best_tps tokens/s)" | tee -a "$OUT/variants.txt"
rm -rf $W/ds
env ${ENVS[$best]} "$BIN" capture --model $W/llama8b --input $W/in.jsonl --output file://$W/ds --layers 2,16,29,31 \
  --device cuda --dtype bf16 --max-tokens-per-batch 16384 --queue-depth 4 --no-progress ${FLAGS[$best]} 2>&1 | tail -7 | tee "$OUT/ours_capture.txt"
[ "${VERIFY:-1}" = 0 ] || "$BIN" verify file://$W/ds 2>&1 | tail -2 | tee -a "$OUT/ours_capture.txt"
for name in $(printf '%s\n' ${PARITY-default} "$best" | sort -u); do
  echo "--- parity under $name" | tee -a "$OUT/parity.txt"
  env ${ENVS[$name]} python3 "$HERE/parity_bf16.py" --bin "$BIN" --work /tmp/hslake-parity -- ${FLAGS[$name]} 2>&1 | grep -v "it/s" | tee -a "$OUT/parity.txt"
done
