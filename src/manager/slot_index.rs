//! The tier's key -> slot index: a [`ProbeTable`] (linear probing,
//! backward-shift deletion, load factor at most 1/2, huge-page memory) sized
//! once for the tier's capacity, whose tags are fingerprints.
//!
//! An entry is 8 bytes: the slot and a 32-bit fingerprint of the key (the top
//! half of its Fibonacci hash, whose top bits are also the home position).
//! The full key lives in the slot record, which the caller reads through
//! `key_of` to confirm a fingerprint match. So the index takes half the memory
//! of one holding the keys (16 instead of 32 bytes per chunk at load 1/2), and
//! a store's two random probes (the new key, the evicted one) more often hit
//! the CPU's caches. A miss reads no slot record unless fingerprints collide
//! (one chance in 2^32 per probed entry).

use crate::key::ChunkKey;

use super::probing::{ProbeTable, Tag, fibonacci_hash};

/// Top 32 bits of a key's Fibonacci hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint(u32);

impl Tag for Fingerprint {
    const VACANT: Self = Self(0);
    const INDEX: &'static str = "slot index";

    /// The fingerprint's top bits (a table has at most 2^32 entries, so
    /// `shift` >= 32).
    #[inline]
    fn home(self, shift: u32) -> usize {
        (u64::from(self.0) >> (shift - 32)) as usize
    }
}

#[inline]
fn fingerprint(key: ChunkKey) -> Fingerprint {
    Fingerprint((fibonacci_hash(key) >> 32) as u32)
}

/// Maps chunk keys to host slot ids (never `u32::MAX`); holds at most the
/// capacity given at creation. Every method that compares keys takes `key_of`,
/// the key the slot record of an indexed slot holds.
#[derive(Debug)]
pub(crate) struct SlotIndex {
    /// At most 2^32 entries: the home is the fingerprint's top bits.
    table: ProbeTable<Fingerprint>,
}

impl SlotIndex {
    /// An index for up to `max_len` keys.
    pub(crate) fn with_capacity(max_len: usize) -> Self {
        Self {
            table: ProbeTable::with_capacity(max_len, 1 << 32),
        }
    }

    /// Hints the CPU to fetch the cache line where `key` would be found, so a
    /// batch of lookups overlaps its memory latency.
    #[inline]
    pub(crate) fn prefetch(&self, key: ChunkKey) {
        self.table.prefetch(fingerprint(key));
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The slot of `key`.
    #[inline]
    pub(crate) fn get(&self, key: ChunkKey, key_of: impl Fn(u32) -> ChunkKey) -> Option<u32> {
        self.table.get(fingerprint(key), |s| key_of(s) == key)
    }

    /// Sets the slot of `key`, inserting it if absent.
    #[inline]
    pub(crate) fn insert(&mut self, key: ChunkKey, slot: u32, key_of: impl Fn(u32) -> ChunkKey) {
        self.table
            .insert(fingerprint(key), slot, |s| key_of(s) == key);
    }

    /// Removes `key`, returning its slot (call it while the slot record still
    /// holds the key).
    pub(crate) fn remove(
        &mut self,
        key: ChunkKey,
        key_of: impl Fn(u32) -> ChunkKey,
    ) -> Option<u32> {
        self.table.remove(fingerprint(key), |s| key_of(s) == key)
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

    /// Drives the index like the manager does: a slot record per slot holds its
    /// key, slots are reused, and the index is checked against a `HashMap`.
    fn churn(key_space: u64, colliding: bool) {
        let cap = 1000usize;
        let mut idx = SlotIndex::with_capacity(cap);
        let mut records: Vec<Option<ChunkKey>> = vec![None; cap];
        let mut free: Vec<u32> = (0..cap as u32).rev().collect();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut x: u64 = 12345;
        // With `colliding`, the keys are k * inv(phi) for small k: their hashes
        // are k itself, so they all share fingerprint 0 and home 0.
        const INV_PHI: u64 = 0xF1DE_83E1_9937_733D; // phi * INV_PHI == 1 mod 2^64
        let steps = if cfg!(miri) { 1_200 } else { 200_000u32 };
        for step in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x % key_space;
            let key = if colliding {
                // All keys have fingerprint 0 and home 0: worst-case probing,
                // and every comparison needs the slot record.
                ChunkKey(k.wrapping_mul(INV_PHI))
            } else {
                ChunkKey(k)
            };
            let key_of = |s: u32| records[s as usize].expect("indexed slot holds a key");
            if x & 1 == 0 && !model.contains_key(&key.0) {
                if let Some(s) = free.pop() {
                    records[s as usize] = Some(key);
                    idx.insert(key, s, |s| records[s as usize].expect("indexed"));
                    model.insert(key.0, s);
                }
            } else {
                let got = idx.remove(key, key_of);
                assert_eq!(got, model.remove(&key.0), "step {step}");
                if let Some(s) = got {
                    records[s as usize] = None;
                    free.push(s);
                }
            }
            assert_eq!(idx.len(), model.len());
            if step % if cfg!(miri) { 499 } else { 997 } == 0 {
                for (&k, &s) in &model {
                    let key_of = |s: u32| records[s as usize].expect("indexed");
                    assert_eq!(idx.get(ChunkKey(k), key_of), Some(s), "key {k}");
                }
            }
        }
        idx.clear();
        assert_eq!(idx.len(), 0);
        assert_eq!(idx.get(ChunkKey(1), |_| unreachable!("empty index")), None);
    }

    #[test]
    fn behaves_like_a_hash_map_under_random_churn() {
        churn(3000, false);
    }

    #[test]
    fn keys_with_equal_fingerprints_are_told_apart_by_their_slot_records() {
        assert_eq!(
            fingerprint(ChunkKey(7u64.wrapping_mul(0xF1DE_83E1_9937_733D))),
            Fingerprint(0)
        );
        churn(if cfg!(miri) { 60 } else { 300 }, true);
    }

    #[test]
    fn inserting_a_present_key_moves_it_to_the_new_slot() {
        let mut idx = SlotIndex::with_capacity(4);
        let records = [ChunkKey(5), ChunkKey(5), ChunkKey(9)];
        let key_of = |s: u32| records[s as usize];
        idx.insert(ChunkKey(5), 0, key_of);
        idx.insert(ChunkKey(9), 2, key_of);
        idx.insert(ChunkKey(5), 1, key_of);
        assert_eq!(idx.len(), 2);
        assert_eq!(idx.get(ChunkKey(5), key_of), Some(1));
        assert_eq!(idx.get(ChunkKey(9), key_of), Some(2));
        assert_eq!(idx.get(ChunkKey(6), key_of), None);
        assert_eq!(idx.heap_bytes() % 8, 0);
    }
}
