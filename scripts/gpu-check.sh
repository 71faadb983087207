#!/usr/bin/env bash
# GPU check of the data plane, in two phases:
#
#   scripts/gpu-check.sh build   # here (cargo, nvcc): builds the release test binaries
#                                # and the kvoffload binary, copies them into gpu-carry/
#   scripts/gpu-check.sh run     # on the GPU machine (no cargo, no network), from the
#                                # repo root, using only gpu-carry/
#
# The one call that runs it on a GPU machine: the device tool's `run` with
#   command = "bash scripts/gpu-check.sh run"   and   carry = ["gpu-carry"]
# (or, on a shell there, from the repo root with gpu-carry/ copied along:
#   bash scripts/gpu-check.sh run             # full sweep
#   bash scripts/gpu-check.sh run --quick     # short sweep)
#
# `run` executes every carried test binary with `--nocapture --test-threads=1`,
# then its `gpu_*` tests, which binaries built without a driver #[ignore]
# (`--ignored gpu_`; they print SKIP where no device opens), then
#   kvoffload bench --backend cuda --json --calibrate $OUT/strategy-table.json
# (4 KiB..2 MiB per block, 64..4096 blocks, both directions, each strategy; GB/s
# and fraction of a large pinned memcpy measured in the same run; rows in
# $OUT/bench-cuda.json, the calibrated table in $OUT/strategy-table.json), then
#   kvoffload sim --backend cuda            (default strategy table)
#   kvoffload sim --backend cuda --strategy-table $OUT/strategy-table.json
# (summaries in $OUT/sim-cuda*.json; exit 1 on any leak), and the vLLM
# connector's binding over device memory (python/tests/binding_roundtrip.py
# --backend cuda: store, wipe, load back, compare; no vLLM or torch needed).
# Pass `--quick` after
# `run` for a short sweep and short sims.
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
    # The CLI (bench and sim on the CUDA backend).
    cargo build --release --bin kvoffload --message-format=json 2>/dev/null \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kvoffload" and "bin" in m["target"]["kind"]:
        print(m["executable"])
' | while read -r exe; do cp "$exe" "$carry/kvoffload"; echo "carried binary: kvoffload"; done
    [[ -x "$carry/kvoffload" ]] || { echo "gpu-check: the kvoffload binary was not built" >&2; exit 1; }
    # The vLLM connector's binding (kvoffload._native, CUDA worker included)
    # and its store-wipe-load round trip, which needs neither vLLM nor torch.
    (cd python && cargo build --release --lib)
    mkdir -p "$carry/python/kvoffload"
    cp python/target/release/lib_native.so "$carry/python/kvoffload/_native.abi3.so"
    cp python/kvoffload/__init__.py "$carry/python/kvoffload/"
    cp python/tests/binding_roundtrip.py "$carry/python/"
    echo "carried: the Python binding and python/tests/binding_roundtrip.py"
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
    export KVOFFLOAD_BIN="$carry/kvoffload"   # tests/cli.rs runs the carried binary
    for t in "$carry"/tests/*; do
        echo "=== $(basename "$t")"
        "$t" --nocapture --test-threads=1 || status=1
        # The GPU tests (gpu_*) are #[ignore]d in binaries built without a
        # driver (here: built on the dev machine); this is where they run.
        if [ "$("$t" --list --ignored 2>/dev/null | grep -c '^gpu_\|::gpu_')" -gt 0 ]; then
            echo "=== $(basename "$t") --ignored gpu_"
            "$t" --ignored gpu_ --nocapture --test-threads=1 || status=1
        fi
    done
    local out="${OUT:-$carry}"
    local table="$out/strategy-table.json"
    local quick="" requests=2000
    if [[ "${2:-}" == "--quick" ]]; then quick="--quick"; requests=300; fi
    "$carry/kvoffload" info || status=1
    echo "=== kvoffload bench --backend cuda --json $quick --calibrate $table"
    "$carry/kvoffload" bench --backend cuda --json $quick --calibrate "$table" \
        --csv "$out/bench-cuda.csv" >"$out/bench-cuda.json" || status=1
    python3 - "$out/bench-cuda.json" <<'PY' || true
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{'dir':<6} {'block':>9} {'blocks':>6} {'strategy':<13} {'GB/s':>8} {'frac':>6} {'submit_us':>9}")
for r in rows:
    print(f"{r['direction']:<6} {r['block_bytes']:>9} {r['blocks']:>6} {r['strategy']:<13} {r['gbps']:>8.2f} {r['fraction_of_ceiling']:>6.2f} {r.get('submit_us', 0):>9.1f}")
PY
    echo "=== the vLLM connector's binding on CUDA: binding_roundtrip.py --backend cuda"
    if command -v python3 >/dev/null; then
        PYTHONPATH="$carry/python" python3 "$carry/python/binding_roundtrip.py" --backend cuda || status=1
    else
        echo "SKIP: binding round trip: no python3 on this machine"
    fi
    echo "=== kvoffload sim --backend cuda --requests $requests"
    "$carry/kvoffload" sim --backend cuda --requests "$requests" --report "$out/sim-cuda.json" || status=1
    if [[ -f "$table" ]]; then
        echo "=== kvoffload sim --backend cuda --requests $requests --strategy-table $table"
        "$carry/kvoffload" sim --backend cuda --requests "$requests" --strategy-table "$table" \
            --report "$out/sim-cuda-calibrated.json" || status=1
    fi
    exit $status
}

case "$phase" in
    build) build ;;
    run) run "$@" ;;
    *) echo "usage: scripts/gpu-check.sh build|run [--quick]" >&2; exit 2 ;;
esac
