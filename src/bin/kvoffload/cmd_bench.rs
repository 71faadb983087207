//! `kvoffload bench`: the transfer sweep, as a table, JSON, CSV or SVG.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use kvoffload::bench::{self, HostSweep};

/// Arguments of `kvoffload bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Print a JSON array of rows instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the rows as CSV to this file.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw GB/s against block size per strategy into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Block sizes in bytes (comma separated).
    #[arg(long, value_delimiter = ',')]
    block_bytes: Option<Vec<u64>>,
    /// Blocks per job (comma separated).
    #[arg(long, value_delimiter = ',')]
    blocks: Option<Vec<u32>>,
    /// Bytes moved per measured point.
    #[arg(long)]
    bytes_per_point: Option<u64>,
    /// Write the CUDA strategy table (needs a GPU).
    #[arg(long)]
    calibrate: Option<PathBuf>,
}

/// Runs the subcommand.
pub fn run(a: BenchArgs) -> ExitCode {
    let mut sweep = HostSweep::default();
    if let Some(b) = a.block_bytes {
        if b.contains(&0) {
            eprintln!("kvoffload bench: block_bytes = 0 is out of range: allowed 1..");
            return ExitCode::from(2);
        }
        sweep.block_bytes = b;
    }
    if let Some(n) = a.blocks {
        if n.contains(&0) {
            eprintln!("kvoffload bench: blocks = 0 is out of range: allowed 1..");
            return ExitCode::from(2);
        }
        sweep.blocks = n;
    }
    if let Some(p) = a.bytes_per_point {
        sweep.bytes_per_point = p;
    }
    let rows = match bench::run_host(&sweep) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvoffload bench: {e}");
            return ExitCode::from(1);
        }
    };
    let cuda_note = "cuda: SKIP the CUDA sweep is `cargo run --release --example gpu_sweep` in this version (needs an NVIDIA driver)";
    if a.json {
        match serde_json::to_string_pretty(&rows) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("kvoffload bench: {e}");
                return ExitCode::from(1);
            }
        }
        eprintln!("{cuda_note}");
    } else {
        print!("{}", bench::table(&rows));
        println!("{cuda_note}");
    }
    if let Some(p) = &a.csv
        && let Err(e) = std::fs::write(p, bench::csv(&rows))
    {
        eprintln!("kvoffload bench: {}: {e}", p.display());
        return ExitCode::from(1);
    }
    if let Some(p) = &a.plot
        && let Err(e) = std::fs::write(p, bench::svg(&rows))
    {
        eprintln!("kvoffload bench: {}: {e}", p.display());
        return ExitCode::from(1);
    }
    if a.calibrate.is_some() {
        eprintln!(
            "kvoffload bench: --calibrate needs a GPU: SKIP (use `cargo run --release --example gpu_sweep -- --write-table FILE` on a GPU machine)"
        );
        return ExitCode::from(2);
    }
    ExitCode::SUCCESS
}
