#!/usr/bin/env bash
# Runs the GPU correctness checks of hslake capture on one GPU: the NCCL one-rank check and the
# bf16 parity of every architecture against transformers (parity_bf16.py).
#   bash gpu-run/checks.sh     (from the repository root, staged by benchmarks/gpu/stage.sh)
# Logs go to $OUT (or ./gpu-out). Needs one CUDA GPU, torch and transformers.
set -uo pipefail
source "$(dirname "$0")/env.sh"
"$BIN" debug nccl-check 2>&1 | tee "$OUT/nccl.txt"
python3 "$HERE/parity_bf16.py" --bin "$BIN" --work /tmp/hslake-parity 2>&1 | tee "$OUT/parity.txt"
