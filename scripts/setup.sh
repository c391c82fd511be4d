#!/usr/bin/env bash
# Sets up everything hslake needs on a fresh machine: the Python environment in .venv
# (torch 2.11.0 wheel for libtorch, test packages, the S3 test server), the Rust build,
# and the Python module. Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python3 ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages (torch 2.11.0 is about 4.6 GB with its NVIDIA libraries)" >&2
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

echo "setup: building hslake (dev profile)" >&2
cargo build --workspace --bins
