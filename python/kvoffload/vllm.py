"""kvoffload as a vLLM 0.33 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvOffloadConnector",
                           "kv_connector_module_path": "kvoffload.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}'

(``kv_connector_module_path`` may be left out: the installed package
registers the name as a vLLM plugin, ``kvoffload.vllm_plugin``.)

The scheduler role delegates every hook to kvoffload's Rust scheduler
(``SchedulerCore``); the worker role maps vLLM's KV cache tensors onto
kvoffload's layouts and runs its data plane (``WorkerCore``: the host backend
for CPU tensors, the CUDA backend for CUDA tensors). This module only translates vLLM's objects: no offload decision is
made here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    get_offloading_event_group_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    group_kernel_blocks,
    iter_layer_specs,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvoffload._native import SchedulerCore, WorkerCore, shared_region_path
from kvoffload.config import EngineConfig
from kvoffload.request_params import parse_request_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["KvOffloadConnector", "KvOffloadMetadata", "KvOffloadWorkerMetadata"]


@dataclass
class KvOffloadMetadata(KVConnectorMetadata):
    """What the scheduler sends every worker for one step."""

    #: The workers' plan (loads, stores, flushes) as kvoffload's compact bytes.
    plan: bytes
    #: The request of every load job in the plan, ``{job: request id}``.
    load_requests: dict[int, str]
    #: Requests whose load failed or stalled: their blocks must be recomputed.
    failed_loads: list[str]


@dataclass
class KvOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker reports after a step; vLLM sums it over workers."""

    completed: dict[int, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    #: ``{"load"|"store": [bytes, seconds, [sizes]]}``.
    stats: dict[str, list[Any]] = field(default_factory=dict)
    #: The remote tier's worker counters since the last report (the non-zero
    #: ones of ``_REMOTE_WORKER_COUNTERS``: writes, and the fetches' reads).
    remote: dict[str, int] = field(default_factory=dict)
    #: Where the worker's host pool went (``_PLACEMENT_GAUGES``' keys),
    #: in the worker's first report only.
    placement: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvOffloadWorkerMetadata)
        completed = dict(self.completed)
        for job, n in other.completed.items():
            completed[job] = completed.get(job, 0) + n
        stats: dict[str, list[Any]] = {k: [v[0], v[1], list(v[2])] for k, v in self.stats.items()}
        for k, (b, t, sizes) in other.stats.items():
            mine = stats.setdefault(k, [0, 0.0, []])
            mine[0] += b
            mine[1] += t
            mine[2].extend(sizes)
        remote = dict(self.remote)
        for k, n in other.remote.items():
            remote[k] = remote.get(k, 0) + n
        placement = dict(self.placement)
        for k, n in other.placement.items():
            placement[k] = placement.get(k, 0) + n
        return KvOffloadWorkerMetadata(completed, self.failed | other.failed, stats, remote, placement)


def _histogram_tag() -> str:
    """The type tag vLLM's stats payload gives a histogram (read off one)."""
    probe = OffloadingConnectorStats()
    probe.observe_histogram("probe", 0)
    return probe.metric_sections()[0]["probe"]


_HISTOGRAM = _histogram_tag()


def _observe_all(stats: OffloadingConnectorStats, name: str, values: list[Any]) -> None:
    """``stats.observe_histogram(name, v)`` for every ``v`` in ``values``, in
    one call: the payload's documented layout (``metric_sections``), a type
    entry and a list of samples per label tuple; nothing when ``values`` is
    empty, as the per-value calls would leave it."""
    if not values:
        return
    types, data = stats.metric_sections()
    types.setdefault(name, _HISTOGRAM)
    data.setdefault(name, {}).setdefault((), []).extend(values)


#: vLLM's metric names (vLLM 0.33 ``offloading/metrics.py``, ``kv_offload/cpu/common.py``).
_LOAD, _STORE = "vllm:kv_offload_load", "vllm:kv_offload_store"
_LOOKUP_SYNC_DELAY = "vllm:kv_offload_lookup_sync_delay_seconds"
_LOOKUP_ASYNC_DELAY = "vllm:kv_offload_lookup_async_delay_seconds"
_ALLOCATION_FAILURE = "vllm:kv_offload_allocation_failure"
_STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
_CPU_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
_CPU_WRITE_USAGE = "vllm:kv_offload_cpu_cache_write_usage_perc"
_CPU_READ_USAGE = "vllm:kv_offload_cpu_cache_read_usage_perc"
_CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"

#: kvoffload's stall metrics, beside vLLM's (the names of kvoffload's own
#: Prometheus exporter).
STALL_METRICS = {
    "vllm:kv_offload_stalled_transfers": OffloadingCounterMetadata(
        documentation="Transfer jobs the stall watchdog declared stalled (their loads recompute).",
        labelnames=("transfer_type",),
    ),
    "kvoffload_late_reports": OffloadingCounterMetadata(
        documentation="Worker reports that arrived for jobs already declared stalled.",
    ),
    "kvoffload_stalled_jobs": OffloadingGaugeMetadata(
        documentation="Stalled jobs whose late reports are still awaited.",
    ),
    "kvoffload_quarantined_chunks": OffloadingGaugeMetadata(
        documentation="Host chunks held back after a stalled store until its late reports arrive.",
    ),
}

#: The remote tier's metrics (with ``remote_tier`` configured): the
#: scheduler's lookups and fetches, the workers' writes and reads (summed over workers).
REMOTE_METRICS = {
    "kvoffload_remote_chunks_found": OffloadingCounterMetadata(
        documentation="Chunks the remote store held when a lookup missed the host tier.",
    ),
    "kvoffload_remote_chunks_fetched": OffloadingCounterMetadata(
        documentation="Chunks fetched from the remote store into the host tier.",
    ),
    "kvoffload_remote_fetches_failed": OffloadingCounterMetadata(
        documentation="Remote fetch jobs that missed, failed or stalled (their requests recompute).",
    ),
    "kvoffload_remote_partial_tails_fetched": OffloadingCounterMetadata(
        documentation="Partial tails (recurrent states inside a block, with hashes finer than the "
        "blocks) fetched from the remote store into the host tier.",
    ),
    "kvoffload_remote_bytes_written": OffloadingCounterMetadata(
        documentation="Bytes the workers wrote to the remote store.",
    ),
    "kvoffload_remote_puts_failed": OffloadingCounterMetadata(
        documentation="Chunk shares the remote store refused or failed to write.",
    ),
    "kvoffload_remote_puts_dropped": OffloadingCounterMetadata(
        documentation="Chunk shares not written: queue full, store unreachable or value too large.",
    ),
    "kvoffload_remote_partial_chunks_not_put": OffloadingCounterMetadata(
        documentation="Chunk shares not written because their store wrote only part of the host row "
        "(a sliding window's hole: the rest is stale).",
    ),
    "kvoffload_remote_shares_fetched": OffloadingCounterMetadata(
        documentation="Chunk shares the workers read back from the remote store and accepted.",
    ),
    "kvoffload_remote_shares_missed": OffloadingCounterMetadata(
        documentation="Chunk shares the workers asked for and did not get "
        "(absent, rejected, store unreachable or timed out).",
    ),
    "kvoffload_remote_values_rejected": OffloadingCounterMetadata(
        documentation="Values read back and rejected: corrupt, truncated, foreign or oversized.",
    ),
    "kvoffload_remote_bytes_read": OffloadingCounterMetadata(
        documentation="Bytes the workers read back from the remote store (accepted or not).",
    ),
    "kvoffload_remote_connected": OffloadingGaugeMetadata(
        documentation="1 while the scheduler's connection to the remote store is up.",
    ),
}

#: Where the workers' host pools went (NUMA placement), summed over the
#: workers: each reports its pool (its mapping of a shared region) once.
#: The names of kvoffload's own exporter (``kvoffload sim --metrics-addr``).
PLACEMENT_METRICS = {
    "kvoffload_host_pools": OffloadingGaugeMetadata(
        documentation="Host pools reported (one per worker).",
    ),
    "kvoffload_host_pools_placed": OffloadingGaugeMetadata(
        documentation="Host pools placed on a NUMA node (host_numa_node).",
    ),
    "kvoffload_host_pool_sampled_pages": OffloadingGaugeMetadata(
        documentation="Pages of the host pools sampled for their NUMA node.",
    ),
    "kvoffload_host_pool_pages_elsewhere": OffloadingGaugeMetadata(
        documentation="Sampled pages of placed host pools on another NUMA node than theirs.",
    ),
    "kvoffload_host_copy_threads_on_node": OffloadingGaugeMetadata(
        documentation="Host backend copy threads running on their pool's NUMA node.",
    ),
}

#: ``WorkerCore.host_placement``'s keys each gauge sums (``pools`` counts
#: the reports; ``placed`` is 1 where the pool has a node).
_PLACEMENT_GAUGES = {
    "pools": "kvoffload_host_pools",
    "placed": "kvoffload_host_pools_placed",
    "sampled": "kvoffload_host_pool_sampled_pages",
    "elsewhere": "kvoffload_host_pool_pages_elsewhere",
    "copy_threads_on_node": "kvoffload_host_copy_threads_on_node",
}

#: The worker's remote counters (``WorkerCore.remote_stats``: its writes and
#: its fetches' reads) reported to the scheduler, and their metrics.
_REMOTE_WORKER_COUNTERS = {
    "bytes_put": "kvoffload_remote_bytes_written",
    "puts_failed": "kvoffload_remote_puts_failed",
    "puts_dropped": "kvoffload_remote_puts_dropped",
    "partial_chunks_not_put": "kvoffload_remote_partial_chunks_not_put",
    "hits": "kvoffload_remote_shares_fetched",
    "misses": "kvoffload_remote_shares_missed",
    "rejected_values": "kvoffload_remote_values_rejected",
    "bytes_got": "kvoffload_remote_bytes_read",
}

#: The scheduler's remote counters (``SchedulerCore.remote_stats``) and their metrics.
_REMOTE_LOOKUP_COUNTERS = {
    "chunks_found": "kvoffload_remote_chunks_found",
    "chunks_fetched": "kvoffload_remote_chunks_fetched",
    "fetches_failed": "kvoffload_remote_fetches_failed",
    "partial_tails_fetched": "kvoffload_remote_partial_tails_fetched",
}


def _increments(now: dict[str, Any], last: dict[str, int], keys: Iterable[str]) -> dict[str, int]:
    """The non-zero increments of the cumulative counters `keys` of `now`
    since `last`, which is brought up to `now`."""
    out = {}
    for key in keys:
        n = now[key] - last.get(key, 0)
        last[key] = now[key]
        if n:
            out[key] = n
    return out


def _hash_as_bytes(h: bytes) -> bytes:
    return h


def _hash_as_int(h: bytes) -> int:
    return int.from_bytes(h, byteorder="big") & ((1 << 64) - 1)


def block_hash_converter() -> Callable[[bytes], Any]:
    """vLLM's ``maybe_convert_block_hash`` with its environment flag
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) read once: vLLM reads it from
    the environment for every hash, which was most of this connector's
    ``take_events`` time (``tests/test_connector.py`` checks both settings
    against vLLM's function)."""
    import vllm.envs as envs

    return _hash_as_int if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else _hash_as_bytes


def _window_chunks(window: int | tuple, chunk_tokens: int) -> int:
    """vLLM's ``get_sliding_window_size_in_chunks``: the chunks a window of
    ``window`` tokens spans (with the tokens it retains behind it; a
    chunked-local group's: its attention chunk's)."""
    extra = 0
    if window == RECURRENT_STATE:
        # A Mamba group depends on a single state.
        return 1
    if isinstance(window, tuple):
        if window[0] == "chunked_local":
            return -(-window[1] // chunk_tokens)
        window, extra = window[1], window[2]
    return max(-(-window // chunk_tokens), -(-(window - 1 + extra) // chunk_tokens))


def _placeholder_stored(block_hash: Any, kind: Any, window: Any, group: int = 0) -> BlockStored:
    """vLLM's placeholder ``BlockStored`` for a chunk: named by the hash of
    its last block, no tokens, no LoRA, its KV group, the group's kind and
    window."""
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        lora_id=None,
        block_size=0,
        medium="CPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def _u64(limit: int | None) -> int | None:
    """A token limit as the core takes it: Python ints are unbounded, and a
    limit past 2**64 - 1 tokens limits nothing more than that one does."""
    return None if limit is None else min(limit, (1 << 64) - 1)


#: KV cache specs whose block table stays dense while a request runs (every
#: block kept until the request ends): the ones this connector can offload.
_DENSE_ATTENTION_SPECS = (FullAttentionSpec, MLAAttentionSpec)


#: A KV group as the scheduler core takes it: ``None`` full attention, an
#: int a sliding window in tokens, ``("chunked_local", n)`` chunked-local
#: attention over aligned chunks of ``n`` tokens, ``("sliding_window", w,
#: extra)`` a sliding window retaining ``extra`` tokens behind it
#: (multi-module MTP), ``RECURRENT_STATE`` a Mamba group in vLLM's align
#: mode.
GroupWindow = int | tuple[str, int] | tuple[str, int, int] | str | None

#: The scheduler core's name for a recurrent-state (Mamba) group.
RECURRENT_STATE = "recurrent_state"

#: The windowed kinds of one KV group that take the hybrid path.
_WINDOWED_SPECS = (SlidingWindowSpec, SlidingWindowMLASpec, ChunkedLocalAttentionSpec)

#: Sliding windows: MLA's (DeepSeek V4's windowed latent layers) is one to
#: vLLM's connector, where it is prefix-cacheable.
_SLIDING_WINDOW_SPECS = (SlidingWindowSpec, SlidingWindowMLASpec)


def kv_offloaded_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """The KV groups offloaded, by their index in vLLM's configuration: the
    prefix-cacheable ones (vLLM's ``prefix_cacheable_group_ids``, as its
    ``OffloadingConnector`` selects them). A group that is not (a circular
    buffer of keys still being compressed, a bounded-replay window, a group
    outside external transfer) is per-request scratch to vLLM: recomputed,
    never cached, so neither stored nor loaded. Raises ``ValueError`` where
    no group is eligible, or for HiSparse (vLLM then offloads its indexer
    groups only, which kvoffload does not)."""
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        raise ValueError(
            "KvOffloadConnector does not offload HiSparse KV caches (hisparse_host_num_blocks is set)"
        )
    groups = kv_cache_config.kv_cache_groups
    ids = tuple(
        i
        for i, g in enumerate(groups)
        if getattr(g, "enable_kv_transfer", True) and getattr(g.kv_cache_spec, "prefix_cacheable", True)
    )
    if not ids:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError(
            f"KvOffloadConnector found no KV group to offload: none of this model's groups ({', '.join(kinds)}) "
            "is prefix-cacheable, and vLLM caches (and offloads) only those"
        )
    return ids


def kv_offloaded_groups(kv_cache_config: KVCacheConfig) -> list[Any]:
    """The ``KVCacheGroupSpec`` of each offloaded group (`kv_offloaded_group_ids`),
    in order: kvoffload's group ``i`` is vLLM's group ``kv_offloaded_group_ids()[i]``."""
    groups = kv_cache_config.kv_cache_groups
    return [groups[i] for i in kv_offloaded_group_ids(kv_cache_config)]


def kv_eagle_groups(kv_cache_config: KVCacheConfig) -> list[int]:
    """The KV groups that hold an EAGLE/MTP drafter's layers (vLLM's
    ``is_eagle_group``, set with speculative decoding whose draft KV at a
    position depends on the next token): vLLM's connector treats their last
    chunk as volatile. Indices among the offloaded groups."""
    return [i for i, g in enumerate(kv_offloaded_groups(kv_cache_config)) if getattr(g, "is_eagle_group", False)]


def check_mamba_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuses, with the reason, the Mamba configurations kvoffload does not
    offload: a Mamba group outside ``mamba_cache_mode="align"`` (its state
    is then not kept at block boundaries, and vLLM caches none of it);
    decode context parallelism. Speculative decoding's extra state blocks
    (``num_speculative_blocks``) are offloaded as vLLM's connector offloads
    them: as the group's other blocks (test_hybrid_vllm.py, "full+mambasb"). Block
    hashes finer than a Mamba block (vLLM's ``prefix_match_unit``) are
    checked with the chunk size (`kv_partial_tails`)."""
    mamba = [g for g in kv_offloaded_groups(kv_cache_config) if isinstance(g.kv_cache_spec, MambaSpec)]
    if not mamba:
        return
    for g in mamba:
        spec = g.kv_cache_spec
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise ValueError(
                f"KvOffloadConnector offloads Mamba state in mamba_cache_mode='align' only; this model's "
                f"Mamba group is in mode {mode!r} (set mamba_cache_mode='align')"
            )
    if _dcp(vllm_config) > 1:
        raise ValueError(
            "KvOffloadConnector does not offload Mamba groups under decode context parallelism"
        )


def kv_partial_tails(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, blocks_per_chunk: int) -> bool:
    """Whether Mamba states are offloaded at hash boundaries inside a block
    ("partial tails"): vLLM hashes finer than a Mamba block (its
    ``prefix_match_unit``), and vLLM's connector builds them
    (``supports_partial_tail``): chunks of one block, every offloaded group
    of one block size, no windowed group but Mamba's. Refuses, with the
    reason, finer hashes where vLLM builds none (kvoffload was not checked
    against vLLM there), and with Mamba
    layers that export prefill checkpoints (Mamba2, GDN), where vLLM
    0.33.0's own prefix cache serves wrong states."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    groups = kv_offloaded_groups(kv_cache_config)
    mamba = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    if not mamba:
        return False
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if all(int(g.kv_cache_spec.block_size) <= tokens_per_hash for g in mamba):
        return False
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    windowed = [
        type(g.kv_cache_spec).__name__
        for g in groups
        if isinstance(g.kv_cache_spec, _WINDOWED_SPECS)
    ]
    why = (
        f"chunks of {blocks_per_chunk} blocks" if blocks_per_chunk != 1
        else f"KV groups of block sizes {sorted(sizes)}" if len(sizes) != 1
        else f"a windowed group ({windowed[0]})" if windowed
        else None
    )
    if why is not None:
        raise ValueError(
            f"KvOffloadConnector offloads Mamba states inside a block (vLLM hashes every {tokens_per_hash} "
            f"tokens, prefix_match_unit, finer than the Mamba block of {mamba[0].kv_cache_spec.block_size}) "
            f"only as vLLM's connector does: chunks of one block, one block size, no windowed group; "
            f"this configuration has {why}. Leave prefix_match_unit unset, or set it to the Mamba block"
        )
    if any(int(getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) or 0) > 0 for g in mamba):
        # vLLM 0.33.0's Mamba manager, with a prefill checkpoint instead of
        # block-split prefills (Mamba2, GDN), caches the block of a hit
        # inside a block under the next block boundary's hash while it
        # holds the state at the hit: later hits there read a wrong state
        # (docs/hybrid-groups.md, step 22). Offloading would carry it to
        # the host tier and to other nodes.
        raise ValueError(
            f"KvOffloadConnector does not offload Mamba states inside a block (prefix_match_unit "
            f"{tokens_per_hash}, finer than the Mamba block of {mamba[0].kv_cache_spec.block_size}) for Mamba "
            "layers with prefill checkpoints (Mamba2, GDN): vLLM 0.33.0's prefix cache then keys a block "
            "holding the state at a hit inside a block as the state at the next block boundary, and the "
            "offload tiers would spread that state. Leave prefix_match_unit unset, or set it to the Mamba block"
        )
    return True


def kv_partial_tail_eagle_margin(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """The tokens past a partial tail's boundary at which an EAGLE/MTP
    draft group keys it (vLLM's ``eagle_proof_margin``, as its connector
    resolves it: one hash unit where the core takes hits inside a block
    and the draft group's manager looks up at that grain, else one block);
    0 without a draft group or partial tails."""
    from vllm.v1.core.kv_cache_utils import eagle_proof_margin, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    groups = kv_offloaded_groups(kv_cache_config)
    drafts = [g for g in groups if getattr(g, "is_eagle_group", False) and not isinstance(g.kv_cache_spec, MambaSpec)]
    if not drafts:
        return 0
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    block = int(groups[0].kv_cache_spec.block_size)
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    partial_hash_hits = alignment is not None and alignment < block
    margins = {
        eagle_proof_margin(
            block,
            tokens_per_hash,
            partial_hash_hits and KVCacheSpecRegistry.get_manager_class(g.kv_cache_spec).supports_fine_grained_hash_lookup,
        )
        for g in drafts
    }
    if len(margins) != 1:
        raise ValueError(
            f"KvOffloadConnector: EAGLE/MTP draft groups with different proof margins {sorted(margins)} (one is built)"
        )
    return margins.pop()


def kv_group_windows(kv_cache_config: KVCacheConfig) -> list[GroupWindow] | None:
    """The offloaded KV groups (`kv_offloaded_groups`) of a hybrid
    ``KVCacheConfig`` (several groups, vLLM's hybrid manager, or one
    sliding-window, chunked-local or Mamba group) as the scheduler core takes
    them (``GroupWindow``: ``None`` for full attention, the sliding window in
    tokens, ``("chunked_local", n)``, ``RECURRENT_STATE``). ``None`` for one group of another kind
    (the single-group path). Raises ``ValueError`` for offloaded groups
    kvoffload cannot offload (other kinds of layers). The groups may have
    different block sizes (``kv_group_block_tokens``)."""
    groups = kv_cache_config.kv_cache_groups
    offloaded = kv_offloaded_groups(kv_cache_config)
    if len(groups) < 2 and not (
        type(offloaded[0].kv_cache_spec) in _WINDOWED_SPECS
        or isinstance(offloaded[0].kv_cache_spec, MambaSpec)
        # One full-attention (or MLA) group holding a drafter's layers:
        # the groups' path follows its volatile last chunk.
        or (type(offloaded[0].kv_cache_spec) in _DENSE_ATTENTION_SPECS and kv_eagle_groups(kv_cache_config))
    ):
        return None
    windows: list[GroupWindow] = []
    for g in offloaded:
        spec = g.kv_cache_spec
        if type(spec) in _DENSE_ATTENTION_SPECS:
            # Full attention, MLA's included (vLLM's connector: no window).
            windows.append(None)
        elif type(spec) in _SLIDING_WINDOW_SPECS:
            extra = int(getattr(spec, "extra_retained_tokens", 0))
            windows.append(("sliding_window", int(spec.sliding_window), extra) if extra else int(spec.sliding_window))
        elif type(spec) is ChunkedLocalAttentionSpec:
            windows.append(("chunked_local", int(spec.attention_chunk_size)))
        elif isinstance(spec, MambaSpec):
            # Its state at a block boundary (align mode: `check_mamba_groups`).
            windows.append(RECURRENT_STATE)
        else:
            raise ValueError(
                "KvOffloadConnector offloads hybrid models of full-attention (or MLA), sliding-window, "
                f"chunked-local attention and Mamba KV groups; this model has a {type(spec).__name__} group"
            )
    return windows


def kv_layer_spec(group_spec: Any, layer: str) -> Any:
    """Layer `layer`'s spec in a KV group of spec `group_spec`: its own where
    the group keeps one per layer (vLLM's ``UniformTypeKVCacheSpecs``, on the
    workers), else the group's."""
    per_layer = getattr(group_spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict):
        return per_layer.get(layer, group_spec)
    return group_spec


def kv_group_block_tokens(kv_cache_config: KVCacheConfig, dcp: int = 1) -> list[int]:
    """Each KV group's tokens a block. vLLM gives a group of smaller pages
    (fewer KV heads, say) larger blocks so that every group has one page
    size; the groups' chunks are then ``blocks_per_chunk`` of their own
    blocks, of different token counts, as vLLM's connector makes them.
    Under decode context parallelism (`dcp` ranks) a block of a spec DCP
    shards spans ``block_size x dcp`` tokens (vLLM's
    ``resolve_dcp_kv_block_size``). The offloaded groups only."""
    return [_sharded_block_tokens(g.kv_cache_spec, dcp) for g in kv_offloaded_groups(kv_cache_config)]


def kv_unit_block_tokens(kv_cache_config: KVCacheConfig, dcp: int = 1) -> int:
    """The engine's block: the greatest common divisor of the groups'
    blocks (every group's block a whole number of it); the scheduler core
    takes a request's block hashes one per such block."""
    return math.gcd(*kv_group_block_tokens(kv_cache_config, dcp))


def _dcp(vllm_config: VllmConfig) -> int:
    """vLLM's ``decode_context_parallel_size`` (1 without DCP)."""
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def _sharded_block_tokens(spec: Any, dcp: int) -> int:
    """The tokens a KV block of `spec` spans over `dcp` DCP ranks: each
    rank holds every dcp-th token of a block of a spec DCP shards."""
    return int(spec.block_size) * (dcp if getattr(spec, "dcp_sharded", False) else 1)


def kv_hashes_per_block(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """vLLM's block hashes per KV block: ``block_size // prefix_match_unit``
    (vLLM's ``tokens_per_hash``, which it allows finer than the blocks with
    several KV groups), 1 by default. A block's chunk key is the last hash
    in it, as vLLM's connector keys its chunks."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    dcp = _dcp(vllm_config)
    for block in kv_group_block_tokens(kv_cache_config, dcp):
        if tokens_per_hash <= 0 or block % tokens_per_hash:
            raise ValueError(
                f"KvOffloadConnector needs every KV block ({block} tokens) to be a multiple of "
                f"vLLM's block-hash unit (prefix_match_unit: {tokens_per_hash} tokens)"
            )
    return kv_unit_block_tokens(kv_cache_config, dcp) // tokens_per_hash


def kv_scheduler_view(kv_cache_config: KVCacheConfig) -> KVCacheConfig:
    """The configuration as vLLM's scheduler sees it: a group of layers of
    one kind and different page sizes (``UniformTypeKVCacheSpecs``, which
    the workers' configuration keeps: DeepSeek V3.2's MLA and its indexer)
    has its first layer's spec, as vLLM flattens it for the scheduler. Both
    sides then derive the same engine configuration (the host chunk's bytes
    come from the backing allocation either way)."""
    groups = kv_cache_config.kv_cache_groups
    if not any(isinstance(getattr(g.kv_cache_spec, "kv_cache_specs", None), dict) for g in groups):
        return kv_cache_config
    flat = copy.copy(kv_cache_config)
    flat.kv_cache_groups = [
        dataclasses.replace(g, kv_cache_spec=kv_layer_spec(g.kv_cache_spec, g.layer_names[0]))
        if isinstance(getattr(g.kv_cache_spec, "kv_cache_specs", None), dict) and g.layer_names
        else g
        for g in groups
    ]
    return flat


def _engine_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineConfig:
    """The engine configuration from vLLM's: one full-attention KV group, or
    (`kv_group_windows`) full-attention, sliding-window, chunked-local
    attention and Mamba groups (`check_mamba_groups`)."""
    groups = kv_cache_config.kv_cache_groups
    check_mamba_groups(vllm_config, kv_cache_config)
    if kv_group_windows(kv_cache_config) is not None:
        return _hybrid_engine_config(vllm_config, kv_cache_config)
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups) or "none"
        raise ValueError(
            "KvOffloadConnector supports models with one full-attention KV cache group "
            f"(this model's groups: {kinds})"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) not in _DENSE_ATTENTION_SPECS:
        # R-SWA and sink layers: vLLM frees (or nulls) their blocks behind
        # the window while the request runs, and the single-group path
        # stores from, and loads into, every block id it was given (another
        # request may hold some by then). Sliding-window and chunked-local
        # groups take the hybrid path (`kv_group_windows`), which follows
        # vLLM's windows.
        raise ValueError(
            "KvOffloadConnector offloads full-attention KV only (FullAttentionSpec, "
            f"MLAAttentionSpec); this model's KV cache group is {type(spec).__name__}, "
            "whose blocks vLLM frees behind the window while a request runs"
        )
    # Decode context parallelism: each of the dcp ranks holds every dcp-th
    # token of a block, so a block (and its hash) spans block_size x dcp
    # tokens while each worker's page is its own share; the workers move
    # their pages whole, the scheduler counts the block's tokens (vLLM's
    # `resolve_dcp_kv_block_size`).
    block_tokens = _sharded_block_tokens(spec, _dcp(vllm_config))
    num_blocks = kv_cache_config.num_blocks
    if kv_cache_config.kv_cache_tensors and num_blocks > 0:
        # As vLLM's offloading: every KVCacheTensor describes placement in the
        # same backing allocation, so the first one's size is the total.
        per_block = kv_cache_config.kv_cache_tensors[0].size // num_blocks
    else:
        per_block = spec.page_size_bytes * len(groups[0].layer_names)
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    replicated = _replicated_layout(vllm_config, kv_cache_config, per_block, _canonical_layout(vllm_config))
    return EngineConfig.from_extra(
        extra,
        tokens_per_block=block_tokens,
        world_size=vllm_config.parallel_config.world_size,
        worker_bytes_per_block=per_block,
        # As vLLM counts a hit against sync_load_budget_bytes: a worker's
        # bytes of a block over the block's tokens.
        kv_bytes_per_token=spec.page_size_bytes * len(groups[0].layer_names) // block_tokens,
        replicated_layout=replicated,
        remote_head_shares=_remote_head_shares(vllm_config, kv_cache_config, replicated),
    )


def _hybrid_engine_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineConfig:
    """The engine configuration of a hybrid ``KVCacheConfig`` (vLLM's
    ``SchedulerOffloadConfig`` for several groups): a host chunk holds one
    group's blocks, sized as vLLM's (the backing allocation's bytes per
    block); the sync-load budget counts every offloaded group's bytes per
    token (vLLM's ``kv_bytes_per_token``, over the groups its connector
    selects)."""
    dcp = _dcp(vllm_config)
    groups = kv_offloaded_groups(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    page_bytes = [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups]
    if kv_cache_config.kv_cache_tensors and num_blocks > 0:
        per_block = kv_cache_config.kv_cache_tensors[0].size // num_blocks
    else:
        per_block = sum(page_bytes)
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    block_tokens = kv_group_block_tokens(kv_cache_config, dcp)
    if len(set(block_tokens)) > 1 and extra.get("block_size") is not None:
        # vLLM's own check: a chunk in tokens fits one block size only.
        raise ValueError(
            "If 'block_size' is specified in kv_connector_extra_config, all KV cache groups must have "
            f"the same block size (they have {sorted(set(block_tokens))}); set 'blocks_per_chunk' instead"
        )
    replicated = _replicated_layout(vllm_config, kv_cache_config, per_block, _canonical_layout(vllm_config))
    return EngineConfig.from_extra(
        extra,
        tokens_per_block=kv_unit_block_tokens(kv_cache_config, dcp),
        world_size=vllm_config.parallel_config.world_size,
        worker_bytes_per_block=per_block,
        kv_bytes_per_token=sum(b // t for b, t in zip(page_bytes, block_tokens)),
        replicated_layout=replicated,
        remote_head_shares=_remote_head_shares(vllm_config, kv_cache_config, replicated),
    )


def _uses_shared_region() -> bool:
    """Whether vLLM's CPU offloading keeps its host pool in a region every
    worker maps (its ``CPUOffloadingSpec._uses_shared_region``: CUDA but not
    ROCm, or XPU); only there does it keep one copy of replicated KV."""
    from vllm.platforms import current_platform

    return bool(
        (current_platform.is_cuda_alike() and not current_platform.is_rocm()) or current_platform.is_xpu()
    )


def _canonical_layout(vllm_config: VllmConfig) -> bool:
    """Whether ``kv_connector_extra_config`` asks for vLLM's
    ``canonical_layout`` (a boolean; anything else raises ``ValueError``)."""
    from kvoffload.config import canonical_layout

    return canonical_layout(dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))


def _parallelism_agnostic(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, canonical: bool) -> bool:
    """vLLM's ``is_parallelism_agnostic``: whether an offloaded block's bytes
    are the same under any tensor-parallel size. Without ``canonical_layout``:
    one full-attention group (not MLA) whose heads are split over the ranks,
    no per-token-head quantisation, no context parallelism, vLLM's first
    model runner. With it, every layer of every group a spec whose canonical
    page can be derived (head-sharded attention or sliding windows, MLA with
    one token a state and a page of whole token rows), no context
    parallelism, the workers exactly the tensor-parallel group."""
    pc = vllm_config.parallel_config
    mc = vllm_config.model_config
    tp = pc.tensor_parallel_size
    dcp = getattr(pc, "decode_context_parallel_size", 1)
    pcp = getattr(pc, "prefill_context_parallel_size", 1)
    total_heads = mc.get_total_num_kv_heads() if mc is not None else 0
    groups = kv_cache_config.kv_cache_groups
    single = groups[0].kv_cache_spec if len(groups) == 1 else None
    agnostic = bool(
        not getattr(vllm_config, "use_v2_model_runner", False)
        and single is not None
        and isinstance(single, FullAttentionSpec)
        and not isinstance(single, MLAAttentionSpec)
        and single.num_kv_heads * tp == total_heads
        and not single.kv_quant_mode.is_per_token_head
        and dcp == 1
        and pcp == 1
    )
    if not canonical or agnostic:
        return agnostic

    def certifiable(spec: Any) -> bool:
        if not isinstance(spec, AttentionSpec) or spec.kv_quant_mode.is_per_token_head:
            return False
        if type(spec) is MLAAttentionSpec:
            return spec.tokens_per_state == 1 and spec.real_page_size_bytes % spec.block_size == 0
        if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)):
            return False
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            return False
        return (total_heads % tp == 0 or tp % total_heads == 0) and spec.num_kv_heads == max(1, total_heads // tp)

    layer_specs = [s for g in groups for s in iter_layer_specs(g.kv_cache_spec)]
    return bool(
        layer_specs and all(certifiable(s) for s in layer_specs) and dcp == 1 and pcp == 1 and pc.world_size == tp
    )


def _replicated_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, worker_bytes_per_block: int, canonical: bool = False
) -> bool:
    """Whether vLLM's OffloadingConnector keeps one copy of each chunk for
    every worker (its ``replicated_layout``, gated as its CPU spec gates it,
    on a platform where the host pool is a shared region). Without
    ``canonical_layout``: MLA KV replicated on every tensor-parallel rank,
    tensor parallelism alone (no pipeline or context parallelism), one
    node, the ``mp`` executor. With it (vLLM's rule then replaces that
    one): every offloaded layer plain MLA, the layout parallelism-agnostic
    (`_parallelism_agnostic`), one node, one worker or the ``mp`` executor."""
    pc = vllm_config.parallel_config
    mc = vllm_config.model_config
    if not _uses_shared_region():
        return False
    if canonical:
        return bool(
            _parallelism_agnostic(vllm_config, kv_cache_config, True)
            and all(
                type(s) is MLAAttentionSpec
                for g in kv_offloaded_groups(kv_cache_config)
                for s in iter_layer_specs(g.kv_cache_spec)
            )
            and getattr(pc, "nnodes_within_dp", 1) == 1
            and (pc.world_size == 1 or pc.distributed_executor_backend == "mp")
        )
    tp = pc.tensor_parallel_size
    return bool(
        mc is not None
        and getattr(mc, "use_mla", False)
        and tp > 1
        and getattr(kv_cache_config, "kv_tp_replicas", 1) == tp
        and worker_bytes_per_block > 0
        and pc.pipeline_parallel_size == 1
        and getattr(pc, "prefill_context_parallel_size", 1) == 1
        and getattr(pc, "decode_context_parallel_size", 1) == 1
        and pc.world_size == tp
        and pc.distributed_executor_backend == "mp"
        and getattr(pc, "nnodes_within_dp", 1) == 1
    )


def _remote_head_shares(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, replicated: bool) -> int:
    """The model's KV heads where they are the shares of a chunk in the
    remote tier, else 0. They are with ``canonical_layout`` where vLLM's
    canonical rule calls the layout parallelism-agnostic (head-sharded
    attention, sliding windows or MLA; no context parallelism; the workers
    exactly the tensor-parallel group) and the offloaded layers are all of
    one kind: attention whose heads tensor parallelism shards (the model's
    KV heads), or MLA (one latent "head" every rank holds). A replicated
    layout keeps its one share (rank 0 puts the whole chunk): that is
    already the same at every tensor-parallel size."""
    if replicated or not _canonical_layout(vllm_config):
        return 0
    if not _parallelism_agnostic(vllm_config, kv_cache_config, True):
        return 0
    specs = [s for g in kv_offloaded_groups(kv_cache_config) for s in iter_layer_specs(g.kv_cache_spec)]
    if specs and all(type(s) is MLAAttentionSpec for s in specs):
        return 1
    if any(isinstance(s, MLAAttentionSpec) for s in specs):
        return 0
    mc = vllm_config.model_config
    return int(mc.get_total_num_kv_heads()) if mc is not None else 0


def _head_page(tensor: torch.Tensor, spec: Any, num_blocks: int) -> tuple[str, int, int, int, int] | None:
    """How a layer's page holds its KV heads, for KV heads as remote shares
    (``WorkerCore.attach_remote_heads``): ``(order, halves, block tokens,
    heads, head bytes)``, read from the tensor's shape and strides as vLLM's
    canonical mapping reads them (K and V apart, ``(blocks, 2, tokens,
    heads, head)``, or side by side, ``(blocks, heads, tokens, 2 x head)``;
    a token's heads together, NHD, or a head's tokens, HND); an MLA page is
    one "head" of token rows. None: a layout it does not know."""
    bs = spec.block_size
    elem = tensor.element_size()
    if type(spec) is MLAAttentionSpec:
        page = spec.real_page_size_bytes
        return None if page % bs else ("nhd", 1, bs, 1, page // bs)
    heads, hd = spec.num_kv_heads, spec.head_size
    shape, stride = tuple(tensor.shape), tensor.stride()
    if shape == (num_blocks, heads, bs, 2 * hd):
        _, head_stride, token_stride, inner = stride
        halves, head_bytes = 1, 2 * hd * elem
        nhd = head_stride == 2 * hd and token_stride == heads * 2 * hd
        hnd = head_stride == bs * 2 * hd and token_stride == 2 * hd
    elif shape == (num_blocks, 2, bs, heads, hd):
        _, half_stride, token_stride, head_stride, inner = stride
        if half_stride != bs * heads * hd:
            return None
        halves, head_bytes = 2, hd * elem
        nhd = token_stride == heads * hd and head_stride == hd
        hnd = head_stride == bs * hd and token_stride == hd
    else:
        return None
    if inner != 1 or not (nhd or hnd) or halves * bs * heads * head_bytes != spec.real_page_size_bytes:
        return None
    return ("nhd" if nhd else "hnd", halves, bs, heads, head_bytes)


def _all_workers_barrier() -> bool:
    """Waits until every worker of the engine has reached this point (vLLM's
    world group, as vLLM's shared offload region waits); False, at once,
    where vLLM's groups do not exist (a test's workers in one process)."""
    from vllm.distributed import parallel_state as ps

    try:
        group = ps.get_inner_dp_world_group()
    except AssertionError:
        try:
            group = ps.get_world_group()
        except AssertionError:
            return False
    group.barrier()
    return True


def _shared_region_name(vllm_config: VllmConfig) -> str:
    """The name of the engine's shared host region: its engine id and the
    engine process's id (the parent of every worker process of the ``mp``
    executor), so that two engines given the same engine id never share one."""
    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or "engine"
    return f"{engine_id}_{os.getppid()}"


def _group_extent(spec: Any) -> Any:
    """A group's window in the remote namespace: the local-attention chunk,
    a Mamba group's state shapes and dtypes, else the spec's
    ``sliding_window`` (as namespaces were named before chunked-local
    groups)."""
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        # A Mamba layer's page: its states' shapes and dtypes.
        return f"{tuple(tuple(x) for x in spec.shapes)}:{','.join(str(d) for d in spec.dtypes)}"
    return getattr(spec, "sliding_window", "")


def _remote_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: EngineConfig) -> int:
    """The deployment's namespace in the remote store: the same on every node
    (and in both roles) exactly when their chunks' bytes are interchangeable:
    model and revision, the KV spec (dtype, heads, head size, layers), the
    block and chunk sizes, the bytes per block, the world size (one where
    every worker holds the same bytes), pipeline
    stages, decode context parallelism, the block hash function, the attention backend,
    and the operator's ``deployment``."""
    from kvoffload._native import remote_namespace

    # Both roles name it from the scheduler's view (a worker keeps one spec
    # a layer in a group of layers of different page sizes).
    kv_cache_config = kv_scheduler_view(kv_cache_config)
    # The offloaded groups' layouts (a group left out holds no chunk).
    offloaded = kv_offloaded_groups(kv_cache_config)
    group = offloaded[0]
    spec = group.kv_cache_spec
    mc = vllm_config.model_config
    model = f"{mc.model if mc else ''}@{(mc.revision if mc else None) or ''}|{cfg.remote_deployment}"
    attention = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    # KV heads as shares: a share is one head's bytes, whatever the
    # tensor-parallel size; named by the model's heads, not a rank's.
    head_shares = cfg.remote_head_shares
    layout = "|".join(
        str(x)
        for x in (
            "vllm-per-layer-LBHNC",
            type(spec).__name__,
            f"kv-heads:{head_shares}" if head_shares else getattr(spec, "num_kv_heads", ""),
            getattr(spec, "head_size", ""),
            getattr(spec, "dtype", ""),
            vllm_config.cache_config.cache_dtype,
            len(group.layer_names),
            vllm_config.cache_config.prefix_caching_hash_algo,
            attention or "auto",
        )
    )
    groups = kv_cache_config.kv_cache_groups
    if (
        len(groups) > 1
        or getattr(spec, "sliding_window", None) is not None
        or isinstance(spec, (ChunkedLocalAttentionSpec, MambaSpec))
    ):
        # Hybrid groups: a chunk holds one group's layers, keyed by its group.
        layout += "|groups:" + ";".join(
            f"{type(g.kv_cache_spec).__name__}/{_group_extent(g.kv_cache_spec)}/{len(g.layer_names)}"
            for g in offloaded
        )
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        # A rank's share is its stage's layers, not a tensor-parallel
        # share of every layer: named apart from a tensor-parallel split of
        # the same world size (namespaces without stages stay as they were).
        layout += f"|pp:{pp}"
    dcp = _dcp(vllm_config)
    if dcp > 1:
        # Decode context parallelism: a rank's share of a block is every
        # dcp-th token (in runs of the interleave size), not a share of the
        # heads; a deployment without it of the same block tokens and world
        # size must not read these chunks (namespaces without DCP stay as
        # they were).
        interleave = getattr(vllm_config.parallel_config, "cp_kv_cache_interleave_size", 1)
        layout += f"|dcp:{dcp}/{interleave}"
    # Replicated KV (every worker holds a whole chunk's bytes, one share of
    # it is stored) is named as one worker: a node of one worker of the
    # same model and layout reads and writes the same chunks.
    bytes_per_block = cfg.worker_chunk_bytes // cfg.blocks_per_chunk
    if head_shares:
        # One head's bytes a block (a worker holds its heads' or, with more
        # ranks than heads, one head).
        bytes_per_block //= max(1, head_shares // cfg.world_size)
    return remote_namespace(
        model,
        layout,
        cfg.tokens_per_block,
        cfg.blocks_per_chunk,
        bytes_per_block,
        cfg.remote_shares,
    )


def _worker_rank(world_size: int) -> int:
    """This worker's rank among the engine's ``world_size`` workers (tensor
    rank within its pipeline stage, stages outermost): the share of each
    chunk it writes and fetches."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        tp = ps.get_tp_group()
        pp = ps.get_pp_group()
        return pp.rank_in_group * tp.world_size + tp.rank_in_group
    if world_size == 1:
        return 0
    raise RuntimeError(
        "kvoffload.vllm: remote_tier with several workers needs vLLM's model parallel "
        "groups initialised (each worker writes its own share of a chunk)"
    )


class _SchedulerSide:
    """The scheduler role: vLLM's objects in, kvoffload's scheduler calls out."""

    def __init__(self, cfg: EngineConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.cfg = cfg
        events = vllm_config.kv_events_config
        # As vLLM's manager: no KV events unless vLLM publishes them.
        publish = bool(events is not None and events.enable_kv_cache_events)
        #: Whether vLLM publishes KV events (else ``take_events`` is empty).
        self.publish = publish
        #: Whether the events carry each chunk's payload (and every
        #: ``BlockStored`` the KV group's kind and window).
        self.self_describing = publish and cfg.self_describing_kv_events
        #: vLLM's index of each offloaded KV group (kvoffload's group ``i``
        #: is vLLM's ``group_ids[i]``): the prefix-cacheable groups.
        self.group_ids = kv_offloaded_group_ids(kv_cache_config)
        #: The offloaded groups' indices where vLLM has groups left out
        #: (its per-group block lists are narrowed to them), else ``None``.
        self.selected = (
            self.group_ids if len(self.group_ids) < len(kv_cache_config.kv_cache_groups) else None
        )
        #: vLLM's groups left out (their blocks share the GPU pool: a block
        #: a store still reads may be allocated to one of them).
        self.left_out = tuple(
            i for i in range(len(kv_cache_config.kv_cache_groups)) if i not in self.group_ids
        )
        #: Per KV group its window (``GroupWindow``; ``None``: full
        #: attention), or ``None`` for one full-attention group.
        self.windows = kv_group_windows(kv_cache_config)
        #: Per KV group its chunk in tokens (``blocks_per_chunk`` of its
        #: blocks); one entry for one full-attention group.
        self.group_chunk_tokens = (
            [t * cfg.blocks_per_chunk for t in kv_group_block_tokens(kv_cache_config, _dcp(vllm_config))]
            if self.windows
            else [cfg.tokens_per_block * cfg.blocks_per_chunk]
        )
        retention = vllm_config.cache_config.prefix_cache_retention_interval if self.windows else None
        if self.windows and retention is not None:
            for w, chunk in zip(self.windows, self.group_chunk_tokens):
                if w is not None and retention % chunk:
                    # vLLM's own check.
                    raise ValueError(
                        f"prefix_cache_retention_interval ({retention}) must be a multiple of "
                        f"tokens_per_chunk ({chunk})."
                    )
        self.core = SchedulerCore(
            cfg.to_json(),
            kv_events=publish,
            self_describing=self.self_describing,
            groups=self.windows,
            retention_interval=retention,
            eagle_groups=kv_eagle_groups(kv_cache_config) if self.windows else [],
            hashes_per_block=kv_hashes_per_block(vllm_config, kv_cache_config) if self.windows else 1,
            block_tokens=kv_group_block_tokens(kv_cache_config, _dcp(vllm_config)) if self.windows else [],
            partial_tails=bool(self.windows) and kv_partial_tails(vllm_config, kv_cache_config, cfg.blocks_per_chunk),
            partial_tail_eagle_margin=kv_partial_tail_eagle_margin(vllm_config, kv_cache_config) if self.windows else 0,
        )
        #: Per KV group, the kind and window its events carry (self-describing).
        self.event_specs = (
            [get_offloading_event_group_spec(g) for g in kv_offloaded_groups(kv_cache_config)]
            if self.self_describing
            else None
        )
        #: The remote stats already reported (the payload carries increments).
        self.remote_last: dict[str, int] = {}
        #: The workers' host pool placements, summed (``_PLACEMENT_GAUGES``).
        self.placement: dict[str, int] = {}
        #: Whether lookups may reserve a sync load (``sync_load_budget_bytes``).
        self.sync_loads = cfg.sync_load_budget_bytes > 0
        if cfg.remote_tier_json is not None:
            self._attach_remote(vllm_config, kv_cache_config)
        # Requests the connector was told of (the engine reads their token
        # counts and block hashes from the objects, at the hooks that need them).
        self.requests: set[str] = set()
        #: Whether the hooks run the stall scan (when due): only for a core
        #: without its watchdog thread, which otherwise scans on its own.
        self.scan_in_hooks = False
        self.stats = OffloadingConnectorStats()
        self.block_size = cfg.tokens_per_block * cfg.blocks_per_chunk
        self.info_sent = False
        max_len = vllm_config.model_config.max_model_len if vllm_config.model_config else 0
        # vLLM's CPU tier facts (``CPUOffloadingInfo``): a request of
        # max_model_len tokens takes its chunks in every group (a sliding
        # window's at most its window's).
        per_request = 0
        for w, group_chunk in zip(self.windows or [None], self.group_chunk_tokens):
            group_chunks = -(-max_len // group_chunk)
            if w is not None:
                group_chunks = min(group_chunks, _window_chunks(w, group_chunk))
            per_request += group_chunks
        self.info = {
            "cpu_num_chunks": cfg.num_cpu_chunks,
            "cpu_blocks_per_chunk": cfg.blocks_per_chunk,
            "cpu_kv_cache_size_bytes": cfg.num_cpu_chunks * cfg.host_chunk_bytes,
            "cpu_kv_cache_size_tokens": (
                cfg.num_cpu_chunks * max_len // per_request if max_len > 0 else None
            ),
        }

    def _attach_remote(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        import os

        from kvoffload._native import check_remote_config

        assert self.cfg.remote_tier_json is not None
        algo = vllm_config.cache_config.prefix_caching_hash_algo
        if os.getenv("PYTHONHASHSEED") is None and not str(algo).startswith("sha256"):
            logger.warning(
                "kvoffload: remote_tier with prefix_caching_hash_algo=%s and no PYTHONHASHSEED: "
                "vLLM seeds its block hashes at random per process, so no other node (nor this "
                "one after a restart) finds this node's chunks; set PYTHONHASHSEED to one value "
                "on every node, or use sha256",
                algo,
            )
        self.core.attach_remote(
            self.cfg.remote_tier_json,
            _remote_namespace(vllm_config, kv_cache_config, self.cfg),
            self.cfg.remote_shares,
        )
        heads = self.cfg.remote_head_shares
        if self.cfg.canonical_layout and not heads and not self.cfg.replicated_layout:
            logger.info(
                "kvoffload: canonical_layout: the remote tier keeps one share of a chunk a worker, not one "
                "a KV head: vLLM does not call this layout parallelism-agnostic (context parallelism, "
                "pipeline stages, layers whose heads are not split over the ranks), or its layers mix "
                "MLA and other attention; only nodes of this tensor-parallel size read its chunks"
            )
        logger.info(
            "kvoffload: remote tier %s attached (lookups that miss the host tier ask it; a chunk's shares: %s)",
            check_remote_config(self.cfg.remote_tier_json),
            f"the model's {heads} KV heads, read by nodes of any tensor-parallel size"
            if heads
            else f"{self.cfg.remote_shares} (one a worker, or one where every worker holds the same bytes)",
        )

    def on_new_request(self, request: Request) -> None:
        self.core.add_request(request)
        self.requests.add(request.request_id)
        params = request.kv_transfer_params
        if params:
            # vLLM's per-request limits (``max_load_tokens``,
            # ``max_offload_tokens``) and tier filter (``kv_load_tiers``).
            p = parse_request_params(params)
            if not p.is_default:
                self.core.set_request_caps(
                    request.request_id,
                    _u64(p.max_load_tokens),
                    _u64(p.max_offload_tokens),
                    p.skips_remote_tier,
                )

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The accepted hit split by the tier that supplied it: ``host`` for
        chunks the host tier held; ``external_unspecified`` (vLLM's label for
        a remote store) for chunks the request's own fetches brought from the
        remote tier. Only non-zero counts."""
        if num_external_tokens == 0:
            return {}
        rid = request.request_id
        if rid not in self.requests:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        host, remote = self.core.hit_sources(rid, num_external_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.EXTERNAL_UNSPECIFIED: remote}
        return {k: v for k, v in out.items() if v}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id not in self.requests:
            self.on_new_request(request)
        # Prompt-logprob requests (and any that asks) must compute their
        # prompt: no hit, as vLLM's connector and its GPU prefix cache.
        if self.windows:
            # Sliding-window groups also store the window ending where the
            # GPU prefix cache's shared prefix ends (set before this lookup).
            self.core.set_shared_prefix_boundary(request.request_id, int(request.shared_prefix_boundary))
        hit = self.core.lookup(
            request.request_id, num_computed_tokens, bool(request.skip_reading_prefix_cache)
        )
        if hit is None:
            return None, False
        if hit and self.sync_loads and self.core.sync_load_reserved(request.request_id):
            # Loaded inside the step (the workers wait for it): the request
            # runs at once, as vLLM's sync loads.
            return hit, False
        return hit, hit > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.selected is not None:
            self._note_left_out([[int(b.block_id) for b in group] for group in blocks.blocks])
        if self.windows:
            # Per group each block and whether it holds cached KV (a hash).
            groups = [
                ([int(b.block_id) for b in group], [b.block_hash is not None for b in group])
                for group in self._offloaded(blocks.blocks)
            ]
            self.core.on_alloc_groups(request.request_id, groups, num_external_tokens)
            return
        block_ids = [int(b) for b in self._offloaded(blocks.get_block_ids())[0]]
        self.core.on_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, so: SchedulerOutput) -> KvOffloadMetadata:
        # A stall scan if one is due, for a core without the watchdog thread
        # (which scans on its own); stalls found either way are applied by
        # the step itself.
        if self.scan_in_hooks:
            self.core.scan_if_due()
        new_blocks = [self._offloaded(r.block_ids) if r.block_ids else [] for r in so.scheduled_new_reqs]
        new = [
            (r.req_id, [int(b) for b in ids[0]] if ids else [], int(r.num_computed_tokens))
            for r, ids in zip(so.scheduled_new_reqs, new_blocks)
        ]
        cached = so.scheduled_cached_reqs
        cached_blocks = cached.new_block_ids
        if self.selected is not None:
            for ids in [r.block_ids for r in so.scheduled_new_reqs if r.block_ids] + [
                ids for ids in cached_blocks if ids is not None
            ]:
                self._note_left_out(ids)
            cached_blocks = [None if ids is None else self._offloaded(ids) for ids in cached_blocks]
        preempted = sorted(r for r in (so.preempted_req_ids or ()) if r in self.requests)
        finished = [r for r in (so.finished_req_ids or ()) if r in self.requests]
        # Several KV groups: the new requests' blocks of groups 1, 2, ...
        new_groups = (
            [[[int(b) for b in g] for g in ids[1:]] if ids else [] for ids in new_blocks]
            if self.windows
            else []
        )
        copies = getattr(so, "kv_cache_block_copies", None)
        if copies:
            # Blocks vLLM's model runner overwrites with a copy in this step
            # (Mamba's copy-on-write): a store still reading one is flushed
            # first, as vLLM counts them allocated.
            self.core.note_allocated([int(c.dst_block_id) for c in copies])
        plan, load_requests, failed = self.core.build_step(
            so.num_scheduled_tokens,
            new,
            cached.req_ids,
            cached_blocks,
            cached.num_computed_tokens,
            cached.resumed_req_ids,
            preempted,
            finished,
            new_groups,
            self._boundary_states(so),
        )
        self.requests.difference_update(finished)
        return KvOffloadMetadata(plan=plan, load_requests=load_requests, failed_loads=failed)

    def _boundary_states(self, so: SchedulerOutput) -> list[tuple[str, int, int, int]]:
        """The Mamba states vLLM's core hands over in this step (its
        ``boundary_state_offloads``: per request ``(group, block, boundary
        tokens)``), as the scheduler core takes them: the requests this
        connector tracks, the offloaded groups in kvoffload's numbering."""
        block_state = getattr(so, "kv_connector_block_state", None)
        handoffs = getattr(block_state, "boundary_state_offloads", None) if block_state is not None else None
        if not handoffs or not self.windows:
            return []
        ours = {g: i for i, g in enumerate(self.group_ids)}
        return [
            (rid, ours[g], int(block), int(boundary))
            for rid, entries in handoffs.items()
            if rid in self.requests
            for g, block, boundary in entries
            if g in ours
        ]

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        meta = out.kv_connector_worker_meta
        if not isinstance(meta, KvOffloadWorkerMetadata):
            return
        if meta.completed or meta.failed:
            _, _, rejected = self.core.on_worker_output(meta.completed, sorted(meta.failed))
            for r in rejected:
                logger.warning("kvoffload: rejected worker report %s", r)
        for key, n in meta.remote.items():
            name = _REMOTE_WORKER_COUNTERS.get(key)
            if name is not None and n:
                self.stats.increase_counter(name, n)
        for key, n in meta.placement.items():
            self.placement[key] = self.placement.get(key, 0) + n
        for name, (b, t, sizes) in meta.stats.items():
            if not (b or t or sizes):
                continue
            prefix = _LOAD if name == "load" else _STORE
            self.stats.increase_counter(f"{prefix}_bytes", b)
            self.stats.increase_counter(f"{prefix}_time", t)
            _observe_all(self.stats, f"{prefix}_size", sizes)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        if rid not in self.requests:
            return False, None
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        self.core.request_finished(
            rid, [int(b) for b in block_ids], aborted, int(request.num_computed_tokens)
        )
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """``request_finished`` with several KV groups (vLLM's
        ``SupportsHMA``): the blocks freed are not what is stored."""
        return self.request_finished(request, self._offloaded(block_ids)[0] if block_ids else [])

    def _note_left_out(self, per_group: Any) -> None:
        """Tells the core of the blocks vLLM allocated to the groups left out
        (vLLM's per-group lists): a store still reading one is flushed before
        the model writes it, as for any block allocated again."""
        new = [int(b) for g in self.left_out for b in per_group[g]]
        if new:
            self.core.note_allocated(new)

    def _offloaded(self, per_group: Any) -> Any:
        """vLLM's per-group lists (one per KV group) narrowed to the
        offloaded groups, in kvoffload's group order."""
        if self.selected is None:
            return per_group
        return tuple(per_group[i] for i in self.selected)

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's KV events for the host tier: a ``BlockStored`` per stored
        chunk and a ``BlockRemoved`` per eviction. By default (vLLM's
        placeholder payload) each names a chunk by the hash of its last
        block; with ``self_describing_kv_events`` a stored chunk carries its
        block hashes, tokens, parent hash, LoRA and KV group kind, and its
        removal names the same block hashes (vLLM's ``OffloadingEventsTracker``).
        Built as one list (the binding hands consecutive stores over as one
        run): a steady decode step stores a chunk per request every block."""
        if not self.publish:
            return []
        specs = self.event_specs
        bpc = self.cfg.blocks_per_chunk
        convert = block_hash_converter()
        identity = convert is _hash_as_bytes
        out: list[KVCacheEvent] = []
        for removed, group, items in self.core.take_events():
            spec = specs[group] if specs is not None else None
            kind = spec.kv_cache_spec_kind if spec is not None else None
            window = spec.kv_cache_spec_sliding_window if spec is not None else None
            # Events name vLLM's group index (a group left out shifts ours).
            vllm_group = self.group_ids[group] if group < len(self.group_ids) else group
            if removed:
                out.append(
                    BlockRemoved(
                        block_hashes=items if identity else [convert(h) for h in items],
                        medium="CPU",
                        group_idx=vllm_group,
                    )
                )
            elif not self.self_describing:
                out.extend(
                    [_placeholder_stored(h if identity else convert(h), kind, window, vllm_group) for h in items]
                )
            else:
                # The group's own block (vLLM's events carry each group's).
                tpb = self.group_chunk_tokens[group] // bpc if group < len(self.group_chunk_tokens) else 0
                out.extend(self._stored_payloads(items, convert, kind, window, tpb, vllm_group))
        return out

    @staticmethod
    def _stored_payloads(
        items: list, convert: Callable[[bytes], Any], kind: Any, window: Any, tpb: int, group: int
    ) -> Iterable[KVCacheEvent]:
        """Self-describing ``BlockStored`` events: a chunk's payload tuple, or
        a placeholder for a chunk without one."""
        for item in items:
            if isinstance(item, tuple):
                hashes, parent, tokens, lora_id, lora_name = item[:5]
                # A partial tail's payload carries its own block size (the
                # hash unit: its hashes end inside the block).
                block_size = item[5] if len(item) > 5 else tpb
                yield BlockStored(
                    block_hashes=[convert(h) for h in hashes],
                    parent_block_hash=convert(parent) if parent is not None else None,
                    token_ids=tokens,
                    block_size=block_size,
                    lora_id=lora_id,
                    medium="CPU",
                    lora_name=lora_name,
                    extra_keys=None,
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
                continue
            yield _placeholder_stored(convert(item), kind, window, group)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's stats payload for the step (its names and what each holds),
        plus kvoffload's stall metrics."""
        st = self.core.take_stats()
        out, self.stats = self.stats, OffloadingConnectorStats()
        _observe_all(out, _LOOKUP_SYNC_DELAY, st["lookup_sync_delays"])
        _observe_all(out, _LOOKUP_ASYNC_DELAY, st["lookup_async_delays"])
        if st["allocation_failures"]:
            out.increase_counter(_ALLOCATION_FAILURE, st["allocation_failures"])
        out.set_gauge(_CPU_USAGE, st["usage"])
        _observe_all(out, _CPU_ALLOCATION_SIZE, st["allocation_sizes"])
        out.set_gauge(_CPU_WRITE_USAGE, st["write_usage"])
        out.set_gauge(_CPU_READ_USAGE, st["read_usage"])
        if self.cfg.store_threshold >= 2:
            out.increase_counter(_STORES_SKIPPED, st["stores_skipped"])
        if st["stalled_stores"]:
            out.increase_counter("vllm:kv_offload_stalled_transfers", st["stalled_stores"], ("GPU_to_CPU",))
        if st["stalled_loads"]:
            out.increase_counter("vllm:kv_offload_stalled_transfers", st["stalled_loads"], ("CPU_to_GPU",))
        if st["late_reports"]:
            out.increase_counter("kvoffload_late_reports", st["late_reports"])
        out.set_gauge("kvoffload_stalled_jobs", st["stalled_jobs"])
        out.set_gauge("kvoffload_quarantined_chunks", st["quarantined_chunks"])
        remote = self.core.remote_stats()
        if remote is not None:
            for key, n in _increments(remote, self.remote_last, _REMOTE_LOOKUP_COUNTERS).items():
                out.increase_counter(_REMOTE_LOOKUP_COUNTERS[key], n)
            out.set_gauge("kvoffload_remote_connected", int(remote["tier"]["connected"]))
        if self.placement:
            for key, name in _PLACEMENT_GAUGES.items():
                out.set_gauge(name, self.placement.get(key, 0))
        if not self.info_sent:
            out.set_info([self.info])
            self.info_sent = True
        return out


class _WorkerSide:
    """The worker role: vLLM's KV tensors mapped onto kvoffload's layouts."""

    def __init__(self, cfg: EngineConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        #: The remote worker counters already reported.
        self.remote_last: dict[str, int] = {}
        self.core: WorkerCore | None = None
        # The CUDA stream transfers are ordered after (kept alive here).
        self.stream: Any = None
        self.tensors: list[torch.Tensor] = []
        self.meta = KvOffloadWorkerMetadata()
        # Load jobs started, with their request; whether the request was reported.
        self.loads: dict[int, str] = {}
        self.loads_of: dict[str, int] = {}
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        # Loads the scheduler declared failed or stalled, still in flight.
        self.abandoned: set[int] = set()
        # Synchronous loads in flight, with their GPU blocks; the blocks of
        # those that failed, for vLLM to recompute (invalid_block_ids).
        self.sync_blocks: dict[int, list[int]] = {}
        self.invalid_blocks: set[int] = set()
        #: Whether the shared host region's name is still to be removed.
        self.region_to_unlink = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        # The offloaded groups' layers (a group vLLM does not cache, such as
        # a circular buffer, is never moved), as vLLM's worker selects them.
        groups = kv_offloaded_groups(self.kv_cache_config)
        regions: list[tuple[int, int, int]] = []
        # Layers whose views start at one address with one block stride share
        # a region: vLLM overlays the KV groups' layers on the same tensors
        # (a block belongs to one group at a time), as its own worker does.
        region_of: dict[tuple[int, int], int] = {}
        #: Per KV group, the regions of its layers (a job moves each group's
        #: blocks over its own regions).
        group_regions: list[list[int]] = []
        devices = set()
        #: Per region, how its page holds the KV heads (KV heads as remote shares).
        head_pages: dict[int, tuple[str, int, int, int, int]] = {}
        for group in groups:
            mine: list[int] = []
            for name in group.layer_names:
                # A group of layers of one kind and different page sizes
                # (DeepSeek V3.2's MLA and its indexer) keeps each layer's
                # spec on the workers: its page is the layer's, not the
                # group's (the sum over its layers), as vLLM's worker reads it.
                layer_spec = kv_layer_spec(group.kv_cache_spec, name)
                page = layer_spec.page_size_bytes
                t = group_kernel_blocks(kv_caches[name], num_blocks)
                devices.add(t.device)
                # A Mamba layer's states fill its page, block after block
                # (vLLM's worker takes its page as the block stride).
                stride = (
                    t.stride(0) * t.element_size() if isinstance(layer_spec, AttentionSpec) else page
                )
                base = t.data_ptr()
                r = region_of.get((base, stride))
                if r is None:
                    r = region_of[(base, stride)] = len(regions)
                    regions.append((base, stride, page))
                    self.tensors.append(t)
                elif regions[r][2] != page:
                    raise ValueError(
                        f"kvoffload.vllm: layer {name} overlays another KV group's layer with a "
                        f"different page size ({page} and {regions[r][2]} bytes)"
                    )
                if r not in mine:
                    mine.append(r)
                if self.cfg.remote_head_shares:
                    hp = _head_page(t, layer_spec, num_blocks)
                    if hp is None or head_pages.setdefault(r, hp) != hp:
                        raise RuntimeError(
                            f"kvoffload.vllm: canonical_layout with a remote tier keeps a chunk as its KV "
                            f"heads, but the KV cache of layer {name} (shape {tuple(t.shape)}, strides "
                            f"{t.stride()}) is not a layout whose heads it knows; remove canonical_layout "
                            "from kv_connector_extra_config"
                        )
            group_regions.append(mine)
        if len(devices) != 1:
            raise ValueError(f"kvoffload.vllm: the KV cache tensors are on several devices: {devices}")
        device = devices.pop()
        args = (regions, num_blocks, self.cfg.blocks_per_chunk, self.cfg.num_cpu_chunks, False)
        grouping = group_regions if len(groups) > 1 else None
        # Replicated KV (`_replicated_layout`): one host region every worker
        # maps, every rank loading from it. By default the ranks write the
        # stores by turns of host chunk (each chunk once, its writer also
        # putting and fetching it); with ``replicated_writes: "vllm"``, as
        # vLLM's workers: rank 0 (every rank with ``canonical_layout``, the
        # same bytes).
        shared: dict[str, Any] = {}
        needs_rank = self.cfg.replicated_layout or self.cfg.remote_tier_json is not None
        rank = _worker_rank(self.cfg.world_size) if needs_rank else 0
        turns = (
            self.cfg.replicated_layout and self.cfg.replicated_writes == "turns" and self.cfg.world_size > 1
        )
        if self.cfg.replicated_layout:
            shared = {
                "shared_region": shared_region_path(_shared_region_name(self.vllm_config)),
                "store_writer": self.cfg.canonical_layout or rank == 0,
            }
            if turns:
                shared["store_turn"] = (rank, self.cfg.world_size)
        if device.type == "cpu":
            self.core = WorkerCore.host(*args, groups=grouping, numa=self.cfg.host_numa_node, **shared)
        elif device.type == "cuda":
            # Stores read blocks the model wrote on this stream: they are
            # ordered after its work (the CUDA backend records an event on it).
            self.stream = torch.cuda.current_stream(device)
            self.core = WorkerCore.cuda(
                *args,
                device.index or 0,
                self.stream.cuda_stream,
                self.cfg.strategy_table,
                groups=grouping,
                # The pool on the GPU's NUMA node (`host_numa_node`).
                numa=self.cfg.host_numa_node,
                **shared,
            )
        else:
            raise NotImplementedError(
                f"kvoffload.vllm: KV caches on {device.type} (supported: cpu, cuda)"
            )
        try:
            # With replicated KV a chunk has one share: its writer (the
            # chunk's turn, or rank 0 with vLLM's writers) puts and fetches
            # it; the others read the shared region it fills.
            if self.cfg.remote_head_shares:
                # KV heads as shares: this worker puts and fetches its heads'.
                self.core.attach_remote_heads(
                    self.cfg.remote_tier_json,
                    _remote_namespace(self.vllm_config, self.kv_cache_config, self.cfg),
                    [head_pages[r] for r in range(len(regions))],
                    self.cfg.remote_head_shares,
                    self.cfg.world_size,
                    rank,
                )
            elif self.cfg.remote_tier_json is not None and (not self.cfg.replicated_layout or rank == 0 or turns):
                self.core.attach_remote(
                    self.cfg.remote_tier_json,
                    _remote_namespace(self.vllm_config, self.kv_cache_config, self.cfg),
                    0 if self.cfg.replicated_layout else rank,
                    self.cfg.remote_shares,
                )
            # The shared region's name goes once every worker has mapped it
            # (vLLM's world group, as its own region waits), so that its
            # memory goes with the last worker however the engine ends;
            # without vLLM's groups (workers in one process), at the first
            # step (vLLM runs none before every worker registered).
            self.region_to_unlink = bool(shared) and not _all_workers_barrier()
            if shared and not self.region_to_unlink:
                self.core.unlink_shared_region()
        except BaseException:
            if shared:
                # The engine does not start: leave no region behind.
                self.core.unlink_shared_region()
            raise
        logger.info(
            "kvoffload: %d KV tensors (%d KV groups) on %s, %d blocks, host pool of %d chunks "
            "(%d bytes, %s backend%s)",
            len(regions),
            len(groups),
            device,
            num_blocks,
            self.cfg.num_cpu_chunks,
            self.core.pool_bytes,
            self.core.backend,
            f", shared region {self.core.shared_region}, "
            + (
                f"writing its turn of chunks ({self.core.store_turn[0]} of {self.core.store_turn[1]})"
                if self.core.store_turn
                else "writing it"
                if self.core.store_writer
                else "reading it"
            )
            if self.core.shared_region
            else "",
        )
        # Where the pool's pages went (`host_numa_node`); a warning where
        # some are on another node than the one it was placed on.
        placement = self.core.host_placement
        (logger.warning if placement["elsewhere"] else logger.info)(
            "kvoffload: host pool NUMA placement: %s", placement["summary"]
        )
        # For the scheduler's gauges, in the first report.
        self.meta.placement = {
            "pools": 1,
            "placed": int(placement["node"] is not None),
            **{k: int(placement[k]) for k in ("sampled", "elsewhere", "copy_threads_on_node")},
        }

    def bind(self, meta: KvOffloadMetadata) -> None:
        assert self.core is not None, "register_kv_caches first"
        if self.region_to_unlink:
            # vLLM runs no step before every worker has registered its KV
            # caches, so every worker has mapped the shared region by now:
            # its name goes (the memory goes with the last worker).
            self.region_to_unlink = False
            try:
                self.core.unlink_shared_region()
            except RuntimeError as e:
                logger.warning("kvoffload: %s", e)
        self.core.bind(meta.plan)
        self.sync_blocks.update(self.core.sync_loads())
        for job, req in meta.load_requests.items():
            if job in self.sync_blocks:
                # Its request runs in this step already: no finished load.
                continue
            self.loads[job] = req
            self.loads_of[req] = job
        # Loads the scheduler gave up on (stalled): once the transfer can no
        # longer write the request's GPU blocks, vLLM is told the load failed
        # (finished and failed: it recomputes those tokens). A transfer that
        # has not started is cancelled now and reported as failed (the
        # scheduler's late report); one that is under way is reported when it
        # ends, so no late write can land in blocks vLLM recomputes or reuses.
        for req in meta.failed_loads:
            job = self.loads_of.get(req)
            if job is None:
                continue
            self.abandoned.add(job)
            if self.core.cancel(job):
                self._end_load(job, failed=True)
                self.meta.completed[job] = self.meta.completed.get(job, 0) + 1
                self.meta.failed.add(job)

    def _end_load(self, job: int, failed: bool) -> None:
        req = self.loads.pop(job, None)
        if req is None:
            return
        self.loads_of.pop(req, None)
        self.finished_recving.add(req)
        if failed or job in self.abandoned:
            self.failed_recving.add(req)
        self.abandoned.discard(job)

    def handle_preemptions(self, meta: KvOffloadMetadata) -> None:
        self.bind(meta)
        assert self.core is not None
        self.core.handle_preemptions()

    def start_load_kv(self) -> None:
        assert self.core is not None
        self.core.start_transfers()

    def wait_for_save(self) -> None:
        assert self.core is not None
        self.core.queue_stores()

    def get_finished(self) -> tuple[set[str], set[str]]:
        assert self.core is not None
        completed, failed, stats = self.core.get_finished()
        for job, n in completed.items():
            self.meta.completed[job] = self.meta.completed.get(job, 0) + n
            if job in self.loads:
                self._end_load(job, failed=job in failed)
            blocks = self.sync_blocks.pop(job, None)
            if blocks is not None and job in failed:
                # A synchronous load's request computed over these blocks in
                # this step: vLLM recomputes from the first one (or fails the
                # request, per its kv_load_failure_policy).
                self.invalid_blocks.update(blocks)
        self.meta.failed.update(failed)
        for name, (b, t, sizes) in stats.items():
            if b or sizes:
                mine = self.meta.stats.setdefault(name, [0, 0.0, []])
                mine[0] += b
                mine[1] += t
                mine[2].extend(sizes)
        remote = self.core.remote_stats()
        if remote is not None:
            for key, n in _increments(remote, self.remote_last, _REMOTE_WORKER_COUNTERS).items():
                self.meta.remote[key] = self.meta.remote.get(key, 0) + n
        recv, self.finished_recving = self.finished_recving, set()
        return set(), recv

    def take_failed_recving(self) -> set[str]:
        out, self.failed_recving = self.failed_recving, set()
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self.invalid_blocks = self.invalid_blocks, set()
        return out

    def build_connector_worker_meta(self) -> KvOffloadWorkerMetadata | None:
        if not (self.meta.completed or self.meta.stats or self.meta.remote or self.meta.placement):
            return None
        out, self.meta = self.meta, KvOffloadWorkerMetadata()
        return out


class KvOffloadPromMetrics(OffloadPromMetrics):
    """vLLM's ``kv_offload`` Prometheus metrics, plus kvoffload's stall metrics."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        for name, metadata in {**STALL_METRICS, **REMOTE_METRICS, **PLACEMENT_METRICS}.items():
            self._offloading_metric_metadata[name] = metadata
            self._offloading_metric_defs[name] = self._create_metric(name, metadata)


class KvOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface, served by kvoffload.

    It declares ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on
    for it, and a model of full-attention, sliding-window and chunked-local
    attention layers (``kv_group_windows``; Gemma 3, gpt-oss, Llama 4) is offloaded group by group, as vLLM's own
    ``OffloadingConnector`` does."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = _engine_config(vllm_config, kv_scheduler_view(kv_cache_config))
        self.engine_config = cfg
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(cfg, vllm_config, kv_cache_config)
        else:
            self._worker = _WorkerSide(cfg, vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is a later miss.
        return False

    # ---------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None and isinstance(kv_connector_metadata, KvOffloadMetadata)
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads, and the loads that failed or stalled (those are in
        both sets: vLLM then recomputes their tokens)."""
        assert self._worker is not None
        _, recving = self._worker.get_finished()
        return KVConnectorTransferResults(
            finished_recving=recving, failed_recving=self._worker.take_failed_recving()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The GPU blocks of synchronous loads that failed, reported in the
        step they were detected (vLLM recomputes them, or fails their
        requests, per ``kv_load_failure_policy``)."""
        if self._worker is None:
            return set()
        return self._worker.take_invalid_blocks()

    def build_connector_worker_meta(self) -> KvOffloadWorkerMetadata | None:
        if self._worker is None:
            return None
        return self._worker.build_connector_worker_meta()

    # ------------------------------------------------------------- scheduler
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA`` hook: a request finished, with its blocks
        in every KV group."""
        assert self._scheduler is not None
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        assert self._scheduler is not None
        return self._scheduler.take_events()

    def reset_cache(self) -> bool | None:
        assert self._scheduler is not None
        self._scheduler.core.reset()
        return True

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.core.has_pending_work()

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        if self._scheduler is None:
            return None
        return self._scheduler.get_stats()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Blocks first in every layer's tensor, as vLLM's own offloading needs.
        return "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadingConnectorStats:
        return OffloadingConnectorStats(data=data) if data is not None else OffloadingConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -------------------------------------------------------------- testing
    def scheduler_state(self) -> dict[str, Any]:
        """The engine's state (jobs, requests, stalled jobs, quarantined and
        pinned chunks, invariants): for tests and leak checks."""
        assert self._scheduler is not None
        return self._scheduler.core.state()
