#!/usr/bin/env bash
# One GPU call: vLLM installed from the stashed parts (in the background), our kernel check, parity with every
# fused kernel, and our prefill per part under the defaults and under the fused kernels (kernels.sh).
set -uo pipefail
REAL_OUT=$OUT; export OUT=/tmp/o; mkdir -p $OUT
export PYTHONUNBUFFERED=1
source gpu-run/env.sh
T0=$(date +%s); st() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
if [ ! -d /tmp/site/vllm ] && ls /tmp/vl/vlpart.* >/dev/null 2>&1; then
  ( mkdir -p /tmp/vl/wheels; cat /tmp/vl/vlpart.* | tar xf - -C /tmp/vl/wheels &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vl/wheels/*.whl > /tmp/vl/install.log 2>&1; echo "install rc=$?" >> /tmp/vl/install.log ) &
fi
st debug kernels
timeout 120 $BIN debug kernels --iters 10 > $OUT/kernels.txt 2>&1; echo "kernels rc=$?"; tail -45 $OUT/kernels.txt
st parity fused
FUSED="--norm fused --activation fused --rope fused --moe-route fused"
timeout 150 python3 gpu-run/parity_bf16.py --bin $BIN --work /tmp/parity --runs 1:f32:batched -- $FUSED > $OUT/parity_fused.txt 2>&1; echo "parity rc=$?"; tail -14 $OUT/parity_fused.txt
st models
STEPS=models MODELS="llama qwen" CHOICES="--attention flash;$FUSED --attention flash" BATCHES=16 ITERS=4 timeout 270 bash gpu-run/kernels.sh > $OUT/kernels_models_log.txt 2>&1; echo "models rc=$?"; cat $OUT/kernels_summary.txt
wait; cat /tmp/vl/install.log 2>/dev/null | tail -3
st done
tar czf $REAL_OUT/call4.tgz -C /tmp/o .
