//! One scheduling step (vLLM `build_connector_meta`): request updates,
//! preemption and fence flushes, store planning, finalization of finished requests.

use crate::ids::RequestId;

use super::Scheduler;
use super::store::StoreReach;
use super::types::{SchedulerError, StepInput, StepPlan};

impl Scheduler {
    /// Builds the step's plan for the workers.
    ///
    /// Validates the whole input first (unknown scheduled requests, the
    /// preemption-flush invariant) and returns an error with nothing changed.
    pub fn build_step(&mut self, input: &StepInput) -> Result<StepPlan, SchedulerError> {
        self.apply_stalls();
        for s in &input.scheduled {
            if !self.requests.contains_key(&s.req) {
                return Err(SchedulerError::UnknownRequest(s.req));
            }
        }
        self.check_preemption_flush(&input.preempted)?;

        // 1. Request updates.
        for s in &input.scheduled {
            if let Some(rs) = self.requests.get_mut(&s.req) {
                if s.full_table {
                    rs.block_ids.clear();
                }
                rs.block_ids.extend_from_slice(&s.new_block_ids);
            }
            self.batch
                .allocated
                .extend(s.new_block_ids.iter().copied().filter(|b| b.0 != 0));
        }
        // 2. Preemption flush (loads of this step excluded).
        self.preemption_flush(&input.preempted);
        // 3. Fence flush.
        if !self.fences.is_empty() {
            for b in &self.batch.allocated {
                self.batch.flush.extend_from_slice(self.fences.jobs(*b));
            }
        }
        // 4. Store planning: scheduled, then finished, in list order.
        let mut stores = Vec::new();
        for s in &input.scheduled {
            self.plan_store(
                s.req,
                StoreReach::Running {
                    computed: s.computed_tokens,
                    scheduled: s.scheduled_tokens,
                },
                &mut stores,
            );
        }
        for &req in &input.finished {
            if self
                .requests
                .get(&req)
                .is_some_and(|r| !r.finished_signaled)
            {
                self.plan_store(req, StoreReach::Finished, &mut stores);
            }
        }
        // 5. The plan.
        let mut flush = std::mem::take(&mut self.batch.flush);
        flush.sort_unstable();
        flush.dedup();
        let mut failed_loads = std::mem::take(&mut self.failed_loads);
        failed_loads.sort_unstable();
        failed_loads.dedup();
        let plan = StepPlan {
            loads: std::mem::take(&mut self.batch.loads),
            stores,
            flush,
            failed_loads,
        };
        // 6. Finished requests: the manager hears it once, after their last store.
        for &req in &input.finished {
            self.finalize_finished(req);
        }
        // 7. Per-step state.
        self.batch.allocated.clear();
        Ok(plan)
    }

    fn finalize_finished(&mut self, req: RequestId) {
        let Some(rs) = self.requests.get_mut(&req) else {
            return;
        };
        if rs.finish.is_none() {
            tracing::debug!(%req, "listed as finished without request_finished");
            rs.finish = Some(super::request::FinishInfo {
                aborted: false,
                computed_tokens: 0,
            });
        }
        rs.finished_signaled = true;
        if !rs.manager_finished {
            rs.manager_finished = true;
            self.manager.request_finished(req);
            self.counters.manager_request_finished += 1;
        }
        if rs.jobs.is_empty() {
            self.requests.remove(&req);
        }
    }
}
