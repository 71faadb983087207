//! The linear-probing table shared by the tier's two key -> slot indexes
//! ([`super::key_index::KeyIndex`], [`super::slot_index::SlotIndex`]): open
//! addressing with Fibonacci hashing, linear probing and backward-shift
//! deletion (no tombstones), sized once for its capacity at a load factor of
//! at most 1/2, in huge-page memory.
//!
//! An entry is a *tag* (what the index keeps of the key: the key itself, or a
//! fingerprint of it) and a slot. The home position is the top bits of the
//! key's Fibonacci hash, which the tag alone gives, so that deletion can move
//! entries without reading their keys. A lookup compares tags, then asks
//! the index to confirm a tag match (a fingerprint index reads the slot
//! record's key; a key index needs nothing). Every method is generic over the
//! tag, so each index gets its own monomorphized, inlined copy.

use crate::key::ChunkKey;

use super::huge_buffer::HugeBuffer;

/// 2^64 / phi, the Fibonacci hashing multiplier.
const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

/// The Fibonacci hash of `key`: its top bits are the key's home position.
#[inline]
pub(crate) fn fibonacci_hash(key: ChunkKey) -> u64 {
    key.0.wrapping_mul(PHI)
}

/// What an index keeps of each key.
pub(crate) trait Tag: Copy + PartialEq {
    /// The tag of vacant entries (never compared: vacancy is the slot's).
    const VACANT: Self;
    /// The index's name, for its over-capacity panic.
    const INDEX: &'static str;
    /// The home position in a table of 2^(64 - `shift`) entries: the key's
    /// Fibonacci hash shifted right by `shift` (its top 64 - `shift` bits).
    fn home(self, shift: u32) -> usize;
}

/// The slot of a vacant entry.
const EMPTY: u32 = u32::MAX;

/// One entry: a tag and its slot (`EMPTY` when vacant).
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Entry<T> {
    tag: T,
    slot: u32,
}

impl<T: Tag> Entry<T> {
    /// What a vacant entry holds.
    const VACANT: Self = Self {
        tag: T::VACANT,
        slot: EMPTY,
    };
}

/// Open-addressing table of tags to slots, holding at most the capacity given
/// at creation (so it never grows).
#[derive(Debug)]
pub(crate) struct ProbeTable<T: Tag> {
    entries: HugeBuffer<Entry<T>>,
    /// 64 - log2 of the table size (see [`Tag::home`]).
    shift: u32,
    mask: usize,
    len: usize,
    max_len: usize,
}

impl<T: Tag> ProbeTable<T> {
    /// A table for up to `max_len` keys, of at most `max_size` entries.
    pub(crate) fn with_capacity(max_len: usize, max_size: usize) -> Self {
        let size = (max_len.max(8) * 2).next_power_of_two().min(max_size);
        Self {
            entries: HugeBuffer::new(size, Entry::VACANT),
            shift: 64 - size.trailing_zeros(),
            mask: size - 1,
            len: 0,
            max_len,
        }
    }

    /// The home position of a tag.
    #[inline]
    fn home(&self, tag: T) -> usize {
        tag.home(self.shift)
    }

    /// The position of the entry of `tag` that `confirm` accepts (given the
    /// entry's slot), or the vacant position where it would go.
    #[inline]
    fn find(&self, tag: T, confirm: impl Fn(u32) -> bool) -> Result<usize, usize> {
        let mut i = self.home(tag);
        loop {
            let e = self.entries[i];
            if e.slot == EMPTY {
                return Err(i);
            }
            if e.tag == tag && confirm(e.slot) {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Hints the CPU to fetch the cache line where `tag` would be found, so a
    /// batch of lookups overlaps its memory latency.
    #[inline]
    pub(crate) fn prefetch(&self, tag: T) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            let p = std::ptr::from_ref(&self.entries[self.home(tag)]).cast::<i8>();
            // SAFETY: a prefetch is a hint with no memory effect; `p` points into
            // the live table. SSE is part of the x86_64 baseline.
            unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p) };
        }
        #[cfg(not(all(target_arch = "x86_64", not(miri))))]
        let _ = tag;
    }

    /// Number of keys.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The slot of the entry of `tag` that `confirm` accepts.
    #[inline]
    pub(crate) fn get(&self, tag: T, confirm: impl Fn(u32) -> bool) -> Option<u32> {
        self.find(tag, confirm).ok().map(|i| self.entries[i].slot)
    }

    /// Sets the slot of the entry of `tag` that `confirm` accepts, inserting
    /// one if there is none.
    #[inline]
    pub(crate) fn insert(&mut self, tag: T, slot: u32, confirm: impl Fn(u32) -> bool) {
        debug_assert_ne!(slot, EMPTY);
        match self.find(tag, confirm) {
            Ok(i) => self.entries[i].slot = slot,
            Err(i) => {
                assert!(self.len < self.max_len, "{} over its capacity", T::INDEX);
                self.entries[i] = Entry { tag, slot };
                self.len += 1;
            }
        }
    }

    /// Removes the entry of `tag` that `confirm` accepts, returning its slot.
    pub(crate) fn remove(&mut self, tag: T, confirm: impl Fn(u32) -> bool) -> Option<u32> {
        let hole = self.find(tag, confirm).ok()?;
        let slot = self.entries[hole].slot;
        let (shift, mask) = (self.shift, self.mask);
        remove_at(&mut self.entries, mask, hole, Entry::VACANT, |e| {
            (e.slot != EMPTY).then(|| e.tag.home(shift))
        });
        self.len -= 1;
        Some(slot)
    }

    /// Removes every key.
    pub(crate) fn clear(&mut self) {
        if self.len > 0 {
            self.entries.fill(Entry::VACANT);
            self.len = 0;
        }
    }

    /// Bytes of memory held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes()
    }
}

/// Empties `entries[hole]` and closes the gap (backward-shift deletion):
/// each later entry of the cluster moves back into the hole if the hole lies
/// between its home and its position, so no tombstones are needed and probes
/// stay short. `home` gives an occupied entry's home position, or `None` for
/// a vacant entry (the end of the cluster); `vacant` is what an empty entry
/// holds. `mask` is the table size minus one (a power of two).
#[inline]
fn remove_at<E: Copy>(
    entries: &mut [E],
    mask: usize,
    mut hole: usize,
    vacant: E,
    home: impl Fn(&E) -> Option<usize>,
) {
    let mut j = hole;
    loop {
        j = (j + 1) & mask;
        let e = entries[j];
        let Some(h) = home(&e) else {
            break;
        };
        if (j.wrapping_sub(h) & mask) >= (j.wrapping_sub(hole) & mask) {
            entries[hole] = e;
            hole = j;
        }
    }
    entries[hole] = vacant;
}
