//! A scheduler wrapper that records every hook it forwards as a trace line
//! (`docs/trace-format.md`), so that a failing test case can be written out and
//! replayed with `kvoffload replay`.

use std::time::Duration;

use kvoffload::scheduler::{
    CompletionReport, LookupOutcome, ScanOutcome, Scheduler, SchedulerError, StepInput, StepPlan,
    WorkerOutcome,
};
use kvoffload::{BlockHash, GpuBlockId, JobId, ManualClock, OffloadConfig, RequestId};
use serde_json::{Value, json};

/// The scheduler on a manual clock, plus the trace of every call made through it.
pub struct Rec {
    pub s: Scheduler,
    pub clock: ManualClock,
    pub lines: Vec<String>,
}

fn req(r: RequestId) -> Value {
    json!(format!("r{}", r.0))
}

fn blocks(b: &[GpuBlockId]) -> Value {
    Value::from(b.iter().map(|b| b.0).collect::<Vec<_>>())
}

fn hashes(h: &[BlockHash]) -> Value {
    Value::from(h.iter().map(|h| h.0).collect::<Vec<_>>())
}

impl Rec {
    /// A scheduler for `cfg`; the trace header carries the keys the replay needs.
    pub fn new(cfg: &OffloadConfig) -> Self {
        let (s, clock) = super::driver::scheduler_on_manual_clock(cfg);
        let header = json!({
            "kvoffload_trace": 1,
            "config": {
                "tokens_per_block": cfg.tokens_per_block,
                "blocks_per_chunk": cfg.blocks_per_chunk,
                "num_cpu_chunks": cfg.num_cpu_chunks,
                "world_size": cfg.world_size,
                "offload_prompt_only": cfg.offload_prompt_only,
                "stall_timeout_ms": cfg.stall_timeout_ms,
                "stall_scan_interval_ms": cfg.stall_scan_interval_ms,
            }
        });
        Self {
            s,
            clock,
            lines: vec![header.to_string()],
        }
    }

    fn rec(&mut self, v: Value) {
        self.lines.push(v.to_string());
    }

    /// The trace so far, one JSON line each.
    pub fn trace(&self) -> String {
        let mut t = self.lines.join("\n");
        t.push('\n');
        t
    }

    pub fn add_request(
        &mut self,
        r: RequestId,
        prompt: u64,
        h: &[BlockHash],
    ) -> Result<(), SchedulerError> {
        self.rec(json!({"op": "add_request", "req": req(r), "prompt_tokens": prompt, "block_hashes": hashes(h)}));
        self.s.add_request(r, prompt, h)
    }

    pub fn update_request(
        &mut self,
        r: RequestId,
        num_tokens: u64,
        h: &[BlockHash],
    ) -> Result<(), SchedulerError> {
        self.rec(json!({"op": "update_request", "req": req(r), "num_tokens": num_tokens, "block_hashes": hashes(h)}));
        self.s.update_request(r, num_tokens, h)
    }

    pub fn lookup(&mut self, r: RequestId, computed: u64) -> Result<LookupOutcome, SchedulerError> {
        self.rec(json!({"op": "lookup", "req": req(r), "computed_tokens": computed}));
        self.s.lookup(r, computed)
    }

    pub fn on_alloc(
        &mut self,
        r: RequestId,
        b: &[GpuBlockId],
        external: u64,
    ) -> Result<Option<JobId>, SchedulerError> {
        self.rec(json!({"op": "alloc", "req": req(r), "block_ids": blocks(b), "external_tokens": external}));
        self.s.on_alloc(r, b, external)
    }

    pub fn build_step(&mut self, input: &StepInput) -> Result<StepPlan, SchedulerError> {
        let scheduled: Vec<Value> = input
            .scheduled
            .iter()
            .map(|s| {
                json!({"req": req(s.req), "new_block_ids": blocks(&s.new_block_ids),
                       "computed_tokens": s.computed_tokens, "scheduled_tokens": s.scheduled_tokens,
                       "full_table": s.full_table})
            })
            .collect();
        let pre: Vec<Value> = input.preempted.iter().map(|&r| req(r)).collect();
        let fin: Vec<Value> = input.finished.iter().map(|&r| req(r)).collect();
        self.rec(json!({"op": "step", "scheduled": scheduled, "preempted": pre, "finished": fin}));
        self.s.build_step(input)
    }

    /// Worker reports; each job appears at most once in `completed`.
    pub fn on_worker_output(&mut self, report: &CompletionReport) -> WorkerOutcome {
        let mut completed = serde_json::Map::new();
        for &(j, n) in &report.completed {
            completed.insert(j.0.to_string(), json!(n));
        }
        let failed: Vec<u64> = report.failed.iter().map(|j| j.0).collect();
        self.rec(json!({"op": "worker_output", "completed": completed, "failed": failed}));
        self.s.on_worker_output(report)
    }

    pub fn request_finished(
        &mut self,
        r: RequestId,
        b: &[GpuBlockId],
        aborted: bool,
        computed: u64,
    ) -> Result<(), SchedulerError> {
        self.rec(
            json!({"op": "request_finished", "req": req(r), "block_ids": blocks(b),
                        "aborted": aborted, "computed_tokens": computed}),
        );
        self.s.request_finished(r, b, aborted, computed)
    }

    pub fn reset(&mut self) -> Result<(), SchedulerError> {
        self.rec(json!({"op": "reset"}));
        self.s.reset()
    }

    pub fn advance_ms(&mut self, ms: u64) {
        self.rec(json!({"op": "advance", "ms": ms}));
        self.clock.advance(Duration::from_millis(ms));
    }

    pub fn scan(&mut self) -> ScanOutcome {
        self.rec(json!({"op": "scan"}));
        self.s.scan_now()
    }

    pub fn confirm_cancelled(&mut self, job: JobId) -> Result<(), SchedulerError> {
        self.rec(json!({"op": "confirm_cancelled", "job": job.0}));
        self.s.confirm_cancelled(job)
    }

    /// Drains the host tier's events (a serving backend does it every step).
    pub fn take_events(&mut self) -> Vec<kvoffload::manager::OffloadEvent> {
        self.rec(json!({"op": "events"}));
        self.s.take_events()
    }

    /// Records a `state` line (no effect; shows the counts when replayed).
    pub fn state_line(&mut self) {
        self.rec(json!({"op": "state"}));
    }

    /// Writes the trace to `$CARGO_TARGET_TMPDIR/<dir>/<name>.jsonl` and returns the path.
    pub fn write(&self, dir: &str, name: &str) -> std::path::PathBuf {
        let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(dir);
        std::fs::create_dir_all(&d).expect("trace dir");
        let p = d.join(format!("{name}.jsonl"));
        std::fs::write(&p, self.trace()).expect("write trace");
        p
    }
}

impl super::driver::Hooks for Rec {
    fn lookup(&mut self, r: RequestId, computed: u64) -> LookupOutcome {
        Rec::lookup(self, r, computed).expect("lookup")
    }

    fn on_alloc(&mut self, r: RequestId, b: &[GpuBlockId], external: u64) -> Option<JobId> {
        Rec::on_alloc(self, r, b, external).expect("alloc")
    }

    fn update_request(&mut self, r: RequestId, num_tokens: u64, h: &[BlockHash]) {
        Rec::update_request(self, r, num_tokens, h).expect("update");
    }

    fn request_finished(&mut self, r: &super::driver::Req, aborted: bool) {
        Rec::request_finished(self, r.rid(), &r.blocks, aborted, r.computed)
            .expect("request_finished");
    }
}
