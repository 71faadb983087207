//! The `kvoffload` command line: `sim`, `bench`, `replay`, `info`.
//!
//! It only parses arguments and prints; everything else is in the library.

mod cmd_bench;
mod cmd_sim;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Offloads an LLM server's paged KV cache to pinned host memory and loads it back.
#[derive(Debug, Parser)]
#[command(name = "kvoffload", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a synthetic serving workload through the engine, with faults, and prints a summary.
    Sim(cmd_sim::SimArgs),
    /// Measures transfer throughput per backend, strategy, direction and block size.
    Bench(cmd_bench::BenchArgs),
    /// Replays a trace (JSON Lines, docs/trace-format.md; `-` reads stdin).
    Replay {
        /// The trace file.
        trace: String,
    },
    /// What this build contains (kernels, nvcc).
    Info,
}

/// `kvoffload replay TRACE.jsonl` (`-` reads stdin): exit 2 on a malformed line.
fn replay(path: &str) -> ExitCode {
    use std::io::{BufReader, Write};
    let stdout = std::io::stdout();
    let out = std::io::BufWriter::new(stdout.lock());
    let result = if path == "-" {
        kvoffload::replay::run(std::io::stdin().lock(), out)
    } else {
        match std::fs::File::open(path) {
            Ok(f) => kvoffload::replay::run(BufReader::new(f), out),
            Err(e) => {
                eprintln!("kvoffload replay: {path}: {e}");
                return ExitCode::from(1);
            }
        }
    };
    let _ = std::io::stdout().flush();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ kvoffload::replay::ReplayError::Malformed { .. }) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("kvoffload replay: {e}");
            ExitCode::from(1)
        }
    }
}

fn info() -> ExitCode {
    println!("kvoffload {}", env!("CARGO_PKG_VERSION"));
    if kvoffload::kernels::KERNELS_BUILT {
        println!("CUDA kernels: built ({})", kvoffload::kernels::NVCC_VERSION);
        for m in kvoffload::kernels::MODULES {
            println!("  {}: fatbin {} bytes", m.name, m.fatbin.len());
        }
    } else {
        println!("CUDA kernels: not built (no nvcc at build time)");
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let cli = Cli::parse();
    match cli.command {
        Command::Sim(a) => cmd_sim::run(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::Replay { trace } => replay(&trace),
        Command::Info => info(),
    }
}
