//! Partial tails: recurrent states (Mamba groups in vLLM's align mode) at
//! hash boundaries inside a block, when vLLM hashes finer than the blocks
//! (its `prefix_match_unit`). vLLM 0.33.0's `_lookup` past the complete
//! chunks, the partial-tail part of `update_state_after_alloc`, and
//! `_build_partial_tail_store_jobs`, without EAGLE draft groups.
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

use crate::ids::{GpuBlockId, RequestId};
use crate::key::{BlockHash, ChunkKey};
use crate::manager::LookupResult;
use crate::scheduler::request::RequestState;
use crate::scheduler::types::{GroupSpan, JobBlocks, TransferJob};
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

/// vLLM 0.33.0's `_lookup` past `_lookup_complete_chunks`, without EAGLE
/// groups: the boundaries on the hash unit inside the block after the
/// complete hit, up to the prompt's last token but one (and the load
/// cap), are tried from the right; `state(boundary, group)` answers for
/// each group's key there, in group order up to the first miss. The first
/// boundary whose keys all hit ends the hit.
pub fn lookup_partial_tail(
    req: PartialLookup,
    mut state: impl FnMut(u64, usize) -> KeyState,
) -> PartialAnswer {
    let mut pending = false;
    for boundary in req.boundaries() {
        let mut all_hit = true;
        let mut here_pending = false;
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
    /// The boundaries a partial tail may end on, from the right: on the
    /// hash unit, inside the block after the complete hit, before the
    /// prompt's last token and within the load cap.
    pub fn boundaries(&self) -> impl Iterator<Item = u64> + use<> {
        let tph = self.tokens_per_hash.max(1);
        let complete_end = self.computed + self.complete_hit;
        let block_end = complete_end + self.block_tokens;
        let mut max_boundary = self
            .prompt_tokens
            .saturating_sub(1)
            .min(block_end.saturating_sub(1));
        if let Some(cap) = self.max_load_tokens {
            max_boundary = max_boundary.min(self.computed.saturating_add(cap));
        }
        max_boundary -= max_boundary % tph;
        // The complete hit ends on a block, so without EAGLE groups the
        // boundaries stay inside the next block: no bridge chunk to load.
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
        if let Some(g) = groups.shapes.iter().position(|s| s.is_eagle_draft()) {
            return refuse(format!("group {g} is an EAGLE draft group"));
        }
        if tokens_per_hash == 0
            || tokens_per_hash >= block
            || !block.is_multiple_of(tokens_per_hash)
        {
            return refuse(format!(
                "a hash every {tokens_per_hash} tokens must divide the {block}-token block and be finer"
            ));
        }
        self.partial_tails = Some(PartialTails {
            tokens_per_hash,
            block_tokens: block,
        });
        Ok(())
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
        let Some((pt, lookup)) = self.partial_lookup(req, computed, complete_hit) else {
            return complete;
        };
        let Some(rs) = self.requests.get(&req) else {
            return complete;
        };
        let num_groups = lookup.num_groups;
        let answer =
            lookup_partial_tail(lookup, |boundary, g| self.host_tail_state(rs, g, boundary));
        match answer {
            PartialAnswer::Complete => complete,
            PartialAnswer::Defer => LookupOutcome::Defer,
            PartialAnswer::Tail(boundary) => {
                let keys = (0..num_groups).filter_map(|g| {
                    rs.boundary_key(g, boundary, pt.tokens_per_hash)
                        .map(|key| PartialTailKey {
                            req,
                            group: g,
                            boundary,
                            key,
                        })
                });
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
        };
        Some((pt, lookup))
    }

    /// The host tier's state of `rs`'s partial-tail key of `group` at
    /// `boundary` (a miss while the request's hash there is not known).
    pub(crate) fn host_tail_state(
        &self,
        rs: &RequestState,
        group: usize,
        boundary: u64,
    ) -> KeyState {
        let Some(pt) = self.partial_tails else {
            return KeyState::Miss;
        };
        match rs.boundary_key(group, boundary, pt.tokens_per_hash) {
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
    pub(crate) fn plan_partial_tail_stores(
        &mut self,
        states: &[BoundaryState],
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
                let key = rs.boundary_key(g, boundary, pt.tokens_per_hash);
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
            // vLLM positions a partial tail at its boundary's token.
            let positions: Vec<u64> = (0..num_groups)
                .map(|g| groups.token_position(g, boundary))
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
            self.enter_fenced_store(req, blocks, (stored, chunk_ids), spans, out);
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
