#!/usr/bin/env bash
# Collects, into .whl/, the wheels the GPU machine lacks (it has torch, transformers and pytest, and
# no package index): our own packages and the pure-Python dependencies of miles-core's engine, at the
# versions pinned in uv.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
NEEDED="pluggy stevedore click rich markdown-it-py mdurl pygments pydantic pydantic-core annotated-types
typing-inspection pyyaml httpx httpcore h11 anyio sniffio idna certifi fastapi starlette uvicorn
annotated-doc pytest-timeout aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs
opentelemetry-api importlib-metadata zipp xxhash zstandard orjson
trl datasets dill multiprocess megatron-core diffusers"
rm -rf .whl && mkdir -p .whl
uv build --all-packages --wheel -o .whl -q
for d in tests/plugins/*/; do uv build --wheel -o .whl -q "$d"; done
pins=$(uv export --frozen --no-hashes --all-groups --format requirements-txt | sed 's/ *;.*//' | grep '==')
specs=()
for name in $NEEDED; do
    # A package pinned per Python version (megatron-core) is listed once per pin: take the last,
    # the newest Python's (the GPU machine runs 3.12).
    spec=$(grep -i "^${name}==" <<<"$pins" | tail -n1 || true)
    if [ -n "$spec" ]; then specs+=("$spec"); fi
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${specs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
ls .whl | wc -l
