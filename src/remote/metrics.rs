//! The remote tier's counters, gauges and latency histograms.
//!
//! Counters are atomics (the step thread counts drops and timeouts without a
//! lock); the latency histograms are updated by the I/O thread once per
//! batch under a mutex that the step thread takes only to read them.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::histogram::Histogram;

/// Latency bucket bounds (seconds): 50 µs to 5 s.
const LATENCY_BOUNDS: [f64; 12] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0, 5.0,
];

/// Live counters shared by the tier and its I/O thread.
#[derive(Debug)]
pub(crate) struct Counters {
    pub connected: AtomicBool,
    pub outages: AtomicU64,
    pub reconnect_attempts: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub rejected_values: AtomicU64,
    pub lookups: AtomicU64,
    pub lookup_chunks_present: AtomicU64,
    pub bytes_put: AtomicU64,
    pub bytes_got: AtomicU64,
    pub puts_written: AtomicU64,
    pub puts_failed: AtomicU64,
    /// Puts queued and not yet handled by the I/O thread (a gauge).
    pub puts_queued: AtomicU64,
    pub puts_dropped_queue_full: AtomicU64,
    pub puts_dropped_unavailable: AtomicU64,
    pub puts_dropped_too_large: AtomicU64,
    pub puts_skipped_partial: AtomicU64,
    pub get_errors: AtomicU64,
    pub timeouts: AtomicU64,
    pub late_answers: AtomicU64,
    pub latency: Mutex<Latency>,
}

/// Put and get latency, one observation per batch.
#[derive(Debug, Clone)]
pub(crate) struct Latency {
    pub put: Histogram,
    pub get: Histogram,
}

impl Default for Counters {
    fn default() -> Self {
        let z = || AtomicU64::new(0);
        Self {
            connected: AtomicBool::new(false),
            outages: z(),
            reconnect_attempts: z(),
            hits: z(),
            misses: z(),
            rejected_values: z(),
            lookups: z(),
            lookup_chunks_present: z(),
            bytes_put: z(),
            bytes_got: z(),
            puts_written: z(),
            puts_failed: z(),
            puts_queued: z(),
            puts_dropped_queue_full: z(),
            puts_dropped_unavailable: z(),
            puts_dropped_too_large: z(),
            puts_skipped_partial: z(),
            get_errors: z(),
            timeouts: z(),
            late_answers: z(),
            latency: Mutex::new(Latency {
                put: Histogram::new(&LATENCY_BOUNDS),
                get: Histogram::new(&LATENCY_BOUNDS),
            }),
        }
    }
}

impl Counters {
    /// Adds `n` to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// A consistent-enough copy for reporting.
    pub fn snapshot(&self) -> RemoteStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let latency = match self.latency.lock() {
            Ok(l) => l.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        RemoteStats {
            connected: self.connected.load(Ordering::Relaxed),
            outages: g(&self.outages),
            reconnect_attempts: g(&self.reconnect_attempts),
            hits: g(&self.hits),
            misses: g(&self.misses),
            rejected_values: g(&self.rejected_values),
            lookups: g(&self.lookups),
            lookup_chunks_present: g(&self.lookup_chunks_present),
            bytes_put: g(&self.bytes_put),
            bytes_got: g(&self.bytes_got),
            puts_written: g(&self.puts_written),
            puts_failed: g(&self.puts_failed),
            puts_queued: g(&self.puts_queued),
            puts_dropped_queue_full: g(&self.puts_dropped_queue_full),
            puts_dropped_unavailable: g(&self.puts_dropped_unavailable),
            puts_dropped_too_large: g(&self.puts_dropped_too_large),
            puts_skipped_partial: g(&self.puts_skipped_partial),
            get_errors: g(&self.get_errors),
            timeouts: g(&self.timeouts),
            late_answers: g(&self.late_answers),
            put_latency: latency.put,
            get_latency: latency.get,
        }
    }
}

/// What the remote tier did so far (cumulative), and whether it is connected.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteStats {
    /// Whether the store is reachable now.
    pub connected: bool,
    /// Times the store became unreachable.
    pub outages: u64,
    /// Reconnection tries.
    pub reconnect_attempts: u64,
    /// Fetches answered with a valid value.
    pub hits: u64,
    /// Fetches answered without one (absent, rejected, unavailable, timed out).
    pub misses: u64,
    /// Values read back and rejected (corrupt, truncated, foreign, oversized).
    pub rejected_values: u64,
    /// Lookup batches answered.
    pub lookups: u64,
    /// Chunks lookups found present on every rank.
    pub lookup_chunks_present: u64,
    /// Value bytes written.
    pub bytes_put: u64,
    /// Value bytes read back (accepted or not).
    pub bytes_got: u64,
    /// Values written.
    pub puts_written: u64,
    /// Writes the store refused or failed.
    pub puts_failed: u64,
    /// Puts waiting in the queue now (a gauge).
    pub puts_queued: u64,
    /// Puts dropped because the queue was full.
    pub puts_dropped_queue_full: u64,
    /// Puts dropped because the store was unreachable.
    pub puts_dropped_unavailable: u64,
    /// Puts dropped because the value was over `max_value_bytes`.
    pub puts_dropped_too_large: u64,
    /// Chunks not written because their store wrote only part of the
    /// host row (a sliding window's hole): the rest of the row is stale.
    pub puts_skipped_partial: u64,
    /// Reads that failed with an error (not absent keys).
    pub get_errors: u64,
    /// Lookups and fetches given up after `op_timeout_ms`.
    pub timeouts: u64,
    /// Answers that came after their operation was given up (dropped).
    pub late_answers: u64,
    /// Put latency per batch (seconds).
    pub put_latency: Histogram,
    /// Get and exists latency per batch (seconds).
    pub get_latency: Histogram,
}

impl RemoteStats {
    /// Puts dropped for any reason.
    pub fn puts_dropped(&self) -> u64 {
        self.puts_dropped_queue_full + self.puts_dropped_unavailable + self.puts_dropped_too_large
    }

    /// Appends the Prometheus text exposition (`kvoffload_remote_*`).
    pub fn render_prometheus(&self, o: &mut String) {
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP kvoffload_remote_{name} {help}");
            let _ = writeln!(o, "# TYPE kvoffload_remote_{name} counter");
            let _ = writeln!(o, "kvoffload_remote_{name} {v}");
        };
        counter(
            "hits_total",
            "Remote fetches answered with a valid value.",
            self.hits,
        );
        counter(
            "misses_total",
            "Remote fetches answered without a value.",
            self.misses,
        );
        counter(
            "rejected_values_total",
            "Remote values rejected (corrupt, truncated, foreign namespace, oversized).",
            self.rejected_values,
        );
        counter(
            "bytes_put_total",
            "Bytes written to the remote store.",
            self.bytes_put,
        );
        counter(
            "bytes_got_total",
            "Bytes read from the remote store.",
            self.bytes_got,
        );
        counter(
            "puts_total",
            "Values written to the remote store.",
            self.puts_written,
        );
        counter(
            "put_errors_total",
            "Remote writes that failed.",
            self.puts_failed,
        );
        counter(
            "dropped_puts_total",
            "Remote puts dropped (queue full, store unreachable, too large).",
            self.puts_dropped(),
        );
        counter(
            "partial_chunks_not_put_total",
            "Chunks not written because their store wrote only part of the host row.",
            self.puts_skipped_partial,
        );
        counter(
            "get_errors_total",
            "Remote reads that failed.",
            self.get_errors,
        );
        counter(
            "timeouts_total",
            "Remote lookups and fetches given up after op_timeout_ms.",
            self.timeouts,
        );
        counter(
            "outages_total",
            "Times the remote store became unreachable.",
            self.outages,
        );
        let _ = writeln!(
            o,
            "# HELP kvoffload_remote_queued_puts Puts waiting for the I/O thread."
        );
        let _ = writeln!(o, "# TYPE kvoffload_remote_queued_puts gauge");
        let _ = writeln!(o, "kvoffload_remote_queued_puts {}", self.puts_queued);
        let _ = writeln!(
            o,
            "# HELP kvoffload_remote_connected Whether the remote store is reachable (1) or not (0)."
        );
        let _ = writeln!(o, "# TYPE kvoffload_remote_connected gauge");
        let _ = writeln!(o, "kvoffload_remote_connected {}", u8::from(self.connected));
        self.put_latency.render(
            o,
            "kvoffload_remote_put_seconds",
            "Remote put batch latency.",
        );
        self.get_latency.render(
            o,
            "kvoffload_remote_get_seconds",
            "Remote get and exists batch latency.",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_every_metric() {
        let c = Counters::default();
        Counters::add(&c.hits, 3);
        c.connected.store(true, Ordering::Relaxed);
        let mut o = String::new();
        c.snapshot().render_prometheus(&mut o);
        for name in [
            "kvoffload_remote_hits_total 3",
            "kvoffload_remote_connected 1",
            "kvoffload_remote_dropped_puts_total 0",
            "kvoffload_remote_partial_chunks_not_put_total 0",
            "kvoffload_remote_put_seconds_count 0",
            "kvoffload_remote_get_seconds_bucket",
            "kvoffload_remote_rejected_values_total 0",
        ] {
            assert!(o.contains(name), "{name} missing from:\n{o}");
        }
    }
}
