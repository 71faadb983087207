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

use cudarc::driver::CudaContext;
use thiserror::Error;

use crate::worker::cuda::error::driver;
use crate::worker::cuda::{
    CudaBackend, CudaBackendOptions, CudaError, DeviceBuffer, LaunchShape, PinnedBuffer, Strategy,
    open_context, pool_near,
};
use crate::worker::numa::{self, SysfsTopology};
use crate::worker::{BackendError, HostRowLayout, TransferSpec, WorkerLayout};

mod buffers;
mod calibrate;
mod contention;
mod geometry;
mod measure;
mod point;
mod swap;
mod sweep;
mod tune;
mod verify;

use buffers::Buffers;
pub use calibrate::{CalibrationPolicy, calibrated_table};
use contention::Burn;
use geometry::Geometry;
pub use measure::ceiling_gbps;
use measure::{measure, measure_contended, measure_pipelined};
#[cfg(test)]
use point::test_point;
pub use point::{CudaPoint, CudaSweepOutput};
pub use swap::{SwapReport, check_table_swap};
pub use sweep::{CudaSweep, LaunchVariant, PIPELINE, STANDARD_RING_DEPTHS};

/// One burn launch under `contend`, microseconds (a model kernel's order).
const BURN_KERNEL_US: f64 = 50.0;
/// Burn launches per contended measurement (about 10 ms of compute).
const BURN_LAUNCHES: u32 = 200;

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
    let guard = numa::enter(sweep.numa, &pool_near(ctx), &SysfsTopology::system())
        .map_err(|e| CudaBenchError::Options(format!("host pool placement: {e}")))?;
    let pool = PinnedBuffer::host_alloc(ctx, max_job)?;
    let host_placement = guard.finish(pool.addr() as usize, max_job).to_string();
    let bufs = Buffers {
        pool,
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
        host_placement,
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

#[cfg(test)]
mod tests {
    use super::*;

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
