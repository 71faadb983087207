//! Inspection: occupancy and usage statistics, views of the eviction order
//! (ARC's lists, the LRU order), the quarantined slots, the metadata's
//! memory, and a full consistency check. Read-only; the views and the check
//! cost time linear in the tier and are meant for tests and debugging.

use crate::ids::ChunkId;
use crate::key::ChunkKey;

use super::policy::EvictionPolicy;
use super::slots::{Counters, PENDING, SlotState};
use super::{ALLOC_SIZE_BUCKETS, ManagerStats, OffloadManager};

/// ARC's state, as [`OffloadManager::arc_state`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ArcState {
    /// Adaptive target size of T1.
    pub target_t1: f64,
    /// Resident keys seen once, least recent first.
    pub t1: Vec<ChunkKey>,
    /// Resident keys reused, least recent first.
    pub t2: Vec<ChunkKey>,
    /// Ghost keys evicted from T1, least recent first.
    pub b1: Vec<ChunkKey>,
    /// Ghost keys evicted from T2, least recent first.
    pub b2: Vec<ChunkKey>,
}

impl OffloadManager {
    /// Occupancy and usage.
    pub fn stats(&self) -> ManagerStats {
        let c = self.counters;
        let n = f64::from(self.capacity);
        let usage = f64::from(c.pinned + c.pending) / n;
        let write_usage = f64::from(c.pending) / n;
        ManagerStats {
            num_chunks: self.capacity,
            cached: c.ready,
            pending: c.pending,
            pinned: c.pinned,
            evictable: c.ready - c.pinned,
            quarantined: c.quarantined,
            free: self.capacity - c.ready - c.pending - c.quarantined,
            usage,
            write_usage,
            read_usage: usage - write_usage,
            stores_skipped: self.stores_skipped,
            allocation_failures: self.allocation_failures,
            ignored_complete_keys: self.ignored_complete_keys,
            dropped_events: self.events.dropped(),
        }
    }

    /// Histogram of `prepare_store` sizes: bucket i counts calls of `[2^i, 2^(i+1))` chunks.
    pub fn allocation_size_histogram(&self) -> [u64; ALLOC_SIZE_BUCKETS] {
        self.alloc_sizes
    }

    /// ARC's lists (keys, least recent first) and target; `None` under LRU.
    pub fn arc_state(&self) -> Option<ArcState> {
        let v = self.policy.arc_view()?;
        let keys = |slots: Vec<u32>| {
            slots
                .into_iter()
                .map(|s| self.slots[s as usize].key)
                .collect()
        };
        Some(ArcState {
            target_t1: v.target_t1,
            t1: keys(v.t1),
            t2: keys(v.t2),
            b1: v.b1,
            b2: v.b2,
        })
    }

    /// Resident keys in LRU order (least recent first); `None` under ARC.
    /// For tests and debugging: O(resident chunks).
    pub fn lru_order(&self) -> Option<Vec<ChunkKey>> {
        self.policy.lru_view().map(|slots| {
            slots
                .into_iter()
                .map(|s| self.slots[s as usize].key)
                .collect()
        })
    }

    /// The quarantined slots, in id order.
    pub fn quarantined_chunks(&self) -> Vec<ChunkId> {
        (0..self.capacity)
            .filter(|&s| self.slots[s as usize].state == SlotState::Quarantined)
            .map(ChunkId)
            .collect()
    }

    /// Bytes of heap memory of the per-chunk structures (index, slot records,
    /// free list, policy), as they report it: a quick figure for benchmarks.
    /// It leaves out the event buffer, the per-request records and the reuse
    /// filter; `tests/manager_heap.rs` measures the whole heap with a counting
    /// allocator.
    pub fn metadata_bytes(&self) -> usize {
        self.index.heap_bytes()
            + self.slots.heap_bytes()
            + self.pool.heap_bytes()
            + self.policy.heap_bytes()
            + std::mem::size_of::<Self>()
    }

    /// Recounts every state from the slots and checks the counters and the
    /// slot/key bijection. Returns a description of the first inconsistency.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut c = Counters::default();
        let mut occupied = 0usize;
        for (s, slot) in self.slots.iter().enumerate() {
            match slot.state {
                SlotState::Free => {}
                SlotState::Quarantined => c.quarantined += 1,
                SlotState::Occupied => {
                    occupied += 1;
                    if self.indexed(slot.key) != Some(s as u32) {
                        return Err(format!(
                            "slot {s} holds key {} but the index disagrees",
                            slot.key
                        ));
                    }
                    match slot.ref_cnt {
                        PENDING => c.pending += 1,
                        0 => c.ready += 1,
                        r if r > 0 => {
                            c.ready += 1;
                            c.pinned += 1;
                        }
                        r => return Err(format!("slot {s} has ref count {r}")),
                    }
                }
            }
            if slot.protected {
                return Err(format!("slot {s} left protected"));
            }
        }
        if occupied != self.index.len() {
            return Err(format!(
                "{} keys indexed but {occupied} slots occupied",
                self.index.len()
            ));
        }
        if c != self.counters {
            return Err(format!("counters {:?} but recount {c:?}", self.counters));
        }
        let free = self.capacity as usize - occupied - c.quarantined as usize;
        if self.pool.available() != free {
            return Err(format!(
                "pool offers {} slots but {free} are free",
                self.pool.available()
            ));
        }
        Ok(())
    }
}
