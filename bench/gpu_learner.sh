#!/usr/bin/env bash
# bench/learner.py on a GPU machine (reference: one H200): the asyncrl trainer's step against a plain PyTorch
# autocast loop on the same batch, Qwen2.5-0.5B shape, bf16, 8 x 2,048 tokens. Under 10 minutes.
#
#   here, once, online:  bash bench/gpu_learner.sh fetch   # DeepSpeed + what the GPU image lacks -> bench/wheels/
#   on the GPU machine:  bash bench/gpu_learner.sh         # carry bench/wheels (git ignores it)
#   the rank check only: bash bench/gpu_learner.sh ranks   # bench/gpu_rank_pin.py: the local plan pins a
#                                                         # learner rank to a device; it steps there on NCCL
#
# Writes bench/results/learner_gpu.json (every sequence 512 + 1,536 tokens, ZeRO-0),
# bench/results/learner_gpu_rl.json (answers of 64..1,536 tokens: padded by the plain loop,
# packed by asyncrl) and learner_gpu_zero2.json (the first at ZeRO-2), and copies them to the folder $OUT
# when it is set. The GPU image has torch,
# transformers, msgpack, prometheus-client and pyyaml; the wheels add DeepSpeed (pure Python,
# nothing compiled at run time: the trainer passes a torch AdamW), pydantic and pyzmq.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels

if [ "${1:-}" = fetch ]; then
    mkdir -p "$WHEELS"
    .venv/bin/python -m pip wheel -q --no-deps -w "$WHEELS" deepspeed==0.19.8
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection==0.4.5 \
        hjson==3.1.0 pyzmq==27.3.0 py-cpuinfo einops msgspec
    ls -l "$WHEELS"
    exit 0
fi

SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
if [ "${1:-}" = ranks ]; then
    timeout 300 python3 bench/gpu_rank_pin.py --out bench/results/gpu_rank_pin.json
    if [ -n "${OUT:-}" ]; then cp bench/results/gpu_rank_pin.json "$OUT"/; fi
    exit 0
fi
timeout 220 python3 bench/learner.py --device cuda --lengths full --warmup 2 --steps 5 \
    --out bench/results/learner_gpu.json || echo "the full-length run did not finish"
timeout 200 python3 bench/learner.py --device cuda --lengths rl --micro-batch-tokens 16384 --warmup 2 --steps 5 \
    --out bench/results/learner_gpu_rl.json || echo "the packed run did not finish"
timeout 150 python3 bench/learner.py --device cuda --lengths full --zero-stage 2 --warmup 2 --steps 3 \
    --out bench/results/learner_gpu_zero2.json || echo "the ZeRO-2 run did not finish"
if [ -n "${OUT:-}" ]; then cp bench/results/learner_gpu*.json "$OUT"/ 2>/dev/null || true; fi
