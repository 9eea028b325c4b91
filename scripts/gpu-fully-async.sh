#!/usr/bin/env bash
# Fully async vs sync on the GPU machine: trainer on cuda:0, engine on cuda:1 (a disaggregated placement).
# Usage there: OUT=<dir> scripts/gpu-fully-async.sh   (carry .whl built by scripts/gpu-wheels.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/miles-gpu}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/miles ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} MILES_CACHE_DIR=/tmp/miles-cache HF_HUB_OFFLINE=1
export MILES_DISABLE_PLUGINS=broken
python3 benchmarks/fully_async.py --device cuda --no-plot --repeats "${REPEATS:-2}" --steps "${STEPS:-12}" \
    --out "$OUT" 2>&1 | grep -E "^repeat|^median|Error|error" | tee "$OUT/fully-async-cuda.log"
