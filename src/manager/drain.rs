//! What the manager accumulates for its backend between steps, and the calls
//! that hand it over: the event log (stores and removals), the sizes of the
//! allocations tried, and the evicted chunks' former slots (for a remote tier
//! written on eviction).

use crate::ids::ChunkId;
use crate::key::ChunkKey;

use super::slots::key_of;
use super::{OffloadEvent, OffloadManager};

impl OffloadManager {
    /// Drains pending events (evictions before the stores that reuse their space).
    /// Call it every step: at most 65,536 undrained events are kept, the oldest
    /// beyond that are dropped (counted in
    /// [`ManagerStats::dropped_events`](super::ManagerStats::dropped_events)).
    pub fn take_events(&mut self) -> Vec<OffloadEvent> {
        let Self {
            events,
            index,
            slots,
            ..
        } = self;
        events.drain(|k| index.get(k, key_of(slots)).is_some())
    }

    /// Whether events are logged at all (on by default). A backend that
    /// publishes no events turns them off: stores and evictions then log
    /// nothing, and [`Self::take_events`] is always empty.
    pub fn set_events_logged(&mut self, on: bool) {
        self.events.set_logging(on);
    }

    /// Drops the pending events without building them (a backend that
    /// publishes no events drains this way, allocation-free).
    pub fn discard_events(&mut self) {
        self.events.clear();
    }

    /// Events waiting to be drained.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// How many keys each store tried to allocate since the last call, in
    /// order (vLLM `kv_offload_cpu_allocation_size`).
    pub fn take_allocation_sizes(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.allocation_sizes)
    }

    /// Keeps every evicted chunk's key and former slot (off by default), so
    /// that its bytes can be written elsewhere before the slot is reused.
    pub fn track_evicted_slots(&mut self, on: bool) {
        self.evicted_slots = on.then(Vec::new);
    }

    /// Moves the evicted chunks kept since the last call into `out`.
    pub fn take_evicted_slots(&mut self, out: &mut Vec<(ChunkKey, ChunkId)>) {
        if let Some(t) = self.evicted_slots.as_mut() {
            out.append(t);
        }
    }
}
