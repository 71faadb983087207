//! Test harness: a scheduler on a manual clock, checked after every hook.
#![allow(dead_code)]

pub mod driver;
pub mod memory_tier;
pub mod rng;
pub mod trace_rec;

use std::time::Duration;

use kvoffload::manager::{LookupResult, StoreOutcome};
use kvoffload::scheduler::{
    CompletionReport, LookupOutcome, ScheduledRequest, Scheduler, StepInput, StepPlan,
    WorkerOutcome,
};
use kvoffload::{BlockHash, ChunkKey, GpuBlockId, JobId, ManualClock, OffloadConfig, RequestId};

/// Geometry of a test.
pub struct Geo {
    pub tpb: u32,
    pub bpc: u32,
    pub chunks: u64,
    pub world: u32,
    pub prompt_only: bool,
    /// The step's sync-load budget, in tokens (one byte per token); 0: off.
    pub sync_budget: u64,
}

impl Default for Geo {
    fn default() -> Self {
        Self {
            tpb: 4,
            bpc: 1,
            chunks: 64,
            world: 1,
            prompt_only: false,
            sync_budget: 0,
        }
    }
}

pub struct H {
    pub s: Scheduler,
    pub clock: ManualClock,
    pub tpb: u64,
    pub bpc: u64,
}

pub fn r(n: u64) -> RequestId {
    RequestId(n)
}

pub fn b(ids: impl IntoIterator<Item = u32>) -> Vec<GpuBlockId> {
    ids.into_iter().map(GpuBlockId).collect()
}

/// Block hashes of a prefix family: block i of family f hashes to f*1000 + i + 1.
pub fn hashes(family: u64, range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(|i| BlockHash(family * 1000 + i + 1)).collect()
}

/// The chunk key of chunk i of family f.
pub fn key(family: u64, chunk: u64, bpc: u64) -> ChunkKey {
    ChunkKey(family * 1000 + (chunk + 1) * bpc)
}

pub fn jobs_of(plan: &[kvoffload::scheduler::TransferJob]) -> Vec<JobId> {
    plan.iter().map(|j| j.job).collect()
}

impl H {
    pub fn new(g: Geo) -> Self {
        let cfg = OffloadConfig {
            tokens_per_block: g.tpb,
            blocks_per_chunk: g.bpc,
            world_size: g.world,
            offload_prompt_only: g.prompt_only,
            sync_load_budget_bytes: g.sync_budget,
            sync_load_bytes_per_token: Some(1),
            ..OffloadConfig::with_chunks(g.chunks)
        };
        let (s, clock) = driver::scheduler_on_manual_clock(&cfg);
        Self {
            s,
            clock,
            tpb: u64::from(g.tpb),
            bpc: u64::from(g.bpc),
        }
    }

    pub fn check(&self) {
        if let Err(e) = self.s.check_invariants() {
            panic!("invariant violated: {e}");
        }
    }

    /// Adds request `id` of prefix family `family` with `prompt` tokens.
    pub fn add(&mut self, id: u64, family: u64, prompt: u64) {
        let full = prompt / self.tpb;
        self.s
            .add_request(r(id), prompt, &hashes(family, 0..full))
            .expect("add_request");
        self.check();
    }

    /// Grows request `id` (family `family`) to `num_tokens`, hashing new full blocks.
    pub fn grow(&mut self, id: u64, family: u64, old_tokens: u64, num_tokens: u64) {
        let h = hashes(family, old_tokens / self.tpb..num_tokens / self.tpb);
        self.s
            .update_request(r(id), num_tokens, &h)
            .expect("update");
        self.check();
    }

    pub fn lookup(&mut self, id: u64, computed: u64) -> LookupOutcome {
        // Mid-step: the per-step state is not empty yet, so no full check here.
        self.s.lookup(r(id), computed).expect("lookup")
    }

    pub fn alloc(&mut self, id: u64, blocks: &[GpuBlockId], external: u64) -> Option<JobId> {
        self.s.on_alloc(r(id), blocks, external).expect("alloc")
    }

    pub fn step(&mut self, input: StepInput) -> StepPlan {
        let plan = self.s.build_step(&input).expect("step");
        self.check();
        plan
    }

    /// A step scheduling `(req, new blocks, computed, scheduled)` entries.
    pub fn run(
        &mut self,
        scheduled: &[(u64, Vec<GpuBlockId>, u64, u64)],
        preempted: &[u64],
        finished: &[u64],
    ) -> StepPlan {
        self.step(StepInput {
            scheduled: scheduled
                .iter()
                .map(|(id, blocks, c, n)| ScheduledRequest {
                    req: r(*id),
                    new_block_ids: blocks.clone(),
                    computed_tokens: *c,
                    scheduled_tokens: *n,
                    full_table: false,
                })
                .collect(),
            preempted: preempted.iter().map(|&i| r(i)).collect(),
            finished: finished.iter().map(|&i| r(i)).collect(),
            ..StepInput::default()
        })
    }

    pub fn report(&mut self, completed: &[(JobId, u32)]) -> WorkerOutcome {
        let out = self.s.on_worker_output(&CompletionReport {
            completed: completed.to_vec(),
            failed: vec![],
        });
        assert!(out.rejected.is_empty(), "rejected: {:?}", out.rejected);
        self.check();
        out
    }

    /// Every worker reports every listed job.
    pub fn complete(&mut self, jobs: &[JobId], world: u32) -> WorkerOutcome {
        let c: Vec<(JobId, u32)> = jobs.iter().map(|&j| (j, world)).collect();
        self.report(&c)
    }

    pub fn finish(&mut self, id: u64, blocks: &[GpuBlockId]) {
        self.s
            .request_finished(r(id), blocks, false, 0)
            .expect("request_finished");
        self.check();
    }

    pub fn abort(&mut self, id: u64, blocks: &[GpuBlockId], computed: u64) {
        self.s
            .request_finished(r(id), blocks, true, computed)
            .expect("request_finished");
        self.check();
    }

    /// Stores `keys` in the host tier directly (prepared, then completed).
    pub fn cache(&mut self, keys: &[ChunkKey]) {
        let m = self.s.manager_mut();
        m.prepare_store(keys, None).expect("prepare_store");
        m.complete_store(keys, StoreOutcome::Success, None)
            .expect("complete_store");
    }

    pub fn lookup_key(&self, k: ChunkKey) -> LookupResult {
        self.s.manager().lookup(k)
    }

    pub fn advance_s(&self, s: u64) {
        self.clock.advance(Duration::from_secs(s));
    }
}
