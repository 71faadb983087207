#!/usr/bin/env python3
"""Widens the hybrid corpus' check: records vLLM 0.33.0's connector on N more
seeds (cycling through test_hybrid_vllm.py's configurations) into a folder
that is not committed, runs kvoffload's connector (its scheduler side) on
each and compares it with vLLM's run step by step (as
`test_kvoffload_answers_as_vllm_on_hybrid_configs` does on the committed
corpus), runs the seed end to end with kvoffload's workers and checks every
running request's KV in every group after every step (as
`test_hybrid_worker.py` does), and leaves the folder for `tests/hybrid_corpus.rs` to check the
core's hybrid lookup, load plan and store selection against.

Run with the cached vLLM venv's python (scripts/setup-vllm.sh prints it), the
kvoffload package installed in it (scripts/test-python.sh does):
    PY=$(scripts/setup-vllm.sh)
    PYTHONHASHSEED=1 $PY scripts/widen-hybrid.py 40 /tmp/hybrid-wide
    KVOFFLOAD_HYBRID_CORPUS=/tmp/hybrid-wide cargo test --release --test hybrid_corpus
`--only S` cycles through the configurations whose group names contain S
(`--only local`: the chunked-local ones; `--only eagle`: those with
EAGLE draft groups; `--only hash`: those whose block hashes are finer
than the blocks; `--only sizes`: those whose groups have different block
sizes; `--only left-out`: those with groups vLLM's connector leaves out),
from seed 30,000.
`--stress K` runs K busy processes beside it (`cpu_stress.py`): races
between the copies and the model's writes show only when the cores are
busy.
Exits 1 if kvoffload answered a step differently or moved a wrong byte.
"""

import os
import sys

import cpu_stress

tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests")
sys.path.insert(0, tests)
import conftest  # noqa: E402,F401  (vLLM's environment: CPU, offline)
import test_hybrid_vllm as hy  # noqa: E402
import test_hybrid_worker as hw  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> int:
    try:
        stress, args = cpu_stress.parse(sys.argv[1:])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    only = None
    if len(args) == 4 and args[2] == "--only":
        only, args = args[3], args[:2]
    if len(args) != 2 or not args[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    n, out = int(args[0]), Path(args[1])
    cases = hy.select_cases(only)
    if not cases:
        print(f"no configuration's groups contain {only!r}", file=sys.stderr)
        return 2
    base = 10_000 if only is None else 30_000
    with cpu_stress.busy(stress):
        return widen(n, out, cases, base)


def widen(n: int, out: Path, cases: list, base: int) -> int:
    same = differ = wrong = stalled = 0
    moved = {"checked": 0, "loads": 0, "window_loads": 0, "stores": 0, "holes": 0}
    for k in range(n):
        _, specs, extra, opts, delay = cases[k % len(cases)]
        seed = base + k
        try:
            steps, derived = hy.record(seed, specs, extra, opts, delay)
        except AssertionError as e:
            # vLLM's own run did not end (seen: requests holding blocks
            # while waiting for KV behind a head request that cannot be
            # allocated, in these small GPU pools): nothing to compare.
            print(f"seed {seed} {specs}: not recorded: {e}", flush=True)
            continue
        hy.write_case(out / f"seed{seed}-{specs}.json.gz", seed, specs, extra, opts, delay, steps, derived)
        want = [hy.comparable(st, hy.first_index_modulus(specs, extra, opts)) for st in steps]
        got = hy.kvoffload_run(seed, specs, extra, opts, delay)
        diff = next((i for i, (w, g) in enumerate(zip(want, got)) if w != g), None)
        if diff is None and len(want) != len(got):
            diff = min(len(want), len(got))
        if diff is None:
            same += 1
            print(f"seed {seed} {specs}: {len(steps)} steps, kvoffload the same", flush=True)
        else:
            differ += 1
            print(f"seed {seed} {specs}: kvoffload differs at step {diff}", flush=True)
        try:
            seen = hw.worker_run(seed, specs, extra, opts)
        except hw.VllmStalled as e:
            stalled += 1
            print(f"seed {seed} {specs}: with workers: {e}", flush=True)
            continue
        except AssertionError as e:
            wrong += 1
            print(f"seed {seed} {specs}: with workers: {str(e)[:300]}", flush=True)
            continue
        for k2 in moved:
            moved[k2] += seen[k2]
    print(f"{same} seeds the same as vLLM, {differ} different", flush=True)
    print(
        f"with workers: {wrong} seeds with a wrong byte or a leak, {stalled} stalled in vLLM's scheduler "
        f"with kvoffload idle; {moved['checked']} tokens checked, "
        f"{moved['loads']} loads ({moved['window_loads']} into windowed groups), {moved['stores']} stores "
        f"({moved['holes']} holes kept in place)",
        flush=True,
    )
    return 1 if differ or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
