#!/usr/bin/env bash
# Runs the main job on the embedded default: sets everything up (including the real
# SmolLM2-135M-Instruct and its chat samples, see scripts/setup.d/20-smollm2.sh), captures layers
# 2, 15, 27, 29 and the final norm in bf16 on CPU into a local dataset, then verifies and
# describes it. Needs what scripts/setup.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
OUT="file://$ROOT/.cache/default/dataset"
rm -rf "$ROOT/.cache/default/dataset"
# target/debug/hslake is setup's build: the dev profile with the read/write path at opt-level 3,
# without debug assertions (Cargo.toml, .cargo/install.toml); --version says so.
target/debug/hslake --version
target/debug/hslake capture --model .cache/models/SmolLM2-135M-Instruct --input .cache/default/samples.jsonl \
  --output "$OUT" --layers 2,15,27,29 --final-norm --device cpu --dtype bf16 --max-tokens-per-batch 4096
target/debug/hslake verify "$OUT"
target/debug/hslake info "$OUT"
