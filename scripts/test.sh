#!/usr/bin/env bash
# The test command: sets up everything a fresh machine needs (the pinned nvcc;
# the pinned vLLM in a cached venv), builds with the CUDA kernels really
# compiled, runs the whole Rust test suite, then the vLLM connector's tests
# (scripts/test-python.sh: kvoffload's KV connector inside vLLM 0.33.0).
# GPU tests print "SKIP: <reason>" and pass where there is no NVIDIA driver.
# Extra arguments go to `cargo test`. KVOFFLOAD_SKIP_VLLM=1 leaves the vLLM
# tests out (they print as not run).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=$(scripts/setup-nvcc.sh)
export NVCC
export KVOFFLOAD_REQUIRE_NVCC=1
cargo test "$@"
if [ "${KVOFFLOAD_SKIP_VLLM:-0}" = 1 ]; then
    echo "SKIP: vLLM connector tests (python/tests) not run: KVOFFLOAD_SKIP_VLLM=1"
else
    scripts/test-python.sh
fi
