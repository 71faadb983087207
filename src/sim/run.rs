//! The simulation loop: one serving step at a time, the backend model calls
//! the scheduler's hooks, the workers execute the plan, reports come back.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use thiserror::Error;

use crate::clock::ManualClock;
use crate::config::{ConfigError, OffloadConfig};
use crate::engine::{HostWorkerPool, PoolError, WorkerCommand, merge_reports, to_worker_plan};
use crate::ids::{GpuBlockId, JobId, RequestId};
use crate::key::BlockHash;
use crate::metrics::{OffloadMetrics, SharedMetricsText};
use crate::scheduler::{
    JobKind, LookupOutcome, ScheduledRequest, Scheduler, SchedulerError, StepInput, WorkerReport,
};
use crate::worker::Fault;

use super::SimOptions;
use super::faults::{FaultPlan, StallFate};
use super::gpu_pool::GpuPool;
use super::recorder::{Recorder, jobs_value, req_name, req_set};
use super::summary::{Leaks, SimSummary, StepTimes, percentile};
use super::workload::{Conversation, Workload, block_hashes};

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
    /// The run did not finish or drain within `max_steps`.
    #[error("did not drain after {0} steps")]
    NoDrain(u64),
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

#[derive(Debug)]
struct Req {
    conv: Conversation,
    tokens: Vec<u64>,
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
    pool: HostWorkerPool,
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
    stall_faulted: HashMap<JobId, (u32, JobKind)>,
    kinds: HashMap<JobId, JobKind>,
    open_stalls: std::collections::HashSet<JobId>,
    due: Vec<(u64, JobId, StallFate)>,
    step: u64,
    step_ns: Vec<u64>,
    cur_ns: u64,
    summary: SimSummary,
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
        let sched = Scheduler::new(&cfg, clock.shared())?;
        let pool = HostWorkerPool::new(
            cfg.world_size,
            opts.gpu_blocks,
            opts.block_bytes,
            cfg.blocks_per_chunk,
            num_chunks,
        )?;
        let tpb = u64::from(cfg.tokens_per_block.max(1));
        let workload = Workload::new(opts.shape, tpb, opts.seed);
        let faults = FaultPlan::new(opts.faults, cfg.world_size, opts.seed ^ 0xFA17);
        let summary = SimSummary {
            seed: opts.seed,
            world_size: cfg.world_size,
            backend: "host".into(),
            ..SimSummary::default()
        };
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
            metrics: OffloadMetrics::default(),
            reqs: BTreeMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            loading: Vec::new(),
            arrivals: Vec::new(),
            next_req: 0,
            finished_prev: Vec::new(),
            stall_faulted: HashMap::new(),
            kinds: HashMap::new(),
            open_stalls: Default::default(),
            due: Vec::new(),
            step: 0,
            step_ns: Vec::new(),
            cur_ns: 0,
            summary,
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

    /// Publishes the Prometheus text into `text` while running.
    pub fn publish_metrics(&mut self, text: SharedMetricsText) {
        self.metrics_out = Some(text);
    }

    /// Runs to the end and drains; `progress` is called every few steps.
    pub fn run(mut self, progress: &mut dyn FnMut(Progress)) -> Result<SimOutput, SimError> {
        let wall = Instant::now();
        let mut draining = false;
        loop {
            if self.step >= self.opts.max_steps {
                return Err(SimError::NoDrain(self.step));
            }
            let work_left = self.next_req < self.opts.requests
                || !self.reqs.is_empty()
                || !self.arrivals.is_empty();
            if !work_left {
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
                });
                self.publish();
            }
        }
        self.publish();
        self.summary.wall_s = wall.elapsed().as_secs_f64();
        self.finish()
    }

    fn publish(&mut self) {
        if let Some(out) = &self.metrics_out {
            self.metrics.scheduler = self.sched.metrics();
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
            .call(json!({"op": "advance", "ms": self.opts.step_ms}));
        let scan_every = (self.cfg.stall_scan_interval_ms / self.opts.step_ms).max(1);
        if step.is_multiple_of(scan_every) {
            self.scan();
        }
        if !draining && self.opts.reset_every > 0 && step.is_multiple_of(self.opts.reset_every) {
            self.timed(|s| s.reset())?;
            self.rec.call(json!({"op": "reset"}));
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
                    if let Some(&(w, _)) = self.stall_faulted.get(&job) {
                        release[w as usize].push(job);
                    }
                }
                StallFate::CancelAfter(_) => self.cancel(job)?,
            }
        }
        self.arrive(step, draining)?;
        let input = self.schedule()?;
        self.rec.call(step_line(&input));
        let plan = self.timed(|s| s.build_step(&input))?;
        self.rec.decision(json!({
            "op": "step",
            "loads": jobs_value(&plan.loads),
            "stores": jobs_value(&plan.stores),
            "flush": plan.flush.iter().map(|j| j.0).collect::<Vec<_>>(),
            "failed_loads": req_set(&plan.failed_loads),
        }));
        for &r in &plan.failed_loads {
            self.load_failed(r);
        }
        // Faults for the new jobs.
        let world = self.pool.world_size() as usize;
        let mut faults: Vec<Vec<(JobId, Fault)>> = vec![Vec::new(); world];
        for (kind, jobs) in [(JobKind::Load, &plan.loads), (JobKind::Store, &plan.stores)] {
            for j in jobs {
                self.kinds.insert(j.job, kind);
                if draining {
                    continue;
                }
                if let Some((w, f)) = self.faults.for_job(j.job) {
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
        let wplan = to_worker_plan(&plan, self.cfg.blocks_per_chunk);
        let cmds: Vec<WorkerCommand> = faults
            .into_iter()
            .zip(release)
            .map(|(faults, release)| WorkerCommand {
                plan: wplan.clone(),
                faults,
                release,
            })
            .collect();
        let out = self.pool.step(cmds)?;
        self.summary.faults.released += out.released.len() as u64;
        for job in &out.released_by_flush {
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
        self.deliver(merged, draining)?;
        self.advance_tokens(&input)?;
        self.step_ns.push(self.cur_ns);
        Ok(())
    }

    fn scan(&mut self) {
        let out = self.timed(|s| s.scan_now());
        self.rec.call(json!({"op": "scan"}));
        self.rec.decision(json!({
            "op": "scan",
            "stalled": out.stalled.iter().map(|j| j.0).collect::<Vec<_>>(),
            "failed_loads": req_set(&out.failed_loads),
        }));
        for &job in &out.stalled {
            if let Some(&(_, kind)) = self.stall_faulted.get(&job) {
                if self.open_stalls.remove(&job) {
                    self.summary.faults.injected_stalls_detected += 1;
                }
                let fate = self.faults.stall_fate(kind == JobKind::Store);
                let after = match fate {
                    StallFate::ReleaseAfter(n) | StallFate::CancelAfter(n) => n,
                };
                self.due.push((self.step + after, job, fate));
            }
        }
        for &r in &out.failed_loads {
            self.load_failed(r);
        }
    }

    fn cancel(&mut self, job: JobId) -> Result<(), SimError> {
        if !self.sched.is_job_stalled(job) {
            return Ok(());
        }
        self.timed(|s| s.confirm_cancelled(job))?;
        self.rec
            .call(json!({"op": "confirm_cancelled", "job": job.0}));
        self.summary.faults.cancelled += 1;
        Ok(())
    }

    fn load_failed(&mut self, r: RequestId) {
        if let Some(q) = self.reqs.get_mut(&r)
            && q.phase == Phase::Loading
        {
            q.phase = Phase::LoadFailed;
            self.summary.faults.failed_loads_recomputed += 1;
            self.summary.work.recomputed_tokens += q.external;
        }
    }

    /// Delivers the merged report: entries the scheduler accepts in one call,
    /// each rejected entry alone (as replay checks a whole line), then duplicates.
    fn deliver(&mut self, merged: WorkerReport, draining: bool) -> Result<(), SimError> {
        if merged.completed.is_empty() && merged.failed.is_empty() {
            return Ok(());
        }
        let mut good = WorkerReport::default();
        let mut bad = Vec::new();
        let mut dups = Vec::new();
        for &(job, n) in &merged.completed {
            let failed: Vec<JobId> = merged
                .failed
                .iter()
                .copied()
                .filter(|&f| f == job)
                .collect();
            let one = WorkerReport {
                completed: vec![(job, n)],
                failed: failed.clone(),
            };
            if self.sched.check_report(&one).is_ok() {
                good.completed.push((job, n));
                good.failed.extend(failed);
                if !draining && self.faults.duplicate() {
                    dups.push(job);
                }
            } else {
                bad.insert(0, one);
            }
        }
        for j in &good.failed {
            if self.kinds.get(j) == Some(&JobKind::Store) {
                self.summary.faults.failed_stores += 1;
            }
        }
        for (j, _) in &good.completed {
            self.kinds.remove(j);
        }
        if !good.completed.is_empty() {
            self.report(&good);
        }
        for b in bad {
            self.report(&b);
        }
        // A duplicate of a report the scheduler has fully applied (a job that
        // is gone, not stalled, not owed to a reset fence) must be rejected.
        for job in dups {
            if job >= self.sched.stale_threshold()
                && !self.sched.is_job_live(job)
                && !self.sched.is_job_stalled(job)
            {
                self.summary.faults.injected_duplicates += 1;
                self.report(&WorkerReport {
                    completed: vec![(job, 1)],
                    failed: Vec::new(),
                });
            }
        }
        Ok(())
    }

    fn report(&mut self, r: &WorkerReport) {
        let completed: serde_json::Map<String, Value> = r
            .completed
            .iter()
            .map(|(j, n)| (j.0.to_string(), Value::from(*n)))
            .collect();
        let mut line = json!({"op": "worker_output", "completed": completed});
        if !r.failed.is_empty() {
            line["failed"] = Value::from(r.failed.iter().map(|j| j.0).collect::<Vec<_>>());
        }
        self.rec.call(line);
        let out = self.timed(|s| s.on_worker_output(r));
        if !out.rejected.is_empty() {
            self.summary.faults.rejected_reports += out.rejected.len() as u64;
            self.rec
                .decision(json!({"op": "worker_output", "rejected": true}));
            return;
        }
        self.rec.decision(json!({
            "op": "worker_output",
            "finished_loads": req_set(&out.finished_loads),
            "failed_loads": req_set(&out.failed_loads),
        }));
        for &q in &out.finished_loads {
            if let Some(q) = self.reqs.get_mut(&q)
                && q.phase == Phase::Loading
            {
                q.phase = Phase::LoadDone;
            }
        }
        for &q in &out.failed_loads {
            self.load_failed(q);
        }
    }

    fn arrive(&mut self, step: u64, draining: bool) -> Result<(), SimError> {
        if draining {
            return Ok(());
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.arrivals.len() {
            if self.arrivals[i].0 <= step {
                due.push(self.arrivals.remove(i).1);
            } else {
                i += 1;
            }
        }
        if self.next_req + (due.len() as u64) < self.opts.requests
            && self.workload.arrives(self.opts.arrival_rate)
        {
            due.push(self.workload.conversation());
        }
        for conv in due {
            if self.next_req >= self.opts.requests {
                break;
            }
            self.add(conv)?;
        }
        Ok(())
    }

    fn add(&mut self, mut conv: Conversation) -> Result<(), SimError> {
        let id = RequestId(self.next_req);
        self.next_req += 1;
        let (prompt, out) = self.workload.next_turn(&mut conv);
        let hashes = block_hashes(&prompt, self.tpb as usize, None);
        let n = prompt.len() as u64;
        self.timed(|s| s.add_request(id, n, &hashes))?;
        self.rec.call(json!({
            "op": "add_request", "req": req_name(id), "prompt_tokens": n,
            "block_hashes": hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
        }));
        self.summary.work.requests += 1;
        self.reqs.insert(
            id,
            Req {
                conv,
                tokens: prompt,
                hashes,
                prompt_len: n,
                out_target: out,
                generated: 0,
                blocks: Vec::new(),
                computed: 0,
                local: 0,
                external: 0,
                phase: Phase::Waiting,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    fn blocks_for(&self, tokens: u64) -> usize {
        tokens.div_ceil(self.tpb) as usize
    }

    /// The backend model's scheduling decisions for this step.
    fn schedule(&mut self) -> Result<StepInput, SimError> {
        let mut input = StepInput {
            finished: std::mem::take(&mut self.finished_prev),
            ..StepInput::default()
        };
        let mut budget = self.opts.max_batch_tokens;
        // 1. Running requests: one token each (or the rest of their prefill).
        let mut idx = 0;
        while idx < self.running.len() {
            let id = self.running[idx];
            let (len, computed, have) = {
                let q = &self.reqs[&id];
                (q.tokens.len() as u64, q.computed, q.blocks.len())
            };
            let want = len - computed;
            let need = self.blocks_for(len).saturating_sub(have);
            let mut preempted_self = false;
            while self.gpu.num_free() < need {
                let Some(&victim) = self.running.last() else {
                    break;
                };
                self.preempt(victim, &mut input);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                continue;
            }
            let new = self.gpu.alloc(need).unwrap_or_default();
            let q = self.reqs.get_mut(&id).expect("running request is tracked");
            q.blocks.extend_from_slice(&new);
            input.scheduled.push(ScheduledRequest {
                req: id,
                new_block_ids: new,
                computed_tokens: computed,
                scheduled_tokens: want,
                full_table: false,
            });
            budget = budget.saturating_sub(want);
            idx += 1;
        }
        // 2. Requests whose load ended.
        let mut keep = Vec::new();
        for id in std::mem::take(&mut self.loading) {
            let q = &self.reqs[&id];
            let len = q.tokens.len() as u64;
            let computed = match q.phase {
                Phase::LoadDone => (q.local + q.external).min(len - 1),
                Phase::LoadFailed => q.local,
                _ => {
                    keep.push(id);
                    continue;
                }
            };
            if len - computed > budget && !input.scheduled.is_empty() {
                keep.push(id);
                continue;
            }
            let blocks = q.blocks.clone();
            self.timed(|s| s.on_alloc(id, &blocks, 0))?;
            self.rec.call(json!({"op": "alloc", "req": req_name(id), "block_ids": ids(&blocks), "external_tokens": 0}));
            self.rec.decision(json!({"op": "alloc"}));
            let q = self.reqs.get_mut(&id).expect("loading request is tracked");
            if q.phase == Phase::LoadDone {
                self.summary.work.loaded_tokens += q.external;
            }
            q.phase = Phase::Running;
            q.computed = computed;
            input.scheduled.push(ScheduledRequest {
                req: id,
                new_block_ids: blocks,
                computed_tokens: computed,
                scheduled_tokens: len - computed,
                full_table: true,
            });
            budget = budget.saturating_sub(len - computed);
            self.running.push(id);
        }
        self.loading = keep;
        // 3. Waiting requests, in order; a deferred one is skipped.
        let mut skipped = VecDeque::new();
        while let Some(id) = self.waiting.pop_front() {
            if self.running.len() + self.loading.len() >= self.opts.max_running {
                self.waiting.push_front(id);
                break;
            }
            // A request preempted in this step waits for the next one.
            if input.preempted.contains(&id) {
                skipped.push_back(id);
                continue;
            }
            let (len, local) = {
                let q = &self.reqs[&id];
                let len = q.tokens.len() as u64;
                let max_local = ((len - 1) / self.tpb) as usize;
                let m = self
                    .gpu
                    .match_prefix(&q.hashes[..max_local.min(q.hashes.len())]);
                (len, m as u64 * self.tpb)
            };
            let outcome = self.timed(|s| s.lookup(id, local))?;
            self.rec
                .call(json!({"op": "lookup", "req": req_name(id), "computed_tokens": local}));
            let ext = match outcome {
                LookupOutcome::Defer => {
                    self.rec.decision(json!({"op": "lookup", "defer": true}));
                    skipped.push_back(id);
                    continue;
                }
                LookupOutcome::Hit(n) => {
                    self.rec.decision(json!({"op": "lookup", "hit_tokens": n}));
                    n
                }
            };
            let total = self.blocks_for(len);
            let local_blocks = (local / self.tpb) as usize;
            let new_needed = total - local_blocks;
            let compute = if ext > 0 { 0 } else { len - local };
            if self.gpu.num_free() < total || (compute > budget && !input.scheduled.is_empty()) {
                self.waiting.push_front(id);
                break;
            }
            let hashes = self.reqs[&id].hashes[..local_blocks].to_vec();
            let mut blocks = self.gpu.take_cached(&hashes);
            blocks.extend(self.gpu.alloc(new_needed).unwrap_or_default());
            let job = self.timed(|s| s.on_alloc(id, &blocks, ext))?;
            self.rec.call(json!({"op": "alloc", "req": req_name(id), "block_ids": ids(&blocks), "external_tokens": ext}));
            self.rec.decision(match job {
                Some(j) => json!({"op": "alloc", "load_job": j.0}),
                None => json!({"op": "alloc"}),
            });
            self.summary.work.prompt_tokens += len;
            self.summary.work.gpu_hit_tokens += local;
            let q = self.reqs.get_mut(&id).expect("waiting request is tracked");
            q.blocks = blocks.clone();
            q.local = local;
            q.external = ext;
            if job.is_some() {
                q.phase = Phase::Loading;
                self.loading.push(id);
            } else {
                q.phase = Phase::Running;
                q.computed = local;
                input.scheduled.push(ScheduledRequest {
                    req: id,
                    new_block_ids: blocks,
                    computed_tokens: local,
                    scheduled_tokens: len - local,
                    full_table: true,
                });
                budget = budget.saturating_sub(len - local);
                self.running.push(id);
            }
        }
        while let Some(id) = skipped.pop_back() {
            self.waiting.push_front(id);
        }
        Ok(input)
    }

    fn preempt(&mut self, id: RequestId, input: &mut StepInput) {
        self.running.retain(|&r| r != id);
        let tpb = self.tpb;
        if let Some(q) = self.reqs.get_mut(&id) {
            let full = ((q.computed / tpb) as usize).min(q.hashes.len());
            self.gpu.free(&q.blocks, &q.hashes[..full]);
            q.blocks.clear();
            q.computed = 0;
            q.phase = Phase::Waiting;
        }
        input.preempted.push(id);
        self.waiting.push_front(id);
        self.summary.work.preemptions += 1;
    }

    /// After the step: scheduled tokens are computed, one token is generated
    /// per request at the end of its prompt; finished requests free their blocks.
    fn advance_tokens(&mut self, input: &StepInput) -> Result<(), SimError> {
        let tpb = self.tpb as usize;
        for s in &input.scheduled {
            let Some(q) = self.reqs.get_mut(&s.req) else {
                continue;
            };
            if q.phase != Phase::Running {
                continue;
            }
            q.computed = s.computed_tokens + s.scheduled_tokens;
            if q.computed < q.tokens.len() as u64 {
                continue;
            }
            let t = Workload::generate(&mut q.conv);
            q.tokens.push(t);
            q.generated += 1;
            self.summary.work.generated_tokens += 1;
            let have = q.hashes.len();
            let new = if q.tokens.len() / tpb > have {
                block_hashes(&q.tokens[have * tpb..], tpb, q.hashes.last().copied())
            } else {
                Vec::new()
            };
            q.hashes.extend_from_slice(&new);
            let n = q.tokens.len() as u64;
            let done = q.generated >= q.out_target;
            self.timed(|sch| sch.update_request(s.req, n, &new))?;
            let mut line = json!({"op": "update_request", "req": req_name(s.req), "num_tokens": n});
            if !new.is_empty() {
                line["block_hashes"] = Value::from(new.iter().map(|h| h.0).collect::<Vec<_>>());
            }
            self.rec.call(line);
            if done {
                self.finish_request(s.req)?;
            }
        }
        Ok(())
    }

    fn finish_request(&mut self, id: RequestId) -> Result<(), SimError> {
        let Some(q) = self.reqs.remove(&id) else {
            return Ok(());
        };
        self.running.retain(|&r| r != id);
        let blocks = q.blocks.clone();
        self.timed(|s| s.request_finished(id, &blocks, false, 0))?;
        self.rec.call(
            json!({"op": "request_finished", "req": req_name(id), "block_ids": ids(&blocks)}),
        );
        let full = ((q.computed / self.tpb) as usize).min(q.hashes.len());
        self.gpu.free(&blocks, &q.hashes[..full]);
        self.finished_prev.push(id);
        self.summary.work.finished += 1;
        let _ = q.prompt_len;
        if q.conv.turns_left > 0 {
            let at = self.step + self.workload.think_steps();
            self.arrivals.push((at, q.conv));
        }
        Ok(())
    }

    fn finish(mut self) -> Result<SimOutput, SimError> {
        // Anything still stalled is cancelled by the backend.
        let due: Vec<JobId> = self.due.drain(..).map(|(_, j, _)| j).collect();
        for job in due {
            self.cancel(job)?;
        }
        self.rec.call(json!({"op": "state"}));
        let st = self.sched.state();
        let invariant = self.sched.check_invariants().err();
        let m = self.sched.metrics();
        let mut l = Leaks {
            jobs: st.jobs as u64,
            requests: st.requests as u64,
            chunks_being_loaded: st.chunks_being_loaded as u64,
            fenced_blocks: st.fenced_blocks as u64,
            stalled_jobs: st.stalled_jobs as u64,
            quarantined_chunks: st.quarantined_chunks as u64,
            pinned_chunks: u64::from(st.manager.pinned),
            pending_chunks: u64::from(st.manager.pending),
            gpu_blocks_in_use: (self.gpu.capacity() - self.gpu.num_free()) as u64,
            reset_fence: self.sched.reset_fence_len() as u64,
            invariant_violations: u64::from(invariant.is_some()),
            total: 0,
        };
        l.total = l.jobs
            + l.requests
            + l.chunks_being_loaded
            + l.fenced_blocks
            + l.stalled_jobs
            + l.quarantined_chunks
            + l.pinned_chunks
            + l.pending_chunks
            + l.gpu_blocks_in_use
            + l.reset_fence
            + l.invariant_violations;
        let s = &mut self.summary;
        s.leaks = l;
        s.invariant_error = invariant;
        s.steps = self.step;
        s.simulated_s = (self.step * self.opts.step_ms) as f64 / 1000.0;
        s.faults.stalled_stores = m.stalled_stores;
        s.faults.stalled_loads = m.stalled_loads;
        s.faults.late_reports = m.late_reports;
        let w = &s.work;
        if w.prompt_tokens > 0 {
            s.hit_rate_without_offload = w.gpu_hit_tokens as f64 / w.prompt_tokens as f64;
            s.hit_rate_with_offload =
                (w.gpu_hit_tokens + w.loaded_tokens) as f64 / w.prompt_tokens as f64;
        }
        let t = &mut s.transfers;
        t.bytes_stored = self.metrics.store.bytes;
        t.bytes_loaded = self.metrics.load.bytes;
        t.store_jobs = self.metrics.store.jobs;
        t.load_jobs = self.metrics.load.jobs;
        let rate = |b: u64, secs: f64| {
            if secs > 0.0 {
                b as f64 / secs / 1e9
            } else {
                0.0
            }
        };
        t.store_gbps = rate(t.bytes_stored, self.metrics.store.seconds);
        t.load_gbps = rate(t.bytes_loaded, self.metrics.load.seconds);
        let mut ns = std::mem::take(&mut self.step_ns);
        ns.sort_unstable();
        s.step_time = StepTimes {
            steps: ns.len() as u64,
            p50_us: percentile(&ns, 50.0) as f64 / 1e3,
            p99_us: percentile(&ns, 99.0) as f64 / 1e3,
            max_us: ns.last().copied().unwrap_or(0) as f64 / 1e3,
        };
        let decisions = self.rec.finish()?;
        Ok(SimOutput {
            summary: self.summary,
            decisions,
        })
    }
}

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
