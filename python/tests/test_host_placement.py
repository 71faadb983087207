"""Where each worker's host pool goes (the connector's ``host_numa_node``,
``WorkerCore.host/cuda(..., numa=)``): on the NUMA node asked for, with
every sampled page of the pool there; ``auto`` over CPU KV caches places it
on the node holding most of the caches' pages where the machine has several
nodes, and says why it does not place it elsewhere (one node online here); a
node that is not online, or a value that is not a placement, is refused by
name.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import binding_roundtrip as rt
import harness


def first_node() -> int:
    """The first NUMA node online on this machine."""
    online = Path("/sys/devices/system/node/online")
    text = online.read_text().strip() if online.exists() else "0"
    return int(text.replace("-", ",").split(",")[0])


def nodes_online() -> int:
    """How many NUMA nodes this machine has online."""
    online = Path("/sys/devices/system/node/online")
    if not online.exists():
        return 1
    count = 0
    for part in online.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def check_auto_over_cpu_caches(p: dict) -> None:
    """`auto` over CPU KV caches: not placed on a machine of one node (it
    says so); on one of several, placed on the caches' node, or not placed
    where no page of the caches is in memory yet."""
    if nodes_online() == 1:
        assert p["node"] is None and p["reason"] == "one NUMA node online", p
    elif p["node"] is not None:
        assert p["reason"].startswith(f"the KV caches are on node {p['node']}: "), p
    else:
        assert p["reason"].startswith("no page of the KV caches is in memory yet"), p


def test_a_pool_asked_for_on_a_node_has_every_sampled_page_there():
    node = first_node()
    out = rt.roundtrip("host", numa=str(node))
    p = out["placement"][0]
    assert p["asked"] == str(node) and p["node"] == node and p["reason"] == "asked for"
    assert p["sampled"] > 0 and p["by_node"] == {node: p["sampled"]}, p
    assert p["absent"] == 0 and p["unknown"] == 0, p
    assert p["copy_threads_on_node"] == 2, p
    assert p["summary"] == (
        f"node {node} (asked for): {p['sampled']} of {p['sampled']} sampled pages there; "
        "host copy threads on its CPUs: 2 of 2"
    )


def test_a_pool_placed_off_says_so():
    p = rt.roundtrip("host", numa="off")["placement"][0]
    assert p["node"] is None and p["reason"] == "placement off", p
    assert p["summary"].startswith("not placed (placement off): "), p
    assert p["copy_threads_on_node"] == 0 and "copy threads" not in p["summary"], p


def test_auto_over_cpu_caches_goes_to_their_node_or_says_why_not():
    p = rt.roundtrip("host", numa="auto")["placement"][0]
    check_auto_over_cpu_caches(p)
    if p["node"] is None:
        assert p["summary"].startswith(f"not placed ({p['reason']}): "), p
        assert p["copy_threads_on_node"] == 0, p


def test_two_workers_over_a_shared_region_place_it_on_the_node(tmp_path):
    node = first_node()
    out = rt.roundtrip("host", shared_region=str(tmp_path / "region.mmap"), turns=True, numa=str(node))
    for p in out["placement"]:
        assert p["node"] == node and p["by_node"] == {node: p["sampled"]}, p
        assert p["copy_threads_on_node"] == 2, p


@pytest.mark.parametrize(
    "numa, needle",
    [
        ("1023", "NUMA node 1023 is not online (online: "),
        ("near", 'NUMA placement "near": expected auto, off or a node number'),
        ("-1", 'NUMA placement "-1"'),
    ],
)
def test_a_placement_that_cannot_apply_is_refused_by_name(numa, needle):
    with pytest.raises(ValueError) as err:
        rt.roundtrip("host", numa=numa)
    assert needle in str(err.value), err.value


def test_the_connector_places_each_worker_s_pool_and_logs_where_it_went(caplog):
    node = first_node()
    with caplog.at_level(logging.INFO, logger="kvoffload.vllm"):
        e = harness.build(world_size=2, extra={"cpu_bytes_to_use": 10**7, "host_numa_node": node})
    for w in e.workers:
        p = w._worker.core.host_placement
        assert p["node"] == node and p["by_node"] == {node: p["sampled"]}, p
    lines = [r.getMessage() for r in caplog.records if "host pool NUMA placement" in r.getMessage()]
    assert lines == [f"kvoffload: host pool NUMA placement: {p['summary']}"] * 2, lines
    default = harness.build(extra={"cpu_bytes_to_use": 10**7})
    assert default.connector.engine_config.host_numa_node == "auto"
    check_auto_over_cpu_caches(default.workers[0]._worker.core.host_placement)


def test_the_placement_reaches_vllm_s_prometheus_metrics_summed_over_workers():
    # Each worker reports its pool once, in its first step's metadata; vLLM
    # sums the workers' metadata and the scheduler's stats carry the gauges.
    node = first_node()
    e = harness.build(world_size=2, extra={"cpu_bytes_to_use": 10**7, "host_numa_node": node})
    prom = harness.PromRecorder(e)
    e.add(list(range(40)), 4)
    e.run()
    sampled = sum(w._worker.core.host_placement["sampled"] for w in e.workers)
    assert sampled > 0
    assert prom.value("kvoffload_host_pools") == 2
    assert prom.value("kvoffload_host_pools_placed") == 2
    assert prom.value("kvoffload_host_pool_sampled_pages") == sampled
    assert prom.value("kvoffload_host_pool_pages_elsewhere") == 0
    assert prom.value("kvoffload_host_copy_threads_on_node") == 4
    # Not placed (`off`): the gauges say so.
    e = harness.build(world_size=2, extra={"cpu_bytes_to_use": 10**7, "host_numa_node": "off"})
    prom = harness.PromRecorder(e)
    e.add(list(range(40)), 4)
    e.run()
    assert prom.value("kvoffload_host_pools") == 2
    assert prom.value("kvoffload_host_pools_placed") == 0
    assert prom.value("kvoffload_host_copy_threads_on_node") == 0


def no_worker(worker, metadata):
    """No worker role: the scheduler role alone reads the configuration."""
    return set(), None


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("off", "off"), (0, "0"), ("3", "3"), (None, "auto")])
def test_host_numa_node_takes_auto_off_or_a_node(value, want):
    e = harness.build(extra={"cpu_bytes_to_use": 10**7, "host_numa_node": value}, fake_worker=no_worker)
    assert e.connector.engine_config.host_numa_node == want


@pytest.mark.parametrize("value", ["near", -1, 1024, True, 1.5, "0x1", "", "٣"])
def test_a_bad_host_numa_node_stops_startup_naming_the_key(value):
    with pytest.raises(ValueError, match="host_numa_node = .* is not allowed"):
        harness.build(extra={"cpu_bytes_to_use": 10**7, "host_numa_node": value}, fake_worker=no_worker)
