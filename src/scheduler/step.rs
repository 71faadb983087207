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
        self.last_partial_tails.clear();
        // A scheduled request that is already finished (abnormal) needs the
        // two-pass order; otherwise each request is updated and planned in one
        // map lookup, which gives the same result.
        let mut slots = std::mem::take(&mut self.batch.slots);
        let any_finished = match self
            .requests
            .resolve_scheduled(input.scheduled.iter().map(|s| s.req), &mut slots)
        {
            Ok(any_finished) => any_finished,
            Err(req) => {
                self.batch.slots = slots;
                return Err(SchedulerError::UnknownRequest(req));
            }
        };
        let one_pass = !any_finished;
        let groups = if input.group_block_ids.is_empty() {
            Ok(())
        } else {
            self.check_group_blocks(input)
        };
        if let Err(e) = groups.and_then(|()| self.check_preemption_flush(&input.preempted)) {
            self.batch.slots = slots;
            return Err(e);
        }

        // 1. Preemption flush (loads of this step excluded). Block updates do not
        //    change job sets, so it may come first.
        self.preemption_flush(&input.preempted);
        // A recycled buffer, or one sized like the last step's plan: no
        // allocation or regrowth in steady state.
        let mut stores = std::mem::take(&mut self.batch.spare_stores);
        stores.reserve(self.batch.last_stores);
        if self.groups.is_some() {
            // 2 to 4 over several KV groups.
            self.update_group_blocks(input, &slots);
            self.fence_flush();
            // Recurrent states handed over, before the other stores (vLLM).
            self.plan_boundary_stores(input, &mut stores);
            self.plan_partial_tail_stores(&input.boundary_states, &input.scheduled, &mut stores);
            for (s, &slot) in input.scheduled.iter().zip(&slots) {
                let reach = StoreReach::Running {
                    computed: s.computed_tokens,
                    scheduled: s.scheduled_tokens,
                };
                self.plan_store_groups(slot, s.req, reach, &mut stores);
            }
        } else if one_pass {
            // 2 and 4. Request updates and their store planning, in list order.
            for (s, &slot) in input.scheduled.iter().zip(&slots) {
                let reach = StoreReach::Running {
                    computed: s.computed_tokens,
                    scheduled: s.scheduled_tokens,
                };
                let update = Some((s.new_block_ids.as_slice(), s.full_table));
                self.plan_store_at(slot, s.req, reach, update, &mut stores);
            }
            // 3. Fence flush (stores of running requests are never fenced).
            self.fence_flush();
        } else {
            for (s, &slot) in input.scheduled.iter().zip(&slots) {
                if let Some(rs) = self.requests.at_mut(slot) {
                    if s.full_table {
                        rs.block_ids.clear();
                    }
                    rs.block_ids.extend_from_slice(&s.new_block_ids);
                }
                self.batch.allocated.extend_non_null(&s.new_block_ids);
            }
            self.fence_flush();
            for (s, &slot) in input.scheduled.iter().zip(&slots) {
                let reach = StoreReach::Running {
                    computed: s.computed_tokens,
                    scheduled: s.scheduled_tokens,
                };
                self.plan_store_at(slot, s.req, reach, None, &mut stores);
            }
        }
        self.batch.slots = slots;
        // 4. Store planning for finished requests, in list order.
        for &req in &input.finished {
            if self
                .requests
                .get(&req)
                .is_some_and(|r| !r.finished_signaled)
            {
                self.plan_store(req, StoreReach::Finished, None, &mut stores);
            }
        }
        // 5. The plan.
        let mut flush = std::mem::take(&mut self.batch.flush);
        flush.sort_unstable();
        flush.dedup();
        let mut failed_loads = std::mem::take(&mut self.failed_loads);
        failed_loads.sort_unstable();
        failed_loads.dedup();
        self.batch.last_stores = stores.len();
        let mut evictions = Vec::new();
        self.remote_evictions(&mut evictions);
        // The partial tails this plan's fetch jobs bring in.
        self.last_partial_tails
            .append(&mut self.fetched_partial_tails);
        let plan = StepPlan {
            loads: std::mem::take(&mut self.batch.loads),
            stores,
            flush,
            failed_loads,
            fetches: std::mem::take(&mut self.batch.fetches),
            evictions,
            sync_loads: {
                let mut s = std::mem::take(&mut self.batch.sync_loads);
                s.sort_unstable();
                s
            },
        };
        // 6. Finished requests: the manager hears it once, after their last store.
        for &req in &input.finished {
            self.finalize_finished(req);
        }
        // 7. Per-step state; the new jobs' deadlines go to the watchdog.
        self.batch.allocated.clear();
        self.batch.sync_reserved.clear();
        self.batch.sync_bytes = 0;
        self.batch.now_ns = None;
        self.watch.track_all(&mut self.batch.deadlines);
        Ok(plan)
    }

    /// Hands a finished step's plan back so that the next plans reuse its
    /// buffers instead of allocating them (optional: a plan that is simply
    /// dropped costs one allocation in the next step).
    pub fn recycle_plan(&mut self, plan: StepPlan) {
        let StepPlan {
            mut loads,
            mut stores,
            mut flush,
            mut failed_loads,
            fetches: _,
            evictions: _,
            sync_loads: _,
        } = plan;
        if stores.capacity() > self.batch.spare_stores.capacity() {
            stores.clear();
            self.batch.spare_stores = stores;
        }
        // The other lists are built between steps (loads at allocation, flush
        // and failed loads by the hooks): reuse their buffers when still empty.
        if self.batch.loads.is_empty() && loads.capacity() > self.batch.loads.capacity() {
            loads.clear();
            self.batch.loads = loads;
        }
        if self.batch.flush.is_empty() && flush.capacity() > self.batch.flush.capacity() {
            flush.clear();
            self.batch.flush = flush;
        }
        if self.failed_loads.is_empty() && failed_loads.capacity() > self.failed_loads.capacity() {
            failed_loads.clear();
            self.failed_loads = failed_loads;
        }
    }

    /// Every pending store reading a block allocated in this step is flushed.
    fn fence_flush(&mut self) {
        if !self.fences.is_empty() {
            for b in self.batch.allocated.as_slice() {
                self.batch.flush.extend_from_slice(self.fences.jobs(*b));
            }
        }
    }

    fn finalize_finished(&mut self, req: RequestId) {
        let Some(slot) = self.requests.slot_of(&req) else {
            return;
        };
        if self.requests.at(slot).is_some_and(|rs| rs.finish.is_none()) {
            tracing::debug!(%req, "listed as finished without request_finished");
            let info = super::request::FinishInfo {
                aborted: false,
                computed_tokens: 0,
            };
            self.requests.set_finish(slot, info);
        }
        let Some(rs) = self.requests.at_mut(slot) else {
            return;
        };
        rs.finished_signaled = true;
        if !rs.manager_finished {
            rs.manager_finished = true;
            self.manager.request_finished_with(req, &mut rs.access);
            self.counters.manager_request_finished += 1;
        }
        if rs.jobs.is_empty() {
            self.requests.remove(&req);
        }
    }
}
