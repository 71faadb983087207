//! Least-recently-used eviction.
//!
//! One ordered list of resident slots: insert appends at the most recent end;
//! a touch moves keys there in reverse so the first key ends most recent; a
//! finished request moves its keys there tail first, so the head of a prefix
//! outlives its tail. Eviction takes the oldest evictable slots.

use crate::key::ChunkKey;

use super::index_list::IndexList;
use super::policy::{EvictionPolicy, FinishedAccess};

/// LRU over host slots.
#[derive(Debug)]
pub(crate) struct LruPolicy {
    order: IndexList,
}

impl LruPolicy {
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            order: IndexList::new(capacity),
        }
    }
}

impl EvictionPolicy for LruPolicy {
    #[inline]
    fn on_insert(&mut self, slot: u32, _key: ChunkKey) {
        self.order.move_to_back(slot);
    }

    fn on_remove(&mut self, slot: u32) {
        self.order.remove(slot);
    }

    #[inline]
    fn on_store_miss(&mut self, _keys: &[ChunkKey]) {}

    fn on_touch(&mut self, _key: ChunkKey, slot: Option<u32>, _ready: bool) {
        if let Some(slot) = slot {
            self.order.move_to_back(slot);
        }
    }

    fn on_request_finished(&mut self, accesses: &[FinishedAccess]) {
        for a in accesses {
            self.order.move_to_back(a.slot);
        }
    }

    fn evict(
        &mut self,
        n: usize,
        can_evict: &mut dyn FnMut(u32) -> bool,
        victims: &mut Vec<u32>,
    ) -> bool {
        victims.clear();
        if n == 0 {
            return true;
        }
        // From the least recent end; usually the first slots are evictable.
        let mut cur = self.order.front();
        while let Some(s) = cur {
            if can_evict(s) {
                victims.push(s);
                if victims.len() == n {
                    break;
                }
            }
            cur = self.order.next_of(s);
        }
        if victims.len() < n {
            victims.clear();
            return false;
        }
        for &v in victims.iter() {
            self.order.remove(v);
        }
        true
    }

    fn clear(&mut self) {
        self.order.clear();
    }

    fn lru_view(&self) -> Option<Vec<u32>> {
        Some(self.order.iter().collect())
    }

    fn heap_bytes(&self) -> usize {
        self.order.heap_bytes()
    }
}
