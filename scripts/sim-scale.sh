#!/usr/bin/env bash
# The main command at scale: runs `kvoffload sim --requests N` for each N given
# (default 2,000 to 1,000,000) and prints one markdown row per run: wall time,
# microseconds of wall time per request, peak resident memory, steps, leaks.
# Every row must show leaks 0 (the script exits 1 otherwise).
#
#   scripts/sim-scale.sh                 # 2000 5000 10000 20000 40000 100000 1000000
#   scripts/sim-scale.sh 2000 20000      # chosen sizes
#   SIM_ARGS="--seed 3" scripts/sim-scale.sh 2000
#   RUNS=3 scripts/sim-scale.sh 2000     # each size 3 times: the median wall (this
#                                        # VM's wall times vary by ±30 % run to run)
#
# Build first: cargo build --release (the script uses target/release/kvoffload).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/kvoffload
[ -x "$bin" ] || { echo "build first: cargo build --release" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs GNU time (/usr/bin/time; Debian package 'time')" >&2; exit 2; }
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(2000 5000 10000 20000 40000 100000 1000000)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
echo "| requests | wall | µs per request | peak RSS | steps | longest wait for progress (limit) | leaks |"
echo "|---|---|---|---|---|---|---|"
runs=${RUNS:-1}
for n in "${sizes[@]}"; do
    walls=()
    failed=0
    for ((i = 0; i < runs; i++)); do
        # shellcheck disable=SC2086
        if ! /usr/bin/time -f '%e %M' -o "$tmp/time" "$bin" sim --requests "$n" ${SIM_ARGS:-} \
            --report "$tmp/r.json" >"$tmp/out" 2>"$tmp/err"; then
            echo "| $n | failed: $(tail -n 1 "$tmp/err") | | | | | |"
            status=1
            failed=1
            break
        fi
        read -r wall rss_kb <"$tmp/time"
        walls+=("$wall")
    done
    [ "$failed" = 0 ] || continue
    python3 - "$n" "$rss_kb" "$tmp/r.json" "${walls[@]}" <<'PY' || status=1
import json, statistics, sys
n, rss_kb, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
walls = sorted(float(w) for w in sys.argv[4:])
wall = statistics.median(walls)
r = json.load(open(path))
leaks = r["leaks"]["total"]
shown = f"{wall:.2f} s" if len(walls) == 1 else f"{wall:.2f} s (median of {', '.join(f'{w:.2f}' for w in walls)})"
print(f"| {n:,} | {shown} | {wall / n * 1e6:.0f} | {rss_kb / 1024:.0f} MiB | {r['steps']:,} "
      f"| {r['longest_steps_without_progress']} ({r['progress_limit_steps']}) | {leaks} |")
sys.exit(1 if leaks != 0 or r["work"]["finished"] != n else 0)
PY
done
exit $status
