//! Plain value types exchanged with the serving backend and the workers:
//! step inputs, step plans, worker reports and their outcomes, errors.

use smallvec::SmallVec;
use thiserror::Error;

use crate::ids::{ChunkId, GpuBlockId, JobId, RequestId};
use crate::key::ChunkKey;
use crate::manager::{ManagerError, ManagerStats};

/// Answer of [`super::Scheduler::lookup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupOutcome {
    /// This many tokens beyond the computed ones can be loaded from the host tier (0: none).
    Hit(u64),
    /// Ask again at a later step (a job in flight, a pending chunk, or a chunk being
    /// loaded for another request).
    Defer,
}

/// One request scheduled in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// The request.
    pub req: RequestId,
    /// Blocks allocated to it in this step, appended to its block list.
    pub new_block_ids: Vec<GpuBlockId>,
    /// Tokens computed before this step.
    pub computed_tokens: u64,
    /// Tokens scheduled in this step.
    pub scheduled_tokens: u64,
    /// `new_block_ids` is the whole block table: replace the list instead of appending.
    pub full_table: bool,
}

/// What the serving backend's scheduler decided in one step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepInput {
    /// Requests scheduled in this step, in order.
    pub scheduled: Vec<ScheduledRequest>,
    /// Requests preempted in this step (a set).
    pub preempted: Vec<RequestId>,
    /// Requests finished since the last step, in order.
    pub finished: Vec<RequestId>,
    /// A scheduler with several KV groups ([`super::Scheduler::with_groups`]):
    /// co-indexed with `scheduled`, each request's new blocks of groups 1,
    /// 2, ... (its `new_block_ids` are group 0's; an entry may be empty when
    /// the request has no new block). Empty when no request has new blocks
    /// past group 0, and always with one group. Kept out of
    /// [`ScheduledRequest`] so that a single-group step's list stays small.
    pub group_block_ids: Vec<Vec<Vec<GpuBlockId>>>,
    /// A scheduler with a recurrent-state (Mamba) group: the blocks
    /// holding requests' states at cached boundaries that vLLM's core hands
    /// over in this step (its `boundary_state_offloads`), in its order.
    pub boundary_states: Vec<super::hybrid::BoundaryState>,
}

/// A job's chunk keys: inline up to two (a store of one or two chunks needs
/// no allocation); derefs to a slice.
pub type JobKeys = SmallVec<[ChunkKey; 2]>;
/// A job's host slots, inline up to four; derefs to a slice.
pub type JobSlots = SmallVec<[ChunkId; 4]>;
/// A job's GPU blocks, inline up to four; derefs to a slice.
pub type JobBlocks = SmallVec<[GpuBlockId; 4]>;

/// One transfer handed to every worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferJob {
    /// The job id (one counter for loads and stores).
    pub job: JobId,
    /// The request it serves.
    pub req: RequestId,
    /// GPU blocks transferred. For a load starting inside its first chunk, that
    /// chunk's leading `keys.len()*blocks_per_chunk - block_ids.len()` blocks are skipped.
    pub block_ids: JobBlocks,
    /// Host slots, co-indexed with `keys`.
    pub chunk_ids: JobSlots,
    /// Chunk keys transferred.
    pub keys: JobKeys,
    /// A job of a scheduler with several KV groups: one span per group, in
    /// group order, cutting `keys` (with `chunk_ids`) and `block_ids` into
    /// each group's part (vLLM's `group_sizes` and `block_indices`). Empty
    /// with one group.
    pub groups: Vec<GroupSpan>,
}

/// One KV group's part of a [`TransferJob`] (several groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GroupSpan {
    /// Keys (and host slots) of this group, following the previous groups'.
    pub num_keys: u32,
    /// GPU blocks of this group, following the previous groups'.
    pub num_blocks: u32,
    /// Index in the request's blocks of this group of the first block moved
    /// (vLLM's `block_indices`: for a store that moves none, 0; for a load,
    /// where its blocks would start).
    pub first_block_index: u32,
}

/// The step's instructions to the workers (vLLM's connector metadata), plus failed loads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepPlan {
    /// Loads created in this step.
    pub loads: Vec<TransferJob>,
    /// Stores created in this step.
    pub stores: Vec<TransferJob>,
    /// Jobs the workers must submit and wait for before this step's compute (sorted, unique).
    pub flush: Vec<JobId>,
    /// Requests whose load stalled since the last step: the backend must recompute
    /// those tokens (sorted, unique).
    pub failed_loads: Vec<RequestId>,
    /// Remote fetch jobs created since the last step (a remote tier attached):
    /// each worker reads its share of each chunk from the remote tier into
    /// the job's host slots (no GPU blocks).
    pub fetches: Vec<TransferJob>,
    /// Chunks the host tier evicted since the last step, with the slot each
    /// held (a remote tier written on eviction): every worker writes its
    /// share of each to the remote tier before any job of this plan runs.
    pub evictions: Vec<(ChunkKey, ChunkId)>,
    /// The loads of `loads` that are synchronous (sorted): the workers
    /// finish them before this step's compute, and their requests, which run
    /// in this step, are not told of a finished load.
    pub sync_loads: Vec<JobId>,
}

/// Completions from the workers, summed over workers (vLLM's worker metadata, aggregated).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CompletionReport {
    /// Job id → number of worker reports.
    pub completed: Vec<(JobId, u32)>,
    /// Jobs whose transfer failed on a worker. An id listed here and not in
    /// `completed` counts as one report.
    pub failed: Vec<JobId>,
}

/// What [`super::Scheduler::on_worker_output`] concluded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkerOutcome {
    /// Requests whose asynchronous load has now been reported by every worker (sorted).
    pub finished_loads: Vec<RequestId>,
    /// Requests whose load failed on a worker (sorted): recompute.
    pub failed_loads: Vec<RequestId>,
    /// Report entries that were rejected (unknown job, too many reports), not applied.
    pub rejected: Vec<(JobId, SchedulerError)>,
}

/// What one synchronous stall scan found and cleaned up.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScanOutcome {
    /// Jobs expired by this scan (sorted).
    pub stalled: Vec<JobId>,
    /// Requests whose load was among them (sorted).
    pub failed_loads: Vec<RequestId>,
}

/// Counts of the scheduler's state (the trace's `state` operation).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SchedulerState {
    /// Live jobs: created, not fully reported, not stalled, not dropped by a reset.
    pub jobs: usize,
    /// Tracked requests.
    pub requests: usize,
    /// Distinct keys of in-flight asynchronous loads.
    pub chunks_being_loaded: usize,
    /// Distinct GPU blocks with a pending store of a finished request.
    pub fenced_blocks: usize,
    /// Stalled jobs whose late reports are still due.
    pub stalled_jobs: usize,
    /// Host chunks held by stalled jobs until their late reports arrive.
    pub quarantined_chunks: usize,
    /// The host tier's occupancy.
    pub manager: ManagerStats,
}

/// A hook call the scheduler rejects. The scheduler's state is unchanged when one
/// is returned, except where a variant says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchedulerError {
    /// The request is not tracked.
    #[error("unknown request {0}")]
    UnknownRequest(RequestId),
    /// `add_request` for a request that is already tracked.
    #[error("request {0} already exists")]
    DuplicateRequest(RequestId),
    /// A report for a job that does not exist.
    #[error("unknown job {0}")]
    UnknownJob(JobId),
    /// More reports than the job still expects.
    #[error("{job} expects {expected} more reports, got {got}")]
    TooManyReports {
        /// The job.
        job: JobId,
        /// Reports still expected.
        expected: u32,
        /// Reports received.
        got: u32,
    },
    /// `alloc` with external tokens for a request without a lookup since its last restart.
    #[error("request {0} has no lookup to allocate for")]
    NoLookup(RequestId),
    /// `alloc` with external tokens while the request has jobs in flight.
    #[error("request {0} has jobs in flight; no load can be created")]
    JobsInFlight(RequestId),
    /// The load range runs past the request's blocks or chunk keys.
    #[error("load range of request {req} is out of bounds: {what}")]
    LoadOutOfRange {
        /// The request.
        req: RequestId,
        /// What ran short.
        what: String,
    },
    /// A preempted request has an older job in flight that is not a store
    /// (invariant D.3: loads must have finished or be from this step).
    #[error(
        "preempted request {req} has an older pending {kind} job {job}; only stores may be flushed"
    )]
    PreemptedWithPendingLoad {
        /// The request.
        req: RequestId,
        /// The offending job.
        job: JobId,
        /// Its kind.
        kind: &'static str,
    },
    /// `reset` between a step's `alloc` (or a lookup that reserved a sync
    /// load) and its `step`.
    #[error(
        "reset with a step in progress (loads, allocations or sync-load reservations not yet planned)"
    )]
    ResetMidStep,
    /// `confirm_cancelled` for a job that is not stalled.
    #[error("{0} is not a stalled job")]
    NotStalled(JobId),
    /// The KV groups given are not ones this scheduler can offload, or a
    /// call does not match the scheduler's groups.
    #[error("KV groups: {0}")]
    Groups(String),
    /// The host tier refused the operation.
    #[error("host tier: {0}")]
    Manager(#[from] ManagerError),
}

/// A copy of `items` as an inline-first vector. A store has one or two
/// chunks: those are copied into the inline array directly (the loop has a
/// constant bound and unrolls), which is cheaper than `from_slice`'s `memcpy`
/// call or `clone`'s generic iterator.
#[inline(always)]
pub(crate) fn copy_small<T: Copy, const N: usize>(items: &[T]) -> SmallVec<[T; N]> {
    match items.first() {
        Some(&first) if items.len() <= N => {
            let mut buf = [first; N];
            for (i, b) in buf.iter_mut().enumerate().skip(1) {
                if let Some(&x) = items.get(i) {
                    *b = x;
                }
            }
            SmallVec::from_buf_and_len(buf, items.len())
        }
        _ => SmallVec::from_slice(items),
    }
}

/// How a job ended (the one completion path, `completion.rs`, takes it; the
/// stall path, `stall.rs`, ends jobs as stalled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Every worker reported; `failed` if one reported a failed transfer.
    Reported { failed: bool },
    /// The watchdog declared it stalled.
    Stalled,
}
