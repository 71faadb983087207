//! A page-aligned, zeroed host allocation that stands in for a GPU cache or the
//! host pool in the host backend (and in tests and simulations).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use thiserror::Error;

/// Alignment of every [`HostBuffer`].
pub const HOST_BUFFER_ALIGN: usize = 4096;

/// A host buffer could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HostBufferError {
    /// Zero bytes were asked for.
    #[error("a host buffer needs at least one byte")]
    Empty,
    /// The size is not representable or the allocator said no.
    #[error("cannot allocate {0} bytes")]
    Alloc(usize),
}

/// Owned, zero-initialised, 4096-aligned bytes addressed by raw pointers.
///
/// Copies run on backend threads through raw addresses, so reading or writing
/// the contents from Rust is `unsafe`: the caller must make sure no job that
/// touches the same bytes is in flight.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this value; all access through it is
// either `unsafe` (with a no-concurrent-copy contract) or by address.
unsafe impl Send for HostBuffer {}
// SAFETY: see `Send`; shared references only expose the address and length.
unsafe impl Sync for HostBuffer {}

/// Copies `data` to `offset` of the `len` bytes at `base`.
///
/// # Safety
/// `base..base + len` is live, writable memory no one else accesses meanwhile.
///
/// # Panics
/// If the range is out of bounds.
pub(super) unsafe fn write_raw(base: NonNull<u8>, len: usize, offset: usize, data: &[u8]) {
    assert!(offset.checked_add(data.len()).is_some_and(|e| e <= len));
    // SAFETY: in bounds (checked above) of live memory (caller contract).
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.as_ptr().add(offset), data.len()) };
}

/// Copies `n` bytes from `offset` of the `len` bytes at `base` into a vector.
///
/// # Safety
/// `base..base + len` is live memory no one writes meanwhile.
///
/// # Panics
/// If the range is out of bounds.
pub(super) unsafe fn read_raw(base: NonNull<u8>, len: usize, offset: usize, n: usize) -> Vec<u8> {
    assert!(offset.checked_add(n).is_some_and(|e| e <= len));
    let mut v = vec![0u8; n];
    // SAFETY: in bounds (checked above) of live memory (caller contract).
    unsafe { std::ptr::copy_nonoverlapping(base.as_ptr().add(offset), v.as_mut_ptr(), n) };
    v
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes.
    pub fn new(len: usize) -> Result<Self, HostBufferError> {
        if len == 0 {
            return Err(HostBufferError::Empty);
        }
        let layout = Layout::from_size_align(len, HOST_BUFFER_ALIGN)
            .map_err(|_| HostBufferError::Alloc(len))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(HostBufferError::Alloc(len))?;
        Ok(Self { ptr, len })
    }

    /// Address of byte 0.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (buffers are never empty).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `[start, end)` lies inside the buffer.
    pub fn contains(&self, start: u64, end: u64) -> bool {
        start >= self.addr() && end >= start && end <= self.addr() + self.len as u64
    }

    /// Copies `data` to `offset`.
    ///
    /// # Safety
    /// No in-flight job may read or write these bytes.
    ///
    /// # Panics
    /// If the range is out of bounds (a test-helper contract, not input validation).
    pub unsafe fn write(&self, offset: usize, data: &[u8]) {
        // SAFETY: the buffer's live bytes; no concurrent access (caller contract).
        unsafe { write_raw(self.ptr, self.len, offset, data) }
    }

    /// Copies `len` bytes from `offset` into a vector.
    ///
    /// # Safety
    /// No in-flight job may write these bytes.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub unsafe fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        // SAFETY: the buffer's live bytes; no concurrent writer (caller contract).
        unsafe { read_raw(self.ptr, self.len, offset, len) }
    }

    /// Copies `out.len()` bytes from `offset` into `out` (no allocation).
    ///
    /// # Safety
    /// No in-flight job may write these bytes.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub unsafe fn read_into(&self, offset: usize, out: &mut [u8]) {
        assert!(offset.checked_add(out.len()).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (checked above); `out` is a distinct live slice;
        // no concurrent writer (caller contract).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }

    /// Calls `f` with the bytes `offset..offset + len`, mutably (to fill them
    /// in place, without a staging copy).
    ///
    /// # Safety
    /// No in-flight job may read or write these bytes, and no other access to
    /// them may happen while `f` runs.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub unsafe fn with_bytes_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (checked above), inside the live allocation; the
        // caller guarantees no concurrent access for the slice's lifetime,
        // which ends when `f` returns.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) };
        f(bytes)
    }

    /// Sets every byte to `byte`.
    ///
    /// # Safety
    /// No in-flight job may read or write the buffer.
    pub unsafe fn fill(&self, byte: u8) {
        // SAFETY: the whole allocation; no concurrent access (caller contract).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.len) };
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout (validated there).
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, HOST_BUFFER_ALIGN),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_bounded() {
        let b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.addr() % HOST_BUFFER_ALIGN as u64, 0);
        // SAFETY: no jobs exist.
        unsafe {
            assert!(b.read(0, 10_000).iter().all(|&x| x == 0));
            b.write(9_998, &[1, 2]);
            assert_eq!(b.read(9_998, 2), vec![1, 2]);
            let mut two = [0u8; 2];
            b.read_into(9_998, &mut two);
            assert_eq!(two, [1, 2]);
            b.with_bytes_mut(9_997, 3, |s| s.copy_from_slice(&[7, 8, 9]));
            assert_eq!(b.read(9_996, 4), vec![0, 7, 8, 9]);
        }
        assert!(b.contains(b.addr(), b.addr() + 10_000));
        assert!(!b.contains(b.addr(), b.addr() + 10_001));
        assert_eq!(HostBuffer::new(0).unwrap_err(), HostBufferError::Empty);
    }
}
