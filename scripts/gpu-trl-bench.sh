#!/usr/bin/env bash
# One GPU, the whole RL step: `miles run` against TRL's GRPOTrainer on the same random model and batch
# (benchmarks/trl_vs_miles_gpu.py). On the lent H200 machine first run scripts/gpu-wheels.sh here (it
# also collects TRL, datasets, dill and multiprocess) and carry .whl; extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
out=${OUT:-/tmp}
python3 benchmarks/trl_vs_miles_gpu.py --out "$out/trl-vs-miles-gpu.json" "$@"
