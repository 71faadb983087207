//! NVTX ranges for the data plane's job phases (plan, submit, in flight,
//! complete), each named with its job, direction and bytes, for Nsight Systems.
//!
//! Ranges are emitted only when an NVTX tool is injected (`NVTX_INJECTION64_PATH`
//! is set, as `nsys profile` does) or when [`set_enabled`] turned them on; otherwise
//! every call is a relaxed atomic load. Under Miri (no FFI) they compile to nothing.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::Direction;
use crate::ids::JobId;

/// A phase of a transfer job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobPhase {
    /// Descriptors being built.
    Plan,
    /// Copies being enqueued.
    Submit,
    /// Between submit and the completion being noticed (a start/end range).
    InFlight,
    /// The completion being published.
    Complete,
}

impl JobPhase {
    fn name(self) -> &'static str {
        match self {
            JobPhase::Plan => "plan",
            JobPhase::Submit => "submit",
            JobPhase::InFlight => "in-flight",
            JobPhase::Complete => "complete",
        }
    }
}

/// 0 = not decided yet, 1 = off, 2 = on.
static ENABLED: AtomicU8 = AtomicU8::new(0);
static FROM_ENV: OnceLock<bool> = OnceLock::new();

/// Forces the ranges on or off (the default follows `NVTX_INJECTION64_PATH`).
pub fn set_enabled(on: bool) {
    ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether ranges are emitted.
pub fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = *FROM_ENV.get_or_init(|| std::env::var_os("NVTX_INJECTION64_PATH").is_some());
            ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// A thread-local range (push/pop) that ends when dropped.
#[must_use = "the range ends when this guard is dropped"]
#[derive(Debug)]
pub struct PhaseRange {
    active: bool,
}

/// Opens a thread-local range for `phase` of `job` (plan, submit, complete).
pub fn phase(phase: JobPhase, direction: Direction, job: JobId, bytes: u64) -> PhaseRange {
    let active = enabled();
    if active {
        push(phase, direction, job, bytes);
    }
    PhaseRange { active }
}

impl Drop for PhaseRange {
    fn drop(&mut self) {
        if self.active {
            pop();
        }
    }
}

/// A process-wide range that may end on another thread (the in-flight phase).
#[derive(Debug)]
pub struct InFlightRange {
    id: Option<i32>,
}

/// Starts the in-flight range of `job`; end it with [`InFlightRange::end`] or by dropping it.
pub fn in_flight(direction: Direction, job: JobId, bytes: u64) -> InFlightRange {
    let id = enabled().then(|| start(JobPhase::InFlight, direction, job, bytes));
    InFlightRange { id }
}

impl InFlightRange {
    /// Ends the range now.
    pub fn end(mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        if let Some(id) = self.id.take() {
            stop(id);
        }
    }
}

impl Drop for InFlightRange {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(not(miri))]
fn push(phase: JobPhase, direction: Direction, job: JobId, bytes: u64) {
    nvtx::range_push!(
        "kvoffload {} {} {} {} B",
        direction,
        phase.name(),
        job,
        bytes
    );
}

#[cfg(not(miri))]
fn pop() {
    nvtx::range_pop!();
}

#[cfg(not(miri))]
fn start(phase: JobPhase, direction: Direction, job: JobId, bytes: u64) -> i32 {
    nvtx::range_start!(
        "kvoffload {} {} {} {} B",
        direction,
        phase.name(),
        job,
        bytes
    )
}

#[cfg(not(miri))]
fn stop(id: i32) {
    nvtx::range_end!(id);
}

#[cfg(miri)]
fn push(phase: JobPhase, _direction: Direction, _job: JobId, _bytes: u64) {
    let _ = phase.name();
}

#[cfg(miri)]
fn pop() {}

#[cfg(miri)]
fn start(_phase: JobPhase, _direction: Direction, _job: JobId, _bytes: u64) -> i32 {
    0
}

#[cfg(miri)]
fn stop(_id: i32) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_open_and_close_with_or_without_a_tool() {
        set_enabled(true);
        {
            let _r = phase(JobPhase::Plan, Direction::Store, JobId(1), 4096);
            in_flight(Direction::Load, JobId(2), 8192).end();
        }
        set_enabled(false);
        let r = phase(JobPhase::Complete, Direction::Store, JobId(3), 1);
        assert!(!r.active);
    }
}
