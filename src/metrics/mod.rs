//! Offload metrics in Prometheus text format, named after vLLM's kv_offload
//! metrics (`vllm:kv_offload_*`), plus kvoffload's stall metrics; and a tiny
//! HTTP server exposing them ([`MetricsServer`]).

mod server;

use std::fmt::Write;

use crate::manager::ManagerStats;
use crate::scheduler::{LookupDelays, SchedulerMetrics};
use crate::worker::TransferStats;
use crate::worker::numa::PoolPlacement;

pub use crate::histogram::Histogram;
pub use server::{MetricsServer, SharedMetricsText};

/// Bucket bounds of the transfer size histograms (bytes), as vLLM's.
pub const SIZE_BUCKETS: [f64; 8] = [1e6, 5e6, 1e7, 2e7, 4e7, 6e7, 1e8, 2e8];

/// Bytes and time of one transfer direction.
#[derive(Debug, Clone, PartialEq)]
pub struct DirectionMetrics {
    /// Bytes moved (counter).
    pub bytes: u64,
    /// Seconds spent copying (counter).
    pub seconds: f64,
    /// Successful jobs (counter).
    pub jobs: u64,
    /// Job sizes in bytes.
    pub size: Histogram,
}

impl Default for DirectionMetrics {
    fn default() -> Self {
        Self {
            bytes: 0,
            seconds: 0.0,
            jobs: 0,
            size: Histogram::new(&SIZE_BUCKETS),
        }
    }
}

/// Where the workers' host pools went (NUMA placement), as gauges: one
/// [`Self::add_pool`] per pool (per worker's mapping of a shared region).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlacementMetrics {
    /// Host pools reported.
    pub pools: u64,
    /// Of those, pools placed on a NUMA node.
    pub placed: u64,
    /// Pages sampled over the pools.
    pub sampled_pages: u64,
    /// Sampled pages of placed pools that are on another node than theirs
    /// (the node ran out of memory, or the pages were there before).
    pub pages_elsewhere: u64,
    /// Host backend copy threads running on their pool's node's CPUs.
    pub copy_threads_on_node: u64,
}

impl PlacementMetrics {
    /// Adds one pool's placement, with its copy threads on the pool's node.
    pub fn add_pool(&mut self, p: &PoolPlacement, copy_threads_on_node: usize) {
        self.pools += 1;
        self.placed += u64::from(p.node.is_some());
        self.sampled_pages += p.pages.sampled as u64;
        self.pages_elsewhere += p.pages_elsewhere() as u64;
        self.copy_threads_on_node += copy_threads_on_node as u64;
    }
}

/// Every metric the engine exports.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OffloadMetrics {
    /// Host → GPU.
    pub load: DirectionMetrics,
    /// GPU → host.
    pub store: DirectionMetrics,
    /// The scheduler's counters and gauges.
    pub scheduler: SchedulerMetrics,
    /// The scheduler's lookup delay histograms.
    pub lookup: LookupDelays,
    /// The host tier's occupancy.
    pub manager: ManagerStats,
    /// Where the host pools went.
    pub placement: PlacementMetrics,
}

impl OffloadMetrics {
    /// Adds one worker report's transfer statistics.
    pub fn add_transfers(&mut self, stats: &TransferStats) {
        for (d, s) in [
            (&mut self.store, &stats.store),
            (&mut self.load, &stats.load),
        ] {
            d.bytes += s.bytes;
            d.seconds += s.time.as_secs_f64();
            d.jobs += s.jobs;
            for &b in &s.sizes {
                d.size.observe(b as f64);
            }
        }
    }

    /// The Prometheus text exposition (version 0.0.4).
    pub fn render(&self) -> String {
        let mut o = String::with_capacity(4096);
        let s = &self.scheduler;
        for (dir, d) in [("load", &self.load), ("store", &self.store)] {
            counter(
                &mut o,
                &format!("vllm:kv_offload_{dir}_bytes"),
                "Bytes transferred",
                d.bytes as f64,
            );
            counter(
                &mut o,
                &format!("vllm:kv_offload_{dir}_time"),
                "Seconds spent transferring",
                d.seconds,
            );
            d.size.render(
                &mut o,
                &format!("vllm:kv_offload_{dir}_size"),
                "Transfer sizes in bytes",
            );
        }
        self.lookup.sync.render(
            &mut o,
            "vllm:kv_offload_lookup_sync_delay_seconds",
            "Duration of lookups resolved without deferring, in seconds",
        );
        self.lookup.async_.render(
            &mut o,
            "vllm:kv_offload_lookup_async_delay_seconds",
            "Time from a lookup's first deferral to its resolution, in seconds",
        );
        counter(
            &mut o,
            "vllm:kv_offload_allocation_failure",
            "Stores that could not allocate host slots",
            s.allocation_failures as f64,
        );
        gauge(
            &mut o,
            "vllm:kv_offload_cpu_cache_usage_perc",
            "Host tier slots that cannot be evicted (pinned + pending)",
            self.manager.usage,
        );
        gauge(
            &mut o,
            "vllm:kv_offload_cpu_cache_write_usage_perc",
            "Host tier slots being written",
            self.manager.write_usage,
        );
        gauge(
            &mut o,
            "vllm:kv_offload_cpu_cache_read_usage_perc",
            "Host tier slots being read",
            self.manager.read_usage,
        );
        let name = "vllm:kv_offload_stalled_transfers";
        let _ = writeln!(
            o,
            "# HELP {name} Transfer jobs declared stalled by the watchdog"
        );
        let _ = writeln!(o, "# TYPE {name} counter");
        let _ = writeln!(
            o,
            "{name}{{transfer_type=\"CPU_to_GPU\"}} {}",
            s.stalled_loads
        );
        let _ = writeln!(
            o,
            "{name}{{transfer_type=\"GPU_to_CPU\"}} {}",
            s.stalled_stores
        );
        counter(
            &mut o,
            "kvoffload_late_reports",
            "Worker reports that arrived for stalled jobs",
            s.late_reports as f64,
        );
        counter(
            &mut o,
            "kvoffload_reports_racing_stall",
            "Late reports whose job the watchdog handed over while the report was applied",
            s.reports_racing_stall as f64,
        );
        counter(
            &mut o,
            "kvoffload_unknown_reports",
            "Worker reports rejected (unknown job, too many reports)",
            s.unknown_reports as f64,
        );
        counter(
            &mut o,
            "kvoffload_cancellations_confirmed",
            "Stalled jobs released by a cancellation",
            s.cancellations_confirmed as f64,
        );
        counter(
            &mut o,
            "kvoffload_jobs_created",
            "Transfer jobs created",
            s.jobs_created as f64,
        );
        counter(
            &mut o,
            "kvoffload_stall_scans",
            "Stall scans of the job table",
            s.scans as f64,
        );
        gauge(
            &mut o,
            "kvoffload_jobs_in_flight",
            "Live transfer jobs",
            s.jobs_in_flight as f64,
        );
        gauge(
            &mut o,
            "kvoffload_stalled_jobs",
            "Stalled jobs awaiting late reports",
            s.stalled_jobs as f64,
        );
        gauge(
            &mut o,
            "kvoffload_quarantined_chunks",
            "Host chunks held by stalled jobs",
            s.quarantined_chunks as f64,
        );
        gauge(
            &mut o,
            "kvoffload_cpu_cached_chunks",
            "Host tier chunks stored and readable",
            f64::from(self.manager.cached),
        );
        gauge(
            &mut o,
            "kvoffload_cpu_num_chunks",
            "Host tier chunk slots",
            f64::from(self.manager.num_chunks),
        );
        let p = &self.placement;
        for (name, help, v) in [
            ("kvoffload_host_pools", "Host pools reported", p.pools),
            (
                "kvoffload_host_pools_placed",
                "Host pools placed on a NUMA node",
                p.placed,
            ),
            (
                "kvoffload_host_pool_sampled_pages",
                "Pages of the host pools sampled for their NUMA node",
                p.sampled_pages,
            ),
            (
                "kvoffload_host_pool_pages_elsewhere",
                "Sampled pages of placed host pools on another NUMA node than theirs",
                p.pages_elsewhere,
            ),
            (
                "kvoffload_host_copy_threads_on_node",
                "Host copy threads running on their pool's NUMA node",
                p.copy_threads_on_node,
            ),
        ] {
            gauge(&mut o, name, help, v as f64);
        }
        o
    }
}

fn header(o: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

fn counter(o: &mut String, name: &str, help: &str, v: f64) {
    header(o, name, help, "counter");
    let _ = writeln!(o, "{name} {v}");
}

fn gauge(o: &mut String, name: &str, help: &str, v: f64) {
    header(o, name, help, "gauge");
    let _ = writeln!(o, "{name} {v}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_has_vllm_names_and_stall_labels() {
        let mut m = OffloadMetrics::default();
        m.scheduler.stalled_loads = 2;
        m.load.bytes = 10;
        let t = m.render();
        assert!(t.contains("vllm:kv_offload_load_bytes 10\n"));
        assert!(t.contains("vllm:kv_offload_stalled_transfers{transfer_type=\"CPU_to_GPU\"} 2\n"));
        assert!(t.contains("# TYPE vllm:kv_offload_store_size histogram"));
        assert!(t.contains("vllm:kv_offload_store_size_bucket{le=\"+Inf\"} 0\n"));
        assert!(t.contains("# TYPE vllm:kv_offload_lookup_sync_delay_seconds histogram\n"));
        assert!(t.contains("# TYPE vllm:kv_offload_lookup_async_delay_seconds histogram\n"));
    }

    #[test]
    fn render_exports_lookup_delays() {
        let mut m = OffloadMetrics::default();
        m.lookup.sync.observe(2e-6);
        m.lookup.async_.observe(0.25);
        m.lookup.async_.observe(2.0);
        let t = m.render();
        assert!(
            t.contains("vllm:kv_offload_lookup_sync_delay_seconds_count 1\n"),
            "{t}"
        );
        assert!(t.contains("vllm:kv_offload_lookup_sync_delay_seconds_bucket{le=\"1e-5\"} 1\n"));
        assert!(t.contains("vllm:kv_offload_lookup_async_delay_seconds_count 2\n"));
        assert!(t.contains("vllm:kv_offload_lookup_async_delay_seconds_sum 2.25\n"));
        assert!(t.contains("vllm:kv_offload_lookup_async_delay_seconds_bucket{le=\"5e-1\"} 1\n"));
    }
}
