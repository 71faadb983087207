//! Reset of the tier (vLLM `reset_cache`) and the flush protocol around it:
//! whether the tier has work of its own to wait for, and the notice that
//! every transfer from before the reset has ended.

use super::OffloadManager;
use super::policy::EvictionPolicy;
use super::slots::{Counters, EMPTY_SLOT, SlotState};

impl OffloadManager {
    /// Evicts everything without per-chunk events. Quarantined slots stay held
    /// (a late transfer may still write them); undrained events stay.
    pub fn reset(&mut self) {
        self.index.clear();
        for slot in self.slots.iter_mut() {
            if slot.state != SlotState::Quarantined {
                *slot = EMPTY_SLOT;
            }
        }
        let slots = &self.slots;
        self.pool
            .reset(|s| slots[s as usize].state == SlotState::Quarantined);
        self.policy.clear();
        // vLLM keeps the reuse filter's offer counts across a reset.
        self.requests.clear();
        self.counters = Counters {
            quarantined: self.counters.quarantined,
            ..Counters::default()
        };
        self.generation += 1;
    }

    /// Whether the tier has background work of its own (never, for host memory).
    pub fn has_pending_work(&self) -> bool {
        false
    }

    /// Every transfer from before the last reset has ended (no-op for host memory).
    pub fn on_reset_flushed(&mut self) {
        tracing::debug!(generation = self.generation, "host tier: reset flushed");
    }
}
