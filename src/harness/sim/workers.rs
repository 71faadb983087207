//! A pool of worker threads, one [`OffloadWorker`] each over a transfer backend
//! wrapped in a [`FaultInjector`] (a [`HostBackend`] here, a CUDA backend in
//! [`super::cuda_workers`]), driven in lock step: every step each worker runs
//! its four hooks, waits for the transfers it submitted (never for a stalled
//! one), and reports.
//!
//! Waiting before the report makes what a step reports depend only on the plan
//! and the injected faults, not on thread timing: a simulation is reproducible.
//!
//! Each worker thread also owns a [`ContentChecker`] over its simulated GPU
//! memory ([`super::content`]): a command's checks run before anything else
//! of it, its writes after the step's wait, where no transfer of the worker
//! is in flight.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;

use super::content::{ContentChecker, ContentOps, ContentResult, HostGpuMemory};
use crate::clock::SharedClock;
use crate::ids::JobId;
use crate::remote::{Namespace, RedisConnector, RemoteStats, RemoteTier, RemoteTierConfig};
use crate::worker::cuda::CudaError;
use crate::worker::numa::{self, HostPlacement, NumaError, PoolNear, PoolPlacement, SysfsTopology};
use crate::worker::{
    Fault, FaultControl, FaultInjector, GpuLayout, HostBackend, HostBackendOptions, HostBuffer,
    HostBufferError, HostRowLayout, LayoutError, OffloadWorker, StoreWriters, TransferBackend,
    WorkerLayout, WorkerPlan, WorkerReport,
};

/// Bound on one wait for a step's transfers (a wedged copy thread, not a stall).
pub(crate) const STEP_WAIT: Duration = Duration::from_secs(60);

/// Why the pool could not be built or a step failed.
#[derive(Debug, Error)]
pub enum PoolError {
    /// Memory for the simulated GPU or host pool.
    #[error("allocating buffers: {0}")]
    Buffer(#[from] HostBufferError),
    /// The layout was rejected.
    #[error("layout: {0}")]
    Layout(#[from] LayoutError),
    /// A worker thread could not start.
    #[error("starting a worker thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// No CUDA driver or device: the CUDA backend cannot run here.
    #[error("cuda backend unavailable: {0}")]
    CudaUnavailable(#[source] CudaError),
    /// A worker's CUDA backend could not be set up.
    #[error("worker {worker}: cuda: {source}")]
    Cuda {
        /// The worker's rank.
        worker: u32,
        /// The error.
        #[source]
        source: CudaError,
    },
    /// A worker's remote tier could not start (refused credentials, a
    /// configuration the store cannot use).
    #[error("worker {worker}: {message}")]
    Remote {
        /// The worker's rank.
        worker: u32,
        /// What went wrong (never a password).
        message: String,
    },
    /// The host pool could not be placed on the NUMA node asked for.
    #[error("host pool placement: {0}")]
    Numa(#[from] NumaError),
    /// A worker hook failed, or a worker thread is gone.
    #[error("worker {worker}: {message}")]
    Worker {
        /// The worker's rank.
        worker: u32,
        /// What went wrong.
        message: String,
    },
}

/// What one worker does in one step.
#[derive(Debug, Clone, Default)]
pub struct WorkerCommand {
    /// The step's plan.
    pub plan: WorkerPlan,
    /// Faults to inject (apply when the job is submitted on this worker).
    pub faults: Vec<(JobId, Fault)>,
    /// Stalled jobs to let run late now.
    pub release: Vec<JobId>,
    /// Stalled jobs the backend cancels now: they never copy nor report, and
    /// the worker forgets them (applied before `release` and the plan).
    pub cancel: Vec<JobId>,
    /// After the step, wait (boundedly) until the worker's remote tier has
    /// written every queued put, and report its stats.
    pub report_remote: bool,
    /// The content check's blocks: checked before anything else of the
    /// command runs, written after the step's transfers were waited for.
    pub content: ContentOps,
}

/// What each worker needs to write its stored chunks through to a remote
/// tier: every worker opens its own connection, as each GPU worker process
/// would.
#[derive(Debug, Clone)]
pub struct RemoteAttach {
    /// Where the store is.
    pub config: RemoteTierConfig,
    /// The deployment's namespace.
    pub namespace: Namespace,
    /// The clock of the tiers' deadlines and backoff.
    pub clock: SharedClock,
}

/// What the pool returns for one step.
#[derive(Debug, Clone, Default)]
pub struct PoolStep {
    /// One report per worker, by rank.
    pub reports: Vec<WorkerReport>,
    /// Stalled jobs released because a flush named them (they run late).
    pub released_by_flush: Vec<JobId>,
    /// Stalled jobs released as the command asked (they were still held).
    pub released: Vec<JobId>,
    /// Stalled jobs cancelled as the command asked (they were still held).
    pub cancelled: Vec<JobId>,
    /// Per-job entries the workers hold after the step, all workers together:
    /// jobs submitted and not reported (stalled ones included), pending loads,
    /// injected faults not applied yet, remote writes waiting for their
    /// store. Zero once everything has drained.
    pub tracked_jobs: u64,
    /// Each worker's remote tier stats, by rank (when the command asked and
    /// the worker has a tier).
    pub remote: Vec<RemoteStats>,
    /// Each worker's content check, by rank.
    pub content: Vec<ContentResult>,
}

struct Reply {
    report: Result<WorkerReport, String>,
    released_by_flush: Vec<JobId>,
    released: Vec<JobId>,
    cancelled: Vec<JobId>,
    tracked_jobs: u64,
    remote: Option<RemoteStats>,
    content: ContentResult,
}

/// The shape of a pool: its workers, their simulated GPU pages and the host
/// pool they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Number of workers (tensor-parallel ranks; 0 counts as 1).
    pub world_size: u32,
    /// GPU blocks per worker.
    pub gpu_blocks: u32,
    /// Bytes of one GPU block (a cross-layer page).
    pub block_bytes: u64,
    /// GPU blocks per host chunk (0 counts as 1).
    pub blocks_per_chunk: u32,
    /// Rows (chunks) of the shared host pool.
    pub num_chunks: u32,
    /// Every worker holds the same KV (vLLM's MLA replicated on every
    /// tensor-parallel rank): a row keeps one copy of a chunk, which every
    /// worker maps, and the workers write the stores by turns of host chunk
    /// (`docs/dataplane.md`, "Replicated KV by turns").
    pub replicated: bool,
    /// Where the host pool goes (its NUMA node).
    pub numa: HostPlacement,
}

impl PoolGeometry {
    /// Worker slots in a host row: one where the workers hold the same KV,
    /// else one a worker.
    pub fn row_slots(&self) -> u32 {
        if self.replicated {
            1
        } else {
            self.world_size.max(1)
        }
    }

    /// The host slot of worker `rank`, which is also the rank its content
    /// pattern and its remote share are drawn for (0 for every worker
    /// where they hold the same KV).
    pub fn slot_of(&self, rank: u32) -> u32 {
        if self.replicated { 0 } else { rank }
    }

    /// Which stores worker `rank` copies: every one, or its turn of host
    /// chunk where the workers hold the same KV.
    pub fn writers_of(&self, rank: u32) -> StoreWriters {
        if self.replicated {
            StoreWriters::turn(rank, self.world_size.max(1)).unwrap_or(StoreWriters::Every)
        } else {
            StoreWriters::Every
        }
    }
}

/// Worker threads (one per simulated GPU), each owning its backend.
#[derive(Debug)]
pub struct WorkerPool {
    txs: Vec<Sender<WorkerCommand>>,
    rxs: Vec<Receiver<Reply>>,
    handles: Vec<JoinHandle<()>>,
    placement: Option<PoolPlacement>,
    /// Host copy threads started, and those running on the pool's node.
    copy_threads: (usize, usize),
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reply").finish_non_exhaustive()
    }
}

impl WorkerPool {
    /// An empty pool; [`Self::spawn`] adds workers.
    pub(crate) fn empty() -> Self {
        Self {
            txs: Vec::new(),
            rxs: Vec::new(),
            handles: Vec::new(),
            placement: None,
            copy_threads: (0, 0),
        }
    }

    /// Starts worker `rank`: `make` builds its worker on the new thread (so a
    /// backend that must not change threads never does) and `keep` is dropped
    /// after the worker (memory its backend addresses); `checker` runs the
    /// content check on the worker's GPU memory, on the same thread. Waits
    /// until the worker is built and returns its error if it could not be.
    pub(crate) fn spawn<B, K>(
        &mut self,
        rank: u32,
        keep: K,
        checker: ContentChecker,
        make: impl FnOnce() -> Result<OffloadWorker<B>, PoolError> + Send + 'static,
    ) -> Result<(), PoolError>
    where
        B: TransferBackend + FaultControl,
        K: Send + 'static,
    {
        let (tx, rx) = mpsc::channel::<WorkerCommand>();
        let (rtx, rrx) = mpsc::channel::<Reply>();
        let (itx, irx) = mpsc::channel::<Result<(), PoolError>>();
        let h = std::thread::Builder::new()
            .name(format!("kvoffload-sim-worker-{rank}"))
            .spawn(move || {
                let _keep = keep;
                match make() {
                    Ok(worker) => {
                        if itx.send(Ok(())).is_ok() {
                            worker_loop(worker, checker, rx, rtx);
                        }
                    }
                    Err(e) => {
                        let _ = itx.send(Err(e));
                    }
                }
            })
            .map_err(PoolError::Spawn)?;
        let started = irx.recv().unwrap_or_else(|_| {
            Err(PoolError::Worker {
                worker: rank,
                message: "worker thread ended while starting".into(),
            })
        });
        if let Err(e) = started {
            let _ = h.join();
            return Err(e);
        }
        self.txs.push(tx);
        self.rxs.push(rrx);
        self.handles.push(h);
        Ok(())
    }

    /// `world_size` workers, each with `gpu_blocks` blocks of `block_bytes`
    /// (cross-layer pages), sharing a host pool of `num_chunks` rows of
    /// `blocks_per_chunk` blocks per worker; each worker's host backend is
    /// wrapped in a [`FaultInjector`] (as the CUDA pool's backends are).
    pub fn new(geometry: PoolGeometry) -> Result<Self, PoolError> {
        Self::host(geometry, None)
    }

    /// As [`Self::new`], each worker writing its stored chunks through to its
    /// own [`RemoteTier`] on `remote` (under its rank).
    pub fn host_with_remote(
        geometry: PoolGeometry,
        remote: RemoteAttach,
    ) -> Result<Self, PoolError> {
        Self::host(geometry, Some(remote))
    }

    fn host(geometry: PoolGeometry, remote: Option<RemoteAttach>) -> Result<Self, PoolError> {
        let PoolGeometry {
            world_size,
            gpu_blocks,
            block_bytes,
            blocks_per_chunk,
            num_chunks,
            ..
        } = geometry;
        let world = world_size.max(1);
        let row = HostRowLayout::uniform(
            blocks_per_chunk.max(1),
            geometry.row_slots(),
            &[block_bytes],
        )?;
        let pool_bytes = row
            .pool_bytes(num_chunks)
            .ok_or(LayoutError::Overflow("host pool size"))?;
        // No GPU to be near: `auto` leaves the pool where the kernel puts it.
        let guard = numa::enter(geometry.numa, &PoolNear::NoGpu, &SysfsTopology::system())?;
        let pool = Arc::new(HostBuffer::new(pool_bytes as usize)?);
        let mut me = Self::empty();
        let placement = guard.finish(pool.addr() as usize, pool.len());
        let home = placement.home();
        me.placement = Some(placement);
        for rank in 0..world {
            let gpu = Arc::new(HostBuffer::new(
                (u64::from(gpu_blocks) * block_bytes) as usize,
            )?);
            let layout = WorkerLayout::new(
                GpuLayout::cross_layer(gpu.addr(), gpu_blocks, block_bytes, block_bytes)?,
                row.clone(),
                geometry.slot_of(rank),
                pool.addr(),
                num_chunks,
            )?;
            let backend = HostBackend::new(
                layout,
                vec![Arc::clone(&gpu), Arc::clone(&pool)],
                HostBackendOptions {
                    home: home.clone(),
                    ..HostBackendOptions::default()
                },
            )?;
            me.copy_threads.0 += 2;
            me.copy_threads.1 += backend.copy_threads_on_home_node();
            let remote = remote.clone();
            let checker = ContentChecker::new(
                Box::new(HostGpuMemory::new(Arc::clone(&gpu))),
                geometry.slot_of(rank),
                block_bytes,
            );
            me.spawn(rank, (), checker, move || {
                let w = OffloadWorker::new(FaultInjector::new(backend), true)
                    .with_store_writers(geometry.writers_of(rank))
                    .with_wait_timeout(Some(STEP_WAIT));
                attach_remote(w, rank, geometry, remote)
            })?;
        }
        Ok(me)
    }

    /// Where the host pool was placed (its NUMA node), once allocated.
    pub fn host_placement(&self) -> Option<&PoolPlacement> {
        self.placement.as_ref()
    }

    /// The placement as one line: where the pool was placed and its pages
    /// are, and, where it was placed and host copy threads copy to it, how
    /// many of them run on its node's CPUs.
    pub fn host_placement_line(&self) -> Option<String> {
        let p = self.placement.as_ref()?;
        let (threads, on_node) = self.copy_threads;
        Some(match p.node {
            Some(_) if threads > 0 => {
                format!("{p}; host copy threads on its CPUs: {on_node} of {threads}")
            }
            _ => p.to_string(),
        })
    }

    /// The placement as gauges (one pool).
    pub fn placement_metrics(&self) -> crate::metrics::PlacementMetrics {
        let mut m = crate::metrics::PlacementMetrics::default();
        if let Some(p) = &self.placement {
            m.add_pool(p, self.copy_threads.1);
        }
        m
    }

    /// Where the host pool was placed, kept (the CUDA pool sets it).
    pub(crate) fn set_host_placement(&mut self, p: PoolPlacement) {
        self.placement = Some(p);
    }

    /// Number of workers.
    pub fn world_size(&self) -> u32 {
        self.txs.len() as u32
    }

    /// Runs one step on every worker (in parallel) and collects their reports.
    pub fn step(&mut self, cmds: Vec<WorkerCommand>) -> Result<PoolStep, PoolError> {
        let gone = |worker: usize| PoolError::Worker {
            worker: worker as u32,
            message: "worker thread is gone".into(),
        };
        for (i, (tx, cmd)) in self.txs.iter().zip(cmds).enumerate() {
            tx.send(cmd).map_err(|_| gone(i))?;
        }
        let mut out = PoolStep::default();
        for (i, rx) in self.rxs.iter().enumerate() {
            let reply = rx.recv().map_err(|_| gone(i))?;
            out.released_by_flush.extend(reply.released_by_flush);
            out.released.extend(reply.released);
            out.cancelled.extend(reply.cancelled);
            out.tracked_jobs += reply.tracked_jobs;
            out.remote.extend(reply.remote);
            out.content.push(reply.content);
            let report = reply.report.map_err(|message| PoolError::Worker {
                worker: i as u32,
                message,
            })?;
            out.reports.push(report);
        }
        out.released_by_flush.sort_unstable();
        out.released_by_flush.dedup();
        Ok(out)
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.txs.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Bound on waiting for a worker's remote tier to write its queued puts.
const REMOTE_FLUSH_WAIT: Duration = Duration::from_secs(30);

/// `w` writing through to its own tier on `remote` (if any), as `rank` of
/// `world` ranks.
/// Attaches worker `rank` to the remote tier, its share of a chunk the
/// geometry's (one share for every worker where they hold the same KV).
pub(super) fn attach_remote<B: TransferBackend>(
    w: OffloadWorker<B>,
    rank: u32,
    geometry: PoolGeometry,
    remote: Option<RemoteAttach>,
) -> Result<OffloadWorker<B>, PoolError> {
    let Some(r) = remote else {
        return Ok(w);
    };
    let err = |message: String| PoolError::Remote {
        worker: rank,
        message,
    };
    let connector = RedisConnector::new(&r.config).map_err(|e| err(e.to_string()))?;
    let shares = geometry.row_slots();
    let tier = RemoteTier::start(Box::new(connector), &r.config, r.namespace, shares, r.clock)
        .map_err(|e| err(e.to_string()))?;
    Ok(w.with_remote_tier(tier, geometry.slot_of(rank)))
}

/// The worker's remote stats once its queued puts are written (or the wait
/// bound passed: the stats then show them as queued).
fn remote_report<B: TransferBackend>(w: &OffloadWorker<B>) -> Option<RemoteStats> {
    let tier = w.remote_tier()?;
    tier.wait_queued_puts(REMOTE_FLUSH_WAIT);
    Some(tier.stats())
}

fn worker_loop<B: TransferBackend + FaultControl>(
    mut w: OffloadWorker<B>,
    mut checker: ContentChecker,
    rx: Receiver<WorkerCommand>,
    tx: Sender<Reply>,
) {
    let mut known: HashSet<JobId> = HashSet::new();
    let mut stall_set: HashSet<JobId> = HashSet::new();
    for cmd in rx {
        let WorkerCommand {
            mut plan,
            faults,
            release,
            cancel,
            report_remote,
            content,
        } = cmd;
        let mut checked = if content.check.is_empty() {
            Ok(ContentResult::default())
        } else {
            // SAFETY: nothing is in flight on this worker's GPU memory here.
            // The previous command's `run_step` waited for every job this
            // worker submitted that a stall does not hold (or failed, and the
            // pool stopped); a held job was never given to the wrapped
            // backend (the injector keeps only its spec), and nothing of this
            // command (releases, flushes, hooks) has run yet. Other workers'
            // transfers never address this worker's memory.
            unsafe { checker.check(&content) }
        };
        // A cancelled job never reports: everything kept for it goes now.
        let mut cancelled = Vec::new();
        for job in cancel {
            if w.backend_mut().cancel_stalled(job) {
                cancelled.push(job);
            }
            w.forget_job(job);
            known.remove(&job);
            stall_set.remove(&job);
        }
        for (job, f) in faults {
            if f == Fault::Stall {
                stall_set.insert(job);
            }
            w.backend_mut().set_fault(job, f);
        }
        let mut released = Vec::new();
        for job in release {
            if w.backend_mut().release_stalled(job) {
                stall_set.remove(&job);
                released.push(job);
            }
        }
        // A flush waits for its jobs: one stalled on this backend runs late now.
        let mut released_by_flush = Vec::new();
        for &job in &plan.flush {
            if w.backend_mut().release_stalled(job) {
                stall_set.remove(&job);
                released_by_flush.push(job);
            } else if stall_set.remove(&job) {
                // Not submitted yet: the flush submits it now, so it must not stall.
                w.backend_mut().set_fault(job, Fault::DelayPolls(0));
                released_by_flush.push(job);
            }
        }
        known.extend(plan.loads.iter().map(|l| l.job));
        known.extend(plan.stores.iter().map(|s| s.job));
        known.extend(plan.fetches.iter().map(|f| f.job));
        let mut report = run_step(&mut w, &mut plan, &known);
        if let (Ok(_), Ok(r)) = (&report, &mut checked)
            && !content.write.is_empty()
        {
            // SAFETY: `run_step` just waited for every job this worker
            // submitted that a stall does not hold (held jobs were never given
            // to the wrapped backend); the stores queued in this step are
            // submitted by the next command's hooks, after this write.
            if let Err(e) = unsafe { checker.write(&content, r) } {
                checked = Err(e);
            }
        }
        let content = match checked {
            Ok(r) => r,
            Err(e) => {
                if report.is_ok() {
                    report = Err(format!("content check: {e}"));
                }
                ContentResult::default()
            }
        };
        if let Ok(r) = &report {
            for job in r.completed.keys() {
                known.remove(job);
                stall_set.remove(job);
            }
        }
        let tracked_jobs = (known.len()
            + stall_set.len()
            + w.pending_loads()
            + w.pending_remote_writes()
            + w.pending_fetches()
            + w.backend().in_flight()
            + w.backend().pending_faults()) as u64;
        let remote = if report_remote {
            remote_report(&w)
        } else {
            None
        };
        if tx
            .send(Reply {
                report,
                released_by_flush,
                released,
                cancelled,
                tracked_jobs,
                remote,
                content,
            })
            .is_err()
        {
            return;
        }
    }
}

fn run_step<B: TransferBackend + FaultControl>(
    w: &mut OffloadWorker<B>,
    plan: &mut WorkerPlan,
    known: &HashSet<JobId>,
) -> Result<WorkerReport, String> {
    w.handle_preemptions(plan).map_err(|e| e.to_string())?;
    w.start_transfers(plan).map_err(|e| e.to_string())?;
    w.queue_stores(plan);
    let stalled: HashSet<JobId> = w.backend().stalled().into_iter().collect();
    let mut ids: Vec<JobId> = known.difference(&stalled).copied().collect();
    ids.sort_unstable();
    w.backend_mut()
        .wait(&ids, Some(STEP_WAIT))
        .map_err(|e| e.to_string())?;
    // Remote fetches too: a step reports what its plan started, whatever the
    // threads' timing (the tier answers or gives up, as a miss).
    w.wait_fetches(STEP_WAIT);
    Ok(w.get_finished())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(world_size: u32) -> PoolGeometry {
        PoolGeometry {
            world_size,
            gpu_blocks: 8,
            block_bytes: 256,
            blocks_per_chunk: 1,
            num_chunks: 4,
            replicated: false,
            numa: HostPlacement::Auto,
        }
    }
    use crate::ids::RequestId;
    use crate::worker::{LoadJob, TransferSpec};

    fn load_plan(job: JobId) -> WorkerPlan {
        WorkerPlan {
            loads: vec![LoadJob {
                job,
                request: Some(RequestId(job.0)),
                spec: TransferSpec::new(&[1], 0, &[0]),
            }],
            ..WorkerPlan::default()
        }
    }

    fn store_plan(job: JobId, block: u32, chunk: u32) -> WorkerPlan {
        WorkerPlan {
            stores: vec![crate::worker::StoreJob {
                job,
                spec: TransferSpec::new(&[block], 0, &[chunk]),
                keys: Vec::new(),
            }],
            ..WorkerPlan::default()
        }
    }

    fn load_into(job: JobId, block: u32, chunk: u32) -> WorkerPlan {
        WorkerPlan {
            loads: vec![LoadJob {
                job,
                request: Some(RequestId(job.0)),
                spec: TransferSpec::new(&[block], 0, &[chunk]),
            }],
            ..WorkerPlan::default()
        }
    }

    fn check(pairs: &[(u32, u64)]) -> ContentOps {
        ContentOps {
            check: pairs
                .iter()
                .map(|&(b, h)| crate::harness::sim::content::BlockCheck {
                    block: crate::ids::GpuBlockId(b),
                    hash: crate::key::BlockHash(h),
                    kind: crate::harness::sim::content::CheckKind::Load,
                })
                .collect(),
            ..ContentOps::default()
        }
    }

    /// Runs the same command on both workers of `pool`.
    fn both(pool: &mut WorkerPool, cmd: WorkerCommand) -> PoolStep {
        pool.step(vec![cmd.clone(), cmd]).unwrap()
    }

    /// The content check through the workers' lock step: a computed block's
    /// pattern survives a store and a load into another block on each worker
    /// (each with its own rank's pattern); a block that was never written, a
    /// failed load's block, and a corrupted block are mismatches.
    #[test]
    fn content_survives_a_store_and_a_load_and_garbage_does_not_pass() {
        let mut pool = WorkerPool::new(geometry(2)).unwrap();
        let written = |pairs: &[(u32, u64)]| ContentOps {
            write: pairs
                .iter()
                .map(|&(b, h)| (crate::ids::GpuBlockId(b), crate::key::BlockHash(h)))
                .collect(),
            ..ContentOps::default()
        };
        // Step 1: blocks 1 and 4 computed (hashes 11, 44); block 1 stored to chunk 0.
        let out = both(
            &mut pool,
            WorkerCommand {
                plan: store_plan(JobId(1), 1, 0),
                content: written(&[(1, 11), (4, 44)]),
                ..WorkerCommand::default()
            },
        );
        assert!(out.content.iter().all(|c| c.written == 2));
        // Step 2: the store runs (queued stores are submitted the step after).
        let out = both(&mut pool, WorkerCommand::default());
        assert!(
            out.reports
                .iter()
                .all(|r| r.completed.get(&JobId(1)) == Some(&1))
        );
        // Step 3: chunk 0 loaded into block 2 on both workers, into block 3
        // with a failure injected on worker 1.
        let mut cmds = Vec::new();
        for rank in 0..2 {
            let mut plan = load_into(JobId(2), 2, 0);
            plan.loads.extend(load_into(JobId(3), 3, 0).loads);
            cmds.push(WorkerCommand {
                plan,
                faults: if rank == 1 {
                    vec![(JobId(3), Fault::Fail)]
                } else {
                    Vec::new()
                },
                ..WorkerCommand::default()
            });
        }
        let out = pool.step(cmds).unwrap();
        assert_eq!(out.reports[1].failed, vec![JobId(3)]);
        // Step 4: the loaded block holds hash 11 on both workers; the failed
        // load's block does not on worker 1; block 5 was never written.
        let out = both(
            &mut pool,
            WorkerCommand {
                content: check(&[(2, 11), (1, 11), (4, 44), (3, 11), (5, 55)]),
                ..WorkerCommand::default()
            },
        );
        assert_eq!(out.content[0].checked, 5);
        assert_eq!(out.content[0].mismatches, 1, "{:?}", out.content[0]);
        assert_eq!(out.content[0].described[0].check.block.0, 5);
        assert_eq!(out.content[1].mismatches, 2, "{:?}", out.content[1]);
        let bad: Vec<u32> = out.content[1]
            .described
            .iter()
            .map(|m| m.check.block.0)
            .collect();
        assert_eq!(bad, vec![3, 5]);
        // A block written corrupted on worker 0, stored and loaded back: only
        // worker 0 sees the mismatch, in the loaded copy.
        pool.step(vec![
            WorkerCommand {
                plan: store_plan(JobId(4), 6, 1),
                content: ContentOps {
                    corrupt_written: true,
                    ..written(&[(6, 66)])
                },
                ..WorkerCommand::default()
            },
            WorkerCommand {
                plan: store_plan(JobId(4), 6, 1),
                content: written(&[(6, 66)]),
                ..WorkerCommand::default()
            },
        ])
        .unwrap();
        both(&mut pool, WorkerCommand::default());
        both(
            &mut pool,
            WorkerCommand {
                plan: load_into(JobId(5), 7, 1),
                ..WorkerCommand::default()
            },
        );
        let out = both(
            &mut pool,
            WorkerCommand {
                content: check(&[(7, 66)]),
                ..WorkerCommand::default()
            },
        );
        assert_eq!(
            (out.content[0].mismatches, out.content[1].mismatches),
            (1, 0)
        );
        assert_eq!(out.content[0].described[0].offset, 0);
    }

    /// A check of a block outside the memory fails the step with a typed
    /// error, not a panic.
    #[test]
    fn a_check_outside_the_memory_fails_the_step() {
        let mut pool = WorkerPool::new(geometry(1)).unwrap();
        let err = pool
            .step(vec![WorkerCommand {
                content: check(&[(8, 1)]),
                ..WorkerCommand::default()
            }])
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("content check: block 8 is outside"),
            "{err}"
        );
    }

    /// A stalled job that is cancelled leaves nothing behind on its worker:
    /// many of them must not grow the workers' per-job state.
    #[test]
    fn cancelled_stalls_leave_nothing_on_the_workers() {
        let mut pool = WorkerPool::new(geometry(2)).unwrap();
        for i in 1..=300 {
            let job = JobId(i);
            let out = pool
                .step(vec![
                    WorkerCommand {
                        plan: load_plan(job),
                        faults: vec![(job, Fault::Stall)],
                        ..WorkerCommand::default()
                    },
                    WorkerCommand {
                        plan: load_plan(job),
                        ..WorkerCommand::default()
                    },
                ])
                .unwrap();
            assert!(out.reports[0].completed.is_empty(), "worker 0 stalls");
            assert_eq!(out.reports[1].completed.get(&job), Some(&1));
            assert!(out.tracked_jobs > 0);
            let out = pool
                .step(vec![
                    WorkerCommand {
                        cancel: vec![job],
                        ..WorkerCommand::default()
                    },
                    WorkerCommand::default(),
                ])
                .unwrap();
            assert_eq!(out.cancelled, vec![job]);
            assert!(out.reports.iter().all(|r| r.completed.is_empty()));
            assert_eq!(out.tracked_jobs, 0, "nothing kept for a cancelled job");
        }
    }

    /// A stalled job released late, or forced by a flush, leaves nothing either.
    #[test]
    fn released_stalls_leave_nothing_on_the_workers() {
        let mut pool = WorkerPool::new(geometry(1)).unwrap();
        for i in 1..=100 {
            let job = JobId(i);
            let out = pool
                .step(vec![WorkerCommand {
                    plan: load_plan(job),
                    faults: vec![(job, Fault::Stall)],
                    ..WorkerCommand::default()
                }])
                .unwrap();
            assert!(out.reports[0].completed.is_empty());
            let cmd = if i % 2 == 0 {
                WorkerCommand {
                    release: vec![job],
                    ..WorkerCommand::default()
                }
            } else {
                WorkerCommand {
                    plan: WorkerPlan {
                        flush: vec![job],
                        ..WorkerPlan::default()
                    },
                    ..WorkerCommand::default()
                }
            };
            let out = pool.step(vec![cmd]).unwrap();
            assert_eq!(out.reports[0].completed.get(&job), Some(&1));
            assert_eq!(out.tracked_jobs, 0);
        }
    }
}
