#!/usr/bin/env bash
# The embedded engine's throughput on one GPU (benchmarks/engine_throughput.py): both KV paths against HF
# generate on a random Qwen3-shaped bf16 model. On the lent H200 machine first run scripts/gpu-wheels.sh
# here and carry .whl; extra arguments go to the benchmark (e.g. --shape 1.7b --prompt 1024 --output 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
out=${OUT:-/tmp}
python3 benchmarks/engine_throughput.py --out "$out/engine-throughput.json" "$@"
