//! Worker reports and the one completion path of a job (vLLM
//! `update_connector_output` and `_complete_job`).

use crate::Direction;
use crate::ids::{JobId, RequestId};
use crate::manager::StoreOutcome;

use super::Scheduler;
use super::jobs::JobEntry;
use super::latch::ReportEffect;
use super::stall::StalledJob;
use super::types::{CompletionReport, Ending, SchedulerError, WorkerOutcome};
use super::types::{JobBlocks, JobSlots};

/// Where a worker report for a job goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Live,
    Stalled,
    Stale,
}

impl Scheduler {
    fn route(&self, job: JobId, count: u32) -> Result<Route, SchedulerError> {
        if let Some(s) = self.stalled.get(&job) {
            if count > s.remaining {
                return Err(SchedulerError::TooManyReports {
                    job,
                    expected: s.remaining,
                    got: count,
                });
            }
            return Ok(Route::Stalled);
        }
        if job.0 < self.stale_threshold {
            return Ok(Route::Stale);
        }
        let Some(e) = self.jobs.get(job) else {
            return Err(SchedulerError::UnknownJob(job));
        };
        let pending = e.latch.pending();
        if count > pending {
            return Err(SchedulerError::TooManyReports {
                job,
                expected: pending,
                got: count,
            });
        }
        Ok(Route::Live)
    }

    /// Report entries summed per job, in ascending job id order.
    fn normalize(report: &CompletionReport) -> Vec<(JobId, u32, bool)> {
        let mut v: Vec<(JobId, u32, bool)> =
            Vec::with_capacity(report.completed.len() + report.failed.len());
        for &(job, n) in &report.completed {
            v.push((job, n, report.failed.contains(&job)));
        }
        for &job in &report.failed {
            if !report.completed.iter().any(|(j, _)| *j == job) {
                v.push((job, 1, true));
            }
        }
        v.sort_by_key(|(j, _, _)| *j);
        // Merge duplicates.
        let mut out: Vec<(JobId, u32, bool)> = Vec::with_capacity(v.len());
        for (j, n, f) in v {
            match out.last_mut() {
                Some(last) if last.0 == j => {
                    last.1 = last.1.saturating_add(n);
                    last.2 |= f;
                }
                _ => out.push((j, n, f)),
            }
        }
        out
    }

    /// Checks a report without applying it: the first entry that
    /// [`Self::on_worker_output`] would reject.
    pub fn check_report(&self, report: &CompletionReport) -> Result<(), SchedulerError> {
        for (job, n, _) in Self::normalize(report) {
            self.route(job, n)?;
        }
        Ok(())
    }

    /// Applies worker reports (summed over workers), in ascending job id order.
    ///
    /// A job completes when it has received `world_size` reports in total.
    /// Reports for jobs created before a reset count toward the reset fence;
    /// late reports for stalled jobs count down their quarantine. Reports for
    /// unknown jobs, or beyond what a job expects, are rejected (counted, logged,
    /// listed in the outcome) and the rest is applied.
    pub fn on_worker_output(&mut self, report: &CompletionReport) -> WorkerOutcome {
        self.apply_stalls();
        let mut out = WorkerOutcome::default();
        for (job, n, failed) in Self::normalize(report) {
            match self.route(job, n) {
                Err(e) => {
                    self.counters.unknown_reports += u64::from(n);
                    tracing::warn!(%job, count = n, error = %e, "rejected worker report");
                    out.rejected.push((job, e));
                }
                Ok(Route::Stalled) => self.late_report(job, n),
                Ok(Route::Stale) => self.stale_report(job, n, failed, &mut out),
                Ok(Route::Live) => {
                    let mut stalled_first = false;
                    let done = match self.jobs.get_mut(job) {
                        Some(mut e) => match e.latch.report(n) {
                            ReportEffect::Completed => {
                                e.failed |= failed;
                                Some(e.failed)
                            }
                            ReportEffect::Counted { .. } => {
                                e.failed |= failed;
                                None
                            }
                            // The watchdog handed it over since this hook began:
                            // the stall wins and this report is late.
                            ReportEffect::Late => {
                                stalled_first = true;
                                None
                            }
                            ReportEffect::AlreadyDone | ReportEffect::TooMany { .. } => None,
                        },
                        None => None,
                    };
                    if stalled_first {
                        self.counters.reports_racing_stall += u64::from(n);
                        self.complete_job(job, Ending::Stalled);
                        self.late_report(job, n);
                    }
                    if let Some(failed) = done
                        && let Some((kind, req)) =
                            self.complete_job(job, Ending::Reported { failed })
                        && kind == Direction::Load
                    {
                        if failed {
                            out.failed_loads.push(req);
                        } else {
                            out.finished_loads.push(req);
                        }
                    }
                }
            }
        }
        out.finished_loads.sort_unstable();
        out.finished_loads.dedup();
        out.failed_loads.sort_unstable();
        out.failed_loads.dedup();
        out
    }

    fn stale_report(&mut self, job: JobId, n: u32, failed: bool, out: &mut WorkerOutcome) {
        let Some(f) = self.reset_fence.get_mut(&job) else {
            tracing::debug!(%job, "report for a job dropped by a reset, fence already drained");
            return;
        };
        f.remaining = f.remaining.saturating_sub(n);
        f.failed |= failed;
        if f.remaining == 0 {
            if let Some(req) = f.load_req {
                if f.failed {
                    out.failed_loads.push(req);
                } else {
                    out.finished_loads.push(req);
                }
            }
            self.reset_fence.remove(&job);
            if self.reset_fence.is_empty() {
                self.manager.on_reset_flushed();
            }
        }
    }

    /// The one completion path: removes the job and applies its effects on the
    /// manager, the being-loaded set, the fences and the request state. Never
    /// calls the manager's `request_finished`. Returns the job's kind and request.
    pub(crate) fn complete_job(
        &mut self,
        job: JobId,
        ending: Ending,
    ) -> Option<(Direction, RequestId)> {
        let e = self.jobs.remove(job)?;
        let req = e.req;
        if e.kind == Direction::Store {
            // A remote fetch's probe learns how it ended (`remote.rs`).
            self.remote_job_ended(job, &e.keys, ending == Ending::Reported { failed: false });
        }
        match (e.kind, ending) {
            (Direction::Store, Ending::Reported { failed }) => {
                let outcome = if failed {
                    StoreOutcome::Failure
                } else {
                    StoreOutcome::Success
                };
                if let Err(err) = self.manager.complete_store(&e.keys, outcome, Some(req)) {
                    tracing::error!(%job, error = %err, "complete_store refused");
                }
                if e.fenced {
                    self.fences.remove(job, e.blocks());
                }
                if let Some(window) = self.window_fences.remove(&job)
                    && !e.fenced
                {
                    self.fences.remove(job, &window);
                }
            }
            (Direction::Store, Ending::Stalled) => {
                let held = match self.manager.complete_store(
                    &e.keys,
                    StoreOutcome::Quarantined,
                    Some(req),
                ) {
                    Ok(h) => h,
                    Err(err) => {
                        tracing::error!(%job, error = %err, "complete_store (quarantine) refused");
                        Vec::new()
                    }
                };
                // Source blocks are fenced (whatever the request's state) while the
                // late DMA may still read them: a reuse flushes the job.
                if !e.fenced {
                    self.fences.add(job, e.blocks());
                }
                self.window_fences.remove(&job);
                self.counters.stalled_stores += 1;
                let blocks = JobBlocks::from_slice(e.blocks());
                self.stalled.insert(
                    job,
                    StalledJob {
                        kind: Direction::Store,
                        req,
                        keys: e.keys,
                        chunk_ids: JobSlots::from_vec(held),
                        blocks,
                        fenced: true,
                        load_quarantined: false,
                        remaining: e.latch.pending(),
                    },
                );
            }
            (Direction::Load, Ending::Reported { .. }) => {
                if let Err(err) = self.manager.complete_load(&e.keys, Some(req)) {
                    tracing::error!(%job, error = %err, "complete_load refused");
                }
                self.unmark_loading(&e);
            }
            (Direction::Load, Ending::Stalled) => {
                // Chunks stay pinned (quarantined) until the late reports arrive.
                self.unmark_loading(&e);
                self.counters.stalled_loads += 1;
                self.failed_loads.push(req);
                let chunk_ids = JobSlots::from_slice(e.chunk_ids());
                // The failed load lets the backend free or recompute its
                // destination blocks while the late DMA may still write them:
                // they are fenced, and a reuse flushes the job.
                let blocks = JobBlocks::from_slice(e.blocks());
                self.fences.add(job, &blocks);
                self.stalled.insert(
                    job,
                    StalledJob {
                        kind: Direction::Load,
                        req,
                        keys: e.keys,
                        chunk_ids,
                        blocks,
                        fenced: true,
                        load_quarantined: false,
                        remaining: e.latch.pending(),
                    },
                );
            }
        }
        if let Some(rs) = self.requests.get_mut(&req) {
            rs.jobs.retain(|j| *j != job);
            if rs.finished_signaled && rs.jobs.is_empty() {
                self.requests.remove(&req);
            }
        }
        Some((e.kind, req))
    }

    /// A load's keys are no longer being loaded (a synchronous load never
    /// marked them).
    fn unmark_loading(&mut self, e: &JobEntry) {
        if e.sync {
            return;
        }
        for k in e.keys.iter() {
            if let Some(n) = self.being_loaded.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.being_loaded.remove(k);
                }
            }
        }
    }
}
