//! Lookup of a request's prefix in the host tier (vLLM
//! `get_num_new_matched_tokens`) and creation of its load job
//! (`update_state_after_alloc`).

use crate::ids::{GpuBlockId, JobId, RequestId};
use crate::key::ChunkKey;
use crate::manager::{LookupResult, OffloadManager};

use super::Scheduler;
use super::jobs::JobEntry;
use super::types::{JobBlocks, JobKeys, JobSlots};
use super::types::{LookupOutcome, SchedulerError, TransferJob};

/// Result of a maximal-prefix scan over chunk keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefixScan {
    /// Leading keys that are present (hit or hit pending), up to the first miss.
    pub hits: usize,
    /// A counted key was still being written: ask again later.
    pub defer: bool,
}

/// Scans `keys` in order: a hit counts; a pending hit counts and defers but the
/// scan continues; a miss stops the scan.
pub(crate) fn maximal_prefix(
    manager: &OffloadManager,
    keys: impl Iterator<Item = ChunkKey>,
) -> PrefixScan {
    let mut scan = PrefixScan {
        hits: 0,
        defer: false,
    };
    for k in keys {
        match manager.lookup(k) {
            LookupResult::Hit => scan.hits += 1,
            LookupResult::HitPending => {
                scan.hits += 1;
                scan.defer = true;
            }
            LookupResult::Miss => break,
        }
    }
    scan
}

/// The furthest token a lookup may answer up to (vLLM 0.33.0's
/// `max_hit_size_tokens` for one full-attention group): the request's
/// tokens, its last keyed chunk, and with a `max_load_tokens` cap, at most
/// `cap` tokens past `computed`, rounded down to a whole chunk.
pub(crate) fn max_hit_tokens(
    num_tokens: u64,
    full_chunk_tokens: u64,
    computed: u64,
    max_load_tokens: Option<u64>,
    tokens_per_chunk: u64,
) -> u64 {
    let mut max_hit = num_tokens.min(full_chunk_tokens);
    if let Some(cap) = max_load_tokens {
        max_hit = max_hit.min(computed.saturating_add(cap));
        if tokens_per_chunk > 0 {
            max_hit -= max_hit % tokens_per_chunk;
        }
    }
    max_hit
}

impl Scheduler {
    /// How many tokens beyond `computed_tokens` the host tier can supply for
    /// `req` (vLLM `get_num_new_matched_tokens`).
    ///
    /// Restarts the request first: its block list is emptied and every chunk is
    /// offered again for storing, even when the answer is [`LookupOutcome::Defer`].
    /// Defers while the request has a job in flight, while a hit chunk is still
    /// being written, and while a hit chunk is being loaded for another request.
    /// Hits below one chunk count as zero.
    ///
    /// Records the lookup delays with the scheduler's clock, as vLLM: every
    /// call that looks the tier up (all but those deferred by the request's
    /// own jobs in flight) adds its duration to the sync histogram, whatever
    /// it answers; the first such call that defers starts the request's async
    /// clock, and the next that resolves (or the request's end) adds the time
    /// since to the async histogram.
    pub fn lookup(
        &mut self,
        req: RequestId,
        computed_tokens: u64,
    ) -> Result<LookupOutcome, SchedulerError> {
        self.lookup_with(req, computed_tokens, false)
    }

    /// [`Self::lookup`] for a request that must not read cached KV (vLLM's
    /// `skip_reading_prefix_cache`, set for prompt-logprob requests): it is
    /// restarted as a lookup restarts it, and answered zero without looking
    /// the tier up (no lookup delay is observed, no sync load reserved). Its
    /// own jobs in flight still defer it, as in vLLM.
    pub fn lookup_skip_reading(
        &mut self,
        req: RequestId,
        computed_tokens: u64,
    ) -> Result<LookupOutcome, SchedulerError> {
        self.lookup_with(req, computed_tokens, true)
    }

    fn lookup_with(
        &mut self,
        req: RequestId,
        computed_tokens: u64,
        skip_reading: bool,
    ) -> Result<LookupOutcome, SchedulerError> {
        let start = self.now_ns();
        let (outcome, looked_up) = self.lookup_inner(req, computed_tokens, skip_reading)?;
        if !looked_up {
            return Ok(outcome);
        }
        self.reserve_sync_load(req, computed_tokens, outcome);
        if skip_reading {
            return Ok(outcome);
        }
        let now = self.now_ns();
        let secs = |ns: u64| ns as f64 / 1e9;
        self.lookup_delays
            .observe_sync(secs(now.saturating_sub(start)));
        if let Some(rs) = self.requests.get_mut(&req) {
            match (outcome, rs.lookup_deferred_since_ns) {
                (LookupOutcome::Defer, None) => rs.lookup_deferred_since_ns = Some(start),
                (LookupOutcome::Defer, Some(_)) | (LookupOutcome::Hit(_), None) => {}
                (LookupOutcome::Hit(_), Some(since)) => {
                    rs.lookup_deferred_since_ns = None;
                    self.lookup_delays
                        .observe_async(secs(now.saturating_sub(since)));
                }
            }
        }
        Ok(outcome)
    }

    /// Whether `req`'s last lookup in this step reserved the step's sync-load
    /// budget: its load, if the backend allocates it, is synchronous (the
    /// workers finish it before the step's compute) and the request runs in
    /// this step (vLLM's `load_kv_async = False`).
    pub fn sync_load_reserved(&self, req: RequestId) -> bool {
        self.batch.sync_reserved.contains(&req)
    }

    /// vLLM's `_reserve_sync_load`: a hit that leaves a token to compute and
    /// fits what is left of the step's budget reserves it; any other answer
    /// drops an earlier reservation of the request in this step.
    fn reserve_sync_load(&mut self, req: RequestId, computed_tokens: u64, outcome: LookupOutcome) {
        self.batch.sync_reserved.retain(|r| *r != req);
        let LookupOutcome::Hit(hit) = outcome else {
            return;
        };
        let Some(num_tokens) = self.requests.get(&req).map(|rs| rs.num_tokens) else {
            return;
        };
        if self.sync_budget == 0 || hit == 0 || computed_tokens.saturating_add(hit) >= num_tokens {
            return;
        }
        let bytes = hit.saturating_mul(self.sync_bytes_per_token);
        if self.batch.sync_bytes.saturating_add(bytes) > self.sync_budget {
            return;
        }
        self.batch.sync_bytes += bytes;
        self.batch.sync_reserved.push(req);
    }

    /// The chunks the last [`Self::lookup`] found in the host tier (hit or
    /// still being written), as indices in its request's chunk keys: the
    /// leading run its scan counted, before any cap or deferral applied to
    /// the answer (vLLM records these for its self-describing KV events).
    /// `None` when that lookup scanned nothing (the request's own jobs in
    /// flight, less than a chunk to find, an unknown request).
    pub fn last_lookup_hits(&self) -> Option<std::ops::Range<usize>> {
        self.last_lookup_hits.clone()
    }

    /// With several KV groups ([`Self::with_groups`]), the chunks the last
    /// [`Self::lookup`] found in the host tier (hit or still being written)
    /// in full-attention groups, as `(group, chunk index)` in the order its
    /// prefix scans asked them (a chunk asked again appears again): vLLM's
    /// `record_lookup` calls, for its self-describing KV events. Empty with
    /// one group ([`Self::last_lookup_hits`]).
    pub fn last_lookup_group_hits(&self) -> &[(usize, usize)] {
        &self.last_lookup_group_hits
    }

    /// The answer, and whether the tier was looked up (`false`: deferred by
    /// the request's own jobs in flight, before any lookup); `skip_reading`:
    /// zero once the request is restarted (vLLM's `skip_reading_prefix_cache`).
    fn lookup_inner(
        &mut self,
        req: RequestId,
        computed_tokens: u64,
        skip_reading: bool,
    ) -> Result<(LookupOutcome, bool), SchedulerError> {
        self.last_lookup_hits = None;
        self.last_lookup_group_hits.clear();
        self.last_partial_tails.clear();
        self.apply_stalls();
        let g = self.geo;
        let rs = self
            .requests
            .get_mut(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        rs.restart();
        rs.lookup_computed = Some(computed_tokens);
        if !rs.jobs.is_empty() {
            return Ok((LookupOutcome::Defer, false));
        }
        if skip_reading {
            return Ok((LookupOutcome::Hit(0), true));
        }
        if self.groups.is_some() {
            let skip_remote = rs.caps.skip_remote_tier;
            let mut found = std::mem::take(&mut self.last_lookup_group_hits);
            let mut ends = std::mem::take(&mut self.last_complete_hit_ends);
            let outcome = self.lookup_groups(req, computed_tokens, &mut found, &mut ends);
            self.last_lookup_group_hits = found;
            self.last_complete_hit_ends = ends;
            // The host tier's hit could go further: the remote tier, if one
            // is attached, is asked about the rest (`hybrid/on_remote.rs`).
            if let Ok(LookupOutcome::Hit(hit)) = outcome
                && self.remote.is_some()
                && !skip_remote
                && let Some(remote) = self.remote_lookup_groups(req, computed_tokens, hit)
            {
                return Ok((remote, true));
            }
            // A hit may end on a partial tail past the complete chunks, in
            // the host tier or, if one is attached, the remote tier
            // (`hybrid/on_remote_tail.rs`).
            let complete = outcome?;
            let outcome = self.lookup_partial_tail(req, computed_tokens, complete);
            if let LookupOutcome::Hit(complete_hit) = complete
                && self.remote.is_some()
                && !skip_remote
                && let Some(remote) =
                    self.remote_partial_tail(req, computed_tokens, complete_hit, outcome)
            {
                return Ok((remote, true));
            }
            return Ok((outcome, true));
        }
        // As vLLM: no hit past the request's last full chunk, and the
        // less-than-a-chunk answer (zero) comes before any key is looked up,
        // so a pending chunk past that bound never defers the request.
        let full_chunk_tokens =
            (rs.num_keys(g.blocks_per_chunk) as u64).saturating_mul(g.tokens_per_chunk);
        let max_hit = max_hit_tokens(
            rs.num_tokens,
            full_chunk_tokens,
            computed_tokens,
            rs.caps.max_load_tokens,
            g.tokens_per_chunk,
        );
        let skip_remote = rs.caps.skip_remote_tier;
        if max_hit.saturating_sub(computed_tokens) < g.tokens_per_chunk {
            return Ok((LookupOutcome::Hit(0), true));
        }
        let start = (computed_tokens / g.tokens_per_chunk) as usize;
        let end =
            (max_hit.div_ceil(g.tokens_per_chunk) as usize).min(rs.num_keys(g.blocks_per_chunk));
        if start >= end {
            return Ok((LookupOutcome::Hit(0), true));
        }
        let Some(rs) = self.requests.get(&req) else {
            return Err(SchedulerError::UnknownRequest(req));
        };
        let scan = maximal_prefix(
            &self.manager,
            (start..end).map(|i| rs.key(i, g.blocks_per_chunk)),
        );
        self.last_lookup_hits = Some(start..start + scan.hits);
        if scan.defer {
            return Ok((LookupOutcome::Defer, true));
        }
        // The host tier misses from chunk `first` on: the remote tier, if
        // one is attached, is asked about the rest (`remote.rs`).
        let first = start + scan.hits;
        if self.remote.is_some() && first < end && !skip_remote {
            let keys: Vec<ChunkKey> = (first..end)
                .map(|i| rs.key(i, g.blocks_per_chunk))
                .collect();
            if let Some(outcome) = self.remote_lookup(req, first, &keys) {
                return Ok((outcome, true));
            }
        }
        let Some(rs) = self.requests.get(&req) else {
            return Err(SchedulerError::UnknownRequest(req));
        };
        let covered = g
            .tokens_per_chunk
            .saturating_mul((start + scan.hits) as u64)
            .min(max_hit);
        let hit = covered.saturating_sub(computed_tokens);
        if hit < g.tokens_per_chunk {
            return Ok((LookupOutcome::Hit(0), true));
        }
        if !self.being_loaded.is_empty()
            && (start..start + scan.hits).any(|i| {
                self.being_loaded
                    .contains_key(&rs.key(i, g.blocks_per_chunk))
            })
        {
            return Ok((LookupOutcome::Defer, true));
        }
        Ok((LookupOutcome::Hit(hit), true))
    }

    /// The backend allocated `block_ids` (the request's whole table) for `req`,
    /// `external_tokens` of which are to be loaded (vLLM `update_state_after_alloc`).
    ///
    /// Every non-null block counts as allocated in this step (fence check at
    /// [`Self::build_step`]). With external tokens, one asynchronous load job is
    /// created: it pins its chunks and marks them as being loaded.
    pub fn on_alloc(
        &mut self,
        req: RequestId,
        block_ids: &[GpuBlockId],
        external_tokens: u64,
    ) -> Result<Option<JobId>, SchedulerError> {
        self.apply_stalls();
        if self.groups.is_some() {
            return Err(SchedulerError::Groups(
                "a scheduler with several KV groups takes on_alloc_groups".into(),
            ));
        }
        let g = self.geo;
        let rs = self
            .requests
            .get(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        // Validate everything before changing anything.
        let plan = if external_tokens == 0 {
            None
        } else {
            let computed = rs.lookup_computed.ok_or(SchedulerError::NoLookup(req))?;
            if !rs.jobs.is_empty() {
                return Err(SchedulerError::JobsInFlight(req));
            }
            let cached = computed.saturating_add(external_tokens);
            let start_block = (computed / g.tokens_per_block) as usize;
            let end_block = cached.div_ceil(g.tokens_per_block) as usize;
            if end_block > block_ids.len() {
                return Err(SchedulerError::LoadOutOfRange {
                    req,
                    what: format!(
                        "needs {end_block} blocks, the table has {}",
                        block_ids.len()
                    ),
                });
            }
            let first_chunk = start_block / g.blocks_per_chunk;
            let end_chunk = cached.div_ceil(g.tokens_per_chunk) as usize;
            if end_chunk > rs.num_keys(g.blocks_per_chunk) {
                return Err(SchedulerError::LoadOutOfRange {
                    req,
                    what: format!(
                        "needs {end_chunk} chunk keys, the request has {}",
                        rs.num_keys(g.blocks_per_chunk)
                    ),
                });
            }
            let keys: Vec<ChunkKey> = (first_chunk..end_chunk)
                .map(|i| rs.key(i, g.blocks_per_chunk))
                .collect();
            Some((keys, start_block, end_block, end_chunk))
        };
        let plan = match plan {
            None => None,
            Some((keys, sb, eb, end_chunk)) => {
                let chunk_ids = match self.requests.get_mut(&req) {
                    // Positions: chunk i ends at (i + 1) chunks (vLLM's
                    // token positions, in chunk units: the same order).
                    Some(rs) => self.manager.prepare_load_recorded(
                        &keys,
                        (end_chunk - keys.len()) as u64 + 1,
                        &mut rs.access,
                    )?,
                    None => self.manager.prepare_load(&keys, Some(req))?,
                };
                Some((keys, chunk_ids, sb, eb, end_chunk))
            }
        };
        self.batch.allocated.extend_non_null(block_ids);
        let Some((keys, chunk_ids, sb, eb, end_chunk)) = plan else {
            return Ok(None);
        };
        let sync = self.batch.sync_reserved.contains(&req);
        let blocks = JobBlocks::from_slice(&block_ids[sb..eb]);
        let job = self.create_load(req, keys, chunk_ids, blocks, Vec::new(), sync);
        if let Some(rs) = self.requests.get_mut(&req) {
            rs.jobs.push(job);
            rs.next_stored_chunk = rs.next_stored_chunk.max(end_chunk);
        }
        Ok(Some(job))
    }
}

impl Scheduler {
    /// Creates a load job (one path for one group and several): marks its
    /// keys as being loaded unless it is `sync` (a synchronous load ends
    /// before the step's compute: other requests' lookups need not wait for
    /// its chunks; vLLM marks only async ones), enters it in the job table
    /// and the watchdog's schedule, and adds it to the step's loads.
    pub(crate) fn create_load(
        &mut self,
        req: RequestId,
        keys: Vec<ChunkKey>,
        chunk_ids: Vec<crate::ids::ChunkId>,
        blocks: JobBlocks,
        groups: Vec<super::types::GroupSpan>,
        sync: bool,
    ) -> JobId {
        let job = self.new_job_id();
        let now = self.now_ns();
        if sync {
            self.batch.sync_loads.push(job);
        } else {
            for &k in &keys {
                *self.being_loaded.entry(k).or_insert(0) += 1;
            }
        }
        let deadline = self.jobs.deadline_for(now);
        let latch = super::latch::JobLatch::new(self.geo.world_size);
        let entry = JobEntry::load(
            req,
            now,
            latch,
            JobKeys::from_slice(&keys),
            &chunk_ids,
            &blocks,
            sync,
        );
        self.jobs.insert(job, entry);
        // After the insert: the watchdog drops deadline entries of absent jobs.
        self.watch.track(job, deadline);
        self.batch.loads.push(TransferJob {
            job,
            req,
            block_ids: blocks,
            chunk_ids: JobSlots::from_vec(chunk_ids),
            keys: JobKeys::from_vec(keys),
            groups,
        });
        job
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EvictionPolicyKind;
    use crate::manager::StoreOutcome;

    fn manager(ready: &[u64], pending: &[u64]) -> OffloadManager {
        let mut m = OffloadManager::new(16, EvictionPolicyKind::Lru).unwrap();
        let all: Vec<ChunkKey> = ready.iter().chain(pending).map(|&k| ChunkKey(k)).collect();
        m.prepare_store(&all, None).unwrap();
        let r: Vec<ChunkKey> = ready.iter().map(|&k| ChunkKey(k)).collect();
        m.complete_store(&r, StoreOutcome::Success, None).unwrap();
        m
    }

    fn scan(m: &OffloadManager, keys: &[u64]) -> PrefixScan {
        maximal_prefix(m, keys.iter().map(|&k| ChunkKey(k)))
    }

    #[test]
    fn all_hit() {
        let m = manager(&[1, 2, 3], &[]);
        assert_eq!(
            scan(&m, &[1, 2, 3]),
            PrefixScan {
                hits: 3,
                defer: false
            }
        );
    }

    #[test]
    fn partial_prefix_and_miss_stops_the_scan() {
        let m = manager(&[1, 2, 4], &[]);
        assert_eq!(
            scan(&m, &[1, 2, 3, 4]),
            PrefixScan {
                hits: 2,
                defer: false
            }
        );
    }

    #[test]
    fn miss_then_hit_is_zero() {
        let m = manager(&[2], &[]);
        assert_eq!(
            scan(&m, &[1, 2]),
            PrefixScan {
                hits: 0,
                defer: false
            }
        );
    }

    #[test]
    fn hit_pending_counts_defers_and_the_scan_continues() {
        let m = manager(&[1, 3], &[2]);
        assert_eq!(
            scan(&m, &[1, 2, 3, 4]),
            PrefixScan {
                hits: 3,
                defer: true
            }
        );
    }
}
