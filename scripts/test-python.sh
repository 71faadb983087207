#!/usr/bin/env bash
# The vLLM connector's tests: sets up the pinned vLLM venv (scripts/setup-vllm.sh,
# cached), builds and installs the kvoffload Python package from ./python into
# it (`pip install ./python`, maturin), and runs the pytest suite in
# python/tests against vLLM 0.33.0's real scheduler and worker connectors.
# Extra arguments go to pytest (e.g. -k differential).
#   KVOFFLOAD_DIFF_SEEDS=N  widens the differential test by N seeds
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=$(scripts/setup-vllm.sh)
# maturin (the build backend) runs its own executable from the venv.
export PATH="$(dirname "$PY"):$PATH"
root="${KVOFFLOAD_VLLM_ROOT:-$HOME/.cache/kvoffload}"
# The binding's own Rust unit tests (next to its code in python/src), linked
# to the venv's libpython (maturin builds the extension module without it).
echo "test-python: the binding's Rust unit tests (cargo test in python/)"
libdir=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
(cd python && PYO3_PYTHON="$PY" LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --quiet)
echo "test-python: pip install ./python into $(dirname "$(dirname "$PY")")"
# No build isolation: maturin comes from the venv (pinned there), and the
# Rust build reuses python/target between runs.
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./python
# From outside the source tree, so the installed package is what is imported.
cd "$(mktemp -d)"
# Request-id sets iterate in Python's hash order: fixed, so a run repeats.
export PYTHONHASHSEED="${PYTHONHASHSEED:-1}"
export KVOFFLOAD_HF_HOME="$root/hf"
# -rs: a test that cannot run here (the CUDA round trip without a GPU)
# prints as skipped with its reason.
"$PY" -m pytest -q -rs -p no:cacheprovider "$repo/python/tests" "$@"
