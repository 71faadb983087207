//! Scheduler counters and gauges (plain values; exported by the metrics layer),
//! and the lookup delay histograms.

use crate::histogram::Histogram;

/// Bucket bounds (seconds) of the lookup delay histograms: a synchronous
/// lookup takes microseconds, a deferred one up to a stall timeout.
pub const LOOKUP_DELAY_BUCKETS: [f64; 12] = [
    1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0,
];

/// Raw observations kept for [`LookupDelays::take_recent`] at most (per
/// histogram): a backend that never takes them loses the newest, not memory.
pub const MAX_RECENT_DELAYS: usize = 1 << 16;

/// How long lookups took to resolve, measured with the scheduler's clock
/// (vLLM `kv_offload_lookup_{sync,async}_delay_seconds`).
#[derive(Debug, Clone, PartialEq)]
pub struct LookupDelays {
    /// Duration of each lookup call that resolved without ever deferring (seconds).
    pub sync: Histogram,
    /// From the first deferral of a request's lookup to the call that
    /// resolved it, or to the request's end (seconds), once per deferral.
    pub async_: Histogram,
    /// Observations not yet taken, `(sync, async)`: vLLM's stats carry each
    /// value (its Prometheus histograms bucket them at the exporter).
    recent: (Vec<f64>, Vec<f64>),
}

impl Default for LookupDelays {
    fn default() -> Self {
        Self {
            sync: Histogram::new(&LOOKUP_DELAY_BUCKETS),
            async_: Histogram::new(&LOOKUP_DELAY_BUCKETS),
            recent: (Vec::new(), Vec::new()),
        }
    }
}

impl LookupDelays {
    /// A lookup that resolved without deferring took `secs`.
    pub(crate) fn observe_sync(&mut self, secs: f64) {
        self.sync.observe(secs);
        if self.recent.0.len() < MAX_RECENT_DELAYS {
            self.recent.0.push(secs);
        }
    }

    /// A deferred lookup resolved (or its request ended) `secs` after its
    /// first deferral.
    pub(crate) fn observe_async(&mut self, secs: f64) {
        self.async_.observe(secs);
        if self.recent.1.len() < MAX_RECENT_DELAYS {
            self.recent.1.push(secs);
        }
    }

    /// The observations since the last call, `(sync, async)`, in order.
    pub fn take_recent(&mut self) -> (Vec<f64>, Vec<f64>) {
        std::mem::take(&mut self.recent)
    }
}

/// A snapshot of the scheduler's counters and gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerMetrics {
    /// Store jobs the watchdog declared stalled (counter).
    pub stalled_stores: u64,
    /// Load jobs the watchdog declared stalled (counter).
    pub stalled_loads: u64,
    /// Worker reports that arrived for stalled jobs (counter).
    pub late_reports: u64,
    /// Of those, the reports that found their job handed over by the watchdog
    /// while the report was being applied: the completion path and the stall
    /// raced on the job's latch, and the stall won (counter).
    pub reports_racing_stall: u64,
    /// Worker reports for jobs that never existed or beyond what a job expects (counter).
    pub unknown_reports: u64,
    /// Stalled jobs released by a cancellation confirmation (counter).
    pub cancellations_confirmed: u64,
    /// `prepare_store` calls that could not allocate (counter).
    pub allocation_failures: u64,
    /// Jobs created (counter).
    pub jobs_created: u64,
    /// `request_finished` calls made to the manager (counter).
    pub manager_request_finished: u64,
    /// Hand-off stores flushed because their block was allocated again in
    /// the step that handed it over (counter; see
    /// `docs/vllm-connector.md`, "Speculative decoding").
    pub handoffs_flushed: u64,
    /// Watchdog scans (counter).
    pub scans: u64,
    /// Live jobs (gauge).
    pub jobs_in_flight: u64,
    /// Stalled jobs awaiting late reports (gauge).
    pub stalled_jobs: u64,
    /// Host chunks held by stalled jobs (gauge).
    pub quarantined_chunks: u64,
}

/// The counters the scheduler thread owns.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub stalled_stores: u64,
    pub stalled_loads: u64,
    pub late_reports: u64,
    pub reports_racing_stall: u64,
    pub unknown_reports: u64,
    pub cancellations_confirmed: u64,
    pub allocation_failures: u64,
    pub jobs_created: u64,
    pub manager_request_finished: u64,
    pub handoffs_flushed: u64,
}
