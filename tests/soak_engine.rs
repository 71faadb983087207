//! Soak of the whole engine: `kvoffload sim`'s workload (shared prefixes,
//! multi-turn conversations, preemptions, resets with requests running)
//! through the real scheduler and the real host-backend worker threads, with
//! 5 % of transfers stalled plus late, duplicate and failed reports.
//!
//! The `#[ignore]`d runs (130,000 requests at a low arrival rate, and the
//! README's main command at 1,000,000 requests) go past 1 M steps and check zero leaks and flat
//! memory: resident memory grows < 5 % between the first tenth after the
//! warm-up (the second) and the last, and the live heap (counted by this
//! test's global allocator) < 1 MiB:
//! `cargo test --release --test soak_engine -- --ignored --nocapture --test-threads=1`
//! (one at a time: each measures the whole process's memory;
//! `KVOFFLOAD_ENGINE_SOAK_REQUESTS=N` and `KVOFFLOAD_ENGINE_SOAK_RATE=P` change its
//! size and its arrival rate). CI runs a short one.
//! `tests/soak.rs` is the control-plane-only soak (simulated workers).

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use std::time::Instant;

use kvoffload::harness::sim::{FaultRates, Sim, SimOptions, default_config};

/// Counts the bytes live on the heap, so that the soak tells heap growth
/// (structures that grow) from resident-memory growth the allocator alone
/// causes (fragmentation, arenas of worker threads).
#[global_allocator]
static ALLOCATOR: counting_alloc::Counting = counting_alloc::Counting;

/// Bytes live on the heap (allocated through Rust's global allocator).
fn heap_bytes() -> u64 {
    counting_alloc::live_bytes().max(0) as u64
}

/// One memory sample, every 1,000 steps.
struct Sample {
    rss: u64,
    heap: u64,
}

/// The soak's workload: the sim's, at a lower arrival rate, with 5 % stalls.
fn soak_options(requests: u64) -> SimOptions {
    SimOptions {
        seed: 42,
        requests,
        reset_every: 2_000,
        // New conversations per step (while fewer than `max_conversations` are
        // open), each of several turns.
        arrival_rate: std::env::var("KVOFFLOAD_ENGINE_SOAK_RATE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.05),
        faults: FaultRates {
            stall: 0.05,
            late: 0.02,
            duplicate: 0.02,
            fail: 0.01,
            max_delay_steps: 40,
            hang: 0.0,
        },
        ..SimOptions::default()
    }
}

fn soak(opts: SimOptions, check_memory: bool) {
    let requests = opts.requests;
    let mut samples: Vec<Sample> = Vec::new();
    let t0 = Instant::now();
    let out = Sim::new(default_config(), opts)
        .expect("valid sim options")
        .run(&mut |p| {
            if p.step.is_multiple_of(1_000) {
                samples.push(Sample {
                    rss: counting_alloc::rss_bytes(),
                    heap: heap_bytes(),
                });
            }
        })
        .expect("the sim runs and drains");
    let s = out.summary;
    assert_eq!(s.invariant_error, None);
    assert_eq!(s.leaks.total, 0, "leaks after drain: {:?}", s.leaks);
    assert_eq!(s.work.finished, requests, "every request finishes");
    assert_eq!(s.content.mismatches, 0, "content check: {:?}", s.content);
    let f = &s.faults;
    assert!(f.injected_stalls > 0, "{f:?}");
    assert_eq!(
        f.injected_stalls_detected + f.stalls_forced_by_flush,
        f.injected_stalls,
        "every injected stall is detected or forced by a flush: {f:?}"
    );
    assert_eq!(
        f.stalled_stores + f.stalled_loads,
        f.injected_stalls_detected + f.late_reports_detected + f.queued_behind_late_detected,
        "every detected stall has a named cause: {f:?}"
    );
    println!(
        "engine soak: {} steps, {requests} requests, {:.1} s wall, {} stalls injected, {} resets",
        s.steps,
        t0.elapsed().as_secs_f64(),
        f.injected_stalls,
        f.resets
    );
    if check_memory && samples.len() >= 20 {
        let tenth = samples.len() / 10;
        let rss = |xs: &[Sample]| xs.iter().map(|x| x.rss).sum::<u64>() / xs.len() as u64;
        let heap = |xs: &[Sample]| xs.iter().map(|x| x.heap).sum::<u64>() / xs.len() as u64;
        // Skip the warm-up: the first tenth is measured after it.
        let (second, last) = (
            &samples[tenth..2 * tenth],
            &samples[samples.len() - tenth..],
        );
        let (first, last_rss) = (rss(second), rss(last));
        let growth = (last_rss as f64 - first as f64) / first as f64 * 100.0;
        let (h1, h2) = (heap(second), heap(last));
        println!(
            "engine soak RSS: second tenth {} KiB, last tenth {} KiB, growth {growth:+.2} %; \
             live heap {} KiB -> {} KiB ({:+} KiB)",
            first / 1024,
            last_rss / 1024,
            h1 / 1024,
            h2 / 1024,
            (h2 as i64 - h1 as i64) / 1024
        );
        let tenths: Vec<String> = (0..10)
            .map(|t| {
                let xs = &samples[t * tenth..(t + 1) * tenth];
                format!("{}/{}", rss(xs) / 1024, heap(xs) / 1024)
            })
            .collect();
        println!("engine soak RSS/heap KiB by tenth: {}", tenths.join(" "));
        // Structures that grow with the steps show on the heap first (the
        // worker threads' records of cancelled stalls grew it by about 4 MiB
        // over a million steps); RSS also carries the allocator's slack.
        assert!(
            h2 < h1 + (1 << 20),
            "live heap grew {} KiB",
            (h2 - h1) / 1024
        );
        assert!(growth < 5.0, "resident memory grew {growth:.2} %");
    }
}

#[test]
fn engine_soak_short_has_no_leaks() {
    soak(soak_options(400), false);
}

#[test]
#[ignore = "long: about a million steps; run with --release -- --ignored"]
fn engine_soak_a_million_steps_is_flat_and_leak_free() {
    let requests = std::env::var("KVOFFLOAD_ENGINE_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(130_000);
    soak(soak_options(requests), true);
}

/// The README's main command (`kvoffload sim`: its workload, faults and
/// resets) at a million requests, about 6.4 M steps: it finishes every request,
/// drains to zero leaks, stays within the progress limit, and its memory stays
/// flat once steady (as the shorter soak above checks):
/// `cargo test --release --test soak_engine main_command -- --ignored --nocapture`.
#[test]
#[ignore = "long: about 8 minutes in release; run with --release -- --ignored"]
fn main_command_at_a_million_requests_is_flat_and_leak_free() {
    soak(
        SimOptions {
            requests: 1_000_000,
            ..SimOptions::default()
        },
        true,
    );
}
