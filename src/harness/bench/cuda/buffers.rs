//! The sweep's device buffer and pinned pool, and the byte check of a
//! point's jobs over them ([`super::verify`]'s patterns).

use crate::Direction;
use crate::worker::cuda::{CudaError, DeviceBuffer, PinnedBuffer};
use crate::worker::{DescriptorTable, TransferSpec, WorkerLayout, plan_descriptors};

use super::CudaBenchError;
use super::verify;

/// The buffers of a sweep, and the byte check of a point's jobs.
pub(super) struct Buffers {
    pub(super) pool: PinnedBuffer,
    pub(super) dev: DeviceBuffer,
}

impl Buffers {
    /// Fills the source side of `dir` with its pattern (device bytes
    /// `[0, dev_bytes)` for stores, pool bytes `[0, pool_bytes)` for loads).
    pub(super) fn fill_source(
        &self,
        dir: Direction,
        dev_bytes: usize,
        pool_bytes: usize,
    ) -> Result<(), CudaError> {
        match dir {
            Direction::Store => self
                .dev
                .upload(0, &verify::pattern(verify::GPU_SEED, dev_bytes)),
            Direction::Load => {
                // SAFETY: no job is in flight (the caller's backend has
                // waited for every job); `pool_bytes ≤ pool.len()`.
                unsafe {
                    self.pool
                        .write(0, &verify::pattern(verify::POOL_SEED, pool_bytes))
                };
                Ok(())
            }
        }
    }

    /// Clears the destination side of `dir`, so that a job that copies
    /// nothing fails its check.
    pub(super) fn clear_destination(
        &self,
        dir: Direction,
        dev_bytes: usize,
        pool_bytes: usize,
    ) -> Result<(), CudaError> {
        match dir {
            Direction::Store => {
                // SAFETY: no job is in flight; the pool holds `pool_bytes`
                // (≤ its length) of pinned, host-writable memory.
                unsafe { std::ptr::write_bytes(self.pool.addr() as *mut u8, 0, pool_bytes) };
                Ok(())
            }
            // Waits for the memset: the jobs' non-blocking streams would not.
            Direction::Load => self.dev.fill(0, dev_bytes),
        }
    }

    /// Checks the bytes of `spec`'s job in `dir` against the source's
    /// pattern: the bytes verified, or the mismatch described.
    pub(super) fn check(
        &self,
        layout: &WorkerLayout,
        dir: Direction,
        spec: &TransferSpec,
        dev_bytes: usize,
        pool_bytes: usize,
    ) -> Result<Result<u64, String>, CudaBenchError> {
        let mut table = DescriptorTable::default();
        plan_descriptors(layout, dir, spec, &mut table)?;
        let result = match dir {
            Direction::Store => {
                let base = self.pool.addr();
                verify::check_descriptors(&table.descs, self.dev.addr(), verify::GPU_SEED, |d| {
                    let off = d.dst.checked_sub(base)?;
                    if off.checked_add(d.bytes)? > pool_bytes as u64 {
                        return None;
                    }
                    // SAFETY: the range lies in the pinned pool (checked
                    // above), which outlives this call; no job is in flight.
                    Some(unsafe {
                        std::slice::from_raw_parts(d.dst as *const u8, d.bytes as usize)
                    })
                })
            }
            Direction::Load => {
                let dev = self.dev.download(0, dev_bytes)?;
                let base = self.dev.addr();
                verify::check_descriptors(&table.descs, self.pool.addr(), verify::POOL_SEED, |d| {
                    let off = usize::try_from(d.dst.checked_sub(base)?).ok()?;
                    dev.get(off..off.checked_add(usize::try_from(d.bytes).ok()?)?)
                })
            }
        };
        Ok(result.map_err(|m| m.to_string()))
    }
}
