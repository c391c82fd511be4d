#!/usr/bin/env bash
# hslake capture against vLLM 0.26's own hidden-state extraction (speculators' data generation), same GPU, same
# checkpoint, same samples, from the repository root with the staged binary (bash benchmarks/gpu/stage.sh):
#   bash gpu-run/vllm_compare.sh stash        in each of the calls that carry .vl1, .vl2, .vl3 (vllm_wheels.sh):
#                                             moves the carried part to /tmp/vl; keep the machine warm between calls
#   MODELS=llama bash gpu-run/vllm_compare.sh then one model per call (each fits the 10 minutes of one call)
# Per model (random bf16 weights made on the device by transformers, vllm_compare.py):
#   1. the checkpoint, SAMPLES samples of 2048 random tokens, and the f32 truth of the first REF of them (the same
#      network upcast to f32, transformers);
#   2. vLLM: /work/shared/reference/vllm_extract.py (staged beside this script), extract_hidden_states with its
#      safetensors connector writing to /dev/shm, timed from generate() until every file is written, the best of
#      two passes after a warm-up; its load timed apart; the first REF samples' states kept for the cosine;
#   3. ours: hslake capture + write + commit of the same samples and layers into a dataset on the disk, its
#      tokens/s over the run (load apart) and wall clock; once more per OURS_ALSO variant (e.g. libtorch's path);
#   4. per-token cosines per layer: ours and vLLM's against the f32 truth, and ours against vLLM's.
# Everything lands in $OUT/vllm_compare.json (one object per model: both tokens/s and their ratio, both load times,
# bytes on disk, the cosines and whether ours is no farther from the truth than vLLM's); logs beside it.
#
# Models: llama (Llama-3.1-8B shapes), qwen (Qwen3-30B-A3B shapes: 48 layers where the GPU has over 100 GB, else
# the first 20), ds (the DeepSeek-V3 cut of moe.sh: 3 dense + 2 MoE layers, 256 experts; over 100 GB only).
# Knobs: MODELS (default "llama qwen ds"), SAMPLES (320; SAMPLES_<model> for one, SAMPLES_ds defaults to 64: the
# cut's states and checkpoint share the 64 GB disk), REF (2), LAYERS_QWEN (layer count; default by memory),
# OURS_FLAGS (flags of our main capture), OURS_ALSO (more captures, ';'-separated flag sets, e.g. libtorch's path
# for the kernels fused by default: "--norm fast --activation torch --rope torch --moe-route torch"), VLLM_ARGS (more
# vllm_extract.py flags, e.g. --enforce-eager), WORK (default /tmp/hslake-vllm; a made model is kept there and reused by a later call),
# VL (the carried parts, default /tmp/vl), VLLM_SITE (vLLM's install, default /tmp/site), KEEP=1 keeps the models.
# DEVICE=cpu TINY=1: a dry run of everything but vLLM at toy sizes on the CPU (vLLM's rows say skipped).
set -uo pipefail
source "$(dirname "$0")/env.sh"
VL=${VL:-/tmp/vl}
VLLM_SITE=${VLLM_SITE:-/tmp/site}
mkdir -p "$VL"
# A call that carried a part (.vlN/vlpart.*) leaves it here for the next calls.
for part in .vl*/vlpart.*; do [ -e "$part" ] && cp -n "$part" "$VL/"; done
if [ "${1:-}" = stash ]; then ls -la "$VL"; exit 0; fi

DEVICE=${DEVICE:-cuda}
W=${WORK:-/tmp/hslake-vllm}
SAMPLES=${SAMPLES:-320}
REF=${REF:-2}
SEQ=2048
TINYFLAG=
[ "${TINY:-0}" = 1 ] && { TINYFLAG=--tiny; SEQ=${SEQ_TINY:-64}; SAMPLES=${SAMPLES_TINY:-12}; }
ROWS=$OUT/vllm_rows.jsonl
: > "$ROWS"
mkdir -p "$W"
T0=$(date +%s)
stage() { echo "=== [$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/vllm_stages.txt"; }
py() { python3 "$HERE/vllm_compare.py" "$@" --rows "$ROWS" --device "$DEVICE" --seq "$SEQ" --samples "$SAMPLES" \
  --ref-samples "$REF" $TINYFLAG; }
row() { python3 -c 'import json,sys; print(json.dumps(dict(model=sys.argv[1], what=sys.argv[2], **json.loads(sys.argv[3]))))' "$@" >> "$ROWS"; }

GPU_GB=0
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  GPU_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1/1024)}')
fi

# vLLM from the carried wheels, once per machine.
VLLM=0
if [ "$DEVICE" = cuda ]; then
  if [ ! -d "$VLLM_SITE/vllm" ]; then
    if ls "$VL"/vlpart.* >/dev/null 2>&1; then
      stage "install vLLM from $(ls "$VL"/vlpart.* | wc -l) parts"
      mkdir -p "$VL/wheels"
      cat "$VL"/vlpart.* | tar xf - -C "$VL/wheels" &&
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$VLLM_SITE" "$VL"/wheels/*.whl 2>&1 | tail -3
    else
      echo "no vLLM parts in $VL (carry .vl1, .vl2, .vl3 with 'bash gpu-run/vllm_compare.sh stash' first)" | tee -a "$OUT/vllm_stages.txt"
    fi
  fi
  [ -d "$VLLM_SITE/vllm" ] && VLLM=1
fi

# vllm MODEL_DIR LABEL IDS: vLLM's extraction of the samples, its rows, the first REF samples' states kept
vllm_run() {
  local m=$1 label=$2 ids=$3
  if [ $VLLM = 0 ]; then row "$label" "vllm skipped (no vLLM on $DEVICE)" '{}'; return; fi
  stage "$label: vLLM extraction of $SAMPLES x $SEQ tokens"
  rm -rf /dev/shm/hslake-vllm-hs "$m-vllm-save"
  PYTHONPATH=$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 python3 "$HERE/vllm_extract.py" "$m" \
    --layers "$ids" --data "$m.jsonl" -n "$SAMPLES" --max-num-batched-tokens 16384 --warmup 16 --repeat 2 \
    --out-dir /dev/shm/hslake-vllm-hs --save-dir "$m-vllm-save" --save-count "$REF" ${VLLM_ARGS:-} \
    > "$OUT/vllm_${label}_vllm.txt" 2>&1
  local rc=$?
  rm -rf /dev/shm/hslake-vllm-hs
  if [ $rc != 0 ]; then row "$label" "vllm FAILED rc=$rc (see vllm_${label}_vllm.txt)" '{}'; return; fi
  python3 - "$OUT/vllm_${label}_vllm.txt" "$label" "$ROWS" <<'EOF'
import json, re, sys
text, label, rows = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
passes = [dict(tps=int(m[1]), gib=float(m[2])) for m in re.finditer(r"tok_per_s=(\d+) written=([\d.]+) GiB", text)]
load = re.search(r"LOAD_S ([\d.]+)", text)
with open(rows, "a") as f:
    f.write(json.dumps(dict(model=label, what="vllm tokens/s", value=max(p["tps"] for p in passes))) + "\n")
    f.write(json.dumps(dict(model=label, what="vllm passes tokens/s", value=[p["tps"] for p in passes])) + "\n")
    f.write(json.dumps(dict(model=label, what="vllm load s", value=float(load[1]) if load else None)) + "\n")
    f.write(json.dumps(dict(model=label, what="vllm bytes written", value=int(passes[-1]["gib"] * 2**30))) + "\n")
EOF
}

# ours MODEL_DIR LABEL TAG FLAGS: our capture + write + commit of the samples, its rows
ours() {
  local m=$1 label=$2 tag=$3 flags=$4 layers=$5 dest=$W/ours-ds
  stage "$label: our capture + write of $SAMPLES x $SEQ tokens ($tag${flags:+: $flags})"
  rm -rf "$dest"
  local t
  t=$(date +%s.%N)
  "$BIN" capture --model "$m" --input "$m.jsonl" --output "file://$dest" --layers "$layers" --device "$DEVICE" \
    --dtype bf16 --max-tokens-per-batch $((8 * SEQ)) $flags --no-progress > "$OUT/vllm_${label}_ours_$tag.txt" 2>&1
  local rc=$?
  local wall
  wall=$(python3 -c "import time; print(round(time.time() - $t, 1))")
  if [ $rc != 0 ]; then row "$label" "ours $tag FAILED rc=$rc (see vllm_${label}_ours_$tag.txt)" '{}'; return 1; fi
  local bytes
  bytes=$(du -sb "$dest" | cut -f1)
  python3 - "$OUT/vllm_${label}_ours_$tag.txt" "$label" "$tag" "$wall" "$bytes" "$flags" "$ROWS" <<'EOF'
import json, re, sys
path, label, tag, wall, size, flags, rows = sys.argv[1:]
text = open(path).read()
tps = re.search(r"tokens, (\d+) tokens/s over", text)
load = re.search(r"time\s+load ([\d.]+)s", text)
name = "ours capture + write" if tag == "main" else f"ours capture + write ({flags})"
with open(rows, "a") as f:
    f.write(json.dumps(dict(model=label, what=f"{name} tokens/s", value=int(tps[1]) if tps else None)) + "\n")
    f.write(json.dumps(dict(model=label, what=f"{name} load s", value=float(load[1]) if load else None)) + "\n")
    f.write(json.dumps(dict(model=label, what=f"{name} wall clock incl. load s", value=float(wall))) + "\n")
    f.write(json.dumps(dict(model=label, what=f"{name} bytes on disk", value=int(size))) + "\n")
EOF
}

# model STEP NAME LABEL [make flags]
model() {
  local step=$1 name=$2 label=$3
  shift 3
  local m=$W/$step per_step=SAMPLES_$step
  local SAMPLES=${!per_step:-$SAMPLES}
  if [ ! -f "$m.truth.npz" ]; then
    stage "$label: make (transformers, random weights), f32 truth"
    rm -rf "$m"
    py make "$name" "$m" "$@" 2>&1 | tail -5 | tee "$OUT/vllm_${label}_make.txt"
    [ -f "$m.truth.npz" ] || { row "$label" "make FAILED (see vllm_${label}_make.txt)" '{}'; return; }
  fi
  local ids layers
  ids=$(py ids "$m")
  layers=$(python3 -c 'import sys; print(",".join(str(int(i) - 1) for i in sys.argv[1].split(",")))' "$ids")
  row "$label" "layers (vLLM ids; ours one less)" "{\"value\": \"$ids\"}"
  vllm_run "$m" "$label" "$ids"
  if ours "$m" "$label" main "${OURS_FLAGS:-}" "$layers"; then
    stage "$label: cosines"
    local save=$m-vllm-save
    [ -d "$save" ] || save=-
    py cosine "$m" "$W/ours-ds" "$save" "$label" 2>&1 | tee -a "$OUT/vllm_${label}_cosine.txt"
  fi
  local also i=0
  IFS=';' read -ra also <<< "${OURS_ALSO:-}"
  for flags in "${also[@]}"; do
    i=$((i + 1))
    ours "$m" "$label" "also$i" "$flags" "$layers"
  done
  rm -rf "$W/ours-ds"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$m" "$m.jsonl" "$m.truth.npz" "$m-vllm-save"
}

for s in ${MODELS:-llama qwen ds}; do
  case $s in
  llama) model llama llama8b llama-3.1-8b ;;
  qwen)
    n=${LAYERS_QWEN:-}
    [ -z "$n" ] && { [ "$GPU_GB" -gt 100 ] && n=48 || n=20; }
    [ -n "$TINYFLAG" ] && n=4
    model qwen qwen3_30b_a3b "qwen3-30b-a3b-${n}l" --num-layers "$n" ;;
  ds)
    if [ "$DEVICE" = cuda ] && [ "$GPU_GB" -le 100 ]; then
      row deepseek-v3-cut "skipped: needs over 100 GB of GPU memory (an H200)" '{}'
      continue
    fi
    # 320 samples of its 7168-wide states would be 38 GB on a disk that holds its 53 GB checkpoint.
    SAMPLES_ds=${SAMPLES_ds:-$([ -n "$TINYFLAG" ] && echo "$SAMPLES" || echo 64)} model ds deepseek_v3 deepseek-v3-cut ;;
  *) echo "unknown model $s (llama, qwen, ds)" >&2; exit 2 ;;
  esac
done

stage done
python3 "$HERE/vllm_compare.py" summary "$ROWS" "$OUT/vllm_compare.json" | tee "$OUT/vllm_summary.txt"
