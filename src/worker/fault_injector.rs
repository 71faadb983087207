//! Fault injection for any [`TransferBackend`]: the [`FaultControl`] trait
//! (the host backend implements it natively) and [`FaultInjector`], a wrapper
//! giving the same semantics to a backend without its own (the CUDA backend),
//! so that the simulation injects the same faults on either.
//!
//! Semantics, as the host backend's: `DelayPolls(n)` copies but reports only
//! from the n-th `poll` after submission on, holding back the jobs behind it in
//! its direction (FIFO); `Stall` neither copies nor reports until
//! [`FaultControl::release_stalled`] submits it late (it then reports after the
//! jobs already queued in its direction); `Fail` reports `success = false`, 0
//! bytes, and copies nothing. Difference: a failed or stalled job's spec is
//! checked by the wrapped backend only when (if) it is submitted there.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::ids::{ChunkId, JobId};

use super::backend::{Direction, HostShare, TransferBackend, TransferResult};
use super::error::BackendError;
use super::fault::Fault;
use super::host_backend::HostBackend;
use super::layout::TransferSpec;

/// Per-job fault injection on a transfer backend.
pub trait FaultControl {
    /// Injects `fault` into `job` (it applies when the job is submitted).
    fn set_fault(&mut self, job: JobId, fault: Fault);
    /// Lets a stalled job run now (a late completion). False if it is not stalled.
    fn release_stalled(&mut self, job: JobId) -> bool;
    /// Jobs held by a [`Fault::Stall`], sorted.
    fn stalled(&self) -> Vec<JobId>;
    /// Drops a stalled job for good: it never runs nor reports (the control
    /// plane confirmed it cancelled). False if it is not stalled.
    fn cancel_stalled(&mut self, job: JobId) -> bool;
    /// Faults injected whose job was not submitted yet.
    fn pending_faults(&self) -> usize;
}

impl FaultControl for HostBackend {
    fn set_fault(&mut self, job: JobId, fault: Fault) {
        HostBackend::set_fault(self, job, fault);
    }

    fn release_stalled(&mut self, job: JobId) -> bool {
        HostBackend::release_stalled(self, job)
    }

    fn stalled(&self) -> Vec<JobId> {
        HostBackend::stalled(self)
    }

    fn cancel_stalled(&mut self, job: JobId) -> bool {
        HostBackend::cancel_stalled(self, job)
    }

    fn pending_faults(&self) -> usize {
        HostBackend::pending_faults(self)
    }
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
        let fault = self.faults.remove(&job);
        let (source, delay) = match fault {
            Some(Fault::Stall) => {
                tracing::debug!(%job, %dir, "fault injection: job stalls");
                self.held.insert(job, (dir, spec.clone()));
                return Ok(());
            }
            Some(Fault::Fail) => (Source::Failed, 0),
            Some(Fault::DelayPolls(n)) => (Source::Inner, u64::from(n)),
            None => (Source::Inner, 0),
        };
        if source == Source::Inner {
            self.submit_inner(dir, job, spec)?;
        }
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
        // Stalled jobs never finish while held; injected failures are done.
        let ids: Vec<JobId> = jobs
            .iter()
            .copied()
            .filter(|j| !self.held.contains_key(j))
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        self.inner.wait(&ids, timeout)
    }

    fn in_flight(&self) -> usize {
        self.held.len() + self.queues.iter().map(VecDeque::len).sum::<usize>()
    }

    fn host_share(&self, chunk: ChunkId) -> Option<HostShare> {
        self.inner.host_share(chunk)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::worker::{GpuLayout, HostBackendOptions, HostBuffer, HostRowLayout, WorkerLayout};

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
        r.b.wait(&[JobId(1), JobId(2), JobId(3)], LONG).unwrap();
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
}
