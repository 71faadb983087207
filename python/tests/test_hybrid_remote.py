"""Hybrid models (vLLM's hybrid KV cache manager: full-attention and
sliding-window groups) with a remote tier on a real ``redis-server``: one
node runs a seeded workload and writes every group's chunks through; a
second node, its host tier empty, runs the same workload over the same
store. Its lookups ask the remote tier about every group's chunks the host
tier misses, fetch what the hit over both tiers reads, and load it; after
every step every running request's KV is compared, in every group, with
what the model computed (``test_hybrid_worker.worker_run``). Skipped with
the reason where ``redis-server`` is missing (failing instead with
``KVOFFLOAD_REDIS_TESTS=1``, as CI sets it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from vllm.distributed.kv_events import BlockStored
from vllm.v1.kv_cache_interface import FullAttentionSpec

import harness
from test_connector import PREFIX, leak_free, run_checked
from test_hybrid_vllm import SPECS, TPB, engine_options, full, local, mamba, window
from test_hybrid_worker import worker_run
from test_remote import (  # noqa: F401  (redis_url, redis_cluster: fixtures)
    record_hit_sources,
    redis_cluster,
    redis_url,
    remote_stats,
    writes,
)

#: (seed, group specs, extra config, engine options): chunks of one, two
#: and four blocks, two windows, a window alone, async scheduling, two
#: workers, dense retention; chunked-local attention groups; EAGLE draft
#: groups (a hit needs the chunk after its end: fetched too); MLA groups; a
#: window retaining tokens behind it; block hashes finer than the blocks.
REMOTE_CASES = [
    (1, "full+swa8", {"offload_prompt_only": False}, {}),
    (3, "full+swa8+swa13", {"block_size": 2 * TPB, "offload_prompt_only": False}, {}),
    (4, "swa6+full", {}, {"async_scheduling": True}),
    (5, "full+swa8", {}, {"world_size": 2}),
    (10, "full+swa8", {"block_size": 4 * TPB, "offload_prompt_only": False}, {"retention": None}),
    (12, "swa8", {"offload_prompt_only": False}, {}),
    (15, "full+local8", {"offload_prompt_only": False}, {}),
    (16, "local12+full", {"block_size": 2 * TPB}, {"async_scheduling": True}),
    (18, "full+swa8+local16", {"offload_prompt_only": False}, {"world_size": 2}),
    (19, "full", {"offload_prompt_only": False}, {"eagle_groups": [0]}),
    (20, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"eagle_groups": [0]}),
    (22, "mla+swa8", {"offload_prompt_only": False}, {}),
    (23, "mla", {"offload_prompt_only": False}, {"eagle_groups": [0]}),
    (24, "full+swa8x2", {"offload_prompt_only": False}, {}),
    (26, "full+swa8", {"offload_prompt_only": False}, {"hash_tokens": 2}),
    # A seed whose node A stores a window's chunk in part (a request whose
    # window has passed its first block) after the whole chunk was evicted:
    # that part of the host slot is stale. Written to the tier, it replaced
    # the whole chunk, and node B loaded a stale block (found by
    # scripts/widen-hybrid-remote.py --only hash, seed 40013).
    (40013, "full+swa8+swa13", {"block_size": 2 * TPB, "offload_prompt_only": False}, {}),
    # Groups of different block sizes: a chunk of one group spans two of
    # another's, both fetched and loaded by their own keys.
    (29, "full+swa8b8", {"offload_prompt_only": False}, {}),
    (31, "full+swa13b8+local16b8", {"blocks_per_chunk": 2, "offload_prompt_only": False}, {"world_size": 2}),
    # Groups vLLM's connector leaves out (not prefix-cacheable): only the
    # others' chunks go to the tier; a circular buffer before a window.
    (36, "full+ring", {"offload_prompt_only": False}, {}),
    (38, "ring+swa8", {}, {"async_scheduling": True}),
    # Mamba states (vLLM's align mode): each fetched and loaded as the
    # state at a hit's end; beside a window, async; alone, two workers;
    # Mamba2's prefill checkpoints.
    (49, "full+mamba", {"offload_prompt_only": False}, {}),
    (50, "mamba+swa8", {}, {"async_scheduling": True}),
    (51, "mamba", {"offload_prompt_only": False}, {"world_size": 2}),
    (55, "full+mamba2", {"offload_prompt_only": False}, {}),
    # Mamba states inside a block (hashes finer than the blocks): node B
    # fetches the complete chunks, then the partial tail in the block
    # after, and loads the state inside the block; four hashes a block,
    # two workers, async.
    (57, "full+mamba", {"offload_prompt_only": False}, {"hash_tokens": 2}),
    (58, "full+mamba", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"hash_tokens": 1, "world_size": 2, "async_scheduling": True}),
    # Beside an EAGLE/MTP draft group: a tail keyed a proof margin past its
    # boundary, fetched with the bridge chunk before it when it lies in the
    # second block past the complete hit.
    (62, "full+mamba", {"offload_prompt_only": False}, {"hash_tokens": 2, "eagle_groups": [0]}),
    # Speculative decoding under async scheduling: an EAGLE drafter beside
    # a window (the drafter's KV depends on the next token: node B may
    # fetch a block whose last position node A computed with another next
    # token, which vLLM's rule allows and the check counts); Mamba states
    # placed from the model runner's corrected counts.
    (95, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False},
     {"spec_tokens": 2, "spec_method": "eagle", "eagle_groups": [0], "async_scheduling": True}),
    (101, "full+mamba", {"offload_prompt_only": False}, {"spec_tokens": 3, "async_scheduling": True}),
]


@pytest.mark.parametrize("seed,specs,extra,opts", REMOTE_CASES, ids=[f"seed{c[0]}-{c[1]}" for c in REMOTE_CASES])
def test_a_second_node_fetches_every_group_s_chunks_and_loads_the_computed_bytes(
    redis_url: str, seed: int, specs: str, extra: dict, opts: dict
) -> None:
    cfg = {**extra, "remote_tier": {"url": redis_url}}
    first: dict[str, Any] = {}
    prom: list[harness.PromRecorder] = []

    def written(e: Any) -> None:
        e.drain_remote()
        e.step()  # the workers' last counters reach the scheduler's stats
        first.update(writes(e))
        # The drafter values node A computed (node B checks a fetched
        # block's last position against them: `Engine.stale_drafter_tails`).
        first["drafter"] = e.drafter_next_tokens

    worker_run(seed, specs, cfg, opts, on_done=written, on_start=lambda e: prom.append(harness.PromRecorder(e)))
    assert first["puts_written"] > 0 and first["puts_failed"] == 0, first
    if seed == 40013:
        # The case's point: node A stored chunks in part and kept them
        # back, and says so.
        assert first["partial_chunks_not_put"] > 0, first
    assert (prom[0].value("kvoffload_remote_partial_chunks_not_put_total") or 0) == first["partial_chunks_not_put"]

    second: dict[str, Any] = {}

    def fetched(e: Any) -> None:
        second["lookup"] = remote_stats(e)
        second["workers"] = writes(e)
        second["state"] = e.connector.scheduler_state()

    def shared_drafter_values(e: Any) -> None:
        e.drafter_next_tokens = first["drafter"]

    seen = worker_run(seed, specs, cfg, opts, on_done=fetched, on_start=shared_drafter_values)
    st = second["lookup"]
    # The second node's host tier starts empty: its hits come from chunks
    # the first node wrote, fetched into its host tier and loaded, every
    # group's bytes right (checked each step by worker_run).
    assert st["fetch_jobs"] > 0 and st["chunks_fetched"] > 0, st
    assert st["fetches_failed"] == 0, st
    assert st["chunks_found"] >= st["chunks_fetched"], st
    if opts.get("hash_tokens") and "mamba" in specs:
        # States inside a block came from the remote tier too, and were
        # loaded (their bytes checked with the rest).
        assert st["partial_tails_fetched"] > 0, st
        assert seen["states_restored_inside_block"] > 0, seen
    assert seen["loads"] > 0 and seen["checked"] > 0, seen
    assert seen["window_loads"] > 0 or specs in ("full", "mla", "full+ring"), seen
    w = second["workers"]
    world = opts.get("world_size", 1)
    assert w["hits"] == st["chunks_fetched"] * world and w["misses"] == 0, (w, st)
    assert w["rejected_values"] == 0, w
    assert second["state"]["remote_probes"] == 0, second["state"]


#: (seed, group specs, extra config, engine options, node A's and node B's
#: tensor-parallel sizes): KV heads as shares (``canonical_layout``) between
#: nodes of other sizes, over windows, async scheduling, EAGLE draft
#: groups, an EAGLE drafter run for real, MLA.
HEAD_CASES = [
    (1, "full+swa8", {"offload_prompt_only": False}, {}, 2, 1),
    (4, "swa6+full", {}, {"async_scheduling": True}, 1, 2),
    (20, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"eagle_groups": [0]}, 4, 2),
    (23, "mla", {"offload_prompt_only": False}, {"eagle_groups": [0]}, 2, 1),
    (95, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False},
     {"spec_tokens": 2, "spec_method": "eagle", "eagle_groups": [0], "async_scheduling": True}, 1, 4),
]


@pytest.mark.parametrize(
    "seed,specs,extra,opts,tp_a,tp_b", HEAD_CASES, ids=[f"seed{c[0]}-{c[1]}-tp{c[4]}to{c[5]}" for c in HEAD_CASES]
)
def test_with_canonical_layout_a_node_of_another_tensor_parallel_size_loads_every_group_s_heads(
    redis_url: str, seed: int, specs: str, extra: dict, opts: dict, tp_a: int, tp_b: int
) -> None:
    """With ``canonical_layout`` a chunk's shares are the model's KV heads:
    node A on `tp_a` workers writes every group's chunks through, node B on
    `tp_b` workers fetches the heads each of its workers holds and loads
    them, every group's bytes right (the fake model writes each head's
    index in the model into its values: a worker given another head's
    bytes fails the check)."""
    cfg = {**extra, "canonical_layout": True, "remote_tier": {"url": redis_url}}
    first: dict[str, Any] = {}

    def written(e: Any) -> None:
        e.drain_remote()
        first.update(writes(e))
        first["shares"] = e.connector.engine_config.remote_shares
        first["drafter"] = e.drafter_next_tokens

    worker_run(seed, specs, cfg, opts, on_done=written, tp=tp_a)
    heads = 1 if specs == "mla" else 4
    assert first["shares"] == heads
    assert first["puts_written"] > 0 and first["puts_written"] % heads == 0 and first["puts_failed"] == 0, first
    second: dict[str, Any] = {}

    def fetched(e: Any) -> None:
        second["lookup"] = remote_stats(e)
        second["workers"] = writes(e)

    def shared_drafter_values(e: Any) -> None:
        e.drafter_next_tokens = first["drafter"]

    seen = worker_run(seed, specs, cfg, opts, on_done=fetched, on_start=shared_drafter_values, tp=tp_b)
    st = second["lookup"]
    assert st["chunks_fetched"] > 0 and st["fetches_failed"] == 0, st
    assert seen["loads"] > 0 and seen["checked"] > 0, seen
    # Every worker fetched the shares of the heads it holds (MLA's one
    # "head": every worker).
    w = second["workers"]
    held = tp_b if heads == 1 else heads
    assert w["hits"] == st["chunks_fetched"] * held and w["misses"] == 0 and w["rejected_values"] == 0, (w, st)


#: The configuration of the seed (50088) whose hit read an unwritten
#: window block: full attention beside windows of 8 and 13 tokens, chunks
#: of two blocks, requests' `kv_transfer_params`.
HOLE_CASE = ("full+swa8+swa13", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"params": True})


def test_a_hit_never_loads_a_window_block_its_store_left_unwritten(redis_url: str) -> None:
    """vLLM's connector stores a sliding window's chunk without the blocks
    the storing request's window has passed, where its reachable-block mask
    says no hit needs them; a hit cut by a request's ``max_load_tokens``
    can end where the mask did not look, and vLLM 0.33.0 then loads the
    unwritten block (the next test shows it with vLLM's own connector). Seed 50088 of the "params" configuration with a host
    tier twice the usual (found by ``widen-hybrid-remote.py --heads``; the
    remote tier's lookups shift vLLM's schedule onto it): request q60, its
    load capped at 12 tokens, hits 8 whose window chunk was stored without
    its first block. kvoffload cuts such a hit before the chunk
    (`hybrid/holes.rs`): every byte right (checked each step), and the cut
    counted."""
    specs, extra, opts = HOLE_CASE
    _, usual = engine_options(specs, extra, opts)
    cfg = {**extra, "cpu_bytes_to_use": 2 * usual["cpu_bytes_to_use"], "remote_tier": {"url": redis_url}}
    state: dict[str, Any] = {}
    seen = worker_run(50088, specs, cfg, opts, on_done=lambda e: state.update(e.connector.scheduler_state()))
    assert seen["loads"] > 0 and seen["checked"] > 0, seen
    assert state["hits_cut_at_partial_chunks"] > 0, state
    assert 0 < state["partial_chunk_records"], state


def test_vllm_s_own_connector_loads_the_unwritten_window_block_on_that_schedule(redis_url: str, monkeypatch) -> None:
    """The previous test's schedule with vLLM 0.33.0's own
    ``OffloadingConnector`` (its scheduler side, fake workers): kvoffload's
    run gives the lookups its remote tier answered "not yet", and vLLM's
    scheduler gets the same answers at the same steps. vLLM stores the
    13-token window's first chunk without its first block (request q2, at
    step 3: group 2 from block 1) and later loads that chunk whole into
    two blocks request q60 holds: the unwritten sub-block reaches the
    model. (Were vLLM fixed, this fails; kvoffload then need no longer cut.)"""
    import test_hybrid_vllm as hy
    from harness import build

    specs, extra, opts = HOLE_CASE
    usual = engine_options

    def doubled(*args: Any) -> Any:
        common, cfg = usual(*args)
        return common, {**cfg, "cpu_bytes_to_use": 2 * cfg["cpu_bytes_to_use"]}

    monkeypatch.setattr(hy, "engine_options", doubled)
    import test_hybrid_worker as hw

    monkeypatch.setattr(hw, "engine_options", doubled)
    deferred: set[tuple[int, str]] = set()

    def record_deferrals(e: Any) -> None:
        inner = e.connector.get_num_new_matched_tokens

        def lookup(request: Any, n: int, *a: Any, **k: Any) -> Any:
            got = inner(request, n, *a, **k)
            if got[0] is None:
                deferred.add((e.steps, request.request_id))
            return got

        e.connector.get_num_new_matched_tokens = lookup

    worker_run(50088, specs, {**extra, "remote_tier": {"url": redis_url}}, opts, on_start=record_deferrals)
    assert deferred
    common, cfg = doubled(specs, extra, opts)
    e = build(connector="OffloadingConnector", module=None, extra=cfg, fake_worker=hy.vllm_worker(1), tpb=TPB,
              groups=SPECS[specs](), **common)
    inner = e.connector.get_num_new_matched_tokens

    def not_yet_as_kvoffload(request: Any, n: int, *a: Any, **k: Any) -> Any:
        if (e.steps, request.request_id) in deferred:
            return None, False
        return inner(request, n, *a, **k)

    e.connector.get_num_new_matched_tokens = not_yet_as_kvoffload
    stores: list[tuple[str, list, list, list]] = []
    q60: list[tuple[list, list, list]] = []
    build_meta = e.connector.build_connector_meta

    def meta(so: Any) -> Any:
        m = build_meta(so)
        for tj in m.store_jobs.values():
            src = tj.src_spec
            stores.append((tj.req_id, list(src.group_sizes), list(src.block_indices), [int(x) for x in tj.dst_spec.block_ids]))
        for tj in m.load_jobs.values():
            if tj.req_id == "q60":
                dst = tj.dst_spec
                q60.append(([int(x) for x in tj.src_spec.block_ids], list(dst.group_sizes), list(dst.block_indices)))
        return m

    e.connector.build_connector_meta = meta
    hy.drive(e, 50088, lambda so: {}, opts)
    bpc = 2

    def chunks_of(chunks: list, sizes: list, first: list) -> list[list]:
        out, at = [], 0
        for size, index in zip(sizes, first):
            n = -(-(index % bpc + size) // bpc) if size else 0
            out.append(chunks[at:at + n])
            at += n
        return out

    assert q60, "vLLM never loaded for q60"
    chunks, sizes, first = q60[0]
    # q60's hit: 8 tokens, every group's first chunk, both blocks each.
    assert sizes == [2, 2, 2] and first == [0, 0, 0], q60[0]
    window_chunk = chunks_of(chunks, sizes, first)[2][0]
    writes = [(rid, idx[2], size[2]) for rid, size, idx, c in stores if window_chunk in chunks_of(c, size, idx)[2]]
    # The one store of that chunk wrote its second block only.
    assert writes == [("q2", 1, 1)], writes


def test_written_on_eviction_a_second_node_finds_every_group_s_evicted_chunks(redis_url: str) -> None:
    """With ``write = "on_eviction"`` and a host tier a tenth of the usual,
    node A writes the chunks its host tier evicts, of every group; node B
    fetches them and loads the computed bytes (checked every step)."""
    specs, opts = "full+swa8+swa13", {}
    extra = {"block_size": 2 * TPB, "offload_prompt_only": False}
    _, usual = engine_options(specs, extra, opts)
    cfg = {
        **extra,
        "cpu_bytes_to_use": usual["cpu_bytes_to_use"] // 10,
        "remote_tier": {"url": redis_url, "write": "on_eviction"},
    }
    first: dict[str, Any] = {}
    worker_run(3, specs, cfg, opts, on_done=lambda e: (e.drain_remote(), first.update(writes(e))))
    assert first["puts_written"] > 0 and first["puts_failed"] == 0, first
    second: dict[str, Any] = {}
    seen = worker_run(3, specs, cfg, opts, on_done=lambda e: second.update(remote_stats(e)))
    assert second["chunks_fetched"] > 0 and second["fetches_failed"] == 0, second
    assert seen["window_loads"] > 0, seen


def stored_by_group(e: harness.Engine) -> list:
    """``(group, block hash)`` of every block the connector's `BlockStored`
    events announce, in order."""
    stored: list = []
    take = e.connector.take_events

    def take_events() -> list:
        got = list(take())
        for ev in got:
            if isinstance(ev, BlockStored):
                stored.extend((ev.group_idx, h) for h in ev.block_hashes)
        return got

    e.connector.take_events = take_events
    return stored


def hybrid_node(remote: dict, specs: str = "full+swa8", **kw: Any) -> harness.Engine:
    extra = {"num_cpu_chunks": 64, "offload_prompt_only": False, "remote_tier": remote}
    return harness.build(extra=extra, tpb=TPB, groups=SPECS[specs](), num_gpu_blocks=96, **kw)


@pytest.mark.parametrize(
    "store,specs",
    [("standalone", "full+swa8"), ("cluster", "full+swa8"), ("standalone", "full+swa8b8")],
    ids=["standalone", "cluster", "standalone-block-sizes"],
)
def test_the_remote_tier_gives_a_second_node_the_hit_the_host_tier_gives_the_first(
    store: str, specs: str, request
) -> None:
    """Node A computes a prefix (full attention and an 8-token window),
    writes it through, then, its GPU prefix cache reset, finds a second
    prompt's hit in its host tier; node B, its host tier empty, finds the
    same hit in the remote tier: the same tokens, reported as a remote
    store, the same bytes, announced by the same blocks of the same groups.
    On one server and on a Redis Cluster of three masters; and with the
    window's blocks twice full attention's (its chunks span two of the
    other group's: the split by source counts both in tokens)."""
    url = request.getfixturevalue("redis_url" if store == "standalone" else "redis_cluster")
    remote = {"url": url, "cluster": store == "cluster"}
    a = hybrid_node(remote, specs)
    stored_a = stored_by_group(a)
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    a.drain_remote()
    assert writes(a)["puts_written"] > 0
    assert a.scheduler.reset_prefix_cache(), "the GPU prefix cache holds no running request"
    host_sources = record_hit_sources(a)
    a.add(PREFIX + [7, 8, 9], max_tokens=3, req_id="again")
    assert run_checked(a) > 0
    # The remote tier holds what node A's host tier holds: nothing to fetch.
    assert remote_stats(a)["chunks_fetched"] == 0, remote_stats(a)
    [(_, host_hit, host_split)] = host_sources
    assert host_hit > 0 and host_split == {"host": host_hit}, (host_sources, remote_stats(a))
    leak_free(a)

    b = hybrid_node(remote, specs)
    stored_b = stored_by_group(b)
    remote_sources = record_hit_sources(b)
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3, req_id="again")
    assert run_checked(b) > 0
    assert r in b.loaded and not b.failed
    # vLLM's label for a remote store; the hit the host tier gave node A.
    assert remote_sources == [(r, host_hit, {"external_unspecified": host_hit})], (remote_sources, host_sources)
    st = remote_stats(b)
    assert st["fetch_jobs"] == 1 and st["fetches_failed"] == 0, st
    leak_free(b)
    assert b.connector.scheduler_state()["remote_probes"] == 0
    # The fetched chunks are announced as node A announced them, per group:
    # the full-attention prefix and the sliding window before the hit's end.
    fetched = stored_b[: st["chunks_fetched"]]
    assert set(fetched) <= set(stored_a), (fetched, stored_a)
    assert {g for g, _ in fetched} == {0, 1}, fetched


def test_a_second_node_fetches_a_mamba_state_inside_a_block_as_the_first_node_stored_it(redis_url: str) -> None:
    """Hashes every 2 tokens, 4-token blocks, full attention beside a Mamba
    state. Node A computes a 43-token prompt: its host tier gets the
    complete chunks to 40 and the partial tail at 42 (the state after 42
    tokens and the attention block holding tokens 40 and 41), and writes
    them through; the same prompt again, its GPU prefix cache reset, hits
    42 tokens in its host tier. Node B, its host tier empty, hits the same
    42 tokens: the complete chunks and the partial tail asked about and
    fetched together, every byte and the state right, all reported as a
    remote store, and its fetches announced by the blocks node A
    announced."""
    prompt = PREFIX + [1, 2, 3]
    remote = {"url": redis_url}
    a = hybrid_node(remote, "full+mamba", hash_tokens=2)
    stored_a = stored_by_group(a)
    a.add(prompt, max_tokens=2)
    run_checked(a)
    a.drain_remote()
    assert writes(a)["puts_written"] > 0
    assert a.scheduler.reset_prefix_cache(), "the GPU prefix cache holds no running request"
    host_sources = record_hit_sources(a)
    a.add(prompt, max_tokens=3, req_id="again")
    assert run_checked(a) > 0
    assert host_sources and host_sources[0][1:] == (42, {"host": 42}), host_sources
    leak_free(a)

    b = hybrid_node(remote, "full+mamba", hash_tokens=2)
    stored_b = stored_by_group(b)
    remote_sources = record_hit_sources(b)
    r = b.add(prompt, max_tokens=3, req_id="again")
    assert run_checked(b) > 0
    assert r in b.loaded and not b.failed
    assert b.states_restored_inside_block > 0
    assert remote_sources == [(r, 42, {"external_unspecified": 42})], remote_sources
    st = remote_stats(b)
    # One remote lookup and one fetch: the complete chunks (full
    # attention's ten, the state at 40) and the partial tail (both groups'
    # keys at 42).
    assert (st["lookups"], st["fetch_jobs"], st["partial_tails_fetched"], st["chunks_fetched"]) == (1, 1, 1, 13), st
    assert st["fetches_failed"] == 0, st
    leak_free(b)
    assert b.connector.scheduler_state()["remote_probes"] == 0
    fetched = stored_b[: st["chunks_fetched"]]
    assert set(fetched) <= set(stored_a), (fetched, stored_a)
    assert sum(g == 1 for g, _ in fetched) == 2, fetched


def test_the_namespace_names_every_group() -> None:
    """Chunks are keyed by group and hold one group's layers: deployments
    whose groups differ (another window, the hybrid manager turned off)
    never read each other's chunks. The store need not be up to start."""
    from kvoffload.vllm import _remote_namespace

    def namespace(**kw: Any) -> int:
        extra = {"cpu_bytes_to_use": 1 << 20, "remote_tier": {"url": "redis://127.0.0.1:1"}}
        w = harness.build(extra=extra, **{"tpb": TPB, **kw}).workers[0]._worker
        return _remote_namespace(w.vllm_config, w.kv_cache_config, w.cfg)

    hybrid = namespace(groups=[full(), window(8)])
    assert hybrid == namespace(groups=[full(), window(8)]), "deterministic"
    assert hybrid != namespace(groups=[full(), window(16)])
    assert hybrid != namespace(groups=[full(), window(8), window(13)])
    assert hybrid != namespace(spec=full())
    # Chunked-local attention over 8-token chunks is not an 8-token window.
    assert hybrid != namespace(groups=[full(), local(8)])
    assert namespace(groups=[full(), local(8)]) != namespace(groups=[full(), local(16)])
    # Mamba groups are named with their states' shapes and dtypes, alone too.
    with_mamba = namespace(groups=[full(), mamba()])
    assert with_mamba not in (hybrid, namespace(groups=[full(), window(8)]))
    other_state = dataclasses.replace(mamba(), shapes=((8, 2), (6, 8)))
    assert with_mamba != namespace(groups=[full(), other_state])
    assert namespace(groups=[mamba()]) != namespace(groups=[other_state])
    # Decode context parallelism over two ranks: blocks of 2 x 4 tokens,
    # each rank every other token (or every other run of the interleave
    # size: other bytes under the same sizes, so another namespace); a
    # deployment of 8-token blocks without DCP is another too.
    extra = {"cpu_bytes_to_use": 1 << 20, "remote_tier": {"url": "redis://127.0.0.1:1"}}
    w = harness.build(extra=extra, tpb=TPB, spec=full(), world_size=2, dcp=2).workers[0]._worker
    dcp = _remote_namespace(w.vllm_config, w.kv_cache_config, w.cfg)
    assert dcp == namespace(spec=full(), world_size=2, dcp=2), "deterministic"
    w.vllm_config.parallel_config.cp_kv_cache_interleave_size = 2
    assert _remote_namespace(w.vllm_config, w.kv_cache_config, w.cfg) != dcp
    # Two pipeline stages of the same world size: each rank holds its
    # stage's layers, not a tensor-parallel share of every layer.
    w = harness.build(extra=extra, tpb=TPB, spec=full(), world_size=2).workers[0]._worker
    tensor = _remote_namespace(w.vllm_config, w.kv_cache_config, w.cfg)
    w.vllm_config.parallel_config.pipeline_parallel_size = 2
    assert _remote_namespace(w.vllm_config, w.kv_cache_config, w.cfg) != tensor
    wide = FullAttentionSpec(block_size=2 * TPB, num_kv_heads=harness.HEADS, head_size=harness.HEAD_SIZE,
                             dtype=torch.float32)
    assert dcp != namespace(spec=wide, world_size=2, tpb=2 * TPB)
