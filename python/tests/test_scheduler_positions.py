"""The scheduler binding finds each cached request by its position in vLLM's
list when it is where it was last step (a cache of addresses, without a hash
lookup). These tests drive ``SchedulerCore`` directly, without vLLM, through
what would break such a cache: the list's order changing, requests finishing
while new ones arrive (whose id objects may take a freed id's address), and
requests that leave the list and come back. Whatever the order, every full
block is stored exactly once, from the request that owns it."""

from __future__ import annotations

import json
import random
import struct

from kvoffload._native import SchedulerCore, plan_transfers

TPB = 4
BLOCKS_PER_REQUEST = 1000


class Req:
    """The attributes of vLLM's ``Request`` the binding reads."""

    def __init__(self, index: int, prompt: int) -> None:
        # A fresh string object per request, as vLLM's ids are; long, so
        # that no temporary of its making takes a freed id's memory first.
        self.request_id = str(index).rjust(200, "0")
        self.index = index
        self.num_prompt_tokens = prompt
        self.num_tokens = prompt
        self.block_hashes = [self.hash(b) for b in range(prompt // TPB)]
        #: GPU blocks: request i owns ids i * 1000 + n.
        self.blocks = [index * BLOCKS_PER_REQUEST + b for b in range(prompt // TPB + 1)]

    def hash(self, block: int) -> bytes:
        v = (self.index << 32) | block
        return struct.pack("<QQ", v, v)

    def grow(self) -> None:
        self.num_tokens += 1
        if self.num_tokens % TPB == 0:
            self.block_hashes.append(self.hash(self.num_tokens // TPB - 1))


def run(seed: int, shuffle: bool, churn: bool) -> set[int]:
    """Decodes requests step by step; returns every GPU block stored."""
    order = random.Random(seed)
    cfg = {"tokens_per_block": TPB, "blocks_per_chunk": 1, "num_cpu_chunks": 4096, "offload_prompt_only": False}
    core = SchedulerCore(json.dumps(cfg), watchdog=False, manual_clock=True, kv_events=False)
    stored: list[int] = []
    everyone: dict[int, Req] = {}
    #: Final token counts of finished requests.
    tokens: dict[int, int] = {}
    running: list[Req] = []
    new: list[Req] = []
    next_index = 0
    #: Addresses of finished requests' id objects; whether each new id
    #: object took one of them.
    freed: set[int] = set()
    reused: list[bool] = []

    def admit() -> None:
        nonlocal next_index
        r = Req(next_index, 5 + next_index % 7)
        next_index += 1
        core.add_request(r)
        core.lookup(r.request_id, 0)
        core.on_alloc(r.request_id, r.blocks, 0)
        new.append(r)
        everyone[r.index] = r
        reused.append(id(r.request_id) in freed)

    for _ in range(24):
        admit()
    pending: list[int] = []
    for step in range(120):
        if pending:
            core.on_worker_output({j: 1 for j in pending}, [])
        finished: list[str] = []
        if churn and step % 3 == 2 and running:
            # The newest request (last in an unshuffled list) finishes and a
            # new one arrives: the new one joins the list where the finished
            # one was, and its id object is likely made at the finished one's
            # address (freed by then).
            gone = max(running, key=lambda q: q.index)
            running.remove(gone)
            core.request_finished(gone.request_id, gone.blocks, False, gone.num_tokens)
            finished.append(gone.request_id)
            tokens[gone.index] = gone.num_tokens
            freed.add(id(gone.request_id))
            del everyone[gone.index]
            gone = None
        elif churn and step % 3 == 0 and step > 0:
            admit()
        if shuffle:
            order.shuffle(running)
        cached_ids, cached_blocks, cached_computed = [], [], []
        for r in running:
            grew = None
            if r.num_tokens % TPB == 0:
                b = r.index * BLOCKS_PER_REQUEST + len(r.blocks)
                r.blocks.append(b)
                grew = ([b],)
            cached_ids.append(r.request_id)
            cached_blocks.append(grew)
            cached_computed.append(r.num_tokens)
        num_scheduled = {r.request_id: 1 for r in running}
        for r in new:
            num_scheduled[r.request_id] = r.num_tokens
        new_parts = [(r.request_id, list(r.blocks), 0) for r in new]
        plan, _, failed = core.build_step(
            num_scheduled, new_parts, cached_ids, cached_blocks, cached_computed, set(), [], finished
        )
        assert failed == []
        _, stores, _ = plan_transfers(plan)
        pending = [job for job, _ in stores]
        for _, blocks in stores:
            stored.extend(blocks)
        # Nothing of this step keeps the finished ids alive.
        num_scheduled = cached_ids = finished = new_parts = None
        for r in running:
            r.grow()
        running.extend(new)
        new.clear()
    assert len(stored) == len(set(stored)), "a block stored twice"
    if churn and not shuffle:
        assert any(reused), "no new id object took a finished one's address: the test lost its point"
    tokens.update((i, r.num_tokens) for i, r in everyone.items())
    for b in stored:
        owner = b // BLOCKS_PER_REQUEST
        assert (b % BLOCKS_PER_REQUEST + 1) * TPB <= tokens[owner], f"block {b} stored before it was full"
    return set(stored)


def test_every_order_stores_the_same_blocks_from_their_owners():
    for seed in range(3):
        steady = run(seed, shuffle=False, churn=False)
        assert steady, "the workload stores"
        assert run(seed, shuffle=True, churn=False) == steady


def test_requests_finishing_and_arriving_keep_their_own_blocks():
    for seed in range(3):
        stable = run(seed, shuffle=False, churn=True)
        assert run(seed, shuffle=True, churn=True) == stable


def test_requests_below_their_store_horizon_are_stored_once_complete_and_again_after_a_reset():
    """vLLM-like decode (a request's new block comes the step after its last
    one filled, so a chunk completes in a step without new blocks): the
    binding leaves a request out of the step while it cannot complete a chunk,
    and must still store every chunk the step it completes, and every chunk
    again at the first step after a reset (which restarts every request's
    stores, so the cached horizons are stale)."""
    cfg = {"tokens_per_block": TPB, "blocks_per_chunk": 2, "num_cpu_chunks": 4096, "offload_prompt_only": False}
    core = SchedulerCore(json.dumps(cfg), watchdog=False, manual_clock=True, kv_events=False)
    reqs = [Req(i, 9 + i) for i in range(8)]
    for r in reqs:
        # Every block the test will need, allocated up front: no step carries
        # new blocks. Request i owns ids (i + 1) * 1000 + n (0 is vLLM's null block).
        r.blocks = [(r.index + 1) * BLOCKS_PER_REQUEST + b for b in range(40)]
        core.add_request(r)
        core.lookup(r.request_id, 0)
        core.on_alloc(r.request_id, r.blocks, 0)
    ids = [r.request_id for r in reqs]
    chunk_tokens = 2 * TPB

    def step(first: bool = False) -> dict[str, list[int]]:
        if first:
            new = [(r.request_id, list(r.blocks), 0) for r in reqs]
            plan, _, _ = core.build_step({r.request_id: r.num_tokens for r in reqs}, new, [], [], [], set(), [], [])
        else:
            computed = [r.num_tokens - 1 for r in reqs]
            plan, _, _ = core.build_step({i: 1 for i in ids}, [], ids, [None] * len(reqs), computed, set(), [], [])
        _, stores, _ = plan_transfers(plan)
        core.on_worker_output({job: 1 for job, _ in stores}, [])
        by_request: dict[str, list[int]] = {}
        for _, blocks in stores:
            owner = reqs[blocks[0] // BLOCKS_PER_REQUEST - 1]
            by_request.setdefault(owner.request_id, []).extend(blocks)
        for r in reqs:
            r.grow()
        return by_request

    stored = step(first=True)
    for _ in range(3 * chunk_tokens):
        for rid, blocks in step().items():
            assert not set(blocks) & set(stored.get(rid, [])), "a block stored twice"
            stored.setdefault(rid, []).extend(blocks)
    for r in reqs:
        # Tokens computed by the last step: num_tokens (after its grow) - 1.
        full_chunks = (r.num_tokens - 1) // chunk_tokens
        want = {(r.index + 1) * BLOCKS_PER_REQUEST + b for b in range(2 * full_chunks)}
        assert set(stored.get(r.request_id, [])) == want, f"request {r.index}: stored {sorted(stored.get(r.request_id, []))}"
    core.reset()
    again = step()
    for r in reqs:
        full_chunks = (r.num_tokens - 1) // chunk_tokens
        want = {(r.index + 1) * BLOCKS_PER_REQUEST + b for b in range(2 * full_chunks)}
        assert set(again.get(r.request_id, [])) == want, f"request {r.index} after the reset"
