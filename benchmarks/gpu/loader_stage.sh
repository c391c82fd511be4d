#!/usr/bin/env bash
# Stages the loader benchmark at real sizes (benchmarks/gpu/loader_real.sh) for a machine with
# 16 cores, Python 3.12 and torch 2.11 but no network and no Rust, that takes at most 64 MiB at a
# time. Into gpu-run/loader/ (git-ignored) it puts:
#   python/hslake/        the hslake package with the module scripts/setup.sh installed into .venv
#                         (the optimised build; abi3, so it loads on 3.12), its debug info
#                         stripped: the same code in a third of the bytes
#   benchmarks/cpu/       loader.py and loader_real.sh (the real-size settings)
#   loader_real.sh        the script to run there
#   wheels/               MosaicML streaming and what `import streaming` needs that the GPU image
#                         lacks (cp312, --no-deps)
# and checks that the folder stays under 60 MiB. Lance is not staged here: pylance's wheel alone
# is 85 MB, so it travels on its own (benchmarks/gpu/lance_stage.sh says how); without it the
# benchmark reads without Lance.
#   bash benchmarks/gpu/loader_stage.sh
# Needs .venv with the hslake module (scripts/setup.sh) and network for pip download.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DEST=gpu-run/loader
LIMIT_MIB=60

rm -rf "$DEST"
mkdir -p "$DEST/python/hslake" "$DEST/benchmarks/cpu" "$DEST/wheels"
so=$("$PY" -c 'import glob, os, hslake
print(*glob.glob(os.path.join(os.path.dirname(hslake.__file__), "_hslake*.so")))')
if [ -z "$so" ] || [ "$(echo "$so" | wc -w)" != 1 ]; then
  echo "expected one installed _hslake*.so next to the hslake package of $PY, found: '$so'" >&2
  exit 1
fi
"$PY" -c 'import hslake, sys
b = hslake.build_info()
print("staging hslake", b["describe"])
sys.exit(1 if b["benchmark_warning"] else 0)' || {
  echo "the installed hslake module is not an optimised build: run scripts/setup.sh's build first" >&2
  exit 1
}
cp -r python/hslake/__init__.py python/hslake/integrations "$DEST/python/hslake/"
strip --strip-debug -o "$DEST/python/hslake/$(basename "$so")" "$so"
find "$DEST/python" -name __pycache__ -prune -exec rm -rf {} +
cp benchmarks/cpu/loader.py benchmarks/cpu/loader_real.sh "$DEST/benchmarks/cpu/"
cp requirements-peers.txt benchmarks/gpu/loader_real.sh "$DEST/"

# requirements-peers.txt's MosaicML reader without what the GPU image already has (torchvision
# 0.26.0, pillow, xxhash: KINDS.md's package list) and without pylance (85 MB). zstd 1.5.7.2 has
# no cp312 wheel on PyPI; 1.5.6.1 is the newest that has one (the same zstd format).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DEST/wheels" \
  mosaicml-streaming==0.13.0 brotli==1.2.1 python-snappy==0.7.3 cramjam==2.14.0 zstd==1.5.6.1 \
  catalogue==2.0.10

mib=$(du -sm "$DEST" | cut -f1)
for d in "$DEST" "$DEST"/python "$DEST"/wheels; do du -sm "$d"; done | sed "s/^/  /"
if [ "$mib" -gt "$LIMIT_MIB" ]; then
  echo "$DEST is $mib MiB, over the $LIMIT_MIB MiB budget of one device call" >&2
  exit 1
fi
echo "device call (nvidia-h200): carry [\"$DEST\"]; command: bash $DEST/loader_real.sh"
