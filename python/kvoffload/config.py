"""The connector's configuration: vLLM's OffloadingConnector extra-config
keys (same names, same meanings), plus kvoffload's stall keys, turned into the
engine configuration the Rust library validates.

An unknown key, or a value of the wrong type or range, raises ``ValueError``
naming the key, so a typo stops vLLM at startup instead of being ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# Host chunks are aligned to the host page, as vLLM's CPU offloading aligns
# them (SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT is mmap.PAGESIZE).
try:
    import mmap

    HOST_PAGE = mmap.PAGESIZE
except Exception:  # pragma: no cover - every supported platform has mmap
    HOST_PAGE = 4096

#: Keys of ``kv_connector_extra_config`` this connector takes, with their meaning.
KEYS: dict[str, str] = {
    "cpu_bytes_to_use": "bytes of host memory for the offloaded KV cache, all workers together (vLLM's key; required unless num_cpu_chunks is given)",
    "num_cpu_chunks": "host chunks, instead of cpu_bytes_to_use",
    "block_size": "tokens per offloaded chunk, a multiple of the GPU block size (vLLM's key)",
    "blocks_per_chunk": "GPU blocks per offloaded chunk (vLLM's key; excludes block_size)",
    "eviction_policy": '"lru" (default) or "arc" (vLLM\'s key)',
    "store_threshold": "offers a chunk needs before it is stored; < 2 stores at once (vLLM's key)",
    "max_tracker_size": "entries the reuse filter tracks (vLLM's key, default 64000)",
    "offload_prompt_only": "store only prompt tokens (vLLM's key, default true)",
    "stall_timeout_s": "seconds after which a transfer job is declared stalled (kvoffload; default 300)",
    "stall_scan_interval_s": "seconds between the stall watchdog's scans (kvoffload; default 10)",
    "spec_name": 'accepted for compatibility only as "CPUOffloadingSpec"',
    "self_describing_kv_events": "KV events carry each stored chunk's block hashes, tokens, parent hash and LoRA, as vLLM's (vLLM's key, default false: each chunk's key hash only)",
    "strategy_table": "path of a CUDA strategy table written by `kvoffload bench --calibrate` (kvoffload; CUDA KV caches; default: the built-in table)",
    "sync_load_budget_bytes": "KV bytes per worker a step may load synchronously: a hit that fits is loaded inside the step and its request runs at once (vLLM's key, default 0: every load asynchronous)",
    "canonical_layout": "vLLM's key (default false): a parallelism-free host page layout; with vLLM's CPU spec it changes who keeps one copy of replicated MLA KV (vLLM's replicated_layout rule for canonical pages) and lets every worker write its stores",
    "replicated_writes": '"turns" (kvoffload; default) or "vllm": who copies the stores of KV replicated on every worker into the one host region they share: "turns", the workers by turns of host chunk (each chunk once, its traffic spread over every GPU\'s link); "vllm", vLLM\'s writers (rank 0 alone, or every rank with canonical_layout)',
    "host_numa_node": '"auto" (kvoffload; default), "off", or a NUMA node number: where each worker\'s host pool goes. "auto": where the machine has several nodes, the node of the worker\'s GPU (where the GPU names one), or with CPU KV caches the node holding most of their pages (elsewhere wherever the kernel puts it); "off": wherever the kernel puts it, as vLLM; a number: that node (an error where it is not online or the system refuses the binding)',
    "remote_tier": "a Redis (or Redis Cluster) store shared across nodes, as a dict (or its JSON) of the remote tier's keys (docs/remote-tier.md: url, cluster, username, password, tls_ca_file, timeouts, write, ...) plus 'deployment', a text kept in the namespace (kvoffload; default: no remote tier)",
}

#: vLLM 0.33.0 keys of ``kv_connector_extra_config`` this connector does not
#: take, with the reason it gives (an unknown key otherwise).
VLLM_KEYS_NOT_TAKEN: dict[str, str] = {
    "cache_policy_module_path": "a Python eviction policy class runs inside vLLM's CPUOffloadingManager; "
    'kvoffload\'s host tier is Rust: eviction_policy takes "lru" or "arc"',
    "spec_module_path": "an out-of-tree offloading spec; kvoffload is its own offloading engine (leave it out)",
    "secondary_tiers": "a key of vLLM's TieringOffloadingSpec; kvoffload's tier past host memory is "
    "remote_tier (a Redis or Redis Cluster store, docs/remote-tier.md)",
    "tier_poll_interval_s": "a key of vLLM's TieringOffloadingSpec; kvoffload's remote_tier runs its own I/O "
    "threads (docs/remote-tier.md)",
    "backpressure": "a key of vLLM's TieringOffloadingSpec; kvoffload's remote_tier bounds its writes with "
    "its queue_capacity (a put that finds the queue full is dropped and counted, never waited for)",
    "enable_telemetry": "a key of vLLM's tiering (kvcr) manager; kvoffload's metrics are always on "
    "(vLLM's kv_offload names, docs/vllm-connector.md)",
}

#: The connector's own key inside ``remote_tier`` (the rest go to the Rust
#: library, which rejects unknown ones).
REMOTE_DEPLOYMENT_KEY = "deployment"


def _int(extra: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = extra.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"kv_connector_extra_config: {key} = {v!r} is not an integer")
    try:
        f = float(v)
    except ValueError:
        raise ValueError(f"kv_connector_extra_config: {key} = {v!r} is not an integer") from None
    if not math.isfinite(f) or f != int(f):
        raise ValueError(f"kv_connector_extra_config: {key} = {v!r} is not an integer")
    n = int(f)
    if n < lo or (hi is not None and n > hi):
        allowed = f"{lo}.." + ("" if hi is None else f"={hi}")
        raise ValueError(f"kv_connector_extra_config: {key} = {v!r} is out of range: allowed {allowed}")
    return n


def _seconds(extra: dict[str, Any], key: str) -> int | None:
    v = extra.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"kv_connector_extra_config: {key} = {v!r} must be a positive number of seconds")
    return max(1, round(v * 1000))


def _bool(extra: dict[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"kv_connector_extra_config: {key} = {v!r} is not a boolean")


def canonical_layout(extra: dict[str, Any]) -> bool:
    """``canonical_layout`` of ``kv_connector_extra_config`` (a boolean)."""
    return _bool(extra, "canonical_layout", False)


def _replicated_writes(extra: dict[str, Any]) -> str:
    v = extra.get("replicated_writes", "turns")
    if v not in ("turns", "vllm"):
        raise ValueError(
            f'kv_connector_extra_config: replicated_writes = {v!r} is not allowed: allowed "turns", "vllm"'
        )
    return v


def _host_numa_node(extra: dict[str, Any]) -> str:
    v = extra.get("host_numa_node")
    if v is None:
        return "auto"
    if v in ("auto", "off"):
        return v
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1024:
        return str(v)
    if isinstance(v, str) and v.isascii() and v.isdigit() and int(v) < 1024:
        return str(int(v))
    raise ValueError(
        f'kv_connector_extra_config: host_numa_node = {v!r} is not allowed: allowed "auto", "off", '
        "or a NUMA node number (0..1023)"
    )


def _strategy_table(extra: dict[str, Any]) -> str | None:
    v = extra.get("strategy_table")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ValueError(f"kv_connector_extra_config: strategy_table = {v!r} is not a file path")
    from kvoffload._native import check_strategy_table

    try:
        check_strategy_table(v)
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config: strategy_table = {v!r}: {e}") from None
    return v


def _remote_tier(extra: dict[str, Any]) -> tuple[str | None, str]:
    """The remote tier's configuration as the library's JSON (checked now:
    a bad key or value raises naming it, never a password), and the
    deployment text; ``(None, "")`` without one."""
    v = extra.get("remote_tier")
    if v is None:
        return None, ""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: remote_tier is not valid JSON: {e}") from None
    if not isinstance(v, dict):
        raise ValueError(
            f"kv_connector_extra_config: remote_tier must be a dict of the remote tier's keys, not {type(v).__name__}"
        )
    v = dict(v)
    deployment = v.pop(REMOTE_DEPLOYMENT_KEY, "")
    if not isinstance(deployment, str):
        raise ValueError(
            f"kv_connector_extra_config: remote_tier.{REMOTE_DEPLOYMENT_KEY} = {deployment!r} is not a string"
        )
    from kvoffload._native import check_remote_config

    text = json.dumps(v)
    try:
        check_remote_config(text)
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config: remote_tier: {e}") from None
    return text, deployment


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration for one vLLM deployment."""

    tokens_per_block: int
    blocks_per_chunk: int
    num_cpu_chunks: int
    world_size: int
    eviction_policy: str
    store_threshold: int
    max_tracker_size: int
    offload_prompt_only: bool
    stall_timeout_ms: int | None
    stall_scan_interval_ms: int | None
    #: Bytes of one chunk on one worker (all its layers), unaligned.
    worker_chunk_bytes: int
    #: Bytes of one chunk in host memory, every worker's part, aligned to the
    #: host page (vLLM's ``kv_bytes_per_chunk``).
    host_chunk_bytes: int = 0
    #: The CUDA strategy table file (checked when the configuration is read),
    #: or None for the built-in table.
    strategy_table: str | None = None
    #: The remote tier's configuration (the library's JSON keys), or None.
    remote_tier_json: str | None = field(default=None, repr=False)
    #: A text the operator adds to the remote tier's namespace.
    remote_deployment: str = ""
    #: KV events carry each chunk's block hashes, tokens, parent and LoRA
    #: (vLLM's ``self_describing_kv_events``; effective with KV events on).
    self_describing_kv_events: bool = False
    #: KV bytes per worker a step may load synchronously (0: none), and the
    #: bytes per token it counts (vLLM's page bytes x layers / block tokens).
    sync_load_budget_bytes: int = 0
    kv_bytes_per_token: int = 0
    #: One copy of each chunk in a host region every worker maps (KV
    #: replicated on every worker: vLLM's ``replicated_layout``), not one per
    #: worker: a chunk takes one worker's part of host memory, rank 0 writes
    #: it and every rank loads from it.
    replicated_layout: bool = False
    #: vLLM's ``canonical_layout``: the replicated decision above follows
    #: vLLM's rule for canonical pages, and every worker writes its stores
    #: (vLLM's ``_is_store_writer``), rank 0 alone no longer.
    canonical_layout: bool = False
    #: Who copies the stores of replicated KV (``replicated_layout``):
    #: ``"turns"``, the workers by turns of host chunk (each chunk once, by
    #: the worker whose turn it is, which also puts and fetches it);
    #: ``"vllm"``, vLLM's writers (rank 0, or every rank with
    #: ``canonical_layout``).
    replicated_writes: str = "turns"
    #: Where each worker's host pool goes: ``"auto"`` (its GPU's NUMA node,
    #: or its CPU KV caches', where there are several), ``"off"``, or a node
    #: number (as text).
    host_numa_node: str = "auto"
    #: With ``canonical_layout`` and a remote tier over a layout whose heads
    #: tensor parallelism shards (vLLM's parallelism-agnostic layouts): the
    #: model's KV heads, the shares of a chunk in the store, so that nodes
    #: of other tensor-parallel sizes read it (0: one share a worker).
    remote_head_shares: int = 0

    @property
    def remote_shares(self) -> int:
        """The shares of a chunk in a remote tier: one a worker, one for
        every worker where they hold the same bytes (rank 0 puts and fetches
        it), or one a KV head (`remote_head_shares`)."""
        if self.remote_head_shares:
            return self.remote_head_shares
        return 1 if self.replicated_layout else self.world_size

    def to_json(self) -> str:
        """The configuration in the Rust library's keys."""
        d: dict[str, Any] = {
            "tokens_per_block": self.tokens_per_block,
            "blocks_per_chunk": self.blocks_per_chunk,
            "num_cpu_chunks": self.num_cpu_chunks,
            "world_size": self.world_size,
            "eviction_policy": self.eviction_policy,
            "store_threshold": self.store_threshold,
            "max_tracker_size": self.max_tracker_size,
            "offload_prompt_only": self.offload_prompt_only,
        }
        if self.stall_timeout_ms is not None:
            d["stall_timeout_ms"] = self.stall_timeout_ms
        if self.stall_scan_interval_ms is not None:
            d["stall_scan_interval_ms"] = self.stall_scan_interval_ms
        if self.sync_load_budget_bytes:
            d["sync_load_budget_bytes"] = self.sync_load_budget_bytes
            d["sync_load_bytes_per_token"] = self.kv_bytes_per_token
        return json.dumps(d)

    @staticmethod
    def from_extra(
        extra: dict[str, Any],
        *,
        tokens_per_block: int,
        world_size: int,
        worker_bytes_per_block: int,
        kv_bytes_per_token: int = 0,
        replicated_layout: bool = False,
        remote_head_shares: int = 0,
    ) -> "EngineConfig":
        """From ``kv_connector_extra_config`` and what vLLM knows of the engine:
        the GPU block size in tokens, the workers, one worker's KV bytes per
        GPU block (all its layers), the KV bytes per token vLLM counts
        against ``sync_load_budget_bytes`` (default: per block / tokens), and
        whether every worker holds the same KV (``replicated_layout``: one
        copy of a chunk in host memory, as vLLM's, and one share of it in a
        remote tier); `remote_head_shares`: the model's KV heads where they
        are a remote tier's shares (taken only with a remote tier)."""
        # vLLM's keys it does not take, set to None (vLLM's default for them), are absent.
        extra = {k: v for k, v in extra.items() if not (k in VLLM_KEYS_NOT_TAKEN and v is None)}
        unknown = sorted(set(extra) - set(KEYS))
        for key in unknown:
            if key in VLLM_KEYS_NOT_TAKEN:
                raise ValueError(
                    f"kv_connector_extra_config: {key!r} is not supported: {VLLM_KEYS_NOT_TAKEN[key]}"
                )
        if unknown:
            allowed = ", ".join(sorted(KEYS))
            raise ValueError(
                f"kv_connector_extra_config: unknown key {unknown[0]!r} (allowed: {allowed})"
            )
        spec = extra.get("spec_name", "CPUOffloadingSpec")
        if spec != "CPUOffloadingSpec":
            raise ValueError(
                f"kv_connector_extra_config: spec_name = {spec!r} is not supported: "
                "kvoffload is its own offloading engine (leave spec_name out)"
            )
        if "block_size" in extra and "blocks_per_chunk" in extra:
            raise ValueError(
                "kv_connector_extra_config: specify only one of 'block_size' or 'blocks_per_chunk'"
            )
        bpc = _int(extra, "blocks_per_chunk", 1, 1 << 20)
        chunk_tokens = _int(extra, "block_size", 1)
        if chunk_tokens is not None:
            if chunk_tokens % tokens_per_block:
                up = -(-chunk_tokens // tokens_per_block) * tokens_per_block
                raise ValueError(
                    f"kv_connector_extra_config: block_size = {chunk_tokens} must be a multiple "
                    f"of the GPU KV cache block size ({tokens_per_block} tokens); use {up}, or "
                    "set blocks_per_chunk"
                )
            bpc = chunk_tokens // tokens_per_block
        bpc = bpc or 1
        policy = extra.get("eviction_policy", "lru")
        if policy not in ("lru", "arc"):
            raise ValueError(
                f'kv_connector_extra_config: eviction_policy = {policy!r} is not allowed: allowed "lru", "arc"'
            )
        worker_chunk_bytes = worker_bytes_per_block * bpc
        chunks = _int(extra, "num_cpu_chunks", 1, (1 << 32) - 2)
        cpu_bytes = _int(extra, "cpu_bytes_to_use", 1)
        remote, deployment = _remote_tier(extra)
        # As vLLM's CPU offloading: a chunk holds every worker's part (one
        # part where every worker holds the same bytes), aligned to the host
        # page.
        copies = 1 if replicated_layout else world_size
        per_chunk = -(-worker_chunk_bytes * copies // HOST_PAGE) * HOST_PAGE
        if chunks is not None and cpu_bytes is not None:
            raise ValueError(
                "kv_connector_extra_config: specify only one of 'cpu_bytes_to_use' or 'num_cpu_chunks'"
            )
        if chunks is None:
            if cpu_bytes is None:
                raise ValueError("kv_connector_extra_config: cpu_bytes_to_use must be specified")
            chunks = cpu_bytes // max(per_chunk, 1)
            if chunks < 1:
                raise ValueError(
                    f"kv_connector_extra_config: cpu_bytes_to_use = {cpu_bytes} holds no chunk "
                    f"(one chunk takes {per_chunk} bytes)"
                )
        threshold = _int(extra, "store_threshold", 0, 1 << 31) or 0
        if threshold < 2:
            # vLLM: "a threshold of 1 equals no filter".
            threshold = 0
        tracker = _int(extra, "max_tracker_size", 1, 1 << 40)
        table = _strategy_table(extra)
        return EngineConfig(
            tokens_per_block=tokens_per_block,
            blocks_per_chunk=bpc,
            num_cpu_chunks=chunks,
            world_size=world_size,
            eviction_policy=policy,
            store_threshold=threshold,
            max_tracker_size=tracker if tracker is not None else 64_000,
            offload_prompt_only=_bool(extra, "offload_prompt_only", True),
            stall_timeout_ms=_seconds(extra, "stall_timeout_s"),
            stall_scan_interval_ms=_seconds(extra, "stall_scan_interval_s"),
            worker_chunk_bytes=worker_chunk_bytes,
            host_chunk_bytes=per_chunk,
            strategy_table=table,
            remote_tier_json=remote,
            remote_deployment=deployment,
            self_describing_kv_events=_bool(extra, "self_describing_kv_events", False),
            sync_load_budget_bytes=_int(extra, "sync_load_budget_bytes", 0, 1 << 62) or 0,
            kv_bytes_per_token=kv_bytes_per_token or worker_bytes_per_block // max(tokens_per_block, 1),
            replicated_layout=replicated_layout,
            canonical_layout=canonical_layout(extra),
            replicated_writes=_replicated_writes(extra),
            host_numa_node=_host_numa_node(extra),
            remote_head_shares=remote_head_shares if remote is not None else 0,
        )
