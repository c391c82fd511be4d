#!/usr/bin/env bash
# Sets up everything hslake needs on a fresh machine: the Python environment in .venv
# (torch 2.11.0 wheel for libtorch, test packages, the S3 test server), the Rust build,
# and the Python module. Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
# OpenMP threads of torch and libtorch otherwise spin while they wait for work: on a 2-core
# machine where cargo, pytest and the hslake binary all hold such threads, every small matrix
# product then took 8x longer (measured: 100 GEMMs of 12x576x1536 in 3.1 s instead of 0.39 s).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

if [ ! -x .venv/bin/python3 ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
# Installing the Python packages needs about 8 GB (torch with its NVIDIA libraries unpacks to
# 5.4 GB, and pip holds the wheels meanwhile); the first dev build of the workspace about 5 GB
# more (target/ of a fresh clone held 4.0 GB after the whole test suite). A full disk otherwise
# surfaces as pip's "No space left on device" or a linker error halfway through.
need_space() { # <GB> <what>
  local free_kb
  free_kb=$(df -Pk "$ROOT" | awk 'NR==2 {print $4}')
  if [ "${HSLAKE_SKIP_SPACE_CHECK:-0}" != 1 ] && [ "$free_kb" -lt $(($1 * 1024 * 1024)) ]; then
    echo "setup: $2 needs about $1 GB free on the disk of $ROOT, but only $((free_kb / 1024)) MB are free" >&2
    echo "setup: free some space (or set HSLAKE_SKIP_SPACE_CHECK=1 to try anyway)" >&2
    exit 1
  fi
}
stamp=.venv/.requirements.sha
want=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages (torch 2.11.0 is about 4.6 GB with its NVIDIA libraries)" >&2
  need_space 8 "installing the Python packages"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements-dev.txt
  echo "$want" > "$stamp"
fi

export PATH="$ROOT/.venv/bin:$PATH"
for step in scripts/setup.d/*.sh; do
  [ -e "$step" ] || continue
  echo "setup: $(basename "$step")" >&2
  bash "$step"
done

if [ ! -d "${CARGO_TARGET_DIR:-target}/debug" ]; then
  need_space 5 "the first dev build of the workspace"
fi
echo "setup: building hslake, hslake-gpu and the Python module (dev profile, read/write path at opt-level 3)" >&2
# The users' build shares its dependencies with the tests' build: Cargo.toml raises the hot crates
# (store, loader, parquet, arrow's array crates, zstd, ...) to opt-level 3 inside the dev profile,
# which reaches release speed on the store and loader benchmarks without a second build of
# DataFusion and libtorch's bindings (docs/PERFORMANCE.md, "Which build"). .cargo/install.toml
# turns off the debug assertions and overflow checks that the tests keep in our hot crates.
# `hslake --version` says which build a binary is.
# --lib builds the Python module's library in the same feature resolution as the CLI and the
# tests (a separate maturin build of the one package compiled arrow and parquet again).
cargo build --workspace --lib --bins --config .cargo/install.toml
bash scripts/python_module.sh
