#!/usr/bin/env bash
# The test command: sets up everything a fresh machine needs (the pinned nvcc),
# builds with the CUDA kernels really compiled, and runs the whole test suite.
# GPU tests print "SKIP: <reason>" and pass where there is no NVIDIA driver.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=$(scripts/setup-nvcc.sh)
export NVCC
export KVOFFLOAD_REQUIRE_NVCC=1
cargo test "$@"
