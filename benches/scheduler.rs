//! Scheduler benchmarks: one step with 1024 running requests (64 or all 1024
//! of them planning a store), a stall scan of 1 M in-flight jobs, and the step's
//! latency while the watchdog thread scans that table.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvoffload::{ManualClock, MonotonicClock, SharedClock};

// `fill_tier` serves `scheduler_scaling` only.
#[allow(dead_code)]
#[path = "common/decode.rs"]
mod decode;

use decode::Decode as Sim;

const RUNNING: u64 = 1024;

/// The step with 1024 running requests over a 64 K-chunk host tier (full and
/// evicting in steady state); only `build_step` is timed.
fn step_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_step");
    for (name, tpb) in [
        ("1024_running_0_storing", 65_536u32),
        ("1024_running_64_storing", 16),
        ("1024_running_1024_storing", 1),
    ] {
        let mut sim = Sim::new(RUNNING, tpb, ManualClock::new().shared(), 10_000, 1 << 16);
        g.bench_function(name, |b| b.iter_custom(|iters| sim.timed_steps(iters)));
        assert_eq!(sim.s.state().jobs, 0, "every store completed");
    }
    g.finish();
}

/// A scheduler with 1 M store jobs in flight (never completed), plus the 1024
/// running requests of the step benchmark.
fn loaded(clock: SharedClock, scan_interval_ms: u64) -> Sim {
    // Room for the 1 M pending chunks and everything the measurement stores,
    // so that no eviction has to skip over pending chunks.
    let mut sim = Sim::new(RUNNING, 1, clock, scan_interval_ms, 4 << 20);
    for _ in 0..1024 {
        sim.prepare();
        let _ = sim.step();
    }
    assert!(sim.s.state().jobs >= 1 << 20);
    sim
}

fn scan_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("stall_scan");
    g.sample_size(20);
    let mut sim = loaded(ManualClock::new().shared(), 10_000);
    let handle = sim.s.watchdog_handle();
    g.bench_function("scan_1M_jobs", |b| {
        b.iter(|| black_box(sim.s.scan_now()));
    });
    g.bench_function("scan_full_1M_jobs", |b| {
        b.iter(|| black_box(handle.scan_full()));
    });
    drop(sim);
    g.finish();

    // Step latency (64 of 1024 storing, as in the target) with 1 M jobs in the
    // table: without scans, with the watchdog thread (deadline-queue scans every
    // 1 ms), and with a thread running full-table scans back to back.
    let mut g = c.benchmark_group("step_during_scan");
    for (name, mode) in [
        ("without_scan", 0),
        ("with_watchdog_scans", 1),
        ("with_full_scans", 2),
    ] {
        let mut sim = loaded(MonotonicClock::shared(), 1);
        // Switch to the 64-storing pattern: only every 16th request completes a block.
        // Staggered, so that 64 requests store in each step.
        sim.tpb = 16;
        for (i, t) in sim.tokens.iter_mut().enumerate() {
            *t = (*t / 16) * 16 + i as u64 % 16;
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut scanner = None;
        if mode == 1 {
            sim.s.start_watchdog().unwrap();
        } else if mode == 2 {
            let h = sim.s.watchdog_handle();
            let stop = std::sync::Arc::clone(&stop);
            scanner = Some(std::thread::spawn(move || {
                let mut scans = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    black_box(h.scan_full());
                    scans += 1;
                }
                scans
            }));
        }
        g.bench_function(name, |b| b.iter_custom(|iters| sim.timed_steps(iters)));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = scanner {
            let scans = t.join().unwrap();
            eprintln!("{name}: {scans} full scans ran during the measurement");
        }
        drop(sim);
    }
    g.finish();
}

criterion_group!(benches, step_benches, scan_benches);
criterion_main!(benches);
