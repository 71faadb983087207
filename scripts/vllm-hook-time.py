#!/usr/bin/env python3
"""vLLM 0.33.0's own connector hook time per step on a kvoffload trace: the
figure to set beside `kvoffload replay TRACE --timing FILE.json`.

It replays the trace on vLLM's real scheduler-role `OffloadingConnector`
through the oracle's replayer (`../shared/oracle/vllm_connector_v1_replay.py`,
which rebuilds vLLM's request and scheduler-output objects from the trace) and
times only the connector hooks the engine loop calls, with the same
attribution and statistics as `kvoffload replay --timing` (docs/trace-format.md):
- timed: `get_num_new_matched_tokens` (lookup), `update_state_after_alloc`
  (alloc), `build_connector_meta` (step), `update_connector_output`
  (worker_output), `request_finished_all_groups` (request_finished);
- lookup/alloc (and add_request, for steadiness) count toward the next step,
  worker_output/request_finished toward the last step before them;
- a steady step has no add_request, lookup, alloc or request_finished; the
  first 16 steady steps are skipped; p50/p90/p99 are nearest rank.
Building the replayer's synthetic inputs and its output lines is not timed.

Usage (vLLM's venv; see ../shared/oracle/setup-vllm.sh):
    ~/.cache/vllm-oracle/vllm-env/bin/python scripts/vllm-hook-time.py decode.jsonl \\
        [--oracle ../shared/oracle] [--timing vllm-timing.json]
Prints the JSON line (and writes it to --timing when given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

WARMUP_STEADY_STEPS = 16
HOOKS = {
    "get_num_new_matched_tokens": "lookup",
    "update_state_after_alloc": "alloc",
    "build_connector_meta": "step",
    "update_connector_output": "worker_output",
    "request_finished_all_groups": "request_finished",
}
HEADER_DEFAULTS = {
    "tokens_per_block": 4,
    "blocks_per_chunk": 1,
    "world_size": 1,
    "eviction_policy": "lru",
    "offload_prompt_only": True,
    "stall_timeout_ms": 300000,
    "stall_scan_interval_ms": 10000,
}


def nearest_rank(sorted_vals: list[float], q: float) -> float:
    k = max(1, math.ceil(q * len(sorted_vals)))
    return sorted_vals[k - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--oracle", default=os.path.join(here, "..", "..", "shared", "oracle"))
    ap.add_argument("--timing", help="also write the JSON line to this file")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.abspath(args.oracle))
    import vllm_connector_v1_replay as v1  # noqa: E402  (imports vLLM)

    with open(args.trace) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    header = lines[0]
    header["config"] = {**HEADER_DEFAULTS, **header.get("config", {})}
    rp = v1.V1Replay(header)

    # Time the hooks on the connector instance.
    spent = [0.0]
    for name in HOOKS:
        orig = getattr(rp.conn, name)

        def timed(*a, _orig=orig, **kw):
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(rp.conn, name, timed)

    steps: list[list] = []  # [seconds, steady]
    pending_time = 0.0
    pending_unsteady = False
    for i, op in enumerate(lines[1:], start=2):
        name = op["op"]
        if name == "update_request":
            op.setdefault("block_hashes", [])
        if name == "step":
            op.setdefault("preempted", [])
            op.setdefault("finished", [])
            for s in op.get("scheduled", []):
                s.setdefault("new_block_ids", [])
        before = spent[0]
        rp.apply(i, op)
        dt = spent[0] - before
        if name in ("lookup", "alloc", "add_request"):
            pending_time += dt
            pending_unsteady = True
        elif name == "step":
            steps.append([pending_time + dt, not pending_unsteady])
            pending_time, pending_unsteady = 0.0, False
        elif name in ("worker_output", "request_finished") and steps:
            steps[-1][0] += dt
            if name == "request_finished":
                steps[-1][1] = False
    steady = [s for s, ok in steps if ok][WARMUP_STEADY_STEPS:]
    out: dict = {"steps": len(steps), "steady_steps": len(steady), "engine_us": None}
    if steady:
        us = sorted(x * 1e6 for x in steady)
        out["engine_us"] = {
            "p50": nearest_rank(us, 0.50),
            "p90": nearest_rank(us, 0.90),
            "p99": nearest_rank(us, 0.99),
            "mean": sum(us) / len(us),
        }
    text = json.dumps(out)
    print(text)
    if args.timing:
        with open(args.timing, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
