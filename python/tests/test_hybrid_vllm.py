"""vLLM 0.33.0's own ``OffloadingConnector`` on hybrid KV cache configurations
(several KV groups: full attention with sliding-window groups, or sliding
windows only), recorded step by step as ``test_differential.py`` records a
run, and kept as a corpus (``corpus/hybrid/*.json.gz``); and kvoffload's
connector (its scheduler side) compared with it step by step.

kvoffload's connector declares ``SupportsHMA``: vLLM keeps its hybrid
manager on for it, and its scheduler plans several groups
(``Scheduler::with_groups``, docs/hybrid-groups.md). These runs are
scheduler-only (fake workers: ``test_hybrid_worker.py`` moves the bytes).
Per step the corpus holds the tokens scheduled, each
lookup's hit, each hit's split by source, each load's and store's GPU blocks
per group (with the group's first block index), the KV events, and what vLLM's connector saw inside (key
states, load and store inputs). The tests check that vLLM still answers as
recorded (a harness or vLLM change shows as a diff), that kvoffload answers
every recorded step as vLLM did, that the recorded runs exercise what the
plan needs (sliding-window loads and hits, stores of every group), and the
rules docs/hybrid-groups.md states, read off vLLM's answers rather than its
source: a hit leaves the last token to compute, loads are chunk-aligned, a
sliding-window group loads only its window.

``KVOFFLOAD_RECORD_HYBRID=1`` rewrites the corpus from vLLM (then review the
diff: it is vLLM's behaviour changing, or the harness).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import HEAD_SIZE, HEADS, build
import kvoffload._native as native
from test_differential import capture_events, kvoffload_worker, order_free, vllm_worker, with_vllm_flushes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import RequestStatus

TPB = 4
#: GPU blocks per KV group: a small cache, so turns leave it and come back
#: from the host tier (vLLM allocates every group's blocks for a prefill).
GPU_BLOCKS = 24
#: Host chunks (each one group's): room for most of a run, some eviction.
HOST_CHUNKS = 512
#: Requests per run.
REQUESTS = 100
#: Steps between a conversation's turns (a turn arrives once the previous
#: one has finished and stored).
TURN_GAP = 20
CORPUS = Path(__file__).parent / "corpus" / "hybrid"


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=TPB, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)


def window(tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=TPB, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32, sliding_window=tokens
    )


def window_retaining(tokens: int, extra: int) -> SlidingWindowSpec:
    """A sliding window keeping `extra` more tokens behind it (vLLM sets
    ``extra_retained_tokens`` with multi-module MTP)."""
    return dataclasses.replace(window(tokens), extra_retained_tokens=extra)


def local(tokens: int) -> ChunkedLocalAttentionSpec:
    """Chunked-local attention over aligned chunks of `tokens` tokens
    (Llama 4's local layers)."""
    return ChunkedLocalAttentionSpec(
        block_size=TPB, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32, attention_chunk_size=tokens
    )


def window_mla(tokens: int) -> SlidingWindowMLASpec:
    """A sliding window over MLA's latent vectors (DeepSeek V4's windowed
    layers; prefix-cacheable: no bounded replay), its page the size of the
    others'."""
    return SlidingWindowMLASpec(
        block_size=TPB, num_kv_heads=1, head_size=2 * HEADS * HEAD_SIZE, dtype=torch.float32, sliding_window=tokens
    )


def bounded_window_mla(tokens: int) -> SlidingWindowMLASpec:
    """A bounded-replay sliding window over MLA's latent vectors (DeepSeek
    V4.1's windowed layers): not prefix-cacheable, vLLM replays its window
    instead, and its connector leaves the group out."""
    return dataclasses.replace(window_mla(tokens), bounded_replay=True)


def ring() -> CircularBufferSpec:
    """A circular buffer of the keys still being compressed (one block a
    request, GLM-5.3-Flash's indexer tail): per-request scratch, not
    prefix-cacheable, left out by vLLM's connector."""
    return CircularBufferSpec(block_size=TPB, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)


def offloaded(specs: list[Any]) -> list[Any]:
    """The groups vLLM's connector offloads (its ``prefix_cacheable_group_ids``):
    the corpus's loads, stores, key states and shapes are theirs."""
    return [s for s in specs if s.prefix_cacheable]


def larger_blocks(spec: Any, block_size: int) -> Any:
    """`spec` with blocks of `block_size` tokens and its page size unchanged
    (fewer KV heads): vLLM grows a group of smaller pages to larger blocks,
    so that every group has one page size."""
    return dataclasses.replace(spec, block_size=block_size, num_kv_heads=spec.num_kv_heads * spec.block_size // block_size)


def mla() -> MLAAttentionSpec:
    """MLA (one latent vector a token), its page the size of the others'."""
    return MLAAttentionSpec(block_size=TPB, num_kv_heads=1, head_size=2 * HEADS * HEAD_SIZE, dtype=torch.float32)


# (seed, group specs by name, extra config, engine options, fake worker delay)
def mamba() -> MambaSpec:
    """A Mamba layer's recurrent state in vLLM's align mode (kept at block
    boundaries, as vLLM keeps it with prefix caching), its page the size of
    the others' (a conv state and an SSM state, 64 floats)."""
    return MambaSpec(
        block_size=TPB,
        shapes=((4, 4), (6, 8)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )


def mamba2() -> MambaSpec:
    """A Mamba2 layer's state (Nemotron-H, Granite 4, Falcon-H1; vLLM's
    ``MambaMixer2``), which also exports the state at a prefill checkpoint
    inside its forward pass (one checkpoint block, any position), so
    vLLM's scheduler need not split a prefill at block boundaries."""
    return dataclasses.replace(mamba(), num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)


def mamba_speculative() -> MambaSpec:
    """A Mamba state in align mode with speculative decoding's extra state
    block (vLLM's ``num_speculative_blocks``, set with MTP/EAGLE on a hybrid
    Mamba model): one block a request more, past its blocks."""
    return dataclasses.replace(mamba(), num_speculative_blocks=1)


SPECS = {
    "full+swa8": lambda: [full(), window(8)],
    "full+swa8+swa13": lambda: [full(), window(8), window(13)],
    "swa6+full": lambda: [window(6), full()],
    "swa8+swa16": lambda: [window(8), window(16)],
    "swa8": lambda: [window(8)],
    "full": lambda: [full()],
    "mla": lambda: [mla()],
    "mla+swa8": lambda: [mla(), window(8)],
    "full+swa8x2": lambda: [full(), window_retaining(8, 2)],
    "full+local8": lambda: [full(), local(8)],
    "full+local12": lambda: [full(), local(12)],
    "local12+full": lambda: [local(12), full()],
    "full+swa8+local16": lambda: [full(), window(8), local(16)],
    # Groups of different block sizes (the suffix: tokens a block).
    "full+swa8b8": lambda: [full(), larger_blocks(window(8), 2 * TPB)],
    "fullb8+swa13": lambda: [larger_blocks(full(), 2 * TPB), window(13)],
    "full+swa13b8+local16b8": lambda: [full(), larger_blocks(window(13), 2 * TPB), larger_blocks(local(16), 2 * TPB)],
    "full+fullb8+swa8": lambda: [full(), larger_blocks(full(), 2 * TPB), window(8)],
    "full+fullb8": lambda: [full(), larger_blocks(full(), 2 * TPB)],
    "mla+swamla8": lambda: [mla(), window_mla(8)],
    "swa6b8+full": lambda: [larger_blocks(window(6), 2 * TPB), full()],
    # Groups vLLM's connector leaves out (not prefix-cacheable).
    "full+ring": lambda: [full(), ring()],
    "mla+swamla8r": lambda: [mla(), bounded_window_mla(8)],
    "ring+swa8": lambda: [ring(), window(8)],
    "fullb8+ring": lambda: [larger_blocks(full(), 2 * TPB), ring()],
    # Mamba: a hybrid model of attention and Mamba layers (Jamba,
    # Nemotron-H, Qwen3-Next's linear attention is another spec), with a
    # sliding window too, and Mamba alone.
    "full+mamba": lambda: [full(), mamba()],
    "mamba+swa8": lambda: [mamba(), window(8)],
    "mamba": lambda: [mamba()],
    "full+mamba+swa8": lambda: [full(), mamba(), window(8)],
    "full+mamba2": lambda: [full(), mamba2()],
    "mamba2+swa8": lambda: [mamba2(), window(8)],
    # Speculative decoding's extra Mamba state block (MTP on a hybrid Mamba
    # model): vLLM allocates it past the request's blocks.
    "full+mambasb": lambda: [full(), mamba_speculative()],
}
CASES = [
    (1, "full+swa8", {"offload_prompt_only": False}, {}, 1),
    (2, "full+swa8", {"eviction_policy": "arc", "offload_prompt_only": False}, {}, 0),
    (3, "full+swa8+swa13", {"block_size": 2 * TPB, "offload_prompt_only": False}, {}, 1),
    (4, "swa6+full", {}, {"async_scheduling": True}, 3),
    (5, "full+swa8", {}, {"world_size": 2}, 1),
    (6, "swa8+swa16", {"offload_prompt_only": False}, {}, 1),
    (7, "full+swa8+swa13", {}, {"max_num_batched_tokens": 16}, 0),
    # Sync loads: hits within 8 KiB a step (256 bytes a token on a worker,
    # over both groups: 32 tokens) load in the step.
    (8, "full+swa8", {"sync_load_budget_bytes": 8192}, {}, 1),
    # Chunks of four blocks: a window of two blocks reaches only the last
    # two blocks of a chunk (vLLM's reachable-block mask).
    (9, "full+swa8", {"block_size": 4 * TPB, "offload_prompt_only": False}, {}, 1),
    # Sliding-window stores with dense retention (vLLM's
    # prefix_cache_retention_interval=None: a tail at every chunk boundary,
    # and a finished request's final tail reconsidered) and with a tail
    # every 16 tokens (the default, 0, keeps only the replay boundary's and
    # the shared prefix's tails).
    (10, "full+swa8", {"block_size": 4 * TPB, "offload_prompt_only": False}, {"retention": None}, 1),
    (11, "full+swa8+swa13", {"offload_prompt_only": False}, {"retention": 16}, 0),
    # A model of sliding-window layers only: one group, vLLM's windows.
    (12, "swa8", {"offload_prompt_only": False}, {}, 1),
    # Self-describing KV events: full-attention chunks carry their block
    # hashes, tokens and parent; sliding-window chunks a placeholder with
    # their group's kind and window (one and two blocks a chunk).
    (13, "full+swa8+swa13", {"self_describing_kv_events": True, "offload_prompt_only": False}, {}, 1),
    (14, "swa6+full", {"self_describing_kv_events": True, "block_size": 2 * TPB}, {}, 0),
    # Chunked-local attention (Llama 4's local layers): a window of its
    # attention chunk, no right padding, every held block stored. Attention
    # chunks of two, three and four blocks; host chunks of one, two and four
    # blocks (host chunks straddling attention chunks: 12 tokens over 8- and
    # 16-token host chunks); with a sliding window beside it; async
    # scheduling, two workers, dense retention, self-describing events
    # (placeholders).
    (15, "full+local8", {"offload_prompt_only": False}, {}, 1),
    (16, "local12+full", {"block_size": 2 * TPB, "self_describing_kv_events": True}, {"async_scheduling": True}, 1),
    (17, "full+local12", {"block_size": 4 * TPB, "offload_prompt_only": False}, {"retention": None}, 1),
    (18, "full+swa8+local16", {"offload_prompt_only": False}, {"world_size": 2}, 0),
    # EAGLE/MTP draft groups (vLLM's is_eagle_group, set with speculative
    # decoding; the scheduler runs without speculation here): a hit must find
    # the chunk after its end, and a decoding request's last chunk is not
    # stored. One full-attention group (a model with an EAGLE drafter); a
    # draft full-attention group beside a window, chunks of two blocks; a
    # draft window too, chunks of four blocks, dense retention (its
    # reachable-block mask needs one block more, one block later).
    (19, "full", {"offload_prompt_only": False}, {"eagle_groups": [0]}, 1),
    (20, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"eagle_groups": [0]}, 1),
    (21, "swa6+full", {"block_size": 4 * TPB, "offload_prompt_only": False}, {"eagle_groups": [0, 1], "retention": None}, 0),
    # MLA groups: full attention to vLLM's connector, beside a window; one
    # MLA group holding an MTP drafter's layers (DeepSeek's MTP).
    (22, "mla+swa8", {"offload_prompt_only": False}, {}, 1),
    (23, "mla", {"offload_prompt_only": False}, {"eagle_groups": [0]}, 1),
    # A sliding window retaining 2 tokens behind it (multi-module MTP): its
    # window, load window and reachable-block mask widen by them (chunks of
    # one block; of four blocks with dense retention).
    (24, "full+swa8x2", {"offload_prompt_only": False}, {}, 1),
    (25, "full+swa8x2", {"block_size": 4 * TPB, "offload_prompt_only": False}, {"retention": None}, 1),
    # Block hashes finer than the blocks (vLLM's prefix_match_unit, allowed
    # with several groups): a chunk's key is the last hash in it. Two and
    # four hashes a block; chunks of one and two blocks; self-describing
    # events (a payload names each block's last hash, its parent the hash
    # before the chunk); a draft group and a chunked-local group.
    (26, "full+swa8", {"offload_prompt_only": False}, {"hash_tokens": 2}, 1),
    (27, "full+swa8+swa13", {"block_size": 2 * TPB, "self_describing_kv_events": True, "offload_prompt_only": False}, {"hash_tokens": 1}, 0),
    (28, "full+local12", {"offload_prompt_only": False}, {"hash_tokens": 2, "eagle_groups": [0], "async_scheduling": True}, 1),
    # Groups of different block sizes (vLLM gives a group of smaller pages
    # larger blocks so every group has one page size): each group's chunk
    # is blocks_per_chunk of its own blocks, its key the last hash in it.
    # A window of 8-token blocks beside 4-token full attention; full
    # attention of 8-token blocks beside a window of 4 (hashes every 2
    # tokens, dense retention); chunks of two blocks with a window and
    # chunked-local attention of 8-token blocks, self-describing events,
    # async scheduling, two workers.
    (29, "full+swa8b8", {"offload_prompt_only": False}, {}, 1),
    (30, "fullb8+swa13", {"offload_prompt_only": False}, {"hash_tokens": 2, "retention": None}, 0),
    (31, "full+swa13b8+local16b8", {"blocks_per_chunk": 2, "self_describing_kv_events": True, "offload_prompt_only": False}, {"async_scheduling": True, "world_size": 2}, 1),
    # Two full-attention groups of different chunks: vLLM's connector then
    # aligns nothing (its alignment_tokens is None), and a window's stores
    # keep every chunk's tail.
    (32, "full+fullb8+swa8", {"offload_prompt_only": False}, {}, 1),
    # A sliding window over MLA's latent vectors beside MLA (DeepSeek V4's
    # windowed layers, prefix-cacheable): a window to vLLM's connector;
    # chunks of two blocks, self-describing events (its placeholders).
    (33, "mla+swamla8", {"blocks_per_chunk": 2, "self_describing_kv_events": True, "offload_prompt_only": False}, {}, 1),
    # Groups of different block sizes with a draft group, a tail every 16
    # tokens and sync loads (the budget counts each group's bytes a token
    # over its own block); a window of 8-token blocks first, async.
    (34, "full+swa8b8", {"sync_load_budget_bytes": 8192, "offload_prompt_only": False}, {"eagle_groups": [0], "retention": 16}, 1),
    (35, "swa6b8+full", {}, {"async_scheduling": True, "max_num_batched_tokens": 16}, 0),
    # Groups that are not prefix-cacheable, which vLLM's connector leaves
    # out (neither stored nor loaded; its events name the others by their
    # own group index): a circular buffer beside full attention; a
    # bounded-replay MLA window beside MLA (vLLM replays the window),
    # self-describing events, chunks of two blocks; a circular buffer
    # first, before a window (group 1 is the only one offloaded), async.
    (36, "full+ring", {"offload_prompt_only": False}, {}, 1),
    (37, "mla+swamla8r", {"blocks_per_chunk": 2, "self_describing_kv_events": True, "offload_prompt_only": False}, {}, 1),
    (38, "ring+swa8", {"self_describing_kv_events": True}, {"async_scheduling": True}, 1),
    # Full attention of 8-token blocks beside a 4-token circular buffer:
    # vLLM hashes every 8 tokens (the prefix-cacheable groups' blocks), two
    # workers.
    (39, "fullb8+ring", {"offload_prompt_only": False}, {"world_size": 2}, 1),
    # The same with block hashes every 4 tokens (vLLM's prefix_match_unit,
    # allowed with several groups even when one is offloaded): the
    # single-group scheduler keys each block by its last hash.
    (40, "fullb8+ring", {"offload_prompt_only": False}, {"hash_tokens": 4}, 0),
    # Per-request `kv_transfer_params` (`request_params`): load caps
    # (vLLM rounds each group's hit down to its chunk), store caps, both,
    # and values both connectors ignore; over windows and full attention,
    # chunks of two blocks, chunked-local groups with async scheduling,
    # groups of different block sizes, an EAGLE draft group.
    (41, "full+swa8", {"offload_prompt_only": False}, {"params": True}, 1),
    (42, "full+swa8+swa13", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"params": True}, 0),
    (43, "full+local12", {}, {"params": True, "async_scheduling": True}, 1),
    (44, "fullb8+swa13", {"offload_prompt_only": False}, {"params": True, "hash_tokens": 2}, 1),
    (46, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"params": True, "eagle_groups": [0]}, 1),
    # Decode context parallelism over two ranks (vLLM runs it with
    # full-attention groups only): a block spans block_size x 2 tokens,
    # each worker holding every other token. One group holding an
    # EAGLE/MTP drafter's layers (DeepSeek's MTP with DCP), chunks of two
    # blocks; full attention of two block sizes, async, with requests'
    # kv_transfer_params.
    (47, "full", {"blocks_per_chunk": 2, "offload_prompt_only": False}, {"eagle_groups": [0], "dcp": 2, "world_size": 2}, 1),
    (48, "full+fullb8", {"offload_prompt_only": False}, {"dcp": 2, "world_size": 2, "async_scheduling": True, "params": True}, 1),
    # Mamba groups in vLLM's align mode (a state kept at each block
    # boundary): vLLM's core hands the connector the block holding a
    # request's state at each boundary it caches, which becomes a store of
    # that one block; a hit ends on a state boundary and loads the state
    # there. Beside full attention; first, beside a window, async; alone,
    # two workers; chunks of two blocks with requests' kv_transfer_params;
    # with a window too, sync loads; self-describing events.
    (49, "full+mamba", {"offload_prompt_only": False}, {}, 1),
    (50, "mamba+swa8", {}, {"async_scheduling": True}, 1),
    (51, "mamba", {"offload_prompt_only": False}, {"world_size": 2}, 0),
    (52, "full+mamba", {"blocks_per_chunk": 2, "offload_prompt_only": False}, {"params": True}, 1),
    (53, "full+mamba+swa8", {"sync_load_budget_bytes": 8192, "offload_prompt_only": False}, {}, 0),
    # Self-describing KV events beside a Mamba group (its chunks keep
    # vLLM's placeholder, named by their group's kind), two workers, async.
    (54, "full+mamba", {"self_describing_kv_events": True, "offload_prompt_only": False}, {"world_size": 2, "async_scheduling": True}, 1),
    # Mamba2 layers (Nemotron-H, Granite 4), which export the state at a
    # prefill checkpoint inside a forward pass (vLLM then splits no
    # prefill at block boundaries, and hands the checkpoint's block over):
    # beside full attention; beside a window, chunks of two blocks, async,
    # with requests' kv_transfer_params.
    (55, "full+mamba2", {"offload_prompt_only": False}, {}, 1),
    (56, "mamba2+swa8", {"blocks_per_chunk": 2}, {"async_scheduling": True, "params": True}, 0),
    # Mamba states inside a block: block hashes finer than the blocks
    # (prefix_match_unit), which vLLM's core keys and caches a state at
    # (its "partial tails": the state at the prompt's last hash boundary,
    # copied out of the running block), and its connector stores and loads
    # with the attention groups' block there. Two and four hashes a block;
    # self-describing events, two workers, async; sync loads. (Not Mamba2:
    # `test_hybrid_worker.py`'s
    # `test_vllm_serves_a_wrong_mamba2_state_inside_a_block_on_its_own`.)
    (57, "full+mamba", {"offload_prompt_only": False}, {"hash_tokens": 2}, 1),
    (58, "full+mamba", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"hash_tokens": 1, "world_size": 2, "async_scheduling": True}, 1),
    # (Not with requests' max_offload_tokens: vLLM's connector then asserts
    # a hand-off past the cap, `test_partial_tails_past_a_store_cap`.)
    (61, "full+mamba", {"sync_load_budget_bytes": 8192}, {"hash_tokens": 2}, 0),
    # Mamba states inside a block beside an EAGLE/MTP draft group: vLLM
    # keys the draft group's tail a proof margin (one hash unit) past the
    # boundary, searches two blocks past the complete hit (a tail in the
    # second loads the complete "bridge" chunk before it), and stores tails
    # only for requests that loaded from the tier. Two and four hashes a
    # block; self-describing events, two workers, async.
    (62, "full+mamba", {"offload_prompt_only": False}, {"hash_tokens": 2, "eagle_groups": [0]}, 1),
    (63, "full+mamba", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"hash_tokens": 1, "eagle_groups": [0], "world_size": 2, "async_scheduling": True}, 1),
    # Speculative decoding's extra Mamba state block (the scheduler runs
    # without speculation, as for the EAGLE cases): vLLM's connector offloads
    # the group as any other Mamba group. Alone; async with two workers;
    # beside an EAGLE/MTP draft group; with partial tails (and beside a
    # draft group, self-describing events); chunks of two blocks with
    # requests' kv_transfer_params; sync loads.
    (64, "full+mambasb", {"offload_prompt_only": False}, {}, 1),
    (65, "full+mambasb", {}, {"async_scheduling": True, "world_size": 2}, 1),
    (66, "full+mambasb", {"offload_prompt_only": False}, {"eagle_groups": [0]}, 1),
    (67, "full+mambasb", {"offload_prompt_only": False}, {"hash_tokens": 2}, 1),
    (68, "full+mambasb", {"blocks_per_chunk": 2, "offload_prompt_only": False}, {"params": True}, 1),
    (69, "full+mambasb", {"sync_load_budget_bytes": 8192, "offload_prompt_only": False}, {}, 0),
    (70, "full+mambasb", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"hash_tokens": 1, "eagle_groups": [0], "world_size": 2, "async_scheduling": True}, 1),
    # Speculative decoding (n-gram drafts, synchronous scheduling; the
    # harness's `spec_tokens`): decode steps schedule draft tokens past the
    # request's tokens (vLLM allocates blocks for them), about one in three
    # is rejected and its KV written at its position. Full attention with
    # a window; two windows, chunks of two blocks, two workers;
    # chunked-local attention with dense retention; a window of 8-token
    # blocks with hashes every 2 tokens; a window alone, sync loads and
    # requests' kv_transfer_params; a circular buffer (left out, written
    # by drafts too); a window retaining 2 tokens behind it (multi-module
    # MTP's); MLA beside a window.
    (71, "full+swa8", {"offload_prompt_only": False}, {"spec_tokens": 3}, 1),
    (72, "full+swa8+swa13", {"block_size": 2 * TPB, "offload_prompt_only": False}, {"spec_tokens": 2, "world_size": 2}, 0),
    (73, "full+local12", {"offload_prompt_only": False}, {"spec_tokens": 4, "retention": None}, 1),
    (74, "full+swa8b8", {"offload_prompt_only": False}, {"spec_tokens": 3, "hash_tokens": 2}, 1),
    (75, "swa8", {"sync_load_budget_bytes": 8192, "offload_prompt_only": False}, {"spec_tokens": 3, "params": True}, 1),
    (76, "full+ring", {"offload_prompt_only": False}, {"spec_tokens": 3}, 0),
    (77, "full+swa8x2", {"block_size": 4 * TPB, "offload_prompt_only": False}, {"spec_tokens": 2, "retention": None}, 1),
    (78, "mla+swa8", {"self_describing_kv_events": True, "offload_prompt_only": False}, {"spec_tokens": 5}, 3),
    # Speculative decoding with Mamba groups (MTP on a hybrid Mamba model):
    # vLLM sizes the speculative blocks to the drafts, its model runner
    # keeps the state after each draft in them and copies the state at a
    # block boundary the accepted tokens reach into the block ending there
    # (the harness's `_compute_state_speculative`; a state after a rejected
    # draft is marked wrong). Beside full attention; first, beside a
    # window, two workers; alone, sync loads; chunks of two blocks with
    # requests' kv_transfer_params; partial tails (hashes every 2 tokens),
    # self-describing events; one draft (one speculative block); full
    # attention, Mamba and a window, dense retention.
    (79, "full+mamba", {"offload_prompt_only": False}, {"spec_tokens": 3}, 1),
    (80, "mamba+swa8", {}, {"spec_tokens": 2, "world_size": 2}, 0),
    (87, "mamba", {"offload_prompt_only": False, "sync_load_budget_bytes": 8192}, {"spec_tokens": 3}, 1),
    (82, "full+mamba", {"blocks_per_chunk": 2, "offload_prompt_only": False}, {"spec_tokens": 2, "params": True}, 1),
    (83, "full+mamba", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"spec_tokens": 3, "hash_tokens": 2}, 1),
    (84, "full+mambasb", {"offload_prompt_only": False}, {"spec_tokens": 1}, 1),
    (85, "full+mamba+swa8", {"offload_prompt_only": False}, {"spec_tokens": 3, "retention": None}, 0),
    # Speculative decoding with async scheduling: vLLM's scheduler
    # schedules placeholder drafts and counts the step in flight's drafts
    # as computed until its output rolls the rejected ones back; its model
    # runner starts each request after the last step's accepted tokens and
    # computes its own drafts (the harness's `Engine._span`). Full
    # attention with a window; chunked-local attention, chunks of two
    # blocks, two workers; MLA beside a window, self-describing events,
    # requests' kv_transfer_params; a circular buffer (written by drafts
    # too); a window alone, sync loads.
    (89, "full+swa8", {"offload_prompt_only": False}, {"spec_tokens": 3, "async_scheduling": True}, 1),
    (90, "full+local12", {"blocks_per_chunk": 2, "offload_prompt_only": False},
     {"spec_tokens": 2, "async_scheduling": True, "world_size": 2}, 0),
    (91, "mla+swa8", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"spec_tokens": 4, "async_scheduling": True, "params": True}, 1),
    (92, "full+ring", {"offload_prompt_only": False}, {"spec_tokens": 3, "async_scheduling": True}, 0),
    (93, "swa8", {"sync_load_budget_bytes": 8192, "offload_prompt_only": False},
     {"spec_tokens": 3, "async_scheduling": True}, 1),
    # An EAGLE drafter run for real (the harness's ``spec_method="eagle"``):
    # vLLM's scheduler reserves lookahead slots for the drafts, never ends a
    # prefill chunk right before the prompt's last token, and drops the
    # last block of a GPU prefix hit in the drafter groups; the fake
    # drafter writes each position's KV in those groups from its token and
    # the next one after the step's sampling, and guesses past them
    # (`Engine._draft`), so a drafter block loaded where the next token
    # differs holds wrong bytes. One draft group; a draft group beside a
    # window, 8-token blocks, async; a draft window beside a draft group,
    # 16-token blocks, dense retention, two workers; MLA with one draft
    # (MTP), self-describing events, requests' kv_transfer_params;
    # hashes every 2 tokens beside chunked-local attention, async; Mamba
    # partial tails beside a draft group.
    (94, "full", {"offload_prompt_only": False}, {"spec_tokens": 3, "spec_method": "eagle", "eagle_groups": [0]}, 1),
    (95, "full+swa8", {"block_size": 2 * TPB, "offload_prompt_only": False},
     {"spec_tokens": 2, "spec_method": "eagle", "eagle_groups": [0], "async_scheduling": True}, 1),
    (96, "swa6+full", {"block_size": 4 * TPB, "offload_prompt_only": False},
     {"spec_tokens": 3, "spec_method": "eagle", "eagle_groups": [0, 1], "retention": None, "world_size": 2}, 0),
    (100, "mla", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"spec_tokens": 1, "spec_method": "eagle", "eagle_groups": [0], "params": True}, 1),
    (98, "full+local12", {"offload_prompt_only": False},
     {"hash_tokens": 2, "spec_tokens": 3, "spec_method": "eagle", "eagle_groups": [0], "async_scheduling": True}, 1),
    (99, "full+mamba", {"offload_prompt_only": False},
     {"hash_tokens": 2, "spec_tokens": 3, "spec_method": "eagle", "eagle_groups": [0]}, 1),
    # Mamba groups under async scheduling with drafts: in align mode vLLM's
    # model runner applies the last step's rejections to its token counts
    # before it places the states (`preprocess_mamba`), so the states go
    # where they go under sync scheduling, from the corrected start
    # (`Engine._span`). Beside full attention; first, beside a window, two
    # workers; partial tails with self-describing events; one draft; an
    # EAGLE drafter beside it.
    (101, "full+mamba", {"offload_prompt_only": False}, {"spec_tokens": 3, "async_scheduling": True}, 1),
    (102, "mamba+swa8", {}, {"spec_tokens": 2, "async_scheduling": True, "world_size": 2}, 0),
    (103, "full+mamba", {"self_describing_kv_events": True, "offload_prompt_only": False},
     {"spec_tokens": 3, "hash_tokens": 2, "async_scheduling": True}, 1),
    (104, "full+mambasb", {"offload_prompt_only": False}, {"spec_tokens": 1, "async_scheduling": True}, 1),
    (105, "full+mamba", {"offload_prompt_only": False},
     {"spec_tokens": 2, "spec_method": "eagle", "eagle_groups": [0], "async_scheduling": True}, 1),
    # Mamba2 layers (prefill checkpoints, as Qwen3-Next's GDN layers)
    # under speculative decoding: a prefill step writes its checkpoint as
    # without speculation (`Engine._checkpoint`), decode steps keep the
    # states in their columns. Beside full attention; beside a window,
    # chunks of two blocks, async, requests' kv_transfer_params; beside an
    # EAGLE drafter's group (MTP on a hybrid model).
    (106, "full+mamba2", {"offload_prompt_only": False}, {"spec_tokens": 3}, 1),
    (107, "mamba2+swa8", {"blocks_per_chunk": 2}, {"spec_tokens": 2, "async_scheduling": True, "params": True}, 0),
    (108, "full+mamba2", {"offload_prompt_only": False},
     {"spec_tokens": 2, "spec_method": "eagle", "eagle_groups": [0]}, 1),
]
# Seeds the widening scripts found something on, kept with the
# configuration they ran (added below the configurations they cycle
# through): seed 42005's Mamba state at boundary 40 is handed over in the
# step its block goes to a new request, which writes it in that step's
# forward (vLLM 0.33.0 stores the new owner's bytes; kvoffload copies it
# before the forward: `test_hybrid_worker.py`'s
# `test_a_state_handed_over_as_its_block_goes_to_another_request_is_copied_first`).
HANDOFF_REALLOCATED = (42005, "mamba", {"offload_prompt_only": False}, {"spec_tokens": 3}, 1)
# The configurations the widening scripts cycle through (`select_cases`).
_CONFIGS = list(CASES)
# Seeds the widening scripts found something on, kept with the
# configuration they ran: seed 36's, on a workload where a request is
# preempted and resumes with the same circular-buffer block, which another
# request wrote meanwhile (the harness checked the buffer against what the
# request had written before its preemption).
CASES += [(10395, "full+ring", {"offload_prompt_only": False}, {}, 1), HANDOFF_REALLOCATED]


def select_cases(only: str | None) -> list[tuple]:
    """The cases the widening scripts cycle through: all, or those whose
    group names contain `only` (``eagle``: those with draft groups;
    ``hash``: those with block hashes finer than the blocks; ``partial``:
    those with Mamba states inside a block; ``partial-eagle``: those of
    them beside an EAGLE draft group; ``sizes``: those
    whose groups have different block sizes; ``left-out``: those with groups
    vLLM's connector leaves out; ``params``: those whose requests carry
    ``kv_transfer_params``; ``dcp``: those with decode context
    parallelism; ``spec``: those with speculative decoding;
    ``async-spec``: those of them with async scheduling; ``eagle-spec``:
    those with an EAGLE drafter run for real)."""
    if only is None:
        return list(_CONFIGS)
    if only == "params":
        return [c for c in _CONFIGS if c[3].get("params")]
    if only == "dcp":
        return [c for c in _CONFIGS if c[3].get("dcp")]
    if only == "spec":
        return [c for c in _CONFIGS if c[3].get("spec_tokens")]
    if only == "async-spec":
        return [c for c in _CONFIGS if c[3].get("spec_tokens") and c[3].get("async_scheduling")]
    if only == "eagle-spec":
        return [c for c in _CONFIGS if c[3].get("spec_method") == "eagle"]
    if only == "eagle":
        return [c for c in _CONFIGS if c[3].get("eagle_groups")]
    if only == "hash":
        return [c for c in _CONFIGS if c[3].get("hash_tokens")]
    if only == "partial":
        return [c for c in _CONFIGS if partial_tail_case(c[1], c[3])]
    if only == "partial-eagle":
        return [c for c in _CONFIGS if partial_tail_case(c[1], c[3]) and c[3].get("eagle_groups")]
    if only == "sizes":
        return [c for c in _CONFIGS if len({s.block_size for s in SPECS[c[1]]()}) > 1]
    if only == "left-out":
        return [c for c in _CONFIGS if len(offloaded(SPECS[c[1]]())) < len(SPECS[c[1]]())]
    return [c for c in _CONFIGS if only in c[1]]


def sampled(prompt: list[int], n: int) -> list[int]:
    """The `n` tokens the harness's fake model samples after `prompt`
    (``Engine.token_at``)."""
    return [10 + (hash((prompt[0], len(prompt), p)) % 1000) for p in range(len(prompt), len(prompt) + n)]


def workload(seed: int, n: int) -> list[tuple[int, list[int], int]]:
    """`n` requests as ``(arrival step, prompt, max tokens)``: conversations,
    each turn's prompt the previous turn's prompt, its answer and a new
    message, over a few shared system prompts, and retries of earlier
    prompts (a hit of a sliding-window group needs the window before the
    hit's end stored: where an earlier request's stores ended); more
    conversations than the GPU cache holds, so they come back from the host
    tier."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 50_000) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    live: list[tuple[int, list[int]]] = []  # (step the last turn was sent, its prompt + answer)
    out = []
    step = 0
    for _ in range(n):
        step += rng.choice((0, 1, 1, 2, 3))
        # A prompt sent before, again (a retry: its hit ends where its
        # stores ended), a new conversation, or the next turn of one sent
        # long enough ago.
        ready = [i for i, (sent, _) in enumerate(live) if step - sent >= TURN_GAP]
        sent = [r for r in out if step - r[0] >= TURN_GAP]
        if sent and rng.random() < 0.3:
            prompt = list(rng.choice(sent)[1])
            out.append((step, prompt, rng.randrange(1, 8)))
            continue
        if ready and rng.random() < 0.7:
            i = rng.choice(ready)
            history = live.pop(i)[1]
        else:
            history = list(rng.choice(systems))
        prompt = history + [rng.randrange(3, 50_000) for _ in range(rng.randrange(1, 20))]
        max_tokens = rng.randrange(1, 8)
        out.append((step, prompt, max_tokens))
        if len(prompt) < 96:
            live.append((step, prompt + sampled(prompt, max_tokens)))
    return out


def request_params(seed: int, n: int) -> list[dict | None]:
    """The ``kv_transfer_params`` of the `n` requests of a case with
    ``"params"`` (its own random stream: the workload stays the seed's):
    none, a load cap (``max_load_tokens``), a store cap
    (``max_offload_tokens``), both, each from 0 to past a prompt, or a
    value both connectors ignore (negative, a bool, a float, a string)."""
    rng = random.Random(seed * 7919 + 17)

    def cap() -> int:
        return rng.choice((0, rng.randrange(1, 40), rng.randrange(1, 40), rng.randrange(40, 120)))

    out: list[dict | None] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            out.append(None)
        elif r < 0.6:
            out.append({"max_load_tokens": cap()})
        elif r < 0.75:
            out.append({"max_offload_tokens": cap()})
        elif r < 0.9:
            out.append({"max_load_tokens": cap(), "max_offload_tokens": cap()})
        else:
            name = rng.choice(("max_load_tokens", "max_offload_tokens"))
            out.append({name: rng.choice((-1, True, 8.0, "8"))})
    return out


def case_params(seed: int, opts: dict) -> dict[str, dict]:
    """A case's ``kv_transfer_params`` by request id (none without
    ``"params"``), as the corpus holds them."""
    if not opts.get("params"):
        return {}
    return {f"q{i}": p for i, p in enumerate(request_params(seed, REQUESTS)) if p is not None}


def spec_blocks(spec: Any) -> list[list[int]]:
    """A GPU load or store spec's blocks as ``[first block index, block
    ids...]`` per group (vLLM lists the groups' blocks one after another)."""
    ids = [int(b) for b in spec.block_ids]
    out, at = [], 0
    for size, first in zip(spec.group_sizes, spec.block_indices):
        out.append([int(first), *ids[at : at + size]])
        at += size
    return out


#: vLLM's ``LookupResult`` as one letter in the corpus.
STATE_LETTER = {"HIT": "H", "HIT_PENDING": "P", "RETRY": "R", "MISS": "M"}


def key_state(sched: Any, key: Any, req_context: Any) -> str:
    """A key's lookup answer as a letter, lower case while a load of the
    chunk is in flight (vLLM then defers the request)."""
    letter = STATE_LETTER[sched.manager.lookup(key, req_context).name]
    return letter.lower() if key in (sched._chunks_being_loaded or ()) else letter


def partial_key_states(sched: Any, request: Any, req_context: Any) -> list:
    """What a partial-tail lookup of `request` could ask vLLM's manager:
    ``[prompt tokens, [[boundary, letters], ...]]``, per hash boundary
    before the prompt's end where a key is known, a letter per group, for
    its key there (`key_state`, upper case: a partial tail's lookup does
    not look at loads in flight)."""
    tph = sched.config.tokens_per_hash
    block = sched._partial_tail_block_size
    out = []
    for boundary in range(tph, request.num_prompt_tokens, tph):
        # Inside a block; beside an EAGLE draft group on a block too (a
        # tail may end on the bridge chunk's end). A draft group's key is
        # the hash a proof margin past the boundary (none past the
        # request's hashes: a miss).
        if boundary % block == 0 and not sched._max_eagle_proof_margin:
            continue
        letters = ""
        for gc in sched.config.kv_group_configs:
            idx = sched._partial_tail_key_tokens(gc, boundary) // tph - 1
            if idx >= len(request.block_hashes):
                letters += "M"
                continue
            key = make_offload_key(request.block_hashes[idx], gc.group_idx)
            letters += key_state(sched, key, req_context).upper()
        if letters.strip("M"):
            out.append([boundary, letters])
    return [request.num_prompt_tokens, out]


def record(seed: int, specs: str, extra: dict, opts: dict, delay: int) -> tuple[list[dict], dict]:
    """vLLM's connector on the seed's workload, step by step, and what vLLM
    derived from the configuration (the hit alignment, the retention
    interval of sliding-window stores)."""
    common, cfg = engine_options(specs, extra, opts)
    e = build(
        connector="OffloadingConnector", module=None, extra=cfg, fake_worker=vllm_worker(delay),
        tpb=TPB, groups=SPECS[specs](), **common,
    )
    lookups: list[list] = []
    inner = e.connector.get_num_new_matched_tokens
    sched = e.connector.connector_scheduler

    def lookup(request: Any, num_computed: int, *a: Any, **k: Any) -> Any:
        assert not a and not k, "vLLM 0.33.0's scheduler passes no max_num_new_tokens"
        st = sched._req_status.get(request.request_id)
        busy = st is not None and bool(st.transfer_jobs)
        got = inner(request, num_computed)
        rec = [request.request_id, num_computed, request.num_tokens, got[0], got[1]]
        if not busy:
            # What the lookup saw (vLLM's manager lookups are side-effect
            # free): per group, each offload key's state, "H" hit, "P" hit
            # pending, "R" retry, "M" miss, lower case while a load of the
            # chunk is in flight.
            st = sched._req_status[request.request_id]
            rec.append(["".join(key_state(sched, key, st.req_context) for key in gs.offload_keys)
                        for gs in st.group_states])
            if sched.config.supports_partial_tail:
                # Partial tails: per hash boundary inside a block (up to the
                # prompt's end), each group's key there, as above.
                rec.append(partial_key_states(sched, request, st.req_context))
        lookups.append(rec)
        return got

    e.connector.get_num_new_matched_tokens = lookup
    allocs: list[list] = []
    alloc = e.connector.update_state_after_alloc

    def update_state_after_alloc(request: Any, blocks: Any, n: int) -> Any:
        if n:
            # What a load is planned from: the GPU's hit, the tokens to
            # load, whether the load is synchronous, and per group each of
            # the request's blocks: "0" null (behind a window), "h" holding
            # a hashed (cached) block, "n" a new one.
            rid = request.request_id
            allocs.append([
                rid,
                sched._req_status[rid].num_locally_computed_tokens,
                n,
                rid in sched._current_batch_sync_loads,
                ["".join("0" if b.is_null else "h" if b.block_hash is not None else "n"
                         for b in blocks.blocks[gc.group_idx])
                 for gc in sched.config.kv_group_configs],
            ])
        got = alloc(request, blocks, n)
        record_sources(e.connector, sources, request, n)
        return got

    e.connector.update_state_after_alloc = update_state_after_alloc
    sources: list[list] = []
    # Store planning: per request, what vLLM's _build_store_jobs starts from
    # (finished or not, the prompt's tokens, the shared-prefix junction the
    # GPU prefix cache found, and per group the next chunk to store, the
    # storable chunks, the prompt's chunks, and each block of the request:
    # "0" null, "b" held), and the chunks it offers the manager
    # (prepare_store's keys, per group).
    store_inputs: list[list] = []
    candidates: list[list] = []
    build_stores = sched._build_store_jobs

    def build_store_jobs(so: Any) -> Any:
        for rid in [*so.num_scheduled_tokens, *(so.finished_req_ids or ())]:
            st = sched._req_status.get(rid)
            if st is None:
                continue
            req = st.req
            if req.status is RequestStatus.FINISHED_ABORTED:
                after = req.num_computed_tokens
            elif req.is_finished():
                after = max(req.num_prompt_tokens, req.num_tokens - 1)
            else:
                after = req.num_computed_tokens + so.num_scheduled_tokens[rid]
            offloadable = sched._calc_num_offloadable_tokens(st, after)
            prompt = sched._calc_num_offloadable_tokens(st, req.num_prompt_tokens)
            store_inputs.append([
                rid,
                req.is_finished(),
                req.num_prompt_tokens,
                req.shared_prefix_boundary,
                [
                    [
                        gs.next_stored_chunk_idx,
                        st.storable_chunks(gc, gs, offloadable),
                        prompt // gc.tokens_per_chunk,
                        "".join("0" if b == 0 else "b" for b in gs.block_ids),
                    ]
                    for gc, gs in zip(sched.config.kv_group_configs, st.group_states)
                ],
            ])
        return build_stores(so)

    sched._build_store_jobs = build_store_jobs
    prepare_store = sched.manager.prepare_store

    def offered(keys: Any, req_context: Any) -> Any:
        keys = list(keys)
        st = sched._req_status[req_context.req_id]
        candidates.append([
            req_context.req_id,
            [[i for i, k in enumerate(gs.offload_keys) if k in keys] for gs in st.group_states],
        ])
        return prepare_store(keys, req_context)

    sched.manager.prepare_store = offered
    # Mamba: the boundary states vLLM's core hands over, and the chunks
    # their stores offer the tier (vLLM plans them before the others).
    mamba_case = any(isinstance(s, MambaSpec) for s in SPECS[specs]())
    handoffs: list[list] = []
    boundary_offers: list[list] = []
    build_boundary = sched._build_partial_tail_store_jobs

    def build_boundary_stores(so: Any) -> Any:
        block_state = so.kv_connector_block_state
        for rid, entries in sorted((block_state.boundary_state_offloads or {}).items() if block_state else ()):
            handoffs.append([rid, [list(e) for e in entries]])
        at = len(candidates)
        try:
            return build_boundary(so)
        finally:
            boundary_offers.extend(candidates[at:])
            del candidates[at:]

    sched._build_partial_tail_store_jobs = build_boundary_stores
    events = capture_events(e.connector)

    def snapshot(so: Any) -> dict:
        meta = so.kv_connector_metadata
        got = {
            "scheduled": dict(sorted(so.num_scheduled_tokens.items())),
            "preempted": sorted(so.preempted_req_ids or ()),
            "lookups": lookups[:],
            "allocs": allocs[:],
            "sources": sources[:],
            "store_inputs": store_inputs[:],
            "store_candidates": candidates[:],
            "loads": sorted([j.req_id, spec_blocks(j.dst_spec)] for j in meta.load_jobs.values()),
            "stores": sorted([j.req_id, spec_blocks(j.src_spec)] for j in meta.store_jobs.values()),
            "events": [list(ev) for ev in order_free(events)],
        }
        if mamba_case:
            got["handoffs"] = handoffs[:]
            got["boundary_offers"] = boundary_offers[:]
        for log in (lookups, allocs, sources, store_inputs, candidates, events, handoffs, boundary_offers):
            log.clear()
        return got

    steps = drive(e, seed, snapshot, opts)
    # JSON's view of the record (tuples as lists), as the corpus holds it.
    derived = {
        "alignment_tokens": sched.config.alignment_tokens,
        "retention_interval": sched.config.retention_interval,
    }
    if sched.config.supports_partial_tail:
        derived["partial_tail"] = {
            "tokens_per_hash": sched.config.tokens_per_hash,
            "block_tokens": sched._partial_tail_block_size,
        }
        if sched._max_eagle_proof_margin:
            # Beside an EAGLE/MTP draft group: where its tails are keyed.
            derived["partial_tail"]["eagle_proof_margin"] = sched._max_eagle_proof_margin
    return json.loads(json.dumps(steps, default=repr)), derived


def record_sources(connector: Any, sources: list[list], request: Any, n: int) -> None:
    """Appends the hit's split by source (asked right after the
    allocation, as vLLM's scheduler asks it for its prefix-cache stats):
    ``[request, tokens, {source: tokens}]``."""
    if n:
        split = connector.get_external_cache_hit_sources(request, n)
        sources.append([request.request_id, n, {str(k.value): v for k, v in sorted(split.items(), key=str)}])


def drive(e: Any, seed: int, snapshot: Any, opts: dict) -> list[dict]:
    """Runs the seed's workload on engine `e` to its end (with the case's
    `kv_transfer_params`, `case_params`): per step
    `snapshot(scheduler_output)` (``{"idle": True}`` for a step with
    nothing to schedule)."""
    arrivals = workload(seed, REQUESTS)
    params = case_params(seed, opts)
    steps: list[dict] = []
    i = 0
    for step in range(600):
        while i < len(arrivals) and arrivals[i][0] <= step:
            _, prompt, max_tokens = arrivals[i]
            e.add(prompt, max_tokens=max_tokens, req_id=f"q{i}", kv_transfer_params=params.get(f"q{i}"))
            i += 1
        if i == len(arrivals) and not e.scheduler.has_requests() and e.pending is None:
            break
        if not e.scheduler.has_requests():
            e.flush_async()
            steps.append({"idle": True})
            continue
        steps.append(snapshot(e.step()))
    else:
        cause = "" if e.scheduler.running else f"; {stall_cause(e.scheduler)}"
        raise AssertionError(f"seed {seed}: requests still running after 600 steps{cause}")
    e.flush_async()
    return steps


def stall_cause(sched: Any) -> str:
    """Why vLLM's scheduler stalled (`test_hybrid_worker.VllmStalled`): the
    request at the head of its KV-holding queue (drained first) or of its
    waiting queue, and whether it is larger than the GPU pool (one group:
    a block a token; a waiting request: vLLM's own admission count)."""
    if sched.kv_holding_waiting:
        queue, head = "KV-holding", sched.kv_holding_waiting.peek_request()
    elif sched.waiting:
        queue, head = "waiting", sched.waiting.peek_request()
    else:
        return "no request waits"
    # vLLM's allocate_slots: the tokens so far and the speculative lookahead.
    tokens = head.num_tokens + sched.num_lookahead_tokens
    mgr = sched.kv_cache_manager
    pool = mgr.block_pool.num_gpu_blocks - 1
    groups = sched.kv_cache_config.kv_cache_groups
    need = 0
    if len(groups) == 1:
        # One group: its last step holds a block for every token.
        need = -(-tokens // groups[0].kv_cache_spec.block_size)
    if queue == "waiting":
        # vLLM's admission gate (the whole sequence, windows capped as vLLM
        # caps them) for a request that holds no block yet.
        need = max(need, mgr.coordinator.get_num_blocks_to_allocate(
            request_id=head.request_id,
            num_tokens=head.num_tokens,
            new_computed_blocks=mgr.empty_kv_cache_blocks.blocks,
            num_encoder_tokens=0,
            total_computed_tokens=0,
            num_local_computed_tokens=0,
            num_tokens_main_model=head.num_tokens,
            apply_admission_cap=True,
            prefill_end=max(head.num_prompt_tokens, head.num_tokens - 1),
        ))
    if need > pool:
        return (
            f"the head of the {queue} queue ({head.request_id}) needs {need} blocks for its {tokens} tokens "
            f"(with its lookahead) and the GPU pool has {pool}: it never fits"
        )
    return f"the head of the {queue} queue ({head.request_id}, {tokens} tokens with its lookahead) cannot be allocated"


def engine_options(specs: str, extra: dict, opts: dict) -> tuple[dict, dict]:
    """The engine options and connector configuration of a case: a GPU cache
    of `GPU_BLOCKS` per group, `HOST_CHUNKS` host chunks of one group's
    layers (2 layers, K and V)."""
    common = {
        "num_gpu_blocks": GPU_BLOCKS * len(SPECS[specs]()),
        "max_num_seqs": 6,
        "max_num_batched_tokens": 64,
        **{k: v for k, v in opts.items() if k != "params"},
    }
    cfg = {"cpu_bytes_to_use": host_bytes(SPECS[specs](), extra, common.get("world_size", 1)), **extra}
    return common, cfg


def host_bytes(groups: list, extra: dict, world: int) -> int:
    """`HOST_CHUNKS` host chunks of one group's layers (2 layers, K and V)
    on each of `world` workers, each holding `groups`' pages."""
    chunk_bytes = groups[0].page_size_bytes * 2 * case_blocks_per_chunk(extra)
    return HOST_CHUNKS * chunk_bytes * world


def block_tokens(spec: Any, opts: dict) -> int:
    """The tokens a block of `spec` spans in a case: its block size, times
    the case's DCP ranks for a spec DCP shards (vLLM's
    ``resolve_dcp_kv_block_size``)."""
    return spec.block_size * (opts.get("dcp", 1) if spec.dcp_sharded else 1)


def case_blocks_per_chunk(extra: dict) -> int:
    """A case's GPU blocks a host chunk (its ``blocks_per_chunk``, or its
    ``block_size`` in `TPB`-token blocks)."""
    return extra.get("blocks_per_chunk", extra.get("block_size", TPB) // TPB)


def corpus_path(seed: int, specs: str) -> Path:
    return CORPUS / f"seed{seed}-{specs}.json.gz"


def write_case(
    path: Path, seed: int, specs: str, extra: dict, opts: dict, delay: int, steps: list, derived: dict
) -> None:
    """Writes a recorded run as the corpus holds it (gzip, mtime 0: the
    same record gives the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    bpc = case_blocks_per_chunk(extra)
    eagle = opts.get("eagle_groups", [])
    shapes = [
        {"tokens_per_chunk": block_tokens(s, opts) * bpc, "sliding_window": getattr(s, "sliding_window", None)}
        | ({"attention_chunk_size": s.attention_chunk_size} if isinstance(s, ChunkedLocalAttentionSpec) else {})
        | ({"extra_retained_tokens": s.extra_retained_tokens} if getattr(s, "extra_retained_tokens", 0) else {})
        | ({"eagle": True} if g in eagle else {})
        | ({"recurrent_state": True} if isinstance(s, MambaSpec) else {})
        for g, s in enumerate(SPECS[specs]())
        if s.prefix_cacheable
    ]
    params = {"kv_transfer_params": case_params(seed, opts)} if opts.get("params") else {}
    text = json.dumps({"seed": seed, "groups": specs, "shapes": shapes, "blocks_per_chunk": bpc,
                       **derived, "extra": extra, "opts": opts, "delay": delay, **params, "steps": steps},
                      separators=(",", ":")) + "\n"
    path.write_bytes(gzip.compress(text.encode(), mtime=0))


def read_corpus(seed: int, specs: str) -> dict:
    return json.loads(gzip.decompress(corpus_path(seed, specs).read_bytes()))


@pytest.mark.parametrize("seed,specs,extra,opts,delay", CASES, ids=[f"seed{c[0]}-{c[1]}" for c in CASES])
def test_vllm_answers_hybrid_configs_as_recorded(seed: int, specs: str, extra: dict, opts: dict, delay: int) -> None:
    got, derived = record(seed, specs, extra, opts, delay)
    if os.environ.get("KVOFFLOAD_RECORD_HYBRID") == "1":
        write_case(corpus_path(seed, specs), seed, specs, extra, opts, delay, got, derived)
    want = read_corpus(seed, specs)
    assert (want["extra"], want["opts"], want["delay"]) == (extra, opts, delay), "the case changed: record again"
    assert {k: want[k] for k in derived} == derived, "vLLM derives another configuration"
    for n, (w, g) in enumerate(zip(want["steps"], got)):
        assert g == w, f"step {n}: vLLM now {g} != recorded {w}"
    assert len(got) == len(want["steps"]), f"{len(got)} steps != {len(want['steps'])} recorded"


def kvoffload_run(seed: int, specs: str, extra: dict, opts: dict, delay: int) -> list[dict]:
    """kvoffload's connector (its scheduler side, with vLLM's hybrid manager
    on) on the case's workload, per step what the
    corpus records of vLLM's and kvoffload can show: the tokens scheduled,
    the preemptions, each lookup's answer, each load's and store's GPU
    blocks per group, the KV events."""
    common, cfg = engine_options(specs, extra, opts)
    e = with_vllm_flushes(
        build(extra=cfg, fake_worker=kvoffload_worker(delay), tpb=TPB, groups=SPECS[specs](), **common)
    )
    lookups: list[list] = []
    inner = e.connector.get_num_new_matched_tokens

    def lookup(request: Any, num_computed: int, *a: Any, **k: Any) -> Any:
        got = inner(request, num_computed, *a, **k)
        lookups.append([request.request_id, num_computed, request.num_tokens, got[0], got[1]])
        return got

    e.connector.get_num_new_matched_tokens = lookup
    sources: list[list] = []
    alloc = e.connector.update_state_after_alloc

    def update_state_after_alloc(request: Any, blocks: Any, n: int) -> Any:
        got = alloc(request, blocks, n)
        record_sources(e.connector, sources, request, n)
        return got

    e.connector.update_state_after_alloc = update_state_after_alloc
    events = capture_events(e.connector)

    def snapshot(so: Any) -> dict:
        meta = so.kv_connector_metadata
        loads, stores = native.plan_group_transfers(meta.plan)
        got = {
            "scheduled": dict(sorted(so.num_scheduled_tokens.items())),
            "preempted": sorted(so.preempted_req_ids or ()),
            "lookups": lookups[:],
            "sources": sources[:],
            "loads": sorted([meta.load_requests[j], groups] for j, groups in loads),
            "stores": sorted(groups for _, groups in stores),
            "events": [list(ev) for ev in order_free(events)],
        }
        lookups.clear()
        sources.clear()
        events.clear()
        return got

    steps = drive(e, seed, snapshot, opts)
    assert e.connector.scheduler_state()["invariants"] is None
    return json.loads(json.dumps(steps, default=repr))


def single_group_path(specs: str, opts: dict) -> bool:
    """Whether kvoffload plans the case with its single-group scheduler: one
    offloaded group of full attention (or MLA), no draft group (vLLM has
    other groups, which its connector leaves out)."""
    groups = offloaded(SPECS[specs]())
    windowed = (SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)
    return len(groups) == 1 and not isinstance(groups[0], windowed) and not opts.get("eagle_groups")


def first_index_modulus(specs: str, extra: dict, opts: dict) -> int | None:
    """`comparable`'s ``first_mod`` for a case: its blocks a chunk where
    kvoffload plans it with its single-group scheduler, else ``None``."""
    return case_blocks_per_chunk(extra) if single_group_path(specs, opts) else None


def comparable(step: dict, first_mod: int | None = None) -> dict:
    """A recorded step of vLLM's as `kvoffload_run` records kvoffload's
    (lookups without the key states vLLM showed, stores without their
    request: kvoffload's plan names a store's blocks, not its request).
    `first_mod`: kvoffload's single-group scheduler names a transfer's
    start by its offset in its first chunk (all the workers read of vLLM's
    first block index: that index modulo blocks a chunk), so vLLM's index is
    taken modulo `first_mod`."""
    if step.get("idle"):
        return step

    def spans(per_group: list[list[int]]) -> list[list[int]]:
        if first_mod is None:
            return per_group
        return [[first % first_mod, *blocks] for first, *blocks in per_group]

    return {
        "scheduled": step["scheduled"],
        "preempted": step["preempted"],
        "lookups": [lk[:5] for lk in step["lookups"]],
        "sources": step["sources"],
        "loads": [[rid, spans(groups)] for rid, groups in step["loads"]],
        "stores": sorted(spans(groups) for _, groups in step["stores"]),
        "events": step["events"],
    }


@pytest.mark.parametrize("seed,specs,extra,opts,delay", CASES, ids=[f"seed{c[0]}-{c[1]}" for c in CASES])
def test_kvoffload_answers_as_vllm_on_hybrid_configs(seed: int, specs: str, extra: dict, opts: dict, delay: int) -> None:
    """Step for step, kvoffload's scheduler side does what vLLM's connector
    did on the recorded case: the same lookups answered, the same loads and
    stores of the same blocks in every group, the same KV events."""
    want = [comparable(st, first_index_modulus(specs, extra, opts)) for st in read_corpus(seed, specs)["steps"]]
    got = kvoffload_run(seed, specs, extra, opts, delay)
    for n, (w, g) in enumerate(zip(want, got)):
        assert g == w, f"step {n}: kvoffload {g} != vLLM {w}"
    assert len(got) == len(want), f"{len(got)} steps != vLLM's {len(want)}"


def partial_tail_case(specs: str, opts: dict) -> bool:
    """Whether a case has vLLM's partial tails: a Mamba group, and block
    hashes finer than its blocks."""
    groups = SPECS[specs]()
    return bool(opts.get("hash_tokens")) and any(
        isinstance(s, MambaSpec) and s.block_size > opts["hash_tokens"] for s in groups
    )


def window_chunks(tokens: int, tokens_per_chunk: int) -> int:
    """vLLM's ``get_sliding_window_size_in_chunks`` (no extra retained tokens)."""
    return -(-(tokens - 1) // tokens_per_chunk) if tokens > 1 else 1


@pytest.mark.parametrize("seed,specs,extra,opts,delay", CASES, ids=[f"seed{c[0]}-{c[1]}" for c in CASES])
def test_recorded_hybrid_runs_follow_the_documented_rules(
    seed: int, specs: str, extra: dict, opts: dict, delay: int
) -> None:
    """docs/hybrid-groups.md's rules, checked on the corpus (vLLM's answers)."""
    steps = read_corpus(seed, specs)["steps"]
    groups = offloaded(SPECS[specs]())
    bpc = case_blocks_per_chunk(extra)
    # Each group's chunk is bpc of its own blocks; a hit ends where every
    # group's hit ends, on one group's chunk boundary (groups of different
    # block sizes: not always the full-attention group's).
    align = math.gcd(*(block_tokens(s, opts) * bpc for s in groups))
    hits = [lk for st in steps for lk in st.get("lookups", ()) if lk[3]]
    loads = [ld for st in steps for ld in st.get("loads", ())]
    stores = [sd for st in steps for sd in st.get("stores", ())]
    # The run exercises what the plan needs (the fixed cases).
    assert hits and loads, "no hit or load in the workload"
    for g in range(len(groups)):
        assert any(len(sd[1][g]) > 1 for sd in stores), f"group {g} never stored"
    # A sliding-window (or chunked-local, Mamba or draft) group makes the
    # hit leave the last token to compute; full-attention groups alone may
    # hit every token.
    windowed = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)) for s in groups)
    last = 1 if windowed or opts.get("eagle_groups") else 0
    # Mamba states inside a block (vLLM's partial tails, with hashes finer
    # than the blocks): a hit may also end on a hash boundary inside the
    # block after its complete chunks.
    partial = partial_tail_case(specs, opts)
    for rid, computed, num_tokens, hit, *_ in hits:
        assert computed + hit <= num_tokens - last, (rid, computed, num_tokens, hit)
        # On a chunk boundary (of the group of the smallest chunks), or at
        # that last token (not aligned).
        end = computed + hit
        if partial and end % align:
            assert end % opts["hash_tokens"] == 0, (rid, computed, num_tokens, hit)
            continue
        assert end % align == 0 or end == num_tokens - 1, (rid, computed, num_tokens, hit)
        assert hit >= align, "a hit is at least one chunk"
    for st in steps:
        # A load answers the step's last lookup of its request.
        hit_of = {lk[0]: (lk[1], lk[3]) for lk in st.get("lookups", ()) if lk[3]}
        for rid, per_group in st.get("loads", ()):
            computed, hit = hit_of[rid]
            for g, (first, *blocks) in enumerate(per_group):
                spec = groups[g]
                tpb = block_tokens(spec, opts)
                tpc = tpb * bpc
                end = -(-(computed + hit) // tpb)
                # Every group's load ends at the hit's end.
                assert first + len(blocks) == end, (rid, g, computed, hit, per_group)
                if isinstance(spec, SlidingWindowSpec):
                    # A sliding-window group loads its window only (one chunk
                    # more where the window's start is not chunk-aligned).
                    retained = spec.sliding_window + spec.extra_retained_tokens
                    limit = (window_chunks(retained, tpc) + 1) * bpc
                    assert len(blocks) <= limit, (rid, g, per_group)
                elif isinstance(spec, ChunkedLocalAttentionSpec):
                    # A chunked-local group loads its attention chunk's worth.
                    limit = -(-spec.attention_chunk_size // tpc) * bpc + 1
                    assert len(blocks) <= limit, (rid, g, per_group)
                elif isinstance(spec, MambaSpec):
                    # A Mamba group loads one block: the state at the hit's
                    # end, which is on one of its chunks (or, a partial
                    # tail, on a hash boundary inside one).
                    unit = opts["hash_tokens"] if partial else tpc
                    assert len(blocks) == 1 and (computed + hit) % unit == 0, (rid, g, computed, hit, per_group)
                else:
                    # A full-attention group loads everything past the GPU hit.
                    assert first == computed // tpb, (rid, g, computed, per_group)


def test_vllm_keeps_its_hybrid_manager_on_for_kvoffload() -> None:
    """The package's connector declares ``SupportsHMA``: vLLM's config
    leaves its hybrid KV cache manager on (else it turns it off and
    allocates every layer for all tokens)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ktc = KVTransferConfig(kv_connector="KvOffloadConnector", kv_connector_module_path="kvoffload.vllm", kv_role="kv_both")
    assert KVConnectorFactory.supports_hma_config(ktc)


def test_corpus_has_self_describing_payloads_for_full_attention_only() -> None:
    """The self-describing cases hold what the comparison above checks:
    full-attention chunks with their tokens, sliding-window chunks as
    placeholders carrying their group's kind and window."""
    kinds = set()
    for seed, specs, extra, _, _ in CASES:
        if not extra.get("self_describing_kv_events"):
            continue
        for st in read_corpus(seed, specs)["steps"]:
            for name, fields in st.get("events", []):
                f = dict(fields)
                if name == "BlockStored":
                    kinds.add((f["kv_cache_spec_kind"], bool(f["token_ids"]), f["kv_cache_spec_sliding_window"] is not None))
    assert ("full_attention", True, False) in kinds, kinds
    assert ("sliding_window", False, True) in kinds, kinds
    assert ("sliding_window", True, True) not in kinds, kinds


def test_corpus_has_hits_partly_not_from_the_host_tier() -> None:
    """Somewhere (windows only) a hit's history before the windows is
    loaded from no chunk: vLLM counts it ``external_unspecified``, and the
    comparison above checks kvoffload's split against it."""
    splits = [
        src[2]
        for seed, specs, *_ in CASES
        for st in read_corpus(seed, specs)["steps"]
        for src in st.get("sources", ())
    ]
    assert splits, "no hit source recorded"
    assert any("external_unspecified" in sp for sp in splits), "every hit entirely from host chunks"


def test_corpus_has_windowed_loads() -> None:
    """Somewhere a sliding-window group loads its window and not the blocks
    past the GPU's hit before it (what a full-attention group would load)."""
    windowed = 0
    for seed, specs, *_ in CASES:
        groups = offloaded(SPECS[specs]())
        sw = [g for g, s in enumerate(groups) if isinstance(s, SlidingWindowSpec)]
        for st in read_corpus(seed, specs)["steps"]:
            computed = {lk[0]: lk[1] // TPB for lk in st.get("lookups", ()) if lk[3]}
            windowed += sum(
                1 for rid, per_group in st.get("loads", ()) for g in sw if per_group[g][0] > computed[rid]
            )
    assert windowed >= 10, windowed


def valid_cap(params: dict | None, name: str) -> int | None:
    """A `kv_transfer_params` cap as vLLM reads it (a non-negative int)."""
    raw = (params or {}).get(name)
    return raw if type(raw) is int and raw >= 0 else None


def test_corpus_requests_keep_within_their_kv_transfer_params() -> None:
    """In the cases with ``kv_transfer_params``, vLLM keeps every request
    within its caps, and the caps bind (the comparison above checks
    kvoffload against these runs): a hit loads at most ``max_load_tokens``
    past the GPU's hit, and no group stores a chunk past
    ``max_offload_tokens``."""
    loads_capped = stores_capped = ignored = 0
    for seed, specs, extra, opts, _ in CASES:
        if not opts.get("params"):
            continue
        case = read_corpus(seed, specs)
        params = case["kv_transfer_params"]
        assert params == case_params(seed, opts), "the params changed: record again"
        tpcs = [shape["tokens_per_chunk"] for shape in case["shapes"]]
        ignored += sum(
            1 for p in params.values() for k in ("max_load_tokens", "max_offload_tokens")
            if k in p and valid_cap(p, k) is None
        )
        for st in case["steps"]:
            for rid, computed, _, hit, *_ in st.get("lookups", ()):
                cap = valid_cap(params.get(rid), "max_load_tokens")
                if cap is not None and hit is not None:
                    assert hit <= cap, (seed, rid, computed, hit, cap)
                    loads_capped += 1
            for rid, _, prompt, _, groups in st.get("store_inputs", ()):
                cap = valid_cap(params.get(rid), "max_offload_tokens")
                if cap is None:
                    continue
                for tpc, (_, storable, _, _) in zip(tpcs, groups):
                    assert storable <= cap // tpc, (seed, rid, storable, cap, tpc)
                stores_capped += cap < prompt
    assert loads_capped >= 100 and stores_capped >= 100 and ignored >= 10, (loads_capped, stores_capped, ignored)


def test_corpus_holds_every_case_and_nothing_else() -> None:
    want = {corpus_path(c[0], c[1]).name for c in CASES}
    have = {p.name for p in CORPUS.glob("*")}
    assert have == want, f"corpus files {sorted(have ^ want)} do not match the cases"



@pytest.mark.parametrize(
    "specs,extra,opts",
    sorted({(c[1], json.dumps(c[2], sort_keys=True), json.dumps(c[3], sort_keys=True)) for c in CASES}),
)
def test_the_tier_facts_are_vllms_on_every_hybrid_config(specs: str, extra: str, opts: str) -> None:
    """The CPU tier's facts (vLLM's ``kv_offload_config_info``: chunks,
    blocks a chunk, bytes, and the tokens it holds at ``max_model_len``,
    where a windowed group counts its window's chunks only) are what vLLM's
    own connector reports for the same configuration."""
    common, cfg = engine_options(specs, json.loads(extra), json.loads(opts))
    theirs = build(
        connector="OffloadingConnector", module=None, extra=cfg, fake_worker=vllm_worker(0),
        tpb=TPB, groups=SPECS[specs](), **common,
    )
    ours = build(extra=cfg, tpb=TPB, groups=SPECS[specs](), **common)
    assert [ours.connector._scheduler.info] == theirs.connector.connector_scheduler.manager.config_info()
