//! DMA strategies: one `cuMemcpyAsync` per coalesced run, or one
//! `cuMemcpyBatchAsync` per job where the driver exports it (resolved at run
//! time; absent symbol = fall back to the loop).

use crate::Direction;
use cudarc::driver::{CudaStream, sys};

use crate::worker::CopyDesc;

use super::error::{CudaError, check};

/// Descriptors per `cuMemcpyBatchAsync` call.
pub const MAX_BATCH: usize = 8192;

/// `cuMemcpyBatchAsync_v2` (CUDA 13 ABI: no failIdx).
type BatchFnV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// `cuMemcpyBatchAsync` as CUDA 12.8 and 12.9 drivers export it: a
/// `size_t *failIdx` before the stream.
type BatchFnV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// The batched copy the driver has, by ABI. (Under Miri no driver symbol is
/// resolved, so neither variant is built there.)
#[derive(Debug, Clone, Copy)]
#[cfg_attr(miri, allow(dead_code))]
enum BatchFn {
    V2(BatchFnV2),
    V1(BatchFnV1),
}

/// `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE` (`CUmemcpyFlags`).
const PREFER_OVERLAP_WITH_COMPUTE: u32 = 0x1;

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
    /// Ask the driver to overlap the copies with compute (the
    /// `PREFER_OVERLAP_WITH_COMPUTE` flag on every copy).
    prefer_overlap: bool,
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
}

impl BatchCopy {
    /// Resolves the batched copy from the loaded driver (never panics):
    /// `cuMemcpyBatchAsync_v2` (CUDA 13), else `cuMemcpyBatchAsync` with the
    /// 12.8/12.9 ABI; neither: per-run copies.
    pub fn resolve() -> Self {
        #[cfg(miri)]
        let f = None;
        #[cfg(not(miri))]
        let f = {
            // SAFETY: only called after a context was created, so the driver
            // library is loaded; `get` looks a symbol up, and each type matches
            // the declaration of the symbol it is read as: `_v2` is CUDA 13's
            // (no failIdx); the unversioned name keeps the 12.8 signature in
            // every driver that exports it (13's header maps the name to `_v2`
            // instead of changing the exported symbol).
            unsafe {
                let lib = sys::culib();
                lib.get::<BatchFnV2>(b"cuMemcpyBatchAsync_v2\0")
                    .ok()
                    .map(|s| BatchFn::V2(*s))
                    .or_else(|| {
                        lib.get::<BatchFnV1>(b"cuMemcpyBatchAsync\0")
                            .ok()
                            .map(|s| BatchFn::V1(*s))
                    })
            }
        };
        match f {
            None => tracing::info!(
                "no cuMemcpyBatchAsync in the driver: batch DMA falls back to per-run copies"
            ),
            Some(BatchFn::V1(_)) => {
                tracing::info!("cuMemcpyBatchAsync with the CUDA 12.8 ABI (no _v2 in the driver)")
            }
            Some(BatchFn::V2(_)) => {}
        }
        Self {
            f,
            ..Self::default()
        }
    }

    /// Sets the prefer-overlap-with-compute flag on the copies to come.
    pub fn set_prefer_overlap(&mut self, on: bool) {
        self.prefer_overlap = on;
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
            flags: if self.prefer_overlap {
                PREFER_OVERLAP_WITH_COMPUTE
            } else {
                0
            },
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
            let mut fail_idx = usize::MAX;
            // SAFETY: the arrays hold `part.len()` entries each and live across the
            // call (the driver reads them during it); one attribute applies from
            // index 0; `fail_idx` is a valid out-parameter for the 12.8 ABI; the
            // memory named is valid per the layout contract.
            let r = unsafe {
                match f {
                    BatchFn::V2(f) => f(
                        self.dsts.as_mut_ptr(),
                        self.srcs.as_mut_ptr(),
                        self.sizes.as_mut_ptr(),
                        part.len(),
                        &mut attrs,
                        attr_idx.as_mut_ptr(),
                        1,
                        stream.cu_stream(),
                    ),
                    BatchFn::V1(f) => f(
                        self.dsts.as_mut_ptr(),
                        self.srcs.as_mut_ptr(),
                        self.sizes.as_mut_ptr(),
                        part.len(),
                        &mut attrs,
                        attr_idx.as_mut_ptr(),
                        1,
                        &mut fail_idx,
                        stream.cu_stream(),
                    ),
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS && fail_idx != usize::MAX {
                tracing::error!(
                    copy = fail_idx,
                    "cuMemcpyBatchAsync failed at this copy of the batch"
                );
            }
            check("cuMemcpyBatchAsync", r)?;
        }
        Ok(true)
    }
}
