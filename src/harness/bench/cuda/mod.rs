//! The CUDA sweep: scattered GPU blocks copied to and from a pinned host pool
//! by [`CudaBackend`] jobs, one strategy at a time, against one large pinned
//! `cuMemcpyAsync` measured in the same run (the ceiling). Its fastest
//! strategy per measured point is the calibrated [`StrategyTable`]
//! ([`calibrated_table`]). Every job's bytes are checked against a pattern
//! ([`verify`]); with `contend`, each strategy also runs beside a train of
//! compute kernels ([`contention`]) to measure what it costs the model.
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
    CudaBackend, CudaBackendOptions, CudaBackendStats, CudaError, DeviceBuffer, LaunchShape,
    PinnedBuffer, Strategy, open_context,
};
use crate::worker::{
    BackendError, DescriptorTable, GpuLayout, HostRowLayout, TransferBackend, TransferSpec,
    WorkerLayout, plan_descriptors,
};

use super::BenchRow;

mod calibrate;
mod contention;
mod swap;
mod tune;
mod verify;

pub use calibrate::{CalibrationPolicy, calibrated_table};
use contention::{Burn, slowdown};
pub use swap::{SwapReport, check_table_swap};

/// Bound on one wait for a measured job.
const JOB_WAIT: Duration = Duration::from_secs(60);
/// One burn launch under `contend`, microseconds (a model kernel's order).
const BURN_KERNEL_US: f64 = 50.0;
/// Burn launches per contended measurement (about 10 ms of compute).
const BURN_LAUNCHES: u32 = 200;
/// Bound on contended jobs per measurement (a train that never ends).
const MAX_CONTENDED_JOBS: u32 = 10_000;
/// Jobs in flight together in a ring-depth measurement.
pub const PIPELINE: u32 = 16;
/// The ring depths `--sweep-ring` measures.
pub const STANDARD_RING_DEPTHS: [usize; 4] = [2, 4, 8, 16];

/// A kernel launch shape other than the default, measured with the
/// `kernel` strategy (`--sweep-launch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchVariant {
    /// CTAs of the copy kernel's grid.
    pub ctas: u32,
    /// Largest piece a descriptor is split into (`kernel_split_bytes`).
    pub max_piece_bytes: u64,
}

impl LaunchVariant {
    /// `ctas=N,piece=BYTES`.
    pub fn label(&self) -> String {
        format!("ctas={},piece={}", self.ctas, self.max_piece_bytes)
    }

    /// The variants `--sweep-launch` measures: 4 … 64 CTAs, 16 … 256 KiB
    /// pieces.
    pub fn standard() -> Vec<Self> {
        let mut v = Vec::new();
        for ctas in [4, 16, 32, 64] {
            for max_piece_bytes in [16 << 10, 64 << 10, 256 << 10] {
                v.push(Self {
                    ctas,
                    max_piece_bytes,
                });
            }
        }
        v
    }
}

/// What to sweep on the CUDA backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaSweep {
    /// Device ordinal.
    pub device: usize,
    /// Block sizes in bytes.
    pub block_bytes: Vec<u64>,
    /// Blocks per job.
    pub blocks: Vec<u32>,
    /// Tensors a block is split over: 1 is a cross-layer cache (one
    /// descriptor per block), `n` a per-layer cache of `n` tensors (`n`
    /// descriptors of `block_bytes / n` per block).
    pub tensors: Vec<u32>,
    /// Directions.
    pub directions: Vec<Direction>,
    /// Strategies (each point is measured with each, forced).
    pub strategies: Vec<Strategy>,
    /// Jobs per (point, strategy); the fastest counts.
    pub reps: u32,
    /// Size of the pinned pool and of the ceiling memcpy; points moving more
    /// bytes per job are skipped.
    pub max_job_bytes: u64,
    /// Points with more descriptors per job are skipped (per-run DMA of
    /// very many descriptors only measures the driver's call cost).
    pub max_descriptors: u64,
    /// Check every job's bytes against a pattern (the strategy's last job
    /// per point).
    pub verify: bool,
    /// Also measure each strategy beside a train of compute kernels: the
    /// copies' rate under contention and the model's slowdown.
    pub contend: bool,
    /// Other kernel launch shapes, measured with the `kernel` strategy on
    /// cross-layer points of at most 1,024 blocks.
    pub launches: Vec<LaunchVariant>,
    /// Also measure `batch_dma` with the driver asked to overlap the copies
    /// with compute (`CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`), on the
    /// same points as `launches`.
    pub batch_prefer_overlap: bool,
    /// Descriptor-table ring depths to measure with `kernel_graph` jobs
    /// pipelined ([`PIPELINE`] in flight before the first is waited for),
    /// on the same points as `launches`.
    pub ring_depths: Vec<usize>,
}

impl Default for CudaSweep {
    /// 4 KiB … 2 MiB per block, 64 … 4096 blocks, cross-layer and 16
    /// tensors per block, both directions, every strategy, best of 7, a 1 GiB
    /// pool and ceiling copy, bytes verified, no contention, no other shapes.
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
            tensors: vec![1, 16],
            directions: Direction::ALL.to_vec(),
            strategies: Strategy::ALL.to_vec(),
            reps: 7,
            max_job_bytes: 1 << 30,
            max_descriptors: 16_384,
            verify: true,
            contend: false,
            launches: Vec::new(),
            batch_prefer_overlap: false,
            ring_depths: Vec::new(),
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
    /// A job's descriptors could not be planned for the byte check.
    #[error("planning a job for its byte check: {0}")]
    Plan(#[from] crate::worker::SpecError),
    /// The sweep's parameters cannot be run.
    #[error("{0}")]
    Options(String),
}

/// One measured (direction, block size, count, tensors, strategy) point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaPoint {
    /// Direction.
    pub direction: Direction,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks per job.
    pub blocks: u32,
    /// Tensors per block (1: cross-layer).
    pub tensors: u32,
    /// The strategy forced for this point.
    pub strategy: Strategy,
    /// GB/s over the best job's device time (events).
    pub gbps: f64,
    /// Best host time to submit one job, microseconds.
    pub submit_us: f64,
    /// Best device time of one job, microseconds.
    pub device_us: f64,
    /// Bytes of the last job compared with the pattern and found equal
    /// (`None`: not checked).
    pub verified_bytes: Option<u64>,
    /// GB/s (all jobs' bytes over their device time) beside the compute
    /// train (`None`: not measured).
    pub contended_gbps: Option<f64>,
    /// The compute train's slowdown while the copies ran (0.1: 10 % longer).
    pub compute_slowdown: Option<f64>,
    /// The kernel launch shape, where not the default.
    pub launch: Option<LaunchVariant>,
    /// Measured with `batch_prefer_overlap` on (batch DMA only).
    pub prefer_overlap: bool,
    /// Measured pipelined with this ring depth (and the staging waits the
    /// jobs met): GB/s is then [`PIPELINE`] jobs' bytes over their wall time.
    pub ring: Option<(u32, u64)>,
}

impl CudaPoint {
    /// A point of `strategy` at `g` with the backend's default options and
    /// only its rates measured (the variants, checks and contention are set
    /// by the caller).
    fn measured(
        direction: Direction,
        g: Geometry,
        strategy: Strategy,
        gbps: f64,
        submit_us: f64,
        device_us: f64,
    ) -> Self {
        Self {
            direction,
            block_bytes: g.block,
            blocks: g.count,
            tensors: g.tensors,
            strategy,
            gbps,
            submit_us,
            device_us,
            verified_bytes: None,
            contended_gbps: None,
            compute_slowdown: None,
            launch: None,
            prefer_overlap: false,
            ring: None,
        }
    }
}

/// A point for the unit tests: `blocks` blocks of `block_bytes`, cross-layer,
/// 1 µs per submit and job.
#[cfg(test)]
pub(super) fn test_point(
    direction: Direction,
    block_bytes: u64,
    blocks: u32,
    strategy: Strategy,
    gbps: f64,
) -> CudaPoint {
    let g = Geometry {
        block: block_bytes,
        count: blocks,
        tensors: 1,
        page: block_bytes,
        tensor_span: block_bytes * (2 * u64::from(blocks) + 1),
    };
    CudaPoint::measured(direction, g, strategy, gbps, 1.0, 1.0)
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
    /// The backend's counters per (block size, count, tensors) after its jobs.
    pub stats: Vec<(u64, u32, u32, CudaBackendStats)>,
    /// Jobs whose bytes differed from the pattern, described (empty: all
    /// checked jobs were right).
    pub mismatches: Vec<String>,
    /// Whether contention was measured (`false` where it was asked for but
    /// the burn kernel was not built).
    pub contended: bool,
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
                    tensors: Some(p.tensors),
                    verified_bytes: p.verified_bytes,
                    contended_gbps: p.contended_gbps,
                    compute_slowdown: p.compute_slowdown,
                    launch: match (p.ring, p.prefer_overlap) {
                        (Some((depth, waits)), _) => Some(format!(
                            "ring={depth},pipelined={PIPELINE},staging_waits={waits}"
                        )),
                        (None, true) => Some("prefer_overlap".into()),
                        (None, false) => p.launch.map(|l| l.label()),
                    },
                }
            })
            .collect()
    }

    /// Per (direction, block size, count), the launch shape (default or a
    /// variant) whose `kernel` job was fastest, where variants were measured.
    pub fn best_launches(&self) -> Vec<(Direction, u64, u32, Option<LaunchVariant>, f64)> {
        let mut out: Vec<(Direction, u64, u32, Option<LaunchVariant>, f64)> = Vec::new();
        for p in self
            .points
            .iter()
            .filter(|p| p.strategy == Strategy::Kernel && p.tensors == 1 && p.gbps.is_finite())
        {
            let measured_variants = self.points.iter().any(|q| {
                q.launch.is_some()
                    && q.direction == p.direction
                    && q.block_bytes == p.block_bytes
                    && q.blocks == p.blocks
            });
            if !measured_variants {
                continue;
            }
            match out
                .iter_mut()
                .find(|o| o.0 == p.direction && o.1 == p.block_bytes && o.2 == p.blocks)
            {
                Some(o) if o.4 >= p.gbps => {}
                Some(o) => {
                    o.3 = p.launch;
                    o.4 = p.gbps;
                }
                None => out.push((p.direction, p.block_bytes, p.blocks, p.launch, p.gbps)),
            }
        }
        out
    }
}

/// Opens device `ordinal` for a sweep; a missing driver or device is
/// [`CudaBenchError::Unavailable`].
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaBenchError> {
    open_context(ordinal).map_err(CudaBenchError::Unavailable)
}

/// One point's geometry: block size, count and tensors, or why it is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    block: u64,
    count: u32,
    tensors: u32,
    /// Bytes of one tensor's page of a block.
    page: u64,
    /// Device bytes of one tensor's region (every other block is copied:
    /// 2 × count + 1 pages).
    tensor_span: u64,
}

impl Geometry {
    fn new(
        block: u64,
        count: u32,
        tensors: u32,
        sweep: &CudaSweep,
        dev_len: u64,
    ) -> Result<Self, &'static str> {
        let tensors = tensors.max(1);
        if !block.is_multiple_of(u64::from(tensors)) {
            return Err("block size not a multiple of the tensors");
        }
        let page = block / u64::from(tensors);
        if page < 16 {
            return Err("pages under 16 bytes");
        }
        if block.saturating_mul(u64::from(count)) > sweep.max_job_bytes {
            return Err("larger than the pool");
        }
        if u64::from(count) * u64::from(tensors) > sweep.max_descriptors {
            return Err("more descriptors than max_descriptors");
        }
        let tensor_span = page.saturating_mul(2 * u64::from(count) + 1);
        if tensor_span.saturating_mul(u64::from(tensors)) > dev_len {
            return Err("larger than the device buffer");
        }
        Ok(Self {
            block,
            count,
            tensors,
            page,
            tensor_span,
        })
    }

    fn device_bytes(&self) -> u64 {
        self.tensor_span * u64::from(self.tensors)
    }

    fn gpu_layout(&self, base: u64) -> Result<GpuLayout, crate::worker::LayoutError> {
        let blocks = 2 * self.count + 1;
        if self.tensors == 1 {
            GpuLayout::cross_layer(base, blocks, self.block, self.block)
        } else {
            let bases: Vec<u64> = (0..u64::from(self.tensors))
                .map(|t| base + t * self.tensor_span)
                .collect();
            GpuLayout::per_layer(&bases, blocks, self.page, self.page)
        }
    }
}

/// The buffers of a sweep, and the byte check of a point's jobs.
struct Buffers {
    pool: PinnedBuffer,
    dev: DeviceBuffer,
}

impl Buffers {
    /// Fills the source side of `dir` with its pattern (device bytes
    /// `[0, dev_bytes)` for stores, pool bytes `[0, pool_bytes)` for loads).
    fn fill_source(
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
    fn clear_destination(
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
    fn check(
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

/// Runs the sweep on `ctx` (from [`open_device`]).
pub fn run_cuda(
    ctx: &Arc<CudaContext>,
    sweep: &CudaSweep,
) -> Result<CudaSweepOutput, CudaBenchError> {
    if sweep.block_bytes.contains(&0)
        || sweep.blocks.contains(&0)
        || sweep.tensors.contains(&0)
        || sweep.reps == 0
    {
        return Err(CudaBenchError::Options(
            "block sizes, block counts, tensors and reps must be at least 1".into(),
        ));
    }
    if sweep
        .launches
        .iter()
        .any(|l| l.ctas == 0 || l.max_piece_bytes < 16)
    {
        return Err(CudaBenchError::Options(
            "a launch variant needs at least 1 CTA and 16-byte pieces".into(),
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
    let bufs = Buffers {
        pool: PinnedBuffer::host_alloc(ctx, max_job)?,
        dev: DeviceBuffer::new(ctx, dev_len)?,
    };
    let ceiling_gbps = [
        ceiling_gbps(ctx, &bufs.dev, &bufs.pool, Direction::Store)?,
        ceiling_gbps(ctx, &bufs.dev, &bufs.pool, Direction::Load)?,
    ];
    let burn = if sweep.contend {
        let b = Burn::new(ctx, BURN_KERNEL_US, BURN_LAUNCHES)?;
        if b.is_none() {
            tracing::warn!("contention asked for, but the kernels were not built: not measured");
        }
        b
    } else {
        None
    };
    let mut out = CudaSweepOutput {
        device,
        ceiling_gbps,
        points: Vec::new(),
        stats: Vec::new(),
        mismatches: Vec::new(),
        contended: burn.is_some(),
    };
    let mut job = 0u64;
    for &tensors in &sweep.tensors {
        for &block in &sweep.block_bytes {
            for &count in &sweep.blocks {
                let g = match Geometry::new(block, count, tensors, sweep, dev_len as u64) {
                    Ok(g) => g,
                    Err(why) => {
                        tracing::info!(block, count, tensors, why, "point skipped");
                        continue;
                    }
                };
                let mut point = PointRun {
                    ctx,
                    sweep,
                    bufs: &bufs,
                    burn: burn.as_ref(),
                    g,
                    job: &mut job,
                    out: &mut out,
                };
                point.run()?;
            }
        }
    }
    Ok(out)
}

/// One (block size, count, tensors) point: its layout, its backends (the
/// default options, then each launch variant), every strategy measured.
struct PointRun<'a> {
    ctx: &'a Arc<CudaContext>,
    sweep: &'a CudaSweep,
    bufs: &'a Buffers,
    burn: Option<&'a Burn>,
    g: Geometry,
    job: &'a mut u64,
    out: &'a mut CudaSweepOutput,
}

impl PointRun<'_> {
    fn run(&mut self) -> Result<(), CudaBenchError> {
        let g = self.g;
        let row = HostRowLayout::uniform(1, 1, &vec![g.page; g.tensors as usize])?;
        let chunks = (self.sweep.max_job_bytes / row.row_bytes()).min(u64::from(u32::MAX)) as u32;
        if g.count > chunks {
            tracing::info!(
                g.block,
                g.count,
                g.tensors,
                "point skipped: padded rows exceed the pool"
            );
            return Ok(());
        }
        let layout = WorkerLayout::new(
            g.gpu_layout(self.bufs.dev.addr())?,
            row.clone(),
            0,
            self.bufs.pool.addr(),
            chunks,
        )?;
        // Scattered (never coalesced) blocks, chunks reversed.
        let blocks: Vec<u32> = (0..g.count).map(|i| 1 + 2 * i).collect();
        let chunk_ids: Vec<u32> = (0..g.count).rev().collect();
        let spec = TransferSpec::new(&blocks, 0, &chunk_ids);
        let dev_bytes = g.device_bytes() as usize;
        let pool_bytes = (row.row_bytes() * u64::from(g.count)) as usize;
        // (kernel launch shape, prefer overlap): the defaults, then variants.
        let mut variants: Vec<(Option<LaunchVariant>, bool)> = vec![(None, false)];
        if g.tensors == 1 && g.count <= 1024 {
            variants.extend(self.sweep.launches.iter().map(|&l| (Some(l), false)));
            if self.sweep.batch_prefer_overlap {
                variants.push((None, true));
            }
        }
        for (variant, prefer_overlap) in variants {
            let mut options = CudaBackendOptions {
                batch_prefer_overlap: prefer_overlap,
                ..CudaBackendOptions::default()
            };
            if let Some(v) = variant {
                options.shape = LaunchShape {
                    ctas: v.ctas,
                    ..LaunchShape::default()
                };
                options.kernel_split_bytes = v.max_piece_bytes;
            }
            let compute = self.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
            // SAFETY: the layout lies inside `dev` (`Geometry::new` checked
            // the span) and `pool` (`count ≤ chunks` rows); both outlive the
            // backend, which is dropped (synchronising its streams) at the end
            // of this iteration.
            let mut backend =
                unsafe { CudaBackend::new(self.ctx.clone(), layout.clone(), compute, options)? };
            let strategies: Vec<Strategy> = if variant.is_some() {
                vec![Strategy::Kernel]
            } else if prefer_overlap {
                vec![Strategy::BatchDma]
            } else {
                self.sweep.strategies.clone()
            };
            for &dir in &self.sweep.directions {
                if self.sweep.verify {
                    self.bufs.fill_source(dir, dev_bytes, pool_bytes)?;
                }
                for &strategy in &strategies {
                    backend.force_strategy(Some(strategy));
                    if self.sweep.verify {
                        self.bufs.clear_destination(dir, dev_bytes, pool_bytes)?;
                    }
                    let Some(mut p) =
                        measure(&mut backend, &spec, dir, self.sweep.reps, self.job, g)?
                    else {
                        tracing::warn!(g.block, g.count, g.tensors, %dir, strategy = strategy.name(), "no successful job");
                        continue;
                    };
                    p.strategy = strategy;
                    p.launch = variant;
                    p.prefer_overlap = prefer_overlap;
                    if self.sweep.verify {
                        match self
                            .bufs
                            .check(&layout, dir, &spec, dev_bytes, pool_bytes)?
                        {
                            Ok(n) => p.verified_bytes = Some(n),
                            Err(why) => {
                                let what = format!(
                                    "{dir} {} B x {} blocks, {} tensors, {}{}: {why}",
                                    g.block,
                                    g.count,
                                    g.tensors,
                                    strategy.name(),
                                    match (variant, prefer_overlap) {
                                        (Some(v), _) => format!(" ({})", v.label()),
                                        (None, true) => " (prefer_overlap)".into(),
                                        (None, false) => String::new(),
                                    }
                                );
                                tracing::error!(%what, "copied bytes differ from the source");
                                self.out.mismatches.push(what);
                            }
                        }
                    }
                    if let Some(burn) = self.burn {
                        let (gbps, slow) =
                            measure_contended(&mut backend, &spec, dir, self.job, g, burn)?;
                        p.contended_gbps = gbps;
                        p.compute_slowdown = Some(slow);
                    }
                    self.out.points.push(p);
                }
            }
            if variant.is_none() && !prefer_overlap {
                self.out
                    .stats
                    .push((g.block, g.count, g.tensors, backend.stats().clone()));
            }
        }
        if g.tensors == 1 && g.count <= 1024 {
            for &depth in &self.sweep.ring_depths {
                self.run_ring(&layout, &spec, depth, dev_bytes, pool_bytes)?;
            }
        }
        Ok(())
    }

    /// `kernel_graph` jobs pipelined through a ring of `depth` tables.
    fn run_ring(
        &mut self,
        layout: &WorkerLayout,
        spec: &TransferSpec,
        depth: usize,
        dev_bytes: usize,
        pool_bytes: usize,
    ) -> Result<(), CudaBenchError> {
        let g = self.g;
        let options = CudaBackendOptions {
            ring_slots: depth.max(1),
            ..CudaBackendOptions::default()
        };
        let compute = self.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        // SAFETY: as in `run`: the layout lies inside the sweep's buffers,
        // which outlive this backend (dropped, synchronising, on return).
        let mut backend =
            unsafe { CudaBackend::new(self.ctx.clone(), layout.clone(), compute, options)? };
        backend.force_strategy(Some(Strategy::KernelGraph));
        for &dir in &self.sweep.directions {
            if self.sweep.verify {
                self.bufs.fill_source(dir, dev_bytes, pool_bytes)?;
                self.bufs.clear_destination(dir, dev_bytes, pool_bytes)?;
            }
            let waits = backend.stats().staging_waits;
            let Some(mut p) = measure_pipelined(&mut backend, spec, dir, self.job, g)? else {
                tracing::warn!(g.block, g.count, depth, %dir, "no successful pipelined job");
                continue;
            };
            p.strategy = Strategy::KernelGraph;
            p.ring = Some((depth as u32, backend.stats().staging_waits - waits));
            if self.sweep.verify {
                match self.bufs.check(layout, dir, spec, dev_bytes, pool_bytes)? {
                    Ok(n) => p.verified_bytes = Some(n),
                    Err(why) => self.out.mismatches.push(format!(
                        "{dir} {} B x {} blocks, kernel_graph pipelined (ring={depth}): {why}",
                        g.block, g.count
                    )),
                }
            }
            self.out.points.push(p);
        }
        Ok(())
    }
}

fn submit(
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
fn measure(
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
fn measure_pipelined(
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
fn measure_contended(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn point(direction: Direction, strategy: Strategy, gbps: f64) -> CudaPoint {
        CudaPoint {
            verified_bytes: Some(4096 * 64),
            ..test_point(direction, 4096, 64, strategy, gbps)
        }
    }

    #[test]
    fn rows_carry_the_same_run_ceiling_and_the_checked_bytes() {
        let mut contended = point(Direction::Load, Strategy::Dma, 10.0);
        contended.contended_gbps = Some(8.0);
        contended.compute_slowdown = Some(0.02);
        contended.launch = Some(LaunchVariant {
            ctas: 16,
            max_piece_bytes: 65536,
        });
        let mut overlapped = point(Direction::Store, Strategy::BatchDma, 30.0);
        overlapped.prefer_overlap = true;
        let mut ring = point(Direction::Load, Strategy::KernelGraph, 35.0);
        ring.ring = Some((8, 2));
        let out = CudaSweepOutput {
            device: "x".into(),
            ceiling_gbps: [50.0, 40.0],
            points: vec![
                point(Direction::Store, Strategy::Kernel, 25.0),
                contended,
                overlapped,
                ring,
            ],
            stats: Vec::new(),
            mismatches: Vec::new(),
            contended: true,
        };
        let rows = out.rows();
        assert_eq!(rows[0].backend, "cuda");
        assert_eq!(rows[0].strategy, "kernel");
        assert_eq!(rows[0].direction, "store");
        assert_eq!(rows[0].fraction_of_ceiling, 0.5);
        assert_eq!(rows[0].verified_bytes, Some(4096 * 64));
        assert_eq!(rows[0].tensors, Some(1));
        assert_eq!(rows[1].ceiling_gbps, 40.0);
        assert_eq!(rows[1].fraction_of_ceiling, 0.25);
        assert_eq!(rows[1].contended_gbps, Some(8.0));
        assert_eq!(rows[1].compute_slowdown, Some(0.02));
        assert_eq!(rows[1].launch.as_deref(), Some("ctas=16,piece=65536"));
        assert_eq!(rows[2].launch.as_deref(), Some("prefer_overlap"));
        assert_eq!(
            rows[3].launch.as_deref(),
            Some("ring=8,pipelined=16,staging_waits=2")
        );
        assert_eq!(rows[0].launch, None);
    }

    #[test]
    fn the_best_launch_shape_is_reported_per_point_where_variants_ran() {
        let mut default = point(Direction::Store, Strategy::Kernel, 20.0);
        let mut wide = default;
        wide.launch = Some(LaunchVariant {
            ctas: 32,
            max_piece_bytes: 16 << 10,
        });
        wide.gbps = 30.0;
        let mut narrow = default;
        narrow.launch = Some(LaunchVariant {
            ctas: 4,
            max_piece_bytes: 256 << 10,
        });
        narrow.gbps = 10.0;
        let mut other = point(Direction::Load, Strategy::Kernel, 5.0);
        other.blocks = 1024;
        let out = CudaSweepOutput {
            device: "x".into(),
            ceiling_gbps: [50.0, 50.0],
            points: vec![default, wide, narrow, other],
            stats: Vec::new(),
            mismatches: Vec::new(),
            contended: false,
        };
        let best = out.best_launches();
        assert_eq!(best.len(), 1, "only where variants ran: {best:?}");
        assert_eq!(best[0].3, wide.launch);
        default.gbps = 40.0;
        let out = CudaSweepOutput {
            points: vec![default, wide, narrow],
            ..out
        };
        assert_eq!(out.best_launches()[0].3, None, "the default shape can win");
    }

    #[test]
    fn geometry_skips_what_cannot_be_laid_out() {
        let sweep = CudaSweep::default();
        let dev = 3u64 << 30;
        let g = Geometry::new(64 << 10, 1024, 16, &sweep, dev).unwrap();
        assert_eq!(g.page, 4 << 10);
        assert_eq!(g.tensor_span, (4 << 10) * 2049);
        assert_eq!(g.device_bytes(), g.tensor_span * 16);
        assert!(Geometry::new(4 << 10, 64, 1, &sweep, dev).is_ok());
        assert!(
            Geometry::new(1000, 64, 16, &sweep, dev).is_err(),
            "not a multiple"
        );
        assert!(
            Geometry::new(128, 64, 16, &sweep, dev).is_err(),
            "8-byte pages"
        );
        assert!(
            Geometry::new(2 << 20, 4096, 1, &sweep, dev).is_err(),
            "8 GiB job"
        );
        assert!(
            Geometry::new(4 << 10, 4096, 16, &sweep, dev).is_err(),
            "65,536 descriptors"
        );
        assert!(
            Geometry::new(1 << 20, 1024, 1, &sweep, 1 << 30).is_err(),
            "device span"
        );
        // Per-layer layouts lay their tensors one after another.
        let l = g.gpu_layout(1 << 40).unwrap();
        assert!(format!("{l:?}").contains("1099511627776"));
    }

    #[test]
    fn launch_variants_are_labelled_and_the_standard_set_is_complete() {
        let v = LaunchVariant::standard();
        assert_eq!(v.len(), 12);
        assert!(v.iter().all(|l| l.ctas > 0 && l.max_piece_bytes >= 16));
        assert_eq!(v[0].label(), "ctas=4,piece=16384");
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
