//! How the scheduler's step cost grows: with the number of running requests
//! (64 to 16,384, one in 16 completing a block each step, over a full 64 K-chunk
//! host tier) and with the host tier's size (64 K to 16 M chunks, full and
//! evicting, 1,024 running). vLLM 0.33's connector hooks grow linearly with the
//! running requests (about 5 µs each); `docs/perf.md` puts the two side by side.
//!
//! `cargo bench --bench scheduler_scaling` (the 16 M-chunk tier takes about
//! 2 GB and a minute to fill).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvoffload::ManualClock;

#[path = "common/decode.rs"]
mod decode;

use decode::Decode;

/// Tokens per block: one request in 16 completes a block (and stores) per step.
const TPB: u32 = 16;

/// Steps run untimed before measuring, so that the tier is in its steady
/// state (full, every store evicting) and the requests' states have grown.
const WARM_STEPS: u64 = 64;

fn steady(running: u64, chunks: u64) -> Decode {
    let mut d = Decode::new(running, TPB, ManualClock::new().shared(), 10_000, chunks);
    d.fill_tier(chunks);
    d.timed_steps(WARM_STEPS);
    d
}

fn by_running(c: &mut Criterion) {
    let mut g = c.benchmark_group("step_by_running_requests");
    for running in [64u64, 256, 1024, 4096, 16_384] {
        let mut d = steady(running, 1 << 16);
        g.bench_with_input(BenchmarkId::from_parameter(running), &running, |b, _| {
            b.iter_custom(|iters| d.timed_steps(iters));
        });
        assert_eq!(d.s.state().jobs, 0, "every store completed");
    }
    g.finish();
}

fn by_tier_size(c: &mut Criterion) {
    let mut g = c.benchmark_group("step_by_tier_chunks");
    g.sample_size(30);
    for chunks in [1u64 << 16, 1 << 20, 1 << 24] {
        let mut d = steady(1024, chunks);
        let st = d.s.manager().stats();
        assert_eq!(st.free, 0, "the tier is full: {st:?}");
        g.bench_with_input(BenchmarkId::from_parameter(chunks), &chunks, |b, _| {
            b.iter_custom(|iters| d.timed_steps(iters));
        });
        drop(d);
    }
    g.finish();
}

criterion_group!(benches, by_running, by_tier_size);
criterion_main!(benches);
