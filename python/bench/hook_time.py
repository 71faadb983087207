#!/usr/bin/env python3
"""Connector hook time per steady engine step, through Python, kvoffload's
``KvOffloadConnector`` against vLLM 0.33.0's own ``OffloadingConnector`` on the
same workload in the same run (a benchmark, not a test).

Each connector runs on vLLM's real core ``Scheduler`` (scheduler role; the
workers are fakes that finish every job one step after it is planned). N
requests with distinct prompts of 64..79 tokens are prefilled, then decode;
with 16 tokens per block and ``offload_prompt_only`` off, a decoding request
fills a block every 16 steps, so about N/16 store jobs are planned a step. A
steady step adds, finishes and looks up no request. Each point runs
`--repeat` times, the two connectors alternating; the figure is the median
run's median step. Timed: every connector
hook the scheduler calls in the step (on_new_request,
get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
update_connector_output, request_finished(_all_groups), take_events,
get_kv_connector_stats, has_pending_push_work, ...), outermost calls only;
take_events is drained inside its timing (vLLM's is a generator).

``--groups full+swa`` runs a hybrid model instead (vLLM's hybrid KV cache
manager: a full-attention group and a sliding-window group of
`WINDOW` tokens, both connectors declaring ``SupportsHMA``): every block
is stored or offered in both groups, and a decoding request's window
blocks are freed behind it. ``--groups full+mamba`` runs a hybrid
Mamba model (a full-attention group and a Mamba group in vLLM's align
mode): a decoding request's Mamba state is handed over, and stored, at
each block boundary it reaches. ``--groups eagle`` runs one
full-attention group holding an EAGLE drafter's layers (vLLM's
``is_eagle_group``): the connectors keep a decoding request's last chunk
back, and kvoffload's binding reads every scheduled request's token count
each step.

Usage (the project's vLLM venv, kvoffload installed in it):
    scripts/bench-vllm-hooks.sh [--requests 64,256,1024] [--steps 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import conftest  # noqa: E402,F401  (environment before vLLM is imported)
from harness import build  # noqa: E402
from test_differential import kvoffload_worker, vllm_worker  # noqa: E402

TPB = 16
PROMPT = 64
#: The sliding window of `--groups full+swa`, in tokens (two blocks).
WINDOW = 32
WARMUP = 16
HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_external_cache_hit_sources",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
)


class HookTimer:
    """Wraps the connector's hooks; sums the time of outermost calls."""

    def __init__(self, connector: Any) -> None:
        self.total = 0.0
        self.calls: dict[str, int] = {}
        #: Seconds per hook (outermost calls).
        self.by_hook: dict[str, float] = {}
        self.depth = 0
        for name in HOOKS:
            inner = getattr(connector, name, None)
            if inner is not None:
                setattr(connector, name, self._wrap(name, inner))

    def _wrap(self, name: str, inner: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.depth += 1
            t0 = time.perf_counter()
            try:
                out = inner(*a, **k)
                # vLLM's take_events is a generator: its work happens while
                # the caller iterates, so it is drained inside the timing.
                return list(out) if name == "take_events" else out
            finally:
                if self.depth == 1:
                    dt = time.perf_counter() - t0
                    self.total += dt
                    self.by_hook[name] = self.by_hook.get(name, 0.0) + dt
                self.depth -= 1

        return timed


def measure(
    connector: str,
    module: str | None,
    worker: Any,
    n: int,
    steps: int,
    kv_events: bool = False,
    self_describing: bool = False,
    hybrid: str | None = None,
    hash_tokens: int | None = None,
) -> dict[str, Any]:
    batched = max(8192, n)
    # Every request decodes through the prefill of the last one and the timed steps.
    prefill_steps = -(-n * (PROMPT + 16) // batched)
    decode = WARMUP + steps + prefill_steps + 8
    blocks_per_req = -(-(PROMPT + 16 + decode) // TPB)
    groups = None
    if hybrid:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        common = dict(block_size=TPB, num_kv_heads=2, head_size=4, dtype=torch.float32)
        if hybrid == "full+mamba":
            # A state of 256 floats: the attention block's page.
            state = MambaSpec(
                block_size=TPB, shapes=((16, 4), (12, 16)), dtypes=(torch.float32,) * 2, mamba_cache_mode="align"
            )
            groups = [FullAttentionSpec(**common), state]
        elif hybrid == "eagle":
            groups = [FullAttentionSpec(**common)]
        else:
            groups = [FullAttentionSpec(**common), SlidingWindowSpec(sliding_window=WINDOW, **common)]
    ngroups = len(groups) if groups else 1
    num_gpu_blocks = ngroups * n * blocks_per_req + 64
    # Room for every block in the host tier (2 layers x K,V x 16 tokens x 2 heads x 4 floats).
    block_bytes = 2 * 2 * TPB * 2 * 4 * 4
    e = build(
        connector=connector,
        module=module,
        extra={
            "cpu_bytes_to_use": num_gpu_blocks * block_bytes,
            "offload_prompt_only": False,
            "self_describing_kv_events": self_describing,
        },
        tpb=TPB,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=n,
        max_num_batched_tokens=batched,
        fake_worker=worker(1),
        kv_events=kv_events,
        groups=groups,
        hash_tokens=hash_tokens,
        eagle_groups=(0,) if hybrid == "eagle" else (),
    )
    timer = HookTimer(e.connector)
    for i in range(n):
        length = PROMPT + i % 16
        prompt = [3 + (i * 131 + p * 7) % 50_000 for p in range(length)]
        prompt[0] = 3 + i  # distinct from the first block on
        e.add(prompt, max_tokens=decode, req_id=f"q{i}")
    per_step: list[float] = []
    by_hook: dict[str, float] = {}
    stores = 0
    while len(per_step) < WARMUP + steps:
        before, lookups = timer.total, timer.calls.get("get_num_new_matched_tokens", 0)
        hooks_before = dict(timer.by_hook)
        so = e.step()
        steady = (
            not so.scheduled_new_reqs
            and not so.finished_req_ids
            and timer.calls.get("get_num_new_matched_tokens", 0) == lookups
            and len(so.num_scheduled_tokens) == n
            and all(v == 1 for v in so.num_scheduled_tokens.values())
        )
        if steady:
            per_step.append(timer.total - before)
            if len(per_step) > WARMUP:
                stores += _stores(so.kv_connector_metadata)
                for name, t in timer.by_hook.items():
                    by_hook[name] = by_hook.get(name, 0.0) + t - hooks_before.get(name, 0.0)
        if e.steps > 10 * (WARMUP + steps) + 100:
            raise RuntimeError(f"{connector}: no steady decode steps with {n} requests")
    timed = sorted(per_step[WARMUP:])
    return {
        "median_us": statistics.median(timed) * 1e6,
        "p90_us": timed[int(0.9 * (len(timed) - 1))] * 1e6,
        "stores_per_step": stores / len(timed),
        "steps": len(timed),
        "mean_us_by_hook": {k: v / len(timed) * 1e6 for k, v in sorted(by_hook.items())},
    }


def _stores(meta: Any) -> int:
    if hasattr(meta, "store_jobs"):
        return len(meta.store_jobs)
    import kvoffload._native as native

    return len(native.plan_jobs(meta.plan)[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="64,256,1024", help="decoding requests, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="steady steps timed per point")
    ap.add_argument(
        "--kv-events",
        default="off,on",
        help="KV events published (vLLM's kv_events_config): off (vLLM's default), on, "
        "self-describing (on, with self_describing_kv_events), comma-separated",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per point, alternating the connectors; the figure is the median run",
    )
    ap.add_argument(
        "--groups",
        default="one",
        choices=("one", "full+swa", "full+mamba", "eagle"),
        help="one full-attention KV group, or a hybrid model (a full-attention and a "
        f"{WINDOW}-token sliding-window group, or a Mamba group, vLLM's hybrid manager), "
        "or one full-attention group holding an EAGLE drafter's layers (the connectors' "
        "volatile last chunk; the binding reads every scheduled request's token count)",
    )
    ap.add_argument(
        "--hash-tokens",
        type=int,
        default=None,
        help="vLLM's prefix_match_unit (block hashes every N tokens, finer than the "
        f"{TPB}-token blocks; several groups only): with --groups full+mamba, Mamba states "
        "inside a block (partial tails) too",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    rows = []
    print(
        f"{'requests':>8} {'kv events':>9} {'stores/step':>11} {'vLLM median us':>15}"
        f" {'kvoffload median us':>20} {'ratio':>7}"
    )
    for ev in args.kv_events.split(","):
        for n in (int(x) for x in args.requests.split(",")):
            on, sd = ev in ("on", "self-describing"), ev == "self-describing"
            hy = None if args.groups == "one" else args.groups
            vs, ks = [], []
            for _ in range(max(1, args.repeat)):
                ht = args.hash_tokens
                vs.append(measure("OffloadingConnector", None, vllm_worker, n, args.steps, on, sd, hy, ht))
                ks.append(
                    measure("KvOffloadConnector", "kvoffload.vllm", kvoffload_worker, n, args.steps, on, sd, hy, ht)
                )
            v = sorted(vs, key=lambda r: r["median_us"])[len(vs) // 2]
            k = sorted(ks, key=lambda r: r["median_us"])[len(ks) // 2]
            v["runs_median_us"] = [r["median_us"] for r in vs]
            k["runs_median_us"] = [r["median_us"] for r in ks]
            ratio = v["median_us"] / k["median_us"]
            rows.append(
                {
                    "requests": n,
                    "kv_events": ev,
                    "groups": args.groups,
                    "hash_tokens": args.hash_tokens,
                    "vllm": v,
                    "kvoffload": k,
                    "ratio": ratio,
                }
            )
            print(
                f"{n:>8} {ev:>9} {k['stores_per_step']:>11.1f} {v['median_us']:>15.0f}"
                f" {k['median_us']:>20.0f} {ratio:>6.1f}x",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
