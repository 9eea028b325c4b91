#!/usr/bin/env bash
# Issue 19's GPU Measure in one call (at most 600 s): the diffusion engine's images per second beside
# diffusers' StableDiffusion3Pipeline on an SD3.5-medium-shaped random model, the rollout step with and
# without pipelining against a CUDA engine process, and the diffusion GPU tests.
# Here first: rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap && (cd .snap && bash scripts/gpu-wheels.sh)
# then run with carry [".snap"] and command: cd .snap && OUT=$OUT bash scripts/gpu-diffusion.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-diffusion}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 DIFFUSERS_VERBOSITY=error OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

timeout "${TESTS_S:-60}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -rA -q tests/diffusion \
    2>&1 | tee "$out/tests-diffusion.log"
timeout "${BENCH_S:-330}" python3 benchmarks/diffusion_gpu.py --parts "${DIFF_PARTS:-images,rollout}" --out "$out/diffusion-gpu.json" 2>&1 \
    | grep -v "it/s\]" | tee "$out/diffusion-gpu.log"
if [ -n "${GUIDANCE:-}" ]; then
    timeout "${GUIDANCE_S:-150}" python3 benchmarks/diffusion_gpu.py --parts images --guidance "$GUIDANCE" \
        --out "$out/diffusion-gpu-cfg.json" 2>&1 | grep -v "it/s\]" | tee "$out/diffusion-gpu-cfg.log"
fi
if [ -n "${ENGINE_1024:-}" ]; then  # issue 14's 1,024-token cells beside HF generate
    timeout "${ENGINE_1024_S:-90}" python3 benchmarks/engine_throughput.py --paths hf,paged --batches 64 \
        --prompt 1024 --output 1024 --out "$out/engine-1024.json" 2>&1 | tee "$out/engine-1024.log"
fi
