//! `kvoffload bench`: transfer throughput per backend, strategy, direction,
//! block size and block count, against a ceiling measured in the same run
//! (a plain memcpy of the same bytes on the host backend, one large pinned
//! `cuMemcpyAsync` on the CUDA backend, a plain `redis` client loop for the
//! remote tier).

mod cuda;
mod host;
mod plot;
mod remote;

use std::fmt::Write;

use serde::Serialize;

pub use cuda::{
    CudaBenchError, CudaPoint, CudaSweep, CudaSweepOutput, calibrated_table, open_device, run_cuda,
};
pub use host::{HostSweep, run_host};
pub use plot::svg;
pub use remote::{RemoteBenchError, RemoteSweep, run_remote};

/// One measured point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchRow {
    /// `host` or `cuda`.
    pub backend: String,
    /// How the copy is done (`copy-thread` for the host backend; the CUDA
    /// strategy's name: `dma`, `batch_dma`, `kernel`, `kernel_graph`).
    pub strategy: String,
    /// `store` (GPU → host, D2H) or `load` (host → GPU, H2D).
    pub direction: String,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks per job.
    pub blocks: u32,
    /// Measured GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// The same run's ceiling, GB/s.
    pub ceiling_gbps: f64,
    /// `gbps / ceiling_gbps`.
    pub fraction_of_ceiling: f64,
    /// Best host time to submit one job, microseconds (CUDA rows only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit_us: Option<f64>,
}

/// The rows as an aligned text table.
pub fn table(rows: &[BenchRow]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<7} {:<13} {:<6} {:>11} {:>7} {:>9} {:>9} {:>8}",
        "backend", "strategy", "dir", "block_bytes", "blocks", "GB/s", "ceiling", "fraction"
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{:<7} {:<13} {:<6} {:>11} {:>7} {:>9.2} {:>9.2} {:>8.2}",
            r.backend,
            r.strategy,
            r.direction,
            r.block_bytes,
            r.blocks,
            r.gbps,
            r.ceiling_gbps,
            r.fraction_of_ceiling
        );
    }
    o
}

/// The rows as CSV with a header line.
pub fn csv(rows: &[BenchRow]) -> String {
    let mut o = String::from(
        "backend,strategy,direction,block_bytes,blocks,gbps,ceiling_gbps,fraction_of_ceiling\n",
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{},{},{},{},{},{:.4},{:.4},{:.4}",
            r.backend,
            r.strategy,
            r.direction,
            r.block_bytes,
            r.blocks,
            r.gbps,
            r.ceiling_gbps,
            r.fraction_of_ceiling
        );
    }
    o
}
