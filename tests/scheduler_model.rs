//! Model-based property test of the control plane: random interleavings of
//! add / lookup / alloc / step (with preemptions, finishes and aborts) /
//! request-finished / reset, worker reports delivered in order, out of order,
//! late, duplicated, split across workers and for unknown jobs, and clock jumps
//! past the stall timeout. After every operation the scheduler is checked
//! against a reference model of every job's life (live -> completed, stalled or
//! dropped by a reset; every report accepted or rejected as the model says;
//! every job completes or stalls exactly once; no load of a key that was not
//! stored) and against `Scheduler::check_invariants` (no chunk evicted while
//! pinned or pending, no slot owned twice, ...). At the end everything drains
//! and nothing is left. A failing case is shrunk by proptest and written out as
//! a replayable trace (`kvoffload replay PATH`), whose path the failure prints.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

use common::trace_rec::Rec;
use kvoffload::scheduler::{
    JobKind, LookupOutcome, ScheduledRequest, SchedulerError, StepInput, WorkerReport,
};
use kvoffload::{BlockHash, ChunkKey, GpuBlockId, JobId, OffloadConfig, RequestId};
use proptest::prelude::*;

const TPB: u64 = 4;
const STALL_MS: u64 = 1_000;

#[derive(Debug, Clone)]
enum Op {
    Add {
        family: u8,
        prompt: u8,
    },
    Step {
        preempt: Option<u8>,
        finish: Option<u8>,
        abort: bool,
    },
    /// Reports for one in-flight job, any job (out of order), `count` reports,
    /// delivered in one call or split into single-worker calls.
    Report {
        pick: u8,
        count: u8,
        fail: bool,
        split: bool,
    },
    /// A report for a job that already completed (duplicate).
    Duplicate {
        pick: u8,
    },
    /// A report for a job id never created.
    Unknown {
        ahead: u8,
    },
    /// A late report for a stalled job.
    Late {
        pick: u8,
    },
    /// Clock moves by `ms` (small).
    Advance {
        ms: u16,
    },
    /// Clock jumps past the stall timeout, then a scan.
    Jump,
    Scan,
    Reset,
    Cancel {
        pick: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..24).prop_map(|(family, prompt)| Op::Add { family, prompt }),
        6 => (proptest::option::of(any::<u8>()), proptest::option::of(any::<u8>()), any::<bool>())
            .prop_map(|(preempt, finish, abort)| Op::Step { preempt, finish, abort }),
        5 => (any::<u8>(), 1u8..4, proptest::bool::weighted(0.1), any::<bool>())
            .prop_map(|(pick, count, fail, split)| Op::Report { pick, count, fail, split }),
        1 => any::<u8>().prop_map(|pick| Op::Duplicate { pick }),
        1 => (0u8..4).prop_map(|ahead| Op::Unknown { ahead }),
        1 => any::<u8>().prop_map(|pick| Op::Late { pick }),
        1 => (0u16..600).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Jump),
        1 => Just(Op::Scan),
        1 => Just(Op::Reset),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
    ]
}

/// A job's life in the reference model.
#[derive(Debug, Clone, Copy, PartialEq)]
enum JSt {
    /// In flight; `left` reports due.
    Live,
    /// Every report arrived.
    Completed,
    /// Handed over as stalled; `left` late reports due.
    Stalled,
    /// Late reports all in, or cancellation confirmed.
    Released,
    /// In flight at a reset; `left` reports still count toward the reset fence.
    Dropped,
}

#[derive(Debug, Clone)]
struct MJob {
    kind: JobKind,
    req: RequestId,
    created_ms: u64,
    left: u32,
    failed: bool,
    st: JSt,
    keys: Vec<ChunkKey>,
    /// Times it completed / stalled (each at most once, and not both).
    completions: u32,
    stalls: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum RSt {
    Waiting,
    Loading,
    Running,
    Done,
}

struct MReq {
    id: u64,
    family: u64,
    prompt_blocks: u64,
    tokens: u64,
    computed: u64,
    st: RSt,
    full: bool,
    blocks: Vec<GpuBlockId>,
}

struct World {
    rec: Rec,
    world: u32,
    now_ms: u64,
    reqs: Vec<MReq>,
    jobs: BTreeMap<u64, MJob>,
    /// Job ids below this were created before the last reset.
    threshold: u64,
    /// Keys whose store completed successfully since the last reset.
    stored: HashSet<ChunkKey>,
    free_blocks: Vec<GpuBlockId>,
    next_block: u32,
    stall_count: u64,
}

fn hash(m: &MReq, i: u64) -> BlockHash {
    if i < m.prompt_blocks {
        BlockHash(m.family * 1000 + i + 1)
    } else {
        BlockHash((m.id + 1) * 1_000_000 + i)
    }
}

impl World {
    fn new(world: u32, chunks: u64, prompt_only: bool) -> Self {
        let cfg = OffloadConfig {
            tokens_per_block: TPB as u32,
            blocks_per_chunk: 1,
            world_size: world,
            offload_prompt_only: prompt_only,
            stall_timeout_ms: STALL_MS,
            stall_scan_interval_ms: 100,
            ..OffloadConfig::with_chunks(chunks)
        };
        Self {
            rec: Rec::new(&cfg),
            world,
            now_ms: 0,
            reqs: Vec::new(),
            jobs: BTreeMap::new(),
            threshold: 0,
            stored: HashSet::new(),
            free_blocks: Vec::new(),
            next_block: 0,
            stall_count: 0,
        }
    }

    fn new_job(&mut self, job: JobId, kind: JobKind, req: RequestId, keys: Vec<ChunkKey>) {
        let prev = self.jobs.insert(
            job.0,
            MJob {
                kind,
                req,
                created_ms: self.now_ms,
                left: self.world,
                failed: false,
                st: JSt::Live,
                keys,
                completions: 0,
                stalls: 0,
            },
        );
        assert!(prev.is_none(), "job id {job} reused");
    }

    /// The model and the scheduler agree on every job; the invariants hold.
    fn check(&self) {
        if let Err(e) = self.rec.s.check_invariants() {
            panic!("invariant violated: {e}");
        }
        let s = &self.rec.s;
        let (mut live, mut stalled) = (0, 0);
        for (&id, j) in &self.jobs {
            let id = JobId(id);
            assert!(j.completions + j.stalls <= 1, "{id} ended twice: {j:?}");
            assert_eq!(s.is_job_live(id), j.st == JSt::Live, "{id} liveness: {j:?}");
            assert_eq!(
                s.is_job_stalled(id),
                j.st == JSt::Stalled,
                "{id} stalled: {j:?}"
            );
            live += usize::from(j.st == JSt::Live);
            stalled += usize::from(j.st == JSt::Stalled);
        }
        let st = s.state();
        assert_eq!(st.jobs, live, "live jobs");
        assert_eq!(st.stalled_jobs, stalled, "stalled jobs");
        let m = s.metrics();
        assert_eq!(m.jobs_created, self.jobs.len() as u64, "jobs created");
        assert_eq!(
            m.stalled_stores + m.stalled_loads,
            self.stall_count,
            "stalls"
        );
        let fence: usize = self
            .jobs
            .values()
            .filter(|j| j.st == JSt::Dropped && j.left > 0)
            .count();
        assert_eq!(s.reset_fence_len(), fence, "reset fence");
    }

    fn block(&mut self) -> GpuBlockId {
        self.free_blocks.pop().unwrap_or_else(|| {
            self.next_block += 1;
            GpuBlockId(self.next_block)
        })
    }

    fn free(&mut self, i: usize) {
        let b = std::mem::take(&mut self.reqs[i].blocks);
        self.free_blocks.extend(b);
    }

    fn on_loads(&mut self, finished: &[RequestId], failed: &[RequestId]) {
        for m in &mut self.reqs {
            if m.st != RSt::Loading {
                continue;
            }
            if failed.contains(&RequestId(m.id)) {
                m.st = RSt::Running;
                m.computed = 0;
                m.full = true;
            } else if finished.contains(&RequestId(m.id)) {
                m.st = RSt::Running;
                m.full = true;
            }
        }
    }

    /// Delivers `n` reports for `job` (optionally failed) and checks the outcome
    /// against the model; returns the outcome's load lists.
    fn report(&mut self, job: u64, n: u32, fail: bool) {
        let expect_ok = match self.jobs.get(&job) {
            Some(j) => match j.st {
                JSt::Live | JSt::Stalled => n <= j.left,
                JSt::Dropped => true,
                JSt::Completed | JSt::Released => job < self.threshold,
            },
            None => false,
        };
        let out = self.rec.on_worker_output(&WorkerReport {
            completed: vec![(JobId(job), n)],
            failed: if fail { vec![JobId(job)] } else { vec![] },
        });
        if !expect_ok {
            assert_eq!(out.rejected.len(), 1, "report {job}x{n} must be rejected");
            assert!(out.finished_loads.is_empty() && out.failed_loads.is_empty());
            self.check();
            return;
        }
        assert!(
            out.rejected.is_empty(),
            "report {job}x{n}: {:?}",
            out.rejected
        );
        let mut exp_finished = Vec::new();
        let mut exp_failed = Vec::new();
        if let Some(j) = self.jobs.get_mut(&job) {
            match j.st {
                JSt::Live => {
                    j.left -= n;
                    j.failed |= fail;
                    if j.left == 0 {
                        j.st = JSt::Completed;
                        j.completions += 1;
                        match (j.kind, j.failed) {
                            (JobKind::Load, false) => exp_finished.push(j.req),
                            (JobKind::Load, true) => exp_failed.push(j.req),
                            (JobKind::Store, false) => self.stored.extend(j.keys.iter().copied()),
                            (JobKind::Store, true) => {}
                        }
                    }
                }
                JSt::Stalled => {
                    j.left -= n;
                    if j.left == 0 {
                        j.st = JSt::Released;
                    }
                }
                JSt::Dropped => {
                    // A load dropped by a reset still ends for the backend: as a
                    // failed load if any worker reported a failure, before or
                    // after the reset.
                    let before = j.left;
                    j.left = j.left.saturating_sub(n);
                    j.failed |= fail;
                    if before > 0 && j.left == 0 && j.kind == JobKind::Load {
                        if j.failed {
                            exp_failed.push(j.req);
                        } else {
                            exp_finished.push(j.req);
                        }
                    }
                }
                JSt::Completed | JSt::Released => {}
            }
        }
        assert_eq!(
            out.finished_loads, exp_finished,
            "finished loads of {job}x{n}"
        );
        assert_eq!(out.failed_loads, exp_failed, "failed loads of {job}x{n}");
        self.check();
        self.on_loads(&out.finished_loads, &out.failed_loads);
    }

    fn scan(&mut self) {
        let out = self.rec.scan();
        let mut exp = Vec::new();
        let mut exp_failed = BTreeSet::new();
        for (&id, j) in &mut self.jobs {
            if j.st == JSt::Live && self.now_ms - j.created_ms > STALL_MS {
                j.st = JSt::Stalled;
                j.stalls += 1;
                self.stall_count += 1;
                exp.push(JobId(id));
                if j.kind == JobKind::Load {
                    exp_failed.insert(j.req);
                }
            }
        }
        assert_eq!(out.stalled, exp, "scan at {} ms", self.now_ms);
        let exp_failed: Vec<RequestId> = exp_failed.into_iter().collect();
        assert_eq!(out.failed_loads, exp_failed, "failed loads of the scan");
        self.check();
        self.on_loads(&[], &out.failed_loads);
    }

    fn pick(&self, pick: u8, st: JSt) -> Option<u64> {
        let v: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| st == j.st && (st != JSt::Dropped || j.left > 0))
            .map(|(&id, _)| id)
            .collect();
        (!v.is_empty()).then(|| v[pick as usize % v.len()])
    }

    fn step(&mut self, preempt: Option<u8>, finish: Option<u8>, abort: bool) {
        let mut input = StepInput::default();
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != RSt::Waiting {
                continue;
            }
            let id = RequestId(self.reqs[i].id);
            match self.rec.lookup(id, 0).expect("lookup") {
                LookupOutcome::Defer => {}
                LookupOutcome::Hit(n) => {
                    let tokens = self.reqs[i].tokens;
                    let blocks: Vec<GpuBlockId> =
                        (0..tokens / TPB + 1).map(|_| self.block()).collect();
                    let job = self.rec.on_alloc(id, &blocks, n).expect("alloc");
                    let m = &mut self.reqs[i];
                    m.blocks = blocks;
                    m.full = true;
                    if let Some(job) = job {
                        m.st = RSt::Loading;
                        m.computed = n;
                        // Keys are known from the plan; the job is live now.
                        self.new_job(job, JobKind::Load, id, Vec::new());
                    } else {
                        m.st = RSt::Running;
                        m.computed = 0;
                    }
                }
            }
        }
        let running: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| self.reqs[i].st == RSt::Running && !self.reqs[i].full)
            .collect();
        let mut skip = Vec::new();
        if let Some(p) = preempt
            && !running.is_empty()
        {
            let i = running[p as usize % running.len()];
            input.preempted.push(RequestId(self.reqs[i].id));
            self.reqs[i].st = RSt::Waiting;
            self.reqs[i].computed = 0;
            self.free(i);
            skip.push(i);
        }
        if let Some(f) = finish
            && !running.is_empty()
        {
            let i = running[f as usize % running.len()];
            if !skip.contains(&i) {
                let (id, blocks, computed) = (
                    self.reqs[i].id,
                    self.reqs[i].blocks.clone(),
                    self.reqs[i].computed,
                );
                self.rec
                    .request_finished(RequestId(id), &blocks, abort, computed)
                    .expect("request_finished");
                input.finished.push(RequestId(id));
                self.reqs[i].st = RSt::Done;
                self.free(i);
                skip.push(i);
            }
        }
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != RSt::Running || skip.contains(&i) {
                continue;
            }
            let (id, computed, full) = (self.reqs[i].id, self.reqs[i].computed, self.reqs[i].full);
            if computed >= self.reqs[i].tokens {
                let m = &mut self.reqs[i];
                m.tokens += 1;
                let new_hashes: Vec<BlockHash> = if m.tokens.is_multiple_of(TPB) {
                    vec![hash(m, m.tokens / TPB - 1)]
                } else {
                    vec![]
                };
                let n = m.tokens;
                // Mid-step (after lookups and allocs): checked after the step.
                self.rec
                    .update_request(RequestId(id), n, &new_hashes)
                    .expect("update");
            }
            let mut new_blocks = Vec::new();
            while (self.reqs[i].blocks.len() as u64) * TPB <= self.reqs[i].tokens {
                let b = self.block();
                self.reqs[i].blocks.push(b);
                new_blocks.push(b);
            }
            let m = &mut self.reqs[i];
            input.scheduled.push(ScheduledRequest {
                req: RequestId(id),
                new_block_ids: if full { m.blocks.clone() } else { new_blocks },
                computed_tokens: computed,
                scheduled_tokens: m.tokens - computed,
                full_table: full,
            });
            m.computed = m.tokens;
            m.full = false;
        }
        let plan = self.rec.build_step(&input).expect("step");
        for l in &plan.loads {
            for k in &l.keys {
                assert!(
                    self.stored.contains(k),
                    "load {} of key {k:?} that was never stored",
                    l.job
                );
            }
            let j = self
                .jobs
                .get_mut(&l.job.0)
                .expect("a load the model saw created");
            assert_eq!(j.st, JSt::Live, "load {} planned but not live", l.job);
            j.keys = l.keys.to_vec();
        }
        for s in &plan.stores {
            self.new_job(s.job, JobKind::Store, s.req, s.keys.to_vec());
        }
        for &f in &plan.flush {
            assert!(self.jobs.contains_key(&f.0), "flush of unknown job {f}");
        }
        self.check();
        self.on_loads(&[], &plan.failed_loads);
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Add { family, prompt } => {
                let id = self.reqs.len() as u64;
                let prompt = u64::from(prompt);
                let r = MReq {
                    id,
                    family: u64::from(family),
                    prompt_blocks: prompt / TPB,
                    tokens: prompt,
                    computed: 0,
                    st: RSt::Waiting,
                    full: true,
                    blocks: vec![],
                };
                let hashes: Vec<BlockHash> = (0..r.prompt_blocks).map(|i| hash(&r, i)).collect();
                self.rec
                    .add_request(RequestId(id), prompt, &hashes)
                    .expect("add");
                self.reqs.push(r);
                self.check();
            }
            Op::Step {
                preempt,
                finish,
                abort,
            } => self.step(preempt, finish, abort),
            Op::Report {
                pick,
                count,
                fail,
                split,
            } => {
                let Some(job) = self
                    .pick(pick, JSt::Live)
                    .or_else(|| self.pick(pick, JSt::Dropped))
                else {
                    return;
                };
                let n = u32::from(count).min(self.jobs[&job].left).max(1);
                if split {
                    for k in 0..n {
                        self.report(job, 1, fail && k == 0);
                    }
                } else {
                    self.report(job, n, fail);
                }
            }
            Op::Duplicate { pick } => {
                if let Some(job) = self
                    .pick(pick, JSt::Completed)
                    .or_else(|| self.pick(pick, JSt::Released))
                {
                    self.report(job, 1, false);
                }
            }
            Op::Unknown { ahead } => {
                let job = self.rec.s.next_job_id().0 + u64::from(ahead);
                self.report(job, 1, false);
            }
            Op::Late { pick } => {
                if let Some(job) = self.pick(pick, JSt::Stalled) {
                    self.report(job, 1, false);
                }
            }
            Op::Advance { ms } => {
                self.rec.advance_ms(u64::from(ms));
                self.now_ms += u64::from(ms);
            }
            Op::Jump => {
                self.rec.advance_ms(STALL_MS + 1);
                self.now_ms += STALL_MS + 1;
                self.scan();
            }
            Op::Scan => self.scan(),
            Op::Reset => {
                self.rec.reset().expect("reset");
                self.threshold = self.rec.s.next_job_id().0;
                self.stored.clear();
                for (&id, j) in self.jobs.iter_mut() {
                    if j.st == JSt::Live {
                        j.st = JSt::Dropped;
                    }
                    // A stalled job that holds no host chunk (its chunks were
                    // already held by an older stalled load) stops being tracked
                    // at a reset; its late reports are then accepted as stale.
                    if j.st == JSt::Stalled && !self.rec.s.is_job_stalled(JobId(id)) {
                        j.st = JSt::Released;
                    }
                }
                for r in &mut self.reqs {
                    if r.st == RSt::Running {
                        r.full = true;
                    }
                }
                self.check();
            }
            Op::Cancel { pick } => {
                if let Some(job) = self.pick(pick, JSt::Stalled) {
                    self.rec
                        .confirm_cancelled(JobId(job))
                        .expect("cancel a stalled job");
                    self.jobs.get_mut(&job).unwrap().st = JSt::Released;
                } else if let Some(job) = self.pick(pick, JSt::Live) {
                    let e = self.rec.confirm_cancelled(JobId(job));
                    assert!(
                        matches!(e, Err(SchedulerError::NotStalled(_))),
                        "cancel of a live job: {e:?}"
                    );
                }
                self.check();
            }
        }
    }

    /// Every outstanding report arrives, every request finishes: nothing is left.
    fn drain(&mut self) {
        let due: Vec<(u64, u32)> = self
            .jobs
            .iter()
            .filter(|(_, j)| matches!(j.st, JSt::Live | JSt::Stalled | JSt::Dropped) && j.left > 0)
            .map(|(&id, j)| (id, j.left))
            .collect();
        for (job, n) in due {
            self.report(job, n, false);
        }
        let live: Vec<u64> = self
            .reqs
            .iter()
            .filter(|r| r.st != RSt::Done)
            .map(|r| r.id)
            .collect();
        for &id in &live {
            self.rec
                .request_finished(RequestId(id), &[], true, 0)
                .expect("finish");
        }
        let input = StepInput {
            finished: live.iter().map(|&i| RequestId(i)).collect(),
            ..StepInput::default()
        };
        let plan = self.rec.build_step(&input).expect("final step");
        assert!(plan.stores.is_empty() && plan.loads.is_empty());
        self.rec.state_line();
        self.check();
        let st = self.rec.s.state();
        assert_eq!(
            (
                st.jobs,
                st.requests,
                st.chunks_being_loaded,
                st.fenced_blocks,
                st.stalled_jobs,
                st.quarantined_chunks
            ),
            (0, 0, 0, 0, 0, 0),
            "leak after drain: {st:?}"
        );
        assert_eq!(
            st.manager.pending + st.manager.pinned + st.manager.quarantined,
            0,
            "{st:?}"
        );
        assert_eq!(self.rec.s.reset_fence_len(), 0);
        assert!(!self.rec.s.has_pending_work());
        for (id, j) in &self.jobs {
            assert!(
                matches!(j.st, JSt::Completed | JSt::Released | JSt::Dropped),
                "job {id} did not end: {j:?}"
            );
            assert_eq!(
                j.completions + j.stalls,
                u32::from(j.st != JSt::Dropped),
                "job {id} ended once: {j:?}"
            );
        }
    }
}

/// Runs `ops`; on failure writes the trace (up to and including the failing
/// call) and fails with its path.
fn run(ops: Vec<Op>, world: u32, chunks: u64, prompt_only: bool) {
    let mut w = World::new(world, chunks, prompt_only);
    let res = catch_unwind(AssertUnwindSafe(|| {
        for op in ops {
            w.apply(op);
        }
        w.drain();
    }));
    if let Err(payload) = res {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let trace = w.rec.trace();
        let name = format!("fail-{:016x}", fxhash(&trace));
        let path = w.rec.write("scheduler_model", &name);
        panic!(
            "{msg}\nreplayable trace: kvoffload replay {}",
            path.display()
        );
    }
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn control_plane_matches_the_model(
        ops in proptest::collection::vec(op(), 1..100),
        world in 1u32..4,
        chunks in prop_oneof![Just(4u64), Just(16), Just(64)],
        prompt_only in any::<bool>(),
    ) {
        run(ops, world, chunks, prompt_only);
    }
}

/// The recorded trace of a run replays without a malformed line, one output
/// line per operation, and the replay's last `state` shows the drained engine.
#[test]
fn recorded_trace_replays() {
    use Op::*;
    let ops = vec![
        Add {
            family: 0,
            prompt: 9,
        },
        Step {
            preempt: None,
            finish: None,
            abort: false,
        },
        Report {
            pick: 0,
            count: 1,
            fail: false,
            split: true,
        },
        Add {
            family: 0,
            prompt: 9,
        },
        Step {
            preempt: None,
            finish: None,
            abort: false,
        },
        Jump,
        Late { pick: 0 },
        Duplicate { pick: 0 },
        Unknown { ahead: 2 },
        Reset,
        Report {
            pick: 0,
            count: 3,
            fail: false,
            split: false,
        },
        Step {
            preempt: None,
            finish: Some(0),
            abort: false,
        },
    ];
    let mut w = World::new(2, 16, false);
    for op in ops {
        w.apply(op);
    }
    w.drain();
    let trace = w.rec.trace();
    let mut out = Vec::new();
    kvoffload::replay::run(trace.as_bytes(), &mut out).expect("replayable");
    let out = String::from_utf8(out).unwrap();
    assert_eq!(out.lines().count(), w.rec.lines.len() - 1);
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["op"], "state");
    assert_eq!(last["jobs"], 0);
    assert_eq!(last["stalled_jobs"], 0);
    assert_eq!(last["has_pending_work"], false);
    assert!(
        w.rec.s.metrics().unknown_reports >= 1,
        "the unknown report was rejected"
    );
}
