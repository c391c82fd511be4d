#!/usr/bin/env bash
# The main job on the embedded default: set everything up, write a dataset into a local
# directory, verify it and describe it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
OUT="file://$ROOT/.cache/default/dataset"
rm -rf "$ROOT/.cache/default/dataset"
target/debug/hslake synth "$OUT" --samples 64 --seq-len 64:256 --hidden 576 --layers 2,15,27,29 --final-norm --num-layers 30 --vocab-size 49152
target/debug/hslake verify "$OUT"
target/debug/hslake info "$OUT"
