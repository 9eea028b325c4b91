#!/usr/bin/env bash
# One GPU-machine session: the GPU tests, the NCCL broadcast benchmark, then the default recipe on CUDA.
# Usage there: OUT=<dir> scripts/gpu-session.sh   (carry .whl built by scripts/gpu-wheels.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/miles-gpu}
mkdir -p "$OUT"
bash scripts/gpu-tests.sh 2>&1 | tee "$OUT/gpu-tests.log"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} MILES_CACHE_DIR=/tmp/miles-cache HF_HUB_OFFLINE=1
python3 benchmarks/nccl_broadcast.py --out "$OUT" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/nccl-broadcast.log"
start=$(date +%s.%N)
python3 -m miles run --set run.output_dir=/tmp/miles-gpu-runs --overwrite \
    --set engine.device=cuda --set fsdp.device=cuda --set tracking.tensorboard=false \
    --set tracking.console=false 2>&1 | tail -20 | tee "$OUT/default-recipe-cuda.log"
end=$(date +%s.%N)
echo "default recipe on cuda: wall $(python3 -c "print(round($end-$start,1))") s" | tee -a "$OUT/default-recipe-cuda.log"
cp /tmp/miles-gpu-runs/default/metrics.jsonl "$OUT/default-recipe-cuda-metrics.jsonl" 2>/dev/null || true
