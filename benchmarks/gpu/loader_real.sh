#!/usr/bin/env bash
# Runs the loader benchmark at EAGLE-3's real sizes on a 16-core GPU machine: SpecForge's
# torch.save files, speculators' safetensors files, MosaicML streaming, Lance when staged, and
# hslake (window and sample shuffle) on the same samples, one epoch per reader and worker count
# in WORKERS, with the cores each needs for the draft step's tokens/s. Runs from the folder
# benchmarks/gpu/loader_stage.sh fills (gpu-run/loader), without network: the peers' wheels go
# into a temporary folder on PYTHONPATH, nothing is installed into the image's Python. Writes
# under $OUT:
#   machine.txt       date, CPU, cores, load average, free disk and memory
#   loader_real.txt   everything printed, the table included
#   loader_real.json  the results (written after each reader, so a stopped run keeps what it had)
#   notes.txt         readers left out and why
#   OUT=/tmp/x bash gpu-run/loader/loader_real.sh                              # staged
#   OUT=/tmp/x SAMPLES=4 SEQ_LEN=16:64 bash benchmarks/gpu/loader_real.sh      # a quick check in the tree
# SAMPLES (48), SEQ_LEN (512:4096), WORKERS (1,2,4,8), MAX_S (a reader's limit, 120 s) and
# BUDGET_S (the whole benchmark's limit, 480 s) size it.
# Needs ~25 GB free under DATA (/tmp/hslake-loader-real).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -f "$HERE/benchmarks/cpu/loader.py" ]; then
  STAGE=$HERE
else
  STAGE=$(cd "$HERE/../.." && pwd)/gpu-run/loader
fi
if [ ! -f "$STAGE/benchmarks/cpu/loader.py" ] || ! ls "$STAGE"/python/hslake/_hslake*.so >/dev/null 2>&1; then
  echo "no staged benchmark in $STAGE: run benchmarks/gpu/loader_stage.sh first" >&2
  exit 1
fi
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DATA=${DATA:-/tmp/hslake-loader-real}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE

{
  date -u
  echo "cores: $(nproc); $(grep -m1 'model name' /proc/cpuinfo || true)"
  uptime
  df -h "$(dirname "$DATA")" | tail -1
  free -g | sed -n 2p
  "$PY" --version
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

site=$(mktemp -d /tmp/loader-site.XXXXXX)
trap 'rm -rf "$site" "$DATA"' EXIT
: > "$OUT/notes.txt"
if ls "$STAGE"/wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$STAGE"/wheels/*.whl ||
    echo "NOTE: installing the staged peer wheels failed; readers that need them are left out" |
    tee -a "$OUT/notes.txt"
fi
export PYTHONPATH=$STAGE/python:$site${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import hslake; print("hslake", hslake.__file__, hslake.build_info())'

readers=torch,safetensors
if "$PY" -c 'import streaming' >/dev/null 2>&1; then
  readers+=,mosaicml
else
  echo "NOTE: MosaicML streaming left out: 'import streaming' fails here" | tee -a "$OUT/notes.txt"
fi
if "$PY" -c 'import lance' >/dev/null 2>&1; then
  readers+=,lance_take,lance_dataset
else
  echo "NOTE: Lance left out: 'import lance' fails (its 85 MB wheel is staged on its own: benchmarks/gpu/lance_stage.sh)" |
    tee -a "$OUT/notes.txt"
fi
readers+=,hslake,hslake_sample

rm -rf "$DATA"
set +e
json=$OUT/loader_real.json  # before the prefix below, where OUT becomes the data folder
PYTHON=$PY OUT=$DATA JSON_OUT=$json SAMPLES=${SAMPLES:-48} SEQ_LEN=${SEQ_LEN:-512:4096} \
  WORKERS=${WORKERS:-1,2,4,8} READERS=${READERS:-$readers} \
  timeout "${BUDGET_S:-480}" bash "$STAGE/benchmarks/cpu/loader_real.sh" --max-seconds "${MAX_S:-120}" \
  2>&1 | tee "$OUT/loader_real.txt"
rc=${PIPESTATUS[0]}
set -e
{ echo "exit status $rc"; date -u; uptime; } | tee -a "$OUT/machine.txt"
exit "$rc"
