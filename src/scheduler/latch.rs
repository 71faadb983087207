//! The per-job completion state shared by the worker-report path and the stall
//! watchdog: a count of worker reports still expected plus two terminal flags,
//! packed in one atomic word so that exactly one of "completed" and "stalled"
//! ever wins, and a report after a stall never completes the job.
//!
//! Uses [`crate::sync`] atomics, so it is model-checked with loom
//! (`RUSTFLAGS="--cfg loom" cargo test --release --lib loom`).

use crate::sync::{AtomicU64, Ordering};

/// Low 32 bits: reports still expected.
const PENDING: u64 = u32::MAX as u64;
/// Set once by the watchdog when it hands the job over as stalled.
const STALLED: u64 = 1 << 32;
/// Set by the report that brought the pending count to zero.
const DONE: u64 = 1 << 33;

/// What a worker report did to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportEffect {
    /// Counted; `left` reports are still expected.
    Counted {
        /// Reports still expected.
        left: u32,
    },
    /// This report was the last one: the job completed (exactly one report sees this).
    Completed,
    /// The job was handed over as stalled first: the report is late and was not counted.
    Late,
    /// The job had already completed: nothing was counted.
    AlreadyDone,
    /// More reports than the job still expects: nothing was counted.
    TooMany {
        /// Reports the job still expected.
        expected: u32,
    },
}

/// Completion state of one job (see the module documentation).
#[derive(Debug)]
pub struct JobLatch(AtomicU64);

impl JobLatch {
    /// A job expecting `pending` worker reports (at least one).
    pub fn new(pending: u32) -> Self {
        Self(AtomicU64::new(u64::from(pending.max(1))))
    }

    /// Counts `n` worker reports, unless the job already stalled or completed.
    pub fn report(&self, n: u32) -> ReportEffect {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            if cur & STALLED != 0 {
                return ReportEffect::Late;
            }
            if cur & DONE != 0 {
                return ReportEffect::AlreadyDone;
            }
            let pending = (cur & PENDING) as u32;
            if n > pending {
                return ReportEffect::TooMany { expected: pending };
            }
            let left = pending - n;
            let next = if left == 0 { DONE } else { u64::from(left) };
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if left == 0 => return ReportEffect::Completed,
                Ok(_) => return ReportEffect::Counted { left },
                Err(actual) => cur = actual,
            }
        }
    }

    /// Marks the job stalled. True for exactly one caller, and only if the job
    /// has not completed; the reports still expected are kept (see [`Self::pending`]).
    pub fn try_stall(&self) -> bool {
        let mut cur = self.0.load(Ordering::Acquire);
        loop {
            if cur & (STALLED | DONE) != 0 {
                return false;
            }
            match self.0.compare_exchange_weak(
                cur,
                cur | STALLED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Reports still expected (those due as late reports once stalled; 0 once completed).
    pub fn pending(&self) -> u32 {
        (self.0.load(Ordering::Acquire) & PENDING) as u32
    }

    /// Whether the job was handed over as stalled.
    pub fn is_stalled(&self) -> bool {
        self.0.load(Ordering::Acquire) & STALLED != 0
    }

    /// Whether the job completed.
    pub fn is_done(&self) -> bool {
        self.0.load(Ordering::Acquire) & DONE != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn counts_down_then_completes_once() {
        let l = JobLatch::new(3);
        assert_eq!(l.report(1), ReportEffect::Counted { left: 2 });
        assert_eq!(l.report(3), ReportEffect::TooMany { expected: 2 });
        assert_eq!(l.report(2), ReportEffect::Completed);
        assert!(l.is_done());
        assert_eq!(l.report(1), ReportEffect::AlreadyDone);
        assert!(!l.try_stall(), "a completed job never stalls");
        assert_eq!(l.pending(), 0);
    }

    #[test]
    fn stall_wins_once_and_late_reports_never_resurrect() {
        let l = JobLatch::new(2);
        assert_eq!(l.report(1), ReportEffect::Counted { left: 1 });
        assert!(l.try_stall());
        assert!(!l.try_stall(), "handed over once");
        assert_eq!(l.pending(), 1, "late reports still due");
        assert_eq!(l.report(1), ReportEffect::Late);
        assert!(!l.is_done());
        assert!(l.is_stalled());
    }
}

/// Loom models: worker reports racing the watchdog's stall and the scheduler's
/// completion path. Run with `RUSTFLAGS="--cfg loom" cargo test --release --lib loom`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicUsize;
    use loom::thread;

    /// Two workers each report once (split job, world size 2) while the
    /// watchdog tries to stall it: exactly one of completed/stalled wins, and
    /// after a stall no report completes it.
    #[test]
    fn loom_split_reports_race_stall() {
        loom::model(|| {
            let latch = Arc::new(JobLatch::new(2));
            let completed = Arc::new(AtomicUsize::new(0));
            let late = Arc::new(AtomicUsize::new(0));
            let workers: Vec<_> = (0..2)
                .map(|_| {
                    let (l, c, lt) = (latch.clone(), completed.clone(), late.clone());
                    thread::spawn(move || match l.report(1) {
                        ReportEffect::Completed => {
                            c.fetch_add(1, Ordering::SeqCst);
                        }
                        ReportEffect::Late => {
                            lt.fetch_add(1, Ordering::SeqCst);
                        }
                        ReportEffect::Counted { left } => assert_eq!(left, 1),
                        other => panic!("unexpected {other:?}"),
                    })
                })
                .collect();
            let stalled = latch.try_stall();
            for w in workers {
                w.join().unwrap();
            }
            let c = completed.load(Ordering::SeqCst);
            assert_eq!(
                c + usize::from(stalled),
                1,
                "completes or stalls exactly once"
            );
            if stalled {
                assert!(!latch.is_done());
                assert_eq!(latch.pending() as usize, late.load(Ordering::SeqCst));
            } else {
                assert!(latch.is_done());
                assert_eq!(late.load(Ordering::SeqCst), 0);
            }
            assert!(
                !latch.try_stall(),
                "a second scan never hands it over again"
            );
        });
    }

    // The whole hand-over (the real job table, the watchdog's scan and the
    // scheduler's completion path) is modelled in `scheduler/loom_models.rs`.
}
