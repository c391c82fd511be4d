#!/usr/bin/env bash
# Builds the GPU machines' binaries (release, stripped, with only the capture feature, so no
# DataFusion or Flight): hslake-gpu, which runs capture and debug, and hslake, which the scripts
# call and which runs hslake-gpu beside it for those (and `verify` itself). Stages them with the
# GPU benchmarks and checks in gpu-run/ (git-ignored), flat, so that each finds env.sh and the
# binaries beside itself there:
#   bash gpu-run/checks.sh        NCCL one-rank check + bf16 parity vs transformers (tests/gpu/)
#   bash gpu-run/llama8b.sh       Llama-3.1-8B shapes: transformers vs our prefill and capture
#   bash gpu-run/variants.sh      our prefill under each setting
#   bash gpu-run/moe.sh           MoE models on one GPU
#   bash gpu-run/stream.sh        layer-streamed against resident capture on one GPU
#   bash gpu-run/multi_gpu.sh N   tensor parallelism on N GPUs
#   bash gpu-run/kernels.sh       our fused kernels and attention choices: parity, per-part times
#   bash gpu-run/vllm_compare.sh  vLLM 0.26's extraction against our capture (wheels: vllm_wheels.sh)
#   python3 gpu-run/kernel_probe.py  each part of a layer: our operations, vLLM's kernels, SDPA's
# Needs the Rust toolchain and .venv (scripts/setup.sh), and the reference scripts hf_baseline.py
# and vllm_extract.py in REFERENCE (default /work/shared/reference).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
T=${CARGO_TARGET_DIR:-target}
cargo build --release --no-default-features --features capture --bins
mkdir -p gpu-run
cp "$T/release/hslake" "$T/release/hslake-gpu" gpu-run/
cp benchmarks/gpu/env.sh benchmarks/gpu/llama8b.sh benchmarks/gpu/variants.sh benchmarks/gpu/make_llama8b.py \
  benchmarks/gpu/multi_gpu.sh benchmarks/gpu/moe.sh benchmarks/gpu/moe_reference.py \
  benchmarks/gpu/stream.sh benchmarks/gpu/kimi_shapes.py benchmarks/gpu/kernel_probe.py \
  benchmarks/gpu/vllm_compare.sh benchmarks/gpu/vllm_compare.py \
  tests/gpu/checks.sh tests/gpu/kernels.sh tests/gpu/parity_bf16.py tests/gpu/compare_tp.py gpu-run/
REFERENCE=${REFERENCE:-/work/shared/reference}
cp "${HF_BASELINE:-$REFERENCE/hf_baseline.py}" "$REFERENCE/vllm_extract.py" gpu-run/
ls -la gpu-run
du -sh gpu-run
