#!/usr/bin/env bash
# Measures MoE capture on one GPU, from the repository root with the staged binary (bash benchmarks/gpu/stage.sh
# fills gpu-run/):   bash gpu-run/moe.sh
# Three models, each made on the device by transformers with random weights (benchmarks/gpu/moe_reference.py):
#   deepseek_v3      DeepSeek-V3 shapes cut to one GPU: hidden 7168, 128 MLA heads (q_lora 1536, kv_lora 512),
#                    256 experts of 2048 with 8 active (n_group 8, topk_group 4), 3 dense + 2 MoE layers, bf16
#   deepseek_v3 fp8  the same weights in DeepSeek's FP8 blocks (128 x 128, weight_scale_inv), quantized on the
#                    device; its reference is transformers on the dequantized weights
#   deepseek_v3 int4 the same weights with the routed experts in compressed-tensors pack-quantized INT4, groups of
#                    32 (Kimi-K2-Thinking / K2.5's layout), quantized on the device; reference as for FP8
#   qwen3_30b_a3b    Qwen3-30B-A3B shapes: 48 layers, 128 experts of 768 with 8 active, bf16
# and for each: transformers' prefill-only tokens/s (batch 8 x 2048; bf16 models only, the FP8
# model's reference is the same network), ours (debug prefill), our capture + write end to end (SAMPLES samples
# of 2048 tokens; every layer of DeepSeek's 5, Qwen3's layers 1, 23, 44, 47), the min per-token bf16 cosine against
# transformers, and MFU on active parameters. The table is printed at the end and kept in $OUT/moe_summary.txt.
#
# Needs one GPU with the memory of an H200 (141 GB) and ~64 GB of disk: each checkpoint (DeepSeek 53 GB,
# FP8 27 GB, Qwen3 61 GB) is deleted with its captured dataset before the next is written.
#
# Knobs: MODELS (the steps in order, default "ds ds8 qw"; ds4 is the INT4 step), MOE_KERNEL (our --moe-kernel:
# loop, grouped, or both as "loop grouped" for one prefill each, side by side, the capture running the last;
# unset, the binary's default), DEQUANT (our --dequant-kernel for the FP8/INT4 steps: fused, torch, or both as
# "torch fused", one prefill each after the MoE kernels', the capture running the last; unset, the binary's
# default), SAMPLES (default 32; SAMPLES_<step>, e.g. SAMPLES_ds8=160, for one step: a longer capture shows the
# steady state, where the first batches' warm-up no longer counts), CAPTURE_ALSO (more captures per step, ';'-separated,
# each "disk|shm [capture flags]", e.g. "shm;disk --writers 8": /dev/shm shows the writers without the disk; CAPTURE_ALSO_<step> for one step),
# LAYERS_<step> (the captured layers of one step's prefill and captures, e.g. LAYERS_ds=1,2,3,4: EAGLE-3's four
# points; default every layer of a short model, EAGLE-3's aux layers and the last of a long one),
# CAPTURE_DEST (disk or shm: where the main capture writes, default disk; shm when a long capture's states do not fit the
# disk beside the checkpoint: DeepSeek's bf16 53 GB leaves room for ~60 samples), ITERS
# (default 3), WORK (scratch, default /tmp/hslake-moe),
# DEVICE=cpu TINY=1 for a dry run of the whole flow at toy sizes on a CPU (no GPU, minutes).
set -uo pipefail
source "$(dirname "$0")/env.sh"
DEVICE=${DEVICE:-cuda}
W=${WORK:-/tmp/hslake-moe}
SAMPLES=${SAMPLES:-32}
ITERS=${ITERS:-3}
SEQ=2048
[ "${TINY:-0}" = 1 ] && { TINYFLAG=--tiny; SEQ=${SEQ_TINY:-64}; } || TINYFLAG=
ROWS=$OUT/moe_rows.jsonl
: > "$ROWS"
mkdir -p "$W"
T0=$(date +%s)
stage() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/moe_stages.txt"; }
bench() { python3 "$HERE/moe_reference.py" "$@" --rows "$ROWS" --device "$DEVICE" --seq "$SEQ" --samples "$SAMPLES" \
  --iters "$ITERS" $TINYFLAG; }
row() { python3 -c 'import json,sys; print(json.dumps(dict(model=sys.argv[1], what=sys.argv[2], **json.loads(sys.argv[3]))))' "$@" >> "$ROWS"; }
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
df -h "$W" | tee -a "$OUT/moe_stages.txt"

# ours MODEL_DIR LABEL STEP: our prefill and our capture of MODEL_DIR, its cosine against the reference
ours() {
  local m=$1 label=$2 step=$3
  local layers lvar=LAYERS_$step
  layers=${!lvar:-$(python3 "$HERE/moe_reference.py" layers "$m")}
  # One prefill per kernel named in MOE_KERNEL (side by side in this run); the capture uses the last. Quantized
  # steps with DEQUANT set run one prefill per dequantization kernel instead (with the last MoE kernel).
  local tps kernels=${MOE_KERNEL:-default} variants=() v
  local last=${kernels##* } capflag=
  [ "$last" != default ] && capflag="--moe-kernel $last"
  if [ -n "${DEQUANT:-}" ] && [ "$step" != ds ] && [ "$step" != qw ]; then
    for v in $DEQUANT; do variants+=("dequant $v|$capflag --dequant-kernel $v"); done
    capflag="$capflag --dequant-kernel ${DEQUANT##* }"
  else
    for v in $kernels; do
      if [ "$v" = default ]; then variants+=("default|"); else variants+=("$v|--moe-kernel $v"); fi
    done
  fi
  local tag flag file
  for v in "${variants[@]}"; do
    tag=${v%%|*} flag=${v#*|}
    file="moe_${step}_prefill_${tag// /_}.txt"
    [ "$tag" = default ] && tag= || tag=" ($tag)"
    stage "$label: our prefill$tag"
    "$BIN" debug prefill --model "$m" --batch 8 --seq "$SEQ" --iters "$ITERS" --layers "$layers" --device "$DEVICE" \
      --dtype bf16 $flag > "$OUT/$file" 2>&1
    tps=$(grep -oP 'prefill tokens/s \K[0-9]+' "$OUT/$file")
    if [ -n "$tps" ]; then
      row "$label" "ours prefill$tag" "{\"tokens_per_sec\": $tps, \"mfu\": $(python3 "$HERE/moe_reference.py" mfu "$step" "$tps" $TINYFLAG)}"
    else
      row "$label" "ours prefill$tag FAILED (see $file)" '{}'
    fi
  done
  local main_dest=$m-out
  [ "${CAPTURE_DEST:-disk}" = shm ] && main_dest=/dev/shm/hslake-capture
  capture "$m" "$main_dest" "$label" "$step" "$layers" "$capflag" ""
  # More captures of the same inputs, to tell the writers' limits from the disk's and the forward's.
  local extra i=0 where dest also=CAPTURE_ALSO_$step
  IFS=';' read -ra extra <<< "${!also:-${CAPTURE_ALSO:-}}"
  for v in "${extra[@]}"; do
    read -r where flag <<< "$v"
    i=$((i + 1))
    case $where in
    shm) dest=/dev/shm/hslake-capture ;;
    disk) dest=$m-out ;;
    *) echo "CAPTURE_ALSO: $where is neither disk nor shm" >&2; continue ;;
    esac
    capture "$m" "$dest" "$label" "${step}_also$i" "$layers" "$capflag $flag" " to $where${flag:+ $flag}"
  done
}

# capture MODEL_DIR DEST LABEL FILE_TAG LAYERS FLAGS WHERE: our capture + write, its rows, the cosine of what it wrote
capture() {
  local m=$1 dest=$2 label=$3 tag=$4 layers=$5 flags=$6 where=$7
  stage "$label: our capture + write of $SAMPLES x $SEQ tokens$where"
  rm -rf "$dest"
  local t=$(date +%s.%N)
  "$BIN" capture --model "$m" --input "$m.jsonl" --output "file://$dest" --layers "$layers" --device "$DEVICE" \
    --dtype bf16 --max-tokens-per-batch $((8 * SEQ)) $flags --no-progress \
    > "$OUT/moe_${tag}_capture.txt" 2>&1
  local rc=$? secs
  secs=$(python3 -c "import time; print(round(time.time() - $t, 1))")
  if [ $rc = 0 ]; then
    local ctps
    ctps=$(grep -oP '\([0-9]+ tokens, \K[0-9]+(?= tokens/s over)' "$OUT/moe_${tag}_capture.txt" | tail -1)
    row "$label" "ours capture + write$where (run, excl. load)" "{\"tokens_per_sec\": ${ctps:-0}}"
    row "$label" "ours capture$where wall clock incl. load" "{\"seconds\": $secs}"
    [ -z "$where" ] && bench cosine "$m" "$dest" "$label"
  else
    row "$label" "ours capture$where FAILED rc=$rc (see moe_${tag}_capture.txt)" '{}'
  fi
  rm -rf "$dest"
}

# A model's step: STEP KIND MODEL LABEL DESCRIPTION
model() {
  local step=$1 kind=$2 name=$3 label=$4
  local per_step=SAMPLES_$step
  local SAMPLES=${!per_step:-$SAMPLES}
  stage "$label: $5"
  bench "$kind" "$name" "$W/$step" 2>&1 | tail -12 | tee "$OUT/moe_${step}_make.txt"
  ours "$W/$step" "$label" "$step"
  rm -rf "$W/$step"
}

for m in ${MODELS:-ds ds8 qw}; do
  case $m in
  ds) model ds make deepseek_v3 deepseek_v3 "make, transformers prefill, reference states" ;;
  ds8) model ds8 fp8 deepseek_v3 "deepseek_v3 fp8" "quantize on the device, reference on the dequantized weights" ;;
  ds4) model ds4 int4 deepseek_v3 "deepseek_v3 int4" \
    "routed experts to INT4 (Kimi-K2's layout) on the device, reference on the dequantized weights" ;;
  qw) model qw make qwen3_30b_a3b qwen3_30b_a3b "make, transformers prefill, reference states" ;;
  *) echo "unknown model step $m (ds, ds8, ds4, qw)" >&2; exit 2 ;;
  esac
done

stage "done"
bench summary | tee "$OUT/moe_summary.txt"
