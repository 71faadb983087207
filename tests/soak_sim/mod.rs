//! A deterministic serving-backend simulation for the soak test: the real
//! [`Scheduler`] (and its host-tier manager) on a manual clock, driven by a
//! simulated backend (requests with shared prefixes, prefill, decode,
//! preemptions, finishes and aborts, periodic resets) and a simulated worker
//! pool that completes jobs after a short delay, splits reports across the
//! workers, fails a few, and stalls a fraction: a stalled transfer reports late
//! (after the watchdog's scan) or is cancelled through `confirm_cancelled`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use kvoffload::scheduler::{CompletionReport, LookupOutcome, Scheduler, StepInput};
use kvoffload::{JobId, ManualClock, OffloadConfig, RequestId};

use crate::counting_alloc::rss_bytes;
use crate::driver::{self, BlockPool, Hooks, Req, ReqState};
use crate::rng::Rng;

/// Soak parameters.
#[derive(Debug, Clone)]
pub struct SoakParams {
    /// Engine steps.
    pub steps: u64,
    /// Fraction of transfers that stall (never report before the timeout).
    pub stall_rate: f64,
    /// A reset every this many steps (0: never).
    pub reset_every: u64,
    /// Run `check_invariants` every this many steps.
    pub check_every: u64,
    /// Resident-memory samples over the run.
    pub rss_samples: u64,
    /// RNG seed.
    pub seed: u64,
}

/// What a soak run measured.
#[derive(Debug, Default, Clone)]
pub struct SoakReport {
    pub steps: u64,
    pub requests: u64,
    pub jobs: u64,
    pub stalled: u64,
    pub late_reports: u64,
    pub cancelled: u64,
    pub failed_reports: u64,
    pub resets: u64,
    pub preemptions: u64,
    pub loads: u64,
    pub events: u64,
    /// Highest GPU block id handed out (bounded: blocks are reused).
    pub max_block: u64,
    /// Resident set size samples (bytes), evenly spaced over the run.
    pub rss: Vec<u64>,
}

impl SoakReport {
    /// Mean RSS of the first and of the last tenth of the samples, and the growth in percent.
    pub fn rss_growth(&self) -> (u64, u64, f64) {
        let n = (self.rss.len() / 10).max(1);
        let mean = |s: &[u64]| s.iter().sum::<u64>() / s.len().max(1) as u64;
        let first = mean(&self.rss[..n.min(self.rss.len())]);
        let last = mean(&self.rss[self.rss.len().saturating_sub(n)..]);
        let growth = (last as f64 - first as f64) / first.max(1) as f64 * 100.0;
        (first, last, growth)
    }
}

const TPB: u64 = 16;
const STEP_MS: u64 = 10;
const TIMEOUT_MS: u64 = 500;
const WORLD: u32 = 2;
const MAX_REQS: usize = 24;

/// A request of the simulated engine: the driver's request and the tokens
/// at which it finishes.
struct SimReq {
    r: Req,
    target: u64,
}

/// A job as the simulated workers see it.
struct SimJob {
    /// Reports each worker still owes (one per worker).
    workers_left: u32,
    /// Step at which the next worker reports.
    due: u64,
    /// Stalls: reports only after the scheduler declared it stalled.
    stalls: bool,
    failed: bool,
}

/// The simulation.
pub struct Sim {
    pub s: Scheduler,
    clock: ManualClock,
    rng: Rng,
    p: SoakParams,
    reqs: BTreeMap<u64, SimReq>,
    jobs: BTreeMap<u64, SimJob>,
    blocks: BlockPool,
    next_req: u64,
    pub report: SoakReport,
}

impl Sim {
    pub fn new(p: SoakParams) -> Self {
        let cfg = OffloadConfig {
            tokens_per_block: TPB as u32,
            blocks_per_chunk: 2,
            world_size: WORLD,
            offload_prompt_only: false,
            stall_timeout_ms: TIMEOUT_MS,
            stall_scan_interval_ms: 50,
            ..OffloadConfig::with_chunks(256)
        };
        let (s, clock) = driver::scheduler_on_manual_clock(&cfg);
        Self {
            s,
            clock,
            rng: Rng::new(p.seed),
            p,
            reqs: BTreeMap::new(),
            jobs: BTreeMap::new(),
            blocks: BlockPool::default(),
            next_req: 0,
            report: SoakReport::default(),
        }
    }

    fn check(&self) {
        if let Err(e) = self.s.check_invariants() {
            panic!("step {}: invariant violated: {e}", self.report.steps);
        }
    }

    fn new_job(&mut self, job: JobId, step: u64) {
        let stalls = self.rng.chance(self.p.stall_rate);
        let failed = self.rng.chance(0.01);
        let due = step + self.rng.below(4);
        self.jobs.insert(
            job.0,
            SimJob {
                workers_left: WORLD,
                due,
                stalls,
                failed,
            },
        );
    }

    fn on_loads(&mut self, finished: &[RequestId], failed: &[RequestId]) {
        driver::on_loads(self.reqs.values_mut().map(|q| &mut q.r), finished, failed);
    }

    /// One engine step at step number `step`.
    pub fn step(&mut self, step: u64) {
        self.clock.advance(Duration::from_millis(STEP_MS));
        // The watchdog's rule (scan when an interval has passed), on this thread.
        if let Some(out) = self.s.scan_if_due() {
            self.report.stalled += out.stalled.len() as u64;
            self.on_loads(&[], &out.failed_loads);
        }
        if self.p.reset_every > 0 && step > 0 && step.is_multiple_of(self.p.reset_every) {
            self.s.reset().expect("reset");
            self.report.resets += 1;
            for r in self.reqs.values_mut() {
                if r.r.st == ReqState::Running {
                    r.r.full = true;
                }
            }
        }
        self.deliver_reports(step);
        // New requests: shared prefixes of 8 families.
        while self.reqs.len() < MAX_REQS && self.rng.chance(0.3) {
            let id = self.next_req;
            self.next_req += 1;
            let family = self.rng.below(8);
            let prompt = 16 + self.rng.below(96);
            let r = Req::new(id, family, prompt, TPB);
            self.s
                .add_request(RequestId(id), prompt, &r.prompt_hashes())
                .expect("add");
            let target = prompt + 8 + self.rng.below(64);
            self.reqs.insert(id, SimReq { r, target });
            self.report.requests += 1;
        }
        let mut input = StepInput::default();
        let ids: Vec<u64> = self.reqs.keys().copied().collect();
        for &id in &ids {
            if self.reqs[&id].r.st != ReqState::Waiting {
                continue;
            }
            if let LookupOutcome::Hit(n) = Hooks::lookup(&mut self.s, RequestId(id), 0) {
                let r = &mut self.reqs.get_mut(&id).unwrap().r;
                if let Some(job) = driver::admit(&mut self.s, r, &mut self.blocks, TPB, n) {
                    self.report.loads += 1;
                    self.new_job(job, step);
                }
            }
        }
        let mut done = Vec::new();
        for &id in &ids {
            let q = &self.reqs[&id];
            if q.r.st != ReqState::Running || q.r.full {
                continue;
            }
            if q.r.tokens >= q.target {
                done.push((id, false));
            } else if self.rng.chance(0.002) {
                done.push((id, true));
            } else if self.rng.chance(0.003) {
                input.preempted.push(RequestId(id));
            }
        }
        for &(id, aborted) in &done {
            let mut r = self.reqs.remove(&id).unwrap().r;
            driver::finish(&mut self.s, &mut r, &mut self.blocks, aborted, &mut input);
        }
        for &req in &input.preempted {
            driver::preempt(&mut self.reqs.get_mut(&req.0).unwrap().r, &mut self.blocks);
            self.report.preemptions += 1;
        }
        for &id in &ids {
            let Some(q) = self.reqs.get_mut(&id) else {
                continue;
            };
            if q.r.st != ReqState::Running || input.preempted.contains(&RequestId(id)) {
                continue;
            }
            let entry = driver::schedule(&mut self.s, &mut q.r, &mut self.blocks, TPB);
            input.scheduled.push(entry);
        }
        let plan = self.s.build_step(&input).expect("step");
        // The backend drains the host tier's events every step (vLLM `take_events`).
        self.report.events += self.s.take_events().len() as u64;
        for st in &plan.stores {
            self.new_job(st.job, step);
        }
        self.on_loads(&[], &plan.failed_loads);
        self.report.steps += 1;
        if self.p.check_every > 0 && step.is_multiple_of(self.p.check_every) {
            self.check();
        }
    }

    /// The simulated workers: each due job gets one worker's report (reports of
    /// a job are split across steps); a stalling job waits for its stall, then
    /// reports late or has its cancellation confirmed.
    fn deliver_reports(&mut self, step: u64) {
        let mut completed = Vec::new();
        let mut failed = Vec::new();
        let mut cancel = Vec::new();
        let mut finished_jobs = Vec::new();
        for (&id, j) in self.jobs.iter_mut() {
            if j.due > step {
                continue;
            }
            if j.stalls {
                if !self.s.is_job_stalled(JobId(id)) {
                    // Dropped by a reset while stalling: the reset fence needs its reports.
                    if self.s.is_job_live(JobId(id)) || step < j.due + TIMEOUT_MS / STEP_MS * 2 {
                        continue;
                    }
                } else if self.rng.chance(0.5) {
                    cancel.push(id);
                    finished_jobs.push(id);
                    continue;
                }
                self.report.late_reports += u64::from(self.s.is_job_stalled(JobId(id)));
            }
            completed.push((JobId(id), 1));
            if j.failed && j.workers_left == WORLD {
                failed.push(JobId(id));
                self.report.failed_reports += 1;
            }
            j.workers_left -= 1;
            j.due = step + 1 + self.rng.below(2);
            if j.workers_left == 0 {
                finished_jobs.push(id);
            }
        }
        for id in cancel {
            self.s
                .confirm_cancelled(JobId(id))
                .expect("confirm_cancelled");
            self.report.cancelled += 1;
        }
        for id in finished_jobs {
            self.jobs.remove(&id);
        }
        if !completed.is_empty() {
            let out = self
                .s
                .on_worker_output(&CompletionReport { completed, failed });
            assert!(
                out.rejected.is_empty(),
                "step {step}: rejected {:?}",
                out.rejected
            );
            self.on_loads(&out.finished_loads, &out.failed_loads);
        }
    }

    /// Runs the soak, sampling RSS, then drains; panics on any leak.
    pub fn run(mut self) -> SoakReport {
        let every = (self.p.steps / self.p.rss_samples.max(1)).max(1);
        for step in 0..self.p.steps {
            self.step(step);
            if step % every == every - 1 {
                self.report.rss.push(rss_bytes());
            }
        }
        self.drain();
        self.report.max_block = u64::from(self.blocks.highest());
        self.report.jobs = self.s.metrics().jobs_created;
        self.report
    }

    /// Every outstanding report arrives (stalled jobs report late), every
    /// request finishes, the last stores complete: nothing may be left.
    fn drain(&mut self) {
        let mut step = self.p.steps;
        let ids: Vec<u64> = self.reqs.keys().copied().collect();
        for id in &ids {
            self.s
                .request_finished(RequestId(*id), &[], true, 0)
                .expect("finish");
        }
        let input = StepInput {
            finished: ids.iter().map(|&i| RequestId(i)).collect(),
            ..StepInput::default()
        };
        let plan = self.s.build_step(&input).expect("final step");
        assert!(
            plan.stores.is_empty(),
            "aborted at 0 tokens: nothing to store"
        );
        self.reqs.clear();
        // Past every timeout: whatever still stalls is found, then reported late.
        while !self.jobs.is_empty() {
            self.clock
                .advance(Duration::from_millis(TIMEOUT_MS + STEP_MS));
            self.s.scan_now();
            for j in self.jobs.values_mut() {
                j.due = 0;
                j.stalls = false;
            }
            self.deliver_reports(step);
            step += 1;
            assert!(
                step < self.p.steps + 100,
                "drain does not converge: {} jobs",
                self.jobs.len()
            );
        }
        self.s
            .build_step(&StepInput::default())
            .expect("empty step");
        self.check();
        driver::assert_drained(&self.s);
    }
}

/// Summary line for the report.
pub fn summary(r: &SoakReport, wall: Duration) -> String {
    let (first, last, growth) = r.rss_growth();
    let m: HashMap<&str, u64> = HashMap::from([
        ("requests", r.requests),
        ("jobs", r.jobs),
        ("stalled", r.stalled),
        ("late_reports", r.late_reports),
        ("cancelled", r.cancelled),
        ("failed_reports", r.failed_reports),
        ("resets", r.resets),
        ("preemptions", r.preemptions),
        ("loads", r.loads),
        ("events", r.events),
        ("max_block", r.max_block),
    ]);
    let mut kv: Vec<_> = m.into_iter().collect();
    kv.sort();
    format!(
        "soak: {} steps in {:.1} s; {kv:?}; RSS first tenth {} KiB, last tenth {} KiB, growth {growth:+.2}%",
        r.steps,
        wall.as_secs_f64(),
        first / 1024,
        last / 1024
    )
}
