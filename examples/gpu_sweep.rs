//! GPU <-> host sweep of the CUDA backend: 4 KiB to 2 MiB per block, 64 to 4096
//! scattered blocks, both directions, each strategy, as a table with GB/s and
//! the percentage of a large pinned memcpy measured in the same run.
//! Prints `SKIP: <reason>` and exits 0 without a GPU.
//!
//! `gpu_sweep [--quick] [--write-table FILE]` (`--quick`: fewer sizes and
//! repetitions; `--write-table`: write the fastest strategy per measured point as
//! a `StrategyTable` JSON file, the calibration the CUDA backend can load).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, sys};
use kvoffload::ids::JobId;
use kvoffload::worker::cuda::{
    CudaBackend, CudaBackendOptions, CudaError, DeviceBuffer, PinnedBuffer, Strategy, StrategyRule,
    StrategyTable, open_context,
};
use kvoffload::worker::{
    Direction, GpuLayout, HostRowLayout, TransferBackend, TransferSpec, WorkerLayout,
};

/// Largest bytes moved by one job (device side holds twice that, scattered).
const MAX_JOB_BYTES: u64 = 2 << 30;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let table_path = args
        .iter()
        .position(|a| a == "--write-table")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let ctx = match open_context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("SKIP: {e}");
            return;
        }
    };
    match run(&ctx, quick) {
        Ok(points) => {
            let table = calibrated_table(&points);
            match serde_json::to_string_pretty(&table) {
                Ok(json) => println!("# calibrated strategy table:\n{json}"),
                Err(e) => eprintln!("cannot serialise the table: {e}"),
            }
            if let Some(path) = table_path
                && let Err(e) = table.save(std::path::Path::new(&path))
            {
                eprintln!("{e}");
            }
        }
        Err(e) => {
            eprintln!("gpu_sweep failed: {e}");
            std::process::exit(1);
        }
    }
}

/// One measured point: direction, bytes per block, block count, strategy, GB/s.
type Point = (Direction, u64, usize, Strategy, f64);

/// The fastest strategy per measured (direction, block size, count), as rules
/// covering the ranges between measured sizes and counts.
fn calibrated_table(points: &[Point]) -> StrategyTable {
    let mut sizes: Vec<u64> = points.iter().map(|p| p.1).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut counts: Vec<usize> = points.iter().map(|p| p.2).collect();
    counts.sort_unstable();
    counts.dedup();
    let mut rules = Vec::new();
    for dir in Direction::ALL {
        for (si, &size) in sizes.iter().enumerate() {
            for (ci, &count) in counts.iter().enumerate() {
                let best = points
                    .iter()
                    .filter(|p| p.0 == dir && p.1 == size && p.2 == count && p.4.is_finite())
                    .max_by(|a, b| a.4.total_cmp(&b.4));
                let Some(best) = best else { continue };
                rules.push(StrategyRule {
                    direction: Some(dir),
                    min_bytes_per_block: if si == 0 { 0 } else { size },
                    max_bytes_per_block: sizes.get(si + 1).map(|n| n - 1),
                    min_blocks: if ci == 0 { 0 } else { count },
                    max_blocks: counts.get(ci + 1).map(|n| n - 1),
                    strategy: best.3,
                });
            }
        }
    }
    StrategyTable {
        rules,
        fallback: StrategyTable::default().fallback,
    }
}

fn run(ctx: &Arc<CudaContext>, quick: bool) -> Result<Vec<Point>, CudaError> {
    let mut points = Vec::new();
    let name = ctx.name().unwrap_or_else(|_| "?".into());
    println!("device: {name}");
    let pool = PinnedBuffer::host_alloc(ctx, MAX_JOB_BYTES as usize)?;
    let dev = DeviceBuffer::new(ctx, 2 * MAX_JOB_BYTES as usize + (2 << 20))?;
    let ceiling = [
        ceiling_gbps(ctx, &dev, &pool, Direction::Store)?,
        ceiling_gbps(ctx, &dev, &pool, Direction::Load)?,
    ];
    println!(
        "ceiling (one {} MiB pinned memcpy): store (D2H) {:.1} GB/s, load (H2D) {:.1} GB/s",
        MAX_JOB_BYTES >> 20,
        ceiling[0],
        ceiling[1]
    );
    let sizes: &[u64] = if quick {
        &[4 << 10, 16 << 10, 64 << 10, 2 << 20]
    } else {
        &[
            4 << 10,
            16 << 10,
            32 << 10,
            64 << 10,
            256 << 10,
            1 << 20,
            2 << 20,
        ]
    };
    let counts: &[usize] = if quick {
        &[64, 1024]
    } else {
        &[64, 256, 1024, 4096]
    };
    let reps = if quick { 3 } else { 7 };
    println!(
        "{:<6} {:>9} {:>6} {:<13} {:>9} {:>8} {:>10} {:>10}",
        "dir", "block", "blocks", "strategy", "GB/s", "%ceil", "submit_us", "device_us"
    );
    let mut job = 0u64;
    for &block in sizes {
        for &count in counts {
            let bytes = block * count as u64;
            if bytes > MAX_JOB_BYTES {
                continue;
            }
            let num_blocks = (2 * count + 1) as u32;
            let gpu = GpuLayout::cross_layer(dev.addr(), num_blocks, block, block)?;
            let row = HostRowLayout::uniform(1, 1, &[block])?;
            let chunks = (MAX_JOB_BYTES / row.row_bytes()).min(u64::from(u32::MAX)) as u32;
            let layout = WorkerLayout::new(gpu, row, 0, pool.addr(), chunks)?;
            // Every other block (scattered, never coalesced), chunks reversed.
            let blocks: Vec<u32> = (0..count as u32).map(|i| 1 + 2 * i).collect();
            let chunk_ids: Vec<u32> = (0..count as u32).rev().collect();
            let spec = TransferSpec::new(&blocks, 0, &chunk_ids);
            let compute = ctx.new_stream().map_err(|e| CudaError::Driver {
                op: "stream",
                message: format!("{e:?}"),
            })?;
            // SAFETY: `dev` and `pool` outlive the backend (dropped at the end of
            // this iteration, which synchronises its streams).
            let mut backend = unsafe {
                CudaBackend::new(ctx.clone(), layout, compute, CudaBackendOptions::default())?
            };
            for dir in Direction::ALL {
                for strategy in Strategy::ALL {
                    backend.force_strategy(Some(strategy));
                    let mut best_dev = Duration::MAX;
                    let mut best_submit = Duration::MAX;
                    for _ in 0..reps {
                        job += 1;
                        let t = Instant::now();
                        let r = match dir {
                            Direction::Store => backend.submit_store(JobId(job), &spec),
                            Direction::Load => backend.submit_load(JobId(job), &spec),
                        };
                        let submit = t.elapsed();
                        if let Err(e) = r {
                            eprintln!("submit failed: {e}");
                            break;
                        }
                        if let Err(e) = backend.wait(&[JobId(job)], Some(Duration::from_secs(60))) {
                            eprintln!("wait failed: {e}");
                            break;
                        }
                        let mut out = Vec::new();
                        backend.poll(&mut out);
                        for res in out {
                            if res.success {
                                best_dev = best_dev.min(res.duration);
                            }
                        }
                        best_submit = best_submit.min(submit);
                    }
                    let gbps = bytes as f64 / best_dev.as_secs_f64() / 1e9;
                    points.push((dir, block, count, strategy, gbps));
                    println!(
                        "{:<6} {:>9} {:>6} {:<13} {:>9.2} {:>7.1}% {:>10.1} {:>10.1}",
                        dir.to_string(),
                        human(block),
                        count,
                        strategy.name(),
                        gbps,
                        100.0 * gbps / ceiling[dir.index()],
                        best_submit.as_secs_f64() * 1e6,
                        best_dev.as_secs_f64() * 1e6
                    );
                }
            }
            println!("# stats {}x{}: {:?}", human(block), count, backend.stats());
        }
    }
    Ok(points)
}

/// GB/s of one large pinned memcpy (best of 3), timed with events.
fn ceiling_gbps(
    ctx: &Arc<CudaContext>,
    dev: &DeviceBuffer,
    pool: &PinnedBuffer,
    dir: Direction,
) -> Result<f64, CudaError> {
    let stream = ctx.new_stream().map_err(|e| CudaError::Driver {
        op: "stream",
        message: format!("{e:?}"),
    })?;
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = ctx.new_event(flags).map_err(|e| CudaError::Driver {
        op: "event",
        message: format!("{e:?}"),
    })?;
    let e1 = ctx.new_event(flags).map_err(|e| CudaError::Driver {
        op: "event",
        message: format!("{e:?}"),
    })?;
    let bytes = pool.len();
    let mut best = 0f64;
    for _ in 0..3 {
        e0.record(&stream).map_err(|e| CudaError::Driver {
            op: "record",
            message: format!("{e:?}"),
        })?;
        let (dst, src) = match dir {
            Direction::Store => (pool.addr(), dev.addr()),
            Direction::Load => (dev.addr(), pool.addr()),
        };
        // SAFETY: both buffers hold at least `bytes`; synchronised below.
        let r = unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream.cu_stream()) };
        r.result().map_err(|e| CudaError::Driver {
            op: "cuMemcpyAsync",
            message: format!("{e:?}"),
        })?;
        e1.record(&stream).map_err(|e| CudaError::Driver {
            op: "record",
            message: format!("{e:?}"),
        })?;
        let ms = e0.elapsed_ms(&e1).map_err(|e| CudaError::Driver {
            op: "elapsed",
            message: format!("{e:?}"),
        })?;
        best = best.max(bytes as f64 / (f64::from(ms) / 1e3) / 1e9);
    }
    Ok(best)
}

fn human(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{}MiB", b >> 20)
    } else {
        format!("{}KiB", b >> 10)
    }
}
