#!/usr/bin/env bash
# Everything waiting for a GPU in one call of at most 600 s, for when a session may get only one
# machine: gpu-next.sh (issues 14, 17, 18) then gpu-diffusion.sh's images part (issue 19), each part
# under a shorter limit, the results packed into one archive ($OUT/results.tgz: the device tool
# returns at most 8 files).
# Here first: rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap && (cd .snap && bash scripts/gpu-wheels.sh)
# then run with carry [".snap"] and command: cd .snap && OUT=$OUT bash scripts/gpu-all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:-/tmp/gpu-all}
mkdir -p "$final" /tmp/results/next /tmp/results/diffusion
pack() { tar czf "$final/results.tgz" -C /tmp results; }
trap pack EXIT
MFU_S=${MFU_S:-150} TESTS_S=${TESTS_S:-120} VARLEN_S=${VARLEN_S:-20} ENGINE_S=${ENGINE_S:-85} \
    OUT=/tmp/results/next bash scripts/gpu-next.sh
TESTS_S=${DIFF_TESTS_S:-25} BENCH_S=${DIFF_BENCH_S:-140} DIFF_PARTS=${DIFF_PARTS:-images} \
    OUT=/tmp/results/diffusion bash scripts/gpu-diffusion.sh
