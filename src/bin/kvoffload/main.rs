//! The `kvoffload` command line.
//!
//! Subcommands arrive with their issues (sim, bench, replay); this binary
//! reports what it was built with.

use std::process::ExitCode;

fn usage() -> &'static str {
    "usage: kvoffload <command>\n\ncommands:\n  info       what this build contains (kernels, nvcc)\n  --version  print the version\n"
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
