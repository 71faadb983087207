//! Timing one point's jobs: best of a few one at a time, pipelined through
//! a ring, beside a compute train; and the same run's ceiling (one large
//! pinned memcpy).

use crate::Direction;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, sys};

use crate::ids::JobId;
use crate::worker::cuda::error::driver;
use crate::worker::cuda::{CudaBackend, CudaError, DeviceBuffer, PinnedBuffer, Strategy};
use crate::worker::{BackendError, TransferBackend, TransferSpec};

use super::CudaBenchError;
use super::contention::{Burn, slowdown};
use super::geometry::Geometry;
use super::point::CudaPoint;
use super::sweep::PIPELINE;

/// Bound on one wait for a measured job.
pub(super) const JOB_WAIT: Duration = Duration::from_secs(60);
/// Bound on contended jobs per measurement (a train that never ends).
const MAX_CONTENDED_JOBS: u32 = 10_000;

pub(super) fn submit(
    backend: &mut CudaBackend,
    dir: Direction,
    id: JobId,
    spec: &TransferSpec,
) -> Result<(), BackendError> {
    match dir {
        Direction::Store => backend.submit_store(id, spec),
        Direction::Load => backend.submit_load(id, spec),
    }
}

/// Best of `reps` jobs of one (point, strategy); `None` if none succeeded.
pub(super) fn measure(
    backend: &mut CudaBackend,
    spec: &TransferSpec,
    dir: Direction,
    reps: u32,
    job: &mut u64,
    g: Geometry,
) -> Result<Option<CudaPoint>, CudaBenchError> {
    let bytes = g.block * u64::from(g.count);
    let mut best_dev = Duration::MAX;
    let mut best_submit = Duration::MAX;
    let mut results = Vec::new();
    for _ in 0..reps {
        *job += 1;
        let id = JobId(*job);
        let t = Instant::now();
        submit(backend, dir, id, spec)?;
        best_submit = best_submit.min(t.elapsed());
        backend.wait(&[id], Some(JOB_WAIT))?;
        results.clear();
        backend.poll(&mut results);
        for r in results.iter().filter(|r| r.success) {
            best_dev = best_dev.min(r.duration);
        }
    }
    if best_dev == Duration::MAX || best_dev.is_zero() {
        return Ok(None);
    }
    Ok(Some(CudaPoint::measured(
        dir,
        g,
        Strategy::Dma,
        bytes as f64 / best_dev.as_secs_f64() / 1e9,
        best_submit.as_secs_f64() * 1e6,
        best_dev.as_secs_f64() * 1e6,
    )))
}

/// [`PIPELINE`] jobs submitted back to back, then waited for: GB/s over
/// their wall time; `None` if none succeeded.
pub(super) fn measure_pipelined(
    backend: &mut CudaBackend,
    spec: &TransferSpec,
    dir: Direction,
    job: &mut u64,
    g: Geometry,
) -> Result<Option<CudaPoint>, CudaBenchError> {
    let bytes = g.block * u64::from(g.count);
    let mut ids = Vec::with_capacity(PIPELINE as usize);
    let mut submit_time = Duration::ZERO;
    let t = Instant::now();
    for _ in 0..PIPELINE {
        *job += 1;
        let id = JobId(*job);
        let s = Instant::now();
        submit(backend, dir, id, spec)?;
        submit_time += s.elapsed();
        ids.push(id);
    }
    backend.wait(&ids, Some(JOB_WAIT))?;
    let wall = t.elapsed();
    let mut results = Vec::new();
    backend.poll(&mut results);
    let ok = results.iter().filter(|r| r.success).count() as u64;
    if ok == 0 || wall.is_zero() {
        return Ok(None);
    }
    Ok(Some(CudaPoint::measured(
        dir,
        g,
        Strategy::KernelGraph,
        (ok * bytes) as f64 / wall.as_secs_f64() / 1e9,
        submit_time.as_secs_f64() * 1e6 / f64::from(PIPELINE),
        wall.as_secs_f64() * 1e6 / f64::from(PIPELINE),
    )))
}

/// Jobs one after another while a compute train runs (timed alone just
/// before): the copies' GB/s over their device time (`None` if none
/// succeeded) and the train's slowdown.
pub(super) fn measure_contended(
    backend: &mut CudaBackend,
    spec: &TransferSpec,
    dir: Direction,
    job: &mut u64,
    g: Geometry,
    burn: &Burn,
) -> Result<(Option<f64>, f64), CudaBenchError> {
    let bytes = g.block * u64::from(g.count);
    let alone = burn.time_alone_us()?;
    burn.start()?;
    let mut moved = 0u64;
    let mut device = Duration::ZERO;
    let mut results = Vec::new();
    for _ in 0..MAX_CONTENDED_JOBS {
        *job += 1;
        let id = JobId(*job);
        submit(backend, dir, id, spec)?;
        backend.wait(&[id], Some(JOB_WAIT))?;
        results.clear();
        backend.poll(&mut results);
        for r in results.iter().filter(|r| r.success) {
            moved += bytes;
            device += r.duration;
        }
        if burn.done()? {
            break;
        }
    }
    let with = burn.finish_us()?;
    let gbps = (!device.is_zero()).then(|| moved as f64 / device.as_secs_f64() / 1e9);
    Ok((gbps, slowdown(alone, with)))
}

/// GB/s of one copy of the whole pinned pool to or from the device (best of
/// 3), timed with events: the ceiling of this run.
pub fn ceiling_gbps(
    ctx: &Arc<CudaContext>,
    dev: &DeviceBuffer,
    pool: &PinnedBuffer,
    dir: Direction,
) -> Result<f64, CudaError> {
    ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
    let bytes = pool.len().min(dev.len());
    let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = ctx.new_event(flags).map_err(driver("cuEventCreate"))?;
    let e1 = ctx.new_event(flags).map_err(driver("cuEventCreate"))?;
    let mut best = 0f64;
    for _ in 0..3 {
        e0.record(&stream).map_err(driver("cuEventRecord"))?;
        let (dst, src) = match dir {
            Direction::Store => (pool.addr(), dev.addr()),
            Direction::Load => (dev.addr(), pool.addr()),
        };
        // SAFETY: both buffers hold at least `bytes` and live past the
        // synchronisation below (`elapsed_ms` waits for `e1`).
        let r = unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream.cu_stream()) };
        r.result().map_err(driver("cuMemcpyAsync"))?;
        e1.record(&stream).map_err(driver("cuEventRecord"))?;
        e1.synchronize().map_err(driver("cuEventSynchronize"))?;
        let ms = e0.elapsed_ms(&e1).map_err(driver("cuEventElapsedTime"))?;
        if ms > 0.0 {
            best = best.max(bytes as f64 / (f64::from(ms) / 1e3) / 1e9);
        }
    }
    Ok(best)
}
