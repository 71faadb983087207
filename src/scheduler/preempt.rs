//! Preemption flush and cache reset (vLLM `reset_cache`).

use crate::ids::{JobId, RequestId};

use super::types::{JobKind, SchedulerError};
use super::{FencedReset, Scheduler};

impl Scheduler {
    fn is_current_load(&self, job: JobId) -> bool {
        self.batch.loads.iter().any(|l| l.job == job)
    }

    /// Invariant D.3 at a preemption flush: apart from loads created in this
    /// step, a preempted request's pending jobs must all be stores.
    pub(crate) fn check_preemption_flush(
        &self,
        preempted: &[RequestId],
    ) -> Result<(), SchedulerError> {
        for &req in preempted {
            let Some(rs) = self.requests.get(&req) else {
                continue;
            };
            for &job in &rs.jobs {
                if self.is_current_load(job) {
                    continue;
                }
                let kind = self.jobs.get(job).map(|e| e.kind);
                if kind != Some(JobKind::Store) {
                    return Err(SchedulerError::PreemptedWithPendingLoad {
                        req,
                        job,
                        kind: kind.map_or("unknown", JobKind::as_str),
                    });
                }
            }
        }
        Ok(())
    }

    /// The pending stores of preempted requests go to the flush set; loads
    /// created in this step (same-step resume) stay in flight.
    pub(crate) fn preemption_flush(&mut self, preempted: &[RequestId]) {
        for &req in preempted {
            let Some(rs) = self.requests.get(&req) else {
                continue;
            };
            for &job in &rs.jobs {
                if !self.batch.loads.iter().any(|l| l.job == job) {
                    self.batch.flush.push(job);
                }
            }
        }
    }

    /// Resets the host tier (vLLM `reset_cache`).
    ///
    /// Every live job goes to the next step's flush set and to the reset fence
    /// (reports for jobs created before the reset are then counted there only;
    /// the manager hears `on_reset_flushed` when it drains). Finished requests
    /// are finalized (the manager's `request_finished` if they had not had it)
    /// and dropped; surviving requests re-offer every chunk and forget their jobs.
    ///
    /// Stalled jobs are not added to the reset fence (they may never report).
    /// A stalled load's state is dropped: the manager's reset unpins everything.
    /// A stalled store keeps its quarantined host slots (the manager's reset
    /// keeps them held) until its late reports arrive or its cancellation is
    /// confirmed; its GPU fences are dropped (a late read of a reused GPU block
    /// can only land in its quarantined slot).
    pub fn reset(&mut self) -> Result<(), SchedulerError> {
        self.apply_stalls();
        if !self.batch.loads.is_empty() {
            return Err(SchedulerError::ResetMidStep);
        }
        let mut live: Vec<(JobId, FencedReset)> = Vec::with_capacity(self.jobs.len());
        self.jobs.for_each(|id, e| {
            live.push((
                id,
                FencedReset {
                    remaining: e.pending,
                    load_req: (e.kind == JobKind::Load).then_some(e.req),
                },
            ));
        });
        live.sort_unstable_by_key(|(id, _)| *id);
        self.batch.flush.extend(live.iter().map(|(id, _)| *id));
        let mut finished: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.finish.is_some())
            .map(|(id, _)| *id)
            .collect();
        finished.sort_unstable();
        for req in finished {
            if let Some(rs) = self.requests.remove(&req)
                && !rs.manager_finished
            {
                self.manager.request_finished(req);
                self.counters.manager_request_finished += 1;
            }
        }
        self.manager.reset();
        for rs in self.requests.values_mut() {
            rs.next_stored_chunk = 0;
            rs.jobs.clear();
        }
        self.stale_threshold = self.next_job;
        self.reset_fence.extend(live);
        self.jobs.clear();
        self.fences.clear();
        self.being_loaded.clear();
        self.stalled
            .retain(|_, s| s.kind == JobKind::Store && !s.chunk_ids.is_empty());
        for s in self.stalled.values_mut() {
            s.fenced = false;
            s.blocks = Box::default();
        }
        self.watch.reset_schedule();
        if self.reset_fence.is_empty() {
            self.manager.on_reset_flushed();
        }
        Ok(())
    }
}
