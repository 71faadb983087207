//! The worker pool on CUDA backends: one [`CudaBackend`] per worker (device
//! `rank % device_count`) over a device buffer of the simulated GPU pool's
//! blocks, all sharing one pinned, mapped host pool; faults injected by a
//! [`FaultInjector`] with the host backend's semantics.
//!
//! Compiled everywhere, runs only with an NVIDIA driver and a device: without
//! them [`WorkerPool::cuda`] returns [`PoolError::CudaUnavailable`].

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::worker::cuda::{
    CudaBackend, CudaBackendOptions, CudaError, DeviceBuffer, PinnedBuffer, SharedStrategyTable,
    device_count, error::driver, open_context, pool_near,
};
use crate::worker::numa::{self, SysfsTopology};
use crate::worker::{
    FaultInjector, GpuLayout, HostRowLayout, LayoutError, OffloadWorker, WorkerLayout,
};

use super::content::{ContentChecker, ContentError, GpuMemory, LINE_BYTES};
use super::workers::{PoolError, PoolGeometry, RemoteAttach, STEP_WAIT, WorkerPool, attach_remote};

/// A worker's device buffer as the content check writes and reads it: with
/// synchronous copies (`DeviceBuffer::upload` and `download`, which bind the
/// buffer's context to the calling thread: the worker's own).
#[derive(Debug)]
struct DeviceGpuMemory {
    buf: Arc<DeviceBuffer>,
    /// The bytes of a block being written, before their upload.
    staging: Vec<u8>,
}

impl GpuMemory for DeviceGpuMemory {
    fn len(&self) -> usize {
        self.buf.len()
    }

    unsafe fn fill(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), ContentError> {
        self.staging.resize(len, 0);
        fill(&mut self.staging);
        // Synchronous (it waits for the context): the bytes are in place
        // before a later store's stream reads them.
        Ok(self.buf.upload(offset, &self.staging)?)
    }

    unsafe fn read_lines(
        &mut self,
        base: usize,
        block_bytes: usize,
        lines: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<(), ContentError> {
        // One download of the block (a copy per line costs a round trip each).
        let block = self.buf.download(base, block_bytes)?;
        out.clear();
        for &l in lines {
            let start = l * LINE_BYTES;
            let end = (start + LINE_BYTES).min(block_bytes);
            out.extend_from_slice(block.get(start..end).unwrap_or_default());
        }
        Ok(())
    }
}

/// Number of CUDA devices (at least 1 once a context opened).
fn devices() -> usize {
    device_count().unwrap_or(1).max(1)
}

impl WorkerPool {
    /// `world_size` workers on CUDA backends, each with `gpu_blocks` device
    /// blocks of `block_bytes` (cross-layer pages), sharing a pinned host pool
    /// of `num_chunks` rows of `blocks_per_chunk` blocks per worker; jobs choose
    /// their copy strategy from `strategies`, one table all the workers read
    /// (replace it through the same handle while they run; its `tuning` is
    /// applied when the backends are built). With `remote`, each worker also
    /// writes its share of the chunks it stores to its own connection to that
    /// store and runs the plans' fetches from it, as the host pool's workers
    /// do ([`WorkerPool::host_with_remote`]).
    pub fn cuda(
        geometry: PoolGeometry,
        strategies: Arc<SharedStrategyTable>,
        remote: Option<RemoteAttach>,
    ) -> Result<Self, PoolError> {
        let PoolGeometry {
            world_size,
            gpu_blocks,
            block_bytes,
            blocks_per_chunk,
            num_chunks,
            ..
        } = geometry;
        let world = world_size.max(1);
        let first = open_context(0).map_err(PoolError::CudaUnavailable)?;
        let devices = devices();
        let cuda = |worker: u32| move |source: CudaError| PoolError::Cuda { worker, source };
        let row = HostRowLayout::uniform(
            blocks_per_chunk.max(1),
            geometry.row_slots(),
            &[block_bytes],
        )?;
        let pool_bytes = row
            .pool_bytes(num_chunks)
            .ok_or(LayoutError::Overflow("host pool size"))?;
        let pool_len =
            usize::try_from(pool_bytes).map_err(|_| LayoutError::Overflow("host pool size"))?;
        let gpu_len = usize::try_from(u64::from(gpu_blocks).saturating_mul(block_bytes))
            .map_err(|_| LayoutError::Overflow("GPU buffer size"))?;
        // One pool for every worker: on the NUMA node of the first GPU.
        let guard = numa::enter(geometry.numa, &pool_near(&first), &SysfsTopology::system())?;
        let pool = Arc::new(PinnedBuffer::host_alloc(&first, pool_len).map_err(cuda(0))?);
        let mut contexts: Vec<Arc<CudaContext>> = vec![first];
        let mut me = Self::empty();
        me.set_host_placement(guard.finish(pool.addr() as usize, pool_len));
        for rank in 0..world {
            let ordinal = rank as usize % devices;
            let ctx = match contexts.get(ordinal) {
                Some(c) => Arc::clone(c),
                None => {
                    let c = open_context(ordinal).map_err(cuda(rank))?;
                    contexts.push(Arc::clone(&c));
                    c
                }
            };
            let dev = Arc::new(DeviceBuffer::new(&ctx, gpu_len).map_err(cuda(rank))?);
            let layout = WorkerLayout::new(
                GpuLayout::cross_layer(dev.addr(), gpu_blocks, block_bytes, block_bytes)?,
                row.clone(),
                geometry.slot_of(rank),
                pool.addr(),
                num_chunks,
            )?;
            let mut options = CudaBackendOptions {
                strategies: Arc::clone(&strategies),
                ..CudaBackendOptions::default()
            };
            // A calibrated table's tuning (launch shape, ring depth,
            // prefer-overlap) applies when the backend is built.
            strategies.snapshot().tuning.apply(&mut options);
            let checker = ContentChecker::new(
                Box::new(DeviceGpuMemory {
                    buf: Arc::clone(&dev),
                    staging: Vec::new(),
                }),
                geometry.slot_of(rank),
                block_bytes,
            );
            let remote = remote.clone();
            me.spawn(rank, (dev, Arc::clone(&pool)), checker, move || {
                let compute = ctx
                    .new_stream()
                    .map_err(|e| cuda(rank)(driver("cuStreamCreate")(e)))?;
                // SAFETY: the layout addresses `dev` (gpu_blocks × block_bytes) and
                // the pinned, mapped `pool` (row layout × num_chunks), both kept by
                // this worker's thread until after the worker (and its backend,
                // which synchronises its streams on drop) is dropped; nothing else
                // writes them but this pool's jobs.
                let backend = unsafe { CudaBackend::new(ctx, layout, compute, options) }
                    .map_err(cuda(rank))?;
                let w = OffloadWorker::new(FaultInjector::new(backend), true)
                    .with_store_writers(geometry.writers_of(rank))
                    .with_wait_timeout(Some(STEP_WAIT));
                attach_remote(w, rank, geometry, remote)
            })?;
        }
        Ok(me)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore)]
    fn without_a_driver_the_pool_is_unavailable_not_a_panic() {
        let table = Arc::new(SharedStrategyTable::new(
            crate::worker::cuda::StrategyTable::default(),
        ));
        match WorkerPool::cuda(
            PoolGeometry {
                world_size: 2,
                gpu_blocks: 16,
                block_bytes: 4096,
                blocks_per_chunk: 1,
                num_chunks: 8,
                replicated: false,
                numa: crate::worker::numa::HostPlacement::Auto,
            },
            table,
            None,
        ) {
            Ok(p) => {
                assert_eq!(p.world_size(), 2);
                println!("SKIP: a CUDA device is present");
            }
            Err(PoolError::CudaUnavailable(e)) => {
                let msg = PoolError::CudaUnavailable(e).to_string();
                assert!(msg.starts_with("cuda backend unavailable: "), "{msg}");
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
}
