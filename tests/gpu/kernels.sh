#!/usr/bin/env bash
# Our kernel choices on one GPU, in one call (from the repository root, staged by benchmarks/gpu/stage.sh):
#   bash gpu-run/kernels.sh
# 1. `hslake debug kernels`: each fused kernel (SiLU-and-mul, RoPE, RMS norm and add + norm, the MoE routers,
#    alignment and un-permutation) against libtorch's path at Llama-3.1-8B, Qwen3-30B-A3B, DeepSeek-V3 and Kimi-K2
#    shapes (the same bits, or the stated floor for the norm and attention), and each attention choice against an
#    f32 attention; the time of each. Exits non-zero if one is not as promised.
# 2. Cuts of the models we compare with vLLM (Llama-3.1-8B and Qwen3-30B-A3B shapes, LAYERS layers; DeepSeek-V3's
#    with MODELS=".. ds": one dense and one MoE layer, 25 GB), random weights made by transformers; per model our
#    prefill (8 x 2048 tokens) with --profile-parts under the defaults (every fused kernel) and under libtorch's path
#    for all of them at once (TORCH), then its tokens/s under each single choice, and under the defaults at BATCHES sequences per batch (default "16 32":
#    what a larger --max-tokens-per-batch would give).
# 3. parity_bf16.py (every architecture, tiny, against transformers) under the defaults, every fused kernel (and with
#    each attention choice when PARITY_ATTENTION=1).
# The prefill table is printed at the end and kept in $OUT/kernels_summary.txt; logs in $OUT. About 8 minutes on an
# H100 (an estimate: it has not run yet).
# Knobs: STEPS (default "kernels models parity": which of the three run, e.g. to split them over two calls of at
# most 10 minutes), MODELS (default "llama qwen"), LAYERS (default 4), ITERS (default 5 prefill iterations),
# KERNEL_ITERS (default 10 timed runs per kernel), CHOICES (';'-separated flag sets timed one by one in step 2; default
# each kernel back on libtorch's path alone and both other attention choices; empty: none), BATCHES (empty: none), WORK (default /tmp/hslake-kernels). DEVICE=cpu TINY=1: a dry run of steps 2 and 3's plumbing on the CPU (step 1
# needs CUDA and is skipped; the CPU runs libtorch's path whatever the flags).
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEVICE=${DEVICE:-cuda}
W=${WORK:-/tmp/hslake-kernels}
ITERS=${ITERS:-5}
BATCH=8 SEQ=2048
TINYFLAG=
[ "${TINY:-0}" = 1 ] && { TINYFLAG=--tiny; BATCH=2; SEQ=32; }
# libtorch's path for every kernel that is fused by default (the reference the fused ones are checked against).
TORCH="--norm fast --activation torch --rope torch --moe-route torch"
mkdir -p "$W"
T0=$(date +%s)
stage() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/kernels_stages.txt"; }
SUMMARY=$OUT/kernels_summary.txt
: > "$SUMMARY"
rc=0
STEPS=${STEPS:-kernels models parity}
step() { [[ " $STEPS " == *" $1 "* ]]; }
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if [ "$DEVICE" = cuda ] && step kernels; then
  stage "debug kernels"
  "$BIN" debug kernels --iters "${KERNEL_ITERS:-10}" 2>&1 | tee "$OUT/kernels.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi

# prefill MODEL_DIR LABEL TAG FLAGS...: our prefill, its tokens/s into the summary
prefill() {
  local m=$1 label=$2 tag=$3
  shift 3
  local log="$OUT/kernels_${label}_${tag// /_}.txt"
  LAST_LOG=$log
  "$BIN" debug prefill --model "$m" --batch "${PB:-$BATCH}" --seq $SEQ --iters "$ITERS" --layers "$LAYER_OUT" \
    --device "$DEVICE" --dtype bf16 "$@" > "$log" 2>&1
  local tps
  tps=$(grep -oP 'prefill tokens/s \K[0-9]+' "$log")
  printf '%-22s %-58s %10s tokens/s\n' "$label" "$tag" "${tps:-FAILED}" | tee -a "$SUMMARY"
  [ -n "$tps" ] || rc=1
}

step models || MODELS=none
for s in ${MODELS:-llama qwen}; do
  [ "$s" = none ] && continue
  case $s in
  llama) name=llama8b ;;
  qwen) name=qwen3_30b_a3b ;;
  ds) name=deepseek_v3 ;;
  *) echo "unknown model $s (llama, qwen, ds)" >&2; exit 2 ;;
  esac
  n=${LAYERS:-4}
  [ "$s" = ds ] && n=2
  m=$W/$s
  label="$name-${n}l"
  stage "$label: make (transformers, random weights)"
  [ -f "$m/config.json" ] || python3 "$HERE/vllm_compare.py" make "$name" "$m" --num-layers "$n" --no-truth \
    --samples 1 --seq 16 --device "$DEVICE" $TINYFLAG 2>&1 | tail -2
  LAYER_OUT=$((n - 1))
  stage "$label: prefill, parts, defaults (fused) and libtorch's path"
  prefill "$m" "$label" "defaults" --profile-parts
  sed -n '/^section/,/(total)/p' "$LAST_LOG" | sed "s/^/  /" >> "$SUMMARY"
  # shellcheck disable=SC2086
  prefill "$m" "$label" "libtorch" $TORCH --profile-parts
  sed -n '/^section/,/(total)/p' "$LAST_LOG" | sed "s/^/  /" >> "$SUMMARY"
  stage "$label: prefill under each choice"
  CHOICES_DEFAULT="--norm fast;--activation torch;--rope torch;--moe-route torch;--attention cudnn;--attention flash"
  IFS=';' read -ra choices <<< "${CHOICES-$CHOICES_DEFAULT}"
  for flags in "${choices[@]}"; do
    [ "$s" = llama ] && [ "$flags" = "--moe-route torch" ] && continue
    # shellcheck disable=SC2086
    prefill "$m" "$label" "$flags" $flags
  done
  # Batch shape: the same forward over more sequences per batch (--max-tokens-per-batch's default is 16384).
  for pb in ${BATCHES-16 32}; do
    PB=$pb prefill "$m" "$label" "defaults, batch $pb x $SEQ"
  done
  rm -rf "$m" "$m.jsonl"
done

if step parity && [ "$DEVICE" = cuda ]; then
  sets=("")
  [ "${PARITY_ATTENTION:-0}" = 1 ] && sets+=("--attention cudnn" "--attention flash")
  for flags in "${sets[@]}"; do
    stage "parity against transformers: ${flags:-defaults}"
    # shellcheck disable=SC2086
    python3 "$HERE/parity_bf16.py" --bin "$BIN" --work "$W/parity" --runs 1:f32:batched -- $flags 2>&1 |
      tee "$OUT/kernels_parity_$(echo "${flags:-defaults}" | tr " " _).txt" | tail -12
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
stage done
cat "$SUMMARY"
exit $rc
