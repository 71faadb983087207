//! Eviction policies: the trait ([`traits`]), LRU ([`lru`]) and ARC
//! ([`arc`]), and the configured one, dispatched statically ([`Policy`]).
//!
//! Policies order the resident chunks by host slot id; the manager owns the
//! chunk states and tells the policy which slots may be evicted. The trait is
//! a leaf that both policies implement; this module only chooses between them.

mod arc;
mod index_list;
mod lru;
mod traits;

use crate::config::EvictionPolicyKind;
use crate::key::ChunkKey;

use super::request_access::RequestRank;
use arc::ArcPolicy;
use lru::LruPolicy;

pub(crate) use traits::{ArcView, EvictionPolicy, FinishedAccess};

/// The configured policy, dispatched statically so that the store path can
/// inline it (a `match` instead of a virtual call per chunk).
#[derive(Debug)]
pub(crate) enum Policy {
    /// Least recently used.
    Lru(LruPolicy),
    /// Adaptive replacement (boxed: its lists make it several times LRU's size).
    Arc(Box<ArcPolicy>),
}

/// Builds the configured policy for `capacity` slots.
pub(crate) fn new_policy(kind: EvictionPolicyKind, capacity: u32) -> Policy {
    match kind {
        EvictionPolicyKind::Lru => Policy::Lru(LruPolicy::new(capacity)),
        EvictionPolicyKind::Arc => Policy::Arc(Box::new(ArcPolicy::new(capacity))),
    }
}

impl Policy {
    /// LRU only: takes a request rank for a request that observes keys with
    /// positions (`None` under ARC, which has no request ranks).
    pub(crate) fn new_request_rank(&mut self) -> Option<RequestRank> {
        match self {
            Policy::Lru(p) => Some(p.new_request_rank()),
            Policy::Arc(_) => None,
        }
    }

    /// Inserts a new (pending) chunk; LRU ranks it at the request rank `r` and
    /// `position` when given (otherwise as a plain insert).
    /// `shown_as_miss`: the key was among this store's `on_store_miss` keys
    /// (ARC then knows from that call whether it is a ghost).
    #[inline]
    pub(crate) fn insert_at(
        &mut self,
        slot: u32,
        key: ChunkKey,
        ranked: Option<(&RequestRank, u64)>,
        shown_as_miss: bool,
    ) {
        match self {
            Policy::Lru(p) => p.insert_pending(slot, ranked),
            Policy::Arc(p) => p.insert(slot, key, shown_as_miss),
        }
    }

    /// LRU only: a request holding `r` first observed the resident `slot` at `position`.
    #[inline]
    pub(crate) fn observe_at(&mut self, slot: u32, r: &RequestRank, position: u64) {
        if let Policy::Lru(p) = self {
            p.observe_ranked(slot, r, position);
        }
    }

    /// LRU only: the request holding `r` finished; frees its anchor.
    pub(crate) fn release_rank(&mut self, r: &mut RequestRank) {
        if let Policy::Lru(p) = self {
            p.release_anchor(r);
        }
    }
}

/// Forwards a call to the policy in use.
macro_rules! dispatch {
    ($self:ident, $p:ident => $call:expr) => {
        match $self {
            Policy::Lru($p) => $call,
            Policy::Arc($p) => $call,
        }
    };
}

impl EvictionPolicy for Policy {
    #[inline]
    fn on_ready(&mut self, slot: u32) {
        dispatch!(self, p => p.on_ready(slot))
    }
    fn on_remove(&mut self, slot: u32) {
        dispatch!(self, p => p.on_remove(slot))
    }
    #[inline]
    fn on_store_miss(&mut self, keys: &[ChunkKey]) {
        dispatch!(self, p => p.on_store_miss(keys))
    }
    fn on_touch(&mut self, key: ChunkKey, slot: Option<u32>, ready: bool) {
        dispatch!(self, p => p.on_touch(key, slot, ready))
    }
    fn on_request_finished(&mut self, accesses: &[FinishedAccess]) {
        dispatch!(self, p => p.on_request_finished(accesses))
    }
    #[inline]
    fn evict(
        &mut self,
        n: usize,
        can_evict: &mut dyn FnMut(u32) -> bool,
        victims: &mut Vec<u32>,
    ) -> bool {
        dispatch!(self, p => p.evict(n, can_evict, victims))
    }
    fn clear(&mut self) {
        dispatch!(self, p => p.clear())
    }
    fn heap_bytes(&self) -> usize {
        dispatch!(self, p => p.heap_bytes())
    }
    fn lru_view(&self) -> Option<Vec<u32>> {
        dispatch!(self, p => p.lru_view())
    }
    fn arc_view(&self) -> Option<ArcView> {
        dispatch!(self, p => p.arc_view())
    }
}
