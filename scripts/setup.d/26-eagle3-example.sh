#!/usr/bin/env bash
# Installs the EAGLE-3 example (examples/eagle3, the package `hslake_eagle3` the tests import) into
# .venv in editable mode, without dependencies or a build environment: what it imports comes from
# the other setup steps, and setuptools from requirements-dev.txt. Runs only when the installed
# package is missing or comes from another checkout.
set -euo pipefail
cd "$(dirname "$0")/../.."
if python3 -c 'import sys, hslake_eagle3; sys.exit(not hslake_eagle3.__file__.startswith(sys.argv[1]))' \
  "$PWD/examples/eagle3/" 2>/dev/null; then
  exit 0
fi
echo "setup: installing the EAGLE-3 example package (editable, examples/eagle3)" >&2
python3 -m pip install -q --no-deps --no-build-isolation -e examples/eagle3
