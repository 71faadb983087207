//! [`Scheduler::lookup`] with several KV groups: every group's keys asked of
//! the host tier through [`lookup_complete_chunks`].

use std::collections::HashMap;

use crate::ids::RequestId;
use crate::key::{ChunkKey, KeyBuildHasher};
use crate::manager::{LookupResult, OffloadManager};
use crate::scheduler::request::RequestState;
use crate::scheduler::{LookupOutcome, Scheduler, SchedulerError};

use super::lookup::{GroupKeys, HybridLookup, KeyState, lookup_complete_chunks_with_ends};

/// A request's keys in every group, answered by the host tier.
struct TierKeys<'a> {
    manager: &'a OffloadManager,
    being_loaded: &'a HashMap<ChunkKey, u32, KeyBuildHasher>,
    request: &'a RequestState,
    /// Per group, the request's hashes in one of its chunks.
    hashes_per_chunk: &'a [usize],
    /// Per group, whether it is windowed (else its hits are recorded).
    windowed: &'a [bool],
    /// The full-attention `(group, chunk)`s found, hit or pending.
    found: &'a mut Vec<(usize, usize)>,
}

impl GroupKeys for TierKeys<'_> {
    fn num_keys(&self, group: usize) -> usize {
        self.request.num_keys(self.hashes_per_chunk[group])
    }

    fn state(&mut self, group: usize, chunk: usize) -> KeyState {
        let key = self
            .request
            .group_key(group, chunk, self.hashes_per_chunk[group]);
        let state = match self.manager.lookup(key) {
            LookupResult::Hit => KeyState::Hit,
            LookupResult::HitPending => KeyState::HitPending,
            LookupResult::Miss => KeyState::Miss,
        };
        if state != KeyState::Miss && !self.windowed.get(group).copied().unwrap_or(true) {
            self.found.push((group, chunk));
        }
        state
    }

    fn being_loaded(&self, group: usize, chunk: usize) -> bool {
        !self.being_loaded.is_empty()
            && self.being_loaded.contains_key(&self.request.group_key(
                group,
                chunk,
                self.hashes_per_chunk[group],
            ))
    }
}

impl Scheduler {
    /// The hit of restarted request `req` over every group (vLLM's
    /// `_lookup_complete_chunks`): full-attention prefixes, sliding-window
    /// suffixes, deferred while a counted chunk is written or loaded.
    /// `found` gets the full-attention chunks found (vLLM's `record_lookup`),
    /// `hit_ends` each group's end of them (vLLM's `lookup_hit_end_chunk_idx`).
    pub(crate) fn lookup_groups(
        &self,
        req: RequestId,
        computed_tokens: u64,
        found: &mut Vec<(usize, usize)>,
        hit_ends: &mut Vec<usize>,
    ) -> Result<LookupOutcome, SchedulerError> {
        let Some(groups) = self.groups.as_deref() else {
            return Err(SchedulerError::Groups(
                "a lookup over groups on a single-group scheduler".into(),
            ));
        };
        let request = self
            .requests
            .get(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        let mut lookup = HybridLookup {
            computed: computed_tokens,
            num_tokens: request.num_tokens,
            max_load_tokens: request.caps.max_load_tokens,
            max_new_tokens: None,
        };
        // vLLM records the chunks its own lookup found; a lookup asked again
        // with a narrower end (below) records nothing more.
        let mut again = Vec::new();
        let mut first = true;
        loop {
            let mut keys = TierKeys {
                manager: &self.manager,
                being_loaded: &self.being_loaded,
                request,
                hashes_per_chunk: &groups.hashes_per_chunk,
                windowed: &groups.windowed,
                found: if first { &mut *found } else { &mut again },
            };
            first = false;
            let Some(hit) =
                lookup_complete_chunks_with_ends(&groups.shapes, &mut keys, lookup, hit_ends)
            else {
                return Ok(LookupOutcome::Defer);
            };
            // vLLM's hit may load a chunk's unwritten sub-block into a block
            // the request reads (`hybrid/holes.rs`): stop before that chunk.
            let end = computed_tokens + hit;
            match (hit > 0)
                .then(|| self.hole_limit(groups, request, computed_tokens, end))
                .flatten()
            {
                Some(limit) => {
                    tracing::debug!(%req, end, limit, "hit cut before a chunk stored in part");
                    self.hits_cut_at_partial_chunks
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if limit <= computed_tokens {
                        return Ok(LookupOutcome::Hit(0));
                    }
                    lookup.max_new_tokens = Some(limit - computed_tokens);
                }
                None => return Ok(LookupOutcome::Hit(hit)),
            }
        }
    }
}
