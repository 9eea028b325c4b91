#!/usr/bin/env bash
# One call's worth of GPU work for the engine and training-step issues, in priority order, each part's
# log and JSON written under $OUT as it goes (a call stopped at its time limit still returns them):
#   1. the GPU tests of the paged engine, the FSDP attention/compile/offload paths (-k below);
#   2. engine throughput: HF generate, the paged engine reading every step, the paged engine overlapped;
#   3. FSDP MFU: padded, packed (miles_varlen), packed + compiled layers, with offload round trips,
#      and the old pageable offload beside them;
#   4. megatron (issue 17's Measure): FSDP and Megatron MFU on the same 0.6B and 1.7B models and batch,
#      Megatron with and without optimizer streaming (peak memory) and with megatron-core's own attention,
#      FSDP with a LoRA adapter (issue 18), with offload round trips; then the default recipe's RL stage with backend megatron on the GPU.
# Run here first: bash scripts/gpu-wheels.sh (and carry .whl). PARTS=tests,engine,mfu,megatron picks parts.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-perf}
mkdir -p "$out"
parts=${PARTS:-tests,engine,mfu}
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [[ $parts == *tests* ]]; then
    python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -rA -q tests \
        -k "${TESTS_K:-paged or varlen or compile or offload or moe or prefix}" 2>&1 | tee "$out/tests.log"
fi
if [[ $parts == *engine* ]]; then
    python3 benchmarks/engine_throughput.py --paths hf,paged-sync,paged --batches "${BATCHES:-1,64,256}" \
        --out "$out/engine.json" ${ENGINE_ARGS:-} 2>&1 | tee "$out/engine.log"
fi
if [[ $parts == *mfu* ]]; then
    # An 80 GB card (H100) does not hold the 16k-token micro-batches of the H200 figures: halve them.
    mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
    mfu_fit=""
    if [ "${mem_mib:-0}" -lt 100000 ]; then mfu_fit="--micro-batch 4 --pack-tokens 8192"; fi
    python3 benchmarks/train_mfu.py \
        --configs "${MFU_CONFIGS:-padded-full,packed-full,packed-full-compiled,padded-full-pageable}" \
        --warmup 2 --steps "${MFU_STEPS:-3}" --offload-trips 2 --out "$out/mfu.json" $mfu_fit 2>&1 | tee "$out/mfu.log"
fi
if [[ $parts == *megatron* ]]; then
    mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
    fit=""
    if [ "${mem_mib:-0}" -lt 100000 ]; then fit="--micro-batch 4 --pack-tokens 8192"; fi
    for shape in ${MEGATRON_SHAPES:-0.6b 1.7b}; do
        python3 benchmarks/train_mfu.py --shape "$shape" \
            --configs "${MEGATRON_CONFIGS:-padded-full,padded-lora,packed-full-compiled,megatron,megatron-attn-megatron,megatron-streaming}" \
            --warmup 2 --steps "${MFU_STEPS:-3}" --offload-trips 2 --out "$out/train-mfu-$shape.json" $fit 2>&1 \
            | tee "$out/train-mfu-$shape.log"
    done
    # The default recipe (a warm start on the CPU, then GRPO) with the RL stage on megatron on the GPU.
    python3 -m miles run --set backend=megatron --set megatron.params_dtype=float32 --set transport=colocated \
        --set engine.device=cuda --set run.output_dir="$out/megatron-run" --set tracking.console=false \
        2>&1 | tail -n 40 | tee "$out/megatron-run.log"
fi
