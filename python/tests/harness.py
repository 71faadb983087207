"""An engine loop for the connector tests: vLLM's real core ``Scheduler`` (or
``AsyncScheduler``) with a KV connector loaded by module path, ``world_size``
worker-role connectors in this process over CPU tensors as their KV caches,
and a fake model runner that writes deterministic KV bytes for every token it
computes (a function of the token, its position and the layer), so a test can
check that KV restored from the host tier equals what was computed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from unittest import mock
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.forward_context import ForwardContext  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

MODEL = "facebook/opt-125m"
EOS = 2
HEADS = 2
HEAD_SIZE = 4


def kv_value(token: int, position: int, layer: int) -> float:
    """The KV value the fake model writes for a token (exact in float32)."""
    return float((token * 7919 + position * 104729 + layer * 1299709) % (1 << 20)) / 16.0


def draft_kv_value(token: int, next_token: int, position: int, layer: int) -> float:
    """The KV value an EAGLE/MTP drafter writes at a position: a function
    of the token there and of the next one (the drafter reads the target's
    hidden state at the position with the embedding of the next token), so
    a block's last position holds another value before its next token is
    known, or after another next token (exact in float32)."""
    return float((token * 7919 + next_token * 6007 + position * 104729 + layer * 1299709 + 524287) % (1 << 20)) / 16.0


def state_value(req: Request, p: int, layer: int) -> float:
    """The recurrent state the fake model keeps after position `p` of a
    request in a Mamba layer: a function of every token up to `p` (so a
    state of another prefix, or of another position, differs), exact in
    float32."""
    h = 0
    for i in range(p + 1):
        h = (h * 31 + Engine.token_at(req, i) * 7 + 1) % (1 << 20)
    return float((h + layer * 1299709 + p * 104729) % (1 << 20)) / 16.0


@dataclass
class Engine:
    """vLLM's scheduler, its connector, the workers and a fake model."""

    scheduler: Any
    workers: list[Any]
    caches: list[dict[str, torch.Tensor]]
    #: Per KV group, its layers (one group but for a hybrid engine; the
    #: groups' layers overlay the same tensors, as vLLM overlays them).
    group_layers: list[list[str]]
    tpb: int
    async_scheduling: bool
    aggregator: KVOutputAggregator
    hasher: Any
    next_id: int = 0
    pending: tuple[Any, Any] | None = None
    #: Requests that were restored from the host tier (a load finished).
    loaded: set[str] = field(default_factory=set)
    #: Requests whose load failed or stalled (reported to vLLM as failed).
    failed: set[str] = field(default_factory=set)
    steps: int = 0
    #: Called with each worker's metadata before the worker hooks (fault injection).
    on_worker_meta: Any = None
    #: Workers the scheduler counts (`world_size`).
    world: int = 1
    #: In place of the worker connectors (a scheduler-only engine): called as
    #: ``fake_worker(worker, metadata)``, returns ``(finished_recving, worker_meta)``.
    fake_worker: Any = None
    #: A remote tier is configured: each step first waits for the
    #: scheduler's remote lookups, and each worker for its fetches and puts,
    #: so what a run decides does not depend on the I/O threads' timing.
    remote: bool = False
    #: Per KV group, its tokens a block (empty: `tpb` for every group).
    block_sizes: list[int] = field(default_factory=list)
    #: Every worker holds the same KV (vLLM's MLA replicated on every
    #: tensor-parallel rank): the fake model writes the same bytes on every
    #: worker; else worker `w` writes them plus `w`, so a worker that loaded
    #: another's bytes is caught.
    replicated: bool = False
    #: The model's KV heads, split over the workers as tensor parallelism
    #: splits them (0: not modelled): the fake model writes each head's
    #: value plus the head's index in the model, so that a worker's heads
    #: read back are the same bytes whatever split wrote them.
    kv_heads: int = 0
    #: vLLM's ``decode_context_parallel_size``: worker `w` (DCP rank
    #: ``w % dcp``) holds the tokens ``p`` with ``p % dcp`` its rank, in
    #: blocks of the group's ``tpb * dcp`` tokens (full-attention groups:
    #: vLLM runs DCP with those only).
    dcp: int = 1
    #: The KV groups that are not prefix-cacheable (vLLM's connector leaves
    #: them out), each ``True`` for a circular buffer (one block a request,
    #: token ``p`` at slot ``p % block_size``): per-request scratch, written
    #: by the model and never restored. Their blocks are checked to hold
    #: what the model last wrote there for the request (nothing else writes
    #: them).
    scratch_groups: dict[int, bool] = field(default_factory=dict)
    #: What the model last wrote in scratch groups: ``(request, group,
    #: index in its block table) -> (block, {slot: (token, position)})``,
    #: since the request last got its blocks (a preempted request gives
    #: them back: another request may write them before it resumes, even
    #: if it gets the same block again).
    scratch_written: dict[tuple[str, int, int], tuple[int, dict[int, tuple[int, int]]]] = field(
        default_factory=dict
    )
    #: The Mamba groups (vLLM's ``MambaSpec`` in align mode): per request
    #: one recurrent state, which the fake model reads at the start of each
    #: step from the block holding the state after the tokens computed so
    #: far (index ``(computed - 1) // block_size``; restored from the host
    #: tier or the GPU prefix cache, or written by the previous step), checks
    #: it, and writes the state after its last token into the block of that
    #: token (vLLM's align mode), its whole page.
    state_groups: frozenset[int] = frozenset()
    #: The Mamba groups whose layers export a prefill checkpoint (vLLM's
    #: ``num_prefill_checkpoint_blocks``, set by Mamba2 and GDN layers):
    #: their ``(prefill_checkpoint_alignment, hash block, cache-hit
    #: alignment)``. In a step that reaches the checkpoint, the fake model
    #: also writes the state there, into the block vLLM's own rule names
    #: (its ``compute_mamba_prefill_checkpoints``, as a backend calls it).
    checkpoints: dict[int, tuple[int | None, int, int]] = field(default_factory=dict)
    #: States the fake model read and found right.
    states_checked: int = 0
    #: Of those, the states it had not written itself for the request (the
    #: host tier's loads and the GPU prefix cache's hits).
    states_restored: int = 0
    #: Of those, the states after a number of tokens inside a block (vLLM's
    #: partial tails, with block hashes finer than the blocks).
    states_restored_inside_block: int = 0
    #: Prefill checkpoints the fake model wrote.
    checkpoints_written: int = 0
    #: Blocks copied as vLLM's scheduler asked (``kv_cache_block_copies``).
    block_copies: int = 0
    #: Copies whose source block another request computes in the same
    #: step (vLLM 0.33.0's copy-on-write of a partial prefix-cache hit
    #: reads a block cached at schedule time, before the step's forward
    #: writes it: the copy holds stale bytes): ``(request given the copy,
    #: destination block)`` -> ``(step, source block, the request computing
    #: it)``.
    copies_before_computed: dict[tuple[str, int], tuple[int, int, str]] = field(default_factory=dict)
    #: Per request and Mamba group, the tokens after which the fake model
    #: last wrote its state.
    state_ends: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Speculative decoding: draft tokens the fake model accepted, and those
    #: it rejected (their KV, written at their positions, is wrong until the
    #: position is computed again).
    drafts_accepted: int = 0
    drafts_rejected: int = 0
    #: Speculative decoding with Mamba groups: per request and group, the
    #: index in the group's block table of the block holding the state
    #: after the request's computed tokens, where vLLM's model runner keeps
    #: it after a step with drafts (a speculative column); absent: the
    #: block of its last computed token, as align mode keeps it.
    state_index: dict[tuple[str, int], int] = field(default_factory=dict)
    #: States after a rejected draft the fake model wrote (each marked
    #: wrong: a check reading one fails).
    states_after_rejected_drafts: int = 0
    #: Requests that stopped inside the tokens sampled in a step (accepted
    #: drafts past the stop: vLLM drops them and rolls the computed tokens
    #: back to the last token but one).
    finished_past_stop: int = 0
    #: The KV groups of an EAGLE drafter's layers, run for real (`build`'s
    #: ``spec_method="eagle"``): the fake drafter writes them after each
    #: step's sampling (`_draft`), each position's value a function of its
    #: token and the next (`draft_kv_value`).
    drafter_groups: frozenset[int] = frozenset()
    #: Per position and the tokens up to it (``(p, hash of tokens 0..p)``),
    #: the next tokens the fake drafter computed it with as a request's
    #: true next token (`_draft`).
    drafter_next_tokens: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    #: Drafter KV found at a block's last position computed for the same
    #: tokens but another next token: a cached or loaded block whose own
    #: key covers only its tokens, kept from the request that computed it
    #: first (vLLM's drafter groups: its hit rule proves the next token
    #: against the next block's key, which another request may have
    #: stored). vLLM accepts it (a stale drafter value only lowers the
    #: drafts' acceptance: the target verifies every draft); the checks
    #: note each ``(request, group, position, block)`` found so
    #: (`_check_slot`), and fail on any other value.
    stale_drafter_tails: set[tuple[str, int, int, int]] = field(default_factory=set)
    #: This step's requests: their scheduled tokens, and where the model
    #: computes them (`_span`).
    scheduled: dict[str, int] = field(default_factory=dict)
    spans: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    #: Per request, the tokens whose KV the model has computed right after
    #: its last step (under async speculative decoding vLLM's scheduler
    #: counts more: the step in flight's drafts, rejected or not).
    true_computed: dict[str, int] = field(default_factory=dict)
    #: The requests of the last step whose drafts the model rejected, and
    #: how many (their scheduled count reaches that far past their KV until
    #: the scheduler has the step's output).
    rejected_last_step: dict[str, int] = field(default_factory=dict)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(
        self,
        tokens: list[int],
        max_tokens: int = 4,
        req_id: str | None = None,
        skip_cache: bool = False,
        kv_transfer_params: dict | None = None,
        priority: int = 0,
        stop_after: int | None = None,
    ) -> str:
        """Adds a request; `skip_cache`: it must not read cached KV (vLLM's
        ``skip_reading_prefix_cache``, as for prompt logprobs);
        `kv_transfer_params`: the request's, as a client sends them;
        `priority`: under the priority policy, lower runs first;
        `stop_after`: a stop token, the one the fake model samples as the
        request's output token of that index (it stops there, or at an
        earlier output token that happens to be the same)."""
        rid = req_id or f"r{self.next_id}"
        self.next_id += 1
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            skip_reading_prefix_cache=skip_cache or None,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None,
            stop_token_ids=None if stop_after is None else [self.sampled_token(tokens, len(tokens) + stop_after)],
        )
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            mm_features=None,
            block_hasher=self.hasher,
            priority=priority,
        )
        self.scheduler.add_request(req)
        return rid

    @staticmethod
    def token_at(req: Request, p: int) -> int:
        """The token at position `p`: the prompt's, then what the fake model
        samples there (a function of the request and the position, never EOS,
        so the model knows it before the scheduler has recorded it, as a real
        model does under async scheduling)."""
        prompt = req.prompt_token_ids
        if p < len(prompt):
            return prompt[p]
        return Engine.sampled_token(prompt, p)

    @staticmethod
    def sampled_token(prompt: list[int], p: int) -> int:
        """What the fake model samples at position `p` (past the prompt)
        of a request with prompt `prompt`."""
        return 10 + (hash((prompt[0], len(prompt), p)) % 1000)

    @property
    def spec_tokens(self) -> int:
        """Draft tokens a step (vLLM's ``num_speculative_tokens``; 0: no
        speculative decoding)."""
        return self.scheduler.num_spec_tokens

    @staticmethod
    def draft_at(req: Request, p: int) -> int:
        """The fake drafter's guess of the token at position `p` (a
        function of the request and the position, as `token_at`): right
        about two times in three, else another token (never EOS)."""
        t = Engine.token_at(req, p)
        if hash((req.prompt_token_ids[0], len(req.prompt_token_ids), p, 1)) % 3:
            return t
        return 10 + (t - 10 + 1 + p % 7) % 1000

    def _span(self, so: Any, rid: str, req: Request) -> tuple[int, list[int]]:
        """Where the model computes request `rid` in this step, as vLLM's
        model runner does: ``(start, drafts)``, its first position and the
        draft tokens at its last positions.

        schedule() has counted the step's tokens as computed. Under async
        scheduling the scheduler also counts the drafts of the step still
        in flight as accepted, and schedules placeholders: the model runner
        knows on the GPU how many of the last step's drafts it rejected,
        starts that much earlier (``update_num_computed_tokens_for_batch_change``),
        and computes the drafts its drafter proposed after the last step."""
        drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
        start = req.num_computed_tokens - so.num_scheduled_tokens[rid]
        if self.async_scheduling and self.spec_tokens:
            # Only a request in the last step has drafts not yet rolled back
            # (one resumed or new in this step was not in it).
            start -= self.rejected_last_step.get(rid, 0)
            first = start + so.num_scheduled_tokens[rid] - len(drafts)
            drafts = [self.draft_at(req, first + i) for i in range(len(drafts))]
        return start, drafts

    def _first_draft(self, rid: str) -> int:
        """The position of the first draft the model computes for `rid` in
        this step (past its last position when it has none)."""
        start, drafts = self.spans[rid]
        return start + self.scheduled[rid] - len(drafts)

    def _input_token(self, rid: str, req: Request, p: int) -> int:
        """The token the fake model computes at position `p` in this step:
        the request's (its prompt, or what was sampled), or at the step's
        last positions the drafts scheduled there (speculative decoding: a
        rejected draft's KV is written at its position, as a real model
        writes it)."""
        drafts = self.spans[rid][1]
        first_draft = self._first_draft(rid)
        if p < first_draft:
            return self.token_at(req, p)
        return drafts[p - first_draft]

    def _sampled(self, rid: str, req: Request) -> list[int]:
        """The tokens the fake model samples for `req` in this step: none
        for a prefill chunk; else the token after the request's tokens and,
        with drafts scheduled, one more for each draft accepted in a row
        (vLLM's rejection sampler: a draft is accepted where it equals the
        token sampled at its position). Records the request's tokens of
        right KV (`true_computed`) and its rejected drafts."""
        drafts = self.spans[rid][1]
        first = self._first_draft(rid)
        if req.is_prefill_chunk:
            self.true_computed[rid] = first
            return []
        accepted = self.accepted_drafts(req, first, drafts)
        self.drafts_accepted += accepted
        self.drafts_rejected += len(drafts) - accepted
        self.true_computed[rid] = first + accepted
        if len(drafts) > accepted:
            self.rejected_last_step[rid] = len(drafts) - accepted
        return [self.token_at(req, first + i) for i in range(accepted + 1)]

    @staticmethod
    def accepted_drafts(req: Request, first: int, drafts: Any) -> int:
        """How many of `drafts` (guesses of the tokens at positions
        `first`, `first + 1`, ...) vLLM's rejection sampler accepts: those
        equal to the token sampled at their position, in a row."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == Engine.token_at(req, first + accepted):
            accepted += 1
        return accepted

    def _propose_drafts(self, so: Any) -> None:
        """The fake drafter after a step (synchronous scheduling): up to
        `spec_tokens` drafts for each request the step scheduled that still
        runs (none for some, fewer for others, as an n-gram drafter finds
        them), handed to vLLM's scheduler as the model runner hands them."""
        ids, drafts = [], []
        for rid in so.num_scheduled_tokens:
            req = self.scheduler.requests.get(rid)
            if req is None or req.is_finished():
                continue
            n = req.num_tokens
            # An EAGLE drafter always drafts its number; an n-gram one finds
            # fewer, or none.
            count = self.spec_tokens if self.drafter_groups else hash((req.prompt_token_ids[0], n, 2)) % (self.spec_tokens + 2)
            ids.append(rid)
            drafts.append([self.draft_at(req, n + i) for i in range(min(count, self.spec_tokens))])
        if ids:
            self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))

    def _worker_offset(self, w: int) -> Any:
        """What worker `w` adds to every value the model writes (0 for all
        with replicated KV; with `kv_heads`, each of its heads' index in the
        model, a column that broadcasts over a slot's ``(2, heads, head)``)."""
        if self.kv_heads:
            tp = len(self.workers) or self.world
            if self.kv_heads >= tp:
                local = self.kv_heads // tp
                return torch.arange(w * local, (w + 1) * local, dtype=torch.float32).unsqueeze(1)
            return torch.tensor([[float(w // (tp // self.kv_heads))]])
        return 0 if self.replicated else w

    def group_tpb(self, group: int) -> int:
        """Group `group`'s tokens a block (vLLM gives groups of smaller
        pages larger blocks, so every group has one page size)."""
        return self.block_sizes[group] if self.block_sizes else self.tpb

    def _layer_ordinal(self, group: int, index: int) -> int:
        """The layer's number across every group (the fake model writes
        each group's layers apart, so a block moved as another group's
        shows)."""
        return group * len(self.group_layers[0]) + index

    def _compute(self, so: Any) -> None:
        """The fake model: writes the KV of every scheduled token, in every
        KV group."""
        afresh = {r.req_id for r in so.scheduled_new_reqs} | so.scheduled_cached_reqs.resumed_req_ids
        if self.scratch_groups:
            # A request scheduled afresh (new, or resumed after a
            # preemption) has new blocks: what it wrote before is gone.
            self.scratch_written = {k: v for k, v in self.scratch_written.items() if k[0] not in afresh}
        if self.state_index:
            # vLLM's model runner forgets where a preempted request's state
            # was (`cleanup_mamba_state_idx`): it starts again from the
            # block of its last computed token.
            self.state_index = {k: v for k, v in self.state_index.items() if k[0] not in afresh}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
            start = self.spans[rid][0]
            for g, layers in enumerate(self.group_layers):
                table, tpb = tables[g], self.group_tpb(g)
                if g in self.scratch_groups:
                    self._compute_scratch(so, rid, req, g, layers, table, range(start, start + n))
                    continue
                if g in self.drafter_groups:
                    continue
                if g in self.state_groups:
                    if self.spec_tokens:
                        self._compute_state_speculative(so, rid, req, g, layers, table, start, start + n)
                    else:
                        self._compute_state(rid, req, g, layers, table, start, start + n)
                    continue
                for p in range(start, start + n):
                    t = self._input_token(rid, req, p)
                    for w, block, slot in self._places(table, tpb, p):
                        assert block != 0, f"{rid}: token {p} of group {g} computed into the null block"
                        for li, name in enumerate(layers):
                            v = kv_value(t, p, self._layer_ordinal(g, li)) + self._worker_offset(w)
                            self.caches[w][name][block, :, slot] = v

    def _draft(self, rid: str, req: Request) -> None:
        """The fake EAGLE drafter after the step's sampling, in the drafter
        groups: at each position the step computed right, the value of its
        token and the next (the last one's next token is the one just
        sampled, or the next prompt token mid-prefill); past them (the
        positions of rejected drafts, and those of the drafts it proposes
        for the next step) values of guessed tokens, which the steps that
        compute those positions right write again."""
        start, drafts = self.spans[rid]
        right = self.true_computed[rid]
        end = max(start + self.scheduled[rid], right + self.spec_tokens - 1)
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        for g in sorted(self.drafter_groups):
            table, tpb, layers = tables[g], self.group_tpb(g), self.group_layers[g]
            for p in range(start, end):
                if p // (tpb * self.dcp) >= len(table):
                    break
                if p < right:
                    t, nxt = self.token_at(req, p), self.token_at(req, p + 1)
                    self.drafter_next_tokens.setdefault((p, self._prefix_key(req, p)), set()).add(nxt)
                else:
                    t = self.token_at(req, p) if p == right else self.draft_at(req, p)
                    nxt = self.draft_at(req, p + 1)
                for w, block, slot in self._places(table, tpb, p):
                    if block == 0:
                        # No block there (a window's null block).
                        continue
                    for li, name in enumerate(layers):
                        v = draft_kv_value(t, nxt, p, self._layer_ordinal(g, li)) + self._worker_offset(w)
                        self.caches[w][name][block, :, slot] = v

    @staticmethod
    def _prefix_key(req: Request, p: int) -> int:
        """The request's tokens up to position `p`, as one number."""
        return hash(tuple(Engine.token_at(req, i) for i in range(p + 1)))

    def _stale_drafter_tail(self, req: Request, g: int, p: int, layer: int, got: float) -> bool:
        """Whether `got`, found at position `p` of drafter group `g` (in
        layer `layer`, less the worker's offset) where it is the last
        position of a block, is the drafter's value for the request's
        tokens up to `p` computed with another request's true next token
        (`stale_drafter_tails`)."""
        if (p + 1) % (self.group_tpb(g) * self.dcp) != 0:
            return False
        seen = self.drafter_next_tokens.get((p, self._prefix_key(req, p)), ())
        t = self.token_at(req, p)
        return any(draft_kv_value(t, nxt, p, layer) == got for nxt in seen)

    def _state_block(self, g: int, table: list[int], end: int) -> int:
        """The block of a Mamba group holding the state after `end` tokens
        (0 where the table has none there)."""
        idx = (end - 1) // self.group_tpb(g)
        return table[idx] if idx < len(table) else 0

    def _check_state(self, what: str, req: Request, g: int, layers: list[str], block: int, end: int) -> None:
        """`block` holds the state after the first `end` tokens of `req`
        in every layer of Mamba group `g`, on every worker."""
        for w in range(len(self.workers)):
            for li, name in enumerate(layers):
                got = self.caches[w][name][block]
                want = state_value(req, end - 1, self._layer_ordinal(g, li)) + self._worker_offset(w)
                assert torch.all(got == want), (
                    f"{what}: Mamba state after {end} tokens (block {block}) of layer {name} on worker {w}: "
                    f"{got.flatten()[:4].tolist()} != {want}"
                )

    def _compute_state(self, rid: str, req: Request, g: int, layers: list[str], table: list[int], start: int, end: int) -> None:
        """The fake model in a Mamba group (see `state_groups`): reads the
        state after `start` tokens, checks it, and writes the state after
        `end` tokens."""
        if start > 0:
            block = self._state_block(g, table, start)
            assert block != 0, f"{rid}: no block holds its Mamba state after {start} tokens in group {g}"
            self._check_state(f"{rid}: step from {start}", req, g, layers, block, start)
            self.states_checked += 1
            restored = self.state_ends.get((rid, g)) != start
            self.states_restored += restored
            self.states_restored_inside_block += restored and start % self.group_tpb(g) != 0
        self.state_ends[(rid, g)] = end
        block = self._state_block(g, table, end)
        assert block != 0, f"{rid}: Mamba state after {end} tokens of group {g} computed into the null block"
        writes = [(block, end)]
        checkpoint = self._checkpoint(rid, g, table, start, end)
        if checkpoint is not None:
            writes.append(checkpoint)
        for block, at in writes:
            self._write_state(req, g, layers, block, at)

    def _write_state(self, req: Request, g: int, layers: list[str], block: int, at: int, wrong: bool = False) -> None:
        """Writes the state after the request's first `at` tokens into
        `block` of Mamba group `g`, its whole page, on every worker;
        `wrong`: marked wrong (states are multiples of 1/16: a marked one
        is none), as a state after a rejected draft."""
        for w in range(len(self.workers)):
            for li, name in enumerate(layers):
                v = state_value(req, at - 1, self._layer_ordinal(g, li)) + self._worker_offset(w)
                self.caches[w][name][block] = v + (1 / 32 if wrong else 0)

    def _checkpoint(self, rid: str, g: int, table: list[int], start: int, end: int) -> tuple[int, int] | None:
        """A Mamba2/GDN group's prefill checkpoint in a step computing
        tokens `start` to `end` (vLLM's ``compute_mamba_prefill_checkpoints``,
        as a backend calls it): ``(block, tokens)``, the block vLLM names
        and the tokens the state there follows, or ``None``."""
        if g not in self.checkpoints:
            return None
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        alignment, hash_block, hit_alignment = self.checkpoints[g]
        # An EAGLE drafter's rules drop the last block of a hit (vLLM's
        # checkpoint builder follows them: `drop_eagle_block`).
        offsets, cols = compute_mamba_prefill_checkpoints(
            [end], [end - start], hash_block, self.group_tpb(g), alignment, bool(self.drafter_groups), hit_alignment
        )
        if cols[0] < 0:
            return None
        at = start + offsets[0]
        # At a block boundary, the block ending there (with an EAGLE
        # drafter's drop, also the boundary a block before the step's
        # last, in the block after it); with hashes finer than the blocks,
        # a block vLLM reserves (and keys at the checkpoint) where the
        # prefill ends, elsewhere the null block, where vLLM's model runner
        # writes it (`_gather_checkpoint_state_indices`): nothing kept.
        past = (0, 1) if self.drafter_groups else (0,)
        assert at % self.group_tpb(g) or cols[0] - (at - 1) // self.group_tpb(g) in past, (rid, start, end, cols)
        if table[cols[0]] == 0:
            return None
        self.checkpoints_written += 1
        return table[cols[0]], at

    def _compute_state_speculative(
        self, so: Any, rid: str, req: Request, g: int, layers: list[str], table: list[int], start: int, end: int
    ) -> None:
        """The fake model in a Mamba group under speculative decoding, as
        vLLM's model runner keeps the state in align mode
        (``preprocess_mamba`` and ``postprocess_mamba_fused_kernel``):

        - the state after `start` tokens is read (and checked) where the
          last step left it (`state_index`);
        - with ``k`` drafts scheduled, the state after the step's first
          ``end - k`` tokens goes to the block of its last scheduled token
          (column 0), the state after each draft to the ``k`` speculative
          blocks past it (columns 1 to ``k``); a state after a rejected
          draft is written marked wrong;
        - after the step, if the accepted tokens reach a block boundary at
          or past column 0's, the state there is copied into the block
          ending there; the state after the accepted tokens stays in its
          column, where the next step reads it."""
        tpb = self.group_tpb(g)
        drafts = self.spans[rid][1]
        if start > 0:
            idx = self.state_index.get((rid, g), (start - 1) // tpb)
            block = table[idx] if idx < len(table) else 0
            assert block != 0, f"{rid}: no block holds its Mamba state after {start} tokens in group {g}"
            self._check_state(f"{rid}: step from {start}", req, g, layers, block, start)
            self.states_checked += 1
            restored = self.state_ends.get((rid, g)) != start
            self.states_restored += restored
            self.states_restored_inside_block += restored and start % tpb != 0
        first = end - len(drafts)
        accepted = self.accepted_drafts(req, first, drafts)
        curr = -(-end // tpb) - 1
        assert curr + len(drafts) < len(table), f"{rid}: {len(drafts)} drafts past the speculative blocks of group {g}"
        for j in range(len(drafts) + 1):
            block = table[curr + j]
            assert block != 0, f"{rid}: Mamba state column {j} of group {g} in the null block"
            wrong = j > accepted
            self.states_after_rejected_drafts += wrong
            self._write_state(req, g, layers, block, first + j, wrong)
        computed = first + accepted
        aligned = computed // tpb * tpb
        index = curr + accepted
        if aligned >= first and aligned > 0:
            dest = aligned // tpb - 1
            for cache in self.caches:
                for name in layers:
                    cache[name][table[dest]] = cache[name][table[curr + aligned - first]].clone()
            if dest == curr:
                index = curr
        self.state_index[(rid, g)] = index
        self.state_ends[(rid, g)] = computed
        # A prefill step (no drafts) of a Mamba2/GDN group also writes its
        # prefill checkpoint, as without speculation.
        checkpoint = None if drafts else self._checkpoint(rid, g, table, start, end)
        if checkpoint is not None:
            self._write_state(req, g, layers, *checkpoint)

    def _places(self, table: list[int], tpb: int, p: int) -> list[tuple[int, int, int]]:
        """Where token `p` lives: ``(worker, block, slot)`` on each worker
        that holds it (every worker, but for decode context parallelism:
        the workers of its DCP rank, in blocks of ``tpb * dcp`` tokens)."""
        if self.dcp == 1:
            block, slot = table[p // tpb], p % tpb
            return [(w, block, slot) for w in range(len(self.workers))]
        span = tpb * self.dcp
        block, slot = table[p // span], (p % span) // self.dcp
        return [(w, block, slot) for w in range(len(self.workers)) if w % self.dcp == p % self.dcp]

    def _scratch_slot(self, g: int, table: list[int], p: int) -> tuple[int, int] | None:
        """Where token `p` of a scratch group lives: ``(index in the block
        table, slot)``, or ``None`` where the group holds no block for it."""
        tpb = self.group_tpb(g)
        idx, slot = (0, p % tpb) if self.scratch_groups[g] else (p // tpb, p % tpb)
        if idx >= len(table) or table[idx] == 0:
            return None
        return idx, slot

    def _compute_scratch(
        self, so: Any, rid: str, req: Request, g: int, layers: list[str], table: list[int], positions: range
    ) -> None:
        """The fake model's writes into a scratch group (see `scratch_groups`)."""
        for p in positions:
            at = self._scratch_slot(g, table, p)
            if at is None:
                continue
            idx, slot = at
            block, t = table[idx], self._input_token(rid, req, p)
            prev = self.scratch_written.get((rid, g, idx))
            slots = prev[1] if prev is not None and prev[0] == block else {}
            slots[slot] = (t, p)
            self.scratch_written[(rid, g, idx)] = (block, slots)
            for w in range(len(self.workers)):
                for li, name in enumerate(layers):
                    self.caches[w][name][block, :, slot] = kv_value(t, p, self._layer_ordinal(g, li)) + self._worker_offset(w)

    def _check_scratch(self, rid: str, g: int, layers: list[str], table: list[int]) -> None:
        """A scratch group's blocks of the request hold what the model last
        wrote there (kvoffload neither stores nor loads them)."""
        for idx, block in enumerate(table):
            written = self.scratch_written.get((rid, g, idx))
            if block == 0 or written is None or written[0] != block:
                continue
            for slot, (t, p) in written[1].items():
                places = [(w, block, slot) for w in range(len(self.workers))]
                self._check_slot(f"{rid}: scratch group {g}, token {p}", g, layers, places, t, p)

    def check_kv(self, rid: str) -> int:
        """Compares the KV of every computed token of a request with what the
        model computes for it, in every KV group (a sliding-window group's
        blocks behind its window are the null block: not checked); returns
        the tokens checked (in group 0)."""
        req = self.scheduler.requests[rid]
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        # Not the drafts of a step whose output the scheduler has yet to see.
        n = min(req.num_computed_tokens, self.true_computed.get(rid, req.num_computed_tokens))
        for g, layers in enumerate(self.group_layers):
            table, tpb = tables[g], self.group_tpb(g)
            if g in self.scratch_groups:
                self._check_scratch(rid, g, layers, table)
                continue
            if g in self.state_groups:
                idx = self.state_index.get((rid, g), (n - 1) // self.group_tpb(g))
                block = table[idx] if n and idx < len(table) else 0
                if block:
                    self._check_state(f"{rid}: after the step", req, g, layers, block, n)
                continue
            nxt = g in self.drafter_groups
            for p in range(n):
                places = [place for place in self._places(table, tpb, p) if place[1] != 0]
                self._check_slot(
                    f"{rid}: token {p}", g, layers, places, self.token_at(req, p), p,
                    self.token_at(req, p + 1) if nxt else None, req if nxt else None,
                )
        return n

    def _check_slot(
        self,
        what: str,
        g: int,
        layers: list[str],
        places: list[tuple[int, int, int]],
        t: int,
        p: int,
        next_token: int | None = None,
        req: Request | None = None,
    ) -> None:
        """Each ``(worker, block, slot)`` of `places` holds token `t` at
        position `p` of group `g`, in every layer (`what` names it); with
        `next_token`, as a drafter group holds it before that token, or
        (request `req`'s block's last position) computed with another
        request's (counted: `stale_drafter_tails`)."""
        for w, block, slot in places:
            for li, name in enumerate(layers):
                got = self.caches[w][name][block, :, slot]
                layer = self._layer_ordinal(g, li)
                value = kv_value(t, p, layer) if next_token is None else draft_kv_value(t, next_token, p, layer)
                want = value + self._worker_offset(w)
                if req is not None and not torch.all(got == want):
                    # One value at every element once the worker's (or each
                    # head's) offset is taken off: a drafter value.
                    base = got - self._worker_offset(w)
                    found = float(base.flatten()[0])
                    if torch.all(base == found) and self._stale_drafter_tail(req, g, p, layer, found):
                        self.stale_drafter_tails.add((req.request_id, g, p, block))
                        continue
                assert torch.all(got == want), (
                    f"{what} (block {block}) of layer {name} on worker {w}: {got.flatten()[:4].tolist()} != {want}"
                )

    def step(self) -> Any:
        """One engine step; returns the scheduler output."""
        self.steps += 1
        if self.remote:
            self.connector._scheduler.core.wait_remote_lookups()
        so = self.scheduler.schedule()
        self.scheduled = dict(so.num_scheduled_tokens)
        self.spans = {r: self._span(so, r, self.scheduler.requests[r]) for r in self.scheduled}
        self.rejected_last_step = {}
        for r in so.finished_req_ids:
            self.true_computed.pop(r, None)
        meta = so.kv_connector_metadata
        outs = []
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        metas = []
        for w, wc in enumerate(self.workers):
            m = copy.deepcopy(meta)
            if self.on_worker_meta is not None:
                self.on_worker_meta(w, m)
            wc.handle_preemptions(m)
            metas.append(m)
        if self.workers:
            # vLLM's model runner: the connector's preemption handling (its
            # flush of stores still reading reallocated blocks) first, then
            # the block copies, then the loads.
            self._copy_blocks(so)
        for wc, m in zip(self.workers, metas):
            wc.bind_connector_metadata(m)
            wc.start_load_kv(ctx)
        if self.workers:
            self._compute(so)
        sampled = [self._sampled(r, self.scheduler.requests[r]) for r in so.num_scheduled_tokens]
        for w, wc in enumerate(self.workers):
            wc.wait_for_save()
            # Every transfer not stalled on purpose has copied by now: which
            # step a job completes in does not depend on thread timing.
            wc._worker.core.settle()
            if self.remote:
                assert wc._worker.core.wait_remote(), "remote fetches or puts still waiting"
            res = wc.get_transfer_results(so.finished_req_ids)
            wmeta = wc.build_connector_worker_meta()
            wc.clear_connector_metadata()
            self.loaded |= res.finished_recving - res.failed_recving
            self.failed |= res.failed_recving
            outs.append(
                self._output(
                    so,
                    sampled,
                    KVConnectorOutput(
                        finished_recving=res.finished_recving or None,
                        failed_recving=res.failed_recving,
                        invalid_block_ids=wc.get_block_ids_with_load_errors(),
                        kv_connector_worker_meta=wmeta,
                    ),
                )
            )
        if self.workers and self.drafter_groups:
            # vLLM's model runner drafts after the connector's hooks of the
            # step (its stores are submitted at the next step's start).
            for rid in so.num_scheduled_tokens:
                self._draft(rid, self.scheduler.requests[rid])
        if self.fake_worker is not None:
            outs = [self._fake_output(so, w, sampled) for w in range(self.world)]
        mro = self.aggregator.aggregate(outs)
        if self.async_scheduling:
            if self.pending is not None:
                self._update(*self.pending)
            self.pending = (so, mro)
        else:
            self._update(so, mro)
            if self.spec_tokens:
                self._propose_drafts(so)
        return so

    def _update(self, so: Any, mro: ModelRunnerOutput) -> None:
        """vLLM's ``update_from_output`` of a step, counting the requests
        that stopped inside the tokens sampled for them (vLLM trims those
        past the stop, in place)."""
        if not self.spec_tokens:
            self.scheduler.update_from_output(so, mro)
            return
        before = [
            (req, req.num_output_tokens + len(mro.sampled_token_ids[mro.req_id_to_index[r]]))
            for r in so.num_scheduled_tokens
            if (req := self.scheduler.requests.get(r)) is not None
        ]
        self.scheduler.update_from_output(so, mro)
        self.finished_past_stop += sum(req.is_finished() and req.num_output_tokens < n for req, n in before)

    def _copy_blocks(self, so: Any) -> None:
        """vLLM's model runner's block copies (``kv_cache_block_copies``,
        before the connector's loads and the forward pass): the Mamba
        manager copies a state it caches inside a block out of the running
        block (copy-on-write), in every layer on every worker."""
        for src, dst in getattr(so, "kv_cache_block_copies", None) or ():
            writer = self._computing_block(src)
            if writer is not None:
                mgr = self.scheduler.kv_cache_manager
                for rid in self.scheduled:
                    if any(dst in table for table in mgr.get_block_ids(rid)):
                        self.copies_before_computed[(rid, dst)] = (self.steps, src, writer)
            for cache in self.caches:
                for layers in self.group_layers:
                    for name in layers:
                        cache[name][dst] = cache[name][src]
            self.block_copies += 1

    def _computing_block(self, block: int) -> str | None:
        """The request that computes tokens in `block` in this step (in an
        attention group's table, at a position of its span), or None. (A
        Mamba group's copies preserve the state before the step on purpose.)"""
        mgr = self.scheduler.kv_cache_manager
        for rid, n in self.scheduled.items():
            start = self.spans[rid][0]
            for g, table in enumerate(mgr.get_block_ids(rid)):
                if g in self.state_groups or g in self.scratch_groups:
                    continue
                span = self.group_tpb(g) * self.dcp
                first, last = start // span, (start + n - 1) // span
                if block in table[first:last + 1]:
                    return rid
        return None

    def _output(self, so: Any, sampled: list[list[int]], kv: KVConnectorOutput) -> ModelRunnerOutput:
        """One worker's model output for the step: the tokens sampled for
        each scheduled request (`sampled`, in the step's order), and the
        worker connector's output."""
        return ModelRunnerOutput(
            req_ids=list(so.num_scheduled_tokens),
            req_id_to_index={r: i for i, r in enumerate(so.num_scheduled_tokens)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv,
        )

    def _fake_output(self, so: Any, w: int, sampled: list[list[int]]) -> ModelRunnerOutput:
        recv, wmeta = self.fake_worker(w, so.kv_connector_metadata)
        self.loaded |= recv
        return self._output(
            so, sampled, KVConnectorOutput(finished_recving=recv or None, kv_connector_worker_meta=wmeta)
        )

    def drain_remote(self) -> None:
        """Waits until every worker's queued remote puts are written (another
        node may then find them)."""
        for wc in self.workers:
            assert wc._worker.core.wait_remote(), "remote puts still queued"

    def flush_async(self) -> None:
        """Gives the scheduler the output of the step in flight (async
        scheduling)."""
        if self.pending is not None:
            self._update(*self.pending)
            self.pending = None
        # The scheduler has rolled back every rejected draft.
        self.rejected_last_step = {}

    def run(self, max_steps: int = 500) -> None:
        """Steps until every request has finished."""
        for _ in range(max_steps):
            if self.scheduler.has_requests():
                self.step()
            elif self.pending is not None:
                self.flush_async()
            else:
                return
        raise AssertionError(f"requests still running after {max_steps} steps")


def build(
    *,
    connector: str = "KvOffloadConnector",
    module: str | None = "kvoffload.vllm",
    extra: dict[str, Any] | None = None,
    tpb: int = 4,
    num_gpu_blocks: int = 48,
    world_size: int = 1,
    async_scheduling: bool = False,
    num_layers: int = 2,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 8,
    fake_worker: Any = None,
    kv_events: bool = True,
    spec: Any = None,
    policy: str = "fcfs",
    groups: list[Any] | None = None,
    retention: int | None = 0,
    eagle_groups: tuple[int, ...] = (),
    hash_tokens: int | None = None,
    layer_specs: list[Any] | None = None,
    dcp: int = 1,
    replicated: bool = False,
    spec_tokens: int = 0,
    spec_method: str = "ngram",
    kv_heads: int = 0,
) -> Engine:
    """An engine with the connector `connector` (loaded from `module`);
    `spec`: the KV cache group's spec (full attention of `tpb` tokens a
    block, `HEADS` heads of `HEAD_SIZE` floats by default); `groups`: in
    place of `spec`, the specs of several KV cache groups (vLLM's hybrid
    manager: `num_layers` layers each, ``g{group}.layer{i}``, their tensors
    overlaid as vLLM overlays them; the specs must have one page size,
    and may have different block sizes: a group of larger blocks sees the
    same pages as fewer heads; a Mamba group, ``MambaSpec``, turns on
    vLLM's align mode and the fake model's recurrent state, see
    `Engine.state_groups`).
    The fake model writes every group's KV (each group's layers apart).
    `retention`: vLLM's
    ``prefix_cache_retention_interval`` (which sliding-window blocks are kept
    and stored; 0, its default, keeps only the replay boundary's).
    `eagle_groups`: the groups that hold an EAGLE/MTP drafter's layers
    (``KVCacheGroupSpec.is_eagle_group``, which vLLM sets with speculative
    decoding whose draft KV depends on the next token): the connectors treat
    their last chunk as volatile; the scheduler runs without speculation.
    `hash_tokens`: vLLM's ``prefix_match_unit`` (block hashes every
    `hash_tokens` tokens, finer than a block; several groups only).
    `layer_specs`: in place of `spec`, one group of layers of one kind and
    different page sizes (DeepSeek V3.2's MLA and its indexer: vLLM's
    ``UniformTypeKVCacheSpecs``), one spec a layer: the workers get the
    per-layer specs, the scheduler the first layer's (as vLLM flattens
    them), each layer its own tensor in one backing allocation.
    `dcp`: vLLM's ``decode_context_parallel_size`` (full-attention groups,
    as vLLM runs it): a block spans its block size times `dcp` tokens,
    hashed as one, each worker holding its DCP rank's share
    (`Engine.dcp`).
    `replicated`: every worker holds the same KV (`Engine.replicated`), and
    the connector is told so (as vLLM's MLA on every tensor-parallel rank
    with the ``mp`` executor on CUDA: one host region every worker maps).
    `spec_tokens`: speculative decoding with up to that many draft tokens
    a step (vLLM's n-gram ``SpeculativeConfig``, no draft model): the fake
    drafter proposes tokens the fake model then accepts or rejects (see
    `Engine.draft_at`), writing the rejected drafts' KV at their positions
    (and a Mamba group's states after them, marked wrong, in its
    speculative blocks, which are sized to the drafts as vLLM sizes them:
    `Engine._compute_state_speculative`); with async scheduling too (the
    model runner's position correction: `Engine._span`).
    `spec_method`: ``"ngram"``, or ``"eagle"`` (with `eagle_groups`): vLLM's
    scheduler runs an EAGLE drafter's rules and the fake drafter writes
    the drafter groups (`Engine._draft`).
    `kv_heads`: the model's KV heads (vLLM's ``get_total_num_kv_heads``),
    split over `world_size` tensor-parallel workers (the default spec holds
    a worker's share of them; `Engine.kv_heads`)."""
    if replicated:
        with mock.patch("kvoffload.vllm._replicated_layout", lambda *_a: True):
            e = build(
                connector=connector, module=module, extra=extra, tpb=tpb, num_gpu_blocks=num_gpu_blocks,
                world_size=world_size, async_scheduling=async_scheduling, num_layers=num_layers,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, fake_worker=fake_worker,
                kv_events=kv_events, spec=spec, policy=policy, groups=groups, retention=retention,
                eagle_groups=eagle_groups, hash_tokens=hash_tokens, layer_specs=layer_specs, dcp=dcp,
                spec_tokens=spec_tokens, spec_method=spec_method,
            )
        e.replicated = True
        return e
    model_config = ModelConfig(model=MODEL, dtype="float32", seed=42)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        policy=policy,
    )
    cache_config = CacheConfig(
        block_size=tpb,
        enable_prefix_caching=True,
        prefix_cache_retention_interval=retention,
        prefix_match_unit=hash_tokens,
    )
    if groups is not None and any(isinstance(s, MambaSpec) for s in groups):
        # Mamba groups: vLLM's align mode (states kept at block boundaries,
        # prefill chunks split there), as vLLM runs Mamba with prefix caching.
        cache_config.mamba_cache_mode = "align"
    # vLLM's scheduler block is the least common multiple of the groups'
    # block sizes, its hash block the greatest common divisor of the
    # prefix-cacheable groups' (or `hash_tokens`; vLLM's
    # `resolve_kv_cache_block_sizes`); one group: `tpb` for both.
    sizes = [s.block_size for s in groups] if groups is not None else [tpb]
    hashing = [s.block_size for s in groups if s.prefix_cacheable] if groups is not None else []
    # A DCP-sharded block spans its tokens over every DCP rank.
    sched_block = math.lcm(*sizes) * dcp
    hash_block = (math.gcd(*(hashing or sizes)) if hash_tokens is None else hash_tokens) * dcp
    extra = {"num_cpu_chunks": 64, "offload_prompt_only": False} if extra is None else extra
    kv_transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.parallel_config.world_size = world_size
    vllm_config.parallel_config.decode_context_parallel_size = dcp
    if kv_heads:
        # Tensor parallelism over the model's `kv_heads` heads.
        vllm_config.parallel_config.tensor_parallel_size = world_size
        object.__setattr__(model_config, "get_total_num_kv_heads", lambda: kv_heads)
    if spec_tokens:
        if groups is not None:
            # vLLM sizes a Mamba layer's speculative blocks to the drafts
            # (one state column a draft).
            groups = [
                dataclasses.replace(s, num_speculative_blocks=spec_tokens) if isinstance(s, MambaSpec) else s
                for s in groups
            ]
        vllm_config.speculative_config = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=spec_tokens,
            prompt_lookup_max=spec_tokens,
            prompt_lookup_min=1,
            target_model_config=model_config,
            target_parallel_config=vllm_config.parallel_config,
        )
        if spec_method == "eagle":
            # An EAGLE drafter (no draft model here: the fake drafter stands
            # in for it): vLLM's scheduler reserves lookahead slots for its
            # drafts, never ends a prefill chunk right before the prompt's
            # last token, and drops the last block of a prefix-cache hit in
            # the drafter groups.
            assert eagle_groups, "an EAGLE drafter needs its groups (eagle_groups)"
            object.__setattr__(vllm_config.speculative_config, "method", "eagle")
        else:
            assert spec_method == "ngram", spec_method
    assert dcp == 1 or layer_specs is None, "DCP with layer_specs: not built"
    if kv_events:
        vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    if spec is None:
        spec = FullAttentionSpec(
            block_size=tpb,
            num_kv_heads=max(1, kv_heads // world_size) if kv_heads else HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
        )
    if layer_specs is not None:
        names = [f"layer{i}" for i in range(len(layer_specs))]
        per_layer = dict(zip(names, layer_specs))
        return _build_uniform(vllm_config, per_layer, num_gpu_blocks, tpb, async_scheduling, world_size, fake_worker,
                              extra, hash_block)
    if groups is None:
        specs = [spec]
        group_layers = [[f"layer{i}" for i in range(num_layers)]]
    else:
        specs = list(groups)
        assert len({s.page_size_bytes for s in specs}) == 1, "hybrid groups need one page size"
        group_layers = [[f"g{g}.layer{i}" for i in range(num_layers)] for g in range(len(specs))]
    page = specs[0].page_size_bytes
    # One group of full attention of other heads than the default: tensors
    # of its heads (their page is the spec's).
    heads, head_size = HEADS, HEAD_SIZE
    first = specs[0]
    if type(first) in (FullAttentionSpec, SlidingWindowSpec) and first.block_size == tpb:
        heads, head_size = first.num_kv_heads, first.head_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        # One backing allocation, layer-outermost (vLLM's convention: its
        # size is the total); the groups' tensors overlay it (a block id
        # belongs to one group at a time).
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_gpu_blocks * num_layers,
                layers=names,
                layer_stride=page * num_gpu_blocks,
                block_stride=page,
            )
            for names in group_layers
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(names, s, is_eagle_group=g in eagle_groups)
            for g, (names, s) in enumerate(zip(group_layers, specs))
        ],
    )

    def cache() -> dict[str, Any]:
        # Layer i of every group is one tensor: vLLM overlays the groups'
        # layers from byte 0 of one allocation.
        tensors = [
            torch.zeros(num_gpu_blocks, 2, tpb, heads, head_size, dtype=torch.float32) for _ in range(num_layers)
        ]
        # A group of larger blocks sees the same pages as fewer heads (vLLM
        # grows a smaller page's block to the common page size).
        return {
            name: tensors[i].view(num_gpu_blocks, 2, bs, heads * tpb // bs, head_size)
            for names, bs in zip(group_layers, sizes if groups is not None else [tpb])
            for i, name in enumerate(names)
        }

    state_groups = frozenset(g for g, s in enumerate(specs) if isinstance(s, MambaSpec))
    if state_groups:
        # Where prefix-cache hits land, as vLLM's engine resolves it for its
        # scheduler and workers (a Mamba layer's prefill checkpoint reads it).
        from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

        kv_cache_config.hash_block_size = hash_block
        kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, sched_block, hash_block
        )
    layout = Layout(kv_cache_config, kv_cache_config, sched_block, hash_block, cache)
    engine = _engine(
        vllm_config, layout, async_scheduling, world_size, fake_worker, extra, group_layers=group_layers, tpb=tpb,
        block_sizes=sizes if groups is not None else [],
        dcp=dcp,
        scratch_groups={
            g: isinstance(s, CircularBufferSpec) for g, s in enumerate(specs) if not s.prefix_cacheable
        }
        if groups is not None
        else {},
        state_groups=state_groups,
        drafter_groups=frozenset(eagle_groups) if spec_tokens and spec_method == "eagle" else frozenset(),
        checkpoints={
            g: (s.prefill_checkpoint_alignment, hash_block, kv_cache_config.cache_hit_alignment_tokens)
            for g, s in enumerate(specs)
            if g in state_groups and s.num_prefill_checkpoint_blocks > 0
        },
    )
    engine.kv_heads = kv_heads
    return engine


def _scheduler(vllm_config: Any, kv_cache_config: Any, async_scheduling: bool, block: int, hash_block: int) -> Any:
    """vLLM's core scheduler (the async one with `async_scheduling`) over
    `kv_cache_config`, its blocks of `block` tokens hashed every `hash_block`
    (inside ``set_current_vllm_config``)."""
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block,
        hash_block_size=hash_block,
    )


def _build_uniform(
    vllm_config: Any,
    per_layer: dict[str, Any],
    num_gpu_blocks: int,
    tpb: int,
    async_scheduling: bool,
    world_size: int,
    fake_worker: Any,
    extra: dict[str, Any],
    hash_block: int,
) -> Engine:
    """`build` for one group of layers of one kind and different page
    sizes (``UniformTypeKVCacheSpecs``): each layer's pages in its own
    region of one backing allocation (layer-outermost); the scheduler's
    configuration has the first layer's spec, the workers' every layer's."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    names = list(per_layer)
    uniform = UniformTypeKVCacheSpecs(block_size=tpb, kv_cache_specs=per_layer)
    total = uniform.page_size_bytes * num_gpu_blocks
    tensors, offset = [], 0
    for name in names:
        page = per_layer[name].page_size_bytes
        tensors.append(KVCacheTensor(size=total, layers=[name], layer_stride=page * num_gpu_blocks, block_stride=page,
                                     offset=offset))
        offset += page * num_gpu_blocks
    worker_config = KVCacheConfig(
        num_blocks=num_gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, uniform)]
    )
    # vLLM's scheduler sees one layer's spec for the group.
    sched_config = copy.deepcopy(worker_config)
    sched_config.kv_cache_groups[0].kv_cache_spec = per_layer[names[0]]

    def cache() -> dict[str, Any]:
        return {
            name: torch.zeros(num_gpu_blocks, 2, tpb, per_layer[name].num_kv_heads, HEAD_SIZE, dtype=torch.float32)
            for name in names
        }

    layout = Layout(sched_config, worker_config, tpb, hash_block, cache)
    return _engine(vllm_config, layout, async_scheduling, world_size, fake_worker, extra, group_layers=[names], tpb=tpb)


def _workers(
    vllm_config: Any, kv_cache_config: Any, count: int, cache: Callable[[], dict[str, Any]]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """`count` worker connectors, each registering its own `cache()`
    (inside ``set_current_vllm_config``). A scheduler-only engine has none:
    `fake_worker` answers for them."""
    workers, caches = [], []
    for rank in range(count):
        wc = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        layers = cache()
        # vLLM's model-parallel groups do not exist in this process: each
        # worker is told its rank (the share of a chunk it writes).
        with mock.patch("kvoffload.vllm._worker_rank", lambda _ws, r=rank: r):
            wc.register_kv_caches(layers)
        workers.append(wc)
        caches.append(layers)
    return workers, caches


@dataclass
class Layout:
    """What vLLM's scheduler and its workers are told about the KV cache:
    the scheduler's and the workers' configurations, the scheduler's block
    and hash block (tokens), and `cache`, which makes one worker's layer
    tensors."""

    scheduler_config: Any
    worker_config: Any
    block: int
    hash_block: int
    cache: Callable[[], dict[str, Any]]


def _engine(
    vllm_config: Any,
    layout: Layout,
    async_scheduling: bool,
    world_size: int,
    fake_worker: Any,
    extra: dict[str, Any],
    **shape: Any,
) -> Engine:
    """The `Engine` over vLLM's core scheduler and `world_size` workers
    laid out as `layout` (none with a `fake_worker`), hashing requests as
    vLLM's request hasher does, with a remote tier where the connector's
    `extra` configuration names one; `shape` is the rest of `Engine`'s
    fields."""
    with set_current_vllm_config(vllm_config):
        scheduler = _scheduler(
            vllm_config, layout.scheduler_config, async_scheduling, layout.block, layout.hash_block
        )
        workers, caches = _workers(
            vllm_config, layout.worker_config, 0 if fake_worker is not None else world_size, layout.cache
        )
    init_none_hash(sha256)
    return Engine(
        scheduler=scheduler,
        workers=workers,
        caches=caches,
        async_scheduling=async_scheduling,
        aggregator=KVOutputAggregator(world_size),
        hasher=get_request_block_hasher(layout.hash_block, sha256),
        world=world_size,
        fake_worker=fake_worker,
        remote="remote_tier" in extra,
        **shape,
    )


def done_requests(engine: Engine) -> int:
    return sum(1 for r in engine.scheduler.requests.values() if r.status == RequestStatus.RUNNING)


class StoreBytes:
    """A worker core that counts the store bytes its worker copied (wraps
    ``WorkerCore``; `count_store_bytes` installs it on every worker)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.stored = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    def get_finished(self) -> Any:
        completed, failed, stats = self.core.get_finished()
        self.stored += stats["store"][0]
        return completed, failed, stats


def count_store_bytes(e: Engine) -> list[StoreBytes]:
    """Wraps each of `e`'s workers' cores in a `StoreBytes`, in rank order."""
    counters = []
    for w in e.workers:
        counters.append(StoreBytes(w._worker.core))
        w._worker.core = counters[-1]
    return counters


class PromRecorder:
    """Feeds every stats payload the connector gives vLLM's scheduler into
    the connector's Prometheus metrics (`build_prom_metrics`, as vLLM's
    frontend does) on a private registry; `value` reads a sample."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        reg = self.registry

        def bound(cls):
            return lambda *a, **k: cls(*a, registry=reg, **k)

        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            Counter as VCounter,
            Gauge as VGauge,
            Histogram as VHistogram,
        )

        types = {VGauge: bound(Gauge), VCounter: bound(Counter), VHistogram: bound(Histogram)}
        conn = engine.connector
        vllm_config = conn._vllm_config
        self.prom = type(conn).build_prom_metrics(vllm_config, types, ["engine"], {0: ["0"]})
        inner = conn.get_kv_connector_stats

        def recorded():
            st = inner()
            if st is not None and not st.is_empty():
                self.prom.observe(st.data, 0)
            return st

        conn.get_kv_connector_stats = recorded

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"engine": "0", **labels})

