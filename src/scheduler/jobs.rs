//! The job table: per-job state in a concurrent map shared with the stall watchdog.
//!
//! The scheduler thread inserts, updates and removes entries; the watchdog only
//! reads them (shard read locks) and stalls the [`JobLatch`] of the jobs it hands over.
//!
//! The map is a `DashMap`; under loom (`RUSTFLAGS="--cfg loom"`), whose models
//! cannot see inside dashmap's spin locks, it is one loom mutex over a hash map
//! with the same API, so that the models run this table's real code.

#[cfg(not(loom))]
use dashmap::DashMap;
use smallvec::SmallVec;

use crate::Direction;
use crate::ids::{ChunkId, GpuBlockId, JobId, RequestId};
use crate::key::KeyBuildHasher;

use super::latch::JobLatch;
use super::types::{JobKeys, copy_small};

/// Shards of the job table: enough that a full scan holds each lock briefly
/// (about 16 K jobs per shard at 1 M jobs), few enough to stay cache-friendly.
#[cfg_attr(loom, allow(dead_code))]
const SHARDS: usize = 64;

/// Initial capacity of the job table (all shards together): small, so that
/// the table of a steady step (tens to hundreds of jobs in flight) stays in
/// cache; it grows with the jobs in flight (and never shrinks).
#[cfg_attr(loom, allow(dead_code))]
const INITIAL_CAPACITY: usize = 256;

/// One in-flight job: 80 bytes (88 with its id in the table's buckets), so
/// that the heap per in-flight job stays near the 256-byte target even when
/// the shard tables have just doubled (`tests/job_metadata.rs` measures it).
#[derive(Debug)]
pub struct JobEntry {
    /// Load or store.
    pub kind: Direction,
    /// A worker reported the transfer failed.
    pub failed: bool,
    /// `blocks` are registered in the fence index.
    pub fenced: bool,
    /// A load its request does not wait for: the workers finish it before
    /// the step's compute (its keys are not marked as being loaded).
    pub sync: bool,
    /// Worker reports still expected, and the stall/completion race (set once
    /// by the watchdog when it hands the job over as stalled).
    pub latch: JobLatch,
    /// The request it serves.
    pub req: RequestId,
    /// Creation time (clock nanoseconds); stalled when the clock passes it
    /// plus the table's stall timeout.
    pub created_ns: u64,
    /// Chunk keys transferred.
    pub keys: JobKeys,
    /// By `kind`: a store's GPU source blocks (fenced once its request
    /// finishes); a load's host slots (co-indexed with `keys`, so the first
    /// `keys.len()`) followed by its GPU destination blocks (fenced if it
    /// stalls). One list, so that the entry stays small (a stalled store gets
    /// its held slots from the manager).
    ids: SmallVec<[u32; 4]>,
}

impl JobEntry {
    /// A store of `keys` from the GPU blocks `blocks`, created at `created_ns`.
    #[inline]
    pub fn store(
        req: RequestId,
        created_ns: u64,
        latch: JobLatch,
        keys: JobKeys,
        blocks: &[GpuBlockId],
        fenced: bool,
    ) -> Self {
        Self {
            kind: Direction::Store,
            failed: false,
            fenced,
            sync: false,
            latch,
            req,
            created_ns,
            keys,
            ids: copy_small(bytemuck::cast_slice(blocks)),
        }
    }

    /// A load of `keys` from the host slots `chunk_ids` (one per key) into
    /// the GPU blocks `blocks`, created at `created_ns`; `sync`: finished by
    /// the workers within its step.
    pub fn load(
        req: RequestId,
        created_ns: u64,
        latch: JobLatch,
        keys: JobKeys,
        chunk_ids: &[ChunkId],
        blocks: &[GpuBlockId],
        sync: bool,
    ) -> Self {
        debug_assert_eq!(chunk_ids.len(), keys.len(), "one host slot per key");
        let mut ids: SmallVec<[u32; 4]> = copy_small(bytemuck::cast_slice(chunk_ids));
        ids.extend_from_slice(bytemuck::cast_slice(blocks));
        Self {
            kind: Direction::Load,
            failed: false,
            fenced: false,
            sync,
            latch,
            req,
            created_ns,
            keys,
            ids,
        }
    }

    /// The GPU blocks it touches: a store's source blocks, or a load's
    /// destination blocks.
    pub fn blocks(&self) -> &[GpuBlockId] {
        match self.kind {
            Direction::Store => bytemuck::cast_slice(&self.ids),
            Direction::Load => bytemuck::cast_slice(self.ids.get(self.keys.len()..).unwrap_or(&[])),
        }
    }

    /// A load's host slots, co-indexed with `keys` (empty for a store).
    pub fn chunk_ids(&self) -> &[ChunkId] {
        match self.kind {
            Direction::Load => {
                let n = self.keys.len().min(self.ids.len());
                bytemuck::cast_slice(&self.ids[..n])
            }
            Direction::Store => &[],
        }
    }
}

/// The concurrent map the table is built on (see the module docs).
#[cfg(not(loom))]
type Map = DashMap<JobId, JobEntry, KeyBuildHasher>;
#[cfg(loom)]
type Map = crate::sync::Mutex<std::collections::HashMap<JobId, JobEntry, KeyBuildHasher>>;

/// A job read from the table (holds its shard's read lock).
#[cfg(not(loom))]
pub type JobRef<'a> = dashmap::mapref::one::Ref<'a, JobId, JobEntry>;
/// A job being updated in the table (holds its shard's write lock).
#[cfg(not(loom))]
pub type JobRefMut<'a> = dashmap::mapref::one::RefMut<'a, JobId, JobEntry>;
/// A job read from the table (holds the map's lock).
#[cfg(loom)]
pub type JobRef<'a> = loom_map::Entry<'a>;
/// A job being updated in the table (holds the map's lock).
#[cfg(loom)]
pub type JobRefMut<'a> = loom_map::Entry<'a>;

/// The loom build's entry guard.
#[cfg(loom)]
pub mod loom_map {
    use std::collections::HashMap;

    use super::{JobEntry, JobId, KeyBuildHasher};
    use crate::sync::MutexGuard;

    /// One entry of the locked map.
    pub struct Entry<'a> {
        pub(super) guard: MutexGuard<'a, HashMap<JobId, JobEntry, KeyBuildHasher>>,
        pub(super) id: JobId,
    }

    impl std::ops::Deref for Entry<'_> {
        type Target = JobEntry;
        fn deref(&self) -> &JobEntry {
            &self.guard[&self.id]
        }
    }

    impl std::ops::DerefMut for Entry<'_> {
        fn deref_mut(&mut self) -> &mut JobEntry {
            self.guard
                .get_mut(&self.id)
                .expect("entry checked on creation")
        }
    }
}

/// The concurrent job table.
#[derive(Debug)]
pub struct JobTable {
    map: Map,
    /// A job is stalled once the clock passes its creation time plus this.
    stall_timeout_ns: u64,
}

#[cfg(loom)]
impl JobTable {
    fn locked(
        &self,
    ) -> crate::sync::MutexGuard<'_, std::collections::HashMap<JobId, JobEntry, KeyBuildHasher>>
    {
        match self.map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

impl JobTable {
    /// An empty table whose jobs stall `stall_timeout_ns` after their creation.
    pub fn new(stall_timeout_ns: u64) -> Self {
        Self {
            // Pre-sized so that steady insert/remove churn does not keep
            // rehashing tiny shard tables.
            #[cfg(not(loom))]
            map: DashMap::with_capacity_and_hasher_and_shard_amount(
                INITIAL_CAPACITY,
                KeyBuildHasher::default(),
                SHARDS,
            ),
            #[cfg(loom)]
            map: crate::sync::Mutex::new(std::collections::HashMap::default()),
            stall_timeout_ns,
        }
    }

    /// When a job created at `created_ns` stalls (clock nanoseconds).
    pub fn deadline_for(&self, created_ns: u64) -> u64 {
        created_ns.saturating_add(self.stall_timeout_ns)
    }

    /// The stall timeout (nanoseconds).
    pub fn stall_timeout_ns(&self) -> u64 {
        self.stall_timeout_ns
    }

    /// Inserts a new job.
    #[inline]
    pub fn insert(&self, id: JobId, entry: JobEntry) {
        #[cfg(not(loom))]
        self.map.insert(id, entry);
        #[cfg(loom)]
        self.locked().insert(id, entry);
    }

    /// Removes a job and returns it.
    pub fn remove(&self, id: JobId) -> Option<JobEntry> {
        #[cfg(not(loom))]
        return self.map.remove(&id).map(|(_, e)| e);
        #[cfg(loom)]
        return self.locked().remove(&id);
    }

    /// Reads a job.
    pub fn get(&self, id: JobId) -> Option<JobRef<'_>> {
        #[cfg(not(loom))]
        return self.map.get(&id);
        #[cfg(loom)]
        {
            let guard = self.locked();
            guard
                .contains_key(&id)
                .then_some(loom_map::Entry { guard, id })
        }
    }

    /// Updates a job.
    pub fn get_mut(&self, id: JobId) -> Option<JobRefMut<'_>> {
        #[cfg(not(loom))]
        return self.map.get_mut(&id);
        #[cfg(loom)]
        return self.get(id);
    }

    /// Whether the job is live.
    pub fn contains(&self, id: JobId) -> bool {
        #[cfg(not(loom))]
        return self.map.contains_key(&id);
        #[cfg(loom)]
        return self.locked().contains_key(&id);
    }

    /// Live jobs.
    pub fn len(&self) -> usize {
        #[cfg(not(loom))]
        return self.map.len();
        #[cfg(loom)]
        return self.locked().len();
    }

    /// No live job.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every job.
    pub fn clear(&self) {
        #[cfg(not(loom))]
        self.map.clear();
        #[cfg(loom)]
        self.locked().clear();
    }

    /// Calls `f` for every job (shard read locks, one shard at a time).
    pub fn for_each(&self, mut f: impl FnMut(JobId, &JobEntry)) {
        #[cfg(not(loom))]
        for r in self.map.iter() {
            f(*r.key(), r.value());
        }
        #[cfg(loom)]
        for (id, e) in self.locked().iter() {
            f(*id, e);
        }
    }

    /// Hands over every job past its deadline at `now_ns` that was not handed over
    /// before: sets its stall flag and passes its id to `out`. Returns how many.
    pub fn expire(&self, now_ns: u64, mut out: impl FnMut(JobId)) -> usize {
        let mut n = 0;
        self.for_each(|id, e| {
            if now_ns > self.deadline_for(e.created_ns)
                && !e.latch.is_stalled()
                && e.latch.try_stall()
            {
                out(id);
                n += 1;
            }
        });
        n
    }
}
