//! Lookup delay histograms (vLLM `test_scheduler_reports_lookup_sync_delay`,
//! `test_scheduler_reports_lookup_async_delay_on_resolve`), on injected clocks:
//! no test sleeps.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::{Geo, H, b, hashes, key, r};
use kvoffload::manager::StoreOutcome;
use kvoffload::metrics::OffloadMetrics;
use kvoffload::scheduler::{LookupOutcome, Scheduler};
use kvoffload::{Clock, OffloadConfig};

/// A clock that moves `step` forward every time it is read.
#[derive(Debug)]
struct TickClock {
    nanos: AtomicU64,
    step: u64,
}

impl Clock for TickClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.fetch_add(self.step, Ordering::Relaxed))
    }
}

#[test]
fn scheduler_reports_lookup_sync_delay() {
    let step_ns = 3_000_000; // 3 ms per clock read
    let clock = Arc::new(TickClock {
        nanos: AtomicU64::new(0),
        step: step_ns,
    });
    let cfg = OffloadConfig {
        tokens_per_block: 4,
        ..OffloadConfig::with_chunks(16)
    };
    let mut s = Scheduler::new(&cfg, clock).expect("scheduler");
    s.add_request(r(1), 8, &hashes(1, 0..2)).expect("add");
    assert_eq!(s.lookup(r(1), 0).expect("lookup"), LookupOutcome::Hit(0));
    let d = s.lookup_delays();
    assert_eq!(d.sync.count(), 1);
    assert_eq!(d.async_.count(), 0);
    // The call's own duration on the scheduler's clock: at least one tick.
    let secs = d.sync.sum();
    assert!(
        secs >= step_ns as f64 / 1e9 && (secs * 1e9 / step_ns as f64).fract() < 1e-6,
        "{secs}"
    );
    // Each resolving call is one observation; unknown requests record nothing.
    s.lookup(r(1), 4).expect("lookup");
    assert!(s.lookup(r(9), 0).is_err());
    assert_eq!(s.lookup_delays().sync.count(), 2);

    let m = OffloadMetrics {
        lookup: s.lookup_delays().clone(),
        ..OffloadMetrics::default()
    };
    let text = m.render();
    assert!(
        text.contains("vllm:kv_offload_lookup_sync_delay_seconds_count 2\n"),
        "{text}"
    );
    assert!(text.contains("vllm:kv_offload_lookup_async_delay_seconds_count 0\n"));
}

#[test]
fn scheduler_reports_lookup_async_delay_on_resolve() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8); // 2 chunks of 1 block
    let k = [key(1, 0, 1), key(1, 1, 1)];
    // Both chunks are being written: the lookup defers.
    h.s.manager_mut().prepare_store(&k, None).unwrap();
    h.advance_s(1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer);
    h.advance_s(2);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer, "still pending");
    assert_eq!(h.s.lookup_delays().async_.count(), 0, "not resolved yet");
    assert_eq!(
        h.s.lookup_delays().sync.count(),
        0,
        "a deferral is no sync delay"
    );
    h.s.manager_mut()
        .complete_store(&k, StoreOutcome::Success, None)
        .unwrap();
    h.advance_s(3);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let d = h.s.lookup_delays();
    assert_eq!(d.async_.count(), 1, "reported once, on resolve");
    assert_eq!(
        d.async_.sum(),
        5.0,
        "from the first deferral, not the latest"
    );
    assert_eq!(d.sync.count(), 0, "the resolving call is not a sync delay");

    // Asked again after resolving: a new, synchronous lookup; the async
    // delay is not reported a second time.
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let d = h.s.lookup_delays();
    assert_eq!(d.async_.count(), 1);
    assert_eq!(d.sync.count(), 1);
    assert_eq!(
        d.sync.sum(),
        0.0,
        "the manual clock did not move during the call"
    );

    // A deferral by a job in flight resolves the same way.
    h.alloc(1, &b(1..=2), 8);
    h.advance_s(10);
    assert_eq!(
        h.lookup(1, 0),
        LookupOutcome::Defer,
        "its load is in flight"
    );
    h.advance_s(1);
    let plan = h.run(&[], &[], &[]);
    h.complete(&common::jobs_of(&plan.loads), 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let d = h.s.lookup_delays();
    assert_eq!(d.async_.count(), 2);
    assert_eq!(d.async_.sum(), 6.0);
    let m = OffloadMetrics {
        lookup: d.clone(),
        ..OffloadMetrics::default()
    };
    let text = m.render();
    assert!(text.contains("vllm:kv_offload_lookup_async_delay_seconds_count 2\n"));
    assert!(text.contains("vllm:kv_offload_lookup_async_delay_seconds_bucket{le=\"1e0\"} 1\n"));
    assert!(text.contains("vllm:kv_offload_lookup_async_delay_seconds_bucket{le=\"5e0\"} 2\n"));
}
