//! The preemption flush: a preempted request's pending stores are waited
//! for before its blocks are reused (loads created in the same step survive).

use crate::Direction;

use crate::ids::{JobId, RequestId};

use super::Scheduler;
use super::types::SchedulerError;

impl Scheduler {
    fn is_current_load(&self, job: JobId) -> bool {
        self.batch.loads.iter().any(|l| l.job == job)
    }

    /// Invariant D.3 at a preemption flush: apart from loads created in this
    /// step, a preempted request's pending jobs must all be stores or
    /// synchronous loads.
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
                let (kind, sync) = self
                    .jobs
                    .get(job)
                    .map_or((None, false), |e| (Some(e.kind), e.sync));
                if kind != Some(Direction::Store) && !sync {
                    return Err(SchedulerError::PreemptedWithPendingLoad {
                        req,
                        job,
                        kind: kind.map_or("unknown", Direction::as_str),
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
}
