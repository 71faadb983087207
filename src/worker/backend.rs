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
