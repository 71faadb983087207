//! The store path: a store offer (vLLM `prepare_store`: the reuse filter, the
//! request's observations, ARC's ghost hits, then allocation of slots for the
//! keys not yet in the tier) and its completion (the pending chunks become
//! ready, or are dropped, or leave their slots quarantined).

use std::collections::HashSet;

use crate::ids::{ChunkId, RequestId};
use crate::key::{ChunkKey, KeyBuildHasher};

use super::policy::EvictionPolicy;
use super::recency::Record;
use super::request_access::RequestAccess;
use super::slots::{EMPTY_SLOT, PENDING, Slot, SlotState, key_of};
use super::{
    MAX_RECENT_ALLOCATIONS, ManagerError, OffloadManager, PrepareStoreOutput, StoreOutcome,
};

/// One distinct key of a store offer that the request records.
#[derive(Debug, Clone, Copy)]
pub(super) struct Offered {
    key: ChunkKey,
    pos: u64,
    /// Found ready in the tier (a reuse); otherwise a candidate to store.
    ready: bool,
}

impl OffloadManager {
    /// Allocates host slots for the offered keys that are not present yet.
    ///
    /// Keys already present (pending or ready) are skipped, and so are keys the
    /// reuse filter holds back. Evicts the least valuable ready chunks if needed,
    /// never a pinned or pending one and never one of the offered keys. Returns
    /// `None` when it cannot allocate; then nothing changed apart from what
    /// vLLM also records before allocating (the request's observations, ARC's
    /// adaptation to ghost hits, the reuse filter's offer counts).
    pub fn prepare_store(
        &mut self,
        keys: &[ChunkKey],
        req: Option<RequestId>,
    ) -> Option<PrepareStoreOutput> {
        let (keys_to_store, chunk_ids) = self
            .store(keys, None, Record::mapped(req))
            .map(|(k, c)| (k.to_vec(), c.to_vec()))?;
        Some(PrepareStoreOutput {
            keys_to_store,
            chunk_ids,
            evicted: std::mem::take(&mut self.scratch_evicted),
        })
    }

    /// [`Self::prepare_store`] for the scheduler's hot path, without allocating:
    /// the keys to store and their slots are borrowed from reused buffers, the
    /// evicted keys go to the event log only, and the observations are
    /// recorded in `access`, which the caller keeps (the request's state: no
    /// map probe). `positions` are co-indexed with `keys` (the chunks' end
    /// positions in the request; LRU ranks a request's chunks by them).
    pub(crate) fn prepare_store_for_job(
        &mut self,
        keys: &[ChunkKey],
        positions: &[u64],
        access: &mut RequestAccess,
    ) -> Option<(&[ChunkKey], &[ChunkId])> {
        debug_assert_eq!(keys.len(), positions.len());
        self.store(keys, Some(positions), Record::Kept(access))
    }

    /// The one store path: the offer with the request's record, if any (see
    /// [`Self::prepare_store`]); on success the keys to store and their slots,
    /// borrowed from the scratch buffers (the evicted keys are left in
    /// `scratch_evicted`).
    fn store(
        &mut self,
        keys: &[ChunkKey],
        positions: Option<&[u64]>,
        record: Record<'_>,
    ) -> Option<(&[ChunkKey], &[ChunkId])> {
        let ok = self.with_record(record, |m, acc| m.process_offer(keys, positions, acc));
        ok.then_some((&self.scratch_store, &self.scratch_ids))
    }

    /// Processes a store offer (see [`Self::prepare_store`]); whether it
    /// could allocate. `positions`: the keys' positions, when known.
    fn process_offer(
        &mut self,
        keys: &[ChunkKey],
        positions: Option<&[u64]>,
        mut access: Option<&mut RequestAccess>,
    ) -> bool {
        if let Some(filter) = self.filter.as_mut() {
            filter.record(keys);
        }
        // Offered keys, deduplicated in order: absent ones are the candidates
        // to store; present ones are protected from eviction, and the ready
        // ones among them are the request's reuses.
        let mut to_store = std::mem::take(&mut self.scratch_store);
        to_store.clear();
        let mut to_store_pos = std::mem::take(&mut self.scratch_pos);
        to_store_pos.clear();
        let mut protected = std::mem::take(&mut self.scratch_slots);
        protected.clear();
        let mut offer = std::mem::take(&mut self.scratch_offer);
        offer.clear();
        for &k in keys {
            self.index.prefetch(k);
        }
        let mut distinct = (keys.len() > 64)
            .then(|| HashSet::with_capacity_and_hasher(keys.len(), KeyBuildHasher::default()));
        for (i, &k) in keys.iter().enumerate() {
            let repeated = match distinct.as_mut() {
                Some(set) => !set.insert(k),
                None => keys[..i].contains(&k),
            };
            if repeated {
                continue;
            }
            let pos = positions.map_or(0, |p| p[i]);
            match self.indexed(k) {
                Some(s) => {
                    let slot = &mut self.slots[s as usize];
                    if slot.ref_cnt >= 0 {
                        offer.push(Offered {
                            key: k,
                            pos,
                            ready: true,
                        });
                    }
                    if !slot.protected {
                        slot.protected = true;
                        protected.push(s);
                    }
                }
                None => {
                    to_store.push(k);
                    to_store_pos.push(pos);
                    offer.push(Offered {
                        key: k,
                        pos,
                        ready: false,
                    });
                }
            }
        }
        if let Some(filter) = self.filter.as_ref() {
            let skipped = filter.admit(&mut to_store, &mut to_store_pos);
            if skipped > 0 {
                self.stores_skipped += skipped;
                let admitted: HashSet<ChunkKey, KeyBuildHasher> =
                    to_store.iter().copied().collect();
                offer.retain(|o| o.ready || admitted.contains(&o.key));
            }
        }
        // The request records what it saw, and ARC learns from ghost hits
        // before the inserts remove the ghosts (once per request and key).
        match access.as_deref_mut() {
            None => self.policy.on_store_miss(&to_store),
            Some(acc) => {
                acc.refresh(self.generation);
                self.record_store_offer(&offer, positions.is_some(), acc);
                if !self.scratch_misses.is_empty() {
                    self.policy.on_store_miss(&self.scratch_misses);
                }
            }
        }
        let result = if to_store.is_empty() {
            self.scratch_ids.clear();
            self.scratch_evicted.clear();
            self.scratch_store = to_store;
            true
        } else {
            // As vLLM: every allocation attempt counts, failed ones too.
            if self.allocation_sizes.len() < MAX_RECENT_ALLOCATIONS {
                self.allocation_sizes
                    .push(u32::try_from(to_store.len()).unwrap_or(u32::MAX));
            }
            let rank = access.as_deref().and_then(|a| a.rank);
            let ranked = if positions.is_some() { rank } else { None };
            self.allocate(to_store, &to_store_pos, ranked, access.is_some())
        };
        if result && let Some(acc) = access.as_mut() {
            for &i in &self.scratch_candidates {
                acc.mark_inserted_at(i);
            }
        }
        for &s in &protected {
            self.slots[s as usize].protected = false;
        }
        self.scratch_slots = protected;
        self.scratch_pos = to_store_pos;
        self.scratch_offer = offer;
        if !result {
            self.allocation_failures += 1;
        }
        result
    }

    /// Records a store offer as the request's observations: vLLM records the
    /// candidates to store and the ready keys it found, in offer order, before
    /// allocating; the ready ones are reuses. Leaves the candidates not yet
    /// shown to the policy as store misses in `scratch_misses` and the
    /// candidates' record indices in `scratch_candidates` (and in
    /// `scratch_fresh` whether each was shown as a miss by this store).
    fn record_store_offer(&mut self, offer: &[Offered], positioned: bool, acc: &mut RequestAccess) {
        let mut observed = std::mem::take(&mut self.scratch_observed);
        observed.clear();
        let mut misses = std::mem::take(&mut self.scratch_misses);
        misses.clear();
        let mut candidates = std::mem::take(&mut self.scratch_candidates);
        candidates.clear();
        let mut fresh_misses = std::mem::take(&mut self.scratch_fresh);
        fresh_misses.clear();
        for o in offer {
            let pos = positioned.then_some(o.pos);
            let (i, new) = acc.observe(o.key, pos);
            if new && positioned {
                observed.push((o.key, o.pos));
            }
            if o.ready {
                acc.mark_reused_at(i);
            } else {
                let fresh = acc.note_store_miss_at(i);
                if fresh {
                    misses.push(o.key);
                }
                candidates.push(i);
                fresh_misses.push(fresh);
            }
        }
        self.observe_ranked(&observed, acc);
        self.scratch_observed = observed;
        self.scratch_misses = misses;
        self.scratch_candidates = candidates;
        self.scratch_fresh = fresh_misses;
    }

    /// Ends a store job. Pending keys become ready ([`StoreOutcome::Success`]),
    /// are removed with their slots freed ([`StoreOutcome::Failure`]), or are
    /// removed with their slots held back ([`StoreOutcome::Quarantined`], whose
    /// slots are returned). Keys already ready and keys not in the tier (never
    /// prepared, evicted, failed, or dropped by a reset) are ignored, as vLLM
    /// ignores them, and counted in
    /// [`ManagerStats::ignored_complete_keys`](super::ManagerStats::ignored_complete_keys).
    pub fn complete_store(
        &mut self,
        keys: &[ChunkKey],
        outcome: StoreOutcome,
        _req: Option<RequestId>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        // One index pass: resolve every key to its slot (validating), then apply.
        let mut resolved = std::mem::take(&mut self.scratch_resolved);
        resolved.clear();
        for &k in keys {
            match self.indexed(k) {
                Some(s) => resolved.push((k, s)),
                None => self.ignored_complete_keys += 1,
            }
        }
        // The keys completed here, for the event (a kept buffer: a steady
        // step's completions allocate nothing).
        let mut done = std::mem::take(&mut self.scratch_done);
        done.clear();
        let mut held = Vec::new();
        for &(k, s) in &resolved {
            // Skip keys already ready, and keys listed twice (removed earlier in this call).
            let slot = &self.slots[s as usize];
            if slot.ref_cnt != PENDING || slot.state != SlotState::Occupied || slot.key != k {
                self.ignored_complete_keys += 1;
                continue;
            }
            self.counters.pending -= 1;
            match outcome {
                StoreOutcome::Success => {
                    self.slots[s as usize].ref_cnt = 0;
                    self.counters.ready += 1;
                    self.policy.on_ready(s);
                }
                StoreOutcome::Failure => {
                    self.index.remove(k, key_of(&self.slots));
                    self.slots[s as usize] = EMPTY_SLOT;
                    self.policy.on_remove(s);
                    self.pool.release(s);
                }
                StoreOutcome::Quarantined => {
                    self.index.remove(k, key_of(&self.slots));
                    self.slots[s as usize] = Slot {
                        state: SlotState::Quarantined,
                        ..EMPTY_SLOT
                    };
                    self.policy.on_remove(s);
                    self.counters.quarantined += 1;
                    held.push(ChunkId(s));
                }
            }
            done.push(k);
        }
        self.scratch_resolved = resolved;
        match outcome {
            StoreOutcome::Success => self.events.stored(&done),
            StoreOutcome::Failure | StoreOutcome::Quarantined => self.events.store_failed(&done),
        }
        self.scratch_done = done;
        Ok(held)
    }
}
