#!/usr/bin/env bash
# Runs every multi-GPU measurement of hslake capture, from the repository root with the staged
# binary (benchmarks/gpu/stage.sh fills gpu-run/):   bash gpu-run/multi_gpu.sh N
# N = GPUs to use (2, 4 or 8).
#   1. parity vs transformers (tests/gpu/parity_bf16.py; tiny models, five architectures): TP 1,
#      TP N with the f32 and the bf16 reduction
#   2. Llama-3.1-8B shapes: TP N vs TP 1 over 16 samples x 4 layers, both reductions
#      (tests/gpu/compare_tp.py)
#   3. throughput: transformers (hf_baseline.py, one GPU), our forward alone (debug prefill) at
#      TP 1 and TP N, a profile of TP N (compute / all-reduce / copy-out per rank), and capture end
#      to end (file:// dataset) over BATCHES batches of 8 x 2048 tokens at TP 1 and TP N, both
#      reductions
# Knobs: BATCHES (default 80), WORK (scratch, default /tmp/hslake-mgpu), SKIP_PARITY=1, SKIP_8B=1,
# SKIP_THROUGHPUT=1.
# Logs go to $OUT (or ./gpu-out); the summary table is printed at the end and kept in $OUT/summary.txt.
# Needs N CUDA GPUs of one host with NCCL, torch and transformers; about 10 minutes on 2 x H200.
set -uo pipefail
N=${1:?usage: multi_gpu.sh N (number of GPUs)}
# NVLink multicast (NVLS) stays off on these machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/env.sh"
W=${WORK:-/tmp/hslake-mgpu}
BATCHES=${BATCHES:-80}
LAYERS=2,16,29,31
mkdir -p "$W"
S=$OUT/summary.txt
: > "$S"
T0=$(date +%s)
stage() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/stages.txt"; }
row() { echo "$*" >> "$S"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)' | tee -a "$OUT/gpu.txt"
row "multi_gpu.sh $N on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)"

if [ "${SKIP_PARITY:-0}" != 1 ]; then
  stage "parity vs transformers: TP 1, TP $N f32, TP $N bf16"
  python3 "$HERE/parity_bf16.py" --bin "$BIN" --work "$W/parity" --runs 1 "$N:f32" "$N:bf16:batched" 2>&1 | tee "$OUT/parity.txt"
  row ""
  row "## parity vs transformers (bf16, tiny models; bound 0.9999)"
  grep -E "vs transformers|skipped|failed|^parity" "$OUT/parity.txt" | sed 's/^/  /' >> "$S"
fi

stage "Llama-3.1-8B shapes: model and $((BATCHES * 8)) samples"
python3 "$HERE/make_llama8b.py" --out "$W/llama8b" --inputs "$W/in.jsonl" --samples $((BATCHES * 8)) --seq 2048 2>&1 | tail -3 | tee "$OUT/make.txt"
head -16 "$W/in.jsonl" > "$W/in16.jsonl"
M=$W/llama8b
capture() { # capture OUTPUT INPUT FLAGS...: one capture of the 8B model on cuda in $DTYPE (bf16)
  local out=$1 in=$2; shift 2
  "$BIN" capture --model "$M" --input "$in" --output "$out" --layers $LAYERS --device cuda --dtype "${DTYPE:-bf16}" \
    --max-tokens-per-batch 16384 --queue-depth 4 --no-progress "$@"
}

if [ "${SKIP_8B:-0}" != 1 ]; then
  stage "8B: TP $N vs TP 1 over 16 samples x 4 layers"
  rm -rf "$W/cmp1" "$W/cmpf32" "$W/cmpbf16" "$W/cmptruth"
  # The truth every bf16 run approximates: the same weights computed in f32 at TP 1 (hslake's
  # f32 capture equals transformers' f32 forward to 1e-5 relative, tests/python).
  DTYPE=f32 capture "file://$W/cmptruth" "$W/in16.jsonl" --tp 1 > "$OUT/cmp_truth.txt" 2>&1
  capture "file://$W/cmp1" "$W/in16.jsonl" --tp 1 > "$OUT/cmp_tp1.txt" 2>&1
  capture "file://$W/cmpf32" "$W/in16.jsonl" --tp "$N" --tp-reduce f32 > "$OUT/cmp_f32.txt" 2>&1
  capture "file://$W/cmpbf16" "$W/in16.jsonl" --tp "$N" --tp-reduce bf16 > "$OUT/cmp_bf16.txt" 2>&1
  python3 "$HERE/compare_tp.py" "$W/cmp1" "TP$N-f32=$W/cmpf32" "TP$N-bf16=$W/cmpbf16" 2>&1 | tee "$OUT/compare_8b.txt"
  python3 "$HERE/compare_tp.py" "$W/cmptruth" "TP1=$W/cmp1" "TP$N-f32=$W/cmpf32" "TP$N-bf16=$W/cmpbf16" \
    --min-cosine 0 2>&1 | tee "$OUT/compare_8b_truth.txt"
  rm -rf "$W/cmp1" "$W/cmpf32" "$W/cmpbf16" "$W/cmptruth"
  row ""
  row "## 8B shapes, TP $N vs TP 1 (16 samples x layers $LAYERS; bound 0.9999 for f32)"
  sed 's/^/  /' "$OUT/compare_8b.txt" >> "$S"
  row "## 8B shapes, each bf16 run vs the f32 truth (the noise floor: TP 1 is as far from it as transformers)"
  sed 's/^/  /' "$OUT/compare_8b_truth.txt" >> "$S"
fi
if [ "${SKIP_THROUGHPUT:-0}" = 1 ]; then
  stage "done (SKIP_THROUGHPUT=1)"; echo; cat "$S"; exit 0
fi

stage "throughput: transformers on one GPU"
python3 "$HERE/hf_baseline.py" --batch 8 --seq 2048 --capture $LAYERS 2>&1 | tee "$OUT/hf_baseline.txt"
row ""
row "## throughput, Llama-3.1-8B shapes, bf16, 8 x 2048 tokens a batch"
grep -E "tokens/s" "$OUT/hf_baseline.txt" | sed 's/^/  transformers TP 1 /' >> "$S"

stage "throughput: our forward alone, and a profile of TP $N"
prefill() { "$BIN" debug prefill --model "$M" --batch 8 --seq 2048 --layers $LAYERS "$@"; }
prefill --iters 10 --tp 1 > "$OUT/prefill_tp1.txt" 2>&1
prefill --iters 10 --tp "$N" --tp-reduce f32 > "$OUT/prefill_f32.txt" 2>&1
prefill --iters 10 --tp "$N" --tp-reduce bf16 > "$OUT/prefill_bf16.txt" 2>&1
prefill --iters 3 --tp "$N" --tp-reduce f32 --profile > "$OUT/profile_f32.txt" 2>&1
prefill --iters 3 --tp "$N" --tp-reduce bf16 --profile > "$OUT/profile_bf16.txt" 2>&1
for f in prefill_tp1 prefill_f32 prefill_bf16; do
  echo "  $f: $(grep -h 'tokens/s' "$OUT/$f.txt" || tail -1 "$OUT/$f.txt")" >> "$S"
done
for f in profile_f32 profile_bf16; do
  echo "  $f:" >> "$S"
  grep -hE "^rank|tokens/s|rror" "$OUT/$f.txt" | sed 's/^/    /' >> "$S"
done

stage "throughput: capture end to end, $BATCHES batches"
e2e() { # e2e NAME FLAGS...
  local name=$1; shift
  rm -rf "$W/ds"
  capture "file://$W/ds" "$W/in.jsonl" "$@" > "$OUT/e2e_$name.txt" 2>&1
  rm -rf "$W/ds"
  echo "  e2e $name: $(grep -hE 'samples written|rror' "$OUT/e2e_$name.txt" | head -1 | sed 's/^ *//')" >> "$S"
  grep -h "time  " "$OUT/e2e_$name.txt" | sed 's/^ */      /' >> "$S"
}
e2e tp1 --tp 1
e2e "tp$N-f32" --tp "$N" --tp-reduce f32
e2e "tp$N-bf16" --tp "$N" --tp-reduce bf16
# "ours prefill tokens/s 123" (debug prefill) or "(... tokens, 123 tokens/s over ...)" (capture's
# summary; its progress lines also say "tokens/s" but count from the first batch, so not those).
rate() { grep -hoE 'prefill tokens/s [0-9]+|[0-9]+ tokens/s over' "$OUT/$1.txt" | head -1 | grep -oE '[0-9]+' | head -1; }
ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(b) / float(a):.2f}x' if a and b else 'n/a')" "$(rate "$1")" "$(rate "$2")"; }
row ""
row "## TP $N / TP 1 (bound for end to end: 1.8x)"
row "  forward alone: f32 $(ratio prefill_tp1 prefill_f32), bf16 $(ratio prefill_tp1 prefill_bf16)"
row "  end to end:    f32 $(ratio e2e_tp1 "e2e_tp$N-f32"), bf16 $(ratio e2e_tp1 "e2e_tp$N-bf16")"
stage "done"
echo
echo "================ summary ================"
cat "$S"
