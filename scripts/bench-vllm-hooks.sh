#!/usr/bin/env bash
# Connector hook time per steady engine step, kvoffload's KvOffloadConnector
# against vLLM 0.33.0's OffloadingConnector, same workload, same run
# (python/bench/hook_time.py). Sets up the pinned vLLM venv and installs
# ./python into it first. Arguments go to hook_time.py
# (--requests 64,256,1024 --steps 64 --groups one|full+swa|full+mamba
# [--hash-tokens N] --json FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=$(scripts/setup-vllm.sh)
# maturin (the build backend) runs its own executable from the venv.
export PATH="$(dirname "$PY"):$PATH"
root="${KVOFFLOAD_VLLM_ROOT:-$HOME/.cache/kvoffload}"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./python
cd "$(mktemp -d)"
export PYTHONHASHSEED="${PYTHONHASHSEED:-1}" KVOFFLOAD_HF_HOME="$root/hf"
"$PY" "$repo/python/bench/hook_time.py" "$@"
