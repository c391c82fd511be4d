#!/usr/bin/env bash
# Stages Lance (pylance 14.0.2, a peer of the loader benchmark) for a GPU machine without network
# that takes at most 64 MiB at a time: pylance's wheel is 85 MB, so it travels alone, before the
# loader stage (benchmarks/gpu/loader_stage.sh, ~30 MiB). Into gpu-run/lance/ (git-ignored) it
# puts the wheel's 225 MB library xz-compressed (-9e: 48 MB; Python's lzma unpacks it there, no xz
# needed), the rest of the wheel, and the cp312 wheels `import lance` needs that the GPU image
# lacks (lance-namespace, its urllib3 client, pydantic). On the GPU machine, one after the other
# while /tmp survives:
#   carry ["gpu-run/lance"]:    bash gpu-run/lance/unpack.sh          (into /tmp/lance-site)
#   carry ["gpu-run/loader"]:   PYTHONPATH=/tmp/lance-site bash gpu-run/loader/loader_real.sh
# Needs .venv and network for pip download; compressing takes ~5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DEST=gpu-run/lance
LIMIT_MIB=60
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rm -rf "$DEST"
mkdir -p "$DEST/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work" pylance==14.0.2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/wheels" lance-namespace==0.13.0 lance-namespace-urllib3-client==0.13.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
(cd "$work" && mkdir site && cd site && unzip -q ../pylance-*.whl)
so=lance/lance.abi3.so
xz -9e -T0 -c "$work/site/$so" > "$DEST/lance.abi3.so.xz"
rm "$work/site/$so"
tar -C "$work/site" -czf "$DEST/pylance-rest.tar.gz" .
cat > "$DEST/unpack.sh" <<'UNPACK'
#!/usr/bin/env bash
# On the device: pylance and what `import lance` needs into /tmp/lance-site, then a check.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${SITE:-/tmp/lance-site}
rm -rf "$SITE" && mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$HERE"/wheels/*.whl
tar -C "$SITE" -xzf "$HERE/pylance-rest.tar.gz"
python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 16 << 20)' "$HERE/lance.abi3.so.xz" "$SITE/lance/lance.abi3.so"
PYTHONPATH=$SITE python3 -c 'import lance, pyarrow; print("lance", lance.__version__, "pyarrow", pyarrow.__version__)'
UNPACK
mib=$(du -sm "$DEST" | cut -f1)
du -sm "$DEST"/* | sed "s/^/  /"
if [ "$mib" -gt "$LIMIT_MIB" ]; then
  echo "$DEST is $mib MiB, over the $LIMIT_MIB MiB budget of one device call" >&2
  exit 1
fi
echo "device call 1 (nvidia-h200): carry [\"$DEST\"]; command: bash $DEST/unpack.sh"
