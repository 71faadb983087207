//! A key -> position index holding the keys themselves (ARC's ghost lists,
//! whose keys have no slot record): open addressing with linear probing and
//! backward-shift deletion (no tombstones), sized once for its capacity at a
//! load factor of at most 1/2, in huge-page memory. The tier's own index is
//! [`super::slot_index::SlotIndex`], which keeps only fingerprints.
//!
//! The index never holds more keys than its capacity, so the table never
//! grows, and a lookup touches one cache line in the common case.

use crate::key::ChunkKey;

use super::huge_buffer::HugeBuffer;
use super::probing::remove_at;

/// Fibonacci hashing: the top bits of key * 2^64/phi (`shift` = 64 - log2 size).
#[inline]
fn home_of(key: u64, shift: u32) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> shift) as usize
}

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Entry {
    key: u64,
    /// The slot, or `EMPTY`.
    slot: u32,
    _pad: u32,
}

const VACANT: Entry = Entry {
    key: 0,
    slot: EMPTY,
    _pad: 0,
};

/// Maps chunk keys to host slot ids; holds at most the capacity given at creation.
#[derive(Debug)]
pub(crate) struct KeyIndex {
    entries: HugeBuffer<Entry>,
    shift: u32,
    mask: usize,
    len: usize,
    max_len: usize,
}

impl KeyIndex {
    /// An index for up to `max_len` keys.
    pub(crate) fn with_capacity(max_len: usize) -> Self {
        let size = (max_len.max(8) * 2).next_power_of_two();
        Self {
            entries: HugeBuffer::new(size, VACANT),
            shift: 64 - size.trailing_zeros(),
            mask: size - 1,
            len: 0,
            max_len,
        }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        home_of(key, self.shift)
    }

    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.slot == EMPTY {
                return Err(i);
            }
            if e.key == key {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Hints the CPU to fetch the cache line where `key` would be found, so a
    /// batch of lookups overlaps its memory latency.
    #[inline]
    pub(crate) fn prefetch(&self, key: ChunkKey) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            let p = std::ptr::from_ref(&self.entries[self.home(key.0)]).cast::<i8>();
            // SAFETY: a prefetch is a hint with no memory effect; `p` points into
            // the live table. SSE is part of the x86_64 baseline.
            unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p) };
        }
        #[cfg(not(all(target_arch = "x86_64", not(miri))))]
        let _ = key;
    }

    /// Number of keys.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The slot of `key`.
    #[inline]
    pub(crate) fn get(&self, key: ChunkKey) -> Option<u32> {
        self.find(key.0).ok().map(|i| self.entries[i].slot)
    }

    /// Whether `key` is present.
    #[cfg(test)]
    pub(crate) fn contains(&self, key: ChunkKey) -> bool {
        self.find(key.0).is_ok()
    }

    /// Sets the slot of `key`, inserting it if absent.
    pub(crate) fn insert(&mut self, key: ChunkKey, slot: u32) {
        debug_assert_ne!(slot, EMPTY);
        match self.find(key.0) {
            Ok(i) => self.entries[i].slot = slot,
            Err(i) => {
                assert!(self.len < self.max_len, "key index over its capacity");
                self.entries[i] = Entry {
                    key: key.0,
                    slot,
                    _pad: 0,
                };
                self.len += 1;
            }
        }
    }

    /// Removes `key`, returning its slot.
    pub(crate) fn remove(&mut self, key: ChunkKey) -> Option<u32> {
        let hole = self.find(key.0).ok()?;
        let slot = self.entries[hole].slot;
        let (shift, mask) = (self.shift, self.mask);
        remove_at(&mut self.entries, mask, hole, VACANT, |e| {
            (e.slot != EMPTY).then(|| home_of(e.key, shift))
        });
        self.len -= 1;
        Some(slot)
    }

    /// Removes every key.
    pub(crate) fn clear(&mut self) {
        if self.len > 0 {
            self.entries.fill(VACANT);
            self.len = 0;
        }
    }

    /// Bytes of memory held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes()
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
