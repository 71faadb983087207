//! Injected time: a monotonic clock for production and a manual clock for tests and replay.
//!
//! Every component that needs "now" takes an `Arc<dyn Clock>`; tests advance a
//! [`ManualClock`] instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic time source, expressed as the duration since the clock's origin.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Time elapsed since this clock's origin.
    fn now(&self) -> Duration;
}

/// Shared handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// Wall-clock monotonic time (`std::time::Instant`), origin at construction.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }

    /// The same clock behind a shared handle.
    pub fn shared() -> SharedClock {
        Arc::new(Self::new())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that only moves when told to; starts at zero.
///
/// Cloning shares the same underlying time, so a test can keep one handle and
/// give another to the engine.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A manual clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves time forward by `by` (saturating at `u64::MAX` nanoseconds).
    pub fn advance(&self, by: Duration) {
        let add = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let mut cur = self.nanos.load(Ordering::Acquire);
        loop {
            let next = cur.saturating_add(add);
            match self
                .nanos
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Sets the time to `to` if it is later than now; time never goes back.
    pub fn set(&self, to: Duration) {
        let to = u64::try_from(to.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_max(to, Ordering::AcqRel);
    }

    /// This clock behind a shared handle (the clone shares its time).
    pub fn shared(&self) -> SharedClock {
        Arc::new(self.clone())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told_and_clones_share_time() {
        let c = ManualClock::new();
        let shared = c.shared();
        assert_eq!(shared.now(), Duration::ZERO);
        c.advance(Duration::from_millis(1500));
        assert_eq!(shared.now(), Duration::from_millis(1500));
        c.set(Duration::from_secs(1));
        assert_eq!(c.now(), Duration::from_millis(1500), "time never goes back");
        c.set(Duration::from_secs(3));
        assert_eq!(c.now(), Duration::from_secs(3));
    }

    #[test]
    fn manual_clock_saturates_instead_of_overflowing() {
        let c = ManualClock::new();
        c.advance(Duration::MAX);
        c.advance(Duration::from_secs(1));
        assert_eq!(c.now(), Duration::from_nanos(u64::MAX));
    }

    #[test]
    fn monotonic_clock_does_not_go_back() {
        let c = MonotonicClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
    }
}
