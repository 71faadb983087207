//! The job table: per-job state in a concurrent map shared with the stall watchdog.
//!
//! The scheduler thread inserts, updates and removes entries; the watchdog only
//! reads them (shard read locks) and stalls the [`JobLatch`] of the jobs it hands over.

use dashmap::DashMap;

use crate::ids::{JobId, RequestId};
use crate::key::KeyBuildHasher;

use super::latch::JobLatch;
use super::types::{JobBlocks, JobKeys, JobKind, JobSlots};

/// Shards of the job table: enough that a full scan holds each lock briefly
/// (about 16 K jobs per shard at 1 M jobs), few enough to stay cache-friendly.
const SHARDS: usize = 64;

/// Initial capacity of the job table (all shards together): small, so that
/// the table of a steady step (tens to hundreds of jobs in flight) stays in
/// cache; it grows with the jobs in flight (and never shrinks).
const INITIAL_CAPACITY: usize = 1024;

/// One in-flight job.
#[derive(Debug)]
pub struct JobEntry {
    /// Load or store.
    pub kind: JobKind,
    /// A worker reported the transfer failed.
    pub failed: bool,
    /// `blocks` are registered in the fence index.
    pub fenced: bool,
    /// Worker reports still expected, and the stall/completion race (set once
    /// by the watchdog when it hands the job over as stalled).
    pub latch: JobLatch,
    /// The request it serves.
    pub req: RequestId,
    /// Creation time (clock nanoseconds).
    pub created_ns: u64,
    /// Stalled when the clock passes this (nanoseconds).
    pub deadline_ns: u64,
    /// Chunk keys transferred.
    pub keys: JobKeys,
    /// Host slots, co-indexed with `keys`.
    pub chunk_ids: JobSlots,
    /// GPU source blocks of a store (fenced once its request finishes); empty for loads.
    pub blocks: JobBlocks,
}

/// The concurrent job table.
#[derive(Debug)]
pub struct JobTable {
    map: DashMap<JobId, JobEntry, KeyBuildHasher>,
}

impl Default for JobTable {
    fn default() -> Self {
        Self {
            // Pre-sized so that steady insert/remove churn does not keep
            // rehashing tiny shard tables.
            map: DashMap::with_capacity_and_hasher_and_shard_amount(
                INITIAL_CAPACITY,
                KeyBuildHasher::default(),
                SHARDS,
            ),
        }
    }
}

impl JobTable {
    /// Inserts a new job.
    pub fn insert(&self, id: JobId, entry: JobEntry) {
        self.map.insert(id, entry);
    }

    /// Removes a job and returns it.
    pub fn remove(&self, id: JobId) -> Option<JobEntry> {
        self.map.remove(&id).map(|(_, e)| e)
    }

    /// Reads a job.
    pub fn get(&self, id: JobId) -> Option<dashmap::mapref::one::Ref<'_, JobId, JobEntry>> {
        self.map.get(&id)
    }

    /// Updates a job.
    pub fn get_mut(&self, id: JobId) -> Option<dashmap::mapref::one::RefMut<'_, JobId, JobEntry>> {
        self.map.get_mut(&id)
    }

    /// Whether the job is live.
    pub fn contains(&self, id: JobId) -> bool {
        self.map.contains_key(&id)
    }

    /// Live jobs.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// No live job.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Removes every job.
    pub fn clear(&self) {
        self.map.clear();
    }

    /// Calls `f` for every job (shard read locks, one shard at a time).
    pub fn for_each(&self, mut f: impl FnMut(JobId, &JobEntry)) {
        for r in self.map.iter() {
            f(*r.key(), r.value());
        }
    }

    /// Hands over every job past its deadline at `now_ns` that was not handed over
    /// before: sets its stall flag and passes its id to `out`. Returns how many.
    pub fn expire(&self, now_ns: u64, mut out: impl FnMut(JobId)) -> usize {
        let mut n = 0;
        for r in self.map.iter() {
            let e = r.value();
            if now_ns > e.deadline_ns && !e.latch.is_stalled() && e.latch.try_stall() {
                out(*r.key());
                n += 1;
            }
        }
        n
    }
}
