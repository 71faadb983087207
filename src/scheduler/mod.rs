//! The control plane: vLLM's `OffloadingConnectorScheduler` for one
//! full-attention KV group (or several groups, [`hybrid`]) and the host
//! tier, with asynchronous loads, plus stall detection with quarantine.
//!
//! One [`Scheduler`] owns the host-tier [`OffloadManager`]. The serving backend
//! calls its hooks in vLLM's order each step: [`Scheduler::add_request`],
//! [`Scheduler::lookup`], [`Scheduler::on_alloc`], [`Scheduler::build_step`]
//! (the plan for the workers), then [`Scheduler::on_worker_output`] and
//! [`Scheduler::request_finished`]. Job state lives in a concurrent table that
//! the stall watchdog scans; stalled jobs are cleaned at the next hook through
//! the same completion path as normal completions.

mod allocated;
mod completion;
mod fences;
mod hit_sources;
pub mod hybrid;
mod invariants;
mod jobs;
mod latch;
mod lookup;
#[cfg(all(test, loom))]
mod loom_models;
mod metrics;
mod preempt;
mod remote;
mod request;
mod request_table;
mod reset;
mod stall;
mod step;
mod store;
mod types;
mod watchdog;

use crate::Direction;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::SharedClock;
use crate::config::OffloadConfig;
use crate::ids::{ChunkId, GpuBlockId, JobId, RequestId};
use crate::key::{BlockHash, ChunkKey, KeyBuildHasher};
use crate::manager::{OffloadEvent, OffloadManager};

use fences::FenceIndex;
use jobs::JobTable;
use metrics::Counters;
use request::{FinishInfo, RequestState};
use request_table::RequestTable;

pub use hit_sources::HitSources;
pub use request::RequestCaps;
use stall::StalledJob;
use watchdog::{Watchdog, WatchdogShared, nanos};

pub use latch::{JobLatch, ReportEffect};
pub use watchdog::WatchdogHandle;

pub use metrics::{LOOKUP_DELAY_BUCKETS, LookupDelays, SchedulerMetrics};
pub use remote::RemoteLookupStats;
pub use types::{
    CompletionReport, GroupSpan, JobBlocks, JobKeys, JobSlots, LookupOutcome, ScanOutcome,
    ScheduledRequest, SchedulerError, SchedulerState, StepInput, StepPlan, TransferJob,
    WorkerOutcome,
};

/// Geometry and timing the scheduler needs from the configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    tokens_per_block: u64,
    blocks_per_chunk: usize,
    tokens_per_chunk: u64,
    world_size: u32,
    offload_prompt_only: bool,
}

/// A job of a reset that is still owed worker reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FencedReset {
    remaining: u32,
    /// The request of an asynchronous load (it still appears in `finished_loads`,
    /// or in `failed_loads` if a worker reported its transfer failed).
    load_req: Option<RequestId>,
    /// A worker reported the transfer failed (before or after the reset).
    failed: bool,
}

/// State of the step being built (between the first hook and `build_step`).
#[derive(Debug, Default)]
pub(crate) struct Batch {
    loads: Vec<TransferJob>,
    /// Remote fetch jobs created by this step's lookups.
    fetches: Vec<TransferJob>,
    flush: Vec<JobId>,
    allocated: allocated::AllocatedBlocks,
    /// Deadlines of the jobs created in this step, published to the watchdog
    /// at the end of the step.
    deadlines: Vec<(JobId, u64)>,
    /// Slots of the step's scheduled requests (co-indexed with its list).
    slots: Vec<u32>,
    /// Clock time of the step being built, read once for all its new jobs.
    now_ns: Option<u64>,
    /// Stores planned by the last step (the next plan's initial capacity).
    last_stores: usize,
    /// Store-list buffer handed back by [`Scheduler::recycle_plan`], reused
    /// by the next plan (empty, with its capacity).
    spare_stores: Vec<TransferJob>,
    /// Requests whose lookup reserved the step's sync-load budget (vLLM's
    /// `_current_batch_sync_loads`), and the bytes reserved.
    sync_reserved: Vec<RequestId>,
    sync_bytes: u64,
    /// This step's synchronous load jobs.
    sync_loads: Vec<JobId>,
    /// The jobs of the last plan flushed only because their hand-off's
    /// block went to another request in that step (kept until the next
    /// plan: [`Scheduler::handoff_flushes`]).
    handoff_flushes: Vec<JobId>,
}

/// The offload scheduler (control plane) for one KV group, or several
/// ([`Self::with_groups`]).
///
/// The serving backend calls its hooks in this order: per request
/// [`add_request`](Self::add_request), [`lookup`](Self::lookup) and
/// [`on_alloc`](Self::on_alloc); per step [`build_step`](Self::build_step),
/// whose plan the workers execute, then
/// [`on_worker_output`](Self::on_worker_output) with what they report; and
/// [`request_finished`](Self::request_finished) when a request ends.
///
/// ```
/// use kvoffload::scheduler::{
///     CompletionReport, LookupOutcome, ScheduledRequest, Scheduler, StepInput, StepPlan,
/// };
/// use kvoffload::{BlockHash, GpuBlockId, JobId, ManualClock, OffloadConfig, RequestId};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cfg = OffloadConfig {
///     tokens_per_block: 4,
///     blocks_per_chunk: 1,
///     ..OffloadConfig::with_chunks(16)
/// };
/// let clock = ManualClock::new();
/// let mut s = Scheduler::new(&cfg, clock.shared())?;
/// // Every worker (one here) reports every job done.
/// let done = |jobs: Vec<JobId>| CompletionReport {
///     completed: jobs.into_iter().map(|j| (j, 1)).collect(),
///     failed: vec![],
/// };
/// let jobs = |plan: &StepPlan| -> Vec<JobId> {
///     plan.stores.iter().chain(&plan.loads).map(|j| j.job).collect()
/// };
///
/// // Request 1: an 8-token prompt (two full blocks); the host tier has nothing.
/// let hashes = [BlockHash(11), BlockHash(12)];
/// let (r1, r2) = (RequestId(1), RequestId(2));
/// s.add_request(r1, 8, &hashes)?;
/// assert_eq!(s.lookup(r1, 0)?, LookupOutcome::Hit(0));
/// let blocks = [GpuBlockId(1), GpuBlockId(2)];
/// assert_eq!(s.on_alloc(r1, &blocks, 0)?, None);
/// // The step that computes the prompt stores its two chunks.
/// let plan = s.build_step(&StepInput {
///     scheduled: vec![ScheduledRequest {
///         req: r1,
///         new_block_ids: blocks.to_vec(),
///         computed_tokens: 0,
///         scheduled_tokens: 8,
///         full_table: false,
///     }],
///     ..StepInput::default()
/// })?;
/// assert_eq!(plan.stores.iter().map(|j| j.keys.len()).sum::<usize>(), 2);
/// s.on_worker_output(&done(jobs(&plan)));
/// s.request_finished(r1, &blocks, false, 8)?;
///
/// // Request 2, same prefix: its 8 tokens load from the host tier.
/// s.add_request(r2, 8, &hashes)?;
/// assert_eq!(s.lookup(r2, 0)?, LookupOutcome::Hit(8));
/// let load = s.on_alloc(r2, &[GpuBlockId(3), GpuBlockId(4)], 8)?;
/// let plan = s.build_step(&StepInput::default())?;
/// assert_eq!(plan.loads.iter().map(|j| Some(j.job)).collect::<Vec<_>>(), vec![load]);
/// let outcome = s.on_worker_output(&done(jobs(&plan)));
/// assert_eq!(outcome.finished_loads, vec![r2]);
/// s.request_finished(r2, &[GpuBlockId(3), GpuBlockId(4)], false, 8)?;
/// assert!(!s.has_pending_work());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Scheduler {
    geo: Geometry,
    manager: OffloadManager,
    clock: SharedClock,
    requests: RequestTable,
    jobs: Arc<JobTable>,
    watch: Arc<WatchdogShared>,
    watchdog: Option<Watchdog>,
    next_job: u64,
    stale_threshold: u64,
    reset_fence: HashMap<JobId, FencedReset, KeyBuildHasher>,
    fences: FenceIndex,
    being_loaded: HashMap<ChunkKey, u32, KeyBuildHasher>,
    /// With several groups: chunks a store wrote in part (a sliding-window
    /// block the storing request no longer held), with the sub-blocks it
    /// wrote; a hit that would load an unwritten one into a block its
    /// request reads stops before it (`hybrid/holes.rs`).
    partial_chunks: HashMap<ChunkKey, Box<[bool]>, KeyBuildHasher>,
    /// Hits cut before such a chunk (counter; lookups run on `&self`).
    hits_cut_at_partial_chunks: std::sync::atomic::AtomicU64,
    batch: Batch,
    stalled: HashMap<JobId, StalledJob, KeyBuildHasher>,
    /// Quarantined slots of stalled loads (since a reset) -> how many stalled
    /// loads hold them; freed when the count reaches zero.
    load_holds: HashMap<ChunkId, u32, KeyBuildHasher>,
    failed_loads: Vec<RequestId>,
    counters: Counters,
    lookup_delays: LookupDelays,
    scratch_idx: Vec<usize>,
    scratch_pos: Vec<u64>,
    scratch_keys: Vec<ChunkKey>,
    /// The remote tier behind the host tier, if one is attached.
    remote: Option<Box<remote::RemoteSide>>,
    /// With sliding-window groups, where each block sits in their tables.
    window_index: hybrid::WindowIndex,
    /// The chunks (indices in the request's keys) the last lookup's scan
    /// found in the host tier, hit or pending: vLLM's `record_lookup` set.
    last_lookup_hits: Option<std::ops::Range<usize>>,
    /// With several groups: the `(group, chunk)` of every full-attention
    /// chunk the last lookup's prefix scans found in the host tier, hit or
    /// pending (vLLM's `record_lookup` calls, repeats included).
    last_lookup_group_hits: Vec<(usize, usize)>,
    /// With several groups: each group's end of the chunks the last host
    /// lookup's prefix scan found (vLLM's `lookup_hit_end_chunk_idx`; the
    /// partial-tail lookup's bridge chunk reads it).
    last_complete_hit_ends: Vec<usize>,
    /// KV bytes per step that may be loaded synchronously (0: none), and
    /// the bytes per token it counts.
    sync_budget: u64,
    sync_bytes_per_token: u64,
    /// Several KV groups ([`Self::with_groups`]); `None`: one full-attention
    /// group, the single-group paths.
    groups: Option<std::sync::Arc<hybrid::SchedulerGroups>>,
    /// Stores of a scheduler with sliding-window groups -> the window blocks
    /// they fence from their creation (vLLM fences those while the request
    /// runs: the window moves on and frees them); the rest of a store's
    /// blocks are fenced when its request finishes.
    window_fences: HashMap<JobId, JobBlocks, KeyBuildHasher>,
    /// Partial tails of recurrent states ([`Self::enable_partial_tails`]).
    partial_tails: Option<hybrid::PartialTails>,
    /// The partial tails the last lookup or step named
    /// ([`Self::last_partial_tails`]).
    last_partial_tails: Vec<hybrid::PartialTailKey>,
    /// The partial tails of the fetch jobs planned since the last step
    /// (`hybrid/on_remote_tail.rs`): the next step names them.
    fetched_partial_tails: Vec<hybrid::PartialTailKey>,
}

impl Scheduler {
    /// A scheduler for `cfg` (validated) with its own host-tier manager and no
    /// watchdog thread (call [`Self::start_watchdog`], or [`Self::scan_now`]).
    pub fn new(cfg: &OffloadConfig, clock: SharedClock) -> Result<Self, SchedulerError> {
        let manager = OffloadManager::from_config(cfg)?;
        Ok(Self::with_manager(cfg, manager, clock))
    }

    /// A scheduler over an existing manager.
    pub fn with_manager(cfg: &OffloadConfig, manager: OffloadManager, clock: SharedClock) -> Self {
        let jobs = Arc::new(JobTable::new(nanos(cfg.stall_timeout())));
        let watch = Arc::new(WatchdogShared::new(
            Arc::clone(&jobs),
            Arc::clone(&clock),
            cfg.stall_scan_interval(),
        ));
        let bpc = cfg.blocks_per_chunk.max(1) as usize;
        let tpb = u64::from(cfg.tokens_per_block.max(1));
        Self {
            geo: Geometry {
                tokens_per_block: tpb,
                blocks_per_chunk: bpc,
                tokens_per_chunk: tpb * bpc as u64,
                world_size: cfg.world_size.max(1),
                offload_prompt_only: cfg.offload_prompt_only,
            },
            manager,
            clock,
            requests: RequestTable::default(),
            jobs,
            watch,
            watchdog: None,
            next_job: 0,
            stale_threshold: 0,
            reset_fence: HashMap::default(),
            fences: FenceIndex::default(),
            being_loaded: HashMap::default(),
            partial_chunks: HashMap::default(),
            hits_cut_at_partial_chunks: std::sync::atomic::AtomicU64::new(0),
            batch: Batch::default(),
            stalled: HashMap::default(),
            load_holds: HashMap::default(),
            failed_loads: Vec::new(),
            counters: Counters::default(),
            lookup_delays: LookupDelays::default(),
            scratch_idx: Vec::new(),
            scratch_pos: Vec::new(),
            scratch_keys: Vec::new(),
            remote: None,
            window_index: hybrid::WindowIndex::default(),
            last_lookup_hits: None,
            last_lookup_group_hits: Vec::new(),
            last_complete_hit_ends: Vec::new(),
            sync_budget: cfg.sync_load_budget_bytes,
            sync_bytes_per_token: cfg.sync_load_bytes_per_token().unwrap_or(0),
            groups: None,
            window_fences: HashMap::default(),
            partial_tails: None,
            last_partial_tails: Vec::new(),
            fetched_partial_tails: Vec::new(),
        }
    }

    /// A scheduler for a model with several KV groups (vLLM's hybrid KV
    /// cache manager: full-attention and sliding-window groups), each group's
    /// chunk `cfg`'s `blocks_per_chunk` of its blocks, each block a whole
    /// number of `cfg`'s (the finest group's block, whose hashes the
    /// requests carry). Lookups, loads and
    /// stores follow vLLM 0.33.0's `OffloadingConnector` over every group:
    /// [`Self::on_alloc_groups`] in place of [`Self::on_alloc`], and
    /// [`StepInput::group_block_ids`] in each step. One full-attention
    /// group is the single-group scheduler ([`Self::new`]).
    ///
    /// With a remote tier attached ([`Self::attach_remote`]), a lookup asks
    /// it about the chunks of every group that the host tier misses, and
    /// fetches what the hit over both tiers reads.
    pub fn with_groups(
        cfg: &OffloadConfig,
        groups: hybrid::KvGroups,
        clock: SharedClock,
    ) -> Result<Self, SchedulerError> {
        let mut s = Self::new(cfg, clock)?;
        let single = groups.shapes.len() == 1
            && groups.shapes[0].is_full_attention()
            && !groups.shapes[0].is_eagle_draft()
            && groups.shapes[0].tokens_per_chunk() == s.geo.tokens_per_chunk;
        let groups =
            hybrid::SchedulerGroups::new(groups, s.geo.tokens_per_block, s.geo.blocks_per_chunk)
                .map_err(|e| SchedulerError::Groups(e.to_string()))?;
        if !single {
            s.manager.set_position_groups(groups.len() as u32);
            s.groups = Some(std::sync::Arc::new(groups));
        }
        Ok(s)
    }

    /// KV groups this scheduler offloads (1 unless built by [`Self::with_groups`]).
    pub fn num_groups(&self) -> usize {
        self.groups.as_ref().map_or(1, |g| g.len())
    }

    /// Starts the stall watchdog thread (scans every `stall_scan_interval`; it
    /// stops and joins when the scheduler is dropped). No-op if already started.
    pub fn start_watchdog(&mut self) -> std::io::Result<()> {
        if self.watchdog.is_none() {
            self.watchdog = Some(Watchdog::start(Arc::clone(&self.watch))?);
        }
        Ok(())
    }

    /// A handle to run the watchdog's scans from another thread.
    pub fn watchdog_handle(&self) -> WatchdogHandle {
        WatchdogHandle(Arc::clone(&self.watch))
    }

    /// Whether the watchdog thread runs.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn watchdog_running(&self) -> bool {
        self.watchdog.is_some()
    }

    /// The host-tier manager (read only).
    pub fn manager(&self) -> &OffloadManager {
        &self.manager
    }

    /// The host-tier manager, bypassing the scheduler's bookkeeping (replay's
    /// manager operations and tests only).
    pub fn manager_mut(&mut self) -> &mut OffloadManager {
        &mut self.manager
    }

    /// A new request (vLLM `on_new_request`) with the hashes of its full blocks.
    pub fn add_request(
        &mut self,
        req: RequestId,
        prompt_tokens: u64,
        block_hashes: &[BlockHash],
    ) -> Result<(), SchedulerError> {
        self.apply_stalls();
        if self.requests.contains_key(&req) {
            return Err(SchedulerError::DuplicateRequest(req));
        }
        let mut rs = RequestState::new(prompt_tokens, block_hashes);
        if let Some(g) = &self.groups {
            rs.other_groups = vec![Default::default(); g.len() - 1];
        }
        self.requests.insert(req, rs);
        Ok(())
    }

    /// Blocks the backend allocated in this step to KV groups this scheduler
    /// does not offload (vLLM's groups that are not prefix-cacheable, which
    /// share the GPU block pool with the offloaded ones): the next step
    /// ([`Self::build_step`]) counts them as allocated like the offloaded groups'
    /// new blocks, so a store still reading one of them is flushed before
    /// the model writes it, and a window's table forgets it.
    pub fn note_allocated_elsewhere(&mut self, blocks: &[GpuBlockId]) {
        self.batch.allocated.extend_non_null(blocks);
    }

    /// Where the GPU prefix cache's shared prefix of `req` ends (vLLM's
    /// `Request.shared_prefix_boundary`): with sliding-window groups and a
    /// retention other than [`hybrid::Retention::Dense`], the window ending
    /// there is stored too.
    pub fn set_shared_prefix_boundary(
        &mut self,
        req: RequestId,
        tokens: u64,
    ) -> Result<(), SchedulerError> {
        let rs = self
            .requests
            .get_mut(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        rs.shared_prefix_boundary = tokens;
        Ok(())
    }

    /// Sets a request's load and store limits (vLLM `kv_transfer_params`).
    pub fn set_request_caps(
        &mut self,
        req: RequestId,
        caps: RequestCaps,
    ) -> Result<(), SchedulerError> {
        let rs = self
            .requests
            .get_mut(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        rs.caps = caps;
        Ok(())
    }

    /// New tokens of a request: `num_tokens` is the total (prompt + accepted
    /// output); `new_hashes` are the hashes of blocks completed since the last update.
    pub fn update_request(
        &mut self,
        req: RequestId,
        num_tokens: u64,
        new_hashes: &[BlockHash],
    ) -> Result<(), SchedulerError> {
        self.apply_stalls();
        let rs = self
            .requests
            .get_mut(&req)
            .ok_or(SchedulerError::UnknownRequest(req))?;
        rs.num_tokens = num_tokens;
        rs.hashes.extend_from_slice(new_hashes);
        Ok(())
    }

    /// The backend finished (or aborted) a request and will free `block_ids`.
    ///
    /// Pending stores of the request now fence their source blocks. Its last
    /// stores cover the blocks the steps gave it (as in vLLM, `block_ids` do
    /// not replace its block list), and they and the manager's
    /// `request_finished` come at the next
    /// [`Self::build_step`] that lists it in `finished`. A request the scheduler
    /// never tracked is finished in the manager at once.
    pub fn request_finished(
        &mut self,
        req: RequestId,
        block_ids: &[GpuBlockId],
        aborted: bool,
        computed_tokens: u64,
    ) -> Result<(), SchedulerError> {
        self.apply_stalls();
        self.remote_forget(req);
        let now = self.now_ns();
        let info = FinishInfo {
            aborted,
            computed_tokens,
        };
        let Some(rs) = self
            .requests
            .slot_of(&req)
            .and_then(|slot| self.requests.set_finish(slot, info))
        else {
            self.manager.request_finished(req);
            self.counters.manager_request_finished += 1;
            return Ok(());
        };
        // vLLM takes a request's blocks only from the steps that scheduled
        // it: `block_ids` here name what the backend frees, not what is
        // stored (a request aborted while its load was in flight stores
        // nothing of the blocks it never computed).
        let _ = block_ids;
        // As vLLM: a lookup still deferred when its request ends counts its
        // wait (the async delay) then.
        let deferred = rs.lookup_deferred_since_ns.take();
        for &job in &rs.jobs {
            if let Some(mut e) = self.jobs.get_mut(job)
                && e.kind == Direction::Store
                && !e.fenced
            {
                e.fenced = true;
                self.fences.add(job, e.blocks());
                // Its window blocks are among them.
                self.window_fences.remove(&job);
            }
        }
        for (&job, s) in self.stalled.iter_mut() {
            if s.req == req && s.kind == Direction::Store && !s.fenced {
                s.fenced = true;
                self.fences.add(job, &s.blocks);
            }
        }
        if let Some(since) = deferred {
            self.lookup_delays
                .observe_async(now.saturating_sub(since) as f64 / 1e9);
        }
        Ok(())
    }

    /// Drains the host tier's events (evictions before the stores reusing their space).
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        self.apply_stalls();
        self.manager.take_events()
    }

    /// Drops the host tier's pending events unbuilt (for a backend that
    /// publishes none).
    pub fn discard_events(&mut self) {
        self.apply_stalls();
        self.manager.discard_events();
    }

    /// Whether the engine must keep stepping: live jobs, an undrained reset
    /// fence, or work in the manager. Stalled jobs do not count (they may never report).
    pub fn has_pending_work(&self) -> bool {
        !self.jobs.is_empty() || !self.reset_fence.is_empty() || self.manager.has_pending_work()
    }

    /// Counts of the scheduler's state.
    pub fn state(&self) -> SchedulerState {
        SchedulerState {
            jobs: self.jobs.len(),
            requests: self.requests.len(),
            chunks_being_loaded: self.being_loaded.len(),
            fenced_blocks: self.fences.len(),
            stalled_jobs: self.stalled.len(),
            quarantined_chunks: self.quarantined_chunks(),
            manager: self.manager.stats(),
        }
    }

    /// The jobs the last [`Self::build_step`] flushed only because vLLM
    /// gave the block of their hand-off (a recurrent state's) to another
    /// request in that very step: the workers copy them before that step's
    /// compute, which would overwrite the block. vLLM 0.33.0 does not flush
    /// them (it stores the new owner's bytes); comparisons with vLLM's
    /// decisions give these jobs vLLM's completion timing.
    pub fn handoff_flushes(&self) -> &[JobId] {
        &self.batch.handoff_flushes
    }

    /// Counters and gauges.
    pub fn metrics(&self) -> SchedulerMetrics {
        let c = self.counters;
        SchedulerMetrics {
            stalled_stores: c.stalled_stores,
            stalled_loads: c.stalled_loads,
            late_reports: c.late_reports,
            reports_racing_stall: c.reports_racing_stall,
            unknown_reports: c.unknown_reports,
            cancellations_confirmed: c.cancellations_confirmed,
            allocation_failures: c.allocation_failures,
            jobs_created: c.jobs_created,
            manager_request_finished: c.manager_request_finished,
            handoffs_flushed: c.handoffs_flushed,
            scans: self.watch.scans(),
            jobs_in_flight: self.jobs.len() as u64,
            stalled_jobs: self.stalled.len() as u64,
            quarantined_chunks: self.quarantined_chunks() as u64,
        }
    }

    /// The lookup delay histograms (sync and async), since the scheduler was built.
    pub fn lookup_delays(&self) -> &LookupDelays {
        &self.lookup_delays
    }

    /// The lookup delays observed since the last call, `(sync, async)`
    /// (vLLM's stats carry each value).
    pub fn take_lookup_delays(&mut self) -> (Vec<f64>, Vec<f64>) {
        self.lookup_delays.take_recent()
    }

    /// Whether `req` is tracked.
    pub fn has_request(&self, req: RequestId) -> bool {
        self.requests.contains_key(&req)
    }

    /// The tokens (computed plus scheduled) that running request `req` must
    /// reach before a step can plan its next store (`u64::MAX`: none while
    /// it runs, as its limits end before its next chunk); `None` if it is
    /// not tracked.
    ///
    /// A step that lists `req` with no new blocks, not as a full table, and
    /// with computed plus scheduled tokens below this plans nothing for it
    /// and changes nothing of it, so a caller may leave it out of that step's
    /// [`StepInput`] (`tests/store_horizon.rs`). Steps only raise it; a
    /// lookup of `req` (which restarts its stores), a reset, and new limits
    /// ([`Self::set_request_caps`]) may lower it, so a caller caching it asks
    /// again after any of them. With several KV groups it is 0: every
    /// running request is listed in every step.
    pub fn store_horizon(&self, req: RequestId) -> Option<u64> {
        let rs = self.requests.get(&req)?;
        if self.groups.is_some() {
            // Sliding windows drop blocks of requests a step does not list.
            return Some(0);
        }
        let chunk_end = (rs.next_stored_chunk as u64 + 1).saturating_mul(self.geo.tokens_per_chunk);
        let limit = rs.offload_limit(self.geo.offload_prompt_only);
        Some(if chunk_end > limit {
            u64::MAX
        } else {
            chunk_end
        })
    }

    /// The jobs in flight for `req` (sorted), or `None` if it is not tracked.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn request_jobs(&self, req: RequestId) -> Option<Vec<JobId>> {
        self.requests.get(&req).map(|r| {
            let mut v = r.jobs.to_vec();
            v.sort_unstable();
            v
        })
    }

    /// `req`'s GPU blocks in KV group `group` as the scheduler holds them
    /// (null where a window block left the table), or `None` if it is not
    /// tracked.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn request_group_blocks(&self, req: RequestId, group: usize) -> Option<Vec<GpuBlockId>> {
        self.requests
            .get(&req)
            .map(|r| r.group_blocks(group).to_vec())
    }

    /// The next chunk index `req` will offer for storing.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn next_stored_chunk(&self, req: RequestId) -> Option<usize> {
        self.requests.get(&req).map(|r| r.next_stored_chunk)
    }

    /// Whether `job` is live (created, not complete, not stalled, not dropped by a reset).
    pub fn is_job_live(&self, job: JobId) -> bool {
        self.jobs.contains(job)
    }

    /// When `job` was created (clock time), if it is live.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn job_created(&self, job: JobId) -> Option<Duration> {
        self.jobs
            .get(job)
            .map(|e| Duration::from_nanos(e.created_ns))
    }

    /// Whether `job` is stalled and still awaits late reports.
    pub fn is_job_stalled(&self, job: JobId) -> bool {
        self.stalled.contains_key(&job)
    }

    /// Whether `key` is being loaded by an asynchronous load.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_being_loaded(&self, key: ChunkKey) -> bool {
        self.being_loaded.contains_key(&key)
    }

    /// Jobs fencing GPU block `block` (sorted).
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn fenced_jobs(&self, block: GpuBlockId) -> Vec<JobId> {
        let mut v = self.fences.jobs(block).to_vec();
        v.sort_unstable();
        v
    }

    /// Job ids below this were created before the last reset.
    pub fn stale_threshold(&self) -> JobId {
        JobId(self.stale_threshold)
    }

    /// The id the next job will get.
    ///
    /// For tests and inspection (feature `test-support`).
    #[cfg(any(test, feature = "test-support"))]
    pub fn next_job_id(&self) -> JobId {
        JobId(self.next_job)
    }

    /// Reports still owed to the reset fence.
    pub fn reset_fence_len(&self) -> usize {
        self.reset_fence.len()
    }

    fn now_ns(&self) -> u64 {
        nanos(self.clock.now())
    }

    /// The clock time of the step being built (read at its first use in the
    /// step; [`Self::build_step`] forgets it at its end).
    fn step_now_ns(&mut self) -> u64 {
        let clock = &self.clock;
        *self.batch.now_ns.get_or_insert_with(|| nanos(clock.now()))
    }

    fn new_job_id(&mut self) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        self.counters.jobs_created += 1;
        id
    }

    /// The stall timeout.
    pub fn stall_timeout(&self) -> Duration {
        Duration::from_nanos(self.jobs.stall_timeout_ns())
    }
}
