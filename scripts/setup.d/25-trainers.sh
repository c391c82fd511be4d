#!/usr/bin/env bash
# The EAGLE-3 trainers hslake plugs into (speculators 0.9.0, SpecForge 0.2.0) and the few
# packages their training code imports, from requirements-trainers.txt, with --no-deps: their
# metadata would otherwise replace torch/transformers and pull sglang. Runs only when that file
# changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/../.."
stamp=.venv/.trainers.sha
want=$(sha256sum requirements-trainers.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setup: installing speculators and SpecForge (--no-deps, see requirements-trainers.txt)" >&2
python3 -m pip install -q --no-deps -r requirements-trainers.txt
python3 -c 'import speculators.train.data, specforge.training.strategies.base' 2>/dev/null \
  || { echo "setup: the trainers do not import; see the error above" >&2; python3 -c 'import speculators.train.data, specforge.training.strategies.base'; exit 1; }
echo "$want" > "$stamp"
