//! The host backend sweep: scattered blocks copied by [`HostBackend`] jobs,
//! against one contiguous memcpy of the same bytes.

use crate::Direction;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::sim::PoolError;
use crate::ids::JobId;
use crate::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, TransferBackend,
    TransferSpec, WorkerLayout,
};

use super::BenchRow;

/// Trials per point (the best one counts).
const TRIALS: u64 = 3;

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
            for &dir in &sweep.directions {
                // Best of three trials each, interleaved, so that both see the
                // same machine (the dev VM shares its cores).
                let per_trial = reps.div_ceil(TRIALS);
                let mut ceiling = 0.0f64;
                let mut gbps = 0.0f64;
                let mut bench = BackendBench::new(bb, n, dir)?;
                let mut copy = MemcpyBench::new(bytes as usize);
                for _ in 0..TRIALS {
                    ceiling = ceiling.max(copy.gbps(per_trial));
                    gbps = gbps.max(bench.gbps(per_trial, &mut next_job)?);
                }
                rows.push(BenchRow {
                    backend: "host".into(),
                    strategy: "copy-thread".into(),
                    direction: dir.to_string(),
                    block_bytes: bb,
                    blocks: n,
                    gbps,
                    ceiling_gbps: ceiling,
                    fraction_of_ceiling: if ceiling > 0.0 { gbps / ceiling } else { 0.0 },
                    submit_us: None,
                    ..BenchRow::default()
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

/// A plain memcpy of one point's bytes between two buffers (the ceiling).
struct MemcpyBench {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl MemcpyBench {
    fn new(bytes: usize) -> Self {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        dst.copy_from_slice(&src);
        Self { src, dst }
    }

    fn gbps(&mut self, reps: u64) -> f64 {
        let t = Instant::now();
        for _ in 0..reps {
            self.dst.copy_from_slice(std::hint::black_box(&self.src));
            std::hint::black_box(&mut self.dst);
        }
        gbps(self.src.len() as u64 * reps, t.elapsed())
    }
}

/// One host backend set up for one point of the sweep.
struct BackendBench {
    backend: HostBackend,
    spec: TransferSpec,
    dir: Direction,
    bytes: u64,
    out: Vec<crate::worker::TransferResult>,
}

fn worker_err(e: impl std::fmt::Display) -> PoolError {
    PoolError::Worker {
        worker: 0,
        message: e.to_string(),
    }
}

impl BackendBench {
    fn new(block_bytes: u64, n: u32, dir: Direction) -> Result<Self, PoolError> {
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
        let backend = HostBackend::new(layout, vec![gpu, pool], HostBackendOptions::default())?;
        let blocks: Vec<u32> = (0..n).map(|i| i * 2 + 1).collect();
        let chunks: Vec<u32> = (0..n).collect();
        let mut me = Self {
            backend,
            spec: TransferSpec::new(&blocks, 0, &chunks),
            dir,
            bytes: block_bytes * u64::from(n),
            out: Vec::new(),
        };
        let mut warm = 1u64 << 62;
        me.one(&mut warm)?;
        Ok(me)
    }

    fn one(&mut self, next: &mut u64) -> Result<(), PoolError> {
        let job = JobId(*next);
        *next += 1;
        match self.dir {
            Direction::Store => self.backend.submit_store(job, &self.spec),
            Direction::Load => self.backend.submit_load(job, &self.spec),
        }
        .map_err(worker_err)?;
        self.backend
            .wait(&[job], Some(Duration::from_secs(60)))
            .map_err(worker_err)?;
        self.out.clear();
        self.backend.poll(&mut self.out);
        Ok(())
    }

    fn gbps(&mut self, reps: u64, next: &mut u64) -> Result<f64, PoolError> {
        let t = Instant::now();
        for _ in 0..reps {
            self.one(next)?;
        }
        Ok(gbps(self.bytes * reps, t.elapsed()))
    }
}
