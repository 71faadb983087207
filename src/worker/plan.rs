//! The plain types a worker receives each step (from the scheduler) and sends
//! back (completions and stats). The scheduler adapts to these.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::{ChunkId, JobId, RequestId};
use crate::key::ChunkKey;

use super::layout::TransferSpec;
use crate::Direction;

/// A load (host chunks -> GPU blocks) for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadJob {
    /// The job.
    pub job: JobId,
    /// The request it feeds; `None` for a synchronous load (waited in the step).
    pub request: Option<RequestId>,
    /// What to copy.
    pub spec: TransferSpec,
}

/// A store (GPU blocks -> host chunks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreJob {
    /// The job.
    pub job: JobId,
    /// What to copy.
    pub spec: TransferSpec,
    /// The chunk key of each of `spec.chunks` (same order): what a worker
    /// writes through to the remote tier once the copy is done.
    #[serde(default)]
    pub keys: Vec<ChunkKey>,
}

/// A remote fetch: each worker reads its share of each chunk from the remote
/// tier into the chunk's host slot (which the scheduler allocated for it, as
/// for a store), then reports the job (failed if any chunk missed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchJob {
    /// The job.
    pub job: JobId,
    /// The chunk keys.
    pub keys: Vec<ChunkKey>,
    /// Their host slots (same order).
    pub chunks: Vec<ChunkId>,
}

/// What every worker receives for one step.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WorkerPlan {
    /// Loads to start this step.
    pub loads: Vec<LoadJob>,
    /// Stores planned this step (queued, submitted at the next step).
    pub stores: Vec<StoreJob>,
    /// Jobs that must be finished before this step's compute reuses their blocks.
    pub flush: Vec<JobId>,
    /// Remote fetches to start this step.
    #[serde(default)]
    pub fetches: Vec<FetchJob>,
    /// Chunks the host tier evicted, with their slots: a worker whose tier
    /// is written on eviction writes its share of each before this plan's
    /// jobs run (the first hook).
    #[serde(default)]
    pub evictions: Vec<(ChunkKey, ChunkId)>,
}

/// Transfer statistics of one direction.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DirectionStats {
    /// Jobs finished successfully.
    pub jobs: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Summed transfer time.
    pub time: Duration,
    /// Bytes of each finished job, in completion order.
    pub sizes: Vec<u64>,
}

/// Transfer statistics, per direction.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TransferStats {
    /// GPU -> host.
    pub store: DirectionStats,
    /// Host -> GPU.
    pub load: DirectionStats,
}

impl TransferStats {
    /// The stats of `direction`.
    pub fn get_mut(&mut self, direction: Direction) -> &mut DirectionStats {
        match direction {
            Direction::Store => &mut self.store,
            Direction::Load => &mut self.load,
        }
    }
}

/// What one worker reports after a step (reset after each report).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Every job that ended since the last report (success or failure), with
    /// this worker's count (1 each); the scheduler sums counts across workers.
    pub completed: BTreeMap<JobId, u32>,
    /// Requests whose asynchronous load finished successfully.
    pub finished_loads: Vec<RequestId>,
    /// Requests whose load failed: their tokens must be recomputed.
    pub failed_loads: Vec<RequestId>,
    /// Jobs that failed (a subset of `completed`).
    pub failed: Vec<JobId>,
    /// Bytes and time of the successful jobs.
    pub stats: TransferStats,
}

impl WorkerReport {
    /// True when nothing finished.
    pub fn is_empty(&self) -> bool {
        self.completed.is_empty()
    }
}
