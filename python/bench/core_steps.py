#!/usr/bin/env python3
"""Steady decode steps through the binding's ``SchedulerCore`` without vLLM:
N requests decode one token a step, 16 tokens per block, one block per
chunk, so N/16 stores a step; each step's stores complete at the next.
It exists to count the binding's instructions per steady step, which the VM's
noise does not move (the timed comparison with vLLM is ``hook_time.py``):

    cd "$(mktemp -d)"
    for s in 100 200; do STEPS=$s valgrind --tool=callgrind \\
        --callgrind-out-file=cg.$s.out \\
        --toggle-collect='*__pymethod_build_step__' \\
        --toggle-collect='*__pymethod_on_worker_output__' \\
        --toggle-collect='*__pymethod_take_stats__' \\
        "$PY" /path/to/python/bench/core_steps.py; done

then (total of cg.200.out - total of cg.100.out) / 100 is one steady step's
instructions (the setup and the first steps cancel out). ``$PY`` is the
project's vLLM venv (``scripts/setup-vllm.sh`` prints it) with ``./python``
installed. Environment: ``N`` requests (1024), ``STEPS`` (300); ``TIME=1``
also prints each call's median wall time over the second half of the steps
(a quick split of the binding's time, without vLLM around it)."""

from __future__ import annotations

import json
import os
import statistics
import struct
import time

from kvoffload._native import SchedulerCore, plan_jobs

N = int(os.environ.get("N", "1024"))
STEPS = int(os.environ.get("STEPS", "300"))
TPB = 16


class Request:
    """The attributes of vLLM's ``Request`` the binding reads."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.request_id = f"req-{index}"
        self.num_prompt_tokens = 64 + index % TPB
        self.num_tokens = self.num_prompt_tokens
        self.block_hashes = [self.hash(b) for b in range(self.num_tokens // TPB)]

    def hash(self, block: int) -> bytes:
        v = (self.index << 32) | block
        return struct.pack("<QQ", v, v)

    def grow(self) -> None:
        self.num_tokens += 1
        if self.num_tokens % TPB == 0:
            self.block_hashes.append(self.hash(self.num_tokens // TPB - 1))


def main() -> None:
    cfg = {"tokens_per_block": TPB, "blocks_per_chunk": 1, "num_cpu_chunks": 65536, "offload_prompt_only": False}
    core = SchedulerCore(json.dumps(cfg), watchdog=True, manual_clock=False, kv_events=False)
    reqs = [Request(i) for i in range(N)]
    for r in reqs:
        core.add_request(r)
        core.lookup(r.request_id, 0)
        core.on_alloc(r.request_id, list(range(r.index * 8, r.index * 8 + 5)), 0)
    ids = [r.request_id for r in reqs]
    stores: list[int] = []
    timing = os.environ.get("TIME") == "1"
    times: dict[str, list[float]] = {"build_step": [], "on_worker_output": [], "take_stats": []}
    clock = time.perf_counter
    for k in range(STEPS):
        if stores:
            done = {j: 1 for j in stores}
            t0 = clock()
            core.on_worker_output(done, [])
            times["on_worker_output"].append(clock() - t0)
        if k == 0:
            new = [(r.request_id, list(range(r.index * 8, r.index * 8 + 5)), 0) for r in reqs]
            plan, _, _ = core.build_step({r.request_id: r.num_tokens for r in reqs}, new, [], [], [], set(), [], [])
        else:
            blocks = [([100000 + k * N + r.index],) if r.num_tokens % TPB == 0 else None for r in reqs]
            computed = [r.num_tokens for r in reqs]
            scheduled = {i: 1 for i in ids}
            t0 = clock()
            plan, _, _ = core.build_step(scheduled, [], ids, blocks, computed, set(), [], [])
            times["build_step"].append(clock() - t0)
        _, stores, _ = plan_jobs(plan)
        t0 = clock()
        core.take_stats()
        times["take_stats"].append(clock() - t0)
        for r in reqs:
            r.grow()
    print(f"{STEPS} steps, {N} requests, {len(stores)} stores in the last")
    if timing:
        for name, ts in times.items():
            half = ts[len(ts) // 2 :]
            print(f"{name}: median {statistics.median(half) * 1e6:.1f} us over {len(half)} calls")


if __name__ == "__main__":
    main()
