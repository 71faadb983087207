//! Property test: a randomized serving backend (admission with and without
//! per-request load and store limits, prefill, decode,
//! preemption, finish and abort, partial worker reports, stalls, resets,
//! cancellations, block reuse) drives the scheduler; every invariant holds after
//! every hook, no report is ever rejected, and everything drains at the end.
//!
//! Besides the scheduler's own `check_invariants`, a witness that sees only
//! what a worker sees (the plans, the reports it sends, the scans' stalls)
//! checks the properties that keep bytes safe, without reading the
//! scheduler's state:
//! - a host slot is written by one store at a time and never while a load
//!   reads it, nor while a stalled job may still touch it (until its late
//!   reports, or its cancellation, end it);
//! - a load reads a slot only for the key the last store there wrote, after
//!   that store's every report came back successful, and not across a reset;
//! - a GPU block handed to a new owner while a store that may still come back
//!   successful reads it puts that store in the same step's flush (a stalled
//!   store, or one dropped by a reset, can never make its bytes readable);
//! - a GPU block handed to a new owner while a load may still write it (live,
//!   or stalled and not yet ended by its late reports or its cancellation)
//!   puts that load in the same step's flush, across resets too;
//! - every job in flight at a reset is in the next step's flush.

mod common;

use kvoffload::Direction;
use std::collections::{BTreeMap, BTreeSet};

use common::driver::{self, BlockPool, Req, ReqState};
use common::*;
use kvoffload::scheduler::{CompletionReport, LookupOutcome, StepInput, StepPlan};
use kvoffload::{ChunkId, ChunkKey, GpuBlockId, JobId, RequestId};
use proptest::prelude::*;

/// A job as the workers know it.
#[derive(Debug, Clone)]
struct Claim {
    kind: Direction,
    slots: Vec<(ChunkId, ChunkKey)>,
    blocks: Vec<GpuBlockId>,
    reports: u32,
    failed: bool,
    stalled: bool,
    /// A flush made the worker finish it (its GPU blocks are free again).
    flushed: bool,
    /// In flight at a reset: its completion stores nothing.
    dropped: bool,
    /// Every report arrived, or its cancellation was confirmed.
    done: bool,
}

/// The byte-safety witness (see the module docs).
#[derive(Debug, Default)]
struct Witness {
    world: u32,
    jobs: BTreeMap<JobId, Claim>,
    /// What each host slot holds: the key its last store wrote, and whether
    /// that store came back successful (readable).
    slot: BTreeMap<ChunkId, (ChunkKey, bool)>,
    /// Jobs a reset promised to flush in the next step.
    must_flush: BTreeSet<JobId>,
}

impl Witness {
    /// Jobs that may still touch host slot `c`.
    fn slot_busy(&self, c: ChunkId) -> Option<JobId> {
        self.jobs
            .iter()
            .find(|(_, j)| {
                !j.done && (j.stalled || !j.flushed) && j.slots.iter().any(|&(s, _)| s == c)
            })
            .map(|(&id, _)| id)
    }

    /// The step's plan, given the GPU blocks handed to a new owner this step.
    fn on_plan(&mut self, reused: &[GpuBlockId], plan: &StepPlan) {
        for j in std::mem::take(&mut self.must_flush) {
            assert!(
                plan.flush.contains(&j),
                "{j} was in flight at the reset, not flushed"
            );
        }
        // A store whose output can still become readable (not stalled, not
        // dropped by a reset) must read its GPU blocks before they change hands.
        for (&id, j) in &self.jobs {
            if j.kind == Direction::Store && !j.done && !j.flushed && !j.stalled && !j.dropped {
                for b in reused {
                    assert!(
                        !j.blocks.contains(b) || plan.flush.contains(&id),
                        "block {b:?} handed over while store {id} reads it, and not flushed"
                    );
                }
            }
        }
        // A load that may still write its GPU blocks (a stalled one too: its
        // DMA may land late) must finish before they change hands.
        for (&id, j) in &self.jobs {
            if j.kind == Direction::Load && !j.done && !j.flushed {
                for b in reused {
                    assert!(
                        !j.blocks.contains(b) || plan.flush.contains(&id),
                        "block {b:?} handed over while load {id} may still write it, and not flushed"
                    );
                }
            }
        }
        for f in &plan.flush {
            if let Some(j) = self.jobs.get_mut(f) {
                j.flushed = true;
            }
        }
        for t in &plan.stores {
            for (&c, &k) in t.chunk_ids.iter().zip(t.keys.iter()) {
                assert_eq!(
                    self.slot_busy(c),
                    None,
                    "store {} writes slot {c} while busy",
                    t.job
                );
                self.slot.insert(c, (k, false));
            }
            self.add(Direction::Store, t);
        }
        for t in &plan.loads {
            for (&c, &k) in t.chunk_ids.iter().zip(t.keys.iter()) {
                assert_eq!(
                    self.slot.get(&c),
                    Some(&(k, true)),
                    "load {} reads slot {c} for {k:?}",
                    t.job
                );
                if let Some(busy) = self.slot_busy(c) {
                    let j = &self.jobs[&busy];
                    assert_eq!(
                        j.kind,
                        Direction::Load,
                        "load {} reads slot {c} being written",
                        t.job
                    );
                }
            }
            self.add(Direction::Load, t);
        }
    }

    fn add(&mut self, kind: Direction, t: &kvoffload::scheduler::TransferJob) {
        self.jobs.insert(
            t.job,
            Claim {
                kind,
                slots: t
                    .chunk_ids
                    .iter()
                    .copied()
                    .zip(t.keys.iter().copied())
                    .collect(),
                blocks: t.block_ids.to_vec(),
                reports: 0,
                failed: false,
                stalled: false,
                flushed: false,
                dropped: false,
                done: false,
            },
        );
    }

    fn on_report(&mut self, job: JobId, n: u32, failed: bool) {
        let world = self.world;
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        j.reports += n;
        j.failed |= failed;
        if j.reports < world || j.done {
            return;
        }
        j.done = true;
        if j.kind == Direction::Store && !j.failed && !j.stalled && !j.dropped {
            for &(c, k) in &j.slots.clone() {
                if let Some(entry) = self.slot.get_mut(&c)
                    && entry.0 == k
                {
                    entry.1 = true;
                }
            }
        }
    }

    fn on_stalled(&mut self, stalled: &[JobId]) {
        for j in stalled {
            let c = self.jobs.get_mut(j).expect("a stalled job was planned");
            assert!(!c.done, "{j} stalled after it ended");
            c.stalled = true;
        }
    }

    fn on_cancelled(&mut self, job: JobId) {
        if let Some(j) = self.jobs.get_mut(&job) {
            j.done = true;
        }
    }

    fn on_reset(&mut self) {
        for (&id, j) in self.jobs.iter_mut() {
            // Live jobs (not those an earlier reset dropped already).
            if !j.done && !j.stalled && !j.dropped {
                j.dropped = true;
                self.must_flush.insert(id);
            }
        }
        // The tier is empty: nothing written before the reset is readable.
        for v in self.slot.values_mut() {
            v.1 = false;
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        family: u8,
        prompt: u8,
        /// `max_load_tokens`, `max_offload_tokens` (vLLM's per-request limits).
        caps: (Option<u8>, Option<u8>),
    },
    Step {
        preempt: Option<u8>,
        finish: Option<u8>,
        abort: bool,
    },
    Report {
        pick: u8,
        count: u8,
        fail: bool,
    },
    Advance {
        secs: u16,
    },
    Scan,
    Reset,
    Cancel {
        pick: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (
            0u8..3,
            1u8..24,
            proptest::option::weighted(0.25, 0u8..40),
            proptest::option::weighted(0.25, 0u8..40),
        )
            .prop_map(|(family, prompt, load, offload)| Op::Add {
                family,
                prompt,
                caps: (load, offload),
            }),
        5 => (proptest::option::of(any::<u8>()), proptest::option::of(any::<u8>()), any::<bool>())
            .prop_map(|(preempt, finish, abort)| Op::Step { preempt, finish, abort }),
        4 => (any::<u8>(), 1u8..4, proptest::bool::weighted(0.1))
            .prop_map(|(pick, count, fail)| Op::Report { pick, count, fail }),
        1 => (0u16..400).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Scan),
        1 => Just(Op::Reset),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
    ]
}

struct Model {
    h: H,
    witness: Witness,
    /// GPU blocks; those handed out again in a step are the witness's.
    blocks: BlockPool,
    world: u32,
    tpb: u64,
    reqs: Vec<Req>,
    inflight: Vec<(JobId, u32)>,
}

impl Model {
    fn on_loads(&mut self, finished: &[RequestId], failed: &[RequestId]) {
        driver::on_loads(&mut self.reqs, finished, failed);
    }

    fn step(&mut self, preempt: Option<u8>, finish: Option<u8>, abort: bool) {
        let tpb = self.tpb;
        let mut input = StepInput::default();
        // Synchronous loads of this step: the workers finish them before
        // its compute, so they report with the step.
        let mut sync_jobs = Vec::new();
        // Admission of waiting requests.
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != ReqState::Waiting {
                continue;
            }
            let id = self.reqs[i].id;
            match self.h.lookup(id, 0) {
                LookupOutcome::Defer => {}
                LookupOutcome::Hit(n) => {
                    let sync = self.h.s.sync_load_reserved(RequestId(id));
                    let job =
                        driver::admit(&mut self.h.s, &mut self.reqs[i], &mut self.blocks, tpb, n);
                    match job {
                        // Runs in this step, past its loaded tokens.
                        Some(job) if sync => {
                            self.reqs[i].st = ReqState::Running;
                            sync_jobs.push(job);
                        }
                        Some(job) => self.inflight.push((job, self.world)),
                        None => {}
                    }
                }
            }
        }
        let running = driver::settled(&self.reqs);
        let mut skip = Vec::new();
        if let Some(i) = driver::pick(&running, preempt) {
            input.preempted.push(RequestId(self.reqs[i].id));
            driver::preempt(&mut self.reqs[i], &mut self.blocks);
            skip.push(i);
        }
        if let Some(i) = driver::pick(&running, finish).filter(|i| !skip.contains(i)) {
            let r = &mut self.reqs[i];
            driver::finish(&mut self.h.s, r, &mut self.blocks, abort, &mut input);
            skip.push(i);
        }
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != ReqState::Running || skip.contains(&i) {
                continue;
            }
            // Prefill what is left, or decode one token.
            let entry = driver::schedule(&mut self.h.s, &mut self.reqs[i], &mut self.blocks, tpb);
            input.scheduled.push(entry);
        }
        let plan = self.h.step(input);
        let reused = self.blocks.take_reused();
        self.witness.on_plan(&reused, &plan);
        assert_eq!(plan.sync_loads, sync_jobs, "the step lists its sync loads");
        for s in &plan.stores {
            self.inflight.push((s.job, self.world));
        }
        self.on_loads(&[], &plan.failed_loads);
        if !sync_jobs.is_empty() {
            let all: Vec<(JobId, u32)> = sync_jobs.iter().map(|&j| (j, self.world)).collect();
            let out = self.h.s.on_worker_output(&CompletionReport {
                completed: all,
                failed: vec![],
            });
            assert!(out.rejected.is_empty(), "{:?}", out.rejected);
            self.h.check();
            for &j in &sync_jobs {
                self.witness.on_report(j, self.world, false);
            }
        }
    }
}

fn run(ops: Vec<Op>, world: u32, chunks: u64) {
    run_with_sync_budget(ops, world, chunks, 0);
}

/// [`run`] with a sync-load budget of `sync_budget` tokens per step.
fn run_with_sync_budget(ops: Vec<Op>, world: u32, chunks: u64, sync_budget: u64) {
    let h = H::new(Geo {
        chunks,
        world,
        sync_budget,
        ..Geo::default()
    });
    let mut m = Model {
        h,
        witness: Witness {
            world,
            ..Witness::default()
        },
        blocks: BlockPool::tracking_reuse(),
        world,
        tpb: 4,
        reqs: Vec::new(),
        inflight: Vec::new(),
    };
    for op in ops {
        match op {
            Op::Add {
                family,
                prompt,
                caps: (load, offload),
            } => {
                let id = m.reqs.len() as u64;
                let prompt = u64::from(prompt);
                let r = Req::new(id, u64::from(family), prompt, m.tpb);
                m.h.s
                    .add_request(RequestId(id), prompt, &r.prompt_hashes())
                    .unwrap();
                if load.is_some() || offload.is_some() {
                    let caps = kvoffload::scheduler::RequestCaps {
                        max_load_tokens: load.map(u64::from),
                        max_offload_tokens: offload.map(u64::from),
                        ..Default::default()
                    };
                    m.h.s.set_request_caps(RequestId(id), caps).unwrap();
                }
                m.reqs.push(r);
                m.h.check();
            }
            Op::Step {
                preempt,
                finish,
                abort,
            } => m.step(preempt, finish, abort),
            Op::Report { pick, count, fail } => {
                if m.inflight.is_empty() {
                    continue;
                }
                let k = pick as usize % m.inflight.len();
                let (job, left) = m.inflight[k];
                let n = u32::from(count).min(left);
                let out = m.h.s.on_worker_output(&CompletionReport {
                    completed: vec![(job, n)],
                    failed: if fail { vec![job] } else { vec![] },
                });
                assert!(out.rejected.is_empty(), "{:?}", out.rejected);
                m.h.check();
                m.witness.on_report(job, n, fail);
                if n == left {
                    m.inflight.remove(k);
                } else {
                    m.inflight[k].1 -= n;
                }
                m.on_loads(&out.finished_loads, &out.failed_loads);
            }
            Op::Advance { secs } => m.h.advance_s(u64::from(secs)),
            Op::Scan => {
                let out = m.h.s.scan_now();
                m.h.check();
                m.witness.on_stalled(&out.stalled);
                m.on_loads(&[], &out.failed_loads);
            }
            Op::Reset => {
                m.h.s.reset().unwrap();
                m.h.check();
                m.witness.on_reset();
                for r in &mut m.reqs {
                    // Surviving requests restart their block lists at their next step.
                    if r.st == ReqState::Running {
                        r.full = true;
                    }
                }
            }
            Op::Cancel { pick } => {
                if m.inflight.is_empty() {
                    continue;
                }
                let k = pick as usize % m.inflight.len();
                let job = m.inflight[k].0;
                if m.witness
                    .jobs
                    .get(&job)
                    .is_some_and(|j| j.stalled && !j.done)
                {
                    m.h.s.confirm_cancelled(job).unwrap();
                    m.inflight.remove(k);
                    m.h.check();
                    m.witness.on_cancelled(job);
                }
            }
        }
    }
    // Drain: every outstanding report arrives, every live request finishes.
    let all: Vec<(JobId, u32)> = std::mem::take(&mut m.inflight);
    let out = m.h.s.on_worker_output(&CompletionReport {
        completed: all,
        failed: vec![],
    });
    assert!(out.rejected.is_empty(), "{:?}", out.rejected);
    m.h.check();
    let live = driver::unfinished(&m.reqs);
    for &id in &live {
        m.h.s.request_finished(RequestId(id), &[], true, 0).unwrap();
    }
    let plan = m.h.run(&[], &[], &live);
    assert!(
        plan.stores.is_empty(),
        "aborted at 0 computed tokens: nothing to store"
    );
    driver::assert_drained(&m.h.s);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn scheduler_invariants_hold_under_random_backends(
        ops in proptest::collection::vec(op(), 1..80),
        world in 1u32..3,
        chunks in prop_oneof![Just(4u64), Just(16), Just(64)],
        sync_budget in prop_oneof![Just(0u64), Just(8), Just(64)],
    ) {
        run_with_sync_budget(ops, world, chunks, sync_budget);
    }
}

#[test]
fn regression_stalled_load_then_reset() {
    use Op::*;
    let s = |p: Option<u8>| Step {
        preempt: p,
        finish: None,
        abort: false,
    };
    run(
        vec![
            Add {
                family: 0,
                prompt: 4,
                caps: (None, None),
            },
            Add {
                family: 0,
                prompt: 4,
                caps: (None, None),
            },
            s(None),
            s(None),
            Add {
                family: 0,
                prompt: 1,
                caps: (None, None),
            },
            Add {
                family: 0,
                prompt: 1,
                caps: (None, None),
            },
            Add {
                family: 0,
                prompt: 1,
                caps: (None, None),
            },
            Add {
                family: 0,
                prompt: 1,
                caps: (None, None),
            },
            s(Some(0)),
            Report {
                pick: 0,
                count: 2,
                fail: false,
            },
            s(None),
            Advance { secs: 301 },
            Scan,
            Reset,
        ],
        1,
        4,
    );
}
