#!/usr/bin/env bash
# Collects, into .whl/, the wheels the GPU machine lacks (it has torch, transformers and pytest, and
# no package index): our own packages and the pure-Python dependencies of miles-core's engine.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
uv build --all-packages --wheel -o .whl -q
for d in tests/plugins/*/; do uv build --wheel -o .whl -q "$d"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pluggy stevedore click rich markdown-it-py mdurl pygments pydantic pydantic-core \
    annotated-types typing-inspection pyyaml httpx httpcore h11 anyio sniffio idna certifi \
    fastapi starlette uvicorn annotated-doc pytest-timeout
ls .whl | wc -l
