//! The fault plan: which transfers stall, report late, report twice or fail,
//! and what happens to a stalled job once the watchdog has found it.

use crate::ids::JobId;
use crate::worker::Fault;

use super::rng::SimRng;

/// Probabilities of each fault, per transfer job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultRates {
    /// The job never reports on one worker (until released or cancelled).
    pub stall: f64,
    /// The job reports late on one worker (after 1..=`max_delay_steps` steps).
    pub late: f64,
    /// A duplicate report is delivered after the job completes.
    pub duplicate: f64,
    /// The transfer fails on one worker.
    pub fail: f64,
    /// Longest delay of a late report, in steps.
    pub max_delay_steps: u32,
    /// A detected stall is never resolved: the backend neither resumes nor
    /// cancels the transfer (a hung device). The engine keeps serving while
    /// nothing needs the transfer; a flush that must wait for it (its GPU
    /// blocks handed to a new owner) stops the run with
    /// [`crate::harness::sim::SimError::FlushWaitsOnHung`], and otherwise the
    /// run cannot drain and ends with [`crate::harness::sim::SimError::NoDrain`],
    /// each naming what is still held. Off (0) by default.
    pub hang: f64,
}

impl Default for FaultRates {
    fn default() -> Self {
        Self {
            stall: 0.01,
            late: 0.02,
            duplicate: 0.02,
            fail: 0.01,
            max_delay_steps: 40,
            hang: 0.0,
        }
    }
}

impl FaultRates {
    /// No faults at all.
    pub fn none() -> Self {
        Self {
            stall: 0.0,
            late: 0.0,
            duplicate: 0.0,
            fail: 0.0,
            max_delay_steps: 1,
            hang: 0.0,
        }
    }
}

/// What the simulated backend does with a stalled job once it is detected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StallFate {
    /// The transfer resumes this many steps later (a late report).
    ReleaseAfter(u64),
    /// The backend confirms, this many steps later, that it cancelled the transfer.
    CancelAfter(u64),
    /// The transfer hangs: it never resumes and is never cancelled.
    Never,
}

/// The latest a detected stall's fate comes, in steps after its detection.
pub const MAX_STALL_FATE_STEPS: u64 = 20;

/// Draws faults from a seeded stream.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    rates: FaultRates,
    rng: SimRng,
    world_size: u32,
}

impl FaultPlan {
    /// A plan for `world_size` workers.
    pub fn new(rates: FaultRates, world_size: u32, seed: u64) -> Self {
        Self {
            rates,
            rng: SimRng::new(seed),
            world_size: world_size.max(1),
        }
    }

    /// The rates.
    pub fn rates(&self) -> &FaultRates {
        &self.rates
    }

    /// The fault of a new job, if any, and the worker it hits.
    pub fn for_job(&mut self, _job: JobId) -> Option<(u32, Fault)> {
        let r = self.rates;
        let worker = self.rng.range(0, u64::from(self.world_size) - 1) as u32;
        let fault = if self.rng.chance(r.stall) {
            Fault::Stall
        } else if self.rng.chance(r.late) {
            Fault::DelayPolls(self.rng.range(1, u64::from(r.max_delay_steps.max(1))) as u32)
        } else if self.rng.chance(r.fail) {
            Fault::Fail
        } else {
            return None;
        };
        Some((worker, fault))
    }

    /// Whether a completed job gets a duplicate report.
    pub fn duplicate(&mut self) -> bool {
        self.rng.chance(self.rates.duplicate)
    }

    /// The fate of a detected stall: stores resume late, loads are cancelled
    /// (a late load would write GPU blocks the request may have given back),
    /// unless it hangs (with probability `hang`).
    pub fn stall_fate(&mut self, is_store: bool) -> StallFate {
        let after = self.rng.range(1, MAX_STALL_FATE_STEPS);
        // Drawn only when enabled, so that runs without hangs keep their stream.
        if self.rates.hang > 0.0 && self.rng.chance(self.rates.hang) {
            return StallFate::Never;
        }
        if is_store {
            StallFate::ReleaseAfter(after)
        } else {
            StallFate::CancelAfter(after)
        }
    }
}
