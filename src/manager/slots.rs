//! Slot bookkeeping: the per-slot records and the state counters, which slot
//! holds a key, and allocation of slots for a store (evicting ready chunks
//! the policy picks when the free list runs short).
//!
//! A slot is *free* (in the pool), *occupied* by an indexed key (pending,
//! ready or pinned, by its reference count), or *quarantined* (out of both
//! the index and the pool until a late transfer is over).

use crate::ids::ChunkId;
use crate::key::ChunkKey;

use super::policy::EvictionPolicy;
use super::request_access::RequestRank;
use super::{ALLOC_SIZE_BUCKETS, LookupResult, OffloadManager};

/// Reference count of a chunk being stored.
pub(super) const PENDING: i32 = -1;

/// Where a slot stands: in the free list, holding an indexed key, or held
/// back for a late transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    Occupied,
    Quarantined,
}

/// Per-slot record: 16 bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub(super) key: ChunkKey,
    /// -1 pending, 0 ready, k > 0 pinned by k loads. Meaningful when occupied.
    pub(super) ref_cnt: i32,
    pub(super) state: SlotState,
    /// Transient mark: offered in the `prepare_store` being processed.
    pub(super) protected: bool,
}

pub(super) const EMPTY_SLOT: Slot = Slot {
    key: ChunkKey(0),
    ref_cnt: 0,
    state: SlotState::Free,
    protected: false,
};

/// How many slots are in each state (pinned ones also count as ready).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counters {
    pub(super) ready: u32,
    pub(super) pending: u32,
    pub(super) pinned: u32,
    pub(super) quarantined: u32,
}

/// The key each indexed slot's record holds, for the index's key checks.
#[inline]
pub(super) fn key_of(slots: &[Slot]) -> impl Fn(u32) -> ChunkKey + '_ {
    move |s| slots[s as usize].key
}

impl OffloadManager {
    /// The slot `key` is indexed at (pending or ready).
    #[inline]
    pub(super) fn indexed(&self, key: ChunkKey) -> Option<u32> {
        self.index.get(key, key_of(&self.slots))
    }

    /// Whether `key` is stored (hit), being stored (hit pending) or absent (miss).
    #[inline]
    pub fn lookup(&self, key: ChunkKey) -> LookupResult {
        match self.indexed(key) {
            None => LookupResult::Miss,
            Some(s) if self.slots[s as usize].ref_cnt == PENDING => LookupResult::HitPending,
            Some(_) => LookupResult::Hit,
        }
    }

    /// The host slot of `key`, if present (pending or ready).
    pub fn slot_of(&self, key: ChunkKey) -> Option<ChunkId> {
        self.indexed(key).map(ChunkId)
    }

    /// Allocates slots for `to_store` (evicting if needed). On success the keys
    /// and their slots are left in `scratch_store` / `scratch_ids`, and the
    /// evicted keys in `scratch_evicted` (also logged as an event).
    /// `per_key_misses`: `scratch_fresh` says which keys this store showed
    /// the policy as misses (otherwise all of them were).
    pub(super) fn allocate(
        &mut self,
        to_store: Vec<ChunkKey>,
        positions: &[u64],
        rank: Option<RequestRank>,
        per_key_misses: bool,
    ) -> bool {
        let free = self.pool.available();
        let need = to_store.len().saturating_sub(free);
        let evictable = (self.counters.ready - self.counters.pinned) as usize;
        if need > evictable {
            self.record_alloc_size(to_store.len());
            self.scratch_store = to_store;
            return false;
        }
        let mut victims = std::mem::take(&mut self.scratch_victims);
        victims.clear();
        if need > 0 {
            let slots = &self.slots;
            let mut can_evict =
                |s: u32| -> bool { slots[s as usize].ref_cnt == 0 && !slots[s as usize].protected };
            if !self.policy.evict(need, &mut can_evict, &mut victims) {
                self.scratch_victims = victims;
                self.record_alloc_size(to_store.len());
                self.scratch_store = to_store;
                return false;
            }
        }
        for &s in &victims {
            self.index.prefetch(self.slots[s as usize].key);
        }
        let mut evicted = std::mem::take(&mut self.scratch_evicted);
        evicted.clear();
        for &s in &victims {
            let key = self.slots[s as usize].key;
            evicted.push(key);
            if let Some(t) = self.evicted_slots.as_mut() {
                t.push((key, ChunkId(s)));
            }
            self.index.remove(key, key_of(&self.slots));
            self.slots[s as usize] = EMPTY_SLOT;
            self.counters.ready -= 1;
            self.pool.release(s);
        }
        self.scratch_victims = victims;
        self.events.evicted(&evicted);
        self.scratch_evicted = evicted;
        let mut chunk_ids = std::mem::take(&mut self.scratch_ids);
        chunk_ids.clear();
        for (i, &k) in to_store.iter().enumerate() {
            // The capacity check above guarantees a slot.
            let Some(s) = self.pool.alloc() else {
                unreachable!("slot pool exhausted after a successful capacity check")
            };
            self.slots[s as usize] = Slot {
                key: k,
                ref_cnt: PENDING,
                state: SlotState::Occupied,
                protected: false,
            };
            self.index.insert(k, s, key_of(&self.slots));
            let shown_as_miss =
                !per_key_misses || self.scratch_fresh.get(i).copied().unwrap_or(false);
            self.policy.insert_at(
                s,
                k,
                rank.as_ref().map(|r| (r, positions[i])),
                shown_as_miss,
            );
            chunk_ids.push(ChunkId(s));
        }
        self.counters.pending += to_store.len() as u32;
        self.record_alloc_size(to_store.len());
        self.scratch_store = to_store;
        self.scratch_ids = chunk_ids;
        true
    }

    /// Counts an allocation of `n` keys in its power-of-two bucket.
    fn record_alloc_size(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let bucket = (usize::BITS - n.leading_zeros() - 1) as usize;
        self.alloc_sizes[bucket.min(ALLOC_SIZE_BUCKETS - 1)] += 1;
    }
}
