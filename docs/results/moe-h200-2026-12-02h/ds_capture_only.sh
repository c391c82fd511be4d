#!/usr/bin/env bash
# The DeepSeek-V3 cut made and saved as moe.sh makes it (no transformers prefill or reference),
# then our capture + write of 240 x 2048 tokens into /dev/shm, twice.
set -uo pipefail
source "$(dirname "$0")/env.sh"
W=/tmp/hm; mkdir -p $W
t0=$(date +%s)
python3 - <<'PY'
import sys, torch
sys.path.insert(0, "gpu-run")
import moe_bench as mb
cfg = mb.config("deepseek_v3", False)
m = mb.build(cfg, torch.device("cuda"))
mb.inputs(cfg, "/tmp/hm/ds.jsonl", 240, 2048)
m.save_pretrained("/tmp/hm/ds")
PY
echo "made in $(( $(date +%s) - t0 )) s" | tee $OUT/made.txt
for i in 1 2; do
  rm -rf /dev/shm/c
  "$BIN" capture --model $W/ds --input $W/ds.jsonl --output file:///dev/shm/c --layers 0,1,2,3,4 --device cuda \
    --dtype bf16 --max-tokens-per-batch 16384 --no-progress > $OUT/capture_$i.txt 2>&1
  echo "capture $i rc $? at $(( $(date +%s) - t0 )) s" | tee -a $OUT/made.txt
done
