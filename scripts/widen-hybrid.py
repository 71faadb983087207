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
sizes; `--only left-out`: those with groups vLLM's connector leaves out;
`--only params`: those whose requests carry `kv_transfer_params`;
`--only partial`: those with Mamba states inside a block;
`--only partial-eagle`: those of them beside an EAGLE draft group;
`--only dcp`: those with decode context parallelism;
`--only spec`: those with speculative decoding;
`--only async-spec`: those of them with async scheduling;
`--only eagle-spec`: those with an EAGLE drafter run for real),
from seed 30,000.
`--from SEED` starts at SEED instead (each seed keeps its configuration:
`400 DIR` and then `400 DIR --from 10400` run seeds 10,000 to 10,799).
`--replicated` runs the workers' half on two workers holding the same KV
over one shared host region (vLLM's MLA replicated on every rank), written
by turns of host chunk, for each configuration of one worker without
context parallelism (the others run as without it).
`--stress K` runs K busy processes beside it (`cpu_stress.py`): races
between the copies and the model's writes show only when the cores are
busy.
Exits 1 if kvoffload answered a step differently or moved a wrong byte.
"""

import os
import sys

import cpu_stress
import widen_options

tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests")
sys.path.insert(0, tests)
import conftest  # noqa: E402,F401  (vLLM's environment: CPU, offline)
import test_hybrid_vllm as hy  # noqa: E402
import test_hybrid_worker as hw  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> int:
    p = widen_options.parser(__doc__, 10_000, 30_000)
    p.add_argument("out", type=Path, help="the folder the recorded seeds go to")
    p.add_argument("--replicated", action="store_true",
                   help="workers: two holding the same KV, one shared region written by turns")
    args = p.parse_args()
    cases = hy.select_cases(args.only)
    if not cases:
        p.error(f"no configuration's groups contain {args.only!r}")
    with cpu_stress.busy(args.stress):
        return widen(widen_options.seeds(args), args.out, cases, args.replicated)


def widen(seeds: widen_options.Seeds, out: Path, cases: list, replicated: bool = False) -> int:
    same = differ = wrong = stalled = too_large = pool = unrecorded = unrecorded_too_large = stale = 0
    moved = {
        "checked": 0,
        "loads": 0,
        "window_loads": 0,
        "stores": 0,
        "holes": 0,
        "states_restored": 0,
        "states_restored_inside_block": 0,
        "stale_drafter_tails": 0,
        "hits_cut_at_partial_chunks": 0,
    }
    # With --replicated: seeds run on two workers sharing one region, and
    # the store bytes each copied.
    on_shared = 0
    turn_bytes = [0, 0]
    for k in range(seeds.count):
        seed = seeds.seed(k)
        _, specs, extra, opts, delay = cases[seeds.case_index(seed, len(cases))]
        try:
            steps, derived = hy.record(seed, specs, extra, opts, delay)
        except ValueError as e:
            if "free blocks from the pool" not in str(e):
                raise
            # vLLM's core allocating past its own count (hw.VllmPoolError).
            print(f"seed {seed} {specs}: not recorded: vLLM's block pool: {e}", flush=True)
            continue
        except AssertionError as e:
            # vLLM's own run did not end (`test_hybrid_vllm.stall_cause`
            # says why: most often a request larger than these small GPU
            # pools at the head of the queue, else the head of the
            # KV-holding queue that cannot be allocated): nothing to compare.
            print(f"seed {seed} {specs}: not recorded: {e}", flush=True)
            unrecorded += 1
            unrecorded_too_large += "never fits" in str(e)
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
            shared = replicated and hw.replicated_case(opts)
            seen = hw.worker_run(seed, specs, extra, opts, replicated=2 if shared else None)
        except hw.VllmStalled as e:
            stalled += 1
            too_large += "never fits" in str(e)
            print(f"seed {seed} {specs}: with workers: {e}", flush=True)
            continue
        except hw.VllmPoolError as e:
            pool += 1
            print(f"seed {seed} {specs}: with workers: {e}", flush=True)
            continue
        except hw.VllmStaleCopy as e:
            stale += 1
            print(f"seed {seed} {specs}: with workers: {e}", flush=True)
            continue
        except AssertionError as e:
            wrong += 1
            print(f"seed {seed} {specs}: with workers: {str(e)[:300]}", flush=True)
            continue
        for k2 in moved:
            moved[k2] += seen[k2]
        if shared:
            on_shared += 1
            for i, b in enumerate(seen["stored_by_worker"]):
                turn_bytes[i] += b
    print(
        f"{same} seeds the same as vLLM, {differ} different; {unrecorded} not recorded as vLLM's own run did not "
        f"end ({unrecorded_too_large} at a request larger than the GPU pool)",
        flush=True,
    )
    print(
        f"with workers: {wrong} seeds with a wrong byte or a leak, {stalled} stalled in vLLM's scheduler "
        f"with kvoffload idle ({too_large} at a request larger than the GPU pool), {pool} failed in vLLM's block pool, "
        f"{stale} read a block vLLM copied before another request computed it; "
        f"{moved['checked']} tokens checked, "
        f"{moved['loads']} loads ({moved['window_loads']} into windowed groups), {moved['stores']} stores "
        f"({moved['holes']} holes kept in place); {moved['states_restored']} Mamba states read back and checked "
        f"({moved['states_restored_inside_block']} inside a block); {moved['stale_drafter_tails']} drafter "
        "blocks whose last position held another next token's value (vLLM's rule allows it); "
        f"{moved['hits_cut_at_partial_chunks']} hits cut before a window chunk stored in part (vLLM's would "
        "load an unwritten block)",
        flush=True,
    )
    if replicated:
        print(f"{on_shared} seeds on two workers over one shared region, by turns: store bytes {turn_bytes}",
              flush=True)
    return 1 if differ or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
