//! Soak: the control plane under a long simulated load (shared prefixes,
//! preemptions, aborts, 5% stalled transfers reported late or cancelled,
//! failed transfers, periodic resets). Ends with a full drain that must leave
//! nothing behind, and (long run) resident memory flat after warm-up.
//!
//! CI runs the short variant; the 1 M-step run:
//! `cargo test --release --test soak -- --ignored --nocapture`.

#[path = "common/counting_alloc.rs"]
mod counting_alloc;
#[path = "common/driver.rs"]
mod driver;
#[path = "common/rng.rs"]
mod rng;
#[path = "soak_sim/mod.rs"]
mod soak_sim;

use std::time::Instant;

use soak_sim::{Sim, SoakParams, summary};

#[test]
fn soak_short_no_leaks() {
    let p = SoakParams {
        steps: 20_000,
        stall_rate: 0.05,
        reset_every: 1_000,
        check_every: 1,
        rss_samples: 50,
        seed: 7,
    };
    let t = Instant::now();
    let r = Sim::new(p).run();
    println!("{}", summary(&r, t.elapsed()));
    assert!(r.stalled > 10, "stalls exercised: {}", r.stalled);
    assert!(
        r.late_reports > 0 && r.cancelled > 0,
        "late reports and cancellations exercised"
    );
    assert!(r.resets >= 19 && r.preemptions > 0 && r.loads > 0, "{r:?}");
}

#[test]
#[ignore = "1 M steps: run in release, see docs/reliability.md"]
fn soak_1m_steps_flat_memory() {
    let steps: u64 = std::env::var("KVOFFLOAD_SOAK_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let p = SoakParams {
        steps,
        stall_rate: 0.05,
        reset_every: 20_000,
        check_every: 1_000,
        rss_samples: 1_000,
        seed: 1,
    };
    let t = Instant::now();
    let r = Sim::new(p).run();
    let wall = t.elapsed();
    println!("{}", summary(&r, wall));
    let (_, _, growth) = r.rss_growth();
    assert!(
        growth < 5.0,
        "resident memory grew {growth:.2}% between the first and last tenth"
    );
}
