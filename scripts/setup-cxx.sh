#!/usr/bin/env bash
# Installs Debian's g++ when no C++ compiler is on PATH: nvcc compiles the
# kernels' host side with it, and tests/kernel_emulation.rs builds the copy
# kernels as host C++ with it to run their code on the CPU. Idempotent.
# Where it cannot be installed it says why and exits 0: nvcc then fails the
# build with its own message, and the emulation tests show as ignored.
# Usage: scripts/setup-cxx.sh
set -euo pipefail
if command -v "${CXX:-c++}" >/dev/null || command -v g++ >/dev/null; then
    exit 0
fi
# Exit 3: cannot be installed here (said why); any other failure fails.
"$(dirname "$0")/apt-install.sh" setup-cxx g++ || { rc=$?; [ "$rc" = 3 ] && exit 0; exit "$rc"; }
g++ --version | head -n 1 >&2
