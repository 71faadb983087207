#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 nvcc from PyPI into a cached venv (idempotent)
# and prints the path of nvcc. The GPU machines run driver 580 (CUDA 13.0), so
# the PTX must be ISA 9.0: all four packages are pinned together.
# Usage: NVCC=$(scripts/setup-nvcc.sh)
set -euo pipefail
venv="${KVOFFLOAD_NVCC_VENV:-$HOME/.cache/kvoffload/nvcc-13.0.88}"
find_nvcc() { ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n 1; }
nvcc=$(find_nvcc || true)
if [ -z "$nvcc" ] || ! "$nvcc" --version 2>/dev/null | grep -q 'release 13.0'; then
  echo "setup-nvcc: installing nvcc 13.0.88 into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 >&2
  nvcc=$(find_nvcc)
fi
"$nvcc" --version | grep -q 'release 13.0' || { echo "setup-nvcc: $nvcc is not CUDA 13.0" >&2; exit 1; }
echo "$nvcc"
