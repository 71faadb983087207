#!/usr/bin/env bash
# GPU check of the data plane, in two phases:
#
#   scripts/gpu-check.sh build   # here (cargo, nvcc): builds the release test binaries
#                                # and the sweep, copies them into gpu-carry/
#   scripts/gpu-check.sh run     # on the GPU machine (no cargo, no network), from the
#                                # repo root, using only gpu-carry/
#
# The one call that runs it on a GPU machine: the device tool's `run` with
#   command = "bash scripts/gpu-check.sh run"   and   carry = ["gpu-carry"]
# (or, on a shell there, from the repo root with gpu-carry/ copied along:
#   bash scripts/gpu-check.sh run             # full sweep
#   bash scripts/gpu-check.sh run --quick     # short sweep)
#
# `run` executes every carried test binary with `--nocapture --test-threads=1`
# (GPU tests print SKIP without a driver), then the sweep (4 KiB..2 MiB per block,
# 64..4096 blocks, both directions, each strategy; GB/s and % of a large pinned
# memcpy measured in the same run). Pass `--quick` after `run` for a short sweep.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
carry="$here/gpu-carry"
phase="${1:-}"

build() {
    cd "$here"
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/target}"
    if [[ -z "${NVCC:-}" ]]; then
        NVCC="$(ls "$HOME"/.cache/kvoffload/nvcc-13.0.88/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -1 || true)"
        export NVCC
    fi
    export KVOFFLOAD_REQUIRE_NVCC=1   # the carried binaries must embed the kernels
    rm -rf "$carry"
    mkdir -p "$carry/tests"
    # Test binaries (lib unit tests + integration tests).
    cargo test --release --no-run --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["kind"][0] + "-" + m["target"]["name"] + "\t" + m["executable"])
' | while IFS=$'\t' read -r name exe; do
        cp "$exe" "$carry/tests/$name"
        echo "carried test binary: $name"
    done
    # The sweep.
    cargo build --release --example gpu_sweep --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_sweep":
        print(m["executable"])
' | while read -r exe; do cp "$exe" "$carry/gpu_sweep"; echo "carried sweep: gpu_sweep"; done
    [[ -x "$carry/gpu_sweep" ]] || { echo "gpu-check: the sweep was not built" >&2; exit 1; }
    du -sh "$carry"
    echo
    echo "Run on the GPU machine, from the repo root, carrying gpu-carry/ (device tool: carry=[\"gpu-carry\"]):"
    echo "  bash scripts/gpu-check.sh run            # or: bash scripts/gpu-check.sh run --quick"
}

run() {
    cd "$here"
    [[ -d "$carry/tests" ]] || { echo "gpu-check: no gpu-carry/ (run 'scripts/gpu-check.sh build' first)" >&2; exit 1; }
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
        for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/local/cuda/compat; do
            [[ -d "$d" ]] && ls "$d"/libcuda.so* >/dev/null 2>&1 && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
        done
    fi
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    local status=0
    for t in "$carry"/tests/*; do
        echo "=== $(basename "$t")"
        "$t" --nocapture --test-threads=1 || status=1
    done
    local table="${OUT:-$carry}/strategy-table.json"
    echo "=== gpu_sweep ${2:-} --write-table $table"
    "$carry/gpu_sweep" ${2:-} --write-table "$table" || status=1
    exit $status
}

case "$phase" in
    build) build ;;
    run) run "$@" ;;
    *) echo "usage: scripts/gpu-check.sh build|run [--quick]" >&2; exit 2 ;;
esac
