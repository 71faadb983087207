//! Heap allocations of the scheduler's step: a deterministic guard for the
//! step benchmark's hot path (the time itself is measured by
//! `cargo bench --bench scheduler`, never in a test).
//!
//! 1024 decoding requests, 64 of which complete a chunk per step, over a host
//! tier that is full and evicting. In steady state a step allocates nothing:
//! job state, key, slot and block lists live inline or in reused buffers, the
//! event log keeps all keys in one buffer, and the plan's lists reuse the
//! buffers of the plan handed back by `recycle_plan` (a plan that is only
//! dropped costs its store list's allocation in the next step).
//! Counted by a test-only global allocator, on the test's own thread.

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
// The scheduler benchmark's decode-only backend: the step measured there is
// the step counted here.
#[allow(dead_code)]
#[path = "../benches/common/decode.rs"]
mod decode;

use counting_alloc::allocations;
use decode::Decode;
use kvoffload::ManualClock;

#[global_allocator]
static ALLOCATOR: counting_alloc::Counting = counting_alloc::Counting;

const RUNNING: u64 = 1024;
const TOKENS_PER_BLOCK: u32 = 16;

#[test]
fn a_steady_step_allocates_nothing() {
    // Host tier of 2048 chunks; the watchdog scan left to the loop below.
    let mut d = Decode::new(
        RUNNING,
        TOKENS_PER_BLOCK,
        ManualClock::new().shared(),
        1000,
        2048,
    );
    let mut counted_steps = 0u64;
    let mut counted_allocs = 0u64;
    let mut counted_stores = 0u64;
    for step in 0..500 {
        d.prepare();
        let (plan, allocs) = allocations(|| d.step());
        // Steady state: the tier (2048 chunks) is full after about 32 steps.
        // Each request's block list (and access list) doubles its capacity
        // when it reaches 16 blocks (steps 256-271 here) and again at 32
        // (steps 512-527): amortised growth, left out of the window.
        if (272..500).contains(&step) {
            counted_steps += 1;
            counted_allocs += allocs;
            counted_stores += plan.stores.len() as u64;
        }
        d.complete(plan);
        if step % 100 == 0 {
            // What the watchdog thread does every scan interval.
            d.s.scan_now();
        }
    }
    assert_eq!(d.s.state().jobs, 0, "every store completed");
    // None at all in steady state. Before the step was reworked it made about
    // 6 allocations per store (over 380 per step), and 1.3 per step while the
    // plan's store list was allocated afresh.
    let per_store = counted_allocs as f64 / counted_stores as f64;
    assert_eq!(
        counted_allocs, 0,
        "{counted_allocs} allocations in {counted_steps} steps with {counted_stores} stores \
         ({per_store:.2} per store)"
    );
    assert!(counted_stores >= 60 * counted_steps, "the workload stores");
}
