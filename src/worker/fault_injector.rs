//! Fault injection for any [`TransferBackend`]: the [`FaultControl`] trait and
//! [`FaultInjector`], a wrapper that delays, stalls or fails chosen jobs of the
//! backend it wraps. The real backends (host, CUDA) have no fault code of their
//! own: the simulation, the engine's worker pool, the vLLM connector's binding
//! and the tests all inject faults through this wrapper, so a fault means the
//! same on every backend.
//!
//! Semantics: `DelayPolls(n)` copies but reports only from the n-th `poll`
//! after submission on (the wrapper counts its polls), holding back the jobs
//! behind it in its direction (FIFO); `Stall` neither copies nor reports until
//! [`FaultControl::release_stalled`] submits it late (it then reports after the
//! jobs already queued in its direction) or [`FaultControl::cancel_stalled`]
//! drops it; `Fail` reports `success = false`, 0 bytes, and copies nothing.
//!
//! A stalled or failed job's spec is checked when it is given
//! ([`TransferBackend::check_spec`]), as the wrapped backend checks the others
//! at submission; a job refused at submission keeps its injected fault (it
//! applies when the job is submitted). `wait` counts a held (stalled) job as
//! not finished: it waits for the other jobs, then returns
//! [`BackendError::WaitTimedOut`] naming the held ones, at once (nothing can
//! release them while it waits, so it neither sleeps out the timeout nor,
//! without one, blocks forever).
//!
//! [`FaultInjector::settle`] and [`FaultInjector::drain`] are test helpers that
//! make completion independent of thread timing and of injected delays.

use crate::Direction;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::ids::{ChunkId, JobId};

use super::backend::{HostShare, TransferBackend, TransferResult};
use super::error::BackendError;
use super::fault::Fault;
use super::layout::TransferSpec;

/// Per-job fault injection on a transfer backend (implemented by [`FaultInjector`]).
pub trait FaultControl {
    /// Injects `fault` into `job` (it applies when the job is submitted).
    fn set_fault(&mut self, job: JobId, fault: Fault);
    /// Lets a stalled job run now (a late completion). False if it is not stalled.
    fn release_stalled(&mut self, job: JobId) -> bool;
    /// Jobs held by a [`Fault::Stall`], sorted.
    fn stalled(&self) -> Vec<JobId>;
    /// Drops a stalled job for good: it never runs nor reports, and nothing of
    /// it is kept (the control plane confirmed it cancelled). False if it is
    /// not stalled (not submitted, already released or already cancelled).
    fn cancel_stalled(&mut self, job: JobId) -> bool;
    /// Faults injected whose job was not submitted yet.
    fn pending_faults(&self) -> usize;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Submitted to the wrapped backend: report its result.
    Inner,
    /// Injected failure: nothing was submitted.
    Failed,
}

#[derive(Debug)]
struct Entry {
    job: JobId,
    ready_at_poll: u64,
    source: Source,
}

/// A [`TransferBackend`] wrapper implementing [`FaultControl`] (see the module docs).
#[derive(Debug)]
pub struct FaultInjector<B> {
    inner: B,
    faults: HashMap<JobId, Fault>,
    held: HashMap<JobId, (Direction, TransferSpec)>,
    queues: [VecDeque<Entry>; 2],
    results: HashMap<JobId, TransferResult>,
    /// Polls so far: the clock of `DelayPolls`.
    polls: u64,
    buf: Vec<TransferResult>,
}

impl<B: TransferBackend> FaultInjector<B> {
    /// Wraps `inner`.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            faults: HashMap::new(),
            held: HashMap::new(),
            queues: [VecDeque::new(), VecDeque::new()],
            results: HashMap::new(),
            polls: 0,
            buf: Vec::new(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The wrapped backend, mutably (submitting through it bypasses the faults).
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// Waits (up to `timeout`) until every job submitted to the wrapped backend
    /// and not reported yet has finished, without reporting any: the next poll
    /// reports them as usual (injected delays still count polls). Held stalled
    /// jobs and injected failures are not waited for. Tests use it to make
    /// completion independent of thread timing.
    pub fn settle(&mut self, timeout: Duration) -> Result<(), BackendError> {
        let submitted = self.submitted();
        if submitted.is_empty() {
            return Ok(());
        }
        self.inner.wait(&submitted, Some(timeout))
    }

    /// Reports every queued job as if every injected delay had run out: waits
    /// for their copies, moves the delay clock (the poll count) past the
    /// latest of them, and polls. What is still in flight afterwards can only
    /// report once released ([`FaultControl::release_stalled`]): a test that a
    /// job never reports drains instead of polling a fixed number of times, so
    /// a report however late is caught.
    pub fn drain(&mut self, out: &mut Vec<TransferResult>) -> Result<(), BackendError> {
        let submitted = self.submitted();
        if !submitted.is_empty() {
            self.inner.wait(&submitted, None)?;
        }
        let latest = self
            .queues
            .iter()
            .flatten()
            .map(|e| e.ready_at_poll)
            .max()
            .unwrap_or(0);
        // `poll` counts itself first, then reports what is ready at that count.
        self.polls = self.polls.max(latest.saturating_sub(1));
        self.poll(out);
        Ok(())
    }

    /// Queued jobs that were submitted to the wrapped backend, FIFO per direction.
    fn submitted(&self) -> Vec<JobId> {
        self.queues
            .iter()
            .flatten()
            .filter(|e| e.source == Source::Inner)
            .map(|e| e.job)
            .collect()
    }

    fn known(&self, job: JobId) -> bool {
        self.held.contains_key(&job) || self.queues.iter().flatten().any(|e| e.job == job)
    }

    fn submit_inner(
        &mut self,
        dir: Direction,
        job: JobId,
        spec: &TransferSpec,
    ) -> Result<(), BackendError> {
        match dir {
            Direction::Store => self.inner.submit_store(job, spec),
            Direction::Load => self.inner.submit_load(job, spec),
        }
    }

    fn submit(
        &mut self,
        dir: Direction,
        job: JobId,
        spec: &TransferSpec,
    ) -> Result<(), BackendError> {
        if self.known(job) {
            return Err(BackendError::DuplicateJob(job));
        }
        // The fault is used up only once the job is accepted.
        let (source, delay) = match self.faults.get(&job).copied() {
            Some(Fault::Stall) => {
                self.inner.check_spec(spec)?;
                self.faults.remove(&job);
                tracing::debug!(%job, %dir, "fault injection: job stalls");
                self.held.insert(job, (dir, spec.clone()));
                return Ok(());
            }
            Some(Fault::Fail) => {
                self.inner.check_spec(spec)?;
                (Source::Failed, 0)
            }
            Some(Fault::DelayPolls(n)) => (Source::Inner, u64::from(n)),
            None => (Source::Inner, 0),
        };
        if source == Source::Inner {
            self.submit_inner(dir, job, spec)?;
        }
        self.faults.remove(&job);
        self.queues[dir.index()].push_back(Entry {
            job,
            ready_at_poll: self.polls + delay,
            source,
        });
        Ok(())
    }
}

impl<B: TransferBackend> FaultControl for FaultInjector<B> {
    fn set_fault(&mut self, job: JobId, fault: Fault) {
        self.faults.insert(job, fault);
    }

    fn release_stalled(&mut self, job: JobId) -> bool {
        let Some((dir, spec)) = self.held.remove(&job) else {
            return false;
        };
        let source = match self.submit_inner(dir, job, &spec) {
            Ok(()) => Source::Inner,
            Err(e) => {
                tracing::error!(%job, %dir, error = %e, "a released stalled job was refused: it fails");
                Source::Failed
            }
        };
        self.queues[dir.index()].push_back(Entry {
            job,
            ready_at_poll: self.polls,
            source,
        });
        true
    }

    fn stalled(&self) -> Vec<JobId> {
        let mut v: Vec<JobId> = self.held.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn cancel_stalled(&mut self, job: JobId) -> bool {
        // A held job was never submitted to the wrapped backend: dropping its
        // copy of the spec is all there is to cancel.
        let cancelled = self.held.remove(&job).is_some();
        if cancelled {
            tracing::debug!(%job, "stalled job cancelled");
        }
        cancelled
    }

    fn pending_faults(&self) -> usize {
        self.faults.len()
    }
}

impl<B: TransferBackend> TransferBackend for FaultInjector<B> {
    fn submit_store(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError> {
        self.submit(Direction::Store, job, spec)
    }

    fn submit_load(&mut self, job: JobId, spec: &TransferSpec) -> Result<(), BackendError> {
        self.submit(Direction::Load, job, spec)
    }

    fn poll(&mut self, out: &mut Vec<TransferResult>) {
        self.polls += 1;
        self.buf.clear();
        self.inner.poll(&mut self.buf);
        for r in self.buf.drain(..) {
            self.results.insert(r.job, r);
        }
        for dir in Direction::ALL {
            let queue = &mut self.queues[dir.index()];
            while let Some(front) = queue.front() {
                if front.ready_at_poll > self.polls {
                    break;
                }
                let result = match front.source {
                    Source::Failed => TransferResult {
                        job: front.job,
                        direction: dir,
                        success: false,
                        bytes: 0,
                        duration: Duration::ZERO,
                    },
                    Source::Inner => match self.results.remove(&front.job) {
                        Some(r) => r,
                        None => break,
                    },
                };
                queue.pop_front();
                out.push(result);
            }
        }
    }

    fn wait(&mut self, jobs: &[JobId], timeout: Option<Duration>) -> Result<(), BackendError> {
        // Injected failures are done; held (stalled) jobs cannot finish while
        // this waits, so they are reported pending once the others are waited for.
        let ids: Vec<JobId> = jobs
            .iter()
            .copied()
            .filter(|j| !self.held.contains_key(j))
            .collect();
        let waited = if ids.is_empty() {
            Ok(())
        } else {
            self.inner.wait(&ids, timeout)
        };
        if ids.len() == jobs.len() {
            return waited;
        }
        let late = match waited {
            Ok(()) => Vec::new(),
            Err(BackendError::WaitTimedOut { pending }) => pending,
            Err(e) => return Err(e),
        };
        Err(BackendError::WaitTimedOut {
            pending: jobs
                .iter()
                .copied()
                .filter(|j| self.held.contains_key(j) || late.contains(j))
                .collect(),
        })
    }

    fn in_flight(&self) -> usize {
        self.held.len() + self.queues.iter().map(VecDeque::len).sum::<usize>()
    }

    fn check_spec(&self, spec: &TransferSpec) -> Result<(), BackendError> {
        self.inner.check_spec(spec)
    }

    fn host_share(&self, chunk: ChunkId) -> Option<HostShare> {
        self.inner.host_share(chunk)
    }

    fn blocks_per_chunk(&self) -> Option<u32> {
        self.inner.blocks_per_chunk()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::worker::{
        GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, SpecError,
        WorkerLayout,
    };

    const LONG: Option<Duration> = Some(Duration::from_secs(30));

    struct Rig {
        b: FaultInjector<HostBackend>,
        gpu: Arc<HostBuffer>,
        pool: Arc<HostBuffer>,
    }

    fn rig() -> Rig {
        let page = 64u64;
        let gpu = Arc::new(HostBuffer::new(16 * page as usize).unwrap());
        let row = HostRowLayout::uniform(1, 1, &[page]).unwrap();
        let pool = Arc::new(HostBuffer::new(row.pool_bytes(8).unwrap() as usize).unwrap());
        let layout = WorkerLayout::new(
            GpuLayout::cross_layer(gpu.addr(), 16, page, page).unwrap(),
            row,
            0,
            pool.addr(),
            8,
        )
        .unwrap();
        let host = HostBackend::new(
            layout,
            vec![gpu.clone(), pool.clone()],
            HostBackendOptions::default(),
        )
        .unwrap();
        Rig {
            b: FaultInjector::new(host),
            gpu,
            pool,
        }
    }

    fn spec(block: u32, chunk: u32) -> TransferSpec {
        TransferSpec::new(&[block], 0, &[chunk])
    }

    fn poll(b: &mut FaultInjector<HostBackend>) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        b.poll(&mut out);
        out.iter().map(|r| (r.job.0, r.success)).collect()
    }

    #[test]
    fn no_fault_copies_and_reports() {
        let mut r = rig();
        // SAFETY: no job is in flight on these bytes.
        unsafe { r.gpu.write(64, &[7u8; 64]) };
        r.b.submit_store(JobId(1), &spec(1, 2)).unwrap();
        r.b.wait(&[JobId(1)], LONG).unwrap();
        assert_eq!(poll(&mut r.b), vec![(1, true)]);
        // SAFETY: the job completed.
        let row = unsafe { r.pool.read(2 * 4096, 64) };
        assert_eq!(row, vec![7u8; 64]);
        assert_eq!(r.b.in_flight(), 0);
        assert!(matches!(
            r.b.submit_store(JobId(1), &spec(1, 2))
                .and_then(|()| r.b.submit_store(JobId(1), &spec(1, 2))),
            Err(BackendError::DuplicateJob(JobId(1)))
        ));
    }

    #[test]
    fn delay_holds_its_direction_fifo() {
        let mut r = rig();
        r.b.set_fault(JobId(1), Fault::DelayPolls(3));
        r.b.submit_store(JobId(1), &spec(1, 0)).unwrap();
        r.b.submit_store(JobId(2), &spec(2, 1)).unwrap();
        r.b.submit_load(JobId(3), &spec(3, 2)).unwrap();
        r.b.wait(&[JobId(1), JobId(2), JobId(3)], LONG).unwrap();
        assert_eq!(poll(&mut r.b), vec![(3, true)], "load is not held back");
        assert_eq!(poll(&mut r.b), vec![]);
        assert_eq!(poll(&mut r.b), vec![(1, true), (2, true)], "3rd poll");
        assert_eq!(r.b.in_flight(), 0);
    }

    #[test]
    fn stall_holds_until_released_and_fail_reports_failure() {
        let mut r = rig();
        // SAFETY: no job is in flight on these bytes.
        unsafe { r.gpu.write(64, &[9u8; 64]) };
        r.b.set_fault(JobId(1), Fault::Stall);
        r.b.set_fault(JobId(2), Fault::Fail);
        r.b.submit_store(JobId(1), &spec(1, 0)).unwrap();
        r.b.submit_store(JobId(2), &spec(1, 1)).unwrap();
        r.b.submit_store(JobId(3), &spec(2, 2)).unwrap();
        assert_eq!(r.b.stalled(), vec![JobId(1)]);
        assert_eq!(r.b.in_flight(), 3);
        // The others finish; the held job does not (the host backend's own
        // stalls behaved so before the injector took them over).
        assert!(matches!(
            r.b.wait(&[JobId(1), JobId(2), JobId(3)], LONG),
            Err(BackendError::WaitTimedOut { pending }) if pending == vec![JobId(1)]
        ));
        assert_eq!(
            poll(&mut r.b),
            vec![(2, false), (3, true)],
            "later jobs finish"
        );
        // SAFETY: no job writes these rows (1 failed, 0 is held).
        let (r0, r1) = unsafe { (r.pool.read(0, 64), r.pool.read(4096, 64)) };
        assert_eq!((r0, r1), (vec![0u8; 64], vec![0u8; 64]), "nothing copied");
        assert_eq!(poll(&mut r.b), vec![]);
        assert!(r.b.release_stalled(JobId(1)));
        assert!(!r.b.release_stalled(JobId(1)));
        assert!(r.b.stalled().is_empty());
        r.b.wait(&[JobId(1)], LONG).unwrap();
        assert_eq!(poll(&mut r.b), vec![(1, true)], "late report");
        // SAFETY: the job completed.
        assert_eq!(unsafe { r.pool.read(0, 64) }, vec![9u8; 64]);
        // A stall overridden before submission (as a flush does) runs normally.
        r.b.set_fault(JobId(4), Fault::Stall);
        r.b.set_fault(JobId(4), Fault::DelayPolls(0));
        r.b.submit_load(JobId(4), &spec(3, 0)).unwrap();
        r.b.wait(&[JobId(4)], LONG).unwrap();
        assert_eq!(poll(&mut r.b), vec![(4, true)]);
        assert_eq!(r.b.in_flight(), 0);
    }

    #[test]
    fn cancelled_stall_never_runs_and_leaves_nothing() {
        let mut r = rig();
        // SAFETY: no job is in flight on these bytes.
        unsafe { r.gpu.write(64, &[5u8; 64]) };
        r.b.set_fault(JobId(1), Fault::Stall);
        r.b.set_fault(JobId(9), Fault::Fail);
        assert_eq!(r.b.pending_faults(), 2);
        r.b.submit_store(JobId(1), &spec(1, 0)).unwrap();
        assert_eq!(r.b.pending_faults(), 1, "job 9 not submitted yet");
        assert!(r.b.cancel_stalled(JobId(1)));
        assert!(!r.b.cancel_stalled(JobId(1)), "cancelled once");
        assert!(!r.b.release_stalled(JobId(1)), "a cancelled job cannot run");
        assert!(r.b.stalled().is_empty());
        assert_eq!(r.b.in_flight(), 0);
        assert_eq!(poll(&mut r.b), vec![], "never reports");
        // SAFETY: nothing was submitted on this row.
        assert_eq!(unsafe { r.pool.read(0, 64) }, vec![0u8; 64], "never copied");
    }

    #[test]
    fn waiting_on_a_held_job_reports_it_pending_at_once() {
        let mut r = rig();
        r.b.set_fault(JobId(1), Fault::Stall);
        r.b.submit_store(JobId(1), &spec(1, 0)).unwrap();
        r.b.submit_store(JobId(2), &spec(2, 1)).unwrap();
        for timeout in [Some(Duration::ZERO), LONG, None] {
            match r.b.wait(&[JobId(2), JobId(1)], timeout) {
                Err(BackendError::WaitTimedOut { pending }) => {
                    assert_eq!(pending, vec![JobId(1)], "{timeout:?}: job 2 finished");
                }
                other => panic!("{timeout:?}: expected a timeout, got {other:?}"),
            }
        }
        r.b.wait(&[JobId(2)], LONG).unwrap();
        assert_eq!(poll(&mut r.b), vec![(2, true)]);
    }

    #[test]
    fn settle_and_drain_report_every_delay_but_no_stall() {
        let mut r = rig();
        r.b.set_fault(JobId(1), Fault::DelayPolls(u32::MAX));
        r.b.set_fault(JobId(3), Fault::Stall);
        r.b.set_fault(JobId(4), Fault::Fail);
        for j in 1..=4 {
            r.b.submit_store(JobId(j), &spec(j as u32, j as u32))
                .unwrap();
        }
        r.b.settle(Duration::from_secs(30)).unwrap();
        assert_eq!(poll(&mut r.b), vec![], "job 1 holds the stores back");
        let mut out = Vec::new();
        r.b.drain(&mut out).unwrap();
        let got: Vec<(u64, bool)> = out.iter().map(|x| (x.job.0, x.success)).collect();
        assert_eq!(got, vec![(1, true), (2, true), (4, false)]);
        assert_eq!(r.b.stalled(), vec![JobId(3)]);
        assert_eq!(r.b.in_flight(), 1);
    }

    #[test]
    fn a_held_or_failed_job_with_a_bad_spec_is_refused_and_keeps_its_fault() {
        let mut r = rig();
        let bad = TransferSpec::new(&[0], 0, &[0]);
        for (j, fault) in [
            (1, Fault::Stall),
            (2, Fault::Fail),
            (3, Fault::DelayPolls(2)),
        ] {
            r.b.set_fault(JobId(j), fault);
            assert!(matches!(
                r.b.submit_load(JobId(j), &bad),
                Err(BackendError::Spec(SpecError::NullBlock { position: 0 }))
            ));
        }
        assert_eq!(
            r.b.pending_faults(),
            3,
            "not submitted: the faults still apply"
        );
        assert_eq!(r.b.in_flight(), 0);
        assert!(r.b.stalled().is_empty());
        r.b.submit_load(JobId(1), &spec(1, 0)).unwrap();
        assert_eq!(r.b.stalled(), vec![JobId(1)]);
        assert_eq!(r.b.pending_faults(), 2);
    }
}
