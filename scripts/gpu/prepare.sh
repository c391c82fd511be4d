#!/usr/bin/env bash
# Builds the GPU machines' binary — `hslake` with only the capture feature (no DataFusion or
# Flight), release, stripped — and stages it with the GPU scripts in gpu-run/ (ignored by git),
# ready for one device call: bash gpu-run/run.sh checks|throughput, bash gpu-run/moe.sh (MoE models
# on one GPU), or on N GPUs bash gpu-run/multi_gpu.sh N
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
T=${CARGO_TARGET_DIR:-target}
cargo build --release --no-default-features --features capture --bin hslake
mkdir -p gpu-run
cp "$T/release/hslake" gpu-run/hslake
cp scripts/gpu/env.sh scripts/gpu/run.sh scripts/gpu/variants.sh scripts/gpu/make_llama8b.py scripts/gpu/parity_bf16.py \
  scripts/gpu/multi_gpu.sh scripts/gpu/compare_tp.py scripts/gpu/moe.sh scripts/gpu/moe_bench.py gpu-run/
cp /work/shared/reference/hf_baseline.py gpu-run/ 2>/dev/null || cp scripts/gpu/hf_baseline.py gpu-run/
ls -la gpu-run
du -sh gpu-run
