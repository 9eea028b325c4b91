#!/usr/bin/env bash
# Runs the tests marked `gpu` on a machine with CUDA. On the lent H200 machine (no package index)
# first run scripts/gpu-wheels.sh here and carry .whl; this script installs them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -rA -q tests "$@"
