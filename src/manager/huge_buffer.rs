//! A fixed-length buffer for large metadata arrays, backed by transparent huge
//! pages where the OS offers them.
//!
//! The manager's key index and slot arrays are touched at random; on a tier of
//! a million chunks they span tens of MiB, and with 4 KiB pages nearly every
//! access also misses the TLB. Buffers of at least 2 MiB are mapped anonymously
//! and advised `MADV_HUGEPAGE` (Linux), which removes most of those misses.
//! Elsewhere (other OSes, Miri, small buffers) they are plain heap memory.

use std::ops::{Deref, DerefMut};

/// Buffers at least this large are mapped with huge-page advice.
const HUGE_THRESHOLD: usize = 2 << 20;

/// A heap buffer of `len` copies of a value, possibly huge-page backed.
pub(crate) struct HugeBuffer<T: Copy> {
    inner: Backing<T>,
}

enum Backing<T: Copy> {
    Heap(Vec<T>),
    #[cfg(all(target_os = "linux", not(miri)))]
    Mapped {
        ptr: *mut T,
        len: usize,
        bytes: usize,
    },
}

// SAFETY: the mapped variant owns its memory exclusively (like a Vec), so it is
// as Send/Sync as the elements are.
unsafe impl<T: Copy + Send> Send for HugeBuffer<T> {}
// SAFETY: shared access only hands out `&[T]`, as for a Vec.
unsafe impl<T: Copy + Sync> Sync for HugeBuffer<T> {}

impl<T: Copy> HugeBuffer<T> {
    /// `len` copies of `fill`.
    pub(crate) fn new(len: usize, fill: T) -> Self {
        #[cfg(all(target_os = "linux", not(miri)))]
        {
            let bytes = len.saturating_mul(std::mem::size_of::<T>());
            if bytes >= HUGE_THRESHOLD
                && std::mem::align_of::<T>() <= 4096
                && let Some(ptr) = map_huge(bytes)
            {
                let ptr = ptr.cast::<T>();
                for i in 0..len {
                    // SAFETY: `ptr` points to `bytes >= len * size_of::<T>()` writable bytes,
                    // page-aligned (so aligned for T); `i < len` stays in bounds.
                    unsafe { ptr.add(i).write(fill) };
                }
                return Self {
                    inner: Backing::Mapped { ptr, len, bytes },
                };
            }
        }
        let _ = HUGE_THRESHOLD;
        Self {
            inner: Backing::Heap(vec![fill; len]),
        }
    }

    /// Bytes of memory held.
    pub(crate) fn heap_bytes(&self) -> usize {
        match &self.inner {
            Backing::Heap(v) => v.capacity() * std::mem::size_of::<T>(),
            #[cfg(all(target_os = "linux", not(miri)))]
            Backing::Mapped { bytes, .. } => *bytes,
        }
    }
}

#[cfg(all(target_os = "linux", not(miri)))]
fn map_huge(bytes: usize) -> Option<*mut u8> {
    // SAFETY: an anonymous private mapping has no preconditions; the result is
    // checked against MAP_FAILED before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `ptr..ptr+bytes` is the mapping just created; the advice is only a
    // hint and failure (THP disabled) leaves ordinary pages.
    unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) };
    Some(ptr.cast::<u8>())
}

impl<T: Copy> Drop for HugeBuffer<T> {
    fn drop(&mut self) {
        #[cfg(all(target_os = "linux", not(miri)))]
        if let Backing::Mapped { ptr, bytes, .. } = self.inner {
            // SAFETY: the mapping was created by `map_huge` with this length and
            // is unmapped exactly once; T is Copy so no element needs dropping.
            unsafe { libc::munmap(ptr.cast(), bytes) };
        }
    }
}

impl<T: Copy> Deref for HugeBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.inner {
            Backing::Heap(v) => v,
            #[cfg(all(target_os = "linux", not(miri)))]
            // SAFETY: `ptr` holds `len` initialised elements for the buffer's lifetime.
            Backing::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl<T: Copy> DerefMut for HugeBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.inner {
            Backing::Heap(v) => v,
            #[cfg(all(target_os = "linux", not(miri)))]
            // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
            Backing::Mapped { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(*ptr, *len)
            },
        }
    }
}

impl<T: Copy + std::fmt::Debug> std::fmt::Debug for HugeBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeBuffer")
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_buffers_hold_their_values() {
        // Under Miri the large case is plain heap memory like the small ones,
        // and walking 4 MiB element by element takes minutes there.
        let large = if cfg!(miri) { 1000 } else { (4 << 20) / 8 + 5 };
        for len in [0usize, 3, large] {
            let mut b = HugeBuffer::new(len, 7u64);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 7));
            if len > 0 {
                b[len - 1] = 9;
                assert_eq!(b[len - 1], 9);
            }
            assert!(b.heap_bytes() >= len * 8);
        }
    }
}
