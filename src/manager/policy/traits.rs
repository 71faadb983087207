//! The eviction policy trait LRU and ARC implement, and what it exchanges
//! with the manager (a leaf: the policies depend on it, not on each other).

use crate::key::ChunkKey;

/// One resident chunk a finished request observed, for [`EvictionPolicy::on_request_finished`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FinishedAccess {
    /// The chunk's host slot.
    pub slot: u32,
    /// The request inserted it and never reused it (vLLM's insertion-only keys).
    pub insertion_only: bool,
    /// The request read it while it was ready (loaded it, or found it stored),
    /// and it was not the request's own insertion at the time.
    pub reused: bool,
}

/// Recency/frequency ordering of the resident chunks.
pub(crate) trait EvictionPolicy: Send + std::fmt::Debug {
    /// The store of the chunk in `slot` completed (it may now be evicted).
    fn on_ready(&mut self, _slot: u32) {}
    /// The chunk in `slot` left the tier without being evicted (failed store).
    fn on_remove(&mut self, slot: u32);
    /// Keys about to be inserted by a store (ARC adapts its target on ghost hits).
    fn on_store_miss(&mut self, keys: &[ChunkKey]);
    /// An access to one key: `slot` is its slot if resident.
    fn on_touch(&mut self, key: ChunkKey, slot: Option<u32>, ready: bool);
    /// A request finished; `accesses` are its resident chunks in reverse prefix
    /// order (tail first, head last).
    fn on_request_finished(&mut self, accesses: &[FinishedAccess]);
    /// Chooses `n` victims among the slots for which `can_evict` is true, atomically:
    /// either all `n` are removed from the policy and written to `victims` (cleared
    /// first) and it returns true, or nothing changes and it returns false.
    fn evict(
        &mut self,
        n: usize,
        can_evict: &mut dyn FnMut(u32) -> bool,
        victims: &mut Vec<u32>,
    ) -> bool;
    /// Forgets everything (cache reset).
    fn clear(&mut self);
    /// Heap bytes of the policy's bookkeeping.
    fn heap_bytes(&self) -> usize;
    /// LRU's order by slot, least recent first; `None` for other policies.
    fn lru_view(&self) -> Option<Vec<u32>> {
        None
    }
    /// ARC's lists and target, for inspection; `None` for other policies.
    fn arc_view(&self) -> Option<ArcView> {
        None
    }
}

/// ARC's state by slot, as [`EvictionPolicy::arc_view`] reports it.
#[derive(Debug, Clone)]
pub(crate) struct ArcView {
    pub target_t1: f64,
    pub t1: Vec<u32>,
    pub t2: Vec<u32>,
    pub b1: Vec<ChunkKey>,
    pub b2: Vec<ChunkKey>,
}
