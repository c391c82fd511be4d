#!/usr/bin/env bash
# Builds the Python module `hslake` (python/: pyo3 + maturin) in the dev profile and installs
# it into .venv as an editable package: python/hslake/ (the pure-Python wrapper) plus the native
# python/hslake/_hslake.abi3.so. Cargo builds into the workspace's target/ (or
# $CARGO_TARGET_DIR if set), sharing the dependencies `cargo build --workspace` compiles.
# For benchmarks, build the optimised module instead: (cd python && maturin develop --release).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
cd python
VIRTUAL_ENV="$ROOT/.venv" maturin develop --quiet
"$ROOT/.venv/bin/python3" -c 'import hslake; print("setup: hslake", hslake.__version__, "python module installed")' >&2
