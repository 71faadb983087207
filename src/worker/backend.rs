//! The one trait every transfer backend implements (host memcpy, CUDA).

use crate::Direction;
use std::time::Duration;

use crate::ids::{ChunkId, JobId};

use super::error::BackendError;
use super::layout::TransferSpec;

/// A finished job, as reported by [`TransferBackend::poll`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferResult {
    /// The job.
    pub job: JobId,
    /// Its direction.
    pub direction: Direction,
    /// False when the copy failed (no guarantee on the destination bytes).
    pub success: bool,
    /// Bytes moved (planned bytes; 0 when the job failed).
    pub bytes: u64,
    /// Time the copy took on the backend (device time for CUDA).
    pub duration: Duration,
}

/// A transfer backend: asynchronous block copies between GPU pages and host chunks.
///
/// Jobs of one direction complete in submission order (FIFO); the two directions
/// are independent. Submitting never waits for a copy.
///
/// The host backend (memcpy threads) over plain host buffers standing in for
/// the GPU's pages:
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// use kvoffload::worker::{
///     GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, TransferBackend,
///     TransferSpec, WorkerLayout,
/// };
/// use kvoffload::{Direction, JobId};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// const BLOCK: u64 = 256;
/// let (blocks, chunks) = (8, 4);
/// // One worker; chunks of one block.
/// let row = HostRowLayout::uniform(1, 1, &[BLOCK])?;
/// let gpu = Arc::new(HostBuffer::new((blocks as u64 * BLOCK) as usize)?);
/// let pool = Arc::new(HostBuffer::new(row.pool_bytes(chunks).ok_or("overflow")? as usize)?);
/// let layout = WorkerLayout::new(
///     GpuLayout::cross_layer(gpu.addr(), blocks, BLOCK, BLOCK)?,
///     row,
///     0,
///     pool.addr(),
///     chunks,
/// )?;
/// let mut backend = HostBackend::new(layout, vec![gpu, pool], HostBackendOptions::default())?;
///
/// // Store GPU blocks 2 and 3 into host chunks 0 and 1.
/// let job = JobId(1);
/// backend.submit_store(job, &TransferSpec::new(&[2, 3], 0, &[0, 1]))?;
/// backend.wait(&[job], Some(Duration::from_secs(10)))?;
/// let mut done = Vec::new();
/// backend.poll(&mut done);
/// assert_eq!(done.len(), 1);
/// assert_eq!((done[0].job, done[0].direction), (job, Direction::Store));
/// assert!(done[0].success);
/// assert_eq!(done[0].bytes, 2 * BLOCK);
/// assert_eq!(backend.in_flight(), 0);
/// # Ok(())
/// # }
/// ```
pub trait TransferBackend: Send {
    /// Starts copying the spec's GPU blocks into its host chunks.
    fn submit_store(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError>;

    /// Starts copying the spec's host chunks into its GPU blocks.
    fn submit_load(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError>;

    /// Appends the jobs finished since the last poll to `out`, FIFO per direction.
    fn poll(&mut self, out: &mut Vec<TransferResult>);

    /// Blocks until every named job has finished (unknown ids are ignored), or
    /// until `timeout` (None: no limit). Finished jobs are still reported by `poll`.
    fn wait(&mut self, jobs: &[JobId], timeout: Option<Duration>) -> Result<(), BackendError>;

    /// Jobs submitted and not yet reported by `poll`.
    fn in_flight(&self) -> usize;

    /// Checks `spec` as submitting it would (the same [`BackendError::Spec`]
    /// errors), without submitting anything: a wrapper that holds a job back
    /// (the [`FaultInjector`](super::FaultInjector)) refuses a bad spec when it
    /// is given, as the backend would. The default accepts every spec.
    fn check_spec(&self, spec: &TransferSpec) -> Result<(), BackendError> {
        let _ = spec;
        Ok(())
    }

    /// Where this worker's share of host chunk `chunk` lives in host memory,
    /// for reading it outside a transfer (the remote tier's write-through);
    /// `None` where the backend does not expose its host pool (the default)
    /// or the chunk is out of range.
    fn host_share(&self, chunk: ChunkId) -> Option<HostShare> {
        let _ = chunk;
        None
    }

    /// GPU blocks per host chunk, where the backend exposes its host pool
    /// ([`Self::host_share`]): which chunks a store writes whole
    /// ([`TransferSpec::whole_chunks`]). `None` by default.
    fn blocks_per_chunk(&self) -> Option<u32> {
        None
    }
}

/// A worker's share of one host chunk row: `len` bytes at `addr`.
///
/// Reading it is sound only while no transfer writes it: after the store that
/// filled it has finished and before the worker reports that store (until
/// then the scheduler gives the chunk to no other job).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostShare {
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes of the share.
    pub len: usize,
}
