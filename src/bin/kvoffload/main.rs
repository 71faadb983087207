//! The `kvoffload` command line: `sim`, `bench`, `replay`, `info`.
//!
//! It only parses arguments and prints; everything else is in the library.

mod cmd_bench;
mod cmd_sim;

use std::fs::File;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
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
        /// Also write the engine time per step (p50, p90, p99, mean over the
        /// steady steps after a warm-up) as JSON to this file.
        #[arg(long, value_name = "FILE.json")]
        timing: Option<PathBuf>,
    },
    /// What this build contains (kernels, nvcc).
    Info,
}

/// `kvoffload replay TRACE.jsonl [--timing FILE.json]` (`-` reads stdin): exit
/// 2 on a malformed line or an unwritable timing file, 1 on an unreadable trace.
fn replay(path: &str, timing: Option<&Path>) -> ExitCode {
    if path == "-" {
        replay_from(std::io::stdin().lock(), timing)
    } else {
        match File::open(path) {
            Ok(f) => replay_from(std::io::BufReader::new(f), timing),
            Err(e) => {
                eprintln!("kvoffload replay: {path}: {e}");
                ExitCode::from(1)
            }
        }
    }
}

/// The `--timing` file: opened (without truncating) before the replay, so an
/// unwritable path fails before any work; written once the replay succeeded.
struct TimingFile {
    path: PathBuf,
    file: File,
    /// Whether the open created it (then a failed replay removes it).
    created: bool,
}

impl TimingFile {
    fn open(path: &Path) -> Result<Self, String> {
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map(|file| TimingFile {
                path: path.to_path_buf(),
                file,
                created: !existed,
            })
            .map_err(|e| format!("--timing {}: {e}", path.display()))
    }

    fn write(mut self, timings: &kvoffload::harness::replay::StepTimings) -> Result<(), String> {
        let json = timings.to_json() + "\n";
        self.file
            .set_len(0)
            .and_then(|()| self.file.write_all(json.as_bytes()))
            .and_then(|()| self.file.flush())
            .map_err(|e| format!("--timing {}: {e}", self.path.display()))
    }

    fn discard(self) {
        if self.created {
            drop(self.file);
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn replay_from(input: impl BufRead, timing: Option<&Path>) -> ExitCode {
    let timing = match timing.map(TimingFile::open).transpose() {
        Ok(t) => t,
        Err(msg) => {
            eprintln!("kvoffload replay: {msg}");
            return ExitCode::from(2);
        }
    };
    let out = std::io::BufWriter::new(std::io::stdout().lock());
    let result = match &timing {
        None => kvoffload::harness::replay::run(input, out).map(|()| None),
        Some(_) => kvoffload::harness::replay::run_timed(input, out).map(Some),
    };
    let _ = std::io::stdout().flush();
    match result {
        Ok(timings) => {
            if let (Some(file), Some(t)) = (timing, timings)
                && let Err(msg) = file.write(&t)
            {
                eprintln!("kvoffload replay: {msg}");
                return ExitCode::from(2);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            if let Some(file) = timing {
                file.discard();
            }
            match e {
                e @ kvoffload::harness::replay::ReplayError::Malformed { .. } => {
                    eprintln!("{e}");
                    ExitCode::from(2)
                }
                e => {
                    eprintln!("kvoffload replay: {e}");
                    ExitCode::from(1)
                }
            }
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
    topology();
    ExitCode::SUCCESS
}

/// The NUMA nodes online and each GPU's node (where a host pool placed
/// `auto` goes: `docs/dataplane.md`, "NUMA placement of the host pool").
fn topology() {
    use kvoffload::worker::cuda::{device_count, open_context, pci_address};
    use kvoffload::worker::numa::SysfsTopology;
    let topo = SysfsTopology::system();
    match topo.online_nodes() {
        Ok(nodes) => {
            for n in nodes {
                match topo.node_cpus(n) {
                    Ok(cpus) => println!("NUMA {n}: {} CPUs", cpus.len()),
                    Err(e) => println!("NUMA {n}: CPUs unknown ({e})"),
                }
            }
        }
        Err(e) => println!("NUMA nodes: unknown ({e})"),
    }
    let count = match device_count() {
        Ok(c) => c,
        Err(e) => {
            println!("GPUs: none ({e})");
            return;
        }
    };
    if count == 0 {
        println!("GPUs: none (the driver shows no device)");
    }
    for ordinal in 0..count {
        let line = open_context(ordinal).and_then(|ctx| {
            let name = ctx.name().unwrap_or_else(|_| "?".into());
            Ok((name, pci_address(&ctx)?))
        });
        match line {
            Ok((name, pci)) => {
                let node = match topo.device_node(&pci) {
                    Ok(Some(n)) => n.to_string(),
                    Ok(None) => "no NUMA node".to_string(),
                    Err(e) => format!("NUMA node unknown ({e})"),
                };
                println!("GPU {ordinal}: {name}, PCI {pci}, {node}");
            }
            Err(e) => println!("GPU {ordinal}: {e}"),
        }
    }
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
        Command::Replay { trace, timing } => replay(&trace, timing.as_deref()),
        Command::Info => info(),
    }
}
