//! DMA strategies: one `cuMemcpyAsync` per coalesced run, or one
//! `cuMemcpyBatchAsync` per job where the driver exports it (resolved at run
//! time; absent symbol = fall back to the loop).

use cudarc::driver::{CudaStream, sys};

use crate::worker::{CopyDesc, Direction};

use super::error::{CudaError, check};

/// Descriptors per `cuMemcpyBatchAsync` call.
pub const MAX_BATCH: usize = 8192;

/// `cuMemcpyBatchAsync_v2` (CUDA 13 ABI: no failIdx).
type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// Enqueues one `cuMemcpyAsync` per descriptor (addresses are unified).
pub fn enqueue_each(stream: &CudaStream, descs: &[CopyDesc]) -> Result<(), CudaError> {
    for d in descs {
        // SAFETY: every descriptor names memory the backend's layout contract keeps
        // valid (device pages and pinned host rows) until the job completes.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(d.dst, d.src, d.bytes as usize, stream.cu_stream())
        })?;
    }
    Ok(())
}

/// The batched copy, if the driver has it, with reusable argument arrays.
#[derive(Debug, Default)]
pub struct BatchCopy {
    f: Option<BatchFn>,
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
}

impl BatchCopy {
    /// Resolves `cuMemcpyBatchAsync_v2` from the loaded driver (never panics).
    pub fn resolve() -> Self {
        #[cfg(miri)]
        let f = None;
        #[cfg(not(miri))]
        let f = {
            // SAFETY: only called after a context was created, so the driver library
            // is loaded; `get` looks a symbol up and the type matches the CUDA 13
            // declaration of cuMemcpyBatchAsync_v2.
            unsafe {
                sys::culib()
                    .get::<BatchFn>(b"cuMemcpyBatchAsync_v2\0")
                    .ok()
                    .map(|s| *s)
            }
        };
        if f.is_none() {
            tracing::info!(
                "cuMemcpyBatchAsync_v2 not in the driver: batch DMA falls back to per-run copies"
            );
        }
        Self {
            f,
            ..Self::default()
        }
    }

    /// Whether the driver has the batched copy.
    pub fn available(&self) -> bool {
        self.f.is_some()
    }

    /// Enqueues the descriptors as batches; false (nothing enqueued) if the
    /// driver lacks the call.
    pub fn enqueue(
        &mut self,
        stream: &CudaStream,
        descs: &[CopyDesc],
        direction: Direction,
        device: i32,
    ) -> Result<bool, CudaError> {
        let Some(f) = self.f else {
            return Ok(false);
        };
        let dev = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        };
        let host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let (order, src_hint, dst_hint) = match direction {
            // The source is live KV written by the compute stream: stream order.
            Direction::Store => (
                sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                dev,
                host,
            ),
            Direction::Load => (
                sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
                host,
                dev,
            ),
        };
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: order,
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: 0,
        };
        for part in descs.chunks(MAX_BATCH) {
            self.dsts.clear();
            self.srcs.clear();
            self.sizes.clear();
            for d in part {
                self.dsts.push(d.dst);
                self.srcs.push(d.src);
                self.sizes.push(d.bytes as usize);
            }
            let mut attr_idx = [0usize];
            // SAFETY: the arrays hold `part.len()` entries each and live across the
            // call (the driver reads them during it); one attribute applies from
            // index 0; the memory named is valid per the layout contract.
            check("cuMemcpyBatchAsync", unsafe {
                f(
                    self.dsts.as_mut_ptr(),
                    self.srcs.as_mut_ptr(),
                    self.sizes.as_mut_ptr(),
                    part.len(),
                    &mut attrs,
                    attr_idx.as_mut_ptr(),
                    1,
                    stream.cu_stream(),
                )
            })?;
        }
        Ok(true)
    }
}
