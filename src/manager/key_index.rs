//! A key -> position index holding the keys themselves (ARC's ghost lists,
//! whose keys have no slot record): a [`ProbeTable`] (linear probing,
//! backward-shift deletion, load factor at most 1/2, huge-page memory) whose
//! tags are the keys. The tier's own index is
//! [`super::slot_index::SlotIndex`], which keeps only fingerprints.
//!
//! The index never holds more keys than its capacity, so the table never
//! grows, and a lookup touches one cache line in the common case. An entry is
//! 16 bytes: the key, the slot and padding.

use crate::key::ChunkKey;

use super::probing::{ProbeTable, Tag, fibonacci_hash};

/// A whole key as a tag: a tag match is a key match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WholeKey(ChunkKey);

impl Tag for WholeKey {
    const VACANT: Self = Self(ChunkKey(0));
    const INDEX: &'static str = "key index";

    #[inline]
    fn home(self, shift: u32) -> usize {
        (fibonacci_hash(self.0) >> shift) as usize
    }
}

/// A tag match needs no confirmation.
#[inline]
fn any_slot(_: u32) -> bool {
    true
}

/// Maps chunk keys to host slot ids; holds at most the capacity given at creation.
#[derive(Debug)]
pub(crate) struct KeyIndex {
    table: ProbeTable<WholeKey>,
}

impl KeyIndex {
    /// An index for up to `max_len` keys.
    pub(crate) fn with_capacity(max_len: usize) -> Self {
        Self {
            table: ProbeTable::with_capacity(max_len, usize::MAX),
        }
    }

    /// Hints the CPU to fetch the cache line where `key` would be found, so a
    /// batch of lookups overlaps its memory latency.
    #[inline]
    pub(crate) fn prefetch(&self, key: ChunkKey) {
        self.table.prefetch(WholeKey(key));
    }

    /// Number of keys.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The slot of `key`.
    #[inline]
    pub(crate) fn get(&self, key: ChunkKey) -> Option<u32> {
        self.table.get(WholeKey(key), any_slot)
    }

    /// Whether `key` is present.
    #[cfg(test)]
    pub(crate) fn contains(&self, key: ChunkKey) -> bool {
        self.get(key).is_some()
    }

    /// Sets the slot of `key`, inserting it if absent.
    pub(crate) fn insert(&mut self, key: ChunkKey, slot: u32) {
        self.table.insert(WholeKey(key), slot, any_slot);
    }

    /// Removes `key`, returning its slot.
    pub(crate) fn remove(&mut self, key: ChunkKey) -> Option<u32> {
        self.table.remove(WholeKey(key), any_slot)
    }

    /// Removes every key.
    pub(crate) fn clear(&mut self) {
        self.table.clear();
    }

    /// Bytes of memory held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn behaves_like_a_hash_map_under_random_churn() {
        let cap = 1000;
        let mut idx = KeyIndex::with_capacity(cap);
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut x: u64 = 12345;
        // Miri interprets every probe: a shorter churn still wraps, collides and shifts.
        let steps = if cfg!(miri) { 4_000 } else { 200_000u32 };
        for step in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // a small key space so that probes collide and deletions shift
            let key = x % 3000;
            if x & 1 == 0 && model.len() < cap {
                idx.insert(ChunkKey(key), step);
                model.insert(key, step);
            } else {
                assert_eq!(idx.remove(ChunkKey(key)), model.remove(&key));
            }
            assert_eq!(idx.len(), model.len());
            if step % if cfg!(miri) { 499 } else { 997 } == 0 {
                for k in 0..3000 {
                    assert_eq!(idx.get(ChunkKey(k)), model.get(&k).copied(), "key {k}");
                }
            }
        }
        idx.clear();
        assert_eq!(idx.len(), 0);
        assert!(!idx.contains(ChunkKey(1)));
    }
}
