//! Memory the CUDA backend owns: the pinned host pool (mapped, portable) and
//! device buffers (descriptor tables, test caches).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};

use super::error::{CudaError, check, driver};
use crate::worker::SharedRegion;

/// Largest piece registered with one `cuMemHostRegister` call (vLLM uses 64 GiB;
/// one registration of hundreds of GiB fails on some hosts).
pub const MAX_REGISTER_PIECE: usize = 64 << 30;

/// The bytes of one registration: at most `piece` (clamped to 4 KiB ..
/// [`MAX_REGISTER_PIECE`]), page-aligned, a whole number of `row_bytes` rows
/// (one row where a row is larger; `row_bytes` 0 or not page-aligned: pages).
pub fn register_piece(piece: usize, row_bytes: usize) -> usize {
    let piece = piece.clamp(4096, MAX_REGISTER_PIECE) & !4095;
    if row_bytes == 0 || !row_bytes.is_multiple_of(4096) {
        return piece;
    }
    (piece / row_bytes).max(1) * row_bytes
}

/// How a pinned buffer was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinnedKind {
    /// `cuMemHostAlloc(PORTABLE | DEVICEMAP)`.
    HostAlloc,
    /// A page-aligned allocation registered with `cuMemHostRegister` in pieces.
    Registered,
    /// A [`SharedRegion`] (mapped by every worker process) registered with
    /// `cuMemHostRegister` in pieces.
    Shared,
}

/// Pinned, device-mapped host memory. Under unified addressing (every 64-bit
/// Linux system) its host address is also its device address, so kernels read
/// and write it directly.
#[derive(Debug)]
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
    kind: PinnedKind,
    pieces: Vec<(usize, usize)>,
    /// The mapping of a [`PinnedKind::Shared`] buffer (unmapped after the
    /// pieces are unregistered).
    shared: Option<SharedRegion>,
}

// SAFETY: the buffer is plain bytes owned by this value; access to the contents
// is through raw addresses under the backend's job discipline.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references expose only addresses and lengths.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes from `cuMemHostAlloc(PORTABLE | DEVICEMAP)`, zeroed.
    pub fn host_alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: `p` is a valid out-pointer; the context is current.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len.max(1), flags)
        })?;
        // SAFETY: `p` points to `len` bytes just allocated.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        let b = Self {
            ctx: ctx.clone(),
            ptr: p.cast(),
            len,
            kind: PinnedKind::HostAlloc,
            pieces: Vec::new(),
            shared: None,
        };
        b.check_mapping()?;
        Ok(b)
    }

    /// `len` zeroed, page-aligned bytes registered (PORTABLE | DEVICEMAP) in
    /// pieces of at most `piece` bytes (faster to create than `host_alloc` for
    /// large pools). Each piece holds whole rows of `row_bytes` (a host
    /// chunk, page-padded: [`crate::worker::HostRowLayout::row_bytes`]), so
    /// that no copy into or out of a row crosses from one registration into
    /// the next (where a driver may treat it as pageable memory); a row
    /// larger than `piece` gets a piece of its own size.
    pub fn registered(
        ctx: &Arc<CudaContext>,
        len: usize,
        piece: usize,
        row_bytes: usize,
    ) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let layout = Layout::from_size_align(len.max(1), 4096).map_err(|_| CudaError::Driver {
            op: "alloc",
            message: format!("bad size {len}"),
        })?;
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(CudaError::Driver {
                op: "alloc",
                message: format!("cannot allocate {len} bytes"),
            });
        }
        let mut b = Self {
            ctx: ctx.clone(),
            ptr,
            len,
            kind: PinnedKind::Registered,
            pieces: Vec::new(),
            shared: None,
        };
        b.register_pieces(piece, row_bytes)?;
        Ok(b)
    }

    /// `region` (a host pool every worker process of the engine maps)
    /// registered (PORTABLE | DEVICEMAP) in pieces, as [`Self::registered`];
    /// its bytes are kept (another worker may have written them). The
    /// buffer owns the mapping: it unregisters the pieces, then unmaps it.
    pub fn over_shared(
        ctx: &Arc<CudaContext>,
        region: SharedRegion,
        piece: usize,
        row_bytes: usize,
    ) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let mut b = Self {
            ctx: ctx.clone(),
            ptr: region.addr() as *mut u8,
            len: region.len(),
            kind: PinnedKind::Shared,
            pieces: Vec::new(),
            shared: Some(region),
        };
        b.register_pieces(piece, row_bytes)?;
        Ok(b)
    }

    /// Registers the buffer's bytes in pieces of at most `piece` whole rows
    /// of `row_bytes` (each piece recorded for `Drop` as soon as it is
    /// registered), then checks the mapping.
    fn register_pieces(&mut self, piece: usize, row_bytes: usize) -> Result<(), CudaError> {
        let len = self.len;
        let piece = register_piece(piece, row_bytes);
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        let mut off = 0;
        while off < len.max(1) {
            let n = piece.min(len.max(1) - off);
            // SAFETY: `[ptr + off, ptr + off + n)` is inside the buffer's
            // allocation or mapping and page-aligned at its start; it stays
            // there until `Drop`, which unregisters it first.
            check("cuMemHostRegister", unsafe {
                sys::cuMemHostRegister_v2(self.ptr.add(off).cast(), n, flags)
            })?;
            self.pieces.push((off, n));
            off += n;
        }
        self.check_mapping()
    }

    /// Fails unless every piece's device address equals its host address.
    fn check_mapping(&self) -> Result<(), CudaError> {
        let starts: Vec<usize> = if self.pieces.is_empty() {
            vec![0]
        } else {
            self.pieces.iter().map(|p| p.0).collect()
        };
        for off in starts {
            let mut d: sys::CUdeviceptr = 0;
            // SAFETY: the address is inside a pinned, mapped allocation of this context.
            check("cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr.add(off).cast(), 0)
            })?;
            if d != self.ptr as u64 + off as u64 {
                return Err(CudaError::Unsupported(
                    "mapped host memory has a device address different from its host address (no unified addressing)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Host (and device) address of byte 0.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How it was made.
    pub fn kind(&self) -> PinnedKind {
        self.kind
    }

    /// The path of the shared region under a [`PinnedKind::Shared`] buffer.
    pub fn shared_path(&self) -> Option<&std::path::Path> {
        self.shared.as_ref().map(|r| r.path())
    }

    /// Removes the file name of the shared region under a
    /// [`PinnedKind::Shared`] buffer ([`SharedRegion::unlink`]); any other
    /// buffer: nothing.
    pub fn unlink_shared(&self) -> Result<(), crate::worker::SharedRegionError> {
        match &self.shared {
            Some(r) => r.unlink(),
            None => Ok(()),
        }
    }

    /// Copies `data` to `offset`.
    ///
    /// # Safety
    /// No in-flight copy may read or write these bytes.
    pub unsafe fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|e| e <= self.len)
        );
        // SAFETY: in bounds; no concurrent access (caller contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }

    /// Copies `len` bytes from `offset` out.
    ///
    /// # Safety
    /// No in-flight copy may write these bytes.
    pub unsafe fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset.checked_add(len).is_some_and(|e| e <= self.len));
        let mut v = vec![0u8; len];
        // SAFETY: in bounds; no concurrent writer (caller contract).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), v.as_mut_ptr(), len) };
        v
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            tracing::error!("cannot bind the CUDA context to free pinned memory");
        }
        match self.kind {
            PinnedKind::HostAlloc => {
                // SAFETY: allocated by cuMemHostAlloc in this context, freed once.
                let r = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    tracing::error!(?r, "cuMemFreeHost failed");
                }
            }
            PinnedKind::Registered | PinnedKind::Shared => {
                for &(off, _) in &self.pieces {
                    // SAFETY: each piece was registered once in `register_pieces`.
                    let r = unsafe { sys::cuMemHostUnregister(self.ptr.add(off).cast()) };
                    if r != sys::CUresult::CUDA_SUCCESS {
                        tracing::error!(?r, "cuMemHostUnregister failed");
                    }
                }
                if self.kind == PinnedKind::Shared {
                    // The mapping (`shared`) is unmapped when the field drops.
                    return;
                }
                // SAFETY: allocated in `registered` with this layout.
                unsafe {
                    dealloc(
                        self.ptr,
                        Layout::from_size_align_unchecked(self.len.max(1), 4096),
                    )
                };
            }
        }
    }
}

/// A device allocation (`cuMemAlloc`), freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: a device address and its owning context; the context is thread-safe.
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared references expose only the address.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `len` bytes of device memory, zeroed.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; context current.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1))
        })?;
        let b = Self {
            ctx: ctx.clone(),
            ptr,
            len,
        };
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(ptr, 0, len.max(1))
        })?;
        // The memset is asynchronous to the host and on the legacy stream, which the
        // backend's non-blocking streams do not wait for.
        ctx.synchronize().map_err(driver("cuCtxSynchronize"))?;
        Ok(b)
    }

    /// Device address of byte 0.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Synchronous upload of `data` to `offset` (tests and setup only).
    pub fn upload(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        if offset.checked_add(data.len()).is_none_or(|e| e > self.len) {
            return Err(CudaError::Driver {
                op: "cuMemcpyHtoD",
                message: "out of bounds".into(),
            });
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: in bounds (checked); synchronous copy from a live slice.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, data.as_ptr().cast(), data.len())
        })?;
        // From pageable memory the call may return before the DMA lands; the
        // backend's non-blocking streams would not wait for it.
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
    }

    /// Sets the first `len` bytes to `value`, and waits for it (setup and
    /// checks only: the legacy-stream memset does not order itself with the
    /// backend's non-blocking streams, so the context is synchronised).
    pub fn fill(&self, value: u8, len: usize) -> Result<(), CudaError> {
        if len > self.len {
            return Err(CudaError::Driver {
                op: "cuMemsetD8",
                message: "out of bounds".into(),
            });
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        // SAFETY: `len` bytes from the start lie in this allocation (checked).
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, value, len)
        })?;
        self.ctx.synchronize().map_err(driver("cuCtxSynchronize"))
    }

    /// Synchronous download of `len` bytes from `offset` (tests only).
    pub fn download(&self, offset: usize, len: usize) -> Result<Vec<u8>, CudaError> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(CudaError::Driver {
                op: "cuMemcpyDtoH",
                message: "out of bounds".into(),
            });
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let mut v = vec![0u8; len];
        // SAFETY: in bounds (checked); synchronous copy into a live vector.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.ptr + offset as u64, len)
        })?;
        Ok(v)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            tracing::error!("cannot bind the CUDA context to free device memory");
        }
        // SAFETY: allocated by cuMemAlloc in this context, freed once.
        let r = unsafe { sys::cuMemFree_v2(self.ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::error!(?r, "cuMemFree failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::register_piece;

    #[test]
    fn register_pieces_hold_whole_rows() {
        // 1 MiB pieces of 12 KiB rows: 85 rows, never one split.
        assert_eq!(register_piece(1 << 20, 12 << 10), 85 * (12 << 10));
        // A row larger than the piece gets a piece of its own.
        assert_eq!(register_piece(1 << 20, 3 << 20), 3 << 20);
        // Exact multiples stay; no row size: whole pages.
        assert_eq!(register_piece(1 << 20, 64 << 10), 1 << 20);
        assert_eq!(register_piece((1 << 20) + 5, 0), 1 << 20);
        assert_eq!(register_piece(10, 4096), 4096);
    }
}
