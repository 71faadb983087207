//! Partial tails: recurrent states (Mamba groups in vLLM's align mode) at
//! hash boundaries inside a block, when vLLM hashes finer than the blocks
//! (its `prefix_match_unit`). vLLM 0.33.0's `_lookup` past the complete
//! chunks, the partial-tail part of `update_state_after_alloc`, and
//! `_build_partial_tail_store_jobs`.
//!
//! A partial tail at boundary `b` (a multiple of the hash unit, not of the
//! block) is one key per group: vLLM's hash of the first `b` tokens, mixed
//! with the group. In a recurrent group it holds the state after `b` tokens
//! (a block vLLM's core copied out of the running state and hands over);
//! in an attention group, the block holding token `b - 1` (its tokens up to
//! `b` are the valid ones). vLLM offers these only where one boundary
//! names every group's source: chunks of one block, one block size, no
//! windowed group but the recurrent ones, no decode context parallelism
//! ([`Scheduler::enable_partial_tails`] checks it).
//!
//! - **Lookup.** Past the complete chunks' hit (which ends on a block), the
//!   boundaries inside the next block, up to the prompt's last token but
//!   one, are tried from the right: the first whose keys all hit in every
//!   group ends the hit there. A key still being written makes the request
//!   wait when the complete chunks found nothing.
//! - **Load.** Each group reads its complete chunks up to the partial
//!   block, then the partial key into that block.
//! - **Store.** A hand-off inside a block becomes one job: the recurrent
//!   groups' handed blocks and the attention groups' blocks at that index,
//!   fenced from its creation, only the keys the tier does not hold.
//! - **EAGLE/MTP draft groups.** vLLM's core matches a draft group a proof
//!   margin past a hit (one hash unit with fine-grained hits, else a block)
//!   and drops it; a partial tail keys a draft group's block by the hash at
//!   `boundary + margin`, so the tokens after the boundary that its draft
//!   KV depends on are proven too. The lookup then searches two blocks past
//!   the complete hit: a boundary in the second also loads the complete
//!   chunk between ("bridge"), looked up where the complete lookup did not
//!   confirm it. Only requests that loaded from the tier store tails, and
//!   only once the prompt is computed up to `boundary + margin`.

use crate::ids::{GpuBlockId, RequestId};
use crate::key::{BlockHash, ChunkKey};
use crate::manager::LookupResult;
use crate::scheduler::request::RequestState;
use crate::scheduler::types::{GroupSpan, JobBlocks, ScheduledRequest, TransferJob};
use crate::scheduler::{LookupOutcome, Scheduler, SchedulerError};

use super::BoundaryState;
use super::lookup::KeyState;

/// A scheduler's partial-tail geometry (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartialTails {
    /// vLLM's hash unit in tokens (its `prefix_match_unit`).
    pub tokens_per_hash: u64,
    /// Every group's block (and chunk) in tokens.
    pub block_tokens: u64,
    /// Tokens past a boundary at which an EAGLE/MTP draft group's tail key
    /// sits (vLLM's `eagle_proof_margin`); 0 without draft groups.
    pub eagle_margin: u64,
}

/// A partial tail the last lookup found, or a store planned: the request,
/// the group, the boundary and its key (the binding names the key by
/// vLLM's hash at the boundary in its KV events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialTailKey {
    /// The request.
    pub req: RequestId,
    /// The KV group.
    pub group: usize,
    /// The tokens the tail covers.
    pub boundary: u64,
    /// The tokens whose hash names its key: `boundary`, or past it by the
    /// proof margin in an EAGLE/MTP draft group (vLLM's events name it so).
    pub key_tokens: u64,
    /// Its key.
    pub key: ChunkKey,
}

/// A request as the partial-tail lookup sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialLookup {
    /// Tokens the GPU's prefix cache holds (on a block).
    pub computed: u64,
    /// The complete chunks' hit past `computed` ([`super::lookup_complete_chunks`]).
    pub complete_hit: u64,
    /// The request's prompt tokens.
    pub prompt_tokens: u64,
    /// The request's `max_load_tokens`.
    pub max_load_tokens: Option<u64>,
    /// Every group's block (and chunk) in tokens.
    pub block_tokens: u64,
    /// vLLM's hash unit in tokens.
    pub tokens_per_hash: u64,
    /// The KV groups (each has a key at every boundary).
    pub num_groups: usize,
    /// The largest EAGLE proof margin of its groups (0: none): the search
    /// spans two blocks, and a draft group's key needs a hash this far
    /// past the boundary.
    pub eagle_margin: u64,
    /// Tokens the request's known hashes cover (hashes times the unit).
    pub hash_tokens: u64,
}

/// What the bridge chunk's lookup answers (the complete chunk in the block
/// of the complete hit's end, which a tail in the block after it loads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BridgeAnswer {
    /// A group's bridge key the complete lookup did not confirm misses.
    pub miss: bool,
    /// A bridge key is being written or loaded for another request.
    pub pending: bool,
}

/// What the partial-tail lookup answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartialAnswer {
    /// The complete chunks' hit stands.
    Complete,
    /// The hit ends on the partial tail at this boundary (tokens).
    Tail(u64),
    /// A key is still being written and the complete chunks found nothing:
    /// the request waits.
    Defer,
}

/// vLLM 0.33.0's `_lookup` past `_lookup_complete_chunks` without EAGLE
/// draft groups (no bridge chunk): see [`lookup_partial_tail_bridged`].
pub fn lookup_partial_tail(
    req: PartialLookup,
    state: impl FnMut(u64, usize) -> KeyState,
) -> PartialAnswer {
    lookup_partial_tail_bridged(req, |_| BridgeAnswer::default(), state)
}

/// vLLM 0.33.0's `_lookup` past `_lookup_complete_chunks`: the boundaries
/// on the hash unit inside the block after the complete hit (the two
/// blocks after it with EAGLE draft groups), up to the prompt's last token
/// but one (and the load cap, and the request's hashes less the proof
/// margin), are tried from the right; `state(boundary, group)` answers for
/// each group's key there, in group order up to the first miss. The first
/// boundary whose keys all hit ends the hit. Boundaries past the bridge
/// chunk (`bridge(chunk)`, asked once, only when one is tried) need it:
/// a miss drops them, a pending key makes them wait.
pub fn lookup_partial_tail_bridged(
    req: PartialLookup,
    bridge: impl FnOnce(usize) -> BridgeAnswer,
    mut state: impl FnMut(u64, usize) -> KeyState,
) -> PartialAnswer {
    let mut max_boundary = req.max_boundary();
    let complete_end = req.computed + req.complete_hit;
    let bridge_boundary = req.bridge_boundary();
    let mut pending = false;
    if max_boundary >= bridge_boundary && max_boundary > complete_end {
        let answer = bridge((complete_end / req.block_tokens.max(1)) as usize);
        pending = answer.pending;
        if answer.miss {
            max_boundary = bridge_boundary - req.tokens_per_hash.max(1);
        }
    }
    let bridge_pending = pending;
    for boundary in req.boundaries_from(max_boundary) {
        let mut all_hit = true;
        let mut here_pending = boundary >= bridge_boundary && bridge_pending;
        for g in 0..req.num_groups {
            match state(boundary, g) {
                KeyState::Hit => {}
                KeyState::HitPending | KeyState::Retry => here_pending = true,
                KeyState::Miss => {
                    all_hit = false;
                    break;
                }
            }
        }
        pending |= here_pending;
        if all_hit && !here_pending {
            return PartialAnswer::Tail(boundary);
        }
    }
    if pending && req.complete_hit == 0 {
        PartialAnswer::Defer
    } else {
        PartialAnswer::Complete
    }
}

impl PartialLookup {
    /// The boundaries a partial tail may end on, from the right (before
    /// the bridge chunk's lookup): on the hash unit, inside the block after
    /// the complete hit (two with EAGLE draft groups), before the prompt's
    /// last token, within the load cap and the request's hashes.
    pub fn boundaries(&self) -> impl Iterator<Item = u64> + use<> {
        self.boundaries_from(self.max_boundary())
    }

    /// The furthest boundary tried (on the hash unit; at most the complete
    /// hit's end when none is).
    pub fn max_boundary(&self) -> u64 {
        let tph = self.tokens_per_hash.max(1);
        let complete_end = self.computed + self.complete_hit;
        let blocks = if self.eagle_margin > 0 { 2 } else { 1 };
        let block_end = complete_end + blocks * self.block_tokens;
        let mut max_boundary = self
            .prompt_tokens
            .saturating_sub(1)
            .min(block_end.saturating_sub(1));
        if self.eagle_margin > 0 {
            // A draft group's key is the request's hash past the boundary.
            max_boundary = max_boundary.min(self.hash_tokens.saturating_sub(self.eagle_margin));
        }
        if let Some(cap) = self.max_load_tokens {
            max_boundary = max_boundary.min(self.computed.saturating_add(cap));
        }
        max_boundary - max_boundary % tph
    }

    /// The end of the block after the complete hit's: boundaries from it on
    /// also load the complete chunk before it (the bridge). Without EAGLE
    /// draft groups the complete hit ends on a block and no boundary
    /// reaches it.
    pub fn bridge_boundary(&self) -> u64 {
        let block = self.block_tokens.max(1);
        ((self.computed + self.complete_hit) / block + 1) * block
    }

    /// The boundaries from `max_boundary` down, past the complete hit.
    fn boundaries_from(&self, max_boundary: u64) -> impl Iterator<Item = u64> + use<> {
        let tph = self.tokens_per_hash.max(1);
        let complete_end = self.computed + self.complete_hit;
        (0..)
            .map(move |i: u64| max_boundary.saturating_sub(i.saturating_mul(tph)))
            .take_while(move |&b| b > complete_end)
    }
}

impl RequestState {
    /// The partial-tail key of `group` at `boundary` (vLLM's
    /// `_make_boundary_key`), `None` while the request's hash there is not
    /// known.
    pub(crate) fn boundary_key(
        &self,
        group: usize,
        boundary: u64,
        tokens_per_hash: u64,
    ) -> Option<ChunkKey> {
        let idx = (boundary / tokens_per_hash.max(1)).checked_sub(1)? as usize;
        let hash = *self.hash_units.get(idx)?;
        Some(ChunkKey::for_group(hash, group as u32))
    }
}

impl Scheduler {
    /// Turns on partial tails (see the module), vLLM hashing every
    /// `tokens_per_hash` tokens; requests then need every hash
    /// ([`Self::add_hash_units`]). Refused (nothing changed) unless the
    /// scheduler has several groups with a recurrent-state group, chunks of
    /// one block, one block size for every group, no windowed group but the
    /// recurrent ones, and `tokens_per_hash` divides the block and is
    /// smaller.
    pub fn enable_partial_tails(&mut self, tokens_per_hash: u64) -> Result<(), SchedulerError> {
        let refuse = |why: String| Err(SchedulerError::Groups(format!("partial tails: {why}")));
        let Some(groups) = self.groups.as_deref() else {
            return refuse("they need several KV groups".into());
        };
        if self.geo.blocks_per_chunk != 1 {
            return refuse(format!(
                "chunks of {} blocks (vLLM builds them over chunks of one block)",
                self.geo.blocks_per_chunk
            ));
        }
        let block = self.geo.tokens_per_chunk;
        if let Some((g, s)) = groups
            .shapes
            .iter()
            .enumerate()
            .find(|(_, s)| s.tokens_per_chunk() != block)
        {
            return refuse(format!(
                "group {g} has {}-token blocks, not {block} (one block size for every group)",
                s.tokens_per_chunk()
            ));
        }
        if !groups.shapes.iter().any(|s| s.is_recurrent_state()) {
            return refuse("no recurrent-state group".into());
        }
        if let Some(g) = groups
            .shapes
            .iter()
            .position(|s| s.window_chunks().is_some() && !s.is_recurrent_state())
        {
            return refuse(format!("group {g} is windowed"));
        }
        if tokens_per_hash == 0
            || tokens_per_hash >= block
            || !block.is_multiple_of(tokens_per_hash)
        {
            return refuse(format!(
                "a hash every {tokens_per_hash} tokens must divide the {block}-token block and be finer"
            ));
        }
        // vLLM's core looks a draft group up one hash unit past a hit when
        // every group takes fine-grained hits (full attention, MLA: the
        // groups partial tails allow), and keys its tails there.
        let drafts = groups
            .shapes
            .iter()
            .any(|s| s.is_eagle_draft() && !s.is_recurrent_state());
        self.partial_tails = Some(PartialTails {
            tokens_per_hash,
            block_tokens: block,
            eagle_margin: if drafts { tokens_per_hash } else { 0 },
        });
        Ok(())
    }

    /// Sets the EAGLE proof margin of partial tails: vLLM's
    /// `eagle_proof_margin`, one hash unit where the core takes
    /// fine-grained hits (the default), one block where it does not.
    /// Refused unless partial tails are on with an EAGLE/MTP draft group,
    /// and for any other value.
    pub fn set_partial_tail_eagle_margin(&mut self, tokens: u64) -> Result<(), SchedulerError> {
        let refuse = |why: String| Err(SchedulerError::Groups(format!("partial tails: {why}")));
        let Some(pt) = self.partial_tails.as_mut() else {
            return refuse("an EAGLE proof margin needs partial tails on".into());
        };
        if pt.eagle_margin == 0 {
            return refuse("an EAGLE proof margin needs an EAGLE/MTP draft group".into());
        }
        if tokens != pt.tokens_per_hash && tokens != pt.block_tokens {
            return refuse(format!(
                "an EAGLE proof margin of {tokens} tokens: vLLM's is the hash unit ({}) or the block ({})",
                pt.tokens_per_hash, pt.block_tokens
            ));
        }
        pt.eagle_margin = tokens;
        Ok(())
    }

    /// The EAGLE proof margin of partial tails (0: none, or partial tails off).
    pub fn partial_tail_eagle_margin(&self) -> u64 {
        self.partial_tails.map_or(0, |pt| pt.eagle_margin)
    }

    /// The tokens whose hash keys `group`'s partial tail at `boundary`
    /// (vLLM's `_partial_tail_key_tokens`): past it by the proof margin in
    /// an EAGLE/MTP draft group.
    pub(crate) fn tail_key_tokens(&self, group: usize, boundary: u64) -> u64 {
        let draft = self
            .groups
            .as_deref()
            .and_then(|g| g.shapes.get(group))
            .is_some_and(|s| s.is_eagle_draft() && !s.is_recurrent_state());
        boundary
            + if draft {
                self.partial_tail_eagle_margin()
            } else {
                0
            }
    }

    /// `rs`'s partial-tail key of `group` at `boundary` (at its key tokens),
    /// `None` while the request's hash there is not known.
    pub(crate) fn tail_key(
        &self,
        rs: &RequestState,
        group: usize,
        boundary: u64,
    ) -> Option<ChunkKey> {
        let pt = self.partial_tails?;
        rs.boundary_key(
            group,
            self.tail_key_tokens(group, boundary),
            pt.tokens_per_hash,
        )
    }

    /// Whether partial tails are on ([`Self::enable_partial_tails`]).
    pub fn partial_tails_enabled(&self) -> bool {
        self.partial_tails.is_some()
    }

    /// Appends request `req`'s next hashes, one every `tokens_per_hash`
    /// tokens (vLLM's `Request.block_hashes` in full), for its partial
    /// tails; [`Self::update_request`] still takes the last one of each block.
    pub fn add_hash_units(
        &mut self,
        req: RequestId,
        hashes: &[BlockHash],
    ) -> Result<(), SchedulerError> {
        let rs = self
            .requests
            .get_mut(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        rs.hash_units.extend_from_slice(hashes);
        Ok(())
    }

    /// The hashes of `req` given by [`Self::add_hash_units`] (0 for an
    /// unknown request).
    pub fn num_hash_units(&self, req: RequestId) -> usize {
        self.requests.get(&req).map_or(0, |rs| rs.hash_units.len())
    }

    /// The partial tail the last lookup ended its hit on, one entry per
    /// group (empty when it did not), and the partial tails the last step
    /// planned stores of, every key it offered: what the binding needs to
    /// name them in vLLM's KV events.
    pub fn last_partial_tails(&self) -> &[PartialTailKey] {
        &self.last_partial_tails
    }

    /// vLLM's `_lookup` past the complete chunks (see the module): the hit
    /// `complete` of request `req` past the GPU's `computed`, extended to a
    /// partial tail where every group's key hits ([`lookup_partial_tail`]).
    pub(crate) fn lookup_partial_tail(
        &mut self,
        req: RequestId,
        computed: u64,
        complete: LookupOutcome,
    ) -> LookupOutcome {
        let LookupOutcome::Hit(complete_hit) = complete else {
            return complete;
        };
        let Some((_, lookup)) = self.partial_lookup(req, computed, complete_hit) else {
            return complete;
        };
        let Some(rs) = self.requests.get(&req) else {
            return complete;
        };
        let num_groups = lookup.num_groups;
        let answer = lookup_partial_tail_bridged(
            lookup,
            |chunk| self.host_bridge(rs, chunk),
            |boundary, g| self.host_tail_state(rs, g, boundary),
        );
        match answer {
            PartialAnswer::Complete => complete,
            PartialAnswer::Defer => LookupOutcome::Defer,
            PartialAnswer::Tail(boundary) => {
                let keys: Vec<PartialTailKey> = (0..num_groups)
                    .filter_map(|g| {
                        self.tail_key(rs, g, boundary).map(|key| PartialTailKey {
                            req,
                            group: g,
                            boundary,
                            key_tokens: self.tail_key_tokens(g, boundary),
                            key,
                        })
                    })
                    .collect();
                // A tail past the bridge chunk loads it: vLLM records the
                // lookups of its keys the complete lookup did not confirm.
                if boundary >= lookup.bridge_boundary() {
                    let chunk = ((computed + complete_hit) / lookup.block_tokens.max(1)) as usize;
                    for g in self.unconfirmed_bridge_groups(chunk) {
                        self.last_lookup_group_hits.push((g, chunk));
                    }
                }
                self.last_partial_tails.clear();
                self.last_partial_tails.extend(keys);
                if let Some(rs) = self.requests.get_mut(&req) {
                    rs.partial_tail = Some(boundary);
                }
                LookupOutcome::Hit(boundary - computed)
            }
        }
    }

    /// The partial-tail lookup of `req` past a complete hit of
    /// `complete_hit` tokens after the GPU's `computed`, with the geometry;
    /// `None` without partial tails (or an unknown request).
    pub(crate) fn partial_lookup(
        &self,
        req: RequestId,
        computed: u64,
        complete_hit: u64,
    ) -> Option<(PartialTails, PartialLookup)> {
        let pt = self.partial_tails?;
        let num_groups = self.groups.as_deref()?.len();
        let rs = self.requests.get(&req)?;
        let lookup = PartialLookup {
            computed,
            complete_hit,
            prompt_tokens: rs.prompt_tokens,
            max_load_tokens: rs.caps.max_load_tokens,
            block_tokens: pt.block_tokens,
            tokens_per_hash: pt.tokens_per_hash,
            num_groups,
            eagle_margin: pt.eagle_margin,
            hash_tokens: (rs.hash_units.len() as u64).saturating_mul(pt.tokens_per_hash),
        };
        Some((pt, lookup))
    }

    /// The attention groups whose bridge key at `chunk` the last complete
    /// lookup did not confirm (its prefix scan ended at or before it).
    fn unconfirmed_bridge_groups(&self, chunk: usize) -> Vec<usize> {
        let Some(groups) = self.groups.as_deref() else {
            return Vec::new();
        };
        (0..groups.len())
            .filter(|&g| !groups.shapes[g].is_recurrent_state())
            .filter(|&g| self.last_complete_hit_ends.get(g).copied().unwrap_or(0) <= chunk)
            .collect()
    }

    /// The host tier's answer for `rs`'s bridge chunk `chunk` (vLLM's
    /// bridge lookup in `_lookup`): every attention group's key being
    /// loaded for another request is pending; the keys the complete
    /// lookup did not confirm are looked up, in group order up to a miss.
    fn host_bridge(&self, rs: &RequestState, chunk: usize) -> BridgeAnswer {
        let Some(groups) = self.groups.as_deref() else {
            return BridgeAnswer::default();
        };
        let mut answer = BridgeAnswer::default();
        let key = |g: usize| {
            let per_chunk = groups.hashes_per_chunk[g];
            (chunk < rs.num_keys(per_chunk)).then(|| rs.group_key(g, chunk, per_chunk))
        };
        for g in (0..groups.len()).filter(|&g| !groups.shapes[g].is_recurrent_state()) {
            if let Some(k) = key(g) {
                answer.pending |= self.being_loaded.contains_key(&k);
            }
        }
        for g in self.unconfirmed_bridge_groups(chunk) {
            let state = key(g).map_or(LookupResult::Miss, |k| self.manager.lookup(k));
            match state {
                LookupResult::Miss => {
                    answer.miss = true;
                    break;
                }
                LookupResult::HitPending => answer.pending = true,
                LookupResult::Hit => {}
            }
        }
        answer
    }

    /// The host tier's state of `rs`'s partial-tail key of `group` at
    /// `boundary` (a miss while the request's hash there is not known).
    pub(crate) fn host_tail_state(
        &self,
        rs: &RequestState,
        group: usize,
        boundary: u64,
    ) -> KeyState {
        match self.tail_key(rs, group, boundary) {
            None => KeyState::Miss,
            Some(key) => match self.manager.lookup(key) {
                LookupResult::Hit => KeyState::Hit,
                LookupResult::HitPending => KeyState::HitPending,
                LookupResult::Miss => KeyState::Miss,
            },
        }
    }

    /// Plans the stores of `states`' partial tails (hand-offs inside a
    /// block), one job per request, into `out` (vLLM's
    /// `_build_partial_tail_store_jobs` after its aligned hand-offs).
    /// `scheduled`: the step's requests (with EAGLE draft groups, a tail is
    /// stored once the step computes the prompt to its key).
    pub(crate) fn plan_partial_tail_stores(
        &mut self,
        states: &[BoundaryState],
        scheduled: &[ScheduledRequest],
        out: &mut Vec<TransferJob>,
    ) {
        let Some(pt) = self.partial_tails else {
            return;
        };
        let Some(groups) = self.groups.clone() else {
            return;
        };
        let num_groups = groups.len();
        // Requests in the order of their first hand-off (vLLM's dict).
        let mut order: Vec<RequestId> = Vec::new();
        for s in states {
            if !s.boundary.is_multiple_of(pt.block_tokens) && !order.contains(&s.req) {
                order.push(s.req);
            }
        }
        for req in order {
            let entries: Vec<&BoundaryState> = states
                .iter()
                .filter(|s| s.req == req && !s.boundary.is_multiple_of(pt.block_tokens))
                .collect();
            let boundary = entries[0].boundary;
            // vLLM asserts one boundary a request and a step; kvoffload
            // skips what it cannot name.
            if entries.iter().any(|s| s.boundary != boundary) || boundary == 0 {
                continue;
            }
            let Some(rs) = self.requests.get(&req) else {
                continue;
            };
            let limit = rs
                .prompt_tokens
                .min(rs.caps.max_offload_tokens.unwrap_or(rs.prompt_tokens));
            if !boundary.is_multiple_of(pt.tokens_per_hash) || boundary > limit {
                continue;
            }
            if pt.eagle_margin > 0 {
                // Requests that did not load from the tier keep their draft
                // tail in the GPU's prefix cache (vLLM skips the store).
                if !rs.loaded_from_offload {
                    continue;
                }
                // The hand-off comes once, on the step computing the prompt
                // past the boundary: the draft KV up to its key must be
                // computed by the end of this step.
                // (A hand-off comes with its request scheduled; one that
                // is not is not stored.)
                let computed_after = scheduled
                    .iter()
                    .find(|s| s.req == req)
                    .map_or(0, |s| s.computed_tokens.saturating_add(s.scheduled_tokens))
                    .min(rs.prompt_tokens);
                if boundary + pt.eagle_margin > computed_after {
                    continue;
                }
            }
            let block_idx = (boundary / pt.block_tokens) as usize;
            let mut sources: Vec<GpuBlockId> = Vec::with_capacity(num_groups);
            let mut keys: Vec<ChunkKey> = Vec::with_capacity(num_groups);
            let mut complete = true;
            for (g, shape) in groups.shapes.iter().enumerate() {
                let block = if shape.is_recurrent_state() {
                    entries.iter().find(|s| s.group == g).map(|s| s.block)
                } else {
                    rs.group_blocks(g).get(block_idx).copied()
                };
                let key = self.tail_key(rs, g, boundary);
                match (block, key) {
                    (Some(b), Some(k)) if b.0 != 0 => {
                        sources.push(b);
                        keys.push(k);
                    }
                    _ => {
                        complete = false;
                        break;
                    }
                }
            }
            if !complete {
                continue;
            }
            // vLLM positions a partial tail at its key's token.
            let positions: Vec<u64> = (0..num_groups)
                .map(|g| groups.token_position(g, self.tail_key_tokens(g, boundary)))
                .collect();
            let Some((stored, chunk_ids)) = self.prepare_fenced_store(req, &keys, &positions)
            else {
                continue;
            };
            let mut spans = Vec::with_capacity(num_groups);
            let mut blocks = JobBlocks::new();
            for (g, key) in keys.iter().enumerate() {
                let accepted = stored.contains(key);
                if accepted {
                    blocks.push(sources[g]);
                    self.last_partial_tails.push(PartialTailKey {
                        req,
                        group: g,
                        boundary,
                        key_tokens: self.tail_key_tokens(g, boundary),
                        key: *key,
                    });
                }
                spans.push(GroupSpan {
                    num_keys: u32::from(accepted),
                    num_blocks: u32::from(accepted),
                    first_block_index: if accepted { block_idx as u32 } else { 0 },
                });
            }
            // vLLM fences every source block from the store's creation.
            let _ = self.enter_fenced_store(req, blocks, (stored, chunk_ids), spans, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request with no GPU hit, `complete` tokens of complete chunks
    /// found, a 23-token prompt, 8-token blocks, a hash every 2 tokens,
    /// two groups.
    fn req(complete: u64) -> PartialLookup {
        PartialLookup {
            computed: 0,
            complete_hit: complete,
            prompt_tokens: 23,
            max_load_tokens: None,
            block_tokens: 8,
            tokens_per_hash: 2,
            num_groups: 2,
            eagle_margin: 0,
            hash_tokens: 22,
        }
    }

    /// Answers from `(boundary, letters)`: a letter a group (H, P, R, M);
    /// any other boundary misses.
    fn states<'a>(table: &'a [(u64, &'a str)]) -> impl FnMut(u64, usize) -> KeyState + 'a {
        move |boundary, g| {
            let letters = table
                .iter()
                .find(|(b, _)| *b == boundary)
                .map(|(_, l)| l.as_bytes());
            match letters.map(|l| l[g]) {
                Some(b'H') => KeyState::Hit,
                Some(b'P') => KeyState::HitPending,
                Some(b'R') => KeyState::Retry,
                _ => KeyState::Miss,
            }
        }
    }

    #[test]
    fn the_rightmost_boundary_every_group_holds_ends_the_hit() {
        // Boundaries 10, 12, 14 inside the block after 8.
        let table = [(10, "HH"), (12, "HM"), (14, "MH")];
        assert_eq!(
            lookup_partial_tail(req(8), states(&table)),
            PartialAnswer::Tail(10)
        );
        let table = [(10, "HH"), (14, "HH")];
        assert_eq!(
            lookup_partial_tail(req(8), states(&table)),
            PartialAnswer::Tail(14)
        );
        // Nothing held: the complete hit stands; a block boundary (16) is
        // never a partial tail.
        let table = [(16, "HH")];
        assert_eq!(
            lookup_partial_tail(req(8), states(&table)),
            PartialAnswer::Complete
        );
    }

    #[test]
    fn the_prompts_last_token_and_the_load_cap_bound_the_tail() {
        // Complete to 16: the block after ends at 24; a 23-token prompt
        // leaves its last token (22) to compute, a 22-token one 21 (so the
        // last boundary tried is 20).
        let table = [(20, "HH"), (22, "HH")];
        assert_eq!(
            lookup_partial_tail(req(16), states(&table)),
            PartialAnswer::Tail(22)
        );
        let shorter = PartialLookup {
            prompt_tokens: 22,
            ..req(16)
        };
        assert_eq!(
            lookup_partial_tail(shorter, states(&table)),
            PartialAnswer::Tail(20)
        );
        let capped = PartialLookup {
            max_load_tokens: Some(19),
            ..req(16)
        };
        assert_eq!(
            lookup_partial_tail(capped, states(&table)),
            PartialAnswer::Complete
        );
        // From a GPU hit of 8, with nothing complete past it.
        let table = [(10, "HH")];
        let gpu = PartialLookup {
            computed: 8,
            ..req(0)
        };
        assert_eq!(
            lookup_partial_tail(gpu, states(&table)),
            PartialAnswer::Tail(10)
        );
    }

    /// `req(complete)` beside an EAGLE draft group: a proof margin of one
    /// hash unit, 11 hashes known (22 tokens).
    fn eagle(complete: u64) -> PartialLookup {
        PartialLookup {
            eagle_margin: 2,
            ..req(complete)
        }
    }

    fn confirmed(_: usize) -> BridgeAnswer {
        BridgeAnswer::default()
    }

    #[test]
    fn a_draft_group_searches_two_blocks_and_its_key_needs_a_hash_past_the_boundary() {
        // Complete to 8: boundaries up to 20 (two blocks end at 24; the
        // prompt's last token but one is 22; the last key, at 22, proves
        // a boundary at 20), from the right.
        assert_eq!(eagle(8).max_boundary(), 20);
        assert_eq!(eagle(8).bridge_boundary(), 16);
        let table = [(10, "HH"), (20, "HH")];
        assert_eq!(
            lookup_partial_tail_bridged(eagle(8), confirmed, states(&table)),
            PartialAnswer::Tail(20)
        );
        // Without the draft group, one block only.
        assert_eq!(req(8).max_boundary(), 14);
        // Complete to 0 with 5 hashes known (10 tokens): the key at 8 + 2
        // is the last one.
        let few = PartialLookup {
            hash_tokens: 10,
            ..eagle(0)
        };
        assert_eq!(few.boundaries().collect::<Vec<_>>(), vec![8, 6, 4, 2]);
        // No hash past the complete hit's end but one: nothing is tried.
        let none = PartialLookup {
            hash_tokens: 9,
            ..eagle(8)
        };
        assert_eq!(none.boundaries().count(), 0);
    }

    #[test]
    fn a_tail_past_the_bridge_chunk_needs_it() {
        // Complete to 0; the bridge is chunk 0 (tokens 0..8), needed by the
        // boundaries from 8 on.
        let table = [(4, "HH"), (12, "HH")];
        let mut asked = Vec::new();
        let got = lookup_partial_tail_bridged(
            eagle(0),
            |chunk| {
                asked.push(chunk);
                BridgeAnswer::default()
            },
            states(&table),
        );
        assert_eq!(got, PartialAnswer::Tail(12));
        assert_eq!(asked, vec![0], "the bridge is asked once");
        // The bridge misses: only the boundaries before it are tried.
        let miss = |_| BridgeAnswer {
            miss: true,
            pending: false,
        };
        assert_eq!(
            lookup_partial_tail_bridged(eagle(0), miss, states(&table)),
            PartialAnswer::Tail(4)
        );
        // Pending: the boundaries past it wait; one before it still hits,
        // and with none the request waits (nothing complete).
        let pending = |_| BridgeAnswer {
            miss: false,
            pending: true,
        };
        assert_eq!(
            lookup_partial_tail_bridged(eagle(0), pending, states(&table)),
            PartialAnswer::Tail(4)
        );
        assert_eq!(
            lookup_partial_tail_bridged(eagle(0), pending, states(&[(12, "HH")])),
            PartialAnswer::Defer
        );
        // From a GPU hit of 8 with nothing complete past it, the same
        // (vLLM waits when the complete chunks found nothing); with a
        // complete hit, that hit stands.
        let from_gpu = PartialLookup {
            computed: 8,
            ..eagle(0)
        };
        assert_eq!(from_gpu.bridge_boundary(), 16);
        assert_eq!(
            lookup_partial_tail_bridged(from_gpu, pending, states(&[(18, "HH")])),
            PartialAnswer::Defer
        );
        assert_eq!(
            lookup_partial_tail_bridged(eagle(8), pending, states(&[(18, "HH")])),
            PartialAnswer::Complete
        );
        // No boundary reaches the bridge: it is never asked.
        let short = PartialLookup {
            prompt_tokens: 8,
            ..eagle(0)
        };
        let got = lookup_partial_tail_bridged(
            short,
            |_| panic!("the bridge is not needed"),
            states(&[(2, "HH")]),
        );
        assert_eq!(got, PartialAnswer::Tail(2));
    }

    #[test]
    fn a_key_still_being_written_waits_only_when_nothing_else_hits() {
        // 14 pending in group 1: skipped for 12, whose keys hit.
        let table = [(12, "HH"), (14, "HP")];
        assert_eq!(
            lookup_partial_tail(req(8), states(&table)),
            PartialAnswer::Tail(12)
        );
        // Nothing hits, a key pending: the request waits when the complete
        // chunks found nothing, else their hit stands.
        let table = [(14, "PH"), (10, "RM")];
        assert_eq!(
            lookup_partial_tail(req(0), states(&[(4, "PH")])),
            PartialAnswer::Defer
        );
        assert_eq!(
            lookup_partial_tail(req(8), states(&table)),
            PartialAnswer::Complete
        );
        // A key pending after a miss in an earlier group is never asked.
        assert_eq!(
            lookup_partial_tail(req(0), states(&[(4, "MP")])),
            PartialAnswer::Complete
        );
    }
}
