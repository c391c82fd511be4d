#!/usr/bin/env bash
# One GPU call: vLLM's extraction against our capture (defaults, then every fused kernel) on MODELS.
set -uo pipefail
export PYTHONUNBUFFERED=1
REAL_OUT=$OUT; export OUT=/tmp/o5-${MODELS// /_}; mkdir -p $OUT
FUSED="--norm fused --activation fused --rope fused --moe-route fused"
OURS_ALSO="$FUSED;$FUSED --attention flash" timeout ${BUDGET:-560} bash gpu-run/vllm_compare.sh; echo "compare rc=$?"
cat $OUT/vllm_summary.txt 2>/dev/null; cat $OUT/vllm_stages.txt
tar czf $REAL_OUT/call5.tgz -C $OUT .
