#!/usr/bin/env bash
# Installs Debian's g++ when no C++ compiler is on PATH: nvcc compiles the
# kernels' host side with it, and tests/kernel_emulation.rs builds the copy
# kernels as host C++ with it to run their code on the CPU. Idempotent.
# Without root or apt-get it says why and exits 0: nvcc then fails the
# build with its own message, and the emulation tests show as ignored.
# Usage: scripts/setup-cxx.sh
set -euo pipefail
if command -v "${CXX:-c++}" >/dev/null || command -v g++ >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "setup-cxx: no C++ compiler and no apt-get here: install g++ by hand" >&2
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null; then sudo=sudo; else
        echo "setup-cxx: no C++ compiler, not root and no sudo: install g++ by hand" >&2
        exit 0
    fi
fi
echo "setup-cxx: installing g++ (Debian)" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >&2 || true
$sudo apt-get install -y -q --no-install-recommends g++ >&2
g++ --version | head -n 1 >&2
