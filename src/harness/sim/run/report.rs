//! The end of a run: cancellations still due, leak counts from the engine's
//! state, rates and step-time percentiles.

use serde_json::json;

use crate::harness::sim::WorkerCommand;
use crate::ids::JobId;

use super::super::summary::{Held, Leaks, StepTimes};
use super::{Sim, SimError, SimOutput};

impl Sim {
    pub(super) fn finish(mut self) -> Result<SimOutput, SimError> {
        // Anything still stalled is cancelled by the backend.
        let due: Vec<JobId> = self.due.drain(..).map(|(_, j, _)| j).collect();
        for job in due {
            self.cancel(job)?;
        }
        // Their workers drop them (and run the content checks still due):
        // one more worker step, with nothing planned.
        if self.cancels.iter().any(|c| !c.is_empty()) || !self.content_checks.is_empty() {
            let content = self.content_ops(Vec::new());
            let cmds = std::mem::take(&mut self.cancels)
                .into_iter()
                .zip(content)
                .map(|(cancel, content)| WorkerCommand {
                    cancel,
                    content,
                    ..WorkerCommand::default()
                })
                .collect();
            let out = self.pool.step(cmds)?;
            self.content_results(&out.content);
            self.worker_jobs = out.tracked_jobs;
        }
        self.rec.call(|| json!({"op": "state"}));
        let (l, invariant) = self.leaks();
        let m = self.sched.metrics();
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
        let ns = &self.step_ns;
        s.step_time = StepTimes {
            steps: ns.count(),
            p50_us: ns.percentile(50.0) as f64 / 1e3,
            p99_us: ns.percentile(99.0) as f64 / 1e3,
            max_us: ns.max() as f64 / 1e3,
        };
        let decisions = self.rec.finish()?;
        Ok(SimOutput {
            summary: self.summary,
            decisions,
        })
    }

    /// The engine's, the workers' and the simulated backend's state, counted
    /// as leaks (all zero after a clean drain), and the invariant violation.
    fn leaks(&self) -> (Leaks, Option<String>) {
        let st = self.sched.state();
        let invariant = self.sched.check_invariants().err();
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
            worker_jobs: self.worker_jobs,
            sim_jobs: (self.jobs.len()
                + self.stall_faulted.len()
                + self.open_stalls.len()
                + self.due.len()) as u64,
            invariant_violations: u64::from(invariant.is_some()),
            remote_state: self.sched.remote_probes() as u64,
            total: 0,
        };
        l.total = l.fields().iter().map(|&(_, n)| n).sum();
        (l, invariant)
    }

    /// What the run holds now (for a run that stops without finishing).
    pub(super) fn held(&self) -> Held {
        let (engine, invariant_error) = self.leaks();
        Held {
            step: self.step,
            finished: self.summary.work.finished,
            waiting: self.waiting.len() as u64,
            running: self.running.len() as u64,
            loading: self.loading.len() as u64,
            engine,
            invariant_error,
        }
    }
}
