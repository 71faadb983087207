//! A decode-only serving backend for the scheduler benchmarks: `running`
//! requests each generate one token per step; a request plans a store whenever
//! it completes a block. Only `build_step` is timed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvoffload::manager::StoreOutcome;
use kvoffload::scheduler::{CompletionReport, ScheduledRequest, Scheduler, StepInput, StepPlan};
use kvoffload::{BlockHash, ChunkKey, GpuBlockId, OffloadConfig, RequestId, SharedClock};

/// `running` decoding requests over a host tier of `chunks` chunks.
pub struct Decode {
    /// The scheduler under test.
    pub s: Scheduler,
    /// Tokens per block (1 chunk = 1 block).
    pub tpb: u64,
    /// Tokens of each request so far.
    pub tokens: Vec<u64>,
    next_block: u32,
    input: StepInput,
}

impl Decode {
    /// `tpb` tokens per block: with tpb = 16, 1/16 of the requests complete a
    /// block in each step; with tpb = 1, all of them do.
    pub fn new(
        running: u64,
        tpb: u32,
        clock: SharedClock,
        scan_interval_ms: u64,
        chunks: u64,
    ) -> Self {
        let cfg = OffloadConfig {
            tokens_per_block: tpb,
            blocks_per_chunk: 1,
            offload_prompt_only: false,
            stall_scan_interval_ms: scan_interval_ms,
            ..OffloadConfig::with_chunks(chunks)
        };
        let mut s = Scheduler::new(&cfg, clock).expect("scheduler");
        let tpb = u64::from(tpb);
        let mut tokens = Vec::new();
        let mut input = StepInput::default();
        for r in 0..running {
            // Staggered so that block completions spread evenly over steps.
            let t = r % tpb;
            s.add_request(RequestId(r), t.max(1), &[]).unwrap();
            s.lookup(RequestId(r), 0).unwrap();
            s.on_alloc(RequestId(r), &[], 0).unwrap();
            tokens.push(t);
            input.scheduled.push(ScheduledRequest {
                req: RequestId(r),
                new_block_ids: Vec::with_capacity(1),
                computed_tokens: t,
                scheduled_tokens: 1,
                full_table: false,
            });
        }
        Self {
            s,
            tpb,
            tokens,
            next_block: 1,
            input,
        }
    }

    /// Fills the host tier with `n` chunks that no request holds (stored
    /// through the manager in batches), so that every later store evicts.
    pub fn fill_tier(&mut self, n: u64) {
        const BATCH: u64 = 4096;
        let mut keys = Vec::with_capacity(BATCH as usize);
        let mut next = 0u64;
        while next < n {
            keys.clear();
            // Keys far from the requests' own (request << 40 | tokens).
            keys.extend((next..n.min(next + BATCH)).map(|i| ChunkKey(u64::MAX - i)));
            next += keys.len() as u64;
            let m = self.s.manager_mut();
            let plan = m.prepare_store(&keys, None).expect("room in the tier");
            m.complete_store(&plan.keys_to_store, StoreOutcome::Success, None)
                .expect("completes");
        }
        black_box(self.s.take_events());
    }

    /// Untimed: each request has one more token; a completed block gets its hash
    /// and a new GPU block is allocated for the next one.
    pub fn prepare(&mut self) {
        for (i, e) in self.input.scheduled.iter_mut().enumerate() {
            let r = RequestId(i as u64);
            e.new_block_ids.clear();
            let t = self.tokens[i];
            if t.is_multiple_of(self.tpb) {
                e.new_block_ids.push(GpuBlockId(self.next_block));
                self.next_block = self.next_block.wrapping_add(1).max(1);
            }
            e.computed_tokens = t;
            let n = t + 1;
            let hash: &[BlockHash] = if n.is_multiple_of(self.tpb) {
                &[BlockHash((i as u64) << 40 | n)][..]
            } else {
                &[]
            };
            let h = hash.to_vec();
            self.s.update_request(r, n, &h).unwrap();
            self.tokens[i] = n;
        }
    }

    /// One step's plan.
    pub fn step(&mut self) -> StepPlan {
        self.s.build_step(&self.input).unwrap()
    }

    /// The plan's stores complete; events are drained and the plan recycled
    /// (as the sim does).
    pub fn complete(&mut self, plan: StepPlan) {
        let report = CompletionReport {
            completed: plan.stores.iter().map(|j| (j.job, 1)).collect(),
            failed: vec![],
        };
        self.s.on_worker_output(&report);
        black_box(self.s.take_events());
        self.s.recycle_plan(plan);
    }

    /// Timed steps (only `build_step` is timed); stores complete and events
    /// are drained untimed, and a watchdog scan runs untimed every 100 steps
    /// (as the thread would every scan interval), which keeps the deadline
    /// queue short.
    pub fn timed_steps(&mut self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        let watchdog = self.s.watchdog_handle();
        for i in 0..iters {
            if i % 100 == 0 {
                watchdog.scan();
            }
            self.prepare();
            let t0 = Instant::now();
            let plan = black_box(self.step());
            total += t0.elapsed();
            self.complete(plan);
        }
        total
    }
}
