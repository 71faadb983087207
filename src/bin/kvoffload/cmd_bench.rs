//! `kvoffload bench`: the transfer sweep per backend, as a table, JSON, CSV or
//! SVG; `--calibrate` writes the CUDA strategy table.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use kvoffload::harness::bench::{
    self, BenchRow, CalibrationPolicy, CudaSweep, HostSweep, LaunchVariant, RemoteSweep,
    calibrated_table, check_table_swap, open_device, run_remote,
};
use kvoffload::remote::RemoteTierConfig;
use kvoffload::worker::numa::HostPlacement;

/// Which backends `bench` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BenchBackend {
    /// The host backend (memcpy threads), against a plain memcpy.
    Host,
    /// The CUDA backend, every strategy, against one large pinned memcpy.
    Cuda,
    /// Host, then CUDA where a driver and a device are present.
    All,
    /// The remote tier (`--remote-tier URL`): put and get through
    /// kvoffload's tier against a plain redis client loop of SET and GET.
    Remote,
}

/// Arguments of `kvoffload bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Backends to measure [default: all; cuda with --calibrate].
    #[arg(long, value_enum)]
    backend: Option<BenchBackend>,
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
    /// Bytes moved per measured point (host backend).
    #[arg(long)]
    bytes_per_point: Option<u64>,
    /// A short sweep (fewer sizes and repetitions).
    #[arg(long)]
    quick: bool,
    /// Measure every CUDA strategy and write the fastest per block size,
    /// block count and direction as the strategy table the CUDA backend reads
    /// (`kvoffload sim --strategy-table FILE`). Needs a GPU.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "strategy-table.json")]
    calibrate: Option<PathBuf>,
    /// Tensors per block for the CUDA sweep (comma separated): 1 is a
    /// cross-layer cache, N a per-layer cache of N tensors [default: 1,16].
    #[arg(long, value_delimiter = ',')]
    tensors: Option<Vec<u32>>,
    /// Skip the CUDA sweep's byte check (each strategy's last job per point
    /// compared with its source).
    #[arg(long)]
    no_verify: bool,
    /// Also run each CUDA strategy beside a train of compute kernels and
    /// report the copies' GB/s meanwhile and the compute slowdown; with
    /// --calibrate, strategies are then chosen within --max-compute-slowdown.
    #[arg(long)]
    contend: bool,
    /// With --contend --calibrate: the largest compute slowdown a strategy
    /// may cause to be chosen on its speed (0.05 = 5 %).
    #[arg(
        long,
        default_value_t = 0.05,
        value_name = "FRACTION",
        allow_negative_numbers = true
    )]
    max_compute_slowdown: f64,
    /// Also measure the kernel strategy with other launch shapes (4..64
    /// CTAs, 16..256 KiB pieces) and report the fastest per point.
    #[arg(long)]
    sweep_launch: bool,
    /// Also measure batch DMA with the driver asked to overlap the copies
    /// with compute (CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE; worth
    /// reading with --contend).
    #[arg(long)]
    sweep_batch_overlap: bool,
    /// Also measure kernel_graph jobs pipelined (16 in flight) through
    /// descriptor-table rings of 2, 4, 8 and 16 slots.
    #[arg(long)]
    sweep_ring: bool,
    /// The remote store for `--backend remote`: `redis://host:port` or
    /// `rediss://...` (a comma-separated list with --remote-cluster). The
    /// password comes from the URL or KVOFFLOAD_REMOTE_PASSWORD.
    #[arg(long, value_name = "URL")]
    remote_tier: Option<String>,
    /// The remote store is a Redis Cluster.
    #[arg(long)]
    remote_cluster: bool,
    /// Where the CUDA sweep's pinned pool goes: auto (default: the GPU's
    /// NUMA node where the machine has several), off, or a NUMA node number
    /// (run once per node to see what a pool on the far socket costs).
    #[arg(long, default_value = "auto", value_name = "auto|off|NODE")]
    numa: String,
}

fn fail(msg: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("kvoffload bench: {msg}");
    ExitCode::from(code)
}

/// Runs the subcommand.
pub fn run(a: BenchArgs) -> ExitCode {
    let backend = a.backend.unwrap_or(if a.calibrate.is_some() {
        BenchBackend::Cuda
    } else {
        BenchBackend::All
    });
    if a.calibrate.is_some() && backend == BenchBackend::Host {
        return fail(
            "--calibrate measures the CUDA backend: not allowed with --backend host",
            2,
        );
    }
    if (backend == BenchBackend::Remote) != a.remote_tier.is_some() {
        return fail("--backend remote and --remote-tier URL go together", 2);
    }
    if a.block_bytes.as_ref().is_some_and(|b| b.contains(&0)) {
        return fail("block_bytes = 0 is out of range: allowed 1..", 2);
    }
    if a.blocks.as_ref().is_some_and(|b| b.contains(&0)) {
        return fail("blocks = 0 is out of range: allowed 1..", 2);
    }
    if matches!(backend, BenchBackend::Host | BenchBackend::Remote)
        && let Some(flag) = cuda_only_flag(&a)
    {
        return fail(
            format!("{flag} measures the CUDA backend: not allowed with --backend host or remote"),
            2,
        );
    }
    if a.tensors.as_ref().is_some_and(|t| t.contains(&0)) {
        return fail("tensors = 0 is out of range: allowed 1..", 2);
    }
    let numa = match a.numa.parse::<HostPlacement>() {
        Ok(p) => p,
        Err(e) => return fail(e, 2),
    };
    if !(a.max_compute_slowdown.is_finite() && a.max_compute_slowdown >= 0.0) {
        return fail(
            format!(
                "max_compute_slowdown = {} is out of range: allowed 0 or more",
                a.max_compute_slowdown
            ),
            2,
        );
    }
    if backend == BenchBackend::Remote {
        return run_remote_bench(&a);
    }
    // Open the device first: `--backend cuda` without one stops before any work.
    let ctx = if backend == BenchBackend::Host {
        None
    } else {
        match open_device(0) {
            Ok(c) => Some(c),
            Err(e) if backend == BenchBackend::Cuda => return fail(e, 2),
            Err(e) => {
                let reason = match &e {
                    bench::CudaBenchError::Unavailable(r) => r.to_string(),
                    other => other.to_string(),
                };
                eprintln!("SKIP: cuda: {reason}");
                None
            }
        }
    };
    let mut rows: Vec<BenchRow> = Vec::new();
    if backend != BenchBackend::Cuda {
        let mut sweep = HostSweep::default();
        if a.quick {
            sweep.bytes_per_point = 16 << 20;
        }
        if let Some(b) = &a.block_bytes {
            sweep.block_bytes.clone_from(b);
        }
        if let Some(n) = &a.blocks {
            sweep.blocks.clone_from(n);
        }
        if let Some(p) = a.bytes_per_point {
            sweep.bytes_per_point = p;
        }
        match bench::run_host(&sweep) {
            Ok(r) => rows.extend(r),
            Err(e) => return fail(e, 1),
        }
    }
    if let Some(ctx) = &ctx {
        let mut sweep = if a.quick {
            CudaSweep::quick()
        } else {
            CudaSweep::default()
        };
        if let Some(b) = &a.block_bytes {
            sweep.block_bytes.clone_from(b);
        }
        if let Some(n) = &a.blocks {
            sweep.blocks.clone_from(n);
        }
        if let Some(t) = &a.tensors {
            sweep.tensors.clone_from(t);
        }
        sweep.verify = !a.no_verify;
        sweep.contend = a.contend;
        sweep.numa = numa;
        if a.sweep_launch {
            sweep.launches = LaunchVariant::standard();
        }
        sweep.batch_prefer_overlap = a.sweep_batch_overlap;
        if a.sweep_ring {
            sweep.ring_depths = bench::STANDARD_RING_DEPTHS.to_vec();
        }
        let out = match bench::run_cuda(ctx, &sweep) {
            Ok(o) => o,
            Err(e) => return fail(e, 1),
        };
        eprintln!(
            "cuda: {}: ceiling (one {} MiB pinned memcpy) store/D2H {:.1} GB/s, load/H2D {:.1} GB/s",
            out.device,
            sweep.max_job_bytes >> 20,
            out.ceiling_gbps[0],
            out.ceiling_gbps[1]
        );
        eprintln!("cuda: pinned pool NUMA placement: {}", out.host_placement);
        for (block, count, tensors, stats) in &out.stats {
            eprintln!("cuda: stats {block} B x {count} ({tensors} tensors): {stats:?}");
        }
        if a.contend && !out.contended {
            eprintln!("cuda: contention not measured: the kernels were not built");
        }
        for (dir, block, count, launch, gbps) in out.best_launches() {
            let shape = launch.map_or_else(|| "default".to_string(), |l| l.label());
            eprintln!(
                "cuda: fastest kernel launch, {dir} {block} B x {count}: {shape} ({gbps:.2} GB/s)"
            );
        }
        let verified = out
            .points
            .iter()
            .filter(|p| p.verified_bytes.is_some())
            .count();
        if sweep.verify {
            eprintln!(
                "cuda: bytes checked on {verified} of {} points, {} mismatches",
                out.points.len(),
                out.mismatches.len()
            );
        }
        rows.extend(out.rows());
        if !out.mismatches.is_empty() {
            // The rows still go out (they show which points were checked),
            // then the run fails.
            for m in &out.mismatches {
                eprintln!("kvoffload bench: cuda: bytes differ: {m}");
            }
            let _ = output(&a, &rows);
            return fail(
                format!("{} CUDA jobs copied wrong bytes", out.mismatches.len()),
                1,
            );
        }
        if let Some(path) = &a.calibrate {
            let policy = CalibrationPolicy {
                max_compute_slowdown: a.max_compute_slowdown,
            };
            let table = calibrated_table(&out.points, policy);
            if let Err(e) = table.save(path) {
                return fail(e, 1);
            }
            eprintln!(
                "cuda: wrote the calibrated strategy table ({} rules, tuning {}) to {}",
                table.rules.len(),
                serde_json::to_string(&table.tuning).unwrap_or_default(),
                path.display()
            );
            // The table goes into running backends through the shared
            // handle they read on every submit, as a reload would.
            match check_table_swap(ctx, &sweep, &table) {
                Ok(r) if r.failures.is_empty() => eprintln!(
                    "cuda: the calibrated table swapped into running backends: {} swaps, {} changed the strategy, every job used the table's choice and moved the right bytes",
                    r.swaps, r.changed
                ),
                Ok(r) => {
                    for f in &r.failures {
                        eprintln!("kvoffload bench: cuda: after a table swap: {f}");
                    }
                    let _ = output(&a, &rows);
                    return fail(
                        format!(
                            "{} failures across {} table swaps",
                            r.failures.len(),
                            r.swaps
                        ),
                        1,
                    );
                }
                Err(e) => return fail(e, 1),
            }
        }
    }
    output(&a, &rows)
}

/// The first CUDA-sweep flag given, if any.
fn cuda_only_flag(a: &BenchArgs) -> Option<&'static str> {
    [
        (a.tensors.is_some(), "--tensors"),
        (a.no_verify, "--no-verify"),
        (a.contend, "--contend"),
        (a.sweep_launch, "--sweep-launch"),
        (a.sweep_batch_overlap, "--sweep-batch-overlap"),
        (a.sweep_ring, "--sweep-ring"),
        (a.numa != "auto", "--numa"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
}

/// `--backend remote`: the remote tier against a plain client loop.
fn run_remote_bench(a: &BenchArgs) -> ExitCode {
    let cfg = RemoteTierConfig {
        cluster: a.remote_cluster,
        ..RemoteTierConfig::for_url(a.remote_tier.clone().unwrap_or_default())
    };
    if let Err(e) = cfg.validate() {
        return fail(e, 2);
    }
    let mut sweep = RemoteSweep::default();
    if a.quick {
        sweep.bytes_per_point = 8 << 20;
    }
    if let Some(b) = &a.block_bytes {
        sweep.value_bytes.clone_from(b);
    }
    if let Some(p) = a.bytes_per_point {
        sweep.bytes_per_point = p;
    }
    eprintln!(
        "remote: {} ({}): each value once through the tier and once with a plain SET/GET loop, best of 3",
        cfg.redacted_url(),
        if cfg.cluster { "cluster" } else { "standalone" }
    );
    match run_remote(&cfg, &sweep) {
        Ok(rows) => output(a, &rows),
        Err(e) => fail(e, 1),
    }
}

/// Prints the rows (table or JSON) and writes the CSV and SVG asked for.
fn output(a: &BenchArgs, rows: &[BenchRow]) -> ExitCode {
    if a.json {
        match serde_json::to_string_pretty(&rows) {
            Ok(j) => println!("{j}"),
            Err(e) => return fail(e, 1),
        }
    } else {
        print!("{}", bench::table(rows));
    }
    if let Some(p) = &a.csv
        && let Err(e) = std::fs::write(p, bench::csv(rows))
    {
        return fail(format!("{}: {e}", p.display()), 1);
    }
    if let Some(p) = &a.plot
        && let Err(e) = std::fs::write(p, bench::svg(rows))
    {
        return fail(format!("{}: {e}", p.display()), 1);
    }
    ExitCode::SUCCESS
}
