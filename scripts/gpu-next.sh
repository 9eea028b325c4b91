#!/usr/bin/env bash
# The next GPU call (one command of at most 600 s), what waits longest first, each part under its own
# time limit so that a slow part cannot eat the others' time; every part writes under $OUT as it goes.
#   1. issue 17 + 18 Measure: FSDP / FSDP+LoRA / Megatron (SDPA, megatron attention, streaming) on the
#      1.7B shape, same batch, offload round trips (benchmarks/train_mfu.py);
#   2. the GPU tests written and never run: megatron (parity under both attentions, training, LoRA,
#      critic, streaming peak memory, R3), paged-engine LoRA, varlen attention;
#   3. issue 14: engine throughput, HF generate beside the paged engine with and without overlap.
# Here first: rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap && (cd .snap && bash scripts/gpu-wheels.sh)
# then run with carry [".snap"] and command: cd .snap && OUT=$OUT bash scripts/gpu-next.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-next}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
fit=""
if [ "${mem_mib:-0}" -lt 100000 ]; then fit="--micro-batch 4 --pack-tokens 8192"; fi  # an 80 GB H100

timeout "${MFU_S:-210}" python3 benchmarks/train_mfu.py --shape 1.7b \
    --configs padded-full,padded-lora,megatron,megatron-attn-megatron,megatron-streaming \
    --warmup 1 --steps 3 --offload-trips 2 --out "$out/train-mfu-1.7b.json" $fit 2>&1 | tee "$out/train-mfu-1.7b.log"

timeout "${TESTS_S:-190}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -rA -q \
    tests/megatron tests/lora/test_paged_lora_gpu.py tests/lora/test_lora_gpu.py 2>&1 | tee "$out/tests-megatron-lora.log"
timeout "${VARLEN_S:-40}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -rA -q tests -k varlen \
    2>&1 | tee "$out/tests-varlen.log"

timeout "${ENGINE_S:-110}" python3 benchmarks/engine_throughput.py --paths hf,paged-sync,paged --batches 64,256 \
    --out "$out/engine.json" 2>&1 | tee "$out/engine.log"
