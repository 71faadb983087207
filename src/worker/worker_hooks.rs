//! The worker's per-step hooks (vLLM's `OffloadingConnectorWorker`;
//! `docs/dataplane.md`, "Worker hooks"): flush on preemption, start transfers, queue stores for the next
//! step, collect completions; with a remote tier attached
//! ([`OffloadWorker::with_remote_tier`]), every store that completes is also
//! written through to it (asynchronously: the tier queues and never blocks),
//! and the plan's remote fetches read chunk shares from it into host slots.

use crate::Direction;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use thiserror::Error;

use crate::ids::{ChunkId, JobId, RequestId};
use crate::key::ChunkKey;
use crate::remote::{Answer, RemoteTier, Ticket, WritePolicy};

use super::backend::{TransferBackend, TransferResult};
use super::error::BackendError;
use super::plan::{FetchJob, StoreJob, WorkerPlan, WorkerReport};
use super::remote_shares::RemoteShares;
use super::store_turns::{KeptChunks, StoreWriters, keep_chunks};

/// An error of a worker hook.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// Waiting on flushed jobs or synchronous loads failed (for example timed out).
    #[error("waiting on transfers failed: {0}")]
    Wait(#[source] BackendError),
}

/// The remote tier a worker writes its stored chunks through to.
#[derive(Debug)]
struct RemoteWrite {
    tier: RemoteTier,
    /// The shares of each chunk this worker puts and fetches.
    shares: RemoteShares,
    /// A share's bytes gathered from its slot before a put.
    gathered: Vec<u8>,
    /// Stores submitted and not reported yet: their keys and chunks.
    pending: HashMap<JobId, Vec<(ChunkKey, ChunkId)>>,
    /// Fetch jobs in flight: chunks still to come, and whether one missed.
    fetching: HashMap<JobId, FetchProgress>,
    /// Fetches asked of the tier -> their job, host slot and share (its
    /// index in `shares.held()`).
    tickets: HashMap<Ticket, (JobId, ChunkId, usize)>,
    answers: Vec<(Ticket, Answer)>,
    /// Host slots whose last store wrote only part of the chunk (a window's
    /// hole, an unaligned start): the rest is what the slot held before,
    /// so the chunk is never written to the tier, where another node would
    /// load it whole.
    partial: HashSet<ChunkId>,
}

#[derive(Debug, Clone, Copy)]
struct FetchProgress {
    remaining: usize,
    failed: bool,
}

/// One worker (one GPU, or one simulated rank) driving a transfer backend.
#[derive(Debug)]
pub struct OffloadWorker<B> {
    backend: B,
    writers: StoreWriters,
    wait_timeout: Option<Duration>,
    load_jobs: HashMap<JobId, Option<RequestId>>,
    unsubmitted: Vec<StoreJob>,
    report: WorkerReport,
    results: Vec<TransferResult>,
    remote: Option<RemoteWrite>,
}

impl<B: TransferBackend> OffloadWorker<B> {
    /// A worker over `backend`. A worker that is not the store writer (a
    /// replicated layout's rank > 0, over a host pool the writer fills)
    /// acknowledges stores and remote fetches without copying.
    pub fn new(backend: B, store_writer: bool) -> Self {
        let writers = if store_writer {
            StoreWriters::Every
        } else {
            StoreWriters::Reader
        };
        Self {
            backend,
            writers,
            wait_timeout: None,
            load_jobs: HashMap::new(),
            unsubmitted: Vec::new(),
            report: WorkerReport::default(),
            results: Vec::new(),
            remote: None,
        }
    }

    /// Writes every chunk this worker stores through to `tier` as well, under
    /// `rank` (this worker's share of the chunk), once its copy is done. The
    /// backend must expose its host pool ([`TransferBackend::host_share`]: the
    /// host and CUDA backends do); with one that does not, nothing is written
    /// and fetches fail (their requests recompute).
    pub fn with_remote_tier(mut self, tier: RemoteTier, rank: u32) -> Self {
        self.set_remote_tier(tier, rank);
        self
    }

    /// [`Self::with_remote_tier`] on a worker already built (for embedders
    /// that hold it behind a reference), before its first step. A tier set
    /// before is dropped, with its fetches in flight (never reported).
    pub fn set_remote_tier(&mut self, tier: RemoteTier, rank: u32) {
        let total = tier.world_size();
        self.set_remote_tier_shares(tier, RemoteShares::whole_slot(rank, total, true));
    }

    /// [`Self::set_remote_tier`] with the shares of each chunk this worker
    /// holds given (for example KV heads as shares,
    /// [`RemoteShares::kv_heads`]); the tier counts `shares.total()` shares
    /// a chunk.
    pub fn set_remote_tier_shares(&mut self, tier: RemoteTier, shares: RemoteShares) {
        self.remote = Some(RemoteWrite {
            tier,
            shares,
            gathered: Vec::new(),
            pending: HashMap::new(),
            fetching: HashMap::new(),
            tickets: HashMap::new(),
            answers: Vec::new(),
            partial: HashSet::new(),
        });
    }

    /// Fetch jobs started and not reported yet.
    pub fn pending_fetches(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| r.fetching.len())
    }

    /// Waits (at most `limit`, in real time) until every fetch job in flight
    /// has its answers, and queues their reports for [`Self::get_finished`].
    /// A fetch the tier gives up (its `op_timeout_ms`) is a miss, so this
    /// ends once the tier answers or gives up.
    pub fn wait_fetches(&mut self, limit: Duration) {
        let start = std::time::Instant::now();
        loop {
            self.poll_fetches();
            let Some(rw) = self.remote.as_mut() else {
                return;
            };
            let Some(&ticket) = rw.tickets.keys().next() else {
                return;
            };
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return;
            }
            let mut others = Vec::new();
            if let Some(a) = rw.tier.wait(ticket, left, &mut others) {
                rw.answers.push((ticket, a));
            }
            rw.answers.append(&mut others);
        }
    }

    /// The remote tier written through to, if any.
    pub fn remote_tier(&self) -> Option<&RemoteTier> {
        self.remote.as_ref().map(|r| &r.tier)
    }

    /// Stores whose write-through waits for their copy to finish.
    pub fn pending_remote_writes(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| r.pending.len())
    }

    /// Bounds the flush and sync-load waits (default: none, as vLLM).
    pub fn with_wait_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (fault injection in tests and simulations).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Sets which stores this worker copies (for example its turn of the
    /// workers sharing one host pool, [`StoreWriters::Turn`]): a chunk it
    /// does not write is left to another worker, and so are the chunk's
    /// remote puts and fetches.
    pub fn with_store_writers(mut self, writers: StoreWriters) -> Self {
        self.writers = writers;
        self
    }

    /// Whether this worker copies stores (all of them, or its turn's chunks).
    pub fn is_store_writer(&self) -> bool {
        self.writers.writes_any()
    }

    /// Which stores this worker copies.
    pub fn store_writers(&self) -> StoreWriters {
        self.writers
    }

    /// Loads submitted and not reported yet.
    pub fn pending_loads(&self) -> usize {
        self.load_jobs.len()
    }

    /// The backend cancelled `job`, which will never be reported: forgets it
    /// (a load's request). Returns whether the worker was tracking it.
    pub fn forget_job(&mut self, job: JobId) -> bool {
        let remote = self.remote.as_mut().is_some_and(|r| {
            r.tickets.retain(|_, (j, _, _)| *j != job);
            let fetch = r.fetching.remove(&job).is_some();
            r.pending.remove(&job).is_some() || fetch
        });
        self.load_jobs.remove(&job).is_some() || remote
    }

    /// Stores queued for the next step.
    pub fn queued_stores(&self) -> usize {
        self.unsubmitted.len()
    }

    /// Step hook 1, before the step's inputs are prepared: every flushed store of
    /// this step's plan is taken out of `plan.stores` and queued, all queued stores
    /// are submitted, then the flushed jobs (stores or loads) are waited for.
    ///
    /// With a tier written on eviction, the plan's evicted chunks are written
    /// first (before any of this plan's jobs may reuse their slots).
    pub fn handle_preemptions(&mut self, plan: &mut WorkerPlan) -> Result<(), WorkerError> {
        if !plan.evictions.is_empty() {
            self.write_evicted(&plan.evictions);
            plan.evictions.clear();
        }
        if plan.flush.is_empty() {
            return Ok(());
        }
        let flushed: Vec<StoreJob> = {
            let mut kept = Vec::with_capacity(plan.stores.len());
            let mut taken = Vec::new();
            for s in plan.stores.drain(..) {
                if plan.flush.contains(&s.job) {
                    taken.push(s);
                } else {
                    kept.push(s);
                }
            }
            plan.stores = kept;
            taken
        };
        for s in flushed {
            self.queue_store(s);
        }
        self.submit_queued_stores();
        let fetch_flushed = self
            .remote
            .as_ref()
            .is_some_and(|r| plan.flush.iter().any(|j| r.fetching.contains_key(j)));
        if fetch_flushed {
            self.wait_fetches(self.wait_timeout.unwrap_or(FETCH_FLUSH_WAIT));
        }
        self.backend
            .wait(&plan.flush, self.wait_timeout)
            .map_err(WorkerError::Wait)
    }

    /// Step hook 2: submits the stores queued in the previous step, then this
    /// step's loads; synchronous loads (no request) are waited for.
    pub fn start_transfers(&mut self, plan: &WorkerPlan) -> Result<(), WorkerError> {
        self.submit_queued_stores();
        for f in &plan.fetches {
            self.start_fetch(f);
        }
        let mut sync = Vec::new();
        for l in &plan.loads {
            match self.backend.submit_load(l.job, &l.spec) {
                Ok(()) => {
                    self.load_jobs.insert(l.job, l.request);
                    if l.request.is_none() {
                        sync.push(l.job);
                    }
                }
                Err(e) => {
                    tracing::warn!(job = %l.job, error = %e, "load refused; reported as failed");
                    self.fail(l.job, l.request);
                }
            }
        }
        if sync.is_empty() {
            return Ok(());
        }
        self.backend
            .wait(&sync, self.wait_timeout)
            .map_err(WorkerError::Wait)
    }

    /// Step hook 3: queues this step's stores for the next step (a non-writer
    /// acknowledges them at once).
    pub fn queue_stores(&mut self, plan: &mut WorkerPlan) {
        for s in plan.stores.drain(..) {
            self.queue_store(s);
        }
    }

    /// Step hook 4: everything that finished since the last call.
    pub fn get_finished(&mut self) -> WorkerReport {
        self.poll_fetches();
        self.backend.poll(&mut self.results);
        for r in self.results.drain(..) {
            if r.direction == Direction::Store
                && let Some(rw) = self.remote.as_mut()
                && let Some(items) = rw.pending.remove(&r.job)
                && r.success
                && rw.tier.write_policy() == WritePolicy::Through
            {
                write_through(&self.backend, rw, &items);
            }
            *self.report.completed.entry(r.job).or_insert(0) += 1;
            let request = match r.direction {
                Direction::Load => self.load_jobs.remove(&r.job).flatten(),
                Direction::Store => None,
            };
            if r.success {
                let s = self.report.stats.get_mut(r.direction);
                s.jobs += 1;
                s.bytes += r.bytes;
                s.time += r.duration;
                s.sizes.push(r.bytes);
                if let Some(req) = request {
                    self.report.finished_loads.push(req);
                }
            } else {
                tracing::warn!(job = %r.job, direction = %r.direction, "transfer failed");
                self.report.failed.push(r.job);
                if let Some(req) = request {
                    self.report.failed_loads.push(req);
                }
            }
        }
        std::mem::take(&mut self.report)
    }

    /// Asks the tier for each chunk share of fetch job `f`; a worker without
    /// a tier, or a slot outside its host pool view, fails it.
    fn start_fetch(&mut self, f: &FetchJob) {
        let mine;
        let f = match self.writers {
            StoreWriters::Every => f,
            _ if f.keys.len() != f.chunks.len() => f,
            writers => {
                // Another worker's chunks: its fetch fills their shared
                // slots (and reports a miss); a job of none of this
                // worker's chunks is only counted.
                let (keys, chunks) = f
                    .keys
                    .iter()
                    .zip(&f.chunks)
                    .filter(|&(_, &c)| writers.writes(c))
                    .unzip();
                mine = FetchJob {
                    job: f.job,
                    keys,
                    chunks,
                };
                if mine.chunks.is_empty() {
                    *self.report.completed.entry(f.job).or_insert(0) += 1;
                    return;
                }
                &mine
            }
        };
        let Some(rw) = self.remote.as_mut() else {
            tracing::warn!(job = %f.job, "remote fetch without a remote tier; reported as failed");
            self.fail(f.job, None);
            return;
        };
        let mut progress = FetchProgress {
            remaining: 0,
            failed: f.keys.len() != f.chunks.len() || f.keys.is_empty(),
        };
        if !progress.failed {
            for (&key, &chunk) in f.keys.iter().zip(&f.chunks) {
                // A fetch fills the whole slot (or fails, and the slot is freed).
                rw.partial.remove(&chunk);
                let Some(slot) = self.backend.host_share(chunk) else {
                    progress.failed = true;
                    continue;
                };
                for (i, share) in rw.shares.held().iter().enumerate() {
                    let Some(len) = share.len_in(slot.len) else {
                        progress.failed = true;
                        continue;
                    };
                    let t = rw.tier.fetch(key, share.index, Some(len));
                    rw.tickets.insert(t, (f.job, chunk, i));
                    progress.remaining += 1;
                }
            }
        }
        if progress.remaining == 0 {
            self.end_fetch(f.job, progress.failed);
        } else {
            rw.fetching.insert(f.job, progress);
        }
    }

    /// Applies the tier's answers: a fetched share is copied into its host
    /// slot; a job whose answers are all in is reported.
    fn poll_fetches(&mut self) {
        let Some(rw) = self.remote.as_mut() else {
            return;
        };
        rw.tier.poll(&mut rw.answers);
        let mut ended = Vec::new();
        for (ticket, answer) in rw.answers.drain(..) {
            let Some((job, chunk, i)) = rw.tickets.remove(&ticket) else {
                continue;
            };
            let ok = match (answer, rw.shares.held().get(i)) {
                (Answer::Fetched(p), Some(share)) => match self.backend.host_share(chunk) {
                    Some(slot) => {
                        // SAFETY: the slot lies in the backend's host pool,
                        // valid for writes while the backend lives (its
                        // constructor's contract). The scheduler allocated
                        // this slot to this fetch job alone (as for a store):
                        // no transfer reads or writes it until the job is
                        // reported, which happens after every share's copy;
                        // this worker's shares are disjoint ranges of it;
                        // the source is the fetched value, a separate buffer.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(slot.addr as *mut u8, slot.len)
                        };
                        share.scatter(p.bytes(), dst)
                    }
                    None => false,
                },
                _ => false,
            };
            if let Some(progress) = rw.fetching.get_mut(&job) {
                progress.remaining = progress.remaining.saturating_sub(1);
                progress.failed |= !ok;
                if progress.remaining == 0 {
                    ended.push((job, progress.failed));
                }
            }
        }
        for (job, failed) in ended {
            if let Some(rw) = self.remote.as_mut() {
                rw.fetching.remove(&job);
            }
            self.end_fetch(job, failed);
        }
    }

    /// Writes this worker's share of each evicted chunk (its slot still
    /// holds it: nothing of this plan has run yet) when the tier is written
    /// on eviction.
    fn write_evicted(&mut self, evictions: &[(ChunkKey, ChunkId)]) {
        let Some(rw) = self.remote.as_mut() else {
            return;
        };
        if rw.tier.write_policy() != WritePolicy::OnEviction {
            return;
        }
        if self.writers == StoreWriters::Every {
            write_through(&self.backend, rw, evictions);
            return;
        }
        // The chunk's writer filled its slot: it alone puts it.
        let mine: Vec<(ChunkKey, ChunkId)> = evictions
            .iter()
            .copied()
            .filter(|&(_, c)| self.writers.writes(c))
            .collect();
        write_through(&self.backend, rw, &mine);
    }

    fn end_fetch(&mut self, job: JobId, failed: bool) {
        *self.report.completed.entry(job).or_insert(0) += 1;
        if failed {
            tracing::debug!(%job, "remote fetch missed; reported as failed");
            self.report.failed.push(job);
        }
    }

    fn queue_store(&mut self, mut s: StoreJob) {
        let kept = match self.writers {
            StoreWriters::Every => KeptChunks::All,
            StoreWriters::Reader => KeptChunks::Nothing,
            writers => match self.backend.blocks_per_chunk() {
                Some(bpc) => keep_chunks(&s.spec, bpc, |c| writers.writes(c)),
                // Without the chunk geometry every chunk is copied: the
                // same bytes as its writer's, never a chunk left unwritten.
                None => KeptChunks::All,
            },
        };
        match kept {
            KeptChunks::All => self.unsubmitted.push(s),
            KeptChunks::Some(spec) => {
                s.spec = spec;
                self.unsubmitted.push(s);
            }
            // Every chunk is another worker's: acknowledged without copying
            // (the scheduler still counts every worker's report).
            KeptChunks::Nothing => *self.report.completed.entry(s.job).or_insert(0) += 1,
        }
    }

    fn submit_queued_stores(&mut self) {
        for s in std::mem::take(&mut self.unsubmitted) {
            match self.backend.submit_store(s.job, &s.spec) {
                Ok(()) => {
                    let Some(rw) = self.remote.as_mut() else {
                        continue;
                    };
                    let whole = self
                        .backend
                        .blocks_per_chunk()
                        .map(|bpc| s.spec.whole_chunks(bpc));
                    let is_whole =
                        |i: usize| whole.as_ref().is_none_or(|w| w.get(i) == Some(&true));
                    let writers = self.writers;
                    for (i, &chunk) in s.spec.chunks.iter().enumerate() {
                        if !writers.writes(chunk) {
                            // Another worker's turn: it tracks and puts it.
                            continue;
                        }
                        if is_whole(i) {
                            rw.partial.remove(&chunk);
                        } else {
                            rw.partial.insert(chunk);
                        }
                    }
                    if rw.tier.write_policy() != WritePolicy::Through {
                        continue;
                    }
                    if s.keys.len() == s.spec.chunks.len() {
                        let items = s.keys.iter().copied().zip(s.spec.chunks.iter().copied());
                        let items = items.filter(|&(_, c)| writers.writes(c));
                        rw.pending.insert(s.job, items.collect());
                    } else {
                        tracing::debug!(job = %s.job, "store without its chunk keys: not written through");
                    }
                }
                Err(e) => {
                    tracing::warn!(job = %s.job, error = %e, "store refused; reported as failed");
                    self.fail(s.job, None);
                }
            }
        }
    }

    fn fail(&mut self, job: JobId, request: Option<RequestId>) {
        *self.report.completed.entry(job).or_insert(0) += 1;
        self.report.failed.push(job);
        if let Some(req) = request {
            self.report.failed_loads.push(req);
        }
    }
}

/// Bound on waiting for flushed fetches when the worker has no wait timeout.
const FETCH_FLUSH_WAIT: Duration = Duration::from_secs(60);

/// Puts this worker's share of each chunk to the remote tier: a stored chunk
/// when its copy has finished and before the worker reports it, or an
/// evicted one before any job of the plan that evicted it runs. A chunk its
/// store wrote only in part (`RemoteWrite::partial`) is left out.
fn write_through<B: TransferBackend>(
    backend: &B,
    rw: &mut RemoteWrite,
    items: &[(ChunkKey, ChunkId)],
) {
    for &(key, chunk) in items {
        if rw.partial.contains(&chunk) {
            // Part of the chunk is stale: another node must not load it.
            tracing::debug!(%key, "chunk stored in part: not written to the remote tier");
            rw.tier.note_partial_chunk_not_put();
            continue;
        }
        let Some(slot) = backend.host_share(chunk) else {
            continue;
        };
        // SAFETY: the share lies in the backend's host pool, which is valid
        // for reads as long as the backend lives (its constructor's contract).
        // Nothing writes it while it is read: a stored chunk's store has
        // finished (reported by `poll`, which synchronizes with the copy) and
        // until this worker reports it the scheduler gives the slot to no
        // other job; an evicted chunk's slot is reused only by jobs of the
        // plan that evicted it, none of which has been submitted yet (this
        // runs in the plan's first hook). `put` copies the bytes before
        // returning.
        let bytes = unsafe { std::slice::from_raw_parts(slot.addr as *const u8, slot.len) };
        for share in rw.shares.held().iter().filter(|s| s.writes) {
            if share.ranges.is_none() {
                rw.tier.put(key, share.index, bytes);
            } else if share.gather(bytes, &mut rw.gathered) {
                rw.tier.put(key, share.index, &rw.gathered);
            }
        }
    }
}
