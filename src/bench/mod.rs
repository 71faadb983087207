//! `kvoffload bench`: transfer throughput per backend, strategy, direction,
//! block size and block count, against a ceiling measured in the same run
//! (a plain memcpy of the same bytes on the host backend).

pub mod host;
pub mod plot;

use std::fmt::Write;

use serde::Serialize;

pub use host::{HostSweep, run_host};
pub use plot::svg;

/// One measured point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchRow {
    /// `host` or `cuda`.
    pub backend: String,
    /// How the copy is done (`copy-thread` for the host backend).
    pub strategy: String,
    /// `store` (GPU → host) or `load`.
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
}

/// The rows as an aligned text table.
pub fn table(rows: &[BenchRow]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<7} {:<12} {:<6} {:>11} {:>7} {:>9} {:>9} {:>8}",
        "backend", "strategy", "dir", "block_bytes", "blocks", "GB/s", "ceiling", "fraction"
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{:<7} {:<12} {:<6} {:>11} {:>7} {:>9.2} {:>9.2} {:>8.2}",
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
