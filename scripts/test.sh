#!/usr/bin/env bash
# The test command: sets up everything a fresh machine needs (a C++ compiler
# and the pinned nvcc;
# Debian's redis-server for the remote tier's tests; the pinned vLLM in a
# cached venv), builds with the CUDA kernels really
# compiled, runs the whole Rust test suite, then the vLLM connector's tests
# (scripts/test-python.sh: kvoffload's KV connector inside vLLM 0.33.0).
# Tests that need what the machine lacks (a GPU; redis-server where it cannot
# be installed) are counted as ignored by cargo, each with its reason.
# Extra arguments go to `cargo test`. KVOFFLOAD_SKIP_VLLM=1 leaves the vLLM
# tests out (they print as not run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-cxx.sh
NVCC=$(scripts/setup-nvcc.sh)
export NVCC
export KVOFFLOAD_REQUIRE_NVCC=1
scripts/setup-redis.sh
# The Redis tests run where the server is, and show as ignored elsewhere.
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    export KVOFFLOAD_REDIS_TESTS=1
else
    export KVOFFLOAD_REDIS_TESTS=0
fi
cargo test "$@"
if [ "${KVOFFLOAD_SKIP_VLLM:-0}" = 1 ]; then
    echo "SKIP: vLLM connector tests (python/tests) not run: KVOFFLOAD_SKIP_VLLM=1"
else
    scripts/test-python.sh
fi
