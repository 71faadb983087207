//! Scheduler benchmarks: one step with 1024 running requests (64 or all 1024
//! of them planning a store), a stall scan of 1 M in-flight jobs, and the step's
//! latency while the watchdog thread scans that table.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvoffload::scheduler::{ScheduledRequest, Scheduler, StepInput, StepPlan, WorkerReport};
use kvoffload::{
    BlockHash, GpuBlockId, ManualClock, MonotonicClock, OffloadConfig, RequestId, SharedClock,
};

const RUNNING: u64 = 1024;

/// 1024 decoding requests; a request plans a store whenever it completes a block.
struct Sim {
    s: Scheduler,
    tpb: u64,
    tokens: Vec<u64>,
    next_block: u32,
    input: StepInput,
}

impl Sim {
    /// `tpb` tokens per block (1 chunk = 1 block): with tpb = 16, 64 of the 1024
    /// requests complete a block in each step; with tpb = 1, all of them do.
    fn new(tpb: u32, clock: SharedClock, scan_interval_ms: u64, chunks: u64) -> Self {
        let cfg = OffloadConfig {
            tokens_per_block: tpb,
            blocks_per_chunk: 1,
            offload_prompt_only: false,
            stall_scan_interval_ms: scan_interval_ms,
            ..OffloadConfig::with_chunks(chunks)
        };
        let mut s = Scheduler::new(&cfg, clock).expect("scheduler");
        let tpb = u64::from(tpb);
        let mut tokens = Vec::new();
        let mut input = StepInput::default();
        for r in 0..RUNNING {
            // Staggered so that block completions spread evenly over steps.
            let t = r % tpb;
            s.add_request(RequestId(r), t.max(1), &[]).unwrap();
            s.lookup(RequestId(r), 0).unwrap();
            s.on_alloc(RequestId(r), &[], 0).unwrap();
            tokens.push(t);
            input.scheduled.push(ScheduledRequest {
                req: RequestId(r),
                new_block_ids: Vec::with_capacity(1),
                computed_tokens: t,
                scheduled_tokens: 1,
                full_table: false,
            });
        }
        Self {
            s,
            tpb,
            tokens,
            next_block: 1,
            input,
        }
    }

    /// Untimed: each request has one more token; a completed block gets its hash
    /// and a new GPU block is allocated for the next one.
    fn prepare(&mut self) {
        for (i, e) in self.input.scheduled.iter_mut().enumerate() {
            let r = RequestId(i as u64);
            e.new_block_ids.clear();
            let t = self.tokens[i];
            if t.is_multiple_of(self.tpb) {
                e.new_block_ids.push(GpuBlockId(self.next_block));
                self.next_block = self.next_block.wrapping_add(1).max(1);
            }
            e.computed_tokens = t;
            let n = t + 1;
            let hash: &[BlockHash] = if n.is_multiple_of(self.tpb) {
                &[BlockHash((i as u64) << 40 | n)][..]
            } else {
                &[]
            };
            let h = hash.to_vec();
            self.s.update_request(r, n, &h).unwrap();
            self.tokens[i] = n;
        }
    }

    fn step(&mut self) -> StepPlan {
        self.s.build_step(&self.input).unwrap()
    }

    fn complete(&mut self, plan: StepPlan) {
        let report = WorkerReport {
            completed: plan.stores.iter().map(|j| (j.job, 1)).collect(),
            failed: vec![],
        };
        self.s.on_worker_output(&report);
        // The backend drains the host tier's events every step (as the sim does).
        black_box(self.s.take_events());
        // ... and hands the plan back for reuse (as the sim does).
        self.s.recycle_plan(plan);
    }

    /// Timed steps (only `build_step` is timed); stores complete and events are
    /// drained untimed, and a
    /// watchdog scan runs untimed every 100 steps (as the thread would every
    /// scan interval), which keeps the deadline queue short.
    fn timed_steps(&mut self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        let watchdog = self.s.watchdog_handle();
        for i in 0..iters {
            if i % 100 == 0 {
                watchdog.scan();
            }
            self.prepare();
            let t0 = Instant::now();
            let plan = black_box(self.step());
            total += t0.elapsed();
            self.complete(plan);
        }
        total
    }
}

/// The step with 1024 running requests over a 64 K-chunk host tier (full and
/// evicting in steady state); only `build_step` is timed.
fn step_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_step");
    for (name, tpb) in [
        ("1024_running_0_storing", 65_536u32),
        ("1024_running_64_storing", 16),
        ("1024_running_1024_storing", 1),
    ] {
        let mut sim = Sim::new(tpb, ManualClock::new().shared(), 10_000, 1 << 16);
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
    let mut sim = Sim::new(1, clock, scan_interval_ms, 4 << 20);
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
