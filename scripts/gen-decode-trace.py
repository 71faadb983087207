#!/usr/bin/env python3
"""Writes a replay trace (docs/trace-format.md) shaped like a serving decode
workload, for measuring the engine with `kvoffload replay --timing FILE.json`.

    scripts/gen-decode-trace.py --requests 1024 --steps 200 --out decode.jsonl
    kvoffload replay decode.jsonl --timing timing.json > /dev/null

The trace:
- N requests (`--requests`, default 1024), request r with a prompt of
  256 + (r mod 16) tokens: 16 full blocks of 16 tokens (16 block hashes, unique
  per request), plus r mod 16 tokens, so that the requests complete their
  blocks staggered; each is added, looked up (computed_tokens 0) and allocated
  17 GPU blocks (external_tokens 0: nothing to load);
- one prefill `step` scheduling all of them (scheduled_tokens = the prompt):
  one store job per request (16 chunks), then a `worker_output` completing them;
- S decode steps (`--steps`, default 200): every request gets one new token
  (`update_request`, with the new block's hash when a block of 16 tokens
  completes) and is scheduled with scheduled_tokens 1 (`new_block_ids` when
  its token starts a new block); about N/16 requests complete a block, hence
  store one chunk, per step; a `worker_output` after each step completes the
  jobs created in it;
- a final `state` (0 jobs left).

Job ids are assigned by the engine: sequential integers from 0 in creation
order; a step creates at most one store job per scheduled request, in the
order of its `scheduled` list (loads, created by `alloc`, would take ids too;
this trace has none). The script follows that rule to name the jobs in the
`worker_output` lines; replaying the trace gives no "error" field when it
matches the engine.

Standard library only.
"""

import argparse
import json
import sys

TOKENS_PER_BLOCK = 16
PROMPT_BLOCKS = 16


def line(obj):
    return json.dumps(obj, separators=(",", ":")) + "\n"


def generate(requests, steps, out):
    out.write(
        line(
            {
                "kvoffload_trace": 1,
                "config": {
                    "tokens_per_block": TOKENS_PER_BLOCK,
                    "blocks_per_chunk": 1,
                    "num_cpu_chunks": 65536,
                    "world_size": 1,
                    "eviction_policy": "lru",
                    # The default (true) would store the prompt only: no
                    # stores in the decode steps.
                    "offload_prompt_only": False,
                },
            }
        )
    )
    next_block = 1  # GPU block 0 is the null block: never used
    next_job = 0
    names = [f"r{r}" for r in range(requests)]
    prompt = [PROMPT_BLOCKS * TOKENS_PER_BLOCK + r % TOKENS_PER_BLOCK for r in range(requests)]
    blocks = []
    for r, name in enumerate(names):
        hashes = [f"{name}-b{i}" for i in range(PROMPT_BLOCKS)]
        table = list(range(next_block, next_block + PROMPT_BLOCKS + 1))
        next_block += len(table)
        blocks.append(table)
        out.write(
            line({"op": "add_request", "req": name, "prompt_tokens": prompt[r], "block_hashes": hashes})
        )
        out.write(line({"op": "lookup", "req": name, "computed_tokens": 0}))
        out.write(line({"op": "alloc", "req": name, "block_ids": table, "external_tokens": 0}))

    # Prefill: every request stores its 16 full blocks, one job each.
    scheduled = [
        {"req": name, "new_block_ids": blocks[r], "computed_tokens": 0, "scheduled_tokens": prompt[r]}
        for r, name in enumerate(names)
    ]
    out.write(line({"op": "step", "scheduled": scheduled}))
    jobs = list(range(next_job, next_job + requests))
    next_job += requests
    out.write(line({"op": "worker_output", "completed": {str(j): 1 for j in jobs}}))

    # Decode: one token per request per step.
    for k in range(1, steps + 1):
        scheduled = []
        jobs = []
        for r, name in enumerate(names):
            num_tokens = prompt[r] + k
            update = {"op": "update_request", "req": name, "num_tokens": num_tokens}
            completes = num_tokens % TOKENS_PER_BLOCK == 0
            if completes:
                update["block_hashes"] = [f"{name}-b{num_tokens // TOKENS_PER_BLOCK - 1}"]
            out.write(line(update))
            position = num_tokens - 1  # the token computed in this step
            entry = {"req": name}
            if position // TOKENS_PER_BLOCK >= len(blocks[r]):
                blocks[r].append(next_block)
                entry["new_block_ids"] = [next_block]
                next_block += 1
            entry["computed_tokens"] = position
            entry["scheduled_tokens"] = 1
            scheduled.append(entry)
            if completes:
                # Its block is full and hashed: a store job, in list order.
                jobs.append(next_job)
                next_job += 1
        out.write(line({"op": "step", "scheduled": scheduled}))
        out.write(line({"op": "worker_output", "completed": {str(j): 1 for j in jobs}}))
    out.write(line({"op": "state"}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1024, help="requests (default 1024)")
    p.add_argument("--steps", type=int, default=200, help="decode steps (default 200)")
    p.add_argument("--out", default="-", help="output file (default: stdout)")
    a = p.parse_args()
    if a.requests < 1 or a.steps < 0:
        p.error("--requests must be >= 1 and --steps >= 0")
    if a.out == "-":
        generate(a.requests, a.steps, sys.stdout)
    else:
        with open(a.out, "w", encoding="utf-8") as f:
            generate(a.requests, a.steps, f)


if __name__ == "__main__":
    main()
