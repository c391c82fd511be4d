#!/usr/bin/env bash
# Runs the loader benchmark (benchmarks/cpu/loader.py: SpecForge's torch.save files, speculators'
# safetensors files, Lance, MosaicML streaming and hslake on the same samples) at the sizes
# EAGLE-3 data has: hidden 4096, 512-4096 tokens, three aux layers plus the target. The defaults
# make about 4.6 GB of raw tensors, and each format writes its own copy: needs ~25 GB free under
# OUT. Batches of 4 padded samples (~0.5 GB each); one epoch per reader and worker count in
# WORKERS, with the cores each reader needs for a draft step of DRAFT_TOKENS_PER_S (one H200's,
# as benchmarks/gpu/draft_step.py measures it). hslake_all (one window of every row group) is
# left out: it holds most of the dataset decoded.
#   bash benchmarks/cpu/loader_real.sh                     # 2 cores
#   WORKERS=1,2,4,8 bash benchmarks/cpu/loader_real.sh     # 16 cores
# Extra arguments go to loader.py (e.g. --readers torch,hslake --keep).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" benchmarks/cpu/loader.py \
  --samples "${SAMPLES:-64}" --seq-len "${SEQ_LEN:-512:4096}" --hidden 4096 --aux-layers 1,2,3 \
  --batch-size "${BATCH:-4}" --workers "${WORKERS:-1,2}" --row-group-mb "${ROW_GROUP_MB:-64}" \
  --draft-tokens-per-s "${DRAFT_TOKENS_PER_S:-57877}" \
  --readers "${READERS:-torch,safetensors,lance_take,lance_dataset,mosaicml,hslake,hslake_sample}" \
  --out "${OUT:-/tmp/hslake-bench-real}" --json-out "${JSON_OUT:-/tmp/hslake-bench-real.json}" "$@"
