//! The end-of-run summary: counts, hit rates, transfer volumes, faults and their
//! cleanup, leaks (from the engine's real state after the drain), step times.

use std::fmt::Write;

use serde::Serialize;

/// Requests and tokens.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct WorkCounts {
    /// Requests created (conversation turns).
    pub requests: u64,
    /// Requests finished.
    pub finished: u64,
    /// Preemptions (a request may be preempted several times).
    pub preemptions: u64,
    /// Prompt tokens of every admission (re-admissions after preemption included).
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Prompt tokens found in the GPU prefix cache.
    pub gpu_hit_tokens: u64,
    /// Prompt tokens loaded back from the host tier.
    pub loaded_tokens: u64,
    /// Tokens recomputed because their load failed or stalled.
    pub recomputed_tokens: u64,
    /// Loads waited for within their step (a sync-load budget reserved
    /// their hits), failed ones included.
    pub sync_loads: u64,
    /// Tokens those loads brought back (included in `loaded_tokens`).
    pub sync_loaded_tokens: u64,
    /// Synchronous loads that failed (their requests recomputed; included
    /// in `FaultCounts::failed_loads_recomputed`).
    pub sync_loads_failed: u64,
}

/// Transfer volumes.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct TransferCounts {
    /// Bytes stored (GPU → host).
    pub bytes_stored: u64,
    /// Bytes loaded (host → GPU).
    pub bytes_loaded: u64,
    /// Successful store copies, one per job per worker.
    pub store_jobs: u64,
    /// Successful load copies, one per job per worker.
    pub load_jobs: u64,
    /// Store rate over the copy time, GB/s.
    pub store_gbps: f64,
    /// Load rate over the copy time, GB/s.
    pub load_gbps: f64,
}

/// Faults injected and how they were handled.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct FaultCounts {
    /// Transfers that stalled on a worker.
    pub injected_stalls: u64,
    /// Transfers that reported late on a worker.
    pub injected_late: u64,
    /// Duplicate reports delivered.
    pub injected_duplicates: u64,
    /// Transfers that failed on a worker.
    pub injected_failures: u64,
    /// Injected stalls the watchdog found.
    pub injected_stalls_detected: u64,
    /// Jobs with an injected late report that the watchdog declared stalled
    /// (the report came after the stall timeout).
    pub late_reports_detected: u64,
    /// Jobs without a late report of their own that the watchdog declared
    /// stalled while a job of the same direction with a late report was in
    /// flight (a worker reports one direction's jobs in order).
    pub queued_behind_late_detected: u64,
    /// Jobs the watchdog declared stalled with no fault injected into them
    /// and none ahead of them.
    pub other_stalls_detected: u64,
    /// Injected stalls a flush forced to run before their deadline.
    pub stalls_forced_by_flush: u64,
    /// Stores the watchdog declared stalled.
    pub stalled_stores: u64,
    /// Loads the watchdog declared stalled.
    pub stalled_loads: u64,
    /// Late reports counted down for stalled jobs.
    pub late_reports: u64,
    /// Stalled jobs whose transfer the backend confirmed cancelled.
    pub cancelled: u64,
    /// Detected stalls whose transfer hung (never resumed nor cancelled:
    /// [`crate::harness::sim::FaultRates::hang`]).
    pub hung: u64,
    /// Stall-injected jobs that resumed (released, or forced by a flush).
    pub released: u64,
    /// Reports the scheduler rejected (duplicates, reports after cancellation).
    pub rejected_reports: u64,
    /// Loads that failed or stalled and whose tokens were recomputed.
    pub failed_loads_recomputed: u64,
    /// Stores that failed on a worker.
    pub failed_stores: u64,
    /// Host-tier resets with requests running.
    pub resets: u64,
}

/// A block that did not hold the pattern of its hash.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ContentMismatch {
    /// The step whose command checked it.
    pub step: u64,
    /// The worker (rank).
    pub worker: u32,
    /// The GPU block.
    pub block: u32,
    /// The hash whose pattern it should hold.
    pub hash: u64,
    /// Why it was checked: `load` or `prefix hit`.
    pub kind: String,
    /// The first differing byte found, from the block's start.
    pub offset: u64,
}

/// The end-to-end content check ([`crate::harness::sim::content`]): counts
/// over all workers (a block on two workers counts twice).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ContentCounts {
    /// Whether the check ran (`--no-content-check` turns it off).
    pub enabled: bool,
    /// Computed blocks written with their pattern.
    pub blocks_written: u64,
    /// Blocks compared with their pattern (loads and prefix hits).
    pub blocks_checked: u64,
    /// Of those, blocks of loads that completed.
    pub loaded_checked: u64,
    /// Of those, blocks handed out by the GPU prefix cache.
    pub prefix_hits_checked: u64,
    /// 64-byte lines compared per block (the first, the last and pseudo-random
    /// ones), at most.
    pub lines_per_block: u64,
    /// Blocks that did not hold their pattern (must be 0: the command exits 1
    /// otherwise).
    pub mismatches: u64,
    /// The first few mismatches.
    pub first_mismatches: Vec<ContentMismatch>,
}

/// What is left after the drain (all must be zero).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Leaks {
    /// Live jobs.
    pub jobs: u64,
    /// Tracked requests.
    pub requests: u64,
    /// Keys still marked as being loaded.
    pub chunks_being_loaded: u64,
    /// Fenced GPU blocks.
    pub fenced_blocks: u64,
    /// Stalled jobs awaiting reports.
    pub stalled_jobs: u64,
    /// Quarantined host chunks.
    pub quarantined_chunks: u64,
    /// Host chunks pinned by loads.
    pub pinned_chunks: u64,
    /// Host chunks pending a store.
    pub pending_chunks: u64,
    /// GPU blocks still held by the simulated serving backend.
    pub gpu_blocks_in_use: u64,
    /// Reset-fence entries still owed.
    pub reset_fence: u64,
    /// Per-job entries the worker threads still hold (jobs submitted and not
    /// reported, stalled jobs neither released nor cancelled, pending loads,
    /// faults not applied).
    pub worker_jobs: u64,
    /// Per-job entries the simulated serving backend still holds (job kinds,
    /// injected stalls, stall fates due).
    pub sim_jobs: u64,
    /// Invariant violations found by `check_invariants` (0 or 1).
    pub invariant_violations: u64,
    /// Remote-tier state the scheduler still holds (probes, lookups and
    /// fetches of gone requests; 0 without a remote tier).
    pub remote_state: u64,
    /// The sum of the above.
    pub total: u64,
}

impl Leaks {
    /// Every count with its name (the total left out).
    pub(crate) fn fields(&self) -> [(&'static str, u64); 14] {
        [
            ("jobs", self.jobs),
            ("requests", self.requests),
            ("chunks being loaded", self.chunks_being_loaded),
            ("fenced blocks", self.fenced_blocks),
            ("stalled jobs", self.stalled_jobs),
            ("quarantined chunks", self.quarantined_chunks),
            ("pinned chunks", self.pinned_chunks),
            ("pending chunks", self.pending_chunks),
            ("GPU blocks in use", self.gpu_blocks_in_use),
            ("reset-fence entries", self.reset_fence),
            ("worker job entries", self.worker_jobs),
            ("sim job entries", self.sim_jobs),
            ("invariant violations", self.invariant_violations),
            ("remote-tier entries", self.remote_state),
        ]
    }
}

/// The non-zero counts with their names (`none` when all are zero), e.g.
/// `2 jobs, 1 stalled jobs, 4 quarantined chunks`.
impl std::fmt::Display for Leaks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut any = false;
        for (name, n) in self.fields() {
            if n > 0 {
                if any {
                    f.write_str(", ")?;
                }
                write!(f, "{n} {name}")?;
                any = true;
            }
        }
        if !any {
            f.write_str("none")?;
        }
        Ok(())
    }
}

/// What a run still held when it stopped without finishing: the engine's
/// state (as counted for leaks) and the simulated serving backend's requests.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Held {
    /// The step it stopped at.
    pub step: u64,
    /// Requests finished by then.
    pub finished: u64,
    /// Requests waiting for admission.
    pub waiting: u64,
    /// Requests running.
    pub running: u64,
    /// Requests waiting for a load.
    pub loading: u64,
    /// The engine's and the workers' state.
    pub engine: Leaks,
    /// The invariant violation found, if any.
    pub invariant_error: Option<String>,
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "at step {} ({} requests finished): {} waiting, {} running, {} loading; engine holds {}",
            self.step, self.finished, self.waiting, self.running, self.loading, self.engine
        )?;
        if let Some(e) = &self.invariant_error {
            write!(f, "; invariant violated: {e}")?;
        }
        Ok(())
    }
}

/// Scheduler time per step (all hooks of the step), microseconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct StepTimes {
    /// Steps measured.
    pub steps: u64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Maximum.
    pub max_us: f64,
}

/// The whole summary (`--report` writes it as JSON).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SimSummary {
    /// The seed.
    pub seed: u64,
    /// Workers.
    pub world_size: u32,
    /// Backend name.
    pub backend: String,
    /// The workers held the same KV: one copy of a chunk, stores by turns.
    pub replicated: bool,
    /// Where the host pool was placed (its NUMA node), and where a sample
    /// of its pages is.
    pub host_placement: String,
    /// Steps run (drain included).
    pub steps: u64,
    /// Simulated seconds.
    pub simulated_s: f64,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
    /// Requests and tokens.
    pub work: WorkCounts,
    /// The longest run of steps with requests live and none finishing (or
    /// of the drain).
    pub longest_steps_without_progress: u64,
    /// The progress limit the run had (it stops as stuck beyond it).
    pub progress_limit_steps: u64,
    /// Prefix hit rate with the GPU prefix cache alone.
    pub hit_rate_without_offload: f64,
    /// Prefix hit rate with the GPU prefix cache and the host tier.
    pub hit_rate_with_offload: f64,
    /// Transfers.
    pub transfers: TransferCounts,
    /// Faults.
    pub faults: FaultCounts,
    /// Leaks after the drain.
    pub leaks: Leaks,
    /// Scheduler time per step.
    pub step_time: StepTimes,
    /// The invariant violation found at the end, if any.
    pub invariant_error: Option<String>,
    /// The end-to-end content check.
    pub content: ContentCounts,
    /// The remote tier's write-through, all workers together (with a tier).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteCounts>,
}

/// What the workers wrote through to the remote tier (sums over workers).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct RemoteCounts {
    /// The store, password removed.
    pub target: String,
    /// When the workers wrote: `through` (every stored chunk) or
    /// `on_eviction` (chunks the host tier evicted).
    pub write: String,
    /// Chunk shares written.
    pub puts_written: u64,
    /// Value bytes written.
    pub bytes_put: u64,
    /// Writes the store failed.
    pub puts_failed: u64,
    /// Puts dropped (queue full, store unreachable, too large).
    pub puts_dropped: u64,
    /// Puts still queued when the run ended (0 unless the store hung).
    pub puts_queued: u64,
    /// Times a worker found the store unreachable.
    pub outages: u64,
    /// Workers connected at the end.
    pub connected_workers: u32,
    /// Remote lookups the scheduler sent (host-tier misses).
    pub lookups: u64,
    /// Chunks they found.
    pub chunks_found: u64,
    /// Chunks fetched into the host tier.
    pub chunks_fetched: u64,
    /// Value bytes the workers read back (all fetches, accepted or not).
    pub bytes_fetched: u64,
    /// Seconds the workers' put batches took (all workers together).
    pub put_seconds: f64,
    /// Seconds the workers' get batches took (all workers together).
    pub get_seconds: f64,
    /// Fetch jobs that missed or failed (their requests recomputed).
    pub fetches_failed: u64,
    /// Remote state the scheduler still held at the end (a leak: 0).
    pub probes_left: u64,
}

/// Percentile (nearest rank) of sorted values: the exact reference the
/// step-time histogram is tested against.
#[cfg(test)]
pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// GB/s of `bytes` over `secs` (0 when no time was measured).
fn rate(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

fn gb(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

impl SimSummary {
    /// The summary as a plain-text table.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let w = &self.work;
        let t = &self.transfers;
        let f = &self.faults;
        let l = &self.leaks;
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let mut row = |k: &str, v: String| {
            let _ = writeln!(o, "  {k:<32} {v}");
        };
        row(
            "seed / workers / backend",
            format!(
                "{} / {}{} / {}",
                self.seed,
                self.world_size,
                if self.replicated {
                    " (same KV: one copy, stores by turns)"
                } else {
                    ""
                },
                self.backend
            ),
        );
        if !self.host_placement.is_empty() {
            row("host pool NUMA placement", self.host_placement.clone());
        }
        row(
            "steps (simulated time)",
            format!(
                "{} ({:.1} s simulated, {:.2} s wall)",
                self.steps, self.simulated_s, self.wall_s
            ),
        );
        row(
            "longest wait for progress",
            format!(
                "{} steps (limit {}: no request finished, or draining)",
                self.longest_steps_without_progress, self.progress_limit_steps
            ),
        );
        row(
            "requests finished / created",
            format!(
                "{} / {} ({} preemptions)",
                w.finished, w.requests, w.preemptions
            ),
        );
        row(
            "tokens prompt / generated",
            format!("{} / {}", w.prompt_tokens, w.generated_tokens),
        );
        row(
            "prefix hit rate without offload",
            pct(self.hit_rate_without_offload),
        );
        row(
            "prefix hit rate with offload",
            format!(
                "{} (+{} tokens loaded from host)",
                pct(self.hit_rate_with_offload),
                w.loaded_tokens
            ),
        );
        if w.sync_loads > 0 {
            row(
                "synchronous loads",
                format!(
                    "{} ({} tokens loaded within their step; {} failed, recomputed)",
                    w.sync_loads, w.sync_loaded_tokens, w.sync_loads_failed
                ),
            );
        }
        row(
            "stored",
            format!(
                "{} in {} worker copies ({:.2} GB/s copy rate)",
                gb(t.bytes_stored),
                t.store_jobs,
                t.store_gbps
            ),
        );
        row(
            "loaded",
            format!(
                "{} in {} worker copies ({:.2} GB/s copy rate)",
                gb(t.bytes_loaded),
                t.load_jobs,
                t.load_gbps
            ),
        );
        row(
            "faults injected",
            format!(
                "{} stalls, {} late, {} duplicate, {} failed",
                f.injected_stalls, f.injected_late, f.injected_duplicates, f.injected_failures
            ),
        );
        row(
            "stalls detected",
            format!(
                "{} ({} stores, {} loads): {} injected stalls, {} late reports past the \
                 timeout, {} queued behind a late report, {} other; {} injected stalls \
                 forced earlier by a flush",
                f.stalled_stores + f.stalled_loads,
                f.stalled_stores,
                f.stalled_loads,
                f.injected_stalls_detected,
                f.late_reports_detected,
                f.queued_behind_late_detected,
                f.other_stalls_detected,
                f.stalls_forced_by_flush
            ),
        );
        row(
            "stalls cleaned up",
            format!(
                "{} late reports counted down, {} resumed late, {} cancelled",
                f.late_reports, f.released, f.cancelled
            ),
        );
        row("rejected reports", f.rejected_reports.to_string());
        row(
            "failed loads recomputed",
            format!(
                "{} ({} tokens); {} failed stores",
                f.failed_loads_recomputed, w.recomputed_tokens, f.failed_stores
            ),
        );
        row("resets with requests running", f.resets.to_string());
        if let Some(r) = &self.remote {
            row(
                "remote tier (reads)",
                format!(
                    "{} lookups found {} chunks; {} chunks ({}, {:.2} GB/s) fetched into the \
                     host tier, {} fetches failed; {} left held",
                    r.lookups,
                    r.chunks_found,
                    r.chunks_fetched,
                    gb(r.bytes_fetched),
                    rate(r.bytes_fetched, r.get_seconds),
                    r.fetches_failed,
                    r.probes_left
                ),
            );
            row(
                if r.write == "on_eviction" {
                    "remote tier (on eviction)"
                } else {
                    "remote tier (write-through)"
                },
                format!(
                    "{} chunk shares ({}, {:.2} GB/s) written to {}; {} failed, {} dropped, {} \
                     still queued; {} outages, {}/{} workers connected at the end",
                    r.puts_written,
                    gb(r.bytes_put),
                    rate(r.bytes_put, r.put_seconds),
                    r.target,
                    r.puts_failed,
                    r.puts_dropped,
                    r.puts_queued,
                    r.outages,
                    r.connected_workers,
                    self.world_size
                ),
            );
        }
        let c = &self.content;
        row(
            "content check",
            if c.enabled {
                let mut v = format!(
                    "{} blocks checked ({} loaded, {} GPU prefix hits; {} sampled 64-byte \
                     lines each), {} written; {} mismatches",
                    c.blocks_checked,
                    c.loaded_checked,
                    c.prefix_hits_checked,
                    c.lines_per_block,
                    c.blocks_written,
                    c.mismatches
                );
                for m in &c.first_mismatches {
                    let _ = write!(
                        v,
                        "\n{:>35}step {} worker {} block {} hash {:#x} ({}): byte {} differs",
                        "", m.step, m.worker, m.block, m.hash, m.kind, m.offset
                    );
                }
                v
            } else {
                "off".to_string()
            },
        );
        row(
            "leaks after drain",
            if l.total == 0 {
                "0".to_string()
            } else {
                format!("{} ({l})", l.total)
            },
        );
        row(
            "scheduler time per step",
            format!(
                "p50 {:.1} us, p99 {:.1} us, max {:.1} us",
                self.step_time.p50_us, self.step_time.p99_us, self.step_time.max_us
            ),
        );
        o
    }
}
