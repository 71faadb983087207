"""The connector with a remote tier (``remote_tier`` in
``kv_connector_extra_config``) on real ``redis-server`` processes started
here on loopback: two vLLM engines ("nodes", each vLLM 0.33.0's real
scheduler with its worker connectors over CPU tensors) share one store, and a
prefix the first computed is fetched by the second into its host tier, then
loaded with the bytes the first computed. Without ``redis-server`` on PATH
these tests show as skipped with the reason (``scripts/setup-redis.sh``
installs it; with ``KVOFFLOAD_REDIS_TESTS=1``, as CI sets it, they fail
instead)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from unittest import mock

import pytest
import torch

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

import harness
from test_connector import PREFIX, leak_free, run_checked

REDIS = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _need_redis() -> None:
    if REDIS and REDIS_CLI:
        return
    if os.environ.get("KVOFFLOAD_REDIS_TESTS") == "1":
        pytest.fail("KVOFFLOAD_REDIS_TESTS=1 but redis-server or redis-cli is not on PATH")
    pytest.skip("redis-server not on PATH (scripts/setup-redis.sh installs Debian's)")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with `cluster_bus`, one whose cluster bus port
    (+10000) is free and in range too."""
    if not cluster_bus:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(20000, 55000)
        if _bindable(p) and _bindable(p + 10000):
            return p
    raise AssertionError("no free port pair for a cluster node")


def _wait_ping(port: int, proc: subprocess.Popen, limit_s: float = 10.0) -> None:
    """Until the server answers PING (it is starting: not a timer)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"redis-server on port {port} did not answer within {limit_s} s")


def _start(tmp_path, port: int, *args: str) -> subprocess.Popen:
    d = tmp_path / f"redis-{port}"
    d.mkdir()
    proc = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
         "--appendonly", "no", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_ping(port, proc)
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def redis_url(tmp_path):
    """A fresh standalone server."""
    _need_redis()
    port = _free_port()
    proc = _start(tmp_path, port)
    yield f"redis://127.0.0.1:{port}"
    _stop([proc])


class Cluster(str):
    """A cluster's seed URLs, comma-separated (the string), and its servers."""

    procs: list[subprocess.Popen]


@pytest.fixture
def redis_cluster(tmp_path):
    """A fresh cluster of three masters: its seed URLs, comma-separated (a
    `Cluster`, which also holds the server processes)."""
    _need_redis()
    ports = [_free_port(cluster_bus=True) for _ in range(3)]
    procs = [
        _start(tmp_path, p, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
               "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no")
        for p in ports
    ]
    try:
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
        )
        # Until every node says the cluster is ok and knows all three
        # (the cluster is converging: not a timer).
        end = time.monotonic() + 20
        while True:
            infos = [
                subprocess.run([REDIS_CLI, "-p", str(p), "cluster", "info"],
                               capture_output=True, text=True, timeout=10).stdout
                for p in ports
            ]
            if all("cluster_state:ok" in i and "cluster_known_nodes:3" in i for i in infos):
                break
            assert time.monotonic() < end, f"the cluster did not come up: {infos}"
            time.sleep(0.05)
        cluster = Cluster(",".join(f"redis://127.0.0.1:{p}" for p in ports))
        cluster.procs = procs
        yield cluster
    finally:
        _stop(procs)


def extra_for(remote: dict) -> dict:
    return {"num_cpu_chunks": 64, "offload_prompt_only": False, "remote_tier": remote}


def remote_stats(e: harness.Engine) -> dict:
    st = e.connector._scheduler.core.remote_stats()
    assert st is not None, "no remote tier attached"
    return st


def writes(e: harness.Engine) -> dict:
    """The workers' remote counters, summed (a replicated layout's readers
    have no tier of their own)."""
    total: dict = {}
    for w in e.workers:
        for k, v in (w._worker.core.remote_stats() or {}).items():
            total[k] = total.get(k, 0) + v
    return total


def record_stored_events(e: harness.Engine) -> list:
    """The block hashes of the connector's `BlockStored` events, in order."""
    stored: list = []
    take = e.connector.take_events

    def take_events() -> list:
        got = list(take())
        stored.extend(h for ev in got if isinstance(ev, BlockStored) for h in ev.block_hashes)
        return got

    e.connector.take_events = take_events
    return stored


def node_one(remote: dict, world_size: int) -> harness.Engine:
    """A node that computes the prefix, stores it and writes it through."""
    a = harness.build(world_size=world_size, extra=extra_for(remote))
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    a.drain_remote()
    leak_free(a)
    return a


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("store", ["standalone", "cluster"])
def test_a_prefix_computed_on_one_node_is_loaded_on_another_with_its_bytes(store, world_size, request):
    url = request.getfixturevalue("redis_url" if store == "standalone" else "redis_cluster")
    remote = {"url": url, "cluster": store == "cluster"}
    a = node_one(remote, world_size)
    w = writes(a)
    # 44 tokens computed (43 prompt + 1 sampled): 11 full blocks of 4, one
    # chunk each, one share per worker.
    assert w["puts_written"] == 11 * world_size, w
    assert w["puts_failed"] == 0 and w["puts_dropped"] == 0 and w["puts_queued"] == 0, w

    # A second node, with an empty host tier, over the same store.
    b = harness.build(world_size=world_size, extra=extra_for(remote))
    prom = harness.PromRecorder(b)
    stored = record_stored_events(b)
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    hashes = [maybe_convert_block_hash(h) for h in b.scheduler.requests[r].block_hashes]
    checked = run_checked(b)
    assert r in b.loaded, "the prefix came from the other node's chunks"
    assert r not in b.failed
    assert checked > 0
    st = remote_stats(b)
    # The lookup may use the 10 full blocks of the shared 40 tokens.
    assert st["chunks_found"] == 10 and st["chunks_fetched"] == 10, st
    assert st["fetch_jobs"] == 1 and st["fetches_failed"] == 0, st
    assert st["requests_held"] == 0 and st["tier"]["connected"], st
    fetched = writes(b)
    assert fetched["hits"] == 10 * world_size and fetched["misses"] == 0, fetched
    assert fetched["rejected_values"] == 0, fetched
    leak_free(b)
    assert b.connector.scheduler_state()["remote_probes"] == 0
    # Through vLLM's stats path and the connector's Prometheus metrics.
    assert prom.value("kvoffload_remote_chunks_found_total") == 10
    assert prom.value("kvoffload_remote_chunks_fetched_total") == 10
    assert prom.value("kvoffload_remote_connected") == 1
    assert prom.value("kvoffload_remote_bytes_written_total") == fetched["bytes_put"] > 0
    # The workers' reads, summed over the workers.
    assert prom.value("kvoffload_remote_shares_fetched_total") == 10 * world_size
    assert prom.value("kvoffload_remote_bytes_read_total") == fetched["bytes_got"] > 0
    assert not prom.value("kvoffload_remote_shares_missed_total"), "never increased"
    # The fetched chunks entered the host tier: vLLM's KV events announce
    # them by vLLM's own block hashes (then the new request's own stores).
    assert stored[:10] == hashes[:10], (stored, hashes)


def test_another_deployment_never_reads_these_chunks(redis_url):
    node_one({"url": redis_url}, 1)
    b = harness.build(extra=extra_for({"url": redis_url, "deployment": "canary"}))
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    run_checked(b)
    assert r not in b.loaded
    st = remote_stats(b)
    assert st["chunks_found"] == 0 and st["fetch_jobs"] == 0, st
    leak_free(b)


def test_an_unreachable_store_costs_nothing_but_the_hits():
    # Nothing listens on this port: every request still finishes, with the
    # host tier alone, and nothing leaks.
    port = _free_port()
    remote = {"url": f"redis://127.0.0.1:{port}", "connect_timeout_ms": 200,
              "backoff_initial_ms": 50, "backoff_max_ms": 200}
    a = harness.build(extra=extra_for(remote))
    prom = harness.PromRecorder(a)
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    r = a.add(list(range(3000, 3040)), max_tokens=2)
    run_checked(a)
    assert r not in a.loaded
    w = writes(a)
    assert w["puts_written"] == 0 and w["puts_dropped"] > 0 and not w["connected"], w
    st = remote_stats(a)
    assert st["chunks_found"] == 0 and not st["tier"]["connected"], st
    assert prom.value("kvoffload_remote_connected") == 0
    assert prom.value("kvoffload_remote_puts_dropped_total") == w["puts_dropped"]
    leak_free(a)


@pytest.mark.parametrize(
    "remote, named",
    [
        ({"url": "http://127.0.0.1:6379"}, "url"),
        ({"url": "redis://127.0.0.1:6379", "op_timout_ms": 5}, "op_timout_ms"),
        ({"url": "redis://:hunter2@127.0.0.1:6379", "op_timeout_ms": 0}, "op_timeout_ms"),
        ({"url": "redis://a:1,redis://b:2"}, "cluster"),
        ({"url": "redis://127.0.0.1:6379", "deployment": 3}, "deployment"),
        ("{not json", "JSON"),
        (["redis://127.0.0.1:6379"], "dict"),
    ],
)
def test_a_bad_remote_tier_stops_startup_naming_the_key(remote, named):
    with pytest.raises(ValueError) as e:
        harness.build(extra=extra_for(remote))
    msg = str(e.value)
    assert "remote_tier" in msg and named in msg, msg
    assert "hunter2" not in msg and "hunter2" not in repr(e.value), msg


def test_the_engine_config_does_not_print_the_password():
    from kvoffload.config import EngineConfig

    cfg = EngineConfig.from_extra(
        extra_for({"url": "redis://127.0.0.1:6379", "password": "hunter2"}),
        tokens_per_block=4, world_size=1, worker_bytes_per_block=256,
    )
    assert cfg.remote_tier_json is not None
    assert "hunter2" not in repr(cfg)


def test_async_scheduling_and_no_waits_the_lookup_defers_until_the_store_answers(redis_url):
    # As in serving: nothing waits for the store. The lookup answers "not
    # yet" (vLLM skips the request that step) until the store's answer comes,
    # the fetch job runs while vLLM keeps stepping, and only then does the
    # request load; its bytes are checked at every step.
    remote = {"url": redis_url}
    node_one(remote, 1)
    b = harness.build(async_scheduling=True, extra=extra_for(remote))
    b.remote = False
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    run_checked(b, max_steps=100_000)
    assert r in b.loaded
    st = remote_stats(b)
    assert st["chunks_fetched"] == 10 and st["fetches_failed"] == 0, st
    leak_free(b)


def test_written_on_eviction_a_prefix_the_host_tier_evicted_is_found_by_another_node(redis_url):
    remote = {"url": redis_url, "write": "on_eviction"}
    extra = {**extra_for(remote), "num_cpu_chunks": 12}
    a = harness.build(extra=extra)
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    a.drain_remote()
    assert writes(a)["puts_written"] == 0, "nothing is written until the host tier evicts"
    # Another 12 chunks: the host tier of 12 evicts all 11 of the prefix,
    # which are written. (11 new chunks would leave its first chunk, which
    # LRU keeps longest as vLLM's does, and the other node would find no
    # leading chunk.)
    a.add(list(range(3000, 3047)), max_tokens=2)
    run_checked(a)
    a.drain_remote()
    assert writes(a)["puts_written"] == 11, writes(a)
    leak_free(a)
    b = harness.build(extra=extra)
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    run_checked(b)
    assert r in b.loaded, (remote_stats(b), writes(a), writes(b))
    assert remote_stats(b)["chunks_fetched"] == 10
    leak_free(b)


def _redis_cli(url: str, *args: str) -> str:
    port = int(url.rsplit(":", 1)[1])
    return subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True,
                          timeout=10).stdout.strip()


def _pause_clients(url: str, ms: int) -> None:
    """The store stops answering every client for `ms` (CLIENT PAUSE)."""
    out = _redis_cli(url, "client", "pause", str(ms), "all")
    assert out == "OK", out


def test_chunks_gone_between_the_lookup_and_the_fetch_are_recomputed(redis_url):
    # The lookup finds the prefix; then the store loses it (an operator's
    # FLUSHALL, an eviction under maxmemory) before the workers read it. The
    # fetch fails, the request computes its prefix, and nothing leaks.
    remote = {"url": redis_url}
    node_one(remote, 2)
    b = harness.build(world_size=2, extra=extra_for(remote))
    prom = harness.PromRecorder(b)
    core = b.connector._scheduler.core
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    b.step()  # the lookup asks the store: "not yet"
    core.wait_remote_lookups()
    assert _redis_cli(redis_url, "flushall") == "OK"
    checked = run_checked(b)
    assert checked > 0, "the request finished with the right KV"
    assert r not in b.loaded and r not in b.failed, "nothing was loaded: the tokens were computed"
    st = remote_stats(b)
    assert st["chunks_found"] == 10 and st["fetch_jobs"] == 1, st
    assert st["chunks_fetched"] == 0 and st["fetches_failed"] == 1, st
    w = writes(b)
    assert w["hits"] == 0 and w["misses"] == 10 * 2, w
    assert prom.value("kvoffload_remote_fetches_failed_total") == 1
    assert prom.value("kvoffload_remote_shares_missed_total") == 10 * 2
    assert not prom.value("kvoffload_remote_shares_fetched_total"), "never increased"
    leak_free(b)
    assert b.connector.scheduler_state()["remote_probes"] == 0


def test_an_abort_and_a_reset_with_a_fetch_in_flight_leak_nothing(redis_url):
    remote = {"url": redis_url}
    node_one(remote, 1)
    b = harness.build(extra=extra_for(remote))
    core = b.connector._scheduler.core
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    b.step()  # the lookup asks the store: "not yet"
    core.wait_remote_lookups()
    # The store stalls; the next step plans the fetch, whose answers cannot
    # come before the abort and the reset below.
    _pause_clients(redis_url, 1500)
    b.remote = False
    b.step()
    st = remote_stats(b)
    assert st["fetch_jobs"] == 1 and st["chunks_fetched"] == 0, st
    assert b.connector.scheduler_state()["jobs"] == 1, "the fetch is in flight"
    b.scheduler.finish_requests(r, harness.RequestStatus.FINISHED_ABORTED)
    assert b.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    # The fetch ends after the reset (its late report): nothing of it stays.
    b.remote = True
    for _ in range(50):
        if not core.has_pending_work():
            break
        b.step()
    b.flush_async()
    leak_free(b)
    # The engine is whole: the same prefix is fetched and loaded again.
    r2 = b.add(PREFIX + [4, 5, 6], max_tokens=3)
    run_checked(b)
    assert r2 in b.loaded
    assert remote_stats(b)["fetch_jobs"] == 2
    leak_free(b)


@pytest.mark.parametrize("replicated_writes", ["turns", "vllm"])
def test_replicated_kv_is_put_and_fetched_once_and_shared_with_a_one_worker_node(redis_url, replicated_writes):
    """Replicated KV (MLA on every tensor-parallel rank: one host region
    every worker maps) has one share of a chunk in the store, put by the
    chunk's writer: by turns of host chunk (kvoffload's default), each rank
    its chunks; with vLLM's writers, rank 0 all of them. A node of two
    workers fetches each chunk once into its shared region (by turns, each
    rank its chunks), and each rank loads the computed bytes from there. A
    node of one worker of the same model and layout names the same
    namespace and finds them."""
    remote = {"url": redis_url}
    extra = {**extra_for(remote), "replicated_writes": replicated_writes}
    a = harness.build(world_size=2, replicated=True, extra=extra)
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    a.drain_remote()
    leak_free(a)
    per_worker = [w._worker.core.remote_stats() for w in a.workers]
    if replicated_writes == "vllm":
        assert [st is not None for st in per_worker] == [True, False]
    else:
        # Each rank put its turn's chunks, none twice.
        puts = [st["puts_written"] for st in per_worker]
        assert all(puts), puts
    w = writes(a)
    assert w["puts_written"] == 11 and w["puts_failed"] == 0, w

    b = harness.build(world_size=2, replicated=True, extra=extra)
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    assert run_checked(b) > 0
    assert r in b.loaded and r not in b.failed
    st = remote_stats(b)
    assert st["chunks_found"] == 10 and st["chunks_fetched"] == 10 and st["fetches_failed"] == 0, st
    fetched = writes(b)
    assert fetched["hits"] == 10 and fetched["misses"] == 0 and fetched["rejected_values"] == 0, fetched
    if replicated_writes == "turns":
        hits = [w._worker.core.remote_stats()["hits"] for w in b.workers]
        assert all(hits), hits
    leak_free(b)

    one = harness.build(world_size=1, extra=extra_for(remote))
    r = one.add(PREFIX + [4, 5, 6], max_tokens=3)
    assert run_checked(one) > 0
    assert r in one.loaded and r not in one.failed
    assert remote_stats(one)["chunks_fetched"] == 10
    leak_free(one)
    # A node of two workers each holding its own share is another namespace.
    two = harness.build(world_size=2, extra=extra_for(remote))
    two.add(PREFIX + [4, 5, 6], max_tokens=3)
    run_checked(two)
    assert remote_stats(two)["chunks_found"] == 0


def _head_groups(kind: str, tp: int) -> dict:
    """Build options of a node of `tp` workers over 4 KV heads: one group of
    full attention, or full attention beside a sliding window (vLLM's
    hybrid manager; both groups' layers overlay the same tensors)."""
    if kind == "one group":
        return {}
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=4, num_kv_heads=4 // tp, head_size=harness.HEAD_SIZE, dtype=torch.float32)
    return {"groups": [FullAttentionSpec(**common), SlidingWindowSpec(sliding_window=8, **common)]}


@pytest.mark.parametrize(
    "kind,writer_tp,reader_tp",
    [("one group", 2, 1), ("one group", 1, 2), ("one group", 4, 2), ("one group", 2, 8), ("full+window", 2, 1),
     ("full+window", 1, 4)],
)
def test_with_canonical_layout_nodes_of_other_tensor_parallel_sizes_share_chunks_as_kv_heads(
    redis_url, kind, writer_tp, reader_tp
):
    """With ``canonical_layout`` a chunk's shares in the store are the
    model's KV heads (4 here), each head's bytes in an order no
    tensor-parallel split changes: a node splitting the heads over
    `writer_tp` workers puts them, a node of `reader_tp` workers (fewer,
    more, or more than the heads: two workers a head, the first writing it)
    finds and fetches them, and every worker loads its own heads' computed
    bytes (the fake model writes each head's index in the model into its
    values). Without the key the shares are the ranks: another namespace."""
    remote = {"url": redis_url}
    extra = {**extra_for(remote), "canonical_layout": True}
    a = harness.build(world_size=writer_tp, kv_heads=4, extra=extra, **_head_groups(kind, writer_tp))
    assert a.connector.engine_config.remote_head_shares == 4
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    a.drain_remote()
    leak_free(a)
    w = writes(a)
    # 11 full blocks of 4 tokens, one chunk each (a window's too, but those
    # behind its window), a share per head.
    chunks = 11 if kind == "one group" else 11 + 2
    assert w["puts_written"] == chunks * 4 and w["puts_failed"] == 0, w

    b = harness.build(world_size=reader_tp, kv_heads=4, extra=extra, **_head_groups(kind, reader_tp))
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    assert run_checked(b) > 0
    assert r in b.loaded and r not in b.failed
    st = remote_stats(b)
    found = st["chunks_fetched"]
    assert found >= 10 and st["chunks_found"] == found and st["fetches_failed"] == 0, st
    fetched = writes(b)
    # Every worker fetched its heads' shares of the chunks.
    held = max(1, 4 // reader_tp) * reader_tp
    assert fetched["hits"] == found * held and fetched["misses"] == 0 and fetched["rejected_values"] == 0, fetched
    leak_free(b)

    plain = harness.build(world_size=reader_tp, kv_heads=4, extra=extra_for(remote), **_head_groups(kind, reader_tp))
    assert plain.connector.engine_config.remote_head_shares == 0
    plain.add(PREFIX + [4, 5, 6], max_tokens=3)
    run_checked(plain)
    assert remote_stats(plain)["chunks_found"] == 0


def test_with_canonical_layout_mla_is_one_share_every_rank_fetches_and_a_strange_layout_stops_startup(redis_url):
    """MLA's latent vectors are the same on every rank: with
    ``canonical_layout`` (and no shared host region, as on this machine)
    the chunk is one share, rank 0 puts it, and a node of another
    tensor-parallel size fetches it into every worker. A KV cache whose
    layout the heads cannot be read from stops the worker's startup,
    naming the layer (vLLM's canonical layout fails closed too)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    remote = {"url": redis_url}
    extra = {**extra_for(remote), "canonical_layout": True}
    mla = MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=2 * harness.HEADS * harness.HEAD_SIZE,
                           dtype=torch.float32)
    a = harness.build(world_size=2, kv_heads=1, spec=mla, extra=extra)
    assert a.connector.engine_config.remote_head_shares == 1
    assert not a.connector.engine_config.replicated_layout
    a.add(PREFIX + [1, 2, 3], max_tokens=2)
    run_checked(a)
    a.drain_remote()
    leak_free(a)
    assert [w._worker.core.remote_stats()["puts_written"] for w in a.workers] == [11, 0]
    b = harness.build(world_size=1, kv_heads=1, spec=mla, extra=extra)
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    assert run_checked(b) > 0
    assert r in b.loaded and remote_stats(b)["chunks_fetched"] == 10

    real = harness._workers

    def strange_workers(vllm_config, kv_cache_config, count, cache):
        # Each layer's tokens and K/V halves swapped: no layout vLLM knows.
        return real(vllm_config, kv_cache_config, count, lambda: {n: t.transpose(1, 2) for n, t in cache().items()})

    with mock.patch.object(harness, "_workers", strange_workers):
        with pytest.raises(RuntimeError, match="layer0.*canonical_layout"):
            harness.build(world_size=2, kv_heads=4, extra=extra)


def test_a_worker_rank_needs_vllm_s_groups_beyond_one_worker():
    from kvoffload.vllm import _worker_rank

    assert _worker_rank(1) == 0
    with pytest.raises(RuntimeError, match="model parallel"):
        _worker_rank(2)


def _keys_on(port: int) -> set[str]:
    out = subprocess.run([REDIS_CLI, "-p", str(port), "--scan"], capture_output=True, text=True,
                         timeout=10).stdout
    return set(out.split())


def test_a_cluster_master_down_leaves_a_partial_prefix_and_correct_bytes(redis_cluster):
    # The first node writes its prefix over three masters; then a master that
    # holds some of its chunks, but not the first, dies. The second node
    # finds the leading chunks up to the first one on the dead master (a key
    # there is a miss, whatever the client answers for it), fetches and loads
    # those, computes the rest, and every byte is right.
    from kvoffload._native import chunk_key

    remote = {"url": str(redis_cluster), "cluster": True, "connect_timeout_ms": 200,
              "response_timeout_ms": 500, "op_timeout_ms": 3000}
    node_one(remote, 1)
    b = harness.build(extra=extra_for(remote))
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    chunks = [f":0:{chunk_key(bytes(h)):016x}" for h in b.scheduler.requests[r].block_hashes[:10]]
    ports = [int(u.rsplit(":", 1)[1]) for u in str(redis_cluster).split(",")]
    holder = {}
    for i, port in enumerate(ports):
        for k in _keys_on(port):
            for c, suffix in enumerate(chunks):
                if k.endswith(suffix):
                    holder[c] = i
    assert sorted(holder) == list(range(10)), holder
    # The master holding the earliest chunk after chunk 0 that chunk 0's
    # master does not hold.
    first_lost = next(c for c in range(1, 10) if holder[c] != holder[0])
    dead = redis_cluster.procs[holder[first_lost]]
    dead.kill()
    dead.wait(timeout=10)
    run_checked(b)
    st = remote_stats(b)
    assert st["chunks_found"] == first_lost and st["chunks_fetched"] == first_lost, (first_lost, st)
    assert st["fetches_failed"] == 0, st
    assert r in b.loaded
    leak_free(b)


def test_the_namespace_separates_every_part():
    from kvoffload._native import remote_namespace

    base = ("org/model@rev|", "vllm-per-layer-LBHNC|FullAttentionSpec|2|4|torch.float32", 16, 1, 2048, 2)
    ns = remote_namespace(*base)
    assert ns == remote_namespace(*base), "deterministic"
    for i in range(len(base)):
        other = list(base)
        other[i] = other[i] + "x" if isinstance(other[i], str) else other[i] + 1
        assert remote_namespace(*other) != ns, f"part {i} does not change the namespace"
    # Free-text parts are length-prefixed: moving text across them changes it.
    assert remote_namespace("ab", "c", *base[2:]) != remote_namespace("a", "bc", *base[2:])


def test_fetched_chunks_are_announced_with_self_describing_payloads(redis_url):
    """With ``self_describing_kv_events``, the chunks a fetch brings in are
    announced as stored ones are: their block hash, parent, tokens and KV
    group kind, read from the request that looked them up."""
    remote = {"url": redis_url}
    node_one(remote, 1)
    b = harness.build(world_size=1, extra={**extra_for(remote), "self_describing_kv_events": True})
    events: list = []
    take = b.connector.take_events

    def take_events() -> list:
        got = list(take())
        events.extend(got)
        return got

    b.connector.take_events = take_events
    prompt = PREFIX + [7, 8, 9]
    r = b.add(prompt, max_tokens=3)
    hashes = [maybe_convert_block_hash(h) for h in b.scheduler.requests[r].block_hashes]
    run_checked(b)
    assert r in b.loaded, "the prefix came from the other node's chunks"
    assert remote_stats(b)["chunks_fetched"] == 10
    by_hash = {ev.block_hashes[0]: ev for ev in events if isinstance(ev, BlockStored)}
    for i in range(10):  # the 10 fetched chunks of one block of 4 tokens
        ev = by_hash[hashes[i]]
        assert ev.block_hashes == [hashes[i]]
        assert ev.token_ids == prompt[4 * i : 4 * i + 4], (i, ev)
        assert ev.parent_block_hash == (hashes[i - 1] if i else None), (i, ev)
        assert ev.block_size == 4 and ev.kv_cache_spec_kind == "full_attention", ev
    leak_free(b)


def record_hit_sources(e: harness.Engine) -> list:
    """``(request, hit, {source: tokens})`` for every allocation with a hit,
    asked right after it as vLLM's scheduler asks for its prefix-cache stats."""
    seen: list = []
    alloc = e.connector.update_state_after_alloc

    def update_state_after_alloc(request, blocks, n):
        got = alloc(request, blocks, n)
        if n:
            split = e.connector.get_external_cache_hit_sources(request, n)
            seen.append((request.request_id, n, {k.value: v for k, v in split.items()}))
        return got

    e.connector.update_state_after_alloc = update_state_after_alloc
    return seen


def test_hits_fetched_from_the_remote_tier_are_reported_as_a_remote_store(redis_url):
    node_one({"url": redis_url}, 1)
    b = harness.build(extra=extra_for({"url": redis_url}))
    sources = record_hit_sources(b)
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3)
    run_checked(b)
    assert r in b.loaded
    # The 10 fetched chunks of 4 tokens: vLLM's label for a remote store.
    assert sources == [(r, 40, {"external_unspecified": 40})], sources
    leak_free(b)


@pytest.mark.parametrize(
    "tiers,fetched",
    [
        ([{"locality": "local"}], False),
        ([], False),
        ([{"medium": "storage"}], False),
        ([{"medium": "cpu"}], True),
        ([{"locality": "REMOTE"}], True),
        ([{"medium": "tape"}], True),  # only invalid entries: every tier
    ],
    ids=["local-only", "empty", "storage", "cpu", "remote", "invalid"],
)
def test_kv_load_tiers_decides_whether_a_request_reads_the_remote_tier(redis_url, tiers, fetched):
    node_one({"url": redis_url}, 1)
    b = harness.build(extra=extra_for({"url": redis_url}))
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3, kv_transfer_params={"kv_load_tiers": tiers})
    run_checked(b)
    st = remote_stats(b)
    assert (r in b.loaded) == fetched
    assert (st["lookups"] > 0) == fetched, st
    assert st["chunks_fetched"] == (10 if fetched else 0), st
    leak_free(b)


def test_max_load_tokens_bounds_what_is_fetched_and_loaded(redis_url):
    node_one({"url": redis_url}, 1)
    b = harness.build(extra=extra_for({"url": redis_url}))
    sources = record_hit_sources(b)
    # 18 tokens past no GPU hit: 4 whole chunks.
    r = b.add(PREFIX + [7, 8, 9], max_tokens=3, kv_transfer_params={"max_load_tokens": 18})
    run_checked(b)
    assert r in b.loaded
    assert sources == [(r, 16, {"external_unspecified": 16})], sources
    assert remote_stats(b)["chunks_fetched"] == 4
    leak_free(b)
