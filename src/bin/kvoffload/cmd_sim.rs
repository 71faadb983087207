//! `kvoffload sim`: arguments, config merging, progress bar, summary output.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use kvoffload::OffloadConfig;
use kvoffload::harness::sim::{
    PoolError, Progress, Sim, SimBackend, SimError, SimOptions, SimSummary, config_from_path,
    default_config, set_sync_load_budget,
};
use kvoffload::metrics::{MetricsServer, SharedMetricsText};
use kvoffload::remote::{RemoteTierConfig, WritePolicy};
use kvoffload::worker::cuda::StrategyTable;
use kvoffload::worker::numa::HostPlacement;

/// Arguments of `kvoffload sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Engine configuration (TOML or JSON): its keys replace the sim's defaults; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seed of the workload and the faults (same seed, same decisions).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Requests (conversation turns) to run.
    #[arg(long)]
    requests: Option<u64>,
    /// Most conversations open at once (the users of the simulated service;
    /// default 64): a new one arrives only when fewer are open.
    #[arg(long)]
    conversations: Option<u64>,
    /// Worker threads (simulated GPUs); overrides `world_size`.
    #[arg(long)]
    world_size: Option<u32>,
    /// Every worker holds the same KV (MLA replicated on every
    /// tensor-parallel rank): one copy of a chunk in the host pool, which
    /// every worker maps, the stores written by turns of host chunk.
    #[arg(long)]
    replicated: bool,
    /// Host chunk slots; overrides `num_cpu_chunks`.
    #[arg(long)]
    num_cpu_chunks: Option<u64>,
    /// GPU blocks per worker in the simulated serving backend.
    #[arg(long)]
    gpu_blocks: Option<u32>,
    /// Per-step budget of synchronous loads, in KV bytes per worker (the
    /// engine's `sync_load_budget_bytes`; 0: every load asynchronous): a hit
    /// that fits is loaded within its step and its request runs at once.
    #[arg(long, value_name = "BYTES")]
    sync_load_budget: Option<u64>,
    /// Transfer backend: host (default; host memory stands in for the GPU) or
    /// cuda (device buffers and a pinned pool; needs an NVIDIA driver).
    #[arg(long, default_value = "host")]
    backend: String,
    /// CUDA copy strategy table (JSON, as written by `kvoffload bench --calibrate`);
    /// the built-in defaults without it. Used by `--backend cuda`.
    #[arg(long)]
    strategy_table: Option<PathBuf>,
    /// Where the host pool goes: auto (default: on the CUDA backend, the
    /// NUMA node of the first GPU where the machine has several), off
    /// (wherever the kernel puts it), or a NUMA node number.
    #[arg(long, default_value = "auto", value_name = "auto|off|NODE")]
    numa: String,
    /// Turn fault injection off.
    #[arg(long)]
    no_faults: bool,
    /// Turn the content check off (computed blocks written with a pattern of
    /// their hash, loaded blocks and GPU prefix hits compared with it).
    #[arg(long)]
    no_content_check: bool,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Record the control-plane calls as a trace (replayable by `kvoffload replay`).
    #[arg(long)]
    record: Option<PathBuf>,
    /// Serve Prometheus metrics on http://ADDR/metrics while running (e.g. 127.0.0.1:9400).
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Write every stored chunk through to this remote tier: `redis://host:port`
    /// or `rediss://...` (a comma-separated list with --remote-cluster). The
    /// password comes from the URL or KVOFFLOAD_REMOTE_PASSWORD.
    #[arg(long, value_name = "URL")]
    remote_tier: Option<String>,
    /// The remote tier is a Redis Cluster.
    #[arg(long)]
    remote_cluster: bool,
    /// When workers write chunks to the remote tier: through (every stored
    /// chunk, the default) or on_eviction (chunks the host tier evicts).
    #[arg(long, value_name = "WHEN")]
    remote_write: Option<String>,
    /// Serving nodes sharing the remote tier (needs --remote-tier): each its
    /// own scheduler, host tier and workers, running the same seeded workload
    /// one after the other, so that later nodes find the prefixes earlier
    /// ones computed. One summary per node, then their hit rates side by side.
    #[arg(long, default_value_t = 1)]
    nodes: u32,
}

fn fail(msg: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("kvoffload sim: {msg}");
    ExitCode::from(code)
}

/// The engine configuration: the sim's defaults, the file, then the flags; validated.
fn config(a: &SimArgs) -> Result<OffloadConfig, kvoffload::ConfigError> {
    let mut cfg = match &a.config {
        Some(p) => config_from_path(p)?,
        None => default_config(),
    };
    if let Some(w) = a.world_size {
        cfg.world_size = w;
    }
    if let Some(n) = a.num_cpu_chunks {
        cfg.num_cpu_chunks = Some(n);
        cfg.cpu_bytes_to_use = None;
    }
    if let Some(b) = a.sync_load_budget {
        set_sync_load_budget(&mut cfg, b);
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Runs the subcommand.
pub fn run(a: SimArgs) -> ExitCode {
    let cfg = match config(&a) {
        Ok(c) => c,
        Err(e) => return fail(e, 2),
    };
    let strategies = match &a.strategy_table {
        Some(p) => match StrategyTable::load(p) {
            Ok(t) => t,
            Err(e) => return fail(e, 2),
        },
        None => StrategyTable::default(),
    };
    let backend = match a.backend.as_str() {
        "host" => SimBackend::Host,
        "cuda" => SimBackend::Cuda { strategies },
        other => {
            return fail(
                format!("backend = {other:?} is not allowed: allowed host, cuda"),
                2,
            );
        }
    };
    let numa = match a.numa.parse::<HostPlacement>() {
        Ok(p) => p,
        Err(e) => return fail(e, 2),
    };
    if a.remote_cluster && a.remote_tier.is_none() {
        return fail("--remote-cluster needs --remote-tier URL", 2);
    }
    if a.nodes == 0 || a.nodes > 64 {
        return fail(
            format!("nodes = {} is out of range: allowed 1..=64", a.nodes),
            2,
        );
    }
    if a.nodes > 1 && a.remote_tier.is_none() {
        return fail(
            "--nodes above 1 needs --remote-tier URL (the nodes share it)",
            2,
        );
    }
    if a.nodes > 1 && (a.record.is_some() || a.metrics_addr.is_some()) {
        return fail("--record and --metrics-addr run with one node only", 2);
    }
    let write = match a.remote_write.as_deref() {
        None | Some("through") => WritePolicy::Through,
        Some("on_eviction") => WritePolicy::OnEviction,
        Some(other) => {
            return fail(
                format!("remote_write = {other:?} is not allowed: allowed through, on_eviction"),
                2,
            );
        }
    };
    if a.remote_write.is_some() && a.remote_tier.is_none() {
        return fail("--remote-write needs --remote-tier URL", 2);
    }
    let remote = a.remote_tier.as_ref().map(|url| RemoteTierConfig {
        cluster: a.remote_cluster,
        write,
        ..RemoteTierConfig::for_url(url.clone())
    });
    let mut opts = SimOptions {
        seed: a.seed,
        backend,
        remote,
        numa,
        ..SimOptions::default()
    };
    if let Some(r) = a.requests {
        opts.requests = r;
    }
    if let Some(c) = a.conversations {
        opts.max_conversations = c;
    }
    if let Some(g) = a.gpu_blocks {
        opts.gpu_blocks = g;
    }
    if a.no_faults {
        opts.faults = kvoffload::harness::sim::FaultRates::none();
    }
    opts.content_check = !a.no_content_check;
    opts.replicated = a.replicated;
    if let Some(kb) = cfg.kv_bytes_per_block {
        opts.block_bytes = kb;
    }
    let mut summaries = Vec::new();
    for node in 0..a.nodes {
        let s = match run_node(&a, cfg.clone(), opts.clone()) {
            Ok(s) => s,
            Err(code) => return code,
        };
        if a.nodes > 1 {
            println!("kvoffload sim summary, node {} of {}", node + 1, a.nodes);
        } else {
            println!("kvoffload sim summary");
        }
        print!("{}", s.render());
        summaries.push(s);
    }
    if a.nodes > 1 {
        let rates: Vec<String> = summaries
            .iter()
            .enumerate()
            .map(|(i, s)| format!("node {} {:.1}%", i + 1, s.hit_rate_with_offload * 100.0))
            .collect();
        println!(
            "prefix hit rate with offload, by node: {}",
            rates.join(", ")
        );
    }
    if let Some(p) = &a.report {
        let json = if a.nodes > 1 {
            serde_json::to_string_pretty(&summaries)
        } else {
            serde_json::to_string_pretty(&summaries[0])
        };
        let json = match json {
            Ok(j) => j,
            Err(e) => return fail(e, 1),
        };
        if let Err(e) = std::fs::write(p, json + "\n") {
            return fail(format!("{}: {e}", p.display()), 1);
        }
    }
    for s in &summaries {
        if let Some(why) = failure(s) {
            return fail(why, 1);
        }
    }
    ExitCode::SUCCESS
}

/// Why a finished run fails (exit 1): leaks after the drain, or blocks that
/// did not hold the bytes of their hash.
fn failure(s: &SimSummary) -> Option<String> {
    if s.leaks.total != 0 {
        return Some(format!("leaks after drain: {:?}", s.leaks));
    }
    let c = &s.content;
    if c.mismatches != 0 {
        let first = c.first_mismatches.first().map_or(String::new(), |m| {
            format!(
                " (first: step {} worker {} block {} hash {:#x}, {}, byte {})",
                m.step, m.worker, m.block, m.hash, m.kind, m.offset
            )
        });
        return Some(format!(
            "content check: {} of {} blocks checked do not hold the bytes of their hash{first}",
            c.mismatches, c.blocks_checked
        ));
    }
    None
}

/// One node's run: its summary, or the exit code of its error (printed).
fn run_node(a: &SimArgs, cfg: OffloadConfig, opts: SimOptions) -> Result<SimSummary, ExitCode> {
    let mut sim = match Sim::new(cfg, opts) {
        Ok(s) => s,
        Err(SimError::Config(e)) => return Err(fail(e, 2)),
        Err(e @ SimError::Options(_)) => return Err(fail(e, 2)),
        // One line: `cuda backend unavailable: <reason>`.
        Err(SimError::Pool(e @ PoolError::CudaUnavailable(_))) => return Err(fail(e, 2)),
        // Refused credentials, an untrusted certificate: a configuration error.
        Err(SimError::Pool(e @ PoolError::Remote { .. })) => return Err(fail(e, 2)),
        Err(e) => return Err(fail(e, 1)),
    };
    if let Some(p) = &a.record {
        match std::fs::File::create(p) {
            Ok(f) => sim.record_to(Box::new(std::io::BufWriter::new(f))),
            Err(e) => return Err(fail(format!("{}: {e}", p.display()), 1)),
        }
    }
    let _server = match &a.metrics_addr {
        Some(addr) => {
            let text = SharedMetricsText::default();
            sim.publish_metrics(text.clone());
            match MetricsServer::start(addr, text) {
                Ok(s) => {
                    eprintln!("metrics: http://{}/metrics", s.local_addr());
                    Some(s)
                }
                Err(e) => return Err(fail(format!("metrics address {addr}: {e}"), 2)),
            }
        }
        None => None,
    };
    let tty = std::io::stderr().is_terminal();
    let mut progress = |p: Progress| {
        if !tty {
            return;
        }
        let width = 40usize;
        let done = (p.finished * width as u64)
            .checked_div(p.total)
            .map_or(width, |d| d as usize);
        let mut e = std::io::stderr();
        let _ = write!(
            e,
            "\r[{}{}] {}/{} requests, step {}{}",
            "#".repeat(done.min(width)),
            " ".repeat(width - done.min(width)),
            p.finished,
            p.total,
            p.step,
            if p.draining { " (draining)" } else { "" }
        );
        let _ = e.flush();
    };
    let out = match sim.run(&mut progress) {
        Ok(o) => o,
        Err(e) => return Err(fail(e, 1)),
    };
    if tty {
        eprintln!();
    }
    Ok(out.summary)
}

#[cfg(test)]
mod tests {
    use kvoffload::harness::sim::ContentMismatch;

    use super::*;

    #[test]
    fn leaks_or_content_mismatches_fail_the_run() {
        let mut s = SimSummary::default();
        assert_eq!(failure(&s), None);
        s.content.blocks_checked = 10;
        s.content.mismatches = 2;
        s.content.first_mismatches.push(ContentMismatch {
            step: 7,
            worker: 1,
            block: 3,
            hash: 0xab,
            kind: "load".into(),
            offset: 0,
        });
        let why = failure(&s).unwrap();
        assert!(
            why.starts_with("content check: 2 of 10 blocks checked")
                && why.contains("step 7 worker 1 block 3 hash 0xab, load"),
            "{why}"
        );
        s.leaks.total = 1;
        assert!(failure(&s).unwrap().starts_with("leaks after drain"));
    }
}
