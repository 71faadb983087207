//! Lookup delay histograms (vLLM `test_scheduler_reports_lookup_sync_delay`,
//! `test_scheduler_reports_lookup_async_delay_on_resolve`, and what vLLM
//! 0.33's `get_num_new_matched_tokens` and `request_finished` do: every call
//! that looks the tier up is a sync observation, deferring or not; one
//! deferred by the request's own jobs in flight is none and starts no async
//! clock), on injected clocks: no test sleeps.

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
        2,
        "each call that looked the tier up is a sync observation (vLLM)"
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
    assert_eq!(d.sync.count(), 3, "the resolving call is one too");

    // Asked again after resolving: one more sync observation; the async
    // delay is not reported a second time.
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let d = h.s.lookup_delays();
    assert_eq!(d.async_.count(), 1);
    assert_eq!(d.sync.count(), 4);
    assert_eq!(
        d.sync.sum(),
        0.0,
        "the manual clock did not move during the calls"
    );

    // A deferral by the request's own job in flight looks nothing up (vLLM
    // returns before its lookup): no sync observation, no async clock.
    h.alloc(1, &b(1..=2), 8);
    h.advance_s(10);
    assert_eq!(
        h.lookup(1, 0),
        LookupOutcome::Defer,
        "its load is in flight"
    );
    assert_eq!(h.s.lookup_delays().sync.count(), 4);
    h.advance_s(1);
    let plan = h.run(&[], &[], &[]);
    h.complete(&common::jobs_of(&plan.loads), 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let d = h.s.lookup_delays();
    assert_eq!(d.async_.count(), 1, "no async delay for that deferral");
    assert_eq!(d.sync.count(), 5);

    // A second deferral by the tier (a pending chunk) times from its first call.
    h.add(2, 2, 8);
    let k2 = [key(2, 0, 1), key(2, 1, 1)];
    h.s.manager_mut().prepare_store(&k2, None).unwrap();
    assert_eq!(h.lookup(2, 0), LookupOutcome::Defer);
    h.advance_s(1);
    h.s.manager_mut()
        .complete_store(&k2, StoreOutcome::Success, None)
        .unwrap();
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(8));
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

/// vLLM observes the async delay "on resolve, or request finish": a request
/// that ends while its lookup is still deferred reports its wait then, once.
#[test]
fn a_request_ending_while_deferred_reports_its_async_delay() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    let k = [key(1, 0, 1), key(1, 1, 1)];
    h.s.manager_mut().prepare_store(&k, None).unwrap();
    h.advance_s(1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer);
    h.advance_s(4);
    h.s.request_finished(r(1), &[], true, 0).expect("finish");
    let d = h.s.lookup_delays();
    assert_eq!(d.async_.count(), 1, "reported at the request's end");
    assert_eq!(d.async_.sum(), 4.0);
    // Each observation is also kept raw until taken (vLLM's stats carry
    // them): the deferring call's duration (0 on the manual clock), the wait.
    assert_eq!(h.s.take_lookup_delays(), (vec![0.0], vec![4.0]));
    assert_eq!(h.s.take_lookup_delays(), (vec![], vec![]), "taken once");
    // Finishing again (an unknown request now) reports nothing more.
    h.s.request_finished(r(1), &[], true, 0)
        .expect("finish again");
    assert_eq!(h.s.lookup_delays().async_.count(), 1);
}

#[test]
fn raw_sync_delays_are_kept_in_order_until_taken() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.add(2, 2, 8);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0));
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(0));
    let (sync, asynchronous) = h.s.take_lookup_delays();
    assert_eq!(sync.len(), 2, "one per resolving call");
    assert!(asynchronous.is_empty());
    assert_eq!(
        h.s.lookup_delays().sync.count(),
        2,
        "the histogram keeps counting"
    );
}
