//! The manager's event log: evictions, stores, and failed-store cleanups.
//!
//! A failed store's removal is `metadata_only` (the keys were never announced
//! as stored) and is dropped at drain time for keys stored again since.

use std::collections::HashMap;

use crate::key::{ChunkKey, KeyBuildHasher};

use super::types::OffloadEvent;

#[derive(Debug)]
struct Logged {
    event: OffloadEvent,
    seq: u64,
}

/// Undrained events kept at most: a backend that never drains them loses the
/// oldest (counted) instead of growing without bound.
pub(crate) const MAX_PENDING_EVENTS: usize = 1 << 16;

/// Events not yet drained, in emission order.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    pending: Vec<Logged>,
    /// Events dropped because nobody drained the log.
    dropped: u64,
    /// Key -> sequence number of the failed-store event that still owns its removal.
    failed_owner: HashMap<ChunkKey, u64, KeyBuildHasher>,
    seq: u64,
}

impl EventLog {
    fn push(&mut self, keys: Vec<ChunkKey>, removed: bool, metadata_only: bool) -> u64 {
        if self.pending.len() >= MAX_PENDING_EVENTS {
            // Drop the older half at once (amortised O(1) per event).
            let n = self.pending.len() / 2;
            if self.dropped == 0 {
                tracing::warn!(
                    kept = MAX_PENDING_EVENTS,
                    "host-tier events are not being drained (take_events); dropping the oldest"
                );
            }
            for old in self.pending.drain(..n) {
                if old.event.metadata_only {
                    for k in &old.event.keys {
                        if self.failed_owner.get(k) == Some(&old.seq) {
                            self.failed_owner.remove(k);
                        }
                    }
                }
            }
            self.dropped += n as u64;
        }
        self.seq += 1;
        self.pending.push(Logged {
            event: OffloadEvent {
                keys,
                removed,
                metadata_only,
            },
            seq: self.seq,
        });
        self.seq
    }

    /// Keys evicted (removed from the tier).
    pub(crate) fn evicted(&mut self, keys: Vec<ChunkKey>) {
        if !keys.is_empty() {
            self.push(keys, true, false);
        }
    }

    /// Keys whose store completed.
    pub(crate) fn stored(&mut self, keys: Vec<ChunkKey>) {
        if !keys.is_empty() {
            self.push(keys, false, false);
        }
    }

    /// Keys removed because their store failed (metadata-only removal).
    pub(crate) fn store_failed(&mut self, keys: Vec<ChunkKey>) {
        if keys.is_empty() {
            return;
        }
        let seq = self.push(keys.clone(), true, true);
        for k in keys {
            self.failed_owner.insert(k, seq);
        }
    }

    /// A key was allocated again: an earlier failed-store removal no longer applies.
    pub(crate) fn reowned(&mut self, key: ChunkKey) {
        if !self.failed_owner.is_empty() {
            self.failed_owner.remove(&key);
        }
    }

    /// Drains every pending event once, pruning failed-store removals of re-owned keys.
    pub(crate) fn drain(&mut self) -> Vec<OffloadEvent> {
        let mut out = Vec::with_capacity(self.pending.len());
        for Logged { mut event, seq } in self.pending.drain(..) {
            if event.metadata_only {
                let owners = &mut self.failed_owner;
                event.keys.retain(|k| match owners.get(k) {
                    Some(&s) if s == seq => {
                        owners.remove(k);
                        true
                    }
                    _ => false,
                });
                if event.keys.is_empty() {
                    continue;
                }
            }
            out.push(event);
        }
        out
    }

    /// Events waiting to be drained.
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }

    /// Events dropped because the log was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undrained_log_stays_bounded_and_counts_what_it_drops() {
        let mut log = EventLog::default();
        for i in 0..(MAX_PENDING_EVENTS as u64 + 10) {
            log.store_failed(vec![ChunkKey(i)]);
        }
        assert!(log.len() <= MAX_PENDING_EVENTS);
        assert_eq!(
            log.dropped() + log.len() as u64,
            MAX_PENDING_EVENTS as u64 + 10
        );
        assert!(
            log.failed_owner.len() <= MAX_PENDING_EVENTS,
            "owners of dropped events are forgotten"
        );
        let kept = log.len();
        let drained = log.drain();
        assert_eq!(drained.len(), kept, "every kept event is delivered");
        assert_eq!(log.len(), 0);
        assert_eq!(
            drained.last().unwrap().keys,
            vec![ChunkKey(MAX_PENDING_EVENTS as u64 + 9)]
        );
    }
}
