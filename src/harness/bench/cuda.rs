//! The CUDA sweep: scattered GPU blocks copied to and from a pinned host pool
//! by [`CudaBackend`] jobs, one strategy at a time, against one large pinned
//! `cuMemcpyAsync` measured in the same run (the ceiling). Its fastest
//! strategy per measured point is the calibrated [`StrategyTable`].
//!
//! Compiled everywhere, runs only where a driver and a device are present:
//! without them [`open_device`] returns [`CudaBenchError::Unavailable`].

use crate::Direction;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, sys};
use thiserror::Error;

use crate::ids::JobId;
use crate::worker::cuda::error::driver;
use crate::worker::cuda::{
    CudaBackend, CudaBackendOptions, CudaBackendStats, CudaError, DeviceBuffer, PinnedBuffer,
    Strategy, StrategyRule, StrategyTable, open_context,
};
use crate::worker::{
    BackendError, GpuLayout, HostRowLayout, TransferBackend, TransferSpec, WorkerLayout,
};

use super::BenchRow;

/// Bound on one wait for a measured job.
const JOB_WAIT: Duration = Duration::from_secs(60);

/// What to sweep on the CUDA backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaSweep {
    /// Device ordinal.
    pub device: usize,
    /// Block sizes in bytes.
    pub block_bytes: Vec<u64>,
    /// Blocks per job.
    pub blocks: Vec<u32>,
    /// Directions.
    pub directions: Vec<Direction>,
    /// Strategies (each point is measured with each, forced).
    pub strategies: Vec<Strategy>,
    /// Jobs per (point, strategy); the fastest counts.
    pub reps: u32,
    /// Size of the pinned pool and of the ceiling memcpy; points moving more
    /// bytes per job are skipped.
    pub max_job_bytes: u64,
}

impl Default for CudaSweep {
    /// 4 KiB … 2 MiB per block, 64 … 4096 blocks, both directions, every
    /// strategy, best of 7, a 1 GiB pool and ceiling copy.
    fn default() -> Self {
        Self {
            device: 0,
            block_bytes: vec![
                4 << 10,
                16 << 10,
                32 << 10,
                64 << 10,
                256 << 10,
                1 << 20,
                2 << 20,
            ],
            blocks: vec![64, 256, 1024, 4096],
            directions: Direction::ALL.to_vec(),
            strategies: Strategy::ALL.to_vec(),
            reps: 7,
            max_job_bytes: 1 << 30,
        }
    }
}

impl CudaSweep {
    /// A short sweep (4 sizes, 2 counts, best of 3).
    pub fn quick() -> Self {
        Self {
            block_bytes: vec![4 << 10, 16 << 10, 64 << 10, 2 << 20],
            blocks: vec![64, 1024],
            reps: 3,
            ..Self::default()
        }
    }
}

/// Why the CUDA sweep could not run.
#[derive(Debug, Error)]
pub enum CudaBenchError {
    /// No driver, no device, or the bindings could not start.
    #[error("cuda backend unavailable: {0}")]
    Unavailable(#[source] CudaError),
    /// A driver call failed during the sweep.
    #[error("cuda: {0}")]
    Cuda(#[from] CudaError),
    /// The backend refused a job.
    #[error("cuda backend: {0}")]
    Backend(#[from] BackendError),
    /// A point's layout was rejected.
    #[error("layout: {0}")]
    Layout(#[from] crate::worker::LayoutError),
    /// The sweep's parameters cannot be run.
    #[error("{0}")]
    Options(String),
}

/// One measured (direction, block size, count, strategy) point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaPoint {
    /// Direction.
    pub direction: Direction,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks per job.
    pub blocks: u32,
    /// The strategy forced for this point.
    pub strategy: Strategy,
    /// GB/s over the best job's device time (events).
    pub gbps: f64,
    /// Best host time to submit one job, microseconds.
    pub submit_us: f64,
    /// Best device time of one job, microseconds.
    pub device_us: f64,
}

/// What a CUDA sweep measured.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaSweepOutput {
    /// The device's name.
    pub device: String,
    /// The ceiling per direction (`Direction::index`), GB/s.
    pub ceiling_gbps: [f64; 2],
    /// Every measured point.
    pub points: Vec<CudaPoint>,
    /// The backend's counters per (block size, count) after its jobs.
    pub stats: Vec<(u64, u32, CudaBackendStats)>,
}

impl CudaSweepOutput {
    /// The points as bench rows (`backend = "cuda"`, the strategy's name).
    pub fn rows(&self) -> Vec<BenchRow> {
        self.points
            .iter()
            .map(|p| {
                let ceiling = self.ceiling_gbps[p.direction.index()];
                BenchRow {
                    backend: "cuda".into(),
                    strategy: p.strategy.name().into(),
                    direction: p.direction.to_string(),
                    block_bytes: p.block_bytes,
                    blocks: p.blocks,
                    gbps: p.gbps,
                    ceiling_gbps: ceiling,
                    fraction_of_ceiling: if ceiling > 0.0 { p.gbps / ceiling } else { 0.0 },
                    submit_us: Some(p.submit_us),
                }
            })
            .collect()
    }
}

/// Opens device `ordinal` for a sweep; a missing driver or device is
/// [`CudaBenchError::Unavailable`].
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaBenchError> {
    open_context(ordinal).map_err(CudaBenchError::Unavailable)
}

/// Runs the sweep on `ctx` (from [`open_device`]).
pub fn run_cuda(
    ctx: &Arc<CudaContext>,
    sweep: &CudaSweep,
) -> Result<CudaSweepOutput, CudaBenchError> {
    if sweep.block_bytes.contains(&0) || sweep.blocks.contains(&0) || sweep.reps == 0 {
        return Err(CudaBenchError::Options(
            "block sizes, block counts and reps must be at least 1".into(),
        ));
    }
    let max_job = usize::try_from(sweep.max_job_bytes)
        .map_err(|_| CudaBenchError::Options("max_job_bytes does not fit in memory".into()))?;
    let max_block = sweep.block_bytes.iter().copied().max().unwrap_or(0);
    let dev_len = max_job
        .checked_mul(2)
        .and_then(|d| d.checked_add(usize::try_from(max_block).ok()?))
        .ok_or_else(|| CudaBenchError::Options("device buffer size overflows".into()))?;
    let device = ctx.name().unwrap_or_else(|_| "?".into());
    let pool = PinnedBuffer::host_alloc(ctx, max_job)?;
    let dev = DeviceBuffer::new(ctx, dev_len)?;
    let ceiling_gbps = [
        ceiling_gbps(ctx, &dev, &pool, Direction::Store)?,
        ceiling_gbps(ctx, &dev, &pool, Direction::Load)?,
    ];
    let mut out = CudaSweepOutput {
        device,
        ceiling_gbps,
        points: Vec::new(),
        stats: Vec::new(),
    };
    let mut job = 0u64;
    for &block in &sweep.block_bytes {
        for &count in &sweep.blocks {
            let bytes = block.saturating_mul(u64::from(count));
            // Every other block is copied: 2 × count + 1 blocks on the device.
            let span = block.saturating_mul(2 * u64::from(count) + 1);
            if bytes > sweep.max_job_bytes || span > dev_len as u64 {
                tracing::info!(block, count, "point skipped: larger than the pool");
                continue;
            }
            let row = HostRowLayout::uniform(1, 1, &[block])?;
            let chunks = (sweep.max_job_bytes / row.row_bytes()).min(u64::from(u32::MAX)) as u32;
            if count > chunks {
                tracing::info!(block, count, "point skipped: padded rows exceed the pool");
                continue;
            }
            let gpu = GpuLayout::cross_layer(dev.addr(), 2 * count + 1, block, block)?;
            let layout = WorkerLayout::new(gpu, row, 0, pool.addr(), chunks)?;
            // Scattered (never coalesced) blocks, chunks reversed.
            let blocks: Vec<u32> = (0..count).map(|i| 1 + 2 * i).collect();
            let chunk_ids: Vec<u32> = (0..count).rev().collect();
            let spec = TransferSpec::new(&blocks, 0, &chunk_ids);
            let compute = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            // SAFETY: the layout lies inside `dev` (span checked above) and `pool`
            // (`count ≤ chunks` rows); both outlive the backend, which is dropped
            // (synchronising its streams) at the end of this iteration.
            let mut backend = unsafe {
                CudaBackend::new(ctx.clone(), layout, compute, CudaBackendOptions::default())?
            };
            for &dir in &sweep.directions {
                for &strategy in &sweep.strategies {
                    backend.force_strategy(Some(strategy));
                    if let Some(p) = measure(&mut backend, &spec, dir, sweep.reps, &mut job, bytes)?
                    {
                        out.points.push(CudaPoint {
                            direction: dir,
                            block_bytes: block,
                            blocks: count,
                            strategy,
                            ..p
                        });
                    } else {
                        tracing::warn!(block, count, %dir, strategy = strategy.name(), "no successful job");
                    }
                }
            }
            out.stats.push((block, count, backend.stats().clone()));
        }
    }
    Ok(out)
}

/// Best of `reps` jobs of one (point, strategy); `None` if none succeeded.
fn measure(
    backend: &mut CudaBackend,
    spec: &TransferSpec,
    dir: Direction,
    reps: u32,
    job: &mut u64,
    bytes: u64,
) -> Result<Option<CudaPoint>, CudaBenchError> {
    let mut best_dev = Duration::MAX;
    let mut best_submit = Duration::MAX;
    let mut results = Vec::new();
    for _ in 0..reps {
        *job += 1;
        let id = JobId(*job);
        let t = Instant::now();
        match dir {
            Direction::Store => backend.submit_store(id, spec)?,
            Direction::Load => backend.submit_load(id, spec)?,
        }
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
    Ok(Some(CudaPoint {
        direction: dir,
        block_bytes: 0,
        blocks: 0,
        strategy: Strategy::Dma,
        gbps: bytes as f64 / best_dev.as_secs_f64() / 1e9,
        submit_us: best_submit.as_secs_f64() * 1e6,
        device_us: best_dev.as_secs_f64() * 1e6,
    }))
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

/// The fastest strategy per measured (direction, block size, count), as rules
/// covering the ranges between measured sizes and counts (first match wins);
/// the default table's fallback for anything else.
pub fn calibrated_table(points: &[CudaPoint]) -> StrategyTable {
    let mut sizes: Vec<u64> = points.iter().map(|p| p.block_bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut counts: Vec<u32> = points.iter().map(|p| p.blocks).collect();
    counts.sort_unstable();
    counts.dedup();
    let mut rules = Vec::new();
    for dir in Direction::ALL {
        for (si, &size) in sizes.iter().enumerate() {
            for (ci, &count) in counts.iter().enumerate() {
                let best = points
                    .iter()
                    .filter(|p| {
                        p.direction == dir
                            && p.block_bytes == size
                            && p.blocks == count
                            && p.gbps.is_finite()
                    })
                    .max_by(|a, b| a.gbps.total_cmp(&b.gbps));
                let Some(best) = best else { continue };
                rules.push(StrategyRule {
                    direction: Some(dir),
                    min_bytes_per_descriptor: if si == 0 { 0 } else { size },
                    max_bytes_per_descriptor: sizes.get(si + 1).map(|n| n - 1),
                    min_descriptors: if ci == 0 { 0 } else { count as usize },
                    max_descriptors: counts.get(ci + 1).map(|&n| n as usize - 1),
                    strategy: best.strategy,
                });
            }
        }
    }
    StrategyTable {
        rules,
        fallback: StrategyTable::default().fallback,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(
        direction: Direction,
        block_bytes: u64,
        blocks: u32,
        strategy: Strategy,
        gbps: f64,
    ) -> CudaPoint {
        CudaPoint {
            direction,
            block_bytes,
            blocks,
            strategy,
            gbps,
            submit_us: 1.0,
            device_us: 1.0,
        }
    }

    #[test]
    fn calibrated_table_picks_the_fastest_strategy_per_point() {
        use Direction::{Load, Store};
        use Strategy::{BatchDma, Dma, Kernel, KernelGraph};
        let points = [
            p(Store, 4096, 64, Dma, 1.0),
            p(Store, 4096, 64, KernelGraph, 9.0),
            p(Store, 4096, 1024, Kernel, 20.0),
            p(Store, 4096, 1024, Dma, 2.0),
            p(Store, 1 << 20, 64, BatchDma, 50.0),
            p(Store, 1 << 20, 64, Kernel, f64::NAN),
            p(Store, 1 << 20, 1024, BatchDma, 52.0),
            p(Load, 4096, 64, Dma, 3.0),
        ];
        let t = calibrated_table(&points);
        // Measured points and the ranges between them.
        assert_eq!(t.choose(Store, 4096, 64), KernelGraph);
        assert_eq!(
            t.choose(Store, 100, 8),
            KernelGraph,
            "below the smallest point"
        );
        assert_eq!(t.choose(Store, 8192, 1023), KernelGraph);
        assert_eq!(
            t.choose(Store, 4096, 5000),
            Kernel,
            "above the largest count"
        );
        assert_eq!(t.choose(Store, 2 << 20, 64), BatchDma);
        assert_eq!(t.choose(Store, 1 << 20, 1024), BatchDma);
        assert_eq!(t.choose(Load, 4096, 64), Dma);
        // Unmeasured (load, 1 MiB): the fallback.
        assert_eq!(
            t.choose(Load, 1 << 20, 64),
            StrategyTable::default().fallback
        );
        assert!(t.validate().is_ok());
        assert!(calibrated_table(&[]).rules.is_empty());
    }

    #[test]
    fn rows_carry_the_same_run_ceiling() {
        let out = CudaSweepOutput {
            device: "x".into(),
            ceiling_gbps: [50.0, 40.0],
            points: vec![
                p(Direction::Store, 4096, 64, Strategy::Kernel, 25.0),
                p(Direction::Load, 4096, 64, Strategy::Dma, 10.0),
            ],
            stats: Vec::new(),
        };
        let rows = out.rows();
        assert_eq!(rows[0].backend, "cuda");
        assert_eq!(rows[0].strategy, "kernel");
        assert_eq!(rows[0].direction, "store");
        assert_eq!(rows[0].fraction_of_ceiling, 0.5);
        assert_eq!(rows[1].ceiling_gbps, 40.0);
        assert_eq!(rows[1].fraction_of_ceiling, 0.25);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn without_a_driver_the_sweep_is_unavailable_not_a_panic() {
        match open_device(0) {
            Ok(_) => println!("SKIP: a CUDA device is present"),
            Err(e) => {
                assert!(matches!(e, CudaBenchError::Unavailable(_)), "{e}");
                assert!(
                    e.to_string().starts_with("cuda backend unavailable: "),
                    "{e}"
                );
            }
        }
    }
}
