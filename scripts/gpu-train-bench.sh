#!/usr/bin/env bash
# Training throughput and MFU of the FSDP backend alone (benchmarks/train_mfu.py) on one GPU: a random
# Qwen3-1.7B-shaped bf16 model, sequence 2048. On the lent H200 machine first run scripts/gpu-wheels.sh
# here and carry .whl; extra arguments go to the benchmark (e.g. --configs padded-full --samples 16).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
out=${OUT:-/tmp}
python3 benchmarks/train_mfu.py --out "$out/fsdp-mfu.json" "$@"
