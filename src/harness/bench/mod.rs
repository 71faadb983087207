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
    CalibrationPolicy, CudaBenchError, CudaPoint, CudaSweep, CudaSweepOutput, LaunchVariant,
    PIPELINE, STANDARD_RING_DEPTHS, SwapReport, calibrated_table, check_table_swap, open_device,
    run_cuda,
};
pub use host::{HostSweep, run_host};
pub use plot::svg;
pub use remote::{RemoteBenchError, RemoteSweep, run_remote};

/// One measured point.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
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
    /// Tensors per block: 1 cross-layer, more per-layer (CUDA rows only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<u32>,
    /// Bytes of the point's last job compared with their source and found
    /// equal (CUDA rows; absent when not checked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verified_bytes: Option<u64>,
    /// GB/s beside a train of compute kernels (`bench --contend`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contended_gbps: Option<f64>,
    /// The compute train's slowdown meanwhile (0.1: 10 % longer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_slowdown: Option<f64>,
    /// The kernel launch shape where not the default (`ctas=N,piece=BYTES`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launch: Option<String>,
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

/// The rows as CSV with a header line (the CUDA-only columns are empty on
/// other rows).
pub fn csv(rows: &[BenchRow]) -> String {
    let mut o = String::from(
        "backend,strategy,direction,block_bytes,blocks,gbps,ceiling_gbps,fraction_of_ceiling,\
         tensors,verified_bytes,contended_gbps,compute_slowdown,launch\n",
    );
    fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
        v.map(|v| v.to_string()).unwrap_or_default()
    }
    for r in rows {
        let _ = writeln!(
            o,
            "{},{},{},{},{},{:.4},{:.4},{:.4},{},{},{},{},{}",
            r.backend,
            r.strategy,
            r.direction,
            r.block_bytes,
            r.blocks,
            r.gbps,
            r.ceiling_gbps,
            r.fraction_of_ceiling,
            opt(r.tensors),
            opt(r.verified_bytes),
            opt(r.contended_gbps.map(|g| format!("{g:.4}"))),
            opt(r.compute_slowdown.map(|s| format!("{s:.4}"))),
            // `ctas=N,piece=B` holds a comma: quoted.
            opt(r.launch.as_ref().map(|l| format!("\"{l}\""))),
        );
    }
    o
}
