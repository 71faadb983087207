//! Property test of [`Scheduler::store_horizon`]'s promise: a running request
//! listed with no new blocks, not as a full table, and with computed plus
//! scheduled tokens below its horizon may be left out of the step's input
//! without changing anything.
//!
//! Two schedulers get the same hooks (admission with prefix hits and loads,
//! prefill, decode, preemption, finish, abort, worker reports, resets); one
//! is given every scheduled request, the other only those its cached
//! horizons do not rule out (cached after each step that listed the request,
//! forgotten at its lookup and at every reset, as the vLLM binding does),
//! with and without vLLM's `offload_prompt_only`. Every
//! lookup, load, plan and report outcome must be the same, and the requests
//! left out must be most of a decode step's, or the test proves nothing.

#[path = "common/driver.rs"]
mod driver;

use std::collections::HashMap;

use driver::{BlockPool, Hooks, Req, ReqState};
use kvoffload::scheduler::{CompletionReport, LookupOutcome, Scheduler, StepInput};
use kvoffload::{BlockHash, GpuBlockId, JobId, OffloadConfig, RequestId};
use proptest::prelude::*;

/// The same hooks on both schedulers, their answers compared.
struct Pair {
    full: Scheduler,
    lean: Scheduler,
    /// The lean scheduler's horizons, by request, as a caller caches them.
    horizons: HashMap<RequestId, u64>,
}

impl Hooks for Pair {
    fn lookup(&mut self, req: RequestId, computed: u64) -> LookupOutcome {
        let a = self.full.lookup(req, computed).expect("lookup");
        let b = self.lean.lookup(req, computed).expect("lookup");
        assert_eq!(a, b, "lookup of {req}");
        // A lookup restarts its request: its cached horizon may be too high.
        self.horizons.remove(&req);
        a
    }

    fn on_alloc(&mut self, req: RequestId, blocks: &[GpuBlockId], external: u64) -> Option<JobId> {
        let a = self.full.on_alloc(req, blocks, external).expect("alloc");
        let b = self.lean.on_alloc(req, blocks, external).expect("alloc");
        assert_eq!(a, b, "allocation of {req}");
        a
    }

    fn update_request(&mut self, req: RequestId, tokens: u64, hashes: &[BlockHash]) {
        self.full
            .update_request(req, tokens, hashes)
            .expect("update");
        self.lean
            .update_request(req, tokens, hashes)
            .expect("update");
    }

    fn request_finished(&mut self, r: &Req, aborted: bool) {
        for s in [&mut self.full, &mut self.lean] {
            s.request_finished(r.rid(), &r.blocks, aborted, r.computed)
                .expect("request_finished");
        }
    }
}

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
    /// Every job in flight reports (successfully, or `fail` for loads).
    ReportAll {
        fail: bool,
    },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0u8..3, 0u8..40).prop_map(|(family, prompt)| Op::Add { family, prompt }),
        8 => (
            proptest::option::weighted(0.1, any::<u8>()),
            proptest::option::weighted(0.1, any::<u8>()),
            any::<bool>()
        )
            .prop_map(|(preempt, finish, abort)| Op::Step { preempt, finish, abort }),
        3 => any::<bool>().prop_map(|fail| Op::ReportAll { fail }),
        1 => Just(Op::Reset),
    ]
}

struct Run {
    h: Pair,
    reqs: Vec<Req>,
    pool: BlockPool,
    tpb: u64,
    inflight: Vec<JobId>,
    /// Scheduled entries given to the full scheduler, and to the lean one.
    listed: (usize, usize),
}

impl Run {
    fn step(&mut self, preempt: Option<u8>, finish: Option<u8>, abort: bool) {
        let tpb = self.tpb;
        let mut input = StepInput::default();
        for i in 0..self.reqs.len() {
            if self.reqs[i].st != ReqState::Waiting {
                continue;
            }
            let id = self.reqs[i].rid();
            if let LookupOutcome::Hit(n) = self.h.lookup(id, 0)
                && let Some(job) =
                    driver::admit(&mut self.h, &mut self.reqs[i], &mut self.pool, tpb, n)
            {
                self.inflight.push(job);
            }
        }
        let running = driver::settled(&self.reqs);
        let mut skip = Vec::new();
        if let Some(i) = driver::pick(&running, preempt) {
            input.preempted.push(self.reqs[i].rid());
            driver::preempt(&mut self.reqs[i], &mut self.pool);
            skip.push(i);
        }
        if let Some(i) = driver::pick(&running, finish).filter(|i| !skip.contains(i)) {
            let r = &mut self.reqs[i];
            driver::finish(&mut self.h, r, &mut self.pool, abort, &mut input);
            skip.push(i);
        }
        for i in 0..self.reqs.len() {
            if self.reqs[i].st == ReqState::Running && !skip.contains(&i) {
                let entry = driver::schedule(&mut self.h, &mut self.reqs[i], &mut self.pool, tpb);
                input.scheduled.push(entry);
            }
        }
        let mut lean = input.clone();
        let horizons = &self.h.horizons;
        lean.scheduled.retain(|s| {
            s.full_table
                || !s.new_block_ids.is_empty()
                || s.computed_tokens + s.scheduled_tokens
                    >= horizons.get(&s.req).copied().unwrap_or(0)
        });
        self.listed.0 += input.scheduled.len();
        self.listed.1 += lean.scheduled.len();
        let a = self.h.full.build_step(&input).expect("step");
        let b = self.h.lean.build_step(&lean).expect("step");
        assert_eq!(a, b, "plans differ");
        for s in &lean.scheduled {
            if let Some(h) = self.h.lean.store_horizon(s.req) {
                self.h.horizons.insert(s.req, h);
            }
        }
        self.inflight
            .extend(a.loads.iter().chain(&a.stores).map(|j| j.job));
        self.inflight.extend(&a.flush);
        self.inflight.sort_unstable();
        self.inflight.dedup();
    }

    fn report_all(&mut self, fail: bool) {
        let live: Vec<JobId> = std::mem::take(&mut self.inflight)
            .into_iter()
            .filter(|&j| self.h.full.is_job_live(j))
            .collect();
        let report = CompletionReport {
            completed: live.iter().map(|&j| (j, 1)).collect(),
            failed: if fail { live.clone() } else { Vec::new() },
        };
        let a = self.h.full.on_worker_output(&report);
        let b = self.h.lean.on_worker_output(&report);
        assert_eq!(a, b, "report outcomes differ");
        driver::on_loads(self.reqs.iter_mut(), &a.finished_loads, &a.failed_loads);
    }
}

fn run(ops: Vec<Op>, tpb: u32, bpc: u32, prompt_only: bool) -> (usize, usize) {
    let cfg = OffloadConfig {
        tokens_per_block: tpb,
        blocks_per_chunk: bpc,
        offload_prompt_only: prompt_only,
        ..OffloadConfig::with_chunks(64)
    };
    let (full, _c1) = driver::scheduler_on_manual_clock(&cfg);
    let (lean, _c2) = driver::scheduler_on_manual_clock(&cfg);
    let mut m = Run {
        h: Pair {
            full,
            lean,
            horizons: HashMap::new(),
        },
        reqs: Vec::new(),
        pool: BlockPool::default(),
        tpb: u64::from(tpb),
        inflight: Vec::new(),
        listed: (0, 0),
    };
    for op in ops {
        match op {
            Op::Add { family, prompt } => {
                let id = m.reqs.len() as u64;
                let r = Req::new(id, u64::from(family), u64::from(prompt) + 1, m.tpb);
                for s in [&mut m.h.full, &mut m.h.lean] {
                    s.add_request(r.rid(), r.prompt, &r.prompt_hashes())
                        .expect("add");
                }
                m.reqs.push(r);
            }
            Op::Step {
                preempt,
                finish,
                abort,
            } => m.step(preempt, finish, abort),
            Op::ReportAll { fail } => m.report_all(fail),
            Op::Reset => {
                m.h.full.reset().expect("reset");
                m.h.lean.reset().expect("reset");
                m.h.horizons.clear();
            }
        }
        assert_eq!(m.h.full.state(), m.h.lean.state(), "states differ");
    }
    m.listed
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn leaving_out_requests_below_their_store_horizon_changes_nothing(
        ops in proptest::collection::vec(op(), 1..120),
        tpb in prop_oneof![Just(1u32), Just(2), Just(4)],
        bpc in 1u32..4,
        prompt_only in any::<bool>(),
    ) {
        run(ops, tpb, bpc, prompt_only);
    }
}

/// A steady decode: the lean scheduler is given only the requests that
/// complete a chunk (or carry new blocks), about one step in `tokens per
/// chunk` per request (none once the prompt is stored under
/// `offload_prompt_only`) besides the steps that give it a new block, and
/// still plans the same.
#[test]
fn a_decode_lists_only_the_requests_completing_a_chunk() {
    for prompt_only in [false, true] {
        let (full, lean) = run(decode_ops(), 8, 1, prompt_only);
        assert!(full > 400, "{full} entries listed");
        // New blocks (one step in 8 here) are always listed.
        assert!(
            lean < full / 5,
            "prompt only {prompt_only}: the lean scheduler was given {lean} of {full} entries"
        );
    }
}

/// Eight requests decoding 64 steps, every job reporting after each step.
fn decode_ops() -> Vec<Op> {
    let mut ops: Vec<Op> = (0..8)
        .map(|i| Op::Add {
            family: i,
            prompt: 9,
        })
        .collect();
    for _ in 0..64 {
        ops.push(Op::Step {
            preempt: None,
            finish: None,
            abort: false,
        });
        ops.push(Op::ReportAll { fail: false });
    }
    ops
}
