//! The host tier: which chunks are offloaded, in which host slot, in which
//! state, and which to evict. Behaviour of vLLM's `CPUOffloadingManager` for
//! one KV group (see `docs/manager.md`), plus store quarantine for stalls.
//!
//! A chunk is *pending* while its store is in flight (lookups answer
//! [`LookupResult::HitPending`]), *ready* once stored (evictable), and *pinned*
//! while loads read it. Pinned and pending chunks are never evicted. Every
//! method validates its input first and returns a [`ManagerError`] with the
//! state unchanged on bad input.

mod arc;
mod events;
mod huge_buffer;
mod index_list;
mod key_index;
mod lru;
mod policy;
mod probing;
mod request_access;
mod reuse_filter;
mod slot_index;
mod slot_pool;
mod types;

use std::collections::HashMap;

use crate::config::{EvictionPolicyKind, OffloadConfig};
use crate::ids::{ChunkId, RequestId};
use crate::key::{ChunkKey, KeyBuildHasher};

use events::EventLog;

/// Allocation sizes kept for [`OffloadManager::take_allocation_sizes`] at
/// most: a backend that never takes them loses the newest, not memory.
pub const MAX_RECENT_ALLOCATIONS: usize = 1 << 16;
use huge_buffer::HugeBuffer;
use policy::{EvictionPolicy, FinishedAccess, Policy, new_policy};
pub(crate) use request_access::RequestAccess;
use request_access::RequestRank;
use reuse_filter::ReuseFilter;
use slot_index::SlotIndex;
use slot_pool::SlotPool;

pub use types::{
    LookupResult, ManagerError, ManagerStats, OffloadEvent, PrepareStoreOutput, StoreOutcome,
};

/// Reference count of a chunk being stored.
const PENDING: i32 = -1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Occupied,
    Quarantined,
}

/// Per-slot record: 16 bytes.
#[derive(Debug, Clone, Copy)]
struct Slot {
    key: ChunkKey,
    /// -1 pending, 0 ready, k > 0 pinned by k loads. Meaningful when occupied.
    ref_cnt: i32,
    state: SlotState,
    /// Transient mark: offered in the `prepare_store` being processed.
    protected: bool,
}

const EMPTY_SLOT: Slot = Slot {
    key: ChunkKey(0),
    ref_cnt: 0,
    state: SlotState::Free,
    protected: false,
};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counters {
    ready: u32,
    pending: u32,
    pinned: u32,
    quarantined: u32,
}

/// ARC's state, as [`OffloadManager::arc_state`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ArcState {
    /// Adaptive target size of T1.
    pub target_t1: f64,
    /// Resident keys seen once, least recent first.
    pub t1: Vec<ChunkKey>,
    /// Resident keys reused, least recent first.
    pub t2: Vec<ChunkKey>,
    /// Ghost keys evicted from T1, least recent first.
    pub b1: Vec<ChunkKey>,
    /// Ghost keys evicted from T2, least recent first.
    pub b2: Vec<ChunkKey>,
}

/// One distinct key of a store offer that the request records.
#[derive(Debug, Clone, Copy)]
struct Offered {
    key: ChunkKey,
    pos: u64,
    /// Found ready in the tier (a reuse); otherwise a candidate to store.
    ready: bool,
}

/// The key each indexed slot's record holds, for the index's key checks.
#[inline]
fn key_of(slots: &[Slot]) -> impl Fn(u32) -> ChunkKey + '_ {
    move |s| slots[s as usize].key
}

/// Power-of-two buckets of `prepare_store` allocation sizes (chunks per call).
pub const ALLOC_SIZE_BUCKETS: usize = 16;

/// The host-tier offload manager for one KV group.
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
            scratch_ids: Vec::new(),
            scratch_evicted: Vec::new(),
            evicted_slots: None,
        })
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

    /// The slot `key` is indexed at (pending or ready).
    #[inline]
    fn indexed(&self, key: ChunkKey) -> Option<u32> {
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

    /// Pins ready chunks for a load; returns their slots co-indexed with `keys`.
    ///
    /// A key may appear more than once (it is then pinned once per occurrence).
    /// With `req`, the load counts as the request's reuse of the chunks.
    pub fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        req: Option<RequestId>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        let out = self.pin_for_load(keys)?;
        if let Some(req) = req {
            let mut acc = self.requests.remove(&req).unwrap_or_default();
            self.record_load(keys, None, &mut acc);
            self.requests.insert(req, acc);
        }
        Ok(out)
    }

    /// [`Self::prepare_load`] for a request whose record its caller keeps (the
    /// scheduler keeps it in the request's state: no map probe); `first_position`
    /// is the position of `keys[0]`, the others following one apart.
    pub(crate) fn prepare_load_recorded(
        &mut self,
        keys: &[ChunkKey],
        first_position: u64,
        access: &mut RequestAccess,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        let out = self.pin_for_load(keys)?;
        self.record_load(keys, Some(first_position), access);
        Ok(out)
    }

    /// Records a load's keys as the request's observations and reuses.
    fn record_load(&mut self, keys: &[ChunkKey], first: Option<u64>, acc: &mut RequestAccess) {
        acc.refresh(self.generation);
        let mut observed = std::mem::take(&mut self.scratch_observed);
        observed.clear();
        for (i, &k) in keys.iter().enumerate() {
            let pos = first.map(|p| p + i as u64);
            let (i, new) = acc.observe(k, pos);
            if new && let Some(p) = pos {
                observed.push((k, p));
            }
            acc.mark_reused_at(i);
        }
        self.observe_ranked(&observed, acc);
        self.scratch_observed = observed;
    }

    /// The LRU side of a request's first observations (vLLM's
    /// `on_request_access`): the request takes its rank if it has none, and
    /// each resident key joins the request's group unless it ranks higher.
    fn observe_ranked(&mut self, observed: &[(ChunkKey, u64)], acc: &mut RequestAccess) {
        if observed.is_empty() || self.policy_kind != EvictionPolicyKind::Lru {
            return;
        }
        let rank = match acc.rank {
            Some(r) => r,
            None => {
                let Some(r) = self.policy.new_request_rank() else {
                    return;
                };
                acc.rank = Some(r);
                r
            }
        };
        for &(k, p) in observed {
            if let Some(s) = self.indexed(k) {
                self.policy.observe_at(s, &rank, p);
            }
        }
    }

    /// Validates and pins `keys` for a load (nothing changes on error).
    fn pin_for_load(&mut self, keys: &[ChunkKey]) -> Result<Vec<ChunkId>, ManagerError> {
        let mut out = Vec::with_capacity(keys.len());
        for &k in keys {
            let s = self.indexed(k).ok_or(ManagerError::UnknownKey(k))?;
            if self.slots[s as usize].ref_cnt == PENDING {
                return Err(ManagerError::NotReady(k));
            }
            out.push(ChunkId(s));
        }
        for &ChunkId(s) in &out {
            let slot = &mut self.slots[s as usize];
            if slot.ref_cnt == 0 {
                self.counters.pinned += 1;
            }
            slot.ref_cnt += 1;
        }
        Ok(out)
    }

    /// Unpins chunks after their load finished (once per `prepare_load` occurrence).
    pub fn complete_load(
        &mut self,
        keys: &[ChunkKey],
        _req: Option<RequestId>,
    ) -> Result<(), ManagerError> {
        // Validate with multiplicity: a key listed twice must be pinned twice.
        let mut need: HashMap<u32, i32, KeyBuildHasher> = HashMap::default();
        for &k in keys {
            let s = self.indexed(k).ok_or(ManagerError::UnknownKey(k))?;
            let n = need.entry(s).or_insert(0);
            *n += 1;
            if self.slots[s as usize].ref_cnt < *n {
                return Err(ManagerError::NotPinned(k));
            }
        }
        for (s, n) in need {
            let slot = &mut self.slots[s as usize];
            slot.ref_cnt -= n;
            if slot.ref_cnt == 0 {
                self.counters.pinned -= 1;
            }
        }
        Ok(())
    }

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
        // The request's record leaves the map for the call (the store path
        // takes a record, wherever its owner keeps it).
        let mut access = req.map(|r| self.requests.remove(&r).unwrap_or_default());
        let ok = self.prepare_store_inner(keys, None, access.as_mut());
        if let (Some(r), Some(a)) = (req, access) {
            self.requests.insert(r, a);
        }
        if !ok {
            return None;
        }
        Some(PrepareStoreOutput {
            keys_to_store: self.scratch_store.clone(),
            chunk_ids: self.scratch_ids.clone(),
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
        access: Option<&mut RequestAccess>,
    ) -> Option<(&[ChunkKey], &[ChunkId])> {
        debug_assert_eq!(keys.len(), positions.len());
        if !self.prepare_store_inner(keys, Some(positions), access) {
            return None;
        }
        Some((&self.scratch_store, &self.scratch_ids))
    }

    fn prepare_store_inner(
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
        let mut distinct = (keys.len() > 64).then(|| {
            std::collections::HashSet::with_capacity_and_hasher(
                keys.len(),
                KeyBuildHasher::default(),
            )
        });
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
                let admitted: std::collections::HashSet<ChunkKey, KeyBuildHasher> =
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

    /// Allocates slots for `to_store` (evicting if needed). On success the keys
    /// and their slots are left in `scratch_store` / `scratch_ids`, and the
    /// evicted keys in `scratch_evicted` (also logged as an event).
    /// `per_key_misses`: `scratch_fresh` says which keys this store showed
    /// the policy as misses (otherwise all of them were).
    fn allocate(
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

    fn record_alloc_size(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let bucket = (usize::BITS - n.leading_zeros() - 1) as usize;
        self.alloc_sizes[bucket.min(ALLOC_SIZE_BUCKETS - 1)] += 1;
    }

    /// Ends a store job. Pending keys become ready ([`StoreOutcome::Success`]),
    /// are removed with their slots freed ([`StoreOutcome::Failure`]), or are
    /// removed with their slots held back ([`StoreOutcome::Quarantined`], whose
    /// slots are returned). Keys already ready and keys not in the tier (never
    /// prepared, evicted, failed, or dropped by a reset) are ignored, as vLLM
    /// ignores them, and counted in [`ManagerStats::ignored_complete_keys`].
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
        let mut done = Vec::with_capacity(resolved.len());
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
        Ok(held)
    }

    /// Returns quarantined slots to the free list (their late transfer is over).
    pub fn release_quarantined(&mut self, chunks: &[ChunkId]) -> Result<(), ManagerError> {
        let mut seen = std::collections::HashSet::with_capacity(chunks.len());
        for &c in chunks {
            let ok = (c.0 as usize) < self.slots.len()
                && self.slots[c.0 as usize].state == SlotState::Quarantined
                && seen.insert(c.0);
            if !ok {
                return Err(ManagerError::NotQuarantined(c));
            }
        }
        for &ChunkId(s) in chunks {
            self.slots[s as usize] = EMPTY_SLOT;
            self.counters.quarantined -= 1;
            self.pool.release(s);
        }
        Ok(())
    }

    /// Turns pinned chunks into quarantined slots: the keys leave the tier at
    /// once (a removal event), the slots stay out of the free list until
    /// [`Self::release_quarantined`], whatever `reset` does meanwhile. For a
    /// stalled load whose late transfer may still read them. Every key must be
    /// pinned; a key listed twice is quarantined once. Returns the slots.
    pub fn quarantine_pinned(&mut self, keys: &[ChunkKey]) -> Result<Vec<ChunkId>, ManagerError> {
        for &k in keys {
            let s = self.indexed(k).ok_or(ManagerError::UnknownKey(k))?;
            if self.slots[s as usize].ref_cnt < 1 {
                return Err(ManagerError::NotPinned(k));
            }
        }
        let mut held = Vec::with_capacity(keys.len());
        let mut removed = Vec::with_capacity(keys.len());
        for &k in keys {
            let Some(s) = self.index.remove(k, key_of(&self.slots)) else {
                continue; // listed twice
            };
            self.policy.on_remove(s);
            self.slots[s as usize] = Slot {
                state: SlotState::Quarantined,
                ..EMPTY_SLOT
            };
            self.counters.ready -= 1;
            self.counters.pinned -= 1;
            self.counters.quarantined += 1;
            held.push(ChunkId(s));
            removed.push(k);
        }
        self.events.evicted(&removed);
        Ok(held)
    }

    /// Marks keys as recently used; the first key ends most recent. Absent keys
    /// are ignored (ARC adapts its target when they are in a ghost list).
    pub fn touch(&mut self, keys: &[ChunkKey], _req: Option<RequestId>) {
        for &k in keys.iter().rev() {
            let slot = self.indexed(k);
            let ready = slot.is_some_and(|s| self.slots[s as usize].ref_cnt >= 0);
            self.policy.on_touch(k, slot, ready);
        }
    }

    /// The request will make no more `prepare_*` calls: its observed chunks
    /// are re-ranked tail first so the prefix head ends most recent (LRU), or
    /// the chunks it reused are promoted once and its own insertions keep
    /// their list (ARC). `complete_*` calls for its jobs may still follow.
    /// Unknown or already finished requests are a no-op.
    pub fn request_finished(&mut self, req: RequestId) {
        if let Some(mut acc) = self.requests.remove(&req) {
            self.apply_finished(&mut acc);
        }
    }

    /// [`Self::request_finished`] for a request whose record its caller kept
    /// (see [`Self::prepare_store_for_job`]); a record kept in the map under
    /// `req` (through the public calls) is finished first.
    pub(crate) fn request_finished_with(&mut self, req: RequestId, kept: &mut RequestAccess) {
        self.request_finished(req);
        self.apply_finished(kept);
    }

    fn apply_finished(&mut self, acc: &mut RequestAccess) {
        if acc.finished {
            return;
        }
        acc.finished = true;
        if !acc.is_of(self.generation) {
            // Recorded before a reset: the reset forgot it (and its rank).
            return;
        }
        let accesses: Vec<FinishedAccess> = acc
            .head_to_tail()
            .into_iter()
            .rev()
            .filter_map(|s| {
                self.indexed(s.key).map(|slot| FinishedAccess {
                    slot,
                    insertion_only: s.inserted() && !s.reused(),
                    reused: s.reused(),
                })
            })
            .collect();
        self.policy.on_request_finished(&accesses);
        if let Some(r) = acc.rank.as_mut() {
            self.policy.release_rank(r);
        }
    }

    /// Drains pending events (evictions before the stores that reuse their space).
    /// Call it every step: at most 65,536 undrained events are kept, the oldest
    /// beyond that are dropped (counted in [`ManagerStats::dropped_events`]).
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        let Self {
            events,
            index,
            slots,
            ..
        } = self;
        events.drain(|k| index.get(k, key_of(slots)).is_some())
    }

    /// How many keys each store tried to allocate since the last call, in
    /// order (vLLM `kv_offload_cpu_allocation_size`).
    pub fn take_allocation_sizes(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.allocation_sizes)
    }

    /// Drops the pending events without building them (a backend that
    /// publishes no events drains this way, allocation-free).
    pub fn discard_events(&mut self) {
        self.events.clear();
    }

    /// Events waiting to be drained.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// Keeps every evicted chunk's key and former slot (off by default), so
    /// that its bytes can be written elsewhere before the slot is reused.
    pub fn track_evicted_slots(&mut self, on: bool) {
        self.evicted_slots = on.then(Vec::new);
    }

    /// Moves the evicted chunks kept since the last call into `out`.
    pub fn take_evicted_slots(&mut self, out: &mut Vec<(ChunkKey, ChunkId)>) {
        if let Some(t) = self.evicted_slots.as_mut() {
            out.append(t);
        }
    }

    /// Whether the tier has background work of its own (never, for host memory).
    pub fn has_pending_work(&self) -> bool {
        false
    }

    /// Evicts everything without per-chunk events. Quarantined slots stay held
    /// (a late transfer may still write them); undrained events stay.
    pub fn reset(&mut self) {
        self.index.clear();
        for slot in self.slots.iter_mut() {
            if slot.state != SlotState::Quarantined {
                *slot = EMPTY_SLOT;
            }
        }
        let slots = &self.slots;
        self.pool
            .reset(|s| slots[s as usize].state == SlotState::Quarantined);
        self.policy.clear();
        // vLLM keeps the reuse filter's offer counts across a reset.
        self.requests.clear();
        self.counters = Counters {
            quarantined: self.counters.quarantined,
            ..Counters::default()
        };
        self.generation += 1;
    }

    /// Every transfer from before the last reset has ended (no-op for host memory).
    pub fn on_reset_flushed(&mut self) {
        tracing::debug!(generation = self.generation, "host tier: reset flushed");
    }

    /// Occupancy and usage.
    pub fn stats(&self) -> ManagerStats {
        let c = self.counters;
        let n = f64::from(self.capacity);
        let usage = f64::from(c.pinned + c.pending) / n;
        let write_usage = f64::from(c.pending) / n;
        ManagerStats {
            num_chunks: self.capacity,
            cached: c.ready,
            pending: c.pending,
            pinned: c.pinned,
            evictable: c.ready - c.pinned,
            quarantined: c.quarantined,
            free: self.capacity - c.ready - c.pending - c.quarantined,
            usage,
            write_usage,
            read_usage: usage - write_usage,
            stores_skipped: self.stores_skipped,
            allocation_failures: self.allocation_failures,
            ignored_complete_keys: self.ignored_complete_keys,
            dropped_events: self.events.dropped(),
        }
    }

    /// Histogram of `prepare_store` sizes: bucket i counts calls of `[2^i, 2^(i+1))` chunks.
    pub fn allocation_size_histogram(&self) -> [u64; ALLOC_SIZE_BUCKETS] {
        self.alloc_sizes
    }

    /// ARC's lists (keys, least recent first) and target; `None` under LRU.
    pub fn arc_state(&self) -> Option<ArcState> {
        let v = self.policy.arc_view()?;
        let keys = |slots: Vec<u32>| {
            slots
                .into_iter()
                .map(|s| self.slots[s as usize].key)
                .collect()
        };
        Some(ArcState {
            target_t1: v.target_t1,
            t1: keys(v.t1),
            t2: keys(v.t2),
            b1: v.b1,
            b2: v.b2,
        })
    }

    /// Resident keys in LRU order (least recent first); `None` under ARC.
    /// For tests and debugging: O(resident chunks).
    pub fn lru_order(&self) -> Option<Vec<ChunkKey>> {
        self.policy.lru_view().map(|slots| {
            slots
                .into_iter()
                .map(|s| self.slots[s as usize].key)
                .collect()
        })
    }

    /// The quarantined slots, in id order.
    pub fn quarantined_chunks(&self) -> Vec<ChunkId> {
        (0..self.capacity)
            .filter(|&s| self.slots[s as usize].state == SlotState::Quarantined)
            .map(ChunkId)
            .collect()
    }

    /// Bytes of heap memory of the per-chunk structures (index, slot records,
    /// free list, policy), as they report it: a quick figure for benchmarks.
    /// It leaves out the event buffer, the per-request records and the reuse
    /// filter; `tests/manager_heap.rs` measures the whole heap with a counting
    /// allocator.
    pub fn metadata_bytes(&self) -> usize {
        self.index.heap_bytes()
            + self.slots.heap_bytes()
            + self.pool.heap_bytes()
            + self.policy.heap_bytes()
            + std::mem::size_of::<Self>()
    }

    /// Recounts every state from the slots and checks the counters and the
    /// slot/key bijection. Returns a description of the first inconsistency.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut c = Counters::default();
        let mut occupied = 0usize;
        for (s, slot) in self.slots.iter().enumerate() {
            match slot.state {
                SlotState::Free => {}
                SlotState::Quarantined => c.quarantined += 1,
                SlotState::Occupied => {
                    occupied += 1;
                    if self.indexed(slot.key) != Some(s as u32) {
                        return Err(format!(
                            "slot {s} holds key {} but the index disagrees",
                            slot.key
                        ));
                    }
                    match slot.ref_cnt {
                        PENDING => c.pending += 1,
                        0 => c.ready += 1,
                        r if r > 0 => {
                            c.ready += 1;
                            c.pinned += 1;
                        }
                        r => return Err(format!("slot {s} has ref count {r}")),
                    }
                }
            }
            if slot.protected {
                return Err(format!("slot {s} left protected"));
            }
        }
        if occupied != self.index.len() {
            return Err(format!(
                "{} keys indexed but {occupied} slots occupied",
                self.index.len()
            ));
        }
        if c != self.counters {
            return Err(format!("counters {:?} but recount {c:?}", self.counters));
        }
        let free = self.capacity as usize - occupied - c.quarantined as usize;
        if self.pool.available() != free {
            return Err(format!(
                "pool offers {} slots but {free} are free",
                self.pool.available()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
