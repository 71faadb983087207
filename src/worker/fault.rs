//! Fault injection: per job, a delay, a stall or a failure, applied to any
//! backend by a [`FaultInjector`](super::FaultInjector). Used by tests and by
//! the simulation to exercise the stall watchdog and the failed-load path
//! without timers.

use serde::{Deserialize, Serialize};

/// What goes wrong with one job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// The copy runs, but its completion is reported only from the n-th `poll`
    /// after submission on (jobs behind it in the same direction wait: FIFO).
    DelayPolls(u32),
    /// The job never finishes and never reports (no bytes move), until
    /// [`FaultControl::release_stalled`](super::FaultControl::release_stalled)
    /// lets it run late. Later jobs still finish.
    Stall,
    /// The job reports `success = false` without copying.
    Fail,
}
