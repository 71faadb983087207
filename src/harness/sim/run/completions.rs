//! What comes back from the workers and the watchdog: stall scans and the
//! fates of stalled jobs, worker reports (with rejected entries and duplicates
//! delivered alone, as replay checks a whole line), failed loads.

use crate::Direction;
use serde_json::{Value, json};

use crate::ids::{JobId, RequestId};
use crate::scheduler::CompletionReport;

use super::super::faults::StallFate;
use super::super::recorder::req_set;
use super::{Phase, Sim, SimError};

impl Sim {
    pub(super) fn scan(&mut self) {
        let out = self.timed(|s| s.scan_now());
        self.rec.call(|| json!({"op": "scan"}));
        self.rec.decision(|| {
            json!({
                "op": "scan",
                "stalled": out.stalled.iter().map(|j| j.0).collect::<Vec<_>>(),
                "failed_loads": req_set(&out.failed_loads),
            })
        });
        for &job in &out.stalled {
            // Why the watchdog found it: an injected stall, an injected late
            // report past the timeout, a job held back by such a late job, or
            // none of these.
            let injected = self.stall_faulted.contains_key(&job);
            let late = self.jobs.get(&job).is_some_and(|i| i.late);
            let behind = !injected && !late && self.behind_late_job(job);
            let f = &mut self.summary.faults;
            if injected {
                if self.open_stalls.contains(&job) {
                    f.injected_stalls_detected += 1;
                }
            } else if late {
                f.late_reports_detected += 1;
            } else if behind {
                f.queued_behind_late_detected += 1;
            } else {
                f.other_stalls_detected += 1;
            }
            if let Some(&(_, kind)) = self.stall_faulted.get(&job) {
                self.open_stalls.remove(&job);
                let fate = self.faults.stall_fate(kind == Direction::Store);
                let after = match fate {
                    StallFate::ReleaseAfter(n) | StallFate::CancelAfter(n) => n,
                    StallFate::Never => {
                        self.summary.faults.hung += 1;
                        self.hung.insert(job);
                        continue;
                    }
                };
                self.due.push((self.step + after, job, fate));
            }
        }
        for &r in &out.failed_loads {
            self.load_failed(r);
        }
    }

    /// Whether a job of the same direction with an injected late report is in
    /// flight: a worker reports its jobs of one direction in submission order
    /// (as a CUDA stream does), so a late job holds back those queued behind
    /// it (a stalled job that a flush released joins the back of the queue).
    fn behind_late_job(&self, job: JobId) -> bool {
        let Some(kind) = self.jobs.get(&job).map(|i| i.kind) else {
            return false;
        };
        self.jobs
            .iter()
            .any(|(&j, i)| j != job && i.late && i.kind == kind)
    }

    /// The simulated backend cancels a stalled job: its worker drops it in the
    /// next step's command (it never copies nor reports, and the worker forgets
    /// it), and the scheduler gets the confirmation if it still waits for one.
    pub(super) fn cancel(&mut self, job: JobId) -> Result<(), SimError> {
        // Still held on its worker (unless a flush made it run): cancel it there.
        if let Some((w, _)) = self.stall_faulted.remove(&job)
            && let Some(list) = self.cancels.get_mut(w as usize)
        {
            list.push(job);
        }
        if !self.sched.is_job_stalled(job) {
            return Ok(());
        }
        self.timed(|s| s.confirm_cancelled(job))?;
        self.rec
            .call(|| json!({"op": "confirm_cancelled", "job": job.0}));
        self.summary.faults.cancelled += 1;
        // A cancelled job never reports again: forget it.
        self.jobs.remove(&job);
        Ok(())
    }

    pub(super) fn load_failed(&mut self, r: RequestId) {
        if let Some(q) = self.reqs.get_mut(&r)
            && q.phase == Phase::Loading
        {
            q.phase = Phase::LoadFailed;
            self.summary.faults.failed_loads_recomputed += 1;
            self.summary.work.recomputed_tokens += q.external;
        }
    }

    /// Delivers the merged report: entries the scheduler accepts in one call,
    /// each rejected entry alone (as replay checks a whole line), then duplicates.
    pub(super) fn deliver(
        &mut self,
        merged: CompletionReport,
        draining: bool,
    ) -> Result<(), SimError> {
        if merged.completed.is_empty() && merged.failed.is_empty() {
            return Ok(());
        }
        let mut good = CompletionReport::default();
        let mut bad = Vec::new();
        let mut dups = Vec::new();
        for &(job, n) in &merged.completed {
            let failed: Vec<JobId> = merged
                .failed
                .iter()
                .copied()
                .filter(|&f| f == job)
                .collect();
            let one = CompletionReport {
                completed: vec![(job, n)],
                failed: failed.clone(),
            };
            if self.sched.check_report(&one).is_ok() {
                good.completed.push((job, n));
                good.failed.extend(failed);
                if !draining && self.faults.duplicate() {
                    dups.push(job);
                }
            } else {
                bad.insert(0, one);
            }
        }
        for j in &good.failed {
            if self
                .jobs
                .get(j)
                .is_some_and(|i| i.kind == Direction::Store && !i.fetch)
            {
                self.summary.faults.failed_stores += 1;
            }
        }
        if !good.completed.is_empty() {
            self.report(&good);
        }
        // A job is forgotten once the scheduler owes it nothing (a job of
        // several workers stays until its last report; a stalled one until
        // its late reports or its cancellation). A job made before a reset
        // is owed only to the reset fence, which the scheduler does not show
        // per job: it stays until every worker reported, since a late report
        // of it still holds back the jobs queued behind it on its worker.
        let world = self.pool.world_size();
        let stale = self.sched.stale_threshold();
        for &(j, n) in &good.completed {
            let all_in = self.jobs.get_mut(&j).is_some_and(|i| {
                i.reports += n;
                i.reports >= world
            });
            if !self.sched.is_job_live(j) && !self.sched.is_job_stalled(j) && (j >= stale || all_in)
            {
                self.jobs.remove(&j);
            }
        }
        for b in bad {
            self.report(&b);
        }
        // A duplicate of a report the scheduler has fully applied (a job that
        // is gone, not stalled, not owed to a reset fence) must be rejected.
        for job in dups {
            if job >= self.sched.stale_threshold()
                && !self.sched.is_job_live(job)
                && !self.sched.is_job_stalled(job)
            {
                self.summary.faults.injected_duplicates += 1;
                self.report(&CompletionReport {
                    completed: vec![(job, 1)],
                    failed: Vec::new(),
                });
            }
        }
        Ok(())
    }

    pub(super) fn report(&mut self, r: &CompletionReport) {
        let completed: serde_json::Map<String, Value> = r
            .completed
            .iter()
            .map(|(j, n)| (j.0.to_string(), Value::from(*n)))
            .collect();
        let mut line = json!({"op": "worker_output", "completed": completed});
        if !r.failed.is_empty() {
            line["failed"] = Value::from(r.failed.iter().map(|j| j.0).collect::<Vec<_>>());
        }
        self.rec.call(|| line);
        let out = self.timed(|s| s.on_worker_output(r));
        if !out.rejected.is_empty() {
            self.summary.faults.rejected_reports += out.rejected.len() as u64;
            self.rec
                .decision(|| json!({"op": "worker_output", "rejected": true}));
            return;
        }
        self.rec.decision(|| {
            json!({
                "op": "worker_output",
                "finished_loads": req_set(&out.finished_loads),
                "failed_loads": req_set(&out.failed_loads),
            })
        });
        for &r in &out.finished_loads {
            if let Some(q) = self.reqs.get_mut(&r)
                && q.phase == Phase::Loading
            {
                q.phase = Phase::LoadDone;
                self.check_loaded(r);
            }
        }
        for &q in &out.failed_loads {
            self.load_failed(q);
        }
    }
}
