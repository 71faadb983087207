//! `bench --calibrate` swaps the calibrated table into backends that are
//! running: per checked point a backend reads a [`SharedStrategyTable`]
//! holding the built-in defaults, runs a job, gets the calibrated table
//! through [`SharedStrategyTable::replace`] (no lock on its read path), and
//! runs another, which must use the calibrated choice and move the right
//! bytes.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::Direction;
use crate::ids::JobId;
use crate::worker::cuda::error::driver;
use crate::worker::cuda::{
    CudaBackend, CudaBackendOptions, DeviceBuffer, PinnedBuffer, SharedStrategyTable, Strategy,
    StrategyTable,
};
use crate::worker::{HostRowLayout, TransferBackend, TransferSpec, WorkerLayout};

use super::buffers::Buffers;
use super::geometry::Geometry;
use super::measure::{JOB_WAIT, submit};
use super::{CudaBenchError, CudaSweep};

/// What the swap check saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SwapReport {
    /// (point, direction) pairs run once before and once after a swap.
    pub swaps: u32,
    /// Of those, the pairs whose job used another strategy after the swap
    /// than before (the swap visibly took effect).
    pub changed: u32,
    /// Jobs that did not use the table's choice, or moved wrong bytes.
    pub failures: Vec<String>,
}

/// The points the check uses: the sweep's smallest and largest block
/// sizes at its smallest count, for each of its tensor counts.
fn points(sweep: &CudaSweep) -> Vec<(u64, u32, u32)> {
    let count = sweep.blocks.iter().copied().min().unwrap_or(64);
    let mut sizes: Vec<u64> = [
        sweep.block_bytes.iter().copied().min(),
        sweep.block_bytes.iter().copied().max(),
    ]
    .into_iter()
    .flatten()
    .collect();
    sizes.dedup();
    let mut out = Vec::new();
    for &tensors in &sweep.tensors {
        for &size in &sizes {
            out.push((size, count, tensors));
        }
    }
    out
}

/// The strategy a job used: the one whose counter moved.
fn used(before: &[u64; 4], after: &[u64; 4]) -> Option<Strategy> {
    Strategy::ALL
        .into_iter()
        .zip(before.iter().zip(after))
        .find(|(_, (b, a))| a > b)
        .map(|(s, _)| s)
}

/// Runs the check of `table` on `ctx` over a few of `sweep`'s points.
pub fn check_table_swap(
    ctx: &Arc<CudaContext>,
    sweep: &CudaSweep,
    table: &StrategyTable,
) -> Result<SwapReport, CudaBenchError> {
    let mut report = SwapReport::default();
    let mut job = 1u64 << 40;
    for (block, count, tensors) in points(sweep) {
        let Ok(g) = Geometry::new(block, count, tensors, sweep, u64::MAX) else {
            continue;
        };
        let row = HostRowLayout::uniform(1, 1, &vec![g.page; g.tensors as usize])?;
        let pool_bytes = usize::try_from(row.row_bytes() * u64::from(g.count))
            .map_err(|_| CudaBenchError::Options("pool size overflows".into()))?;
        let dev_bytes = usize::try_from(g.device_bytes())
            .map_err(|_| CudaBenchError::Options("device size overflows".into()))?;
        let bufs = Buffers {
            pool: PinnedBuffer::host_alloc(ctx, pool_bytes)?,
            dev: DeviceBuffer::new(ctx, dev_bytes)?,
        };
        let layout = WorkerLayout::new(
            g.gpu_layout(bufs.dev.addr())?,
            row,
            0,
            bufs.pool.addr(),
            g.count,
        )?;
        let blocks: Vec<u32> = (0..g.count).map(|i| 1 + 2 * i).collect();
        let chunk_ids: Vec<u32> = (0..g.count).rev().collect();
        let spec = TransferSpec::new(&blocks, 0, &chunk_ids);
        let shared = Arc::new(SharedStrategyTable::new(StrategyTable::default()));
        let options = CudaBackendOptions {
            strategies: Arc::clone(&shared),
            ..CudaBackendOptions::default()
        };
        let compute = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        // SAFETY: the layout lies inside `bufs` (sized from the geometry
        // above), which outlives the backend: it is dropped (synchronising
        // its streams) at the end of this iteration, before `bufs`.
        let mut backend =
            unsafe { CudaBackend::new(ctx.clone(), layout.clone(), compute, options)? };
        let per_descriptor = g.page;
        let descriptors = (u64::from(g.count) * u64::from(g.tensors)) as usize;
        for dir in Direction::ALL {
            bufs.fill_source(dir, dev_bytes, pool_bytes)?;
            let mut strategies = Vec::new();
            for (phase, t) in [
                ("before", StrategyTable::default()),
                ("after", table.clone()),
            ] {
                let expected = t.choose(dir, per_descriptor, descriptors);
                shared.replace(t);
                bufs.clear_destination(dir, dev_bytes, pool_bytes)?;
                let counts = backend.stats().jobs_by_strategy;
                let fallbacks = backend.stats().fallbacks;
                job += 1;
                submit(&mut backend, dir, JobId(job), &spec)?;
                backend.wait(&[JobId(job)], Some(JOB_WAIT))?;
                let mut results = Vec::new();
                backend.poll(&mut results);
                let what = format!(
                    "{dir} {} B x {} blocks, {} tensors, {phase} the swap",
                    g.block, g.count, g.tensors
                );
                if !results.iter().any(|r| r.success) {
                    report.failures.push(format!("{what}: the job failed"));
                    strategies.push(None);
                    continue;
                }
                let got = used(&counts, &backend.stats().jobs_by_strategy);
                let fell_back = backend.stats().fallbacks > fallbacks;
                // A strategy the machine lacks (no batch call, no kernels,
                // a table too big) falls back to per-run DMA, counted.
                let honoured = got == Some(expected) || (got == Some(Strategy::Dma) && fell_back);
                if !honoured {
                    report.failures.push(format!(
                        "{what}: the backend used {got:?}, the table says {expected:?}"
                    ));
                }
                if let Err(why) = bufs.check(&layout, dir, &spec, dev_bytes, pool_bytes)? {
                    report.failures.push(format!("{what}: {why}"));
                }
                strategies.push(got);
            }
            report.swaps += 1;
            if strategies.first() != strategies.get(1) {
                report.changed += 1;
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_strategy_used_is_the_counter_that_moved() {
        assert_eq!(used(&[1, 0, 0, 0], &[1, 0, 1, 0]), Some(Strategy::Kernel));
        assert_eq!(used(&[0; 4], &[1, 0, 0, 0]), Some(Strategy::Dma));
        assert_eq!(used(&[3, 1, 4, 1], &[3, 1, 4, 1]), None);
    }

    #[test]
    fn points_cover_the_size_extremes_per_tensor_count() {
        let sweep = CudaSweep::default();
        let p = points(&sweep);
        assert_eq!(
            p,
            vec![
                (4 << 10, 64, 1),
                (2 << 20, 64, 1),
                (4 << 10, 64, 16),
                (2 << 20, 64, 16)
            ]
        );
        let one = CudaSweep {
            block_bytes: vec![16 << 10],
            tensors: vec![1],
            ..CudaSweep::default()
        };
        assert_eq!(points(&one), vec![(16 << 10, 64, 1)]);
    }
}
