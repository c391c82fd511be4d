#!/bin/bash
# Capture one dataset with N Slurm array tasks, each its own tensor-parallel group on one node:
# task I runs `hslake capture --shard I/N`. All tasks commit into the same s3:// dataset through
# hslake's commit protocol (put-if-absent manifests), so no task waits for another.
#
#   sbatch --array=0-7 examples/slurm/capture_array.sh
#
# A task that fails or is preempted is simply run again (`scontrol requeue JOB_TASK`, or
# `sbatch --array=3 ...`): --resume skips the samples its shard already committed. When every
# task has exited 0, the dataset holds every input sample exactly once; `hslake verify URL` checks it.
#SBATCH --job-name=hslake-capture
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --output=hslake-capture-%A_%a.log
set -euo pipefail

# Edit these for your cluster.
MODEL=${MODEL:-/models/Kimi-K2.5}
INPUT=${INPUT:-/data/samples.jsonl}      # the same file on every node (shared filesystem)
OUTPUT=${OUTPUT:-s3://my-bucket/hidden-states/kimi-k25}
LAYERS=${LAYERS:-2,30,58,60}
TP=${TP:-8}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
HSLAKE=${HSLAKE:-hslake}
# S3 credentials and endpoint come from the usual AWS_* variables (AWS_ENDPOINT for non-AWS stores).

# The array's size is the number of shards: sbatch --array=0-7 gives 8 (a contiguous range;
# a %K throttle such as --array=0-7%2 is fine).
SHARDS=${SLURM_ARRAY_TASK_COUNT:?submit as an array job, e.g. sbatch --array=0-7}
INDEX=$((SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-0}))

# --resume on every run: the first run of a shard has nothing to skip, a rerun skips what it
# committed before it was stopped. Samples of other shards are never touched.
exec "$HSLAKE" capture --model "$MODEL" --input "$INPUT" --output "$OUTPUT" \
  --layers "$LAYERS" --final-norm --device "$DEVICE" --tp "$TP" --dtype "$DTYPE" \
  --shard "$INDEX/$SHARDS" --resume --no-progress
