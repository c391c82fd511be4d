#!/usr/bin/env bash
# Installs the Python module `hslake` (python/: pyo3) into .venv as an editable package: the
# pure-Python wrapper python/hslake/ plus the native library that `cargo build --workspace`
# made (target/<profile>/libhslake.so, copied to python/hslake/_hslake.abi3.so).
# scripts/setup.sh calls it after its dev build, whose hot crates are optimised and unchecked
# (Cargo.toml, .cargo/install.toml); a full release module is `cargo build --release -p hslake-python && bash scripts/python_module.sh release`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
profile=${1:-debug}
so="${CARGO_TARGET_DIR:-$ROOT/target}/$profile/libhslake.so"
if [ ! -f "$so" ]; then
  echo "python_module: $so is missing; build it first (cargo build --workspace --lib --config .cargo/install.toml)" >&2
  exit 1
fi
# Replace, never overwrite in place: a Python process may have the old library mapped.
cp "$so" python/hslake/_hslake.abi3.so.tmp
mv python/hslake/_hslake.abi3.so.tmp python/hslake/_hslake.abi3.so
site=$("$ROOT/.venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/python" > "$site/hslake.pth"
"$ROOT/.venv/bin/python3" -c 'import hslake; print("setup: hslake", hslake.__version__, "python module installed:", hslake.build_info()["describe"])' >&2
