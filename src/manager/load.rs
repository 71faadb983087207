//! The load path: pinning ready chunks for a load (and recording it as the
//! request's reuse), unpinning them when it completes, and quarantine of the
//! slots a stalled transfer may still touch (pinned chunks of a stalled load,
//! held until [`OffloadManager::release_quarantined`]; a stalled store's are
//! quarantined by [`OffloadManager::complete_store`]).

use std::collections::HashMap;

use crate::ids::{ChunkId, RequestId};
use crate::key::{ChunkKey, KeyBuildHasher};

use super::policy::EvictionPolicy;
use super::recency::Record;
use super::request_access::RequestAccess;
use super::slots::{EMPTY_SLOT, PENDING, Slot, SlotState, key_of};
use super::{ManagerError, OffloadManager};

impl OffloadManager {
    /// Pins ready chunks for a load; returns their slots co-indexed with `keys`.
    ///
    /// A key may appear more than once (it is then pinned once per occurrence).
    /// With `req`, the load counts as the request's reuse of the chunks.
    pub fn prepare_load(
        &mut self,
        keys: &[ChunkKey],
        req: Option<RequestId>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        self.load(keys, None, Record::mapped(req))
    }

    /// [`Self::prepare_load`] for a request whose record its caller keeps (the
    /// scheduler keeps it in the request's state: no map probe); `first_position`
    /// is the position of `keys[0]`, the others following one apart.
    pub(crate) fn prepare_load_recorded(
        &mut self,
        keys: &[ChunkKey],
        first_position: u64,
        access: &mut RequestAccess,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        self.load(
            keys,
            Some(&|i| first_position + i as u64),
            Record::Kept(access),
        )
    }

    /// [`Self::prepare_load_recorded`] with each key's own position
    /// (`positions`, co-indexed with `keys`): a load over several KV groups,
    /// whose keys restart their positions group by group.
    pub(crate) fn prepare_load_at(
        &mut self,
        keys: &[ChunkKey],
        positions: &[u64],
        access: &mut RequestAccess,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        debug_assert_eq!(keys.len(), positions.len());
        let at = |i: usize| positions.get(i).copied().unwrap_or(0);
        self.load(keys, Some(&at), Record::Kept(access))
    }

    /// The one load path: pins `keys` (nothing changes on error), then
    /// records them in the request's record, if any, with key `i` at
    /// position `position(i)` if known.
    fn load(
        &mut self,
        keys: &[ChunkKey],
        position: Option<&dyn Fn(usize) -> u64>,
        record: Record<'_>,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        let out = self.pin_for_load(keys)?;
        self.with_record(record, |m, acc| {
            if let Some(acc) = acc {
                m.record_load(keys, position, acc);
            }
        });
        Ok(out)
    }

    /// Validates and pins `keys` for a load (nothing changes on error).
    fn pin_for_load(&mut self, keys: &[ChunkKey]) -> Result<Vec<ChunkId>, ManagerError> {
        let mut out = Vec::with_capacity(keys.len());
        for &k in keys {
            let s = self.indexed(k).ok_or(ManagerError::UnknownKey(k))?;
            if self.slots[s as usize].ref_cnt == PENDING {
                return Err(ManagerError::NotReady(k));
            }
            out.push(ChunkId(s));
        }
        for &ChunkId(s) in &out {
            let slot = &mut self.slots[s as usize];
            if slot.ref_cnt == 0 {
                self.counters.pinned += 1;
            }
            slot.ref_cnt += 1;
        }
        Ok(out)
    }

    /// Records a load's keys as the request's observations and reuses.
    fn record_load(
        &mut self,
        keys: &[ChunkKey],
        position: Option<&dyn Fn(usize) -> u64>,
        acc: &mut RequestAccess,
    ) {
        acc.refresh(self.generation);
        let mut observed = std::mem::take(&mut self.scratch_observed);
        observed.clear();
        for (i, &k) in keys.iter().enumerate() {
            let pos = position.map(|p| p(i));
            let (i, new) = acc.observe(k, pos);
            if new && let Some(p) = pos {
                observed.push((k, p));
            }
            acc.mark_reused_at(i);
        }
        self.observe_ranked(&observed, acc);
        self.scratch_observed = observed;
    }

    /// Unpins chunks after their load finished (once per `prepare_load` occurrence).
    pub fn complete_load(
        &mut self,
        keys: &[ChunkKey],
        _req: Option<RequestId>,
    ) -> Result<(), ManagerError> {
        // Validate with multiplicity: a key listed twice must be pinned twice.
        let mut need: HashMap<u32, i32, KeyBuildHasher> = HashMap::default();
        for &k in keys {
            let s = self.indexed(k).ok_or(ManagerError::UnknownKey(k))?;
            let n = need.entry(s).or_insert(0);
            *n += 1;
            if self.slots[s as usize].ref_cnt < *n {
                return Err(ManagerError::NotPinned(k));
            }
        }
        for (s, n) in need {
            let slot = &mut self.slots[s as usize];
            slot.ref_cnt -= n;
            if slot.ref_cnt == 0 {
                self.counters.pinned -= 1;
            }
        }
        Ok(())
    }

    /// Turns pinned chunks into quarantined slots: the keys leave the tier at
    /// once (a removal event), the slots stay out of the free list until
    /// [`Self::release_quarantined`], whatever `reset` does meanwhile. For a
    /// stalled load whose late transfer may still read them. Every key must be
    /// pinned; a key listed twice is quarantined once. Returns the slots.
    pub fn quarantine_pinned(&mut self, keys: &[ChunkKey]) -> Result<Vec<ChunkId>, ManagerError> {
        for &k in keys {
            let s = self.indexed(k).ok_or(ManagerError::UnknownKey(k))?;
            if self.slots[s as usize].ref_cnt < 1 {
                return Err(ManagerError::NotPinned(k));
            }
        }
        let mut held = Vec::with_capacity(keys.len());
        let mut removed = Vec::with_capacity(keys.len());
        for &k in keys {
            let Some(s) = self.index.remove(k, key_of(&self.slots)) else {
                continue; // listed twice
            };
            self.policy.on_remove(s);
            self.slots[s as usize] = Slot {
                state: SlotState::Quarantined,
                ..EMPTY_SLOT
            };
            self.counters.ready -= 1;
            self.counters.pinned -= 1;
            self.counters.quarantined += 1;
            held.push(ChunkId(s));
            removed.push(k);
        }
        self.events.evicted(&removed);
        Ok(held)
    }

    /// Returns quarantined slots to the free list (their late transfer is over).
    pub fn release_quarantined(&mut self, chunks: &[ChunkId]) -> Result<(), ManagerError> {
        let mut seen = std::collections::HashSet::with_capacity(chunks.len());
        for &c in chunks {
            let ok = (c.0 as usize) < self.slots.len()
                && self.slots[c.0 as usize].state == SlotState::Quarantined
                && seen.insert(c.0);
            if !ok {
                return Err(ManagerError::NotQuarantined(c));
            }
        }
        for &ChunkId(s) in chunks {
            self.slots[s as usize] = EMPTY_SLOT;
            self.counters.quarantined -= 1;
            self.pool.release(s);
        }
        Ok(())
    }
}
