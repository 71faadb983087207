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
# Carried: the library's unit tests, tests/gpu.rs and tests/cli.rs (the CPU
# suites run in CI), the kvoffload binary and the Python binding.
# `run` gives every step its own timeout, cut to what is left of 460 s,
# shows every step's output, fails on any failed or timed-out step, and ends
# with a summary of the steps and one table of the copies. It executes every
# carried test binary with `--nocapture --test-threads=1`,
# then its `gpu_*` tests, which binaries built without a driver #[ignore]
# (`--ignored gpu_`; they print SKIP where no device opens), then
#   kvoffload bench --backend cuda --json --contend --calibrate $OUT/strategy-table.json
# (4 KiB..2 MiB per block, 64..4096 blocks, cross-layer and 16 tensors per
# block, both directions, each strategy; GB/s and fraction of a large pinned
# memcpy measured in the same run; every point's bytes checked against their
# source; each strategy also beside a train of compute kernels: its GB/s
# there and the compute slowdown, which the calibrated table weighs; rows in
# $OUT/bench-cuda.json, the table in $OUT/strategy-table.json), then
#   kvoffload bench --backend cuda --quick --tensors 1 --contend --sweep-launch --sweep-batch-overlap --sweep-ring --json --calibrate
# (the kernel strategy with 4..64 CTAs and 16..256 KiB pieces, batch DMA
# with the prefer-overlap-with-compute flag, kernel_graph jobs pipelined
# through rings of 2..16 tables; rows in $OUT/bench-launch.json, the fastest
# shape per point on stderr, the tuning they support in
# $OUT/strategy-table-tuned.json), then
#   kvoffload sim --backend cuda            (default strategy table)
#   kvoffload sim --backend cuda --strategy-table $OUT/strategy-table.json
#   kvoffload sim --backend cuda --strategy-table $OUT/strategy-table-tuned.json
# (summaries in $OUT/sim-cuda*.json; exit 1 on any leak or byte mismatch),
#   kvoffload sim --backend cuda --nodes 2 --remote-tier redis://127.0.0.1:PORT
# (the remote tier written from and fetched into the pinned pool, against the
# Debian redis-server carried from the build machine with the libraries it
# links that are not glibc's; shown as SKIP, with the reason, where it does
# not start there), and the vLLM
# connector's binding over device memory (python/tests/binding_roundtrip.py
# --backend cuda: store, wipe, load back, compare; no vLLM or torch needed;
# once more with a strategy table forcing the kernel, once with the pinned
# pool placed on the first NUMA node, which prints where its pages are).
# Pass `--quick` after
# `run` for a short sweep and short sims.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
carry="$here/gpu-carry"
phase="${1:-}"

# Runs `cargo ARGS --message-format=json...`: the compiler's errors and
# warnings (rendered) and cargo's progress go to stderr, never hidden; stdout
# gets one "kind-name<TAB>test|bin<TAB>path" line per executable artifact.
# Under `set -o pipefail` a failed build fails the caller.
cargo_artifacts() {
    cargo "$@" --message-format=json-diagnostic-rendered-ansi | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    reason = m.get("reason")
    if reason == "compiler-message" and m["message"].get("level") in ("error", "warning"):
        sys.stderr.write(m["message"].get("rendered") or "")
    elif reason == "compiler-artifact" and m.get("executable"):
        kind = "test" if m.get("profile", {}).get("test") else "bin"
        print(m["target"]["kind"][0] + "-" + m["target"]["name"] + "\t" + kind + "\t" + m["executable"])
'
}

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
    # Test binaries (lib unit tests + integration tests): only what touches
    # CUDA (the library's unit tests, tests/gpu.rs, tests/cli.rs for sim and
    # bench on the CUDA backend); the CPU suites run in CI.
    cargo_artifacts test --release --no-run | while IFS=$'\t' read -r name kind exe; do
        case "$kind:$name" in
            test:lib-kvoffload | test:test-gpu | test:test-cli)
                cp "$exe" "$carry/tests/$name"
                echo "carried test binary: $name"
                ;;
        esac
    done
    for t in lib-kvoffload test-gpu test-cli; do
        [[ -x "$carry/tests/$t" ]] || { echo "gpu-check: the test binary $t was not built" >&2; exit 1; }
    done
    # The CLI (bench and sim on the CUDA backend).
    cargo_artifacts build --release --bin kvoffload | while IFS=$'\t' read -r name kind exe; do
        if [[ "$kind:$name" == "bin:bin-kvoffload" ]]; then
            cp "$exe" "$carry/kvoffload"
            echo "carried binary: kvoffload"
        fi
    done
    [[ -x "$carry/kvoffload" ]] || { echo "gpu-check: the kvoffload binary was not built" >&2; exit 1; }
    # The vLLM connector's binding (kvoffload._native, CUDA worker included)
    # and its store-wipe-load round trip, which needs neither vLLM nor torch.
    # Its own target folder, whatever CARGO_TARGET_DIR says (the copy below
    # must be the library just built, not a stale one).
    (cd python && CARGO_TARGET_DIR="$here/python/target" cargo build --release --lib)
    mkdir -p "$carry/python/kvoffload"
    cp python/target/release/lib_native.so "$carry/python/kvoffload/_native.abi3.so"
    cp python/kvoffload/__init__.py "$carry/python/kvoffload/"
    cp python/tests/binding_roundtrip.py "$carry/python/"
    echo "carried: the Python binding and python/tests/binding_roundtrip.py"
    carry_redis
    du -sh "$carry"
    echo
    echo "Run on the GPU machine, from the repo root, carrying gpu-carry/ (device tool: carry=[\"gpu-carry\"]):"
    echo "  bash scripts/gpu-check.sh run            # or: bash scripts/gpu-check.sh run --quick"
}

# Carries this machine's redis-server (Debian's; scripts/setup-redis.sh
# installs it) and the shared libraries it links, glibc's own left out (the
# GPU machine's are used), for the remote tier's CUDA sim. Nothing carried,
# and the run step shows SKIP, where it is not installed.
carry_redis() {
    local exe
    exe=$(command -v redis-server || true)
    if [[ -z "$exe" ]]; then
        echo "not carried: redis-server (not installed here: scripts/setup-redis.sh)"
        return
    fi
    mkdir -p "$carry/redis/lib"
    # redis-server is a link to redis-check-rdb: the name chooses the mode.
    cp "$(readlink -f "$exe")" "$carry/redis/redis-server"
    local lib
    for lib in $(ldd "$exe" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'); do
        case "$(basename "$lib")" in
            libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
            *) cp -L "$lib" "$carry/redis/lib/" ;;
        esac
    done
    echo "carried: redis-server ($("$exe" --version | grep -o 'v=[0-9.]*')) and $(ls "$carry/redis/lib" | wc -l) libraries ($(du -sh "$carry/redis" | cut -f1))"
}

# Starts the carried redis-server on a free loopback port; prints the port,
# or nothing (and why, on stderr) if it does not start.
start_redis() {
    local port=6479 dir
    dir=$(mktemp -d)
    [[ -x "$carry/redis/redis-server" ]] || { echo "no redis-server carried" >&2; return; }
    LD_LIBRARY_PATH="$carry/redis/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$carry/redis/redis-server" --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" \
        --appendonly no --daemonize yes --logfile "$dir/redis.log" >&2 || { echo "redis-server did not start" >&2; return; }
    local i
    for i in $(seq 1 100); do
        if (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then echo "$port"; return; fi
        sleep 0.05
    done
    echo "redis-server did not answer on $port: $(tail -n 3 "$dir/redis.log" 2>/dev/null)" >&2
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
    local summary=()
    # One step: its own timeout, its output shown, its status kept (a failed
    # or timed-out step fails the check, never hidden); the summary at the end.
    # Seconds for all the steps: each step's limit is cut to what is left, so
    # the check ends within 8 minutes, summary included (the steps'
    # own limits add up to more; a hung step cannot take the rest).
    local budget=460
    step() {
        local name=$1 limit=$2
        shift 2
        local left=$((budget - SECONDS))
        if (( left < 15 )); then
            status=1
            summary+=("$(printf '%-44s %-14s' "$name" "NOT RUN: past the ${budget}s budget")")
            return
        fi
        if (( limit > left )); then limit=$left; fi
        echo "=== [$name] (timeout ${limit}s) $*"
        local t0=$SECONDS rc=0
        timeout --kill-after=10 "$limit" "$@" || rc=$?
        local verdict=ok
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then verdict="TIMEOUT"; elif [[ $rc -ne 0 ]]; then verdict="FAILED rc=$rc"; fi
        [[ $verdict == ok ]] || status=1
        summary+=("$(printf '%-44s %-14s %4ss' "$name" "$verdict" "$((SECONDS - t0))")")
    }
    export KVOFFLOAD_BIN="$carry/kvoffload"   # tests/cli.rs runs the carried binary
    local t
    for t in "$carry"/tests/*; do
        step "$(basename "$t")" 90 "$t" --nocapture --test-threads=1
        # The GPU tests (gpu_*) are #[ignore]d in binaries built without a
        # driver (here: built on the dev machine); this is where they run.
        if [ "$("$t" --list --ignored 2>/dev/null | grep -c '^gpu_\|::gpu_')" -gt 0 ]; then
            step "$(basename "$t") --ignored gpu_" 150 "$t" --ignored gpu_ --nocapture --test-threads=1
        fi
    done
    local out="${OUT:-$carry}"
    mkdir -p "$out"
    local table="$out/strategy-table.json"
    local quick="" requests=2000
    if [[ "${2:-}" == "--quick" ]]; then quick="--quick"; requests=300; fi
    step "kvoffload info" 30 "$carry/kvoffload" info
    # shellcheck disable=SC2016  # expanded by the inner shell
    step "bench --backend cuda --contend --calibrate" 200 bash -c \
        '"$1" bench --backend cuda --json $2 --contend --calibrate "$3" --csv "$4" > "$5"' _ \
        "$carry/kvoffload" "$quick" "$table" "$out/bench-cuda.csv" "$out/bench-cuda.json"
    # shellcheck disable=SC2016  # expanded by the inner shell
    step "bench --sweep-launch/-batch-overlap/-ring" 100 bash -c \
        '"$1" bench --backend cuda --json --quick --tensors 1 --contend --sweep-launch --sweep-batch-overlap --sweep-ring --calibrate "$3" > "$2"' _ \
        "$carry/kvoffload" "$out/bench-launch.json" "$out/strategy-table-tuned.json"
    if command -v python3 >/dev/null; then
        step "binding_roundtrip.py --backend cuda" 60 env PYTHONPATH="$carry/python" \
            python3 "$carry/python/binding_roundtrip.py" --backend cuda
        # The pinned pool placed on the first NUMA node online (cuMemHostAlloc
        # on a thread bound there): its line says where the sampled pages are.
        numa_node=$(cut -d, -f1 /sys/devices/system/node/online 2>/dev/null | cut -d- -f1)
        step "binding_roundtrip.py cuda, pool on a node" 60 env PYTHONPATH="$carry/python" \
            python3 "$carry/python/binding_roundtrip.py" --backend cuda --numa "${numa_node:-0}"
        # A synchronous load: the bytes must be back when start_transfers returns.
        step "binding_roundtrip.py --backend cuda --sync" 60 env PYTHONPATH="$carry/python" \
            python3 "$carry/python/binding_roundtrip.py" --backend cuda --sync
        # Two workers of the same KV over one shared host region registered
        # with the driver (vLLM's replicated MLA layout): the second never
        # copies a store and must load the first one's bytes.
        step "binding_roundtrip.py cuda, shared region" 60 env PYTHONPATH="$carry/python" \
            python3 "$carry/python/binding_roundtrip.py" --backend cuda --shared-region
        # The same written by turns of host chunk (the connector's default
        # for replicated KV): each worker copies half, loads the other's half.
        step "binding_roundtrip.py cuda, shared, turns" 60 env PYTHONPATH="$carry/python" \
            python3 "$carry/python/binding_roundtrip.py" --backend cuda --shared-region --turns
        # Again with a table given to the worker: every job on the kernel,
        # a tuned launch shape and a ring of 2 (the binding's table path).
        printf '%s\n' '{"rules": [], "fallback": "kernel", "tuning": {"kernel_ctas": 16, "ring_slots": 2}}' \
            > "$out/kernel-table.json"
        step "binding_roundtrip.py --backend cuda (table)" 60 env PYTHONPATH="$carry/python" \
            python3 "$carry/python/binding_roundtrip.py" --backend cuda --strategy-table "$out/kernel-table.json"
    else
        summary+=("$(printf '%-44s %-14s' "binding_roundtrip.py --backend cuda" "SKIP: no python3")")
    fi
    step "sim --backend cuda --requests $requests" 90 \
        "$carry/kvoffload" sim --backend cuda --requests "$requests" --report "$out/sim-cuda.json"
    if [[ -f "$table" ]]; then
        step "sim --backend cuda (calibrated table)" 90 \
            "$carry/kvoffload" sim --backend cuda --requests "$requests" --strategy-table "$table" \
            --report "$out/sim-cuda-calibrated.json"
    fi
    if [[ -f "$out/strategy-table-tuned.json" ]]; then
        step "sim --backend cuda (tuned table)" 90 \
            "$carry/kvoffload" sim --backend cuda --requests "$requests" \
            --strategy-table "$out/strategy-table-tuned.json" --report "$out/sim-cuda-tuned.json"
    fi
    local rport
    rport=$(start_redis 2>"$out/redis-start.err" || true)
    if [[ -n "$rport" ]]; then
        step "sim --backend cuda --nodes 2 --remote-tier" 90 \
            "$carry/kvoffload" sim --backend cuda --requests "$requests" --nodes 2 \
            --remote-tier "redis://127.0.0.1:$rport" --report "$out/sim-cuda-remote.json"
        # The server's own shutdown (the carried client is not needed).
        # shellcheck disable=SC2016
        bash -c 'exec 3<>/dev/tcp/127.0.0.1/$1; printf "SHUTDOWN NOSAVE\r\n" >&3; sleep 0.2' _ "$rport" || true
    else
        summary+=("$(printf '%-44s %-14s' "sim --backend cuda --remote-tier" "SKIP: $(tr '\n' ' ' < "$out/redis-start.err")")")
    fi
    echo
    echo "=== summary: steps"
    printf '%s\n' "${summary[@]}"
    echo
    echo "=== summary: copies (bench --backend cuda; 'verified': bytes of the point's last job checked against the source)"
    if [[ -s "$out/bench-cuda.json" ]] && command -v python3 >/dev/null; then
        python3 - "$out/bench-cuda.json" "$out/bench-launch.json" <<'PY' || status=1
import json, os, sys
rows = json.load(open(sys.argv[1]))
def opt(v, fmt):
    return format(v, fmt) if v is not None else "-"
print(f"{'strategy':<13} {'dir':<6} {'block':>9} {'blocks':>6} {'tensors':>7} {'GB/s':>8} {'of ceiling':>10} {'submit_us':>9} {'verified':>11} {'contended':>9} {'slowdown':>8}")
for r in sorted(rows, key=lambda r: (r["strategy"], r["direction"], r.get("tensors", 1), r["block_bytes"], r["blocks"])):
    print(f"{r['strategy']:<13} {r['direction']:<6} {r['block_bytes']:>9} {r['blocks']:>6} {r.get('tensors', 1):>7} {r['gbps']:>8.2f} {r['fraction_of_ceiling']:>10.2f} {r.get('submit_us', 0):>9.1f} "
          f"{opt(r.get('verified_bytes'), 'd'):>11} {opt(r.get('contended_gbps'), '.2f'):>9} {opt(r.get('compute_slowdown'), '+.3f'):>8}")
unchecked = [r for r in rows if r.get("verified_bytes") is None]
print(f"rows: {len(rows)}, bytes verified on {len(rows) - len(unchecked)}")
if os.path.exists(sys.argv[2]) and os.path.getsize(sys.argv[2]) > 0:
    launch_rows = json.load(open(sys.argv[2]))
    best = {}
    for r in launch_rows:
        if r["strategy"] != "kernel":
            continue
        k = (r["direction"], r["block_bytes"], r["blocks"])
        if k not in best or r["gbps"] > best[k]["gbps"]:
            best[k] = r
    print()
    print("=== summary: fastest kernel launch shape per point (bench --sweep-launch)")
    for k in sorted(best):
        r = best[k]
        print(f"{k[0]:<6} {k[1]:>9} {k[2]:>6} {r.get('launch', 'default'):<24} {r['gbps']:>8.2f} GB/s"
              f"  contended {opt(r.get('contended_gbps'), '.2f')} GB/s, slowdown {opt(r.get('compute_slowdown'), '+.3f')}")
    print()
    print("=== summary: batch DMA, default vs prefer_overlap (bench --sweep-batch-overlap)")
    for r in sorted((r for r in launch_rows if r["strategy"] == "batch_dma"),
                    key=lambda r: (r["direction"], r["block_bytes"], r["blocks"], r.get("launch", ""))):
        print(f"{r['direction']:<6} {r['block_bytes']:>9} {r['blocks']:>6} {r.get('launch', 'default'):<15} {r['gbps']:>8.2f} GB/s"
              f"  contended {opt(r.get('contended_gbps'), '.2f')} GB/s, slowdown {opt(r.get('compute_slowdown'), '+.3f')}")
    print()
    print("=== summary: kernel_graph pipelined through rings of tables (bench --sweep-ring; GB/s over wall time)")
    for r in sorted((r for r in launch_rows if r.get("launch", "").startswith("ring=")),
                    key=lambda r: (r["direction"], r["block_bytes"], r["blocks"], int(r["launch"].split(",")[0][5:]))):
        print(f"{r['direction']:<6} {r['block_bytes']:>9} {r['blocks']:>6} {r['launch']:<40} {r['gbps']:>8.2f} GB/s")
PY
    else
        echo "no bench rows (the bench step failed)"
    fi
    echo "gpu-check: $([[ $status -eq 0 ]] && echo PASS || echo FAIL)"
    exit $status
}

case "$phase" in
    build) build ;;
    run) run "$@" ;;
    *) echo "usage: scripts/gpu-check.sh build|run [--quick]" >&2; exit 2 ;;
esac
