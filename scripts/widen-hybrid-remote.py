#!/usr/bin/env python3
"""Widens the check of the remote tier with hybrid KV groups
(`python/tests/test_hybrid_remote.py`) to N seeds, cycling through
test_hybrid_vllm.py's configurations, on one `redis-server` started here on
loopback. Per seed: node A runs the seeded workload with kvoffload's real
workers and writes every group's chunks through; node B, its host tier
empty, runs the same workload over the same store (each seed in its own
deployment namespace). Both check every running request's KV in every group
after every step (`test_hybrid_worker.worker_run`); the script sums what
node B fetched and loaded.

Run with the cached vLLM venv's python (scripts/setup-vllm.sh prints it), the
kvoffload package installed in it (scripts/test-python.sh does), and
redis-server on PATH (scripts/setup-redis.sh):
    PY=$(scripts/setup-vllm.sh)
    PYTHONHASHSEED=1 $PY scripts/widen-hybrid-remote.py 140 [--cluster] [--only S]
With --cluster, the store is a Redis Cluster of three masters instead.
`--only S` cycles through the configurations whose group names contain S
(`--only local`: the chunked-local ones; `--only eagle`: those with
EAGLE draft groups; `--only hash`: those whose block hashes are finer
than the blocks; `--only sizes`: those whose groups have different block
sizes; `--only left-out`: those with groups vLLM's connector leaves out;
`--only params`: those whose requests carry `kv_transfer_params`;
`--only dcp`: those with decode context parallelism; `--only partial`:
Mamba states inside a block, which node B fetches as partial tails;
`--only partial-eagle`: those beside an EAGLE draft group, whose tails
stay in each node's host tier; `--only spec`: those with speculative
decoding; `--only async-spec`: those of them with async scheduling;
`--only eagle-spec`: those with an EAGLE drafter run for real),
from seed 40,000.
`--heads` runs the configurations whose KV heads can be the store's
shares (full attention and sliding windows of one block size, or MLA; no
context parallelism) with `canonical_layout`, the two nodes on different
tensor-parallel sizes over 4 KV heads (node A on 2 workers and node B on
1, 1 and 2, 4 and 2, 1 and 4, by seed): node B loads the heads node A's
workers wrote.
`--replicated` runs the configurations of one worker without context
parallelism on nodes whose workers hold the same KV (vLLM's MLA replicated
on every rank): node A on two workers over one shared region, written by
turns of host chunk (each rank puts its chunks), node B on two such workers
(each rank fetches its turn's chunks) or on one worker, by seed.
`--from SEED` starts at SEED instead (each seed keeps its configuration).
`--stress K` runs K busy processes beside it (`cpu_stress.py`).
Exits 1 if a node moved a wrong byte, leaked, or a fetch failed.
"""

import os
import sys
import tempfile
from pathlib import Path

import cpu_stress
import widen_options

tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests")
sys.path.insert(0, tests)
import conftest  # noqa: E402,F401  (vLLM's environment: CPU, offline)
import test_hybrid_vllm as hy  # noqa: E402
import test_hybrid_worker as hw  # noqa: E402
import test_remote as tr  # noqa: E402


def main() -> int:
    p = widen_options.parser(__doc__, 20_000, 40_000)
    p.add_argument("--cluster", action="store_true", help="a Redis Cluster of three masters")
    p.add_argument("--heads", action="store_true", help="KV heads as shares, nodes of different tensor-parallel sizes")
    p.add_argument("--replicated", action="store_true",
                   help="workers holding the same KV, one shared region written by turns")
    args = p.parse_args()
    if args.heads and args.replicated:
        p.error("--heads and --replicated do not go together")
    cases = hy.select_cases(args.only)
    if args.heads:
        cases = [c for c in cases if hw.heads_case(c[1], c[3])]
    if args.replicated:
        cases = [c for c in cases if hw.replicated_case(c[3])]
    if not cases:
        p.error(f"no configuration's groups contain {args.only!r}")
    if not (tr.REDIS and tr.REDIS_CLI):
        p.error("redis-server is not on PATH (scripts/setup-redis.sh installs it)")
    seeds = widen_options.seeds(args)
    with cpu_stress.busy(args.stress), tempfile.TemporaryDirectory() as d:
        if args.cluster:
            # The tests' fixture, driven by hand: three masters, torn down at the end.
            servers = tr.redis_cluster.__wrapped__(Path(d))
            url = next(servers)
            try:
                return widen(seeds, {"url": str(url), "cluster": True}, cases, args.heads, args.replicated)
            finally:
                next(servers, None)
        port = tr._free_port()
        proc = tr._start(Path(d), port)
        try:
            return widen(seeds, {"url": f"redis://127.0.0.1:{port}"}, cases, args.heads, args.replicated)
        finally:
            tr._stop([proc])


#: With `--heads`: node A's and node B's tensor-parallel sizes, by seed.
TP_PAIRS = [(2, 1), (1, 2), (4, 2), (1, 4)]

#: With `--replicated`: node B's workers holding the same KV (None: one
#: worker of its own), by seed.
REPLICATED_B = [2, None]


def widen(seeds: widen_options.Seeds, remote: dict, cases: list, heads: bool = False,
          replicated: bool = False) -> int:
    good = wrong = stalled = too_large = pool = stale = 0
    total = {"lookups": 0, "chunks_found": 0, "fetch_jobs": 0, "chunks_fetched": 0, "fetches_failed": 0,
             "partial_tails_fetched": 0, "partial_not_put": 0, "not_yet": 0}
    moved = {"checked": 0, "loads": 0, "window_loads": 0, "states_restored_inside_block": 0, "stale_drafter_tails": 0,
             "hits_cut_at_partial_chunks": 0}
    for k in range(seeds.count):
        seed = seeds.seed(k)
        _, specs, extra, opts, _ = cases[seeds.case_index(seed, len(cases))]
        cfg = {**extra, "remote_tier": {**remote, "deployment": f"seed{seed}"}}
        tp_a = tp_b = rep_a = rep_b = None
        if replicated:
            rep_a, rep_b = 2, REPLICATED_B[seed % len(REPLICATED_B)]
            specs_shown = f"{specs} replicated 2->{rep_b or 1}"
        elif heads:
            cfg["canonical_layout"] = True
            tp_a, tp_b = TP_PAIRS[seed % len(TP_PAIRS)]
            specs_shown = f"{specs} tp {tp_a}->{tp_b}"
        else:
            specs_shown = specs
        got: dict = {}

        def written(e) -> None:
            e.drain_remote()
            total["partial_not_put"] += tr.writes(e)["partial_chunks_not_put"]
            # The drafter values node A computed: node B may fetch one at a
            # block's last position for another next token (vLLM's rule
            # allows it, `harness.Engine.stale_drafter_tails`).
            got["drafter"] = e.drafter_next_tokens

        def fetched(e) -> None:
            got.update(tr.remote_stats(e))

        def count_not_yet(e) -> None:
            e.drafter_next_tokens = got["drafter"]
            # Node B's lookups that answer vLLM "not yet" (each a step a
            # request waits for the remote tier).
            got["not_yet"] = 0
            lookup = e.connector.get_num_new_matched_tokens

            def counted(*args, **kwargs):
                answer = lookup(*args, **kwargs)
                got["not_yet"] += answer[0] is None
                return answer

            e.connector.get_num_new_matched_tokens = counted

        try:
            hw.worker_run(seed, specs, cfg, opts, on_done=written, tp=tp_a, replicated=rep_a)
            seen = hw.worker_run(seed, specs, cfg, opts, on_done=fetched, on_start=count_not_yet, tp=tp_b,
                                 replicated=rep_b)
        except hw.VllmStalled as e:
            stalled += 1
            too_large += "never fits" in str(e)
            print(f"seed {seed} {specs_shown}: {e}", flush=True)
            continue
        except hw.VllmPoolError as e:
            pool += 1
            print(f"seed {seed} {specs_shown}: {e}", flush=True)
            continue
        except hw.VllmStaleCopy as e:
            stale += 1
            print(f"seed {seed} {specs_shown}: {e}", flush=True)
            continue
        except AssertionError as e:
            wrong += 1
            print(f"seed {seed} {specs_shown}: {str(e)[:300]}", flush=True)
            continue
        for key in total:
            total[key] += got.get(key, 0)
        for key in moved:
            moved[key] += seen[key]
        if got["fetches_failed"]:
            wrong += 1
        else:
            good += 1
        print(
            f"seed {seed} {specs_shown}: node B fetched {got['chunks_fetched']} chunks in {got['fetch_jobs']} jobs "
            f"({got['partial_tails_fetched']} partial tails), {seen['loads']} loads, {got['not_yet']} lookups "
            "answered not yet, every byte right",
            flush=True,
        )
    print(
        f"{good} seeds right, {wrong} wrong, {stalled} stalled in vLLM's scheduler ({too_large} at a request "
        f"larger than the GPU pool), {pool} failed in vLLM's "
        f"block pool, {stale} read a block vLLM copied before another request computed it; node B: "
        f"{total['lookups']} remote lookups ({total['not_yet']} of vLLM's lookups answered not yet), "
        f"{total['chunks_found']} chunks found, {total['fetch_jobs']} fetch "
        f"jobs, {total['chunks_fetched']} chunks fetched ({total['partial_tails_fetched']} partial tails), "
        f"{total['fetches_failed']} failed; node A kept "
        f"{total['partial_not_put']} chunks stored in part out of the store; {moved['loads']} loads "
        f"({moved['window_loads']} into groups other than full attention, {moved['states_restored_inside_block']} Mamba "
        f"states inside a block), {moved['checked']} tokens checked; node B found {moved['stale_drafter_tails']} "
        "drafter blocks whose last position held another next token's value (vLLM's rule allows it); "
        f"{moved['hits_cut_at_partial_chunks']} hits cut before a window chunk stored in part (vLLM's would load "
        "an unwritten block)",
        flush=True,
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
