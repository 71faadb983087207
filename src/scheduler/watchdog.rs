//! The stall watchdog: scans the job table every scan interval and hands jobs
//! past their deadline to the scheduler through a lock-free queue.
//!
//! Jobs get their deadline at creation (creation time + stall timeout) from one
//! monotonic clock, in job id order, so deadlines never decrease along job ids.
//! The scheduler therefore also appends `(job, deadline)` to a deadline queue
//! (a step's new jobs at once, under one short lock: the inbox), and a scan
//! moves the inbox into its own queue and walks it from its oldest entry: entries of
//! jobs that are gone are dropped, expired jobs are handed over, and the scan
//! stops at the first live job that is not expired. Its cost is the number of
//! jobs that ended or expired since the last scan, not the number in flight. A
//! full scan of the concurrent map ([`WatchdogHandle::scan_full`]) gives the
//! same result and remains available as a cross-check.
//!
//! The thread waits on a condvar between scans (so it stops at once when the
//! scheduler is dropped) and reads time only from the injected clock. Tests and
//! replay never start the thread: they call the scan synchronously.

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

#[cfg(not(loom))]
use crossbeam_queue::SegQueue;

use crate::clock::SharedClock;
use crate::ids::JobId;
use crate::sync::{AtomicU64, Condvar, Mutex, MutexGuard, Ordering};

use super::jobs::JobTable;

/// Stalled job ids, from the watchdog to the scheduler: crossbeam's lock-free
/// queue; under loom (which cannot see inside it) a mutex-guarded one, so
/// that the models explore the hand-over too.
#[derive(Debug)]
pub(crate) struct HandOver {
    #[cfg(not(loom))]
    q: SegQueue<JobId>,
    #[cfg(loom)]
    q: Mutex<VecDeque<JobId>>,
}

impl HandOver {
    fn new() -> Self {
        Self {
            #[cfg(not(loom))]
            q: SegQueue::new(),
            #[cfg(loom)]
            q: Mutex::new(VecDeque::new()),
        }
    }

    /// Queues a stalled job.
    pub fn push(&self, job: JobId) {
        #[cfg(not(loom))]
        self.q.push(job);
        #[cfg(loom)]
        lock(&self.q).push_back(job);
    }

    /// The oldest queued job.
    pub fn pop(&self) -> Option<JobId> {
        #[cfg(not(loom))]
        return self.q.pop();
        #[cfg(loom)]
        return lock(&self.q).pop_front();
    }

    /// No job queued.
    pub fn is_empty(&self) -> bool {
        #[cfg(not(loom))]
        return self.q.is_empty();
        #[cfg(loom)]
        return lock(&self.q).is_empty();
    }
}

/// Requests to the watchdog thread (kept until it sees them, so that none is
/// lost while it is scanning or not yet waiting).
#[derive(Debug, Default)]
struct Control {
    /// Stop and return.
    stop: bool,
    /// Check the clock now, before the wait is over.
    wake: bool,
}

/// State shared by the scheduler and the watchdog thread.
#[derive(Debug)]
pub(crate) struct WatchdogShared {
    /// The job table.
    pub jobs: Arc<JobTable>,
    /// Stalled job ids, from the watchdog to the scheduler.
    pub queue: HandOver,
    /// `(job, deadline)` in job id order (so in deadline order), from the
    /// scheduler, not yet taken by a scan.
    inbox: Mutex<Vec<(JobId, u64)>>,
    /// The deadline entries a scan has taken and not dropped yet, oldest first
    /// (held by the scan: one scan at a time).
    front: Mutex<VecDeque<(JobId, u64)>>,
    clock: SharedClock,
    interval: Duration,
    /// Clock time of the last scan (nanoseconds); `u64::MAX` before the first.
    last_scan_ns: AtomicU64,
    scans: AtomicU64,
    /// What the thread is asked to do, under the lock its condvar waits with.
    control: Mutex<Control>,
    wake: Condvar,
    /// Signalled after every scan (for [`WatchdogHandle::wait_for_scan_since`]).
    scanned: Condvar,
    /// The lock `scanned` waits with.
    scanned_lock: Mutex<()>,
}

impl WatchdogShared {
    /// Shared state over `jobs`, scanning every `interval` of `clock` time.
    pub fn new(jobs: Arc<JobTable>, clock: SharedClock, interval: Duration) -> Self {
        Self {
            jobs,
            queue: HandOver::new(),
            inbox: Mutex::new(Vec::new()),
            front: Mutex::new(VecDeque::new()),
            clock,
            interval,
            last_scan_ns: AtomicU64::new(u64::MAX),
            scans: AtomicU64::new(0),
            control: Mutex::new(Control::default()),
            wake: Condvar::new(),
            scanned: Condvar::new(),
            scanned_lock: Mutex::new(()),
        }
    }

    /// Registers a new job's deadline (call in job id order, after the job
    /// is in the table).
    pub fn track(&self, job: JobId, deadline_ns: u64) {
        lock(&self.inbox).push((job, deadline_ns));
    }

    /// Registers the deadlines of several new jobs at once and empties `batch`
    /// (in job id order, after the jobs are in the table).
    pub fn track_all(&self, batch: &mut Vec<(JobId, u64)>) {
        if batch.is_empty() {
            return;
        }
        let mut inbox = lock(&self.inbox);
        if inbox.is_empty() && inbox.capacity() < batch.len() {
            // Hand the buffer over, keep the (empty) old one for the next batch.
            std::mem::swap(&mut *inbox, batch);
        } else {
            // The inbox keeps the capacity that scans left it (a swap here
            // would make it regrow from one step's size after every scan).
            inbox.append(batch);
        }
    }

    /// Scans now: every job past its deadline that was not handed over yet is queued.
    /// Returns how many were queued.
    pub fn scan(&self) -> usize {
        let now = nanos(self.clock.now());
        let mut front = lock(&self.front);
        front.extend(lock(&self.inbox).drain(..));
        let mut n = 0;
        while let Some((id, deadline)) = front.pop_front() {
            if now <= deadline {
                if self.jobs.contains(id) {
                    front.push_front((id, deadline));
                    break;
                }
                continue;
            }
            if let Some(e) = self.jobs.get(id)
                && e.latch.try_stall()
            {
                self.queue.push(id);
                n += 1;
            }
        }
        drop(front);
        self.finish_scan(now, n)
    }

    /// Scans every job of the concurrent map (cost linear in the jobs in
    /// flight); same result as [`Self::scan`].
    pub fn scan_full(&self) -> usize {
        let now = nanos(self.clock.now());
        let n = self.jobs.expire(now, |id| self.queue.push(id));
        self.finish_scan(now, n)
    }

    fn finish_scan(&self, now: u64, n: usize) -> usize {
        {
            // Under the waiters' lock, so that none misses the signal.
            let _g = lock(&self.scanned_lock);
            self.last_scan_ns.store(now, Ordering::Release);
            self.scans.fetch_add(1, Ordering::Relaxed);
        }
        self.scanned.notify_all();
        if n > 0 {
            tracing::warn!(stalled = n, "stall watchdog: jobs past their deadline");
        }
        n
    }

    /// Scans if a scan interval of clock time has passed since the last scan
    /// (or there was none). Returns whether it scanned.
    pub fn scan_if_due(&self) -> bool {
        let last = self.last_scan_ns.load(Ordering::Acquire);
        let now = nanos(self.clock.now());
        let due = last == u64::MAX || now.saturating_sub(last) >= nanos(self.interval);
        if due {
            self.scan();
        }
        due
    }

    /// Scans done so far.
    pub fn scans(&self) -> u64 {
        self.scans.load(Ordering::Relaxed)
    }

    /// Wakes the thread (if it runs) so that it checks the clock now instead
    /// of at the end of its wait: after a manual clock jumped, for example.
    pub fn wake(&self) {
        lock(&self.control).wake = true;
        self.wake.notify_all();
    }

    /// Blocks until a scan that read the clock at `since` or later has
    /// finished (true), or `timeout` of wall time has passed (false).
    pub fn wait_for_scan_since(&self, since: Duration, timeout: Duration) -> bool {
        let since = nanos(since);
        let seen = |s: &Self| {
            let last = s.last_scan_ns.load(Ordering::Acquire);
            last != u64::MAX && last >= since
        };
        let deadline = std::time::Instant::now() + timeout;
        let mut g = lock(&self.scanned_lock);
        while !seen(self) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            g = match self.scanned.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Forgets the last scan time (after a reset).
    pub fn reset_schedule(&self) {
        self.last_scan_ns.store(u64::MAX, Ordering::Release);
    }
}

/// A handle on the watchdog's scans, usable from any thread (for example a
/// backend's own housekeeping thread, or a benchmark).
#[derive(Debug, Clone)]
pub struct WatchdogHandle(pub(crate) Arc<WatchdogShared>);

impl WatchdogHandle {
    /// Scans the deadline queue now; expired jobs are handed to the scheduler,
    /// which cleans them up at its next hook. Returns how many were handed over.
    pub fn scan(&self) -> usize {
        self.0.scan()
    }

    /// Scans the whole job table now (linear in the jobs in flight).
    pub fn scan_full(&self) -> usize {
        self.0.scan_full()
    }

    /// Scans if a scan interval of clock time has passed since the last scan.
    pub fn scan_if_due(&self) -> bool {
        self.0.scan_if_due()
    }

    /// Wakes the watchdog thread (if it runs) to check the clock now rather
    /// than at the end of its wait (after a manual or simulated clock jumped).
    pub fn wake(&self) {
        self.0.wake();
    }

    /// Blocks until a scan (by the thread or any handle) that read the clock
    /// at `since` or later has finished: true; false once `timeout` of wall
    /// time has passed first. Lets a test, or a backend that needs it, know
    /// that a scan has seen a given time, without scanning itself.
    pub fn wait_for_scan_since(&self, since: Duration, timeout: Duration) -> bool {
        self.0.wait_for_scan_since(since, timeout)
    }

    /// Scans done so far (by the thread or any handle).
    pub fn scans(&self) -> u64 {
        self.0.scans()
    }
}

/// Locks `m`, also when a panicking thread poisoned it (the data stay valid:
/// every critical section here only moves whole entries).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Clock time in nanoseconds, saturating.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The watchdog thread; stops and joins when dropped.
#[derive(Debug)]
pub(crate) struct Watchdog {
    shared: Arc<WatchdogShared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the thread.
    pub fn start(shared: Arc<WatchdogShared>) -> std::io::Result<Self> {
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("kvoffload-stall-watchdog".into())
            .spawn(move || run(&s))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }
}

fn run(s: &WatchdogShared) {
    let wait = s.interval.max(Duration::from_millis(1));
    let mut control = lock(&s.control);
    loop {
        if control.stop {
            return;
        }
        if !control.wake {
            control = match s.wake.wait_timeout(control, wait) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
            if control.stop {
                return;
            }
        }
        control.wake = false;
        drop(control);
        s.scan_if_due();
        control = lock(&s.control);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        lock(&self.shared.control).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("stall watchdog thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::ids::RequestId;
    use crate::scheduler::jobs::JobEntry;
    use crate::scheduler::latch::JobLatch;

    /// The tests' table has a zero stall timeout: a job's deadline is its creation time.
    fn entry(deadline_ns: u64) -> JobEntry {
        JobEntry::store(
            RequestId(0),
            deadline_ns,
            JobLatch::new(1),
            Default::default(),
            &[],
            false,
        )
    }

    #[test]
    fn deadline_scan_hands_each_expired_job_over_once_and_skips_gone_jobs() {
        let clock = ManualClock::new();
        let jobs = Arc::new(JobTable::new(0));
        let w = WatchdogShared::new(Arc::clone(&jobs), clock.shared(), Duration::from_secs(10));
        for (id, dl) in [(0u64, 10u64), (1, 20), (2, 30), (3, 40)] {
            jobs.insert(JobId(id), entry(dl));
            w.track(JobId(id), dl);
        }
        jobs.remove(JobId(1));
        clock.set(Duration::from_nanos(30));
        assert_eq!(
            w.scan(),
            1,
            "job 0 only: 1 is gone, 2 expires strictly after 30"
        );
        assert_eq!(w.queue.pop(), Some(JobId(0)));
        assert_eq!(w.scan(), 0, "handed over once");
        clock.set(Duration::from_nanos(100));
        assert_eq!(w.scan_full(), 2);
        assert_eq!(w.scan(), 0, "the full scan already handed 2 and 3 over");
        assert_eq!(w.scans(), 4);
    }

    #[test]
    fn scan_if_due_follows_the_interval() {
        let clock = ManualClock::new();
        let w = WatchdogShared::new(
            Arc::new(JobTable::new(0)),
            clock.shared(),
            Duration::from_secs(10),
        );
        assert!(w.scan_if_due());
        clock.advance(Duration::from_secs(9));
        assert!(!w.scan_if_due());
        clock.advance(Duration::from_secs(1));
        assert!(w.scan_if_due());
    }

    #[test]
    fn the_thread_stops_and_joins_on_drop() {
        let w = Arc::new(WatchdogShared::new(
            Arc::new(JobTable::new(0)),
            ManualClock::new().shared(),
            Duration::from_secs(3600),
        ));
        let dog = Watchdog::start(Arc::clone(&w)).unwrap();
        drop(dog); // returns at once: the condvar wakes the thread
        assert_eq!(Arc::strong_count(&w), 1);
    }
}
