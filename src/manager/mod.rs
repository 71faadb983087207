//! The host tier: which chunks are offloaded, in which host slot, in which
//! state, and which to evict. Behaviour of vLLM's `CPUOffloadingManager` for
//! one KV group (see `docs/manager.md`), plus store quarantine for stalls.
//!
//! A chunk is *pending* while its store is in flight (lookups answer
//! [`LookupResult::HitPending`]), *ready* once stored (evictable), and *pinned*
//! while loads read it. Pinned and pending chunks are never evicted. Every
//! method validates its input first and returns a [`ManagerError`] with the
//! state unchanged on bad input.
//!
//! This file holds the [`OffloadManager`] struct and its construction; its
//! methods are split by concern, one file each:
//!
//! - `slots`: the slot records and state counters, key -> slot lookups, and
//!   allocation of slots for a store (with eviction);
//! - `store`: the store path (`prepare_store` and its hot-path form for the
//!   scheduler, `complete_store`);
//! - `load`: the load path (`prepare_load`, `complete_load`) and quarantine
//!   (`quarantine_pinned`, `release_quarantined`);
//! - `recency`: where a request's record lives, what the policy learns from
//!   it (ranked observations, `request_finished`), and `touch`;
//! - `drain`: events, allocation sizes and evicted slots handed to the backend;
//! - `reset`: `reset` and the flush protocol around it;
//! - `inspect`: statistics, debug views and the invariant check.
//!
//! The building blocks live beside them: the key -> slot index (`slot_index`,
//! with `key_index` for ARC's ghost keys, both on the linear-probing table of
//! `probing`), the free list (`slot_pool`), the eviction policies (`policy`,
//! `lru`, `arc`), per-request records (`request_access`), the reuse filter,
//! the event log and the value types (`types`).

mod drain;
mod events;
mod huge_buffer;
mod inspect;
mod key_index;
mod load;
mod policy;
mod probing;
mod recency;
mod request_access;
mod reset;
mod reuse_filter;
mod slot_index;
mod slot_pool;
mod slots;
mod store;
mod types;

use std::collections::HashMap;

use crate::config::{EvictionPolicyKind, OffloadConfig};
use crate::ids::{ChunkId, RequestId};
use crate::key::{ChunkKey, KeyBuildHasher};

use events::EventLog;
use huge_buffer::HugeBuffer;
use policy::{Policy, new_policy};
use reuse_filter::ReuseFilter;
use slot_index::SlotIndex;
use slot_pool::SlotPool;
use slots::{Counters, EMPTY_SLOT, Slot};
use store::Offered;

pub use inspect::ArcState;
pub(crate) use request_access::RequestAccess;
pub use types::{
    LookupResult, ManagerError, ManagerStats, OffloadEvent, PrepareStoreOutput, StoreOutcome,
};

/// Allocation sizes kept for [`OffloadManager::take_allocation_sizes`] at
/// most: a backend that never takes them loses the newest, not memory.
pub const MAX_RECENT_ALLOCATIONS: usize = 1 << 16;

/// Power-of-two buckets of `prepare_store` allocation sizes (chunks per call).
pub const ALLOC_SIZE_BUCKETS: usize = 16;

/// The host-tier offload manager for one KV group.
///
/// A store is prepared (slots reserved, the chunks pending), written by the
/// workers, then completed; a stored chunk can then be looked up and loaded.
///
/// ```
/// use kvoffload::manager::{LookupResult, OffloadManager, StoreOutcome};
/// use kvoffload::{ChunkKey, EvictionPolicyKind};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut m = OffloadManager::new(4, EvictionPolicyKind::Lru)?;
/// let keys = [ChunkKey(1), ChunkKey(2)];
/// let plan = m.prepare_store(&keys, None).ok_or("no room")?;
/// assert_eq!(plan.keys_to_store, keys);
/// assert_eq!(m.lookup(ChunkKey(1)), LookupResult::HitPending);
/// // ... the workers copy the chunks into `plan.chunk_ids` ...
/// m.complete_store(&plan.keys_to_store, StoreOutcome::Success, None)?;
/// assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
/// assert_eq!(m.lookup(ChunkKey(3)), LookupResult::Miss);
///
/// // Loading pins the chunks (no eviction) until the load completes.
/// let slots = m.prepare_load(&keys, None)?;
/// assert_eq!(slots, plan.chunk_ids);
/// m.complete_load(&keys, None)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct OffloadManager {
    capacity: u32,
    policy_kind: EvictionPolicyKind,
    index: SlotIndex,
    slots: HugeBuffer<Slot>,
    pool: SlotPool,
    policy: Policy,
    events: EventLog,
    filter: Option<ReuseFilter>,
    requests: HashMap<RequestId, RequestAccess, KeyBuildHasher>,
    counters: Counters,
    stores_skipped: u64,
    allocation_failures: u64,
    /// Keys each `prepare_store` tried to allocate since the last
    /// [`OffloadManager::take_allocation_sizes`] (vLLM's allocation-size
    /// histogram), at most [`MAX_RECENT_ALLOCATIONS`].
    allocation_sizes: Vec<u32>,
    ignored_complete_keys: u64,
    alloc_sizes: [u64; ALLOC_SIZE_BUCKETS],
    generation: u64,
    /// KV groups sharing each chunk position ([`Self::set_position_groups`]).
    position_groups: u32,
    /// Reused buffers (no allocation on the hot path).
    scratch_slots: Vec<u32>,
    scratch_pos: Vec<u64>,
    scratch_offer: Vec<Offered>,
    scratch_observed: Vec<(ChunkKey, u64)>,
    scratch_candidates: Vec<usize>,
    scratch_misses: Vec<ChunkKey>,
    scratch_fresh: Vec<bool>,
    scratch_resolved: Vec<(ChunkKey, u32)>,
    scratch_victims: Vec<u32>,
    scratch_store: Vec<ChunkKey>,
    scratch_done: Vec<ChunkKey>,
    scratch_ids: Vec<ChunkId>,
    scratch_evicted: Vec<ChunkKey>,
    /// Evicted chunks with the slot they held, kept while
    /// [`Self::track_evicted_slots`] is on (a remote tier written on
    /// eviction), until [`Self::take_evicted_slots`].
    evicted_slots: Option<Vec<(ChunkKey, ChunkId)>>,
}

impl OffloadManager {
    /// A manager of `num_chunks` host slots with the given policy and no reuse filter.
    pub fn new(num_chunks: u64, policy: EvictionPolicyKind) -> Result<Self, ManagerError> {
        if num_chunks == 0 {
            return Err(ManagerError::ZeroCapacity);
        }
        if num_chunks >= u64::from(u32::MAX) {
            return Err(ManagerError::CapacityTooLarge(num_chunks));
        }
        let capacity = num_chunks as u32;
        Ok(Self {
            capacity,
            policy_kind: policy,
            index: SlotIndex::with_capacity(capacity as usize),
            slots: HugeBuffer::new(capacity as usize, EMPTY_SLOT),
            pool: SlotPool::new(capacity),
            policy: new_policy(policy, capacity),
            events: EventLog::default(),
            filter: None,
            requests: HashMap::default(),
            counters: Counters::default(),
            stores_skipped: 0,
            allocation_failures: 0,
            allocation_sizes: Vec::new(),
            ignored_complete_keys: 0,
            alloc_sizes: [0; ALLOC_SIZE_BUCKETS],
            generation: 0,
            position_groups: 1,
            scratch_slots: Vec::new(),
            scratch_pos: Vec::new(),
            scratch_offer: Vec::new(),
            scratch_observed: Vec::new(),
            scratch_candidates: Vec::new(),
            scratch_misses: Vec::new(),
            scratch_fresh: Vec::new(),
            scratch_resolved: Vec::new(),
            scratch_victims: Vec::new(),
            scratch_store: Vec::new(),
            scratch_done: Vec::new(),
            scratch_ids: Vec::new(),
            scratch_evicted: Vec::new(),
            evicted_slots: None,
        })
    }

    /// Several KV groups share each chunk position of a request (vLLM's
    /// keys carry the group): callers then give chunk `c` (ending at
    /// position `c + 1`) of group `g` the position `(c + 1) * groups +
    /// (groups - 1 - g)`. The LRU order within an active request is then
    /// vLLM's (tail first; at one position the lower group first, as vLLM's
    /// heap compares keys), and a finished request is replayed by chunk then
    /// group, as vLLM's `order_request_keys`. 1 (the default): one group.
    pub(crate) fn set_position_groups(&mut self, groups: u32) {
        self.position_groups = groups.max(1);
    }

    /// A manager sized and configured by `cfg` (capacity, policy, reuse filter).
    pub fn from_config(cfg: &OffloadConfig) -> Result<Self, ManagerError> {
        let n = cfg.num_chunks().map_err(|_| ManagerError::ZeroCapacity)?;
        let mut m = Self::new(u64::from(n), cfg.eviction_policy)?;
        if cfg.store_threshold >= 2 {
            m.filter = Some(ReuseFilter::new(cfg.store_threshold, cfg.max_tracker_size));
        }
        Ok(m)
    }

    /// Enables the reuse filter: keys are stored once offered `threshold` (>= 2) times.
    pub fn with_store_threshold(mut self, threshold: u32, max_tracker_size: u64) -> Self {
        self.filter = (threshold >= 2).then(|| ReuseFilter::new(threshold, max_tracker_size));
        self
    }

    /// Host slots in the tier.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// The eviction policy in use.
    pub fn policy_kind(&self) -> EvictionPolicyKind {
        self.policy_kind
    }

    /// Incremented by every [`Self::reset`].
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

#[cfg(test)]
mod tests;
