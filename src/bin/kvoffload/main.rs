//! The `kvoffload` command line.
//!
//! `info` reports what the binary was built with; `replay` runs a trace
//! (docs/trace-format.md). More subcommands (sim, bench) arrive with their issues.

use std::process::ExitCode;

fn usage() -> &'static str {
    "usage: kvoffload <command>\n\ncommands:\n  info       what this build contains (kernels, nvcc)\n  replay T   replay a trace (JSON Lines, docs/trace-format.md); one output line per operation\n  --version  print the version\n"
}

/// `kvoffload replay TRACE.jsonl` (`-` reads stdin): exit 2 on a malformed line.
fn replay(path: Option<&str>) -> ExitCode {
    use std::io::{BufReader, Write};
    let Some(path) = path else {
        eprint!("kvoffload replay: missing trace path\n\n{}", usage());
        return ExitCode::from(2);
    };
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

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--version" | "-V") => {
            println!("kvoffload {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("info") => {
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
        Some("replay") => replay(args.get(1).map(String::as_str)),
        Some("-h" | "--help" | "help") => {
            print!("{}", usage());
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("kvoffload: unknown command {other:?}\n\n{}", usage());
            ExitCode::from(2)
        }
        None => {
            eprint!("{}", usage());
            ExitCode::from(2)
        }
    }
}
