#!/usr/bin/env bash
# Measures layer-streamed capture against resident capture of the same model and inputs, on one GPU.
# Run from the repository root with the staged binary (bash benchmarks/gpu/stage.sh fills gpu-run/):
#   STEPS="kimi" bash gpu-run/stream.sh        STEPS="qwen" bash gpu-run/stream.sh
# Steps (each makes its model, measures, and deletes it, as the disk holds one at a time):
#   kimi  Kimi-K2 shapes (kimi_shapes.py: INT4 routed experts, 1 dense + as many MoE layers as the disk holds):
#         our resident and our streamed forward (debug prefill: seconds per layer, copy rate, share of the copy
#         hidden), then a resident and a streamed capture of the same samples
#         (KIMI_LAYERS, default 1,3,5: three points), each timed with its load; the streamed passes' log lines
#         (tokens, copy GB/s, compute, share of the copy hidden, first sample); the two datasets compared.
#   qwen  Qwen3-30B-A3B in bf16 (moe_reference.py make: transformers' prefill and reference states): a resident
#         capture with the whole GPU, then one under --gpu-memory ${QWEN_BUDGET:-24GiB} with no --placement (auto
#         streams, as the model does not fit); compared with each other and with transformers.
# Knobs: STEPS, SAMPLES (default 128 per step), SEQ (2048), PASS_TOKENS (streamed pass size; default the binary's),
# DEVICE=cpu TINY=1 for a dry run of the flow at toy sizes on a CPU.
# Needs: torch, transformers, safetensors, pyarrow on the GPU machine; ~55 GB of disk and ~70 GB of RAM per step.
# Writes: $OUT/stream_*.txt (each command's output), $OUT/stream_rows.jsonl and $OUT/stream_summary.txt.
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEVICE=${DEVICE:-cuda}
W=${WORK:-/tmp/hslake-stream}
SAMPLES=${SAMPLES:-128}
SEQ=${SEQ:-2048}
SHM=${SHM:-/dev/shm/hslake-stream}
[ "${TINY:-0}" = 1 ] && { TINYFLAG=--tiny; SEQ=${SEQ_TINY:-64}; SAMPLES=${SAMPLES_TINY:-8}; } || TINYFLAG=
BATCH_TOKENS=$((8 * SEQ))
ROWS=$OUT/stream_rows.jsonl
: > "$ROWS"
mkdir -p "$W" "$SHM"
T0=$(date +%s)
stage() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/stream_stages.txt"; }
row() { python3 -c 'import json,sys; print(json.dumps(dict(step=sys.argv[1], what=sys.argv[2], **json.loads(sys.argv[3]))))' "$@" >> "$ROWS"; }
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
df -h "$W" "$SHM" | tee -a "$OUT/stream_stages.txt"
free -g | tee -a "$OUT/stream_stages.txt"

# capture STEP TAG MODEL LAYERS FLAGS...: one capture of MODEL's inputs into $SHM/TAG, timed with its load; a row
# with its wall time, tokens/s, and the time to its first committed version (the first samples out).
capture() {
  local step=$1 tag=$2 m=$3 layers=$4
  shift 4
  local dest=$SHM/$step-$tag log=$OUT/stream_${step}_${tag}.txt
  rm -rf "$dest"
  stage "$step: capture $tag $*"
  local t=$(date +%s.%N)
  "$BIN" capture --model "$m" --input "$m.jsonl" --output "file://$dest" --layers "$layers" --device "$DEVICE" \
    --dtype bf16 --max-tokens-per-batch "$BATCH_TOKENS" --commit-every 32 --no-progress "$@" > "$log" 2>&1 &
  local pid=$! first=
  # The first committed version (beyond the empty version 0) marks the first samples stored.
  while kill -0 $pid 2>/dev/null; do
    if [ -z "$first" ] && [ "$(ls "$dest/_hslake/versions" 2>/dev/null | wc -l)" -ge 2 ]; then
      first=$(python3 -c "import time; print(round(time.time() - $t, 1))")
    fi
    sleep 0.2
  done
  wait $pid
  local rc=$? secs
  secs=$(python3 -c "import time; print(round(time.time() - $t, 1))")
  tail -4 "$log"
  if [ $rc = 0 ]; then
    local tokens=$((SAMPLES * SEQ))
    row "$step" "capture $tag" "{\"seconds_with_load\": $secs, \"first_version_seconds\": ${first:-null}, \"tokens_per_sec_with_load\": $(python3 -c "print(round($tokens / $secs))")}"
    # The streamed passes, as logged.
    grep -oP 'stream \d+ pass: .*' "$log" | tee "$OUT/stream_${step}_${tag}_passes.txt" | tail -3
    grep -P 'placement|streaming through|captured|load' "$log" | head -8
  else
    row "$step" "capture $tag FAILED (see $(basename "$log"))" '{}'
  fi
}

# compare STEP: the streamed dataset against the resident one (first 16 samples: bit-identical or the min cosine)
compare() {
  stage "$1: streamed vs resident"
  python3 "$HERE/compare_tp.py" "$SHM/$1-resident" "stream=$SHM/$1-stream" --samples 16 --min-cosine 0.99999 \
    2>&1 | tee "$OUT/stream_$1_compare.txt"
}

kimi() {
  local m=$W/kimi layers=${KIMI_LAYERS:-1,3,5}
  stage "kimi: make"
  python3 "$HERE/kimi_shapes.py" "$m" --samples "$SAMPLES" --seq "$SEQ" --device "$DEVICE" $TINYFLAG \
    2>&1 | tail -3 | tee "$OUT/stream_kimi_make.txt"
  local n
  n=$(python3 -c "import json; print(json.load(open('$m/config.json'))['num_hidden_layers'])")
  layers=$(python3 -c "print(','.join(l for l in '$layers'.split(',') if int(l) < $n))")
  stage "kimi: our resident forward (debug prefill, layers $layers)"
  "$BIN" debug prefill --model "$m" --batch 8 --seq "$SEQ" --iters 3 --layers "$layers" --device "$DEVICE" \
    --dtype bf16 > "$OUT/stream_kimi_prefill.txt" 2>&1
  tail -2 "$OUT/stream_kimi_prefill.txt"
  stage "kimi: our streamed forward (debug prefill --placement stream)"
  "$BIN" debug prefill --model "$m" --batch 8 --seq "$SEQ" --iters 3 --layers "$layers" --device "$DEVICE" \
    --dtype bf16 --placement stream ${PASS_TOKENS:+--pass-tokens $PASS_TOKENS} > "$OUT/stream_kimi_prefill_stream.txt" 2>&1
  tail -3 "$OUT/stream_kimi_prefill_stream.txt"
  capture kimi resident "$m" "$layers" --placement resident
  capture kimi stream "$m" "$layers" --placement stream \
    ${PASS_TOKENS:+--pass-tokens $PASS_TOKENS}
  compare kimi
  rm -rf "$m" "$SHM"/kimi-*
}

qwen() {
  local m=$W/qwen layers=${QWEN_LAYERS:-1,23,44,47}
  stage "qwen: make (transformers prefill, reference states)"
  python3 "$HERE/moe_reference.py" make qwen3_30b_a3b "$m" --rows "$ROWS" --device "$DEVICE" --seq "$SEQ" \
    --samples "$SAMPLES" --iters 3 --layers "$layers" $TINYFLAG 2>&1 | tail -3 | tee "$OUT/stream_qwen_make.txt"
  [ "${TINY:-0}" = 1 ] && layers=$(python3 "$HERE/moe_reference.py" layers "$m")
  capture qwen resident "$m" "$layers" --placement resident
  # No --placement: auto streams because the model does not fit the budget.
  capture qwen stream "$m" "$layers" --gpu-memory "${QWEN_BUDGET:-24GiB}" \
    ${PASS_TOKENS:+--pass-tokens $PASS_TOKENS}
  compare qwen
  stage "qwen: streamed vs transformers"
  python3 "$HERE/moe_reference.py" cosine "$m" "$SHM/qwen-stream" "qwen3_30b_a3b stream" --rows "$ROWS" \
    2>&1 | tail -3 | tee "$OUT/stream_qwen_cosine.txt"
  rm -rf "$m" "$m.jsonl" "$m.ref.npz" "$SHM"/qwen-*
}

for s in ${STEPS:-kimi qwen}; do
  case $s in
  kimi) kimi ;;
  qwen) qwen ;;
  *) echo "unknown step $s (kimi, qwen)" >&2; exit 2 ;;
  esac
done
stage "done"
python3 -c '
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r.pop("step", r.get("model", "")), r.pop("what"), json.dumps(r))' "$ROWS" | tee "$OUT/stream_summary.txt"
