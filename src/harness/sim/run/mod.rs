//! The simulation loop: one serving step at a time, the backend model calls
//! the scheduler's hooks, the workers execute the plan, reports come back.

mod completions;
mod report;
mod serving;

use crate::Direction;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use thiserror::Error;

use crate::adapter::{merge_reports, to_worker_plan};
use crate::clock::ManualClock;
use crate::config::{ConfigError, OffloadConfig};
use crate::ids::{GpuBlockId, JobId, RequestId};
use crate::key::BlockHash;
use crate::metrics::{OffloadMetrics, SharedMetricsText};
use crate::remote::{Namespace, NamespaceParts, RedisConnector, RemoteTier};
use crate::scheduler::{Scheduler, SchedulerError, StepInput};
use crate::worker::Fault;

use super::content::{BlockCheck, CheckKind, ContentOps, ContentResult, SAMPLED_LINES};
use super::faults::{FaultPlan, StallFate};
use super::gpu_pool::GpuPool;
use super::limits::derived_progress_limit;
use super::recorder::{Recorder, jobs_value, req_name, req_set};
use super::step_times::StepTimeHistogram;
use super::summary::{ContentCounts, ContentMismatch, Held, SimSummary};
use super::workload::{Conversation, Workload};
use super::{
    PoolError, PoolGeometry, RemoteAttach, SimBackend, SimOptions, WorkerCommand, WorkerPool,
};

/// Bound on waiting for the scheduler's remote lookups at the end of a step.
const REMOTE_WAIT: Duration = Duration::from_secs(30);

/// Why a simulation could not run to the end.
#[derive(Debug, Error)]
pub enum SimError {
    /// The engine configuration.
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    /// The scheduler rejected a hook call (a bug in the simulation or the engine).
    #[error("scheduler: {0}")]
    Scheduler(#[from] SchedulerError),
    /// The worker pool.
    #[error("workers: {0}")]
    Pool(#[from] PoolError),
    /// An option is unusable.
    #[error("{0}")]
    Options(String),
    /// Requests were live but none finished within the progress limit.
    #[error(
        "stuck: no request finished in {limit} steps (the progress limit, from the \
         workload and the stall timeout); still held {held}"
    )]
    Stuck {
        /// The progress limit, in steps.
        limit: u64,
        /// What was still held.
        held: Box<Held>,
    },
    /// Every request finished, but the engine did not drain within the
    /// progress limit (a transfer that never ends, a job never reported).
    #[error(
        "did not drain within {limit} steps after the last request finished (the \
         progress limit, from the workload and the stall timeout); still held {held}"
    )]
    NoDrain {
        /// The progress limit, in steps.
        limit: u64,
        /// What was still held.
        held: Box<Held>,
    },
    /// A step's flush names a hung transfer (a detected stall the backend
    /// never resumes nor cancels) whose GPU blocks are being handed to a new
    /// owner: a real worker would block in that flush (or fail the step once
    /// its wait timeout passes), so the run stops there.
    #[error(
        "step {step}: the flush must wait for {job}, a hung {kind} whose GPU blocks are \
         being handed to a new owner (a real engine blocks here, or fails the step once \
         its wait timeout passes); still held {held}"
    )]
    FlushWaitsOnHung {
        /// The step whose flush names it.
        step: u64,
        /// The hung job.
        job: JobId,
        /// `load` or `store`.
        kind: &'static str,
        /// What was still held.
        held: Box<Held>,
    },
    /// Writing the trace.
    #[error("writing the trace: {0}")]
    Trace(#[from] std::io::Error),
}

/// Progress, reported every few steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Requests finished.
    pub finished: u64,
    /// Requests the run will create.
    pub total: u64,
    /// Steps so far.
    pub step: u64,
    /// Whether the run is draining.
    pub draining: bool,
    /// Conversations open (a turn in the serving backend, or a user thinking
    /// before the next turn): at most [`SimOptions::max_conversations`].
    pub open_conversations: u64,
}

/// A finished simulation.
#[derive(Debug, Clone)]
pub struct SimOutput {
    /// The summary.
    pub summary: SimSummary,
    /// The scheduler's decisions in replay's output fields (with `keep_decisions`).
    pub decisions: Vec<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Loading,
    LoadDone,
    LoadFailed,
    Running,
}

/// What the simulated backend knows of a job in flight.
#[derive(Debug, Clone, Copy)]
struct SimJob {
    kind: Direction,
    /// A late report was injected into it (it may pass the stall timeout).
    late: bool,
    /// A remote fetch (a store into the host tier from the remote tier).
    fetch: bool,
    /// Worker reports delivered so far (a job made before a reset is
    /// forgotten only once every worker reported: its late report may still
    /// hold back the jobs queued behind it).
    reports: u32,
}

#[derive(Debug)]
struct Req {
    /// The conversation; its history is the request's tokens (prompt, then
    /// what the request generated).
    conv: Conversation,
    hashes: Vec<BlockHash>,
    prompt_len: u64,
    out_target: u64,
    generated: u64,
    blocks: Vec<GpuBlockId>,
    computed: u64,
    local: u64,
    external: u64,
    phase: Phase,
}

/// A simulation, ready to run.
#[derive(Debug)]
pub struct Sim {
    cfg: OffloadConfig,
    opts: SimOptions,
    tpb: u64,
    clock: ManualClock,
    sched: Scheduler,
    pool: WorkerPool,
    gpu: GpuPool,
    workload: Workload,
    faults: FaultPlan,
    rec: Recorder,
    metrics_out: Option<SharedMetricsText>,
    metrics: OffloadMetrics,
    reqs: BTreeMap<RequestId, Req>,
    running: Vec<RequestId>,
    waiting: VecDeque<RequestId>,
    loading: Vec<RequestId>,
    arrivals: Vec<(u64, Conversation)>,
    next_req: u64,
    finished_prev: Vec<RequestId>,
    stall_faulted: HashMap<JobId, (u32, Direction)>,
    /// Every job in flight: its kind and whether a late report was injected.
    jobs: HashMap<JobId, SimJob>,
    open_stalls: std::collections::HashSet<JobId>,
    /// Detected stalls whose fate is to hang (never resumed nor cancelled).
    hung: std::collections::HashSet<JobId>,
    due: Vec<(u64, JobId, StallFate)>,
    /// Cancelled stalled jobs, by worker, for the next step's commands.
    cancels: Vec<Vec<JobId>>,
    /// Per-job entries the workers held after the last step.
    worker_jobs: u64,
    step: u64,
    /// Steps without progress before the run stops as stuck.
    progress_limit: u64,
    step_ns: StepTimeHistogram,
    cur_ns: u64,
    summary: SimSummary,
    /// Blocks the next worker command checks (content check): loads that
    /// completed, GPU prefix hits.
    content_checks: Vec<BlockCheck>,
    /// Test hook: the worker whose computed blocks are corrupted in these steps.
    corrupt: Option<(u32, std::ops::Range<u64>)>,
    /// This step's synchronous loads (a sync-load budget reserved their
    /// hits): each request runs in the step its load is waited in.
    sync_jobs: Vec<(JobId, RequestId)>,
    /// Requests whose synchronous load failed in this step: the step's
    /// output for them is discarded and they recompute from their load's
    /// first block (vLLM's recovery from a failed KV load).
    sync_failed: std::collections::HashSet<RequestId>,
}

impl Sim {
    /// A simulation of `opts` over the engine configured by `cfg` (validated).
    pub fn new(cfg: OffloadConfig, opts: SimOptions) -> Result<Self, SimError> {
        cfg.validate()?;
        if opts.gpu_blocks < 8 {
            return Err(SimError::Options(format!(
                "gpu_blocks = {} is out of range: allowed 8..=1048576",
                opts.gpu_blocks
            )));
        }
        if opts.step_ms == 0 {
            return Err(SimError::Options(
                "step_ms = 0 is out of range: allowed 1..".into(),
            ));
        }
        let num_chunks = cfg.num_chunks()?;
        let clock = ManualClock::new();
        let mut sched = Scheduler::new(&cfg, clock.shared())?;
        let geometry = PoolGeometry {
            world_size: cfg.world_size,
            gpu_blocks: opts.gpu_blocks,
            block_bytes: opts.block_bytes,
            blocks_per_chunk: cfg.blocks_per_chunk,
            num_chunks,
            replicated: opts.replicated,
            numa: opts.numa,
        };
        let shares = geometry.row_slots();
        let remote = match &opts.remote {
            None => None,
            Some(rc) => {
                rc.validate()?;
                Some(RemoteAttach {
                    config: rc.clone(),
                    namespace: Namespace::new(&NamespaceParts {
                        model: "kvoffload-sim".into(),
                        layout: "cross_layer".into(),
                        tokens_per_block: cfg.tokens_per_block,
                        blocks_per_chunk: cfg.blocks_per_chunk,
                        bytes_per_block: opts.block_bytes,
                        // One share a chunk where every worker holds it.
                        world_size: shares,
                    }),
                    // The workers' tiers time their batches in real time, as
                    // the workers' copies are; the scheduler's lookups run on
                    // the sim's clock (below).
                    clock: crate::clock::MonotonicClock::shared(),
                })
            }
        };
        if let Some(r) = &remote {
            // The scheduler's own connection, for lookups.
            let connector = RedisConnector::new(&r.config).map_err(|e| {
                SimError::Pool(PoolError::Remote {
                    worker: u32::MAX,
                    message: e.to_string(),
                })
            })?;
            let tier = RemoteTier::start(
                Box::new(connector),
                &r.config,
                r.namespace.clone(),
                shares,
                clock.shared(),
            )
            .map_err(|e| {
                SimError::Pool(PoolError::Remote {
                    worker: u32::MAX,
                    message: format!("scheduler: {e}"),
                })
            })?;
            sched.attach_remote(tier);
        }
        let pool = match (&opts.backend, remote) {
            (SimBackend::Host, Some(r)) => WorkerPool::host_with_remote(geometry, r)?,
            (SimBackend::Host, None) => WorkerPool::new(geometry)?,
            (SimBackend::Cuda { strategies }, remote) => WorkerPool::cuda(
                geometry,
                std::sync::Arc::new(crate::worker::cuda::SharedStrategyTable::new(
                    strategies.clone(),
                )),
                remote,
            )?,
        };
        let tpb = u64::from(cfg.tokens_per_block.max(1));
        let workload = Workload::new(opts.shape, tpb, opts.seed);
        let faults = FaultPlan::new(opts.faults, cfg.world_size, opts.seed ^ 0xFA17);
        let progress_limit = opts
            .progress_limit_steps
            .unwrap_or_else(|| derived_progress_limit(&cfg, &opts));
        let summary = SimSummary {
            progress_limit_steps: progress_limit,
            seed: opts.seed,
            world_size: cfg.world_size,
            backend: opts.backend.name().into(),
            replicated: opts.replicated,
            host_placement: pool.host_placement_line().unwrap_or_default(),
            content: ContentCounts {
                enabled: opts.content_check,
                lines_per_block: if opts.content_check {
                    SAMPLED_LINES as u64
                } else {
                    0
                },
                ..ContentCounts::default()
            },
            ..SimSummary::default()
        };
        let world = pool.world_size() as usize;
        let placement = pool.placement_metrics();
        Ok(Self {
            gpu: GpuPool::new(opts.gpu_blocks),
            cfg,
            tpb,
            clock,
            sched,
            pool,
            workload,
            faults,
            rec: Recorder::off(),
            metrics_out: None,
            metrics: OffloadMetrics {
                placement,
                ..OffloadMetrics::default()
            },
            reqs: BTreeMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            loading: Vec::new(),
            arrivals: Vec::new(),
            next_req: 0,
            finished_prev: Vec::new(),
            stall_faulted: HashMap::new(),
            jobs: HashMap::new(),
            open_stalls: Default::default(),
            hung: Default::default(),
            due: Vec::new(),
            cancels: vec![Vec::new(); world],
            worker_jobs: 0,
            step: 0,
            progress_limit,
            step_ns: StepTimeHistogram::default(),
            cur_ns: 0,
            summary,
            content_checks: Vec::new(),
            corrupt: None,
            sync_jobs: Vec::new(),
            sync_failed: Default::default(),
            opts,
        })
    }

    /// Records the control-plane calls as a trace into `out`.
    pub fn record_to(&mut self, out: Box<dyn std::io::Write + Send>) {
        self.rec.trace_to(out, &self.cfg);
    }

    /// Keeps the scheduler's decisions (returned in [`SimOutput::decisions`]).
    pub fn keep_decisions(&mut self) {
        self.rec.keep_decisions();
    }

    /// Test hook: worker `worker` flips the first byte of every block it
    /// writes as computed in `steps` (the content check must then report
    /// mismatches; the decisions do not change).
    #[doc(hidden)]
    pub fn corrupt_computed_blocks(&mut self, worker: u32, steps: std::ops::Range<u64>) {
        self.corrupt = Some((worker, steps));
    }

    /// Publishes the Prometheus text into `text` while running.
    pub fn publish_metrics(&mut self, text: SharedMetricsText) {
        self.metrics_out = Some(text);
    }

    /// Runs to the end and drains; `progress` is called every few steps.
    pub fn run(mut self, progress: &mut dyn FnMut(Progress)) -> Result<SimOutput, SimError> {
        let wall = Instant::now();
        let mut draining = false;
        let limit = self.progress_limit;
        // The last step that made progress: a request finished, nothing was
        // live (users thinking), or the drain began.
        let mut progress_at = 0u64;
        let mut finished = 0u64;
        loop {
            if self.summary.work.finished > finished || self.reqs.is_empty() && !draining {
                finished = self.summary.work.finished;
                progress_at = self.step;
            }
            let stalled_for = self.step - progress_at;
            self.summary.longest_steps_without_progress =
                self.summary.longest_steps_without_progress.max(stalled_for);
            if stalled_for > limit {
                let held = Box::new(self.held());
                return Err(if draining {
                    SimError::NoDrain { limit, held }
                } else {
                    SimError::Stuck { limit, held }
                });
            }
            let work_left = self.next_req < self.opts.requests
                || !self.reqs.is_empty()
                || !self.arrivals.is_empty();
            if !work_left {
                if !draining {
                    progress_at = self.step;
                }
                draining = true;
                if !self.sched.has_pending_work()
                    && self.sched.state().stalled_jobs == 0
                    && self.finished_prev.is_empty()
                {
                    break;
                }
            }
            self.one_step(draining)?;
            if self.step.is_multiple_of(25) {
                progress(Progress {
                    finished: self.summary.work.finished,
                    total: self.opts.requests,
                    step: self.step,
                    draining,
                    open_conversations: (self.reqs.len() + self.arrivals.len()) as u64,
                });
                self.publish();
            }
        }
        self.publish();
        self.remote_report()?;
        self.summary.wall_s = wall.elapsed().as_secs_f64();
        self.finish()
    }

    /// With a remote tier: one more worker step with nothing planned, in
    /// which every worker waits until its queued puts are written, and the
    /// summary's remote counts.
    fn remote_report(&mut self) -> Result<(), SimError> {
        let Some(rc) = &self.opts.remote else {
            return Ok(());
        };
        let target = rc.redacted_url();
        let write = match rc.write {
            crate::remote::WritePolicy::Through => "through",
            crate::remote::WritePolicy::OnEviction => "on_eviction",
        };
        let world = self.pool.world_size() as usize;
        let cmds = vec![
            WorkerCommand {
                report_remote: true,
                ..WorkerCommand::default()
            };
            world
        ];
        let out = self.pool.step(cmds)?;
        self.worker_jobs = out.tracked_jobs;
        let merged = merge_reports(&out.reports);
        self.deliver(merged, true)?;
        let mut r = super::summary::RemoteCounts {
            target,
            write: write.into(),
            ..Default::default()
        };
        if let Some(l) = self.sched.remote_lookup_stats() {
            r.lookups = l.lookups;
            r.chunks_found = l.chunks_found;
            r.chunks_fetched = l.chunks_fetched;
            r.fetches_failed = l.fetches_failed;
        }
        r.probes_left = self.sched.remote_probes() as u64;
        for s in &out.remote {
            r.puts_written += s.puts_written;
            r.bytes_fetched += s.bytes_got;
            r.put_seconds += s.put_latency.sum();
            r.get_seconds += s.get_latency.sum();
            r.bytes_put += s.bytes_put;
            r.puts_failed += s.puts_failed;
            r.puts_dropped += s.puts_dropped();
            r.puts_queued += s.puts_queued;
            r.outages += s.outages;
            r.connected_workers += u32::from(s.connected);
        }
        self.summary.remote = Some(r);
        Ok(())
    }

    fn publish(&mut self) {
        if let Some(out) = &self.metrics_out {
            self.metrics.scheduler = self.sched.metrics();
            self.metrics.lookup.clone_from(self.sched.lookup_delays());
            self.metrics.manager = self.sched.manager().stats();
            out.set(self.metrics.render());
        }
    }

    /// Runs `f` on the scheduler, adding its time to the step's.
    fn timed<T>(&mut self, f: impl FnOnce(&mut Scheduler) -> T) -> T {
        let t = Instant::now();
        let r = f(&mut self.sched);
        self.cur_ns += t.elapsed().as_nanos() as u64;
        r
    }

    fn one_step(&mut self, draining: bool) -> Result<(), SimError> {
        self.step += 1;
        self.cur_ns = 0;
        let step = self.step;
        self.clock.advance(Duration::from_millis(self.opts.step_ms));
        self.rec
            .call(|| json!({"op": "advance", "ms": self.opts.step_ms}));
        let scan_every = (self.cfg.stall_scan_interval_ms / self.opts.step_ms).max(1);
        if step.is_multiple_of(scan_every) {
            self.scan();
        }
        if !draining && self.opts.reset_every > 0 && step.is_multiple_of(self.opts.reset_every) {
            self.timed(|s| s.reset())?;
            self.rec.call(|| json!({"op": "reset"}));
            self.summary.faults.resets += 1;
            // Stalled jobs that span a reset are cancelled by the backend.
            let due: Vec<JobId> = self.due.drain(..).map(|(_, j, _)| j).collect();
            for job in due {
                self.cancel(job)?;
            }
        }
        let mut release: Vec<Vec<JobId>> = vec![Vec::new(); self.pool.world_size() as usize];
        let mut i = 0;
        while i < self.due.len() {
            let (at, job, fate) = self.due[i];
            if at > step && !draining {
                i += 1;
                continue;
            }
            self.due.swap_remove(i);
            match fate {
                StallFate::ReleaseAfter(_) => {
                    // Released once; the entry is not needed any more.
                    if let Some((w, _)) = self.stall_faulted.remove(&job) {
                        release[w as usize].push(job);
                    }
                }
                StallFate::CancelAfter(_) => self.cancel(job)?,
                // Never queued (a hung transfer has nothing due).
                StallFate::Never => {}
            }
        }
        self.arrive(step, draining)?;
        let input = self.schedule()?;
        self.rec.call(|| step_line(&input));
        let plan = self.timed(|s| s.build_step(&input))?;
        if let Some(&job) = plan.flush.iter().find(|j| self.hung.contains(j)) {
            let kind = self.jobs.get(&job).map_or("transfer", |i| i.kind.as_str());
            return Err(SimError::FlushWaitsOnHung {
                step,
                job,
                kind,
                held: Box::new(self.held()),
            });
        }
        self.rec.decision(|| {
            let mut d = json!({
                "op": "step",
                "loads": jobs_value(&plan.loads),
                "stores": jobs_value(&plan.stores),
                "flush": plan.flush.iter().map(|j| j.0).collect::<Vec<_>>(),
                "failed_loads": req_set(&plan.failed_loads),
            });
            // Only with a sync-load budget, as replay writes it.
            if !plan.sync_loads.is_empty() {
                d["sync_loads"] =
                    Value::from(plan.sync_loads.iter().map(|j| j.0).collect::<Vec<_>>());
            }
            d
        });
        for &r in &plan.failed_loads {
            self.load_failed(r);
        }
        // Faults for the new jobs.
        let world = self.pool.world_size() as usize;
        let mut faults: Vec<Vec<(JobId, Fault)>> = vec![Vec::new(); world];
        for (kind, jobs) in [
            (Direction::Load, &plan.loads),
            (Direction::Store, &plan.stores),
        ] {
            for j in jobs {
                self.jobs.insert(
                    j.job,
                    SimJob {
                        kind,
                        late: false,
                        fetch: false,
                        reports: 0,
                    },
                );
                if draining {
                    continue;
                }
                if let Some((w, f)) = self.faults.for_job(j.job) {
                    // Workers that hold the same KV take turns by host
                    // chunk: a store's fault goes to the worker that copies
                    // its first chunk (another would never submit it).
                    let w = match (self.opts.replicated, kind, j.chunk_ids.first()) {
                        (true, Direction::Store, Some(c)) => c.0 % world as u32,
                        _ => w,
                    };
                    // A synchronous load is waited in its step: a stall would
                    // hold the engine (as in vLLM, where it has no timeout),
                    // and its report cannot come late. It can only fail.
                    if f != Fault::Fail && plan.sync_loads.contains(&j.job) {
                        continue;
                    }
                    if let (Fault::DelayPolls(_), Some(info)) = (f, self.jobs.get_mut(&j.job)) {
                        info.late = true;
                    }
                    match f {
                        Fault::Stall => {
                            self.summary.faults.injected_stalls += 1;
                            self.stall_faulted.insert(j.job, (w, kind));
                            self.open_stalls.insert(j.job);
                        }
                        Fault::DelayPolls(_) => self.summary.faults.injected_late += 1,
                        Fault::Fail => self.summary.faults.injected_failures += 1,
                    }
                    faults[w as usize].push((j.job, f));
                }
            }
        }
        // Remote fetches: no faults (the workers run them on the remote
        // tier, not on the backend).
        for j in &plan.fetches {
            self.jobs.insert(
                j.job,
                SimJob {
                    kind: Direction::Store,
                    late: false,
                    fetch: true,
                    reports: 0,
                },
            );
        }
        let wplan = to_worker_plan(&plan, self.cfg.blocks_per_chunk);
        let cancels = std::mem::replace(&mut self.cancels, vec![Vec::new(); world]);
        let written = self.computed_blocks(&input);
        let content = self.content_ops(written);
        let cmds: Vec<WorkerCommand> = faults
            .into_iter()
            .zip(release)
            .zip(cancels)
            .zip(content)
            .map(|(((faults, release), cancel), content)| WorkerCommand {
                plan: wplan.clone(),
                faults,
                release,
                cancel,
                content,
                // With a remote tier, each step waits for the workers' puts
                // and (below) the scheduler's lookups: the run's decisions
                // then depend on the store's contents, not on thread timing.
                report_remote: self.opts.remote.is_some(),
            })
            .collect();
        let out = self.pool.step(cmds)?;
        self.content_results(&out.content);
        if self.opts.remote.is_some() {
            self.sched.wait_remote_lookups(REMOTE_WAIT);
        }
        self.worker_jobs = out.tracked_jobs;
        self.summary.faults.released += out.released.len() as u64;
        for job in &out.released_by_flush {
            // It runs now: nothing is left to release or cancel on its worker,
            // and its late reports end it (no fate is due any more).
            self.stall_faulted.remove(job);
            self.due.retain(|(_, j, _)| j != job);
            if self.open_stalls.remove(job) {
                self.summary.faults.stalls_forced_by_flush += 1;
            } else {
                self.summary.faults.released += 1;
            }
        }
        for r in &out.reports {
            self.metrics.add_transfers(&r.stats);
        }
        let merged = merge_reports(&out.reports);
        self.end_sync_loads(&merged.failed);
        self.deliver(merged, draining)?;
        self.advance_tokens(&input)?;
        self.sync_failed.clear();
        // A serving backend publishes the host tier's KV events every step;
        // the sim drains them (they are outputs, not control-plane decisions,
        // so the trace does not record them).
        drop(self.sched.take_events());
        // The plan's buffers serve the next step.
        self.sched.recycle_plan(plan);
        self.step_ns.record(self.cur_ns);
        Ok(())
    }
}

impl Sim {
    /// The blocks the step computes in full (content check): those of each
    /// scheduled request from its computed tokens to the step's end that are
    /// complete by then (a block is written once it is whole, with its hash).
    fn computed_blocks(&self, input: &StepInput) -> Vec<(GpuBlockId, BlockHash)> {
        let mut out = Vec::new();
        if !self.opts.content_check {
            return out;
        }
        for s in &input.scheduled {
            let Some(q) = self.reqs.get(&s.req) else {
                continue;
            };
            if q.phase != Phase::Running {
                continue;
            }
            let from = (s.computed_tokens / self.tpb) as usize;
            let to = ((s.computed_tokens + s.scheduled_tokens) / self.tpb) as usize;
            let to = to.min(q.hashes.len()).min(q.blocks.len());
            out.extend((from..to.max(from)).map(|i| (q.blocks[i], q.hashes[i])));
        }
        out
    }

    /// Each worker's content-check command for this step: the pending checks
    /// and the blocks `written` (none with the check off).
    fn content_ops(&mut self, written: Vec<(GpuBlockId, BlockHash)>) -> Vec<ContentOps> {
        let world = self.pool.world_size();
        if !self.opts.content_check {
            return vec![ContentOps::default(); world as usize];
        }
        let check = std::mem::take(&mut self.content_checks);
        let c = &mut self.summary.content;
        for k in &check {
            match k.kind {
                CheckKind::Load => c.loaded_checked += u64::from(world),
                CheckKind::PrefixHit => c.prefix_hits_checked += u64::from(world),
            }
        }
        let ops = ContentOps {
            check,
            write: written,
            corrupt_written: false,
        };
        (0..world)
            .map(|rank| ContentOps {
                corrupt_written: self
                    .corrupt
                    .as_ref()
                    .is_some_and(|(w, steps)| *w == rank && steps.contains(&self.step)),
                ..ops.clone()
            })
            .collect()
    }

    /// Adds the workers' content-check results (by rank) to the summary.
    fn content_results(&mut self, results: &[ContentResult]) {
        let c = &mut self.summary.content;
        for (rank, r) in results.iter().enumerate() {
            c.blocks_checked += r.checked;
            c.blocks_written += r.written;
            c.mismatches += r.mismatches;
            for m in &r.described {
                if c.first_mismatches.len() >= MAX_MISMATCHES_DESCRIBED {
                    break;
                }
                tracing::error!(
                    step = self.step,
                    worker = rank,
                    block = m.check.block.0,
                    hash = m.check.hash.0,
                    kind = m.check.kind.name(),
                    offset = m.offset,
                    "content check: a block does not hold the bytes of its hash"
                );
                c.first_mismatches.push(ContentMismatch {
                    step: self.step,
                    worker: rank as u32,
                    block: m.check.block.0,
                    hash: m.check.hash.0,
                    kind: m.check.kind.name().into(),
                    offset: m.offset,
                });
            }
        }
    }

    /// The step's synchronous loads were waited for: a failed one makes its
    /// request recompute (see `advance_tokens`); the others' blocks are
    /// checked like a completed load's.
    fn end_sync_loads(&mut self, failed: &[JobId]) {
        for (job, req) in std::mem::take(&mut self.sync_jobs) {
            let Some(ext) = self.reqs.get(&req).map(|q| q.external) else {
                continue;
            };
            self.summary.work.sync_loads += 1;
            if failed.contains(&job) {
                self.sync_failed.insert(req);
                self.summary.work.sync_loads_failed += 1;
                self.summary.faults.failed_loads_recomputed += 1;
                self.summary.work.recomputed_tokens += ext;
            } else {
                self.summary.work.loaded_tokens += ext;
                self.summary.work.sync_loaded_tokens += ext;
                self.check_loaded(req);
            }
        }
    }

    /// Content check: the blocks of `req`'s load, which completed, must hold
    /// the bytes of their hashes (checked by the next worker command).
    pub(super) fn check_loaded(&mut self, req: RequestId) {
        if !self.opts.content_check {
            return;
        }
        let Some(q) = self.reqs.get(&req) else {
            return;
        };
        let from = (q.local / self.tpb) as usize;
        let to = ((q.local + q.external) / self.tpb) as usize;
        let to = to.min(q.hashes.len()).min(q.blocks.len());
        for i in from..to.max(from) {
            self.content_checks.push(BlockCheck {
                block: q.blocks[i],
                hash: q.hashes[i],
                kind: CheckKind::Load,
            });
        }
    }

    /// Content check: `blocks`, handed out by the GPU prefix cache for
    /// `hashes`, must hold their bytes (checked by this step's worker command).
    pub(super) fn check_prefix_hit(&mut self, blocks: &[GpuBlockId], hashes: &[BlockHash]) {
        if !self.opts.content_check {
            return;
        }
        self.content_checks
            .extend(blocks.iter().zip(hashes).map(|(&block, &hash)| BlockCheck {
                block,
                hash,
                kind: CheckKind::PrefixHit,
            }));
    }
}

/// Mismatches the summary describes (the others are counted).
const MAX_MISMATCHES_DESCRIBED: usize = 8;

fn ids(blocks: &[GpuBlockId]) -> Vec<u32> {
    blocks.iter().map(|b| b.0).collect()
}

fn step_line(input: &StepInput) -> Value {
    let scheduled: Vec<Value> = input
        .scheduled
        .iter()
        .map(|s| {
            let mut v = json!({
                "req": req_name(s.req),
                "new_block_ids": ids(&s.new_block_ids),
                "computed_tokens": s.computed_tokens,
                "scheduled_tokens": s.scheduled_tokens,
            });
            if s.full_table {
                v["full_table"] = Value::Bool(true);
            }
            v
        })
        .collect();
    json!({
        "op": "step",
        "scheduled": scheduled,
        "preempted": input.preempted.iter().map(|&r| req_name(r)).collect::<Vec<_>>(),
        "finished": input.finished.iter().map(|&r| req_name(r)).collect::<Vec<_>>(),
    })
}
