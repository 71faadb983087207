//! The host backend sweep: scattered blocks copied by [`HostBackend`] jobs,
//! against one contiguous memcpy of the same bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::PoolError;
use crate::ids::JobId;
use crate::worker::{
    Direction, GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout,
    TransferBackend, TransferSpec, WorkerLayout,
};

use super::BenchRow;

/// What to sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct HostSweep {
    /// Block sizes in bytes.
    pub block_bytes: Vec<u64>,
    /// Blocks per job.
    pub blocks: Vec<u32>,
    /// Directions.
    pub directions: Vec<Direction>,
    /// Bytes to move per point (at least one job).
    pub bytes_per_point: u64,
}

impl Default for HostSweep {
    fn default() -> Self {
        Self {
            block_bytes: vec![4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20],
            blocks: vec![64, 256],
            directions: vec![Direction::Store, Direction::Load],
            bytes_per_point: 64 << 20,
        }
    }
}

/// Runs the sweep on the host backend.
pub fn run_host(sweep: &HostSweep) -> Result<Vec<BenchRow>, PoolError> {
    let mut rows = Vec::new();
    let mut next_job = 0u64;
    for &bb in &sweep.block_bytes {
        for &n in &sweep.blocks {
            let bytes = bb * u64::from(n);
            let reps = (sweep.bytes_per_point / bytes.max(1)).clamp(1, 4096);
            let ceiling = memcpy_gbps(bytes as usize, reps);
            for &dir in &sweep.directions {
                let gbps = backend_gbps(bb, n, dir, reps, &mut next_job)?;
                rows.push(BenchRow {
                    backend: "host".into(),
                    strategy: "copy-thread".into(),
                    direction: dir.to_string(),
                    block_bytes: bb,
                    blocks: n,
                    gbps,
                    ceiling_gbps: ceiling,
                    fraction_of_ceiling: if ceiling > 0.0 { gbps / ceiling } else { 0.0 },
                });
            }
        }
    }
    Ok(rows)
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    let s = t.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
}

fn memcpy_gbps(bytes: usize, reps: u64) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    gbps(bytes as u64 * reps, t.elapsed())
}

fn backend_gbps(
    block_bytes: u64,
    n: u32,
    dir: Direction,
    reps: u64,
    next_job: &mut u64,
) -> Result<f64, PoolError> {
    // Every other GPU block is copied (scattered blocks); block 0 is the null block.
    let gpu_blocks = n * 2 + 1;
    let gpu = Arc::new(HostBuffer::new(
        (u64::from(gpu_blocks) * block_bytes) as usize,
    )?);
    let row = HostRowLayout::uniform(1, 1, &[block_bytes])?;
    let pool_bytes = row
        .pool_bytes(n)
        .ok_or(crate::worker::LayoutError::Overflow("pool"))?;
    let pool = Arc::new(HostBuffer::new(pool_bytes as usize)?);
    let layout = WorkerLayout::new(
        GpuLayout::cross_layer(gpu.addr(), gpu_blocks, block_bytes, block_bytes)?,
        row,
        0,
        pool.addr(),
        n,
    )?;
    let mut b = HostBackend::new(layout, vec![gpu, pool], HostBackendOptions::default())?;
    let blocks: Vec<u32> = (0..n).map(|i| i * 2 + 1).collect();
    let chunks: Vec<u32> = (0..n).collect();
    let spec = TransferSpec::new(&blocks, 0, &chunks);
    let mut out = Vec::new();
    let mut run = |b: &mut HostBackend, next: &mut u64| -> Result<(), PoolError> {
        let job = JobId(*next);
        *next += 1;
        let r = match dir {
            Direction::Store => b.submit_store(job, &spec),
            Direction::Load => b.submit_load(job, &spec),
        };
        r.map_err(|e| PoolError::Worker {
            worker: 0,
            message: e.to_string(),
        })?;
        b.wait(&[job], Some(Duration::from_secs(60)))
            .map_err(|e| PoolError::Worker {
                worker: 0,
                message: e.to_string(),
            })?;
        out.clear();
        b.poll(&mut out);
        Ok(())
    };
    run(&mut b, next_job)?; // warm-up
    let t = Instant::now();
    for _ in 0..reps {
        run(&mut b, next_job)?;
    }
    Ok(gbps(block_bytes * u64::from(n) * reps, t.elapsed()))
}
