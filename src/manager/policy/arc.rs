//! Adaptive replacement cache (ARC) eviction, as vLLM's CPU manager specifies it.
//!
//! T1 holds chunks seen once, T2 chunks reused; B1 and B2 are ghost lists of
//! keys recently evicted from T1 and T2, each capped at the capacity. A ghost
//! hit adapts `target_t1`: a B1 hit grows it by `max(1, |B2|/|B1|)` (capped at
//! the capacity), a B2 hit shrinks it by `max(1, |B1|/|B2|)` (floored at 0).
//! Eviction takes from T1's LRU end while `|T1| >= int(target_t1)`, otherwise
//! from T2, falling back to the other list; only evictable slots qualify.

use crate::key::ChunkKey;

use super::index_list::IndexList;
use super::traits::{ArcView, EvictionPolicy, FinishedAccess};
use crate::manager::huge_buffer::HugeBuffer;
use crate::manager::key_index::KeyIndex;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resident {
    None,
    T1,
    T2,
}

/// A bounded LRU list of keys no longer resident.
#[derive(Debug)]
struct GhostList {
    capacity: u32,
    index: KeyIndex,
    keys: Vec<ChunkKey>,
    order: IndexList,
    free: Vec<u32>,
}

impl GhostList {
    fn new(capacity: u32) -> Self {
        Self {
            capacity,
            index: KeyIndex::with_capacity(capacity as usize),
            keys: Vec::new(),
            order: IndexList::new(capacity),
            free: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.order.len()
    }

    fn contains(&self, key: ChunkKey) -> bool {
        self.index.get(key).is_some()
    }

    fn remove(&mut self, key: ChunkKey) -> bool {
        match self.index.remove(key) {
            Some(i) => {
                self.order.remove(i);
                self.free.push(i);
                true
            }
            None => false,
        }
    }

    /// Adds `key` (not a ghost yet: it was resident) as the most recent ghost,
    /// dropping the oldest beyond capacity.
    fn push(&mut self, key: ChunkKey) {
        if self.capacity == 0 {
            return;
        }
        debug_assert!(!self.contains(key), "a resident key is never a ghost");
        if self.order.len() >= self.capacity as usize
            && let Some(oldest) = self.order.front()
        {
            let k = self.keys[oldest as usize];
            self.remove(k);
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.keys.push(key);
                (self.keys.len() - 1) as u32
            }
        };
        self.keys[i as usize] = key;
        self.index.insert(key, i);
        self.order.push_back(i);
    }

    /// Makes the ghost `key` the most recent ghost (a ghost hit).
    fn touch(&mut self, key: ChunkKey) {
        if let Some(i) = self.index.get(key) {
            self.order.move_to_back(i);
        }
    }

    fn keys_oldest_first(&self) -> Vec<ChunkKey> {
        self.order.iter().map(|i| self.keys[i as usize]).collect()
    }

    fn clear(&mut self) {
        self.index.clear();
        self.keys.clear();
        self.order.clear();
        self.free.clear();
    }

    fn heap_bytes(&self) -> usize {
        self.index.heap_bytes()
            + self.keys.capacity() * std::mem::size_of::<ChunkKey>()
            + self.order.heap_bytes()
            + self.free.capacity() * 4
    }
}

/// Advances `cur` through `list` to the next slot that may be evicted.
fn next_candidate(
    list: &IndexList,
    cur: &mut Option<u32>,
    can_evict: &mut dyn FnMut(u32) -> bool,
) -> Option<u32> {
    while let Some(s) = *cur {
        *cur = list.next_of(s);
        if can_evict(s) {
            return Some(s);
        }
    }
    None
}

/// ARC over host slots.
#[derive(Debug)]
pub(crate) struct ArcPolicy {
    capacity: u32,
    target_t1: f64,
    t1: IndexList,
    t2: IndexList,
    b1: GhostList,
    b2: GhostList,
    resident: HugeBuffer<Resident>,
    keys: HugeBuffer<ChunkKey>,
    /// Keys of the current store found in B1 or B2 (set by `on_store_miss`).
    ghost_hits: Vec<ChunkKey>,
    /// Scratch of `evict`: whether each victim came from T1.
    from_t1: Vec<bool>,
}

impl ArcPolicy {
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            capacity,
            target_t1: 0.0,
            t1: IndexList::new(capacity),
            t2: IndexList::new(capacity),
            b1: GhostList::new(capacity),
            b2: GhostList::new(capacity),
            resident: HugeBuffer::new(capacity as usize, Resident::None),
            keys: HugeBuffer::new(capacity as usize, ChunkKey(0)),
            ghost_hits: Vec::new(),
            from_t1: Vec::new(),
        }
    }

    /// Adapts the target if `key` is a ghost, and makes it the most recent
    /// ghost of its list; returns whether it was a ghost.
    fn adapt_on_ghost(&mut self, key: ChunkKey) -> bool {
        let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
        if self.b1.contains(key) {
            let delta = if b1 > 0.0 { (b2 / b1).max(1.0) } else { 1.0 };
            self.target_t1 = (self.target_t1 + delta).min(f64::from(self.capacity));
            self.b1.touch(key);
        } else if self.b2.contains(key) {
            let delta = if b2 > 0.0 { (b1 / b2).max(1.0) } else { 1.0 };
            self.target_t1 = (self.target_t1 - delta).max(0.0);
            self.b2.touch(key);
        } else {
            return false;
        }
        true
    }

    fn unlink(&mut self, slot: u32) {
        match self.resident[slot as usize] {
            Resident::T1 => {
                self.t1.remove(slot);
            }
            Resident::T2 => {
                self.t2.remove(slot);
            }
            Resident::None => {}
        }
        self.resident[slot as usize] = Resident::None;
    }

    fn promote(&mut self, slot: u32, ready: bool) {
        match self.resident[slot as usize] {
            Resident::T1 if ready => {
                self.t1.remove(slot);
                self.t2.push_back(slot);
                self.resident[slot as usize] = Resident::T2;
            }
            Resident::T1 => self.t1.move_to_back(slot),
            Resident::T2 => self.t2.move_to_back(slot),
            Resident::None => {}
        }
    }
}

impl ArcPolicy {
    /// A new chunk goes to T1 and is no longer a ghost. `shown_as_miss`: the
    /// preceding `on_store_miss` saw the key, so it is a ghost only if that
    /// call found it (one probe saved per insert); otherwise (the request
    /// adapted on it in an earlier store) both ghost lists are checked.
    pub(crate) fn insert(&mut self, slot: u32, key: ChunkKey, shown_as_miss: bool) {
        if shown_as_miss {
            if let Some(i) = self.ghost_hits.iter().position(|&k| k == key) {
                self.ghost_hits.swap_remove(i);
                if !self.b1.remove(key) {
                    self.b2.remove(key);
                }
            }
        } else if self.b1.len() + self.b2.len() > 0 && !self.b1.remove(key) {
            self.b2.remove(key);
        }
        self.insert_resident(slot, key);
    }

    fn insert_resident(&mut self, slot: u32, key: ChunkKey) {
        self.unlink(slot);
        self.t1.push_back(slot);
        self.resident[slot as usize] = Resident::T1;
        self.keys[slot as usize] = key;
    }
}

impl EvictionPolicy for ArcPolicy {
    fn on_remove(&mut self, slot: u32) {
        self.unlink(slot);
    }

    fn on_store_miss(&mut self, keys: &[ChunkKey]) {
        for &k in keys {
            self.b1.index.prefetch(k);
            self.b2.index.prefetch(k);
        }
        // vLLM adapts tail first (each hit also refreshes its ghost).
        self.ghost_hits.clear();
        for &k in keys.iter().rev() {
            if self.adapt_on_ghost(k) {
                self.ghost_hits.push(k);
            }
        }
    }

    fn on_touch(&mut self, key: ChunkKey, slot: Option<u32>, ready: bool) {
        match slot {
            Some(slot) => self.promote(slot, ready),
            None => {
                self.adapt_on_ghost(key);
            }
        }
    }

    fn on_request_finished(&mut self, accesses: &[FinishedAccess]) {
        for a in accesses {
            if a.insertion_only {
                // A store is no frequency hit: keep the list, restore recency.
                match self.resident[a.slot as usize] {
                    Resident::T1 => self.t1.move_to_back(a.slot),
                    Resident::T2 => self.t2.move_to_back(a.slot),
                    Resident::None => {}
                }
            } else if a.reused {
                // One access per request, whatever the chunk's state now.
                self.promote(a.slot, true);
            }
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
        // Choose every victim first (no mutation), so a failure changes nothing.
        // Each list is scanned once from its least recent end.
        let target = self.target_t1 as usize;
        let mut t1_left = self.t1.len();
        let mut t1_cur = self.t1.front();
        let mut t2_cur = self.t2.front();
        let mut from_t1 = std::mem::take(&mut self.from_t1);
        from_t1.clear();
        while victims.len() < n {
            let order = if t1_left >= target {
                [true, false]
            } else {
                [false, true]
            };
            let mut picked = None;
            for use_t1 in order {
                let (list, cur) = if use_t1 {
                    (&self.t1, &mut t1_cur)
                } else {
                    (&self.t2, &mut t2_cur)
                };
                if let Some(s) = next_candidate(list, cur, can_evict) {
                    picked = Some((s, use_t1));
                    break;
                }
            }
            let Some((slot, is_t1)) = picked else {
                victims.clear();
                self.from_t1 = from_t1;
                return false;
            };
            if is_t1 {
                t1_left -= 1;
            }
            victims.push(slot);
            from_t1.push(is_t1);
        }
        for (&slot, &is_t1) in victims.iter().zip(&from_t1) {
            let key = self.keys[slot as usize];
            self.unlink(slot);
            if is_t1 {
                self.b1.push(key);
            } else {
                self.b2.push(key);
            }
        }
        self.from_t1 = from_t1;
        true
    }

    fn clear(&mut self) {
        self.target_t1 = 0.0;
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.resident.fill(Resident::None);
    }

    fn arc_view(&self) -> Option<ArcView> {
        Some(ArcView {
            target_t1: self.target_t1,
            t1: self.t1.iter().collect(),
            t2: self.t2.iter().collect(),
            b1: self.b1.keys_oldest_first(),
            b2: self.b2.keys_oldest_first(),
        })
    }

    fn heap_bytes(&self) -> usize {
        self.t1.heap_bytes()
            + self.t2.heap_bytes()
            + self.b1.heap_bytes()
            + self.b2.heap_bytes()
            + self.resident.heap_bytes()
            + self.keys.heap_bytes()
    }
}
