//! Stalled jobs: cleanup of what the watchdog handed over, quarantine while
//! late reports are due, and release on late reports or confirmed cancellation.

use crate::Direction;
use crate::ids::{JobId, RequestId};

use super::Scheduler;
use super::types::{Ending, ScanOutcome, SchedulerError};
use super::types::{JobBlocks, JobKeys, JobSlots};

/// A stalled job whose late reports are still due.
#[derive(Debug, Clone)]
pub(crate) struct StalledJob {
    /// Load or store.
    pub kind: Direction,
    /// Its request.
    pub req: RequestId,
    /// Its keys (a load's keys stay pinned in the manager).
    pub keys: JobKeys,
    /// Host slots held back: a store's quarantined slots, a load's pinned slots.
    pub chunk_ids: JobSlots,
    /// Its GPU blocks: a store's source blocks, a load's destination blocks.
    pub blocks: JobBlocks,
    /// `blocks` are registered in the fence index.
    pub fenced: bool,
    /// A load whose pinned chunks were turned into quarantined slots (at a reset).
    pub load_quarantined: bool,
    /// Worker reports still due.
    pub remaining: u32,
}

impl Scheduler {
    /// Applies the cleanup of every job the watchdog handed over since the last
    /// hook (called at the start of every hook). Returns them, sorted.
    pub(crate) fn apply_stalls(&mut self) -> Vec<JobId> {
        let mut ids = Vec::new();
        if self.watch.queue.is_empty() {
            return ids;
        }
        while let Some(id) = self.watch.queue.pop() {
            ids.push(id);
        }
        if ids.is_empty() {
            return ids;
        }
        ids.sort_unstable();
        ids.dedup();
        ids.retain(|&id| {
            let cleaned = self.complete_job(id, Ending::Stalled);
            if let Some((kind, req)) = cleaned {
                tracing::warn!(job = %id, %req, kind = kind.as_str(), "transfer job stalled; cleaned up");
            }
            cleaned.is_some()
        });
        ids
    }

    /// Runs one stall scan now, on this thread, at the clock's current time, and
    /// then the cleanup of what it found (tests and replay; the watchdog thread
    /// does the scan alone and the cleanup waits for the next hook).
    pub fn scan_now(&mut self) -> ScanOutcome {
        // Hand-overs from before this scan are applied first, as at any hook.
        self.apply_stalls();
        let pending_failed = self.failed_loads.len();
        self.watch.scan();
        let stalled = self.apply_stalls();
        let mut failed_loads: Vec<RequestId> = self.failed_loads[pending_failed..].to_vec();
        failed_loads.sort_unstable();
        failed_loads.dedup();
        ScanOutcome {
            stalled,
            failed_loads,
        }
    }

    /// Scans only if a scan interval has passed since the last scan (the
    /// watchdog thread's rule), then cleans up. Returns `None` if not due.
    pub fn scan_if_due(&mut self) -> Option<ScanOutcome> {
        self.apply_stalls();
        let pending_failed = self.failed_loads.len();
        if !self.watch.scan_if_due() {
            return None;
        }
        let stalled = self.apply_stalls();
        let mut failed_loads: Vec<RequestId> = self.failed_loads[pending_failed..].to_vec();
        failed_loads.sort_unstable();
        failed_loads.dedup();
        Some(ScanOutcome {
            stalled,
            failed_loads,
        })
    }

    /// The backend confirms that a stalled job's transfer was cancelled and will
    /// never touch memory again: its quarantine ends now.
    pub fn confirm_cancelled(&mut self, job: JobId) -> Result<(), SchedulerError> {
        self.apply_stalls();
        if !self.stalled.contains_key(&job) {
            return Err(SchedulerError::NotStalled(job));
        }
        self.counters.cancellations_confirmed += 1;
        self.release_stalled(job);
        Ok(())
    }

    /// A late report for a stalled job: counted down silently; at zero the
    /// quarantine ends.
    pub(crate) fn late_report(&mut self, job: JobId, n: u32) {
        self.counters.late_reports += u64::from(n);
        let Some(s) = self.stalled.get_mut(&job) else {
            return;
        };
        s.remaining = s.remaining.saturating_sub(n);
        tracing::debug!(%job, remaining = s.remaining, "late report for a stalled job");
        if s.remaining == 0 {
            self.release_stalled(job);
        }
    }

    fn release_stalled(&mut self, job: JobId) {
        let Some(s) = self.stalled.remove(&job) else {
            return;
        };
        if s.fenced {
            self.fences.remove(job, &s.blocks);
        }
        let r = match s.kind {
            Direction::Store => self.manager.release_quarantined(&s.chunk_ids),
            Direction::Load if s.load_quarantined => {
                // Slots shared with other stalled loads stay held until the last one ends.
                let mut free = JobSlots::new();
                for &c in &s.chunk_ids {
                    match self.load_holds.get_mut(&c) {
                        Some(n) if *n > 1 => *n -= 1,
                        _ => {
                            self.load_holds.remove(&c);
                            free.push(c);
                        }
                    }
                }
                self.manager.release_quarantined(&free)
            }
            Direction::Load => self.manager.complete_load(&s.keys, Some(s.req)),
        };
        if let Err(err) = r {
            tracing::error!(%job, error = %err, "releasing a stalled job's host chunks failed");
        }
    }

    /// Host chunks held by stalled jobs: quarantined store slots, chunks kept
    /// pinned by stalled loads, and (after a reset) stalled loads' quarantined
    /// slots, each counted once however many loads hold it.
    pub(crate) fn quarantined_chunks(&self) -> usize {
        let mut stores = 0;
        let mut pinned: std::collections::HashSet<crate::ids::ChunkId> =
            std::collections::HashSet::new();
        for s in self.stalled.values() {
            match s.kind {
                Direction::Store => stores += s.chunk_ids.len(),
                Direction::Load if !s.load_quarantined => {
                    pinned.extend(s.chunk_ids.iter().copied())
                }
                Direction::Load => {}
            }
        }
        stores + pinned.len() + self.load_holds.len()
    }
}
