#!/usr/bin/env bash
# The memory model checked on one GPU (reference: an H100 or H200): a 0.5 B and a 1.5 B learner
# step, measured peaks (torch.cuda.max_memory_allocated over the allocated bytes before the model)
# beside the predicted ones (bench/memory.py measure --device cuda). Under 10 minutes.
#
#   here, once, online:  bash bench/gpu_learner.sh fetch   # DeepSpeed + what the GPU image lacks -> bench/wheels/
#   on the GPU machine:  bash bench/gpu_memory.sh          # carry bench/wheels (git ignores it)
#
# Appends to bench/results/memory_measured_gpu.json and copies it to $OUT when that is set.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OUTFILE=bench/results/memory_measured_gpu.json
run() { timeout 240 python3 bench/memory.py measure --device cuda --out "$OUTFILE" --dtype bf16 --steps 3 "$@" \
    || echo "did not finish: $*"; }
run --shape qwen2.5-0.5b --zero-stage 2 --micro-batch 4 --seq-len 2048 --bucket-elements none
run --shape qwen2.5-0.5b --zero-stage 3 --micro-batch 4 --seq-len 2048 --bucket-elements none
run --shape qwen2.5-1.5b --zero-stage 3 --micro-batch 2 --seq-len 2048 --bucket-elements none --gradient-checkpointing true
if [ -n "${OUT:-}" ]; then cp "$OUTFILE" "$OUT"/ 2>/dev/null || true; fi
