"""kvoffload's vLLM connector driven by vLLM 0.33.0's real core scheduler
(sync and async), with worker-role connectors over CPU KV tensors and a fake
model that writes deterministic KV bytes (``harness``)."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

import pytest
import torch
from vllm.v1.request import RequestStatus

import harness
import kvoffload
from kvoffload.vllm import KvOffloadConnector

PREFIX = list(range(1000, 1040))  # 40 tokens: 10 blocks of 4


def leak_free(e: harness.Engine) -> dict:
    st = e.connector.scheduler_state()
    assert st["invariants"] is None, st
    for k in ("jobs", "requests", "chunks_being_loaded", "fenced_blocks", "stalled_jobs",
              "quarantined_chunks", "pinned_chunks", "pending_chunks"):
        assert st[k] == 0, (k, st)
    assert all(w._worker.core.in_flight() == 0 for w in e.workers), "worker jobs left"
    core = e.connector._scheduler.core
    assert core.held_requests() == 0, "the binding still holds finished requests"
    # vLLM's hash of every chunk in the tier is held for its events, nothing more.
    assert core.held_hashes() == st["cached_chunks"], (core.held_hashes(), st)
    # Self-describing payloads: at most one per chunk in the tier.
    assert core.held_payloads() <= st["cached_chunks"], (core.held_payloads(), st)
    return st


def run_checked(e: harness.Engine, max_steps: int = 400) -> int:
    """Steps to the end, checking the KV of every running request after each step."""
    checked = 0
    for _ in range(max_steps):
        if not e.scheduler.has_requests() and e.pending is None:
            return checked
        if e.scheduler.has_requests():
            e.step()
        else:
            e.flush_async()
        for rid, req in e.scheduler.requests.items():
            if req.status == RequestStatus.RUNNING:
                checked += e.check_kv(rid)
    raise AssertionError("requests still running")


def evict_gpu_prefix(e: harness.Engine, n: int = 6) -> None:
    for i in range(n):
        e.add(list(range(5000 + 100 * i, 5040 + 100 * i)), max_tokens=2)
    run_checked(e)


def prefix_comes_back(e: harness.Engine) -> None:
    """A request computes a prefix, other requests evict it from the GPU,
    and a request sharing it loads it back from the host tier: every
    running request's KV checked after every step, nothing leaked."""
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3)
    checked = run_checked(e)
    assert b in e.loaded, "the prefix came back from the host tier"
    assert checked > 0
    leak_free(e)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_prefix_evicted_from_the_gpu_is_loaded_back_with_the_computed_bytes(async_scheduling, world_size):
    e = harness.build(
        num_gpu_blocks=32, world_size=world_size, async_scheduling=async_scheduling,
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False},
    )
    prom = harness.PromRecorder(e)
    prefix_comes_back(e)
    # vLLM's kv_offload metrics, through vLLM's own stats path and exporter:
    # the bytes moved (summed over the workers), the lookups, the tier's facts.
    page = 2 * harness.HEADS * harness.HEAD_SIZE * 4 * 4  # K,V x heads x head x tpb x float32
    loaded = prom.value("vllm:kv_offload_load_bytes_total")
    assert loaded is not None and loaded > 0 and loaded % (page * 2) == 0, loaded
    assert prom.value("vllm:kv_offload_store_bytes_total") > loaded
    assert prom.value("vllm:kv_offload_lookup_sync_delay_seconds_count") > 0
    assert prom.value("vllm:kv_offload_cpu_cache_usage_perc") == 0.0, "nothing in flight at the end"
    info = [s for m in prom.registry.collect() for s in m.samples if s.name == "vllm:kv_offload_config_info"]
    assert len(info) == 1 and info[0].labels["cpu_num_chunks"] == "256", info


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_context_parallel_ranks_each_get_their_own_tokens_back(async_scheduling):
    # DCP over two ranks: each worker holds every other token of a block of
    # 2 x 4 tokens (harness.Engine.dcp), its page its own share. A chunk
    # keeps each rank's share; a load brings each rank its own tokens
    # (checked per rank, token by token).
    e = harness.build(
        num_gpu_blocks=32, world_size=2, dcp=2, async_scheduling=async_scheduling,
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False},
    )
    assert e.connector._scheduler.block_size == 8
    prefix_comes_back(e)


def test_preemption_with_stores_in_flight_and_reset_with_requests_running():
    # A GPU pool too small for the batch: vLLM preempts while stores are in
    # flight (submitted one step after their planning). Resets of the prefix
    # cache with requests running: one keeps the host tier, so the running
    # requests vLLM preempts and resumes in the same step load their prefix
    # from it (loads created in the same step as their preemption notice);
    # one resets the host tier too.
    e = harness.build(num_gpu_blocks=24, extra={"num_cpu_chunks": 128, "offload_prompt_only": False})
    seen = {"preempt_with_load": 0, "preempted": 0}
    orig = e.connector._scheduler.build_connector_meta

    def spy(so):
        meta = orig(so)
        if so.preempted_req_ids:
            seen["preempted"] += 1
            if set(meta.load_requests.values()) & set(so.preempted_req_ids):
                seen["preempt_with_load"] += 1
        return meta

    e.connector._scheduler.build_connector_meta = spy
    rng = random.Random(7)
    for round_ in range(4):
        for i in range(6):
            family = rng.randrange(3)
            e.add(PREFIX[: 16 + 8 * family] + [rng.randrange(1, 900) for _ in range(rng.randrange(3, 12))],
                  max_tokens=rng.randrange(4, 12))
        for _ in range(4):
            if e.scheduler.has_requests():
                e.step()
        if round_ in (1, 2):
            # vLLM 0.33 cannot reset its prefix cache while a request waits
            # for a load ("not supported yet"): let the loads land first.
            for _ in range(20):
                if not any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                           for r in e.scheduler.requests.values()):
                    break
                e.step()
            e.flush_async()
            assert e.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=round_ == 2)
        run_checked(e)
    assert seen["preempted"] > 0 and seen["preempt_with_load"] > 0, seen
    leak_free(e)


def test_abort_during_a_load():
    e = harness.build(num_gpu_blocks=32, extra={"num_cpu_chunks": 256, "offload_prompt_only": False})
    e.add(PREFIX + [1], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    b = e.add(PREFIX + [5, 6], max_tokens=4)
    for _ in range(10):
        e.step()
        if e.scheduler.requests[b].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert e.scheduler.requests[b].status == RequestStatus.WAITING_FOR_REMOTE_KVS, "a load in flight"
    e.scheduler.finish_requests(b, RequestStatus.FINISHED_ABORTED)
    run_checked(e)
    leak_free(e)


def manual_clock(e: harness.Engine, timeout_s: float = 1.0) -> kvoffload.SchedulerCore:
    """Puts the scheduler on a manual clock (no watchdog thread: the stall
    scan runs at each step when due)."""
    side = e.connector._scheduler
    cfg = json.loads(side.cfg.to_json())
    cfg["stall_timeout_ms"] = int(timeout_s * 1000)
    cfg["stall_scan_interval_ms"] = 100
    side.core = kvoffload.SchedulerCore(
        json.dumps(cfg), watchdog=False, manual_clock=True, self_describing=side.self_describing
    )
    side.scan_in_hooks = True
    return side.core


@pytest.mark.parametrize("self_describing", [False, True], ids=["placeholder-events", "self-describing-events"])
def test_a_stalled_store_and_a_stalled_load_end_with_every_request_finished_and_nothing_left(self_describing):
    e = harness.build(
        num_gpu_blocks=32,
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False, "self_describing_kv_events": self_describing},
    )
    core = manual_clock(e)
    prom = harness.PromRecorder(e)
    stalled: dict[str, int] = {}
    arm = {"load": False}

    def inject(w, meta):
        loads, stores, _ = kvoffload._native.plan_jobs(meta.plan)
        if w == 0 and stores and "store" not in stalled:
            stalled["store"] = stores[0]
            e.workers[0]._worker.core.set_fault(stores[0], "stall")
        if w == 0 and loads and arm["load"] and "load" not in stalled:
            stalled["load"] = loads[0]
            e.workers[0]._worker.core.set_fault(loads[0], "stall")

    e.on_worker_meta = inject
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    for _ in range(4):
        e.step()
    assert "store" in stalled
    core.advance_clock(2000)  # past the stall timeout: the next step's scan finds it
    run_checked(e)
    assert core.metrics()["stalled_stores"] == 1
    # Its late completion ends the quarantine.
    assert e.workers[0]._worker.core.release_stalled(stalled["store"])
    # A prefix that was stored, then evicted from the GPU: its load stalls.
    e.add(PREFIX[:24] + [9], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    arm["load"] = True
    b = e.add(PREFIX[:24] + [4, 4], max_tokens=3)
    for _ in range(6):
        e.step()
    assert "load" in stalled, "a load was planned"
    assert e.scheduler.requests[b].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    core.advance_clock(2000)
    checked = run_checked(e)
    assert core.metrics()["stalled_loads"] == 1
    assert b in e.failed, "vLLM was told the load failed (it recomputes)"
    assert checked > 0, "the request finished with the right KV"
    leak_free(e)
    # The stall metrics beside vLLM's, through vLLM's exporter.
    stalled_transfers = "vllm:kv_offload_stalled_transfers_total"
    assert prom.value(stalled_transfers, transfer_type="GPU_to_CPU") == 1
    assert prom.value(stalled_transfers, transfer_type="CPU_to_GPU") == 1
    assert prom.value("kvoffload_quarantined_chunks") == 0, "the quarantine ended"
    if self_describing:
        assert core.held_payloads() > 0, "payloads are kept for the chunks in the tier"


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"cpu_bytes_to_use": 10**9, "bogus_key": 1}, "bogus_key"),
        ({"cpu_bytes_to_use": 10**9, "eviction_policy": "fifo"}, "eviction_policy"),
        ({"cpu_bytes_to_use": 10**9, "block_size": 6}, "block_size"),
        ({"cpu_bytes_to_use": 10**9, "stall_timeout_s": -1}, "stall_timeout_s"),
        ({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use"),
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 10**9, "spec_name": "Other"}, "spec_name"),
        ({"cpu_bytes_to_use": 10**9, "cache_policy_module_path": "my.policy"}, "'cache_policy_module_path' is not supported: a Python eviction policy"),
        ({"cpu_bytes_to_use": 10**9, "secondary_tiers": []}, "'secondary_tiers' is not supported: .* remote_tier"),
        ({"cpu_bytes_to_use": 10**9, "backpressure": {}}, "'backpressure' is not supported: .*queue_capacity"),
        ({"cpu_bytes_to_use": 10**9, "self_describing_kv_events": "yes"}, "self_describing_kv_events"),
        ({"cpu_bytes_to_use": 10**9, "replicated_writes": "rank0"}, 'replicated_writes = .rank0. is not allowed: allowed "turns", "vllm"'),
        ({"cpu_bytes_to_use": 10**9, "stall_timeout_s": 1, "stall_scan_interval_s": 5}, "stall_scan_interval_ms"),
    ],
)
def test_bad_configuration_stops_startup_naming_the_key(extra, needle):
    with pytest.raises(ValueError, match=needle):
        harness.build(extra=extra)


def test_vllm_s_keys_kvoffload_does_not_take_are_absent_when_none():
    e = harness.build(extra={"cpu_bytes_to_use": 10**9, "cache_policy_module_path": None, "secondary_tiers": None})
    assert e.connector.engine_config.num_cpu_chunks > 0


def test_a_strategy_table_is_checked_at_startup_and_a_bad_one_named(tmp_path):
    good = tmp_path / "table.json"
    good.write_text(
        '{"rules": [{"min_descriptors": 0, "max_descriptors": 7, "strategy": "dma"}],'
        ' "fallback": "kernel_graph", "tuning": {"kernel_ctas": 16, "ring_slots": 8}}'
    )
    e = harness.build(extra={"cpu_bytes_to_use": 10**9, "strategy_table": str(good)})
    assert e.connector.engine_config.strategy_table == str(good)
    assert harness.build(extra={"cpu_bytes_to_use": 10**9}).connector.engine_config.strategy_table is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [], "fallback": "warp"}')
    ranged = tmp_path / "ranged.json"
    ranged.write_text('{"rules": [], "fallback": "dma", "tuning": {"ring_slots": 0}}')
    for path, needle in [
        (bad, "warp"),
        (ranged, "ring_slots = 0"),
        (tmp_path / "missing.json", "missing.json"),
    ]:
        with pytest.raises(ValueError, match="strategy_table") as err:
            harness.build(extra={"cpu_bytes_to_use": 10**9, "strategy_table": str(path)})
        assert needle in str(err.value), err.value
    with pytest.raises(ValueError, match="strategy_table = 3 is not a file path"):
        harness.build(extra={"cpu_bytes_to_use": 10**9, "strategy_table": 3})


def test_cpu_bytes_to_use_sizes_the_tier_as_vllm_does():
    e = harness.build(extra={"cpu_bytes_to_use": 10 * 4096 + 17, "offload_prompt_only": False})
    cfg = e.connector.engine_config
    # 2 layers x 256-byte pages = 512 bytes per block, aligned up to a 4 KiB page.
    assert cfg.worker_chunk_bytes == 512 and cfg.num_cpu_chunks == 10
    assert isinstance(e.connector, KvOffloadConnector)


@pytest.mark.parametrize("shape", ["one group", "layers of two page sizes", "sliding and full groups"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_replicated_kv_is_kept_once_in_a_region_every_worker_maps(async_scheduling, shape):
    """vLLM keeps one copy of MLA KV replicated on every tensor-parallel rank
    (its ``replicated_layout``): one host region every worker maps, rank 0
    writing the stores, every rank loading from it. Here too, with vLLM's
    writers (``replicated_writes: "vllm"``): rank 1 never copies a store,
    yet loads the prefix back with the bytes the model computed (which it
    can only have from rank 0's writes)."""
    import os

    page = 2 * harness.HEADS * harness.HEAD_SIZE * 4 * 4  # K,V x heads x head x tpb x float32
    chunk = 2 * page  # two layers, one block a chunk: 512 bytes, a 4 KiB host page
    extra = {"cpu_bytes_to_use": 256 * 4096, "offload_prompt_only": False, "replicated_writes": "vllm"}
    e = harness.build(num_gpu_blocks=32, world_size=2, replicated=True, async_scheduling=async_scheduling,
                      extra=extra, **_replicated_shapes()[shape])
    cfg = e.connector.engine_config
    cores = [w._worker.core for w in e.workers]
    if shape == "one group":
        # One copy of a chunk, as vLLM's. Here a chunk's 512 bytes round up
        # to a 4 KiB page with one copy or two; where a worker's part is
        # larger the counts differ (the sizing test below).
        assert cfg.replicated_layout and cfg.worker_chunk_bytes == chunk
        assert cfg.host_chunk_bytes == 4096 and cfg.num_cpu_chunks == 256
        two = harness.build(num_gpu_blocks=32, world_size=2, async_scheduling=async_scheduling, extra=extra)
        two_cfg = two.connector.engine_config
        assert not two_cfg.replicated_layout and two_cfg.host_chunk_bytes == 4096 and two_cfg.num_cpu_chunks == 256
        assert [c.pool_bytes for c in cores] == [256 * 4096] * 2
    assert cfg.replicated_layout
    path = cores[0].shared_region
    assert path is not None and path == cores[1].shared_region and os.path.exists(path), path
    assert path.startswith("/dev/shm/kvoffload_") and str(os.getppid()) in path
    assert [c.store_writer for c in cores] == [True, False]
    assert [c.store_turn for c in cores] == [None, None]
    prom = harness.PromRecorder(e)
    if shape == "one group":
        prefix_comes_back(e)
    else:
        prefix_comes_back_from_the_host_tier(e)
    # Every worker had mapped it by the first step: its name is gone.
    assert not os.path.exists(path), path
    # Only rank 0 copied stores; both loaded.
    stored = prom.value("vllm:kv_offload_store_bytes_total")
    loaded = prom.value("vllm:kv_offload_load_bytes_total")
    assert stored and loaded, (stored, loaded)
    if shape == "one group":
        # The same run with a copy per worker: both ranks store, both load.
        prom_two = harness.PromRecorder(two)
        prefix_comes_back(two)
        assert stored % chunk == 0 and loaded % (2 * chunk) == 0, (stored, loaded)
        assert 2 * stored == prom_two.value("vllm:kv_offload_store_bytes_total")
        assert loaded == prom_two.value("vllm:kv_offload_load_bytes_total")


def test_with_canonical_layout_every_worker_writes_the_replicated_stores():
    """With ``canonical_layout`` vLLM's workers all write the stores of
    replicated KV into the region they share (its ``_is_store_writer``), the
    same bytes; rank 0 alone writes them without the key. The same run
    both ways with vLLM's writers (``replicated_writes: "vllm"``): every
    rank loads the prefix back with the computed bytes, and the store bytes
    double with the key. By turns (the default) the key changes nothing:
    each chunk is written once either way."""
    extra = {"cpu_bytes_to_use": 256 * 4096, "offload_prompt_only": False}
    stored = {}
    for writes in ("vllm", "turns"):
        for canonical in (False, True):
            e = harness.build(num_gpu_blocks=32, world_size=2, replicated=True,
                              extra={**extra, "canonical_layout": canonical, "replicated_writes": writes})
            cores = [w._worker.core for w in e.workers]
            assert e.connector.engine_config.canonical_layout == canonical
            if writes == "vllm":
                assert [c.store_writer for c in cores] == [True, canonical]
            else:
                assert [c.store_turn for c in cores] == [(0, 2), (1, 2)]
            assert cores[0].shared_region == cores[1].shared_region
            prom = harness.PromRecorder(e)
            prefix_comes_back(e)
            stored[writes, canonical] = (prom.value("vllm:kv_offload_store_bytes_total"),
                                         prom.value("vllm:kv_offload_load_bytes_total"))
    one_copy = stored["vllm", False]
    assert one_copy[0] and stored["vllm", True][0] == 2 * one_copy[0], stored
    assert stored["vllm", True][1] == one_copy[1], stored
    assert stored["turns", False] == stored["turns", True] == one_copy, stored


def _replicated_shapes() -> dict:
    """Build options of the replicated-KV tests' model shapes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=4, head_size=harness.HEAD_SIZE, dtype=torch.float32)
    return {
        "one group": {},
        # DeepSeek V3.2's MLA and indexer layers: one group, two page sizes.
        "layers of two page sizes": {
            "layer_specs": [FullAttentionSpec(num_kv_heads=harness.HEADS, **common),
                            FullAttentionSpec(num_kv_heads=1, **common)]
        },
        "sliding and full groups": {
            "groups": [FullAttentionSpec(num_kv_heads=harness.HEADS, **common),
                       SlidingWindowSpec(num_kv_heads=harness.HEADS, sliding_window=8, **common)]
        },
    }


@pytest.mark.parametrize("shape", ["one group", "layers of two page sizes", "sliding and full groups"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_replicated_kv_is_written_once_by_turns_of_host_chunk(async_scheduling, shape):
    """By default the workers sharing one copy of replicated KV take turns
    by host chunk: each copies the chunks whose slot is its turn, so both
    ranks write part of every long store (vLLM's rank 0 writes them all,
    over one GPU's link), together each chunk once, the same bytes as
    vLLM's writers, and every rank loads the prefix back with the bytes the
    model computed (each rank half of them from the other's writes)."""
    copied = {}
    for writes in ("vllm", "turns"):
        extra = {"cpu_bytes_to_use": 256 * 4096, "offload_prompt_only": False, "replicated_writes": writes}
        e = harness.build(num_gpu_blocks=32, world_size=2, replicated=True, async_scheduling=async_scheduling,
                          extra=extra, **_replicated_shapes()[shape])
        counters = harness.count_store_bytes(e)
        prom = harness.PromRecorder(e)
        if shape == "one group":
            prefix_comes_back(e)
        else:
            prefix_comes_back_from_the_host_tier(e)
        copied[writes] = ([c.stored for c in counters], prom.value("vllm:kv_offload_store_bytes_total"),
                          prom.value("vllm:kv_offload_load_bytes_total"))
    (rank0, rank1), total, loaded = copied["vllm"]
    assert rank0 == total and rank1 == 0, copied
    turns, turns_total, turns_loaded = copied["turns"]
    assert all(turns) and sum(turns) == turns_total == total, copied
    assert turns_loaded == loaded, copied


def test_the_shared_region_s_name_goes_once_every_worker_mapped_it_or_the_engine_fails(monkeypatch):
    """With vLLM's groups the name goes at registration, once every worker
    passed the barrier (its memory then goes with the last worker, however
    the engine ends); an engine that fails to start leaves no region."""
    import glob
    import os

    import kvoffload.vllm as kv

    def regions() -> set[str]:
        return set(glob.glob(f"/dev/shm/kvoffload_*_{os.getppid()}.mmap"))

    before = regions()
    # The barrier passes for the last worker to arrive (the workers here
    # register one after the other).
    calls: list[int] = []

    def barrier() -> bool:
        calls.append(1)
        return len(calls) == 2

    monkeypatch.setattr(kv, "_all_workers_barrier", barrier)
    extra = {"num_cpu_chunks": 64, "offload_prompt_only": False}
    e = harness.build(num_gpu_blocks=32, world_size=2, replicated=True, extra=extra)
    assert len(calls) == 2 and regions() == before, "gone before the first step"
    prefix_comes_back(e)

    def broken() -> bool:
        raise RuntimeError("a worker failed to start")

    monkeypatch.setattr(kv, "_all_workers_barrier", broken)
    with pytest.raises(RuntimeError, match="failed to start"):
        harness.build(num_gpu_blocks=32, world_size=2, replicated=True, extra=extra)
    assert regions() == before, "an engine that did not start leaves no region"


def test_a_bad_shared_region_is_a_clear_error(tmp_path):
    """An existing file of another size at the region's path (another
    engine's, or one left by a crash) is refused with its path named."""
    from kvoffload._native import WorkerCore

    cache = torch.zeros(8, 512, dtype=torch.uint8)
    tensors = [(cache.data_ptr(), 512, 512)]
    stale = tmp_path / "region.mmap"
    stale.write_bytes(b"x" * 100)
    with pytest.raises(RuntimeError, match="stale file") as err:
        WorkerCore.host(tensors, 8, 1, 4, False, shared_region=str(stale), store_writer=False)
    assert str(stale) in str(err.value)
    with pytest.raises(RuntimeError, match="open"):
        WorkerCore.host(tensors, 8, 1, 4, False, shared_region=str(tmp_path / "no" / "dir.mmap"))
    fine = WorkerCore.host(tensors, 8, 1, 4, False, shared_region=str(tmp_path / "ok.mmap"))
    assert fine.shared_region == str(tmp_path / "ok.mmap") and fine.store_writer
    fine.unlink_shared_region()
    fine.unlink_shared_region()  # a name already gone is not an error
    assert not (tmp_path / "ok.mmap").exists()
    own = WorkerCore.host(tensors, 8, 1, 4, False)
    assert own.shared_region is None
    own.unlink_shared_region()


def test_replicated_mla_is_decided_and_sized_as_vllm_decides(monkeypatch):
    """`_replicated_layout` answers as vLLM's own ``build_offloading_config``
    over the same vLLM configuration, in every combination of the facts it
    reads (MLA, tensor, pipeline and context parallel sizes, world size,
    replicas, executor, nodes), with its CPU spec's shared-region gate on;
    and the host tier's size with one copy is vLLM's CPUOffloadingSpec's,
    chunk for chunk."""
    import itertools
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    import kvoffload.vllm as kv
    from kvoffload.config import EngineConfig

    said: list[str] = []
    monkeypatch.setattr(kv.logger, "warning", lambda msg, *a: said.append(msg % a))
    # On this machine (CPU) vLLM's gate is off, as ours.
    assert kv._uses_shared_region() == CPUOffloadingSpec._uses_shared_region(None) is False

    spec = MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=16, dtype=torch.float32)
    side = harness.build(spec=spec).workers[0]._worker
    vllm_config, kv_cache_config = side.vllm_config, side.kv_cache_config
    per_block = side.cfg.worker_chunk_bytes // side.cfg.blocks_per_chunk
    pc = vllm_config.parallel_config
    monkeypatch.setattr(kv, "_uses_shared_region", lambda: True)
    replicated = 0
    for mla, tp, one_replica, wider, pp, dcp, pcp, backend, nodes in itertools.product(
        (True, False), (1, 2, 4), (False, True), (False, True), (1, 2), (1, 2), (1, 2), ("mp", "ray", "uni"), (1, 2)
    ):
        monkeypatch.setattr(type(vllm_config.model_config), "use_mla", property(lambda _self, m=mla: m))
        for name, value in (
            ("tensor_parallel_size", tp), ("world_size", tp * pp * (2 if wider else 1)),
            ("pipeline_parallel_size", pp), ("decode_context_parallel_size", dcp),
            ("prefill_context_parallel_size", pcp), ("distributed_executor_backend", backend), ("nnodes", nodes),
        ):
            monkeypatch.setattr(pc, name, value)
        monkeypatch.setattr(kv_cache_config, "kv_tp_replicas", 1 if one_replica else tp)
        theirs = build_offloading_config(vllm_config, kv_cache_config).replicated_layout
        facts = (mla, tp, one_replica, wider, pp, dcp, pcp, backend, nodes)
        assert kv._replicated_layout(vllm_config, kv_cache_config, per_block) == theirs, facts
        replicated += theirs
    assert replicated == 2, "MLA on every rank of TP 2 and 4, alone, mp, one node"
    monkeypatch.setattr(kv, "_uses_shared_region", lambda: False)
    assert not kv._replicated_layout(vllm_config, kv_cache_config, per_block), "no shared region: a copy per worker"

    # The size: vLLM's CPU spec over the same facts, its shared region on.
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    for world, block_bytes, bpc, cpu_bytes in [(2, 512, 1, 10**6), (4, 36_864, 2, 7 * 10**8), (8, 3000, 3, 10**7)]:
        for replicated in (False, True):
            spec = CPUOffloadingSpec(
                SimpleNamespace(
                    extra_config={"cpu_bytes_to_use": cpu_bytes},
                    enable_kv_cache_events=False,
                    groups=(SimpleNamespace(tokens_per_block=16, sliding_window_size_in_chunks=None),),
                    cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=bpc),
                    parallel=SimpleNamespace(world_size=world, rank=0),
                    model=SimpleNamespace(max_model_len=4096),
                    worker_kv_bytes_per_block=block_bytes,
                    replicated_layout=replicated,
                )
            )
            ours = EngineConfig.from_extra(
                {"cpu_bytes_to_use": cpu_bytes, "blocks_per_chunk": bpc},
                tokens_per_block=16,
                world_size=world,
                worker_bytes_per_block=block_bytes,
                replicated_layout=replicated,
            )
            facts = (world, block_bytes, bpc, replicated)
            assert ours.num_cpu_chunks == spec.num_chunks, facts
            assert ours.host_chunk_bytes == spec.kv_bytes_per_chunk, facts
    # With a remote tier too: one share of a chunk there, rank 0's.
    remote = {"cpu_bytes_to_use": 10**6, "remote_tier": {"url": "redis://127.0.0.1:1"}}
    for replicated, shares in ((True, 1), (False, 4)):
        cfg = EngineConfig.from_extra(remote, tokens_per_block=16, world_size=4, worker_bytes_per_block=512,
                                      replicated_layout=replicated)
        assert cfg.replicated_layout == replicated and cfg.remote_shares == shares
    assert not said


def test_canonical_layout_decides_replicated_kv_as_vllm_decides(monkeypatch):
    """With ``canonical_layout`` vLLM's connector decides replicated KV by
    another rule: the layout parallelism-agnostic (every layer of every
    group a spec whose canonical page it can derive), every offloaded layer
    plain MLA, one node, one worker or the ``mp`` executor.
    `_parallelism_agnostic` and `_replicated_layout` answer as vLLM's own
    ``build_offloading_config`` over the same vLLM configuration, with the
    key on and off, for single groups (full attention of every head count
    against the model's, MLA, a sliding window), hybrid models (a window or
    a Mamba group beside full attention) and every combination of the
    facts the rules read (tensor and context parallel sizes, world size,
    per-token-head quantisation, executor, nodes, model runner)."""
    import itertools

    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    import kvoffload.vllm as kv
    from kvoffload.config import EngineConfig

    monkeypatch.setattr(kv, "_uses_shared_region", lambda: True)
    tpb, heads, hs = 4, harness.HEADS, harness.HEAD_SIZE
    full = FullAttentionSpec(block_size=tpb, num_kv_heads=heads, head_size=hs, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=tpb, num_kv_heads=heads, head_size=hs, dtype=torch.float32, sliding_window=8)
    mla = MLAAttentionSpec(block_size=tpb, num_kv_heads=1, head_size=2 * heads * hs, dtype=torch.float32)
    mamba = MambaSpec(block_size=tpb, shapes=((4, 4), (6, 8)), dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")
    cases = {
        "full": dict(spec=full),
        "full, one head": dict(spec=dataclasses.replace(full, num_kv_heads=1, head_size=2 * hs)),
        "mla": dict(spec=mla),
        "window": dict(spec=window),
        "full+window": dict(groups=[full, window]),
        "full+mamba": dict(groups=[full, mamba]),
    }
    seen = {"agnostic": 0, "replicated": 0, "canonical widened": 0, "canonical replicated": 0}
    # Every engine built before the class-level patches below.
    sides = {name: harness.build(**options).workers[0]._worker for name, options in cases.items()}
    for name, side in sides.items():
        vllm_config, kv_cache_config = side.vllm_config, side.kv_cache_config
        per_block = side.cfg.worker_chunk_bytes // side.cfg.blocks_per_chunk
        pc = vllm_config.parallel_config
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        groups = kv_cache_config.kv_cache_groups
        plain = [g.kv_cache_spec for g in groups]
        is_mla = isinstance(plain[0], MLAAttentionSpec)
        monkeypatch.setattr(type(vllm_config.model_config), "use_mla", property(lambda _self, m=is_mla: m))
        for canonical, ptq, tp, total, wider, dcp, pcp, backend, nodes, v2 in itertools.product(
            (False, True), (False, True), (1, 2, 4), (1, 2, 4, 8), (False, True), (1, 2), (1, 2), ("mp", "ray"), (1, 2), (False, True)
        ):
            monkeypatch.setitem(extra, "canonical_layout", canonical)
            monkeypatch.setattr(type(vllm_config.model_config), "get_total_num_kv_heads", lambda _self, t=total: t)
            monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda _self, v=v2: v))
            for g, spec in zip(groups, plain):
                quant = KVQuantMode.INT8_PER_TOKEN_HEAD if ptq and hasattr(spec, "kv_quant_mode") else None
                g.kv_cache_spec = dataclasses.replace(spec, kv_quant_mode=quant) if quant else spec
            for attr, value in (
                ("tensor_parallel_size", tp), ("world_size", tp * (2 if wider else 1)),
                ("pipeline_parallel_size", 2 if wider else 1), ("decode_context_parallel_size", dcp),
                ("prefill_context_parallel_size", pcp), ("distributed_executor_backend", backend), ("nnodes", nodes),
            ):
                monkeypatch.setattr(pc, attr, value)
            monkeypatch.setattr(kv_cache_config, "kv_tp_replicas", tp)
            theirs = build_offloading_config(vllm_config, kv_cache_config)
            facts = (name, canonical, ptq, tp, total, wider, dcp, pcp, backend, nodes, v2)
            assert kv._canonical_layout(vllm_config) == canonical
            agnostic = kv._parallelism_agnostic(vllm_config, kv_cache_config, canonical)
            assert agnostic == theirs.parallel.is_parallelism_agnostic, facts
            replicated = kv._replicated_layout(vllm_config, kv_cache_config, per_block, canonical)
            assert replicated == theirs.replicated_layout, facts
            seen["agnostic"] += agnostic
            seen["replicated"] += replicated and not canonical
            seen["canonical widened"] += canonical and agnostic and not kv._parallelism_agnostic(
                vllm_config, kv_cache_config, False
            )
            seen["canonical replicated"] += replicated and canonical
        for g, spec in zip(groups, plain):
            g.kv_cache_spec = spec
    assert all(seen.values()), seen
    # The key is a boolean; anything else is refused by name.
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="canonical_layout"):
            EngineConfig.from_extra(
                {"num_cpu_chunks": 4, "canonical_layout": bad}, tokens_per_block=4, world_size=1, worker_bytes_per_block=64
            )
    cfg = EngineConfig.from_extra(
        {"num_cpu_chunks": 4, "canonical_layout": "true"}, tokens_per_block=4, world_size=1, worker_bytes_per_block=64
    )
    assert cfg.canonical_layout


def test_a_layer_s_heads_are_read_from_the_layouts_vllm_s_canonical_mapping_reads():
    """KV heads as remote shares (`_head_page`) know the page layouts vLLM's
    canonical mapping certifies (``_attention_byte_regions``: K and V apart
    or side by side, a token's heads together or a head's tokens), and no
    other: over shapes, strides, head counts and dtypes, one answers None
    exactly where the other does, and the order read is the strides'."""
    import itertools

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import _attention_byte_regions
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import kvoffload.vllm as kv

    nb, bs = 6, 4
    known = 0
    for heads, hd, dtype in itertools.product((1, 2, 4), (4, 8), (torch.float32, torch.float16)):
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hd, dtype=dtype)
        z = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
        candidates = {
            "split nhd": (z(nb, 2, bs, heads, hd), "nhd", 2),
            "split hnd": (z(nb, 2, heads, bs, hd).transpose(2, 3), "hnd", 2),
            "packed hnd": (z(nb, heads, bs, 2 * hd), "hnd", 1),
            "packed nhd": (z(nb, bs, heads, 2 * hd).transpose(1, 2), "nhd", 1),
            "blocks second": (z(2, nb, bs, heads, hd), None, 0),
            "strided inner": (z(nb, 2, bs, heads, 2 * hd)[..., ::2], None, 0),
            "halves apart": (z(nb, 2, bs + 1, heads, hd)[:, :, :bs], None, 0),
            "other heads": (z(nb, 2, bs, heads + 1, hd), None, 0),
        }
        for name, (t, order, halves) in candidates.items():
            theirs = _attention_byte_regions(t, spec, nb, 0, 1, 1)
            ours = kv._head_page(t, spec, nb)
            facts = (name, heads, hd, dtype)
            assert (ours is None) == (theirs is None), (facts, ours, theirs)
            if ours is not None:
                if heads > 1:  # one head: both orders are the same bytes
                    assert ours[0] == order, facts
                head_bytes = (hd if halves == 2 else 2 * hd) * t.element_size()
                assert ours[1:] == (halves, bs, heads, head_bytes), facts
                known += 1
    assert known == 4 * 12


def test_one_group_holding_a_drafters_layers_takes_the_groups_path():
    """vLLM's connector keeps an EAGLE/MTP drafter's last chunk out of its
    stores and hits, with one KV group too: one full-attention or MLA group
    (DeepSeek's MTP) holding a drafter's layers takes the groups' path,
    which follows it (test_hybrid_vllm.py, cases with ``eagle_groups``);
    without a drafter it keeps the single-group path."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    import kvoffload.vllm as kv

    common = dict(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)

    def config(spec: Any, eagle: bool) -> Any:
        group = SimpleNamespace(kv_cache_spec=spec, is_eagle_group=eagle, layer_names=["l0"])
        return SimpleNamespace(kv_cache_groups=[group])

    for spec in (FullAttentionSpec(**common), MLAAttentionSpec(**common)):
        assert kv.kv_eagle_groups(config(spec, True)) == [0]
        assert kv.kv_group_windows(config(spec, True)) == [None], type(spec).__name__
        assert kv.kv_group_windows(config(spec, False)) is None, type(spec).__name__


def test_decode_context_parallelism_counts_a_block_as_its_tokens_over_every_rank():
    """With DCP each rank holds every dcp-th token of a block: the scheduler
    counts block_size x dcp tokens a block (vLLM's
    ``resolve_dcp_kv_block_size``), the workers move their own pages, and the
    sync-load budget counts a worker's bytes over the block's tokens. A
    spec DCP does not shard keeps its block (several groups:
    ``test_hybrid_vllm.py``'s DCP cases)."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import kvoffload.vllm as kv

    extra = {"num_cpu_chunks": 16, "offload_prompt_only": False}
    for sharded, tokens in ((True, 8), (False, 4)):
        spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=4, dtype=torch.float32, dcp_sharded=sharded)
        vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(decode_context_parallel_size=2, world_size=2, tensor_parallel_size=2),
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
            model_config=None,
        )
        group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])
        kv_cache_config = SimpleNamespace(kv_cache_groups=[group], kv_cache_tensors=[], num_blocks=8)
        cfg = kv._engine_config(vllm_config, kv_cache_config)
        assert cfg.tokens_per_block == tokens
        assert cfg.kv_bytes_per_token == spec.page_size_bytes // tokens


def _sync_engine(world_size: int) -> tuple[harness.Engine, list]:
    """An engine whose loads are synchronous (a budget far above any hit),
    with every lookup's answer recorded as ``(request, hit, load_async)``."""
    e = harness.build(
        num_gpu_blocks=32,
        world_size=world_size,
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False, "sync_load_budget_bytes": 1 << 20},
    )
    answers: list = []
    inner = e.connector.get_num_new_matched_tokens

    def lookup(request, num_computed, *a, **k):
        got = inner(request, num_computed, *a, **k)
        answers.append((request.request_id, got[0], got[1]))
        return got

    e.connector.get_num_new_matched_tokens = lookup
    return e, answers


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sync_load_runs_its_request_in_the_same_step_with_the_computed_bytes(world_size):
    e, answers = _sync_engine(world_size)
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3)
    so = e.step()
    hits = [(hit, load_async) for rid, hit, load_async in answers if rid == b]
    assert hits and hits[-1][0] > 0 and hits[-1][1] is False, hits
    # Scheduled in the step its load was planned, past the loaded tokens,
    # and its KV (loaded and computed) is right at the end of that step.
    assert b in so.num_scheduled_tokens and so.num_scheduled_tokens[b] < len(PREFIX) + 3, so.num_scheduled_tokens
    assert e.scheduler.requests[b].status == RequestStatus.RUNNING
    assert e.check_kv(b) > 0
    run_checked(e)
    assert b not in e.loaded, "a sync load reports no finished load to vLLM"
    leak_free(e)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_speculative_decoding_never_brings_back_a_rejected_draft_s_kv(world_size, async_scheduling, method):
    # Multi-turn chats under speculative decoding (harness: n-gram drafts,
    # about one in three rejected, their KV written at their positions):
    # each turn's prompt is the last turn's prompt and output plus new
    # tokens, so a turn loads blocks that end inside the last turn's
    # output, some at its final sampled token (whose KV no step computed:
    # its slot holds a rejected draft's KV or older bytes). Every running
    # request's KV is checked after every step, the loaded blocks too.
    e = harness.build(
        num_gpu_blocks=32, world_size=world_size, spec_tokens=3, async_scheduling=async_scheduling,
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False},
        spec_method=method, eagle_groups=(0,) if method == "eagle" else (),
    )
    rng = random.Random(11)
    chats = [[rng.randrange(3, 900) for _ in range(rng.randrange(5, 14))] for _ in range(3)]
    loaded = 0
    for turn in range(4):
        for c, prompt in enumerate(chats):
            # Outputs that end on a block boundary (4 tokens a block).
            max_tokens = 4 * rng.randrange(1, 4) - len(prompt) % 4 or 4
            rid = e.add(prompt, max_tokens=max_tokens)
            run_checked(e)
            outputs = [harness.Engine.sampled_token(prompt, len(prompt) + j) for j in range(max_tokens)]
            chats[c] = prompt + outputs + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 6))]
            loaded += rid in e.loaded
        evict_gpu_prefix(e)
    assert e.drafts_accepted > 20 and e.drafts_rejected > 20, (e.drafts_accepted, e.drafts_rejected)
    assert loaded >= 6, f"{loaded} turns loaded their chat from the host tier"
    leak_free(e)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_an_eagle_drafter_s_last_block_is_not_loaded_before_another_next_token(world_size, async_scheduling):
    # An EAGLE drafter run for real (harness: the drafter's KV at a position
    # is a function of its token and the next one). A request computes a
    # 40-token prefix and goes on with other tokens than the second
    # request, which shares the 10 blocks: the drafter's KV at position 39
    # was computed with the first request's token 40. The connector must
    # leave that block out of the second request's hit (vLLM's volatile
    # last chunk of a drafter group): loading it would hand the second
    # request the first's drafter KV, which the KV check catches (tried:
    # with kvoffload treating no group as the drafter's, this test fails).
    e = harness.build(
        num_gpu_blocks=32, world_size=world_size, async_scheduling=async_scheduling,
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False},
        spec_tokens=3, spec_method="eagle", eagle_groups=(0,),
    )
    prefix_comes_back(e)
    assert e.drafts_accepted > 0 and e.drafts_rejected > 0, (e.drafts_accepted, e.drafts_rejected)
    # Not even the first request's drafter value (the harness would
    # otherwise count it as vLLM's stale tail, `Engine.stale_drafter_tails`).
    assert not e.stale_drafter_tails, e.stale_drafter_tails
    leak_free(e)


def test_vllms_own_prefix_cache_serves_a_drafter_block_computed_for_another_next_token():
    # What vLLM's rule for drafter groups does not prove, shown on its own
    # GPU prefix cache (kvoffload's host tier keeps the same rule, so the
    # same holds there): a block's key covers its tokens only, and the
    # drafter's KV at its last position also depends on the next token.
    # The hit drops its last block, which proves the next token against
    # the key of the block after it, but that block may be another
    # request's. A computes blocks 0-1 of an 8-token prefix and goes on
    # with token 50; B, going on with 60, hits block 0 only (block 1 is a
    # hit's last) and computes its own block 1 and block 2; C shares B's
    # first 12 tokens: it hits blocks 0-2, drops block 2, and keeps block 1
    # as vLLM cached it first: A's, computed with next token 50.
    e = harness.build(
        num_gpu_blocks=48, spec_tokens=2, spec_method="eagle", eagle_groups=(0,),
        extra={"num_cpu_chunks": 256, "offload_prompt_only": False},
    )
    prefix = list(range(300, 308))
    e.add(prefix + [50, 51, 52], max_tokens=1)
    run_checked(e)
    e.add(prefix + [60, 61, 62, 63, 64], max_tokens=1)
    run_checked(e)
    c = e.add(prefix + [60, 61, 62, 63, 70, 71], max_tokens=2)
    run_checked(e)
    assert c not in e.loaded, "the hit came from vLLM's GPU prefix cache"
    stale = {(rid, p) for rid, _, p, _ in e.stale_drafter_tails}
    assert stale == {(c, 7)}, e.stale_drafter_tails


def test_a_failed_sync_load_has_its_blocks_recomputed():
    e, answers = _sync_engine(2)
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    failed: list[int] = []

    def inject(w, meta):
        loads, _, _ = kvoffload._native.plan_jobs(meta.plan)
        if w == 1 and loads and not failed:
            failed.append(loads[0])
            e.workers[1]._worker.core.set_fault(loads[0], "fail")

    e.on_worker_meta = inject
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3)
    e.step()
    assert failed, "a load was planned"
    assert any(rid == b and hit and not load_async for rid, hit, load_async in answers)
    # vLLM was told the blocks are invalid (kv_load_failure_policy="recompute"):
    # it computes them again; every step's KV check holds from here on.
    checked = run_checked(e)
    assert checked > 0
    assert e.scheduler.requests.get(b) is None, "the request finished"
    leak_free(e)


@pytest.mark.parametrize("as_int", ["0", "1"])
def test_the_event_hash_converter_is_vllms(monkeypatch, as_int):
    """The events' hashes, converted with the flag read once per call, are
    what vLLM's maybe_convert_block_hash gives, bytes or 64-bit ints."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    import kvoffload.vllm as kv

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    convert = kv.block_hash_converter()
    for h in (bytes(32), bytes(range(32)), b"\xff" * 32, b"\x01" * 8, b"abc"):
        assert convert(h) == maybe_convert_block_hash(h), (as_int, h)
        assert type(convert(h)) is type(maybe_convert_block_hash(h))


def test_a_request_that_skips_reading_the_cache_computes_its_prompt():
    """vLLM's skip_reading_prefix_cache (set for prompt logprobs): the host
    tier holds the prefix, yet the connector answers zero without looking it
    up (vLLM's scheduler also discards a hit for such a request, but the
    lookup's delay observation and a sync-load reservation would remain),
    and the prompt is computed."""
    e, answers = _sync_engine(1)
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    answers.clear()
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3, skip_cache=True)
    assert run_checked(e) > 0
    assert [hit for rid, hit, _ in answers if rid == b] == [0], answers
    assert b not in e.loaded, "nothing was loaded for it"
    # (It left the prefix in the GPU prefix cache: evicted again first.)
    evict_gpu_prefix(e)
    c = e.add(PREFIX + [4, 5, 6], max_tokens=3)
    run_checked(e)
    assert any(rid == c and hit for rid, hit, _ in answers), "a request that reads the cache hits"
    leak_free(e)


def test_without_published_events_nothing_is_logged_or_held():
    # vLLM publishes no KV events unless kv_events_config enables them (its
    # default): the connector then logs none, holds no hash for them, and
    # take_events is empty, while loads and stores work as ever.
    e = harness.build(num_gpu_blocks=32, kv_events=False, extra={"num_cpu_chunks": 64, "offload_prompt_only": False})
    seen = []
    take = e.connector.take_events

    def take_events():
        got = list(take())
        seen.extend(got)
        return got

    e.connector.take_events = take_events
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3)
    run_checked(e)
    assert b in e.loaded
    assert seen == []
    core = e.connector._scheduler.core
    st = e.connector.scheduler_state()
    assert st["cached_chunks"] > 0 and core.held_hashes() == 0
    leak_free_but_hashes(e)


def leak_free_but_hashes(e: harness.Engine) -> None:
    """``leak_free`` for a connector that holds no hash for events."""
    st = e.connector.scheduler_state()
    assert st["invariants"] is None, st
    for k in ("jobs", "requests", "chunks_being_loaded", "fenced_blocks", "pinned_chunks", "pending_chunks"):
        assert st[k] == 0, (k, st)
    assert e.connector._scheduler.core.held_requests() == 0


def prefix_comes_back_from_the_host_tier(e: harness.Engine, evictions: int = 6) -> None:
    """Runs a request of `PREFIX`, drops the prefix from the GPU prefix cache
    (`evictions` other requests), and runs another of the same
    prefix: it loads from the host tier, every running request's KV checked
    after every step, nothing left at the end."""
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e, evictions)
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3)
    assert run_checked(e) > 0
    assert b in e.loaded
    leak_free(e)


def _local_specs() -> dict:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=4, num_kv_heads=harness.HEADS, head_size=harness.HEAD_SIZE, dtype=torch.float32)
    return {
        "sliding": SlidingWindowSpec(sliding_window=8, **common),
        "chunked": ChunkedLocalAttentionSpec(attention_chunk_size=8, **common),
        "full": FullAttentionSpec(**common),
    }


def test_a_model_of_only_chunked_local_attention_loads_its_last_attention_chunk():
    # vLLM frees such layers' blocks behind the current attention chunk
    # while a request runs; the connector follows vLLM's windows (the hybrid
    # path, as for one sliding-window group: test_hybrid_vllm.py, case
    # "swa8"). A request of the same prefix, once the GPU prefix cache has
    # dropped it, loads the blocks its last attention chunk needs (12-token
    # attention chunks: vLLM's GPU prefix cache counts the 36 tokens before
    # the last one as computed without any KV, and the hit ending at token
    # 40 loads tokens 36 to 39, one block); every running request's KV is
    # checked after every step. (Each request holds a block or two: a small
    # GPU cache and a dozen others evict the prefix.)
    import dataclasses

    spec = dataclasses.replace(_local_specs()["chunked"], attention_chunk_size=12)
    e = harness.build(spec=spec, num_gpu_blocks=8, extra={"num_cpu_chunks": 64, "offload_prompt_only": False})
    assert e.connector._scheduler.windows == [("chunked_local", 12)]
    prefix_comes_back_from_the_host_tier(e, 12)


def test_sliding_window_layers_that_retain_extra_tokens_load_their_wider_window():
    # Multi-module MTP makes vLLM keep extra tokens behind each sliding
    # window (extra_retained_tokens), and its connector's lookups, loads and
    # stores widen by them (test_hybrid_vllm.py, "full+swa8x2"). One such
    # group alone: a prefix dropped by the GPU comes back from the host tier
    # with the computed bytes.
    import dataclasses

    spec = dataclasses.replace(_local_specs()["sliding"], extra_retained_tokens=2)
    e = harness.build(spec=spec, num_gpu_blocks=32, extra={"num_cpu_chunks": 64, "offload_prompt_only": False})
    assert e.connector._scheduler.windows == [("sliding_window", 8, 2)]
    prefix_comes_back_from_the_host_tier(e)


def test_with_the_hybrid_manager_off_a_model_mixing_full_and_sliding_window_layers_runs_as_full_attention():
    # With vLLM's hybrid KV cache manager turned off
    # (--disable-hybrid-kv-cache-manager: the way round what several KV
    # groups do not have yet, such as the remote tier), vLLM allocates the
    # sliding-window layers as full attention when both kinds are present
    # (unify_hybrid_kv_cache_specs): one dense group, which the connector
    # offloads as any other. (With the manager on, test_hybrid_worker.py.)
    from vllm.v1.core.kv_cache_planning import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    specs = {"layer0": _local_specs()["full"], "layer1": _local_specs()["sliding"]}
    unify_hybrid_kv_cache_specs(specs)
    promoted = specs["layer1"]
    assert type(promoted) is FullAttentionSpec and promoted.sliding_window == 8
    e = harness.build(spec=promoted, num_gpu_blocks=32, extra={"num_cpu_chunks": 64, "offload_prompt_only": False})
    prefix_comes_back_from_the_host_tier(e)


def test_the_largest_token_limits_limit_nothing_and_crash_nothing():
    # vLLM's SamplingParams admits ints up to 2**64 - 1 in extra_args: the
    # core's u64 limit must take them and answer as without a limit. (A
    # larger one, set on the request by other code, is clamped to that.)
    from kvoffload.vllm import _u64

    assert _u64(1 << 70) == _u64((1 << 64) - 1) == (1 << 64) - 1 and _u64(None) is None
    e = harness.build(num_gpu_blocks=32, extra={"num_cpu_chunks": 64, "offload_prompt_only": False})
    e.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(e)
    evict_gpu_prefix(e)
    huge = {"max_load_tokens": (1 << 64) - 1, "max_offload_tokens": (1 << 64) - 1}
    b = e.add(PREFIX + [7, 8, 9], max_tokens=3, kv_transfer_params=huge)
    assert run_checked(e) > 0
    assert b in e.loaded
    leak_free(e)


def test_block_hashes_finer_than_blocks_must_divide_them_and_need_groups():
    # vLLM's prefix_match_unit: several hashes a block, with several KV groups.
    cfg = json.dumps({"tokens_per_block": 4, "blocks_per_chunk": 1, "num_cpu_chunks": 8, "world_size": 1})
    with pytest.raises(ValueError, match=r"hashes_per_block \(3\) must divide the block's 4 tokens"):
        kvoffload.SchedulerCore(cfg, watchdog=False, groups=[None, 8], hashes_per_block=3)
    with pytest.raises(ValueError, match=r"hashes_per_block \(0\)"):
        kvoffload.SchedulerCore(cfg, watchdog=False, groups=[None, 8], hashes_per_block=0)
    with pytest.raises(ValueError, match="needs `groups`"):
        kvoffload.SchedulerCore(cfg, watchdog=False, hashes_per_block=2)
    kvoffload.SchedulerCore(cfg, watchdog=False, groups=[None, 8], hashes_per_block=2)


def test_groups_of_different_block_sizes_are_whole_configuration_blocks():
    # vLLM grows a group of smaller pages to larger blocks: each group's
    # tokens a block, a whole number of the configuration's (the finest).
    cfg = json.dumps({"tokens_per_block": 4, "blocks_per_chunk": 1, "num_cpu_chunks": 8, "world_size": 1})
    with pytest.raises(ValueError, match="group 1: blocks of 6 tokens are not a whole number"):
        kvoffload.SchedulerCore(cfg, watchdog=False, groups=[None, 8], block_tokens=[4, 6])
    with pytest.raises(ValueError, match="block_tokens names 1 groups, `groups` has 2"):
        kvoffload.SchedulerCore(cfg, watchdog=False, groups=[None, 8], block_tokens=[4])
    with pytest.raises(ValueError, match="block_tokens needs `groups`"):
        kvoffload.SchedulerCore(cfg, watchdog=False, block_tokens=[4])
    kvoffload.SchedulerCore(cfg, watchdog=False, groups=[None, 8], block_tokens=[4, 8])


def test_a_chunk_size_in_tokens_needs_one_block_size_for_every_group():
    # vLLM's own check: kv_connector_extra_config's block_size (tokens a
    # chunk) fits one block size; blocks_per_chunk works for any.
    from test_hybrid_vllm import SPECS, TPB

    with pytest.raises(ValueError, match="all KV cache groups must have the same block size"):
        harness.build(extra={"num_cpu_chunks": 64, "block_size": 4 * TPB}, tpb=TPB, groups=SPECS["full+swa8b8"]())
    e = harness.build(extra={"num_cpu_chunks": 64, "blocks_per_chunk": 2}, tpb=TPB, groups=SPECS["full+swa8b8"]())
    assert e.connector._scheduler.group_chunk_tokens == [2 * TPB, 4 * TPB]


def test_groups_that_are_not_prefix_cacheable_are_left_out_as_vllm_leaves_them():
    # vLLM's connector offloads its prefix-cacheable groups only (DeepSeek
    # V4.1's bounded-replay windows and GLM's circular buffers are
    # per-request scratch): kvoffload too, naming vLLM's group indices.
    from test_hybrid_vllm import SPECS, bounded_window_mla, mla

    import kvoffload.vllm as kv

    e = harness.build(extra={"num_cpu_chunks": 64}, tpb=4, groups=[mla(), bounded_window_mla(8)])
    sched = e.connector._scheduler
    assert (sched.group_ids, sched.selected, sched.windows) == ((0,), (0,), [None])
    e = harness.build(extra={"num_cpu_chunks": 64}, tpb=4, groups=SPECS["ring+swa8"]())
    sched = e.connector._scheduler
    assert (sched.group_ids, sched.windows) == ((1,), [8])
    # Every group scratch: nothing to offload, said as such.
    config = e.connector._kv_cache_config
    only_ring = dataclasses.replace(config, kv_cache_groups=[config.kv_cache_groups[0]])
    assert not only_ring.kv_cache_groups[0].kv_cache_spec.prefix_cacheable
    with pytest.raises(ValueError, match="found no KV group to offload.*CircularBufferSpec"):
        kv.kv_offloaded_group_ids(only_ring)
    # HiSparse: vLLM offloads its indexer groups instead; refused by name.
    with pytest.raises(ValueError, match="does not offload HiSparse"):
        kv.kv_offloaded_group_ids(dataclasses.replace(config, hisparse_host_num_blocks=8))
    # A group outside external transfer (enable_kv_transfer=False) is left out too.
    off = dataclasses.replace(config.kv_cache_groups[1], enable_kv_transfer=False)
    mixed = dataclasses.replace(config, kv_cache_groups=[config.kv_cache_groups[1], off])
    assert kv.kv_offloaded_group_ids(mixed) == (0,)


def test_the_mamba_configurations_kvoffload_does_not_offload_stop_startup_with_the_reason():
    # Mamba groups are offloaded in vLLM's align mode with a state kept at
    # each block boundary (test_hybrid_vllm.py's Mamba cases); the other
    # Mamba configurations are refused by name, with what to change.
    from vllm.v1.kv_cache_interface import MambaSpec

    import kvoffload.vllm as kv
    from test_hybrid_vllm import SPECS, mamba

    e = harness.build(extra={"num_cpu_chunks": 64}, tpb=4, groups=SPECS["full+mamba"]())
    vllm_config, config = e.connector._vllm_config, e.connector._kv_cache_config
    kv.check_mamba_groups(vllm_config, config)
    assert kv.kv_group_windows(config) == [None, kv.RECURRENT_STATE]

    def with_mamba(spec: Any) -> Any:
        group = dataclasses.replace(config.kv_cache_groups[1], kv_cache_spec=spec)
        return dataclasses.replace(config, kv_cache_groups=[config.kv_cache_groups[0], group])

    refused = [
        (dataclasses.replace(mamba(), mamba_cache_mode="none"), "in mode 'none' .set mamba_cache_mode='align'"),
    ]
    for spec, reason in refused:
        with pytest.raises(ValueError, match=reason):
            kv._engine_config(vllm_config, with_mamba(spec))
    # Speculative decoding's state blocks are offloaded as vLLM's connector
    # offloads them (test_hybrid_vllm.py's "full+mambasb" cases).
    kv._engine_config(vllm_config, with_mamba(dataclasses.replace(mamba(), num_speculative_blocks=2)))
    # Block hashes finer than the Mamba block (prefix_match_unit): vLLM's
    # partial tails (test_hybrid_vllm.py's cases 57 to 61) where vLLM's
    # connector builds them; refused by name where it does not.
    fine = copy.copy(vllm_config)
    fine.cache_config = dataclasses.replace(vllm_config.cache_config, prefix_match_unit=2)
    kv._engine_config(fine, config)
    assert kv.kv_partial_tails(fine, config, 1)
    assert not kv.kv_partial_tails(vllm_config, config, 1)
    with pytest.raises(ValueError, match="hashes every 2 tokens, prefix_match_unit, finer than the Mamba block of 4.*chunks of 2 blocks"):
        kv.kv_partial_tails(fine, config, 2)
    # Beside an EAGLE/MTP draft group too (cases 62 and 63), whose tails
    # are keyed vLLM's proof margin past the boundary: one hash unit where
    # the core takes hits inside a block, else one block; none without a
    # draft group.
    draft = dataclasses.replace(config.kv_cache_groups[0], is_eagle_group=True)
    drafted = dataclasses.replace(config, kv_cache_groups=[draft, config.kv_cache_groups[1]])
    assert kv.kv_partial_tails(fine, drafted, 1)
    assert kv.kv_partial_tail_eagle_margin(fine, dataclasses.replace(drafted, cache_hit_alignment_tokens=2)) == 2
    assert kv.kv_partial_tail_eagle_margin(fine, dataclasses.replace(drafted, cache_hit_alignment_tokens=4)) == 4
    assert kv.kv_partial_tail_eagle_margin(fine, config) == 0
    w = harness.build(extra={"num_cpu_chunks": 64}, tpb=4, groups=SPECS["full+mamba+swa8"]())
    windowed = copy.copy(w.connector._vllm_config)
    windowed.cache_config = dataclasses.replace(windowed.cache_config, prefix_match_unit=2)
    with pytest.raises(ValueError, match="a windowed group .SlidingWindowSpec."):
        kv.kv_partial_tails(windowed, w.connector._kv_cache_config, 1)
    # Mamba2 (and GDN) layers export prefill checkpoints, where vLLM's own
    # prefix cache serves wrong states inside a block
    # (test_hybrid_worker.py's test_vllm_serves_a_wrong_mamba2_state_inside_a_block_on_its_own).
    m2 = harness.build(extra={"num_cpu_chunks": 64}, tpb=4, groups=SPECS["full+mamba2"]())
    m2_config = copy.copy(m2.connector._vllm_config)
    m2_config.cache_config = dataclasses.replace(m2_config.cache_config, prefix_match_unit=2)
    with pytest.raises(ValueError, match="Mamba layers with prefill checkpoints .Mamba2, GDN."):
        kv.kv_partial_tails(m2_config, m2.connector._kv_cache_config, 1)
    # Decode context parallelism.
    dcp = copy.copy(vllm_config)
    dcp.parallel_config = copy.copy(vllm_config.parallel_config)
    dcp.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="Mamba groups under decode context parallelism"):
        kv._engine_config(dcp, config)
    # A model of Mamba layers only takes the groups' path.
    alone = dataclasses.replace(config, kv_cache_groups=[config.kv_cache_groups[1]])
    assert kv.kv_group_windows(alone) == [kv.RECURRENT_STATE]


def test_a_group_of_layers_of_different_page_sizes_comes_back_with_each_layer_s_bytes():
    # DeepSeek V3.2's MLA layers and their (smaller) indexer layers are one
    # KV group of one kind (vLLM's UniformTypeKVCacheSpecs): its scheduler
    # sees the first layer's spec, its workers each layer's. Each layer's
    # page is its own (the group's page is the sum over its layers).
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    common = dict(block_size=4, head_size=harness.HEAD_SIZE, dtype=torch.float32)
    layers = [FullAttentionSpec(num_kv_heads=harness.HEADS, **common), FullAttentionSpec(num_kv_heads=1, **common)]
    assert layers[0].page_size_bytes != layers[1].page_size_bytes
    e = harness.build(num_gpu_blocks=32, extra={"num_cpu_chunks": 64, "offload_prompt_only": False}, layer_specs=layers)
    w = e.workers[0]._worker
    assert w.core.pool_bytes >= 64 * sum(s.page_size_bytes for s in layers)
    # Both roles name one remote namespace (the workers keep one spec a layer).
    from kvoffload.vllm import _remote_namespace

    sched_view = e.connector._kv_cache_config
    assert type(sched_view.kv_cache_groups[0].kv_cache_spec) is FullAttentionSpec
    assert _remote_namespace(w.vllm_config, w.kv_cache_config, w.cfg) == _remote_namespace(
        w.vllm_config, sched_view, w.cfg
    )
    prefix_comes_back_from_the_host_tier(e)
