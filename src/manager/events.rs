//! The manager's event log: evictions, stores, and failed-store cleanups.
//!
//! A failed store's removal is `metadata_only` (the keys were never announced
//! as stored); at drain time it keeps only the keys that are absent from the
//! tier then (vLLM prunes keys a retry re-allocated since).

use crate::key::ChunkKey;

use super::types::OffloadEvent;

/// One undrained event: its keys are `keys[start..start + len]` of the log.
#[derive(Debug, Clone, Copy)]
struct Logged {
    start: usize,
    len: usize,
    removed: bool,
    metadata_only: bool,
}

/// Undrained events kept at most: a backend that never drains them loses the
/// oldest (counted) instead of growing without bound.
pub(crate) const MAX_PENDING_EVENTS: usize = 1 << 16;

/// Events not yet drained, in emission order. The keys of all pending events
/// share one buffer, so logging an event allocates nothing in steady state;
/// the per-event key lists are built when the events are drained.
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    pending: Vec<Logged>,
    /// Keys of the pending events, in order.
    keys: Vec<ChunkKey>,
    /// Events dropped because nobody drained the log.
    dropped: u64,
    /// Nothing is logged (a backend that publishes no events).
    off: bool,
}

impl EventLog {
    fn push(&mut self, keys: &[ChunkKey], removed: bool, metadata_only: bool) {
        if self.off {
            return;
        }
        if self.pending.len() >= MAX_PENDING_EVENTS {
            self.drop_oldest_half();
        }
        self.pending.push(Logged {
            start: self.keys.len(),
            len: keys.len(),
            removed,
            metadata_only,
        });
        self.keys.extend_from_slice(keys);
    }

    /// Drops the older half of the pending events at once (amortised O(1) per event).
    fn drop_oldest_half(&mut self) {
        let n = self.pending.len() / 2;
        if self.dropped == 0 {
            tracing::warn!(
                kept = MAX_PENDING_EVENTS,
                "host-tier events are not being drained (take_events); dropping the oldest"
            );
        }
        let cut = self.pending.get(n).map_or(self.keys.len(), |e| e.start);
        self.pending.drain(..n);
        self.keys.drain(..cut);
        for e in self.pending.iter_mut() {
            e.start -= cut;
        }
        self.dropped += n as u64;
    }

    /// Keys evicted (removed from the tier).
    pub(crate) fn evicted(&mut self, keys: &[ChunkKey]) {
        if !keys.is_empty() {
            self.push(keys, true, false);
        }
    }

    /// Keys whose store completed.
    pub(crate) fn stored(&mut self, keys: &[ChunkKey]) {
        if !keys.is_empty() {
            self.push(keys, false, false);
        }
    }

    /// Keys removed because their store failed (metadata-only removal).
    pub(crate) fn store_failed(&mut self, keys: &[ChunkKey]) {
        if !keys.is_empty() {
            self.push(keys, true, true);
        }
    }

    /// Turns logging on or off; turning it off drops what is pending.
    pub(crate) fn set_logging(&mut self, on: bool) {
        self.off = !on;
        if !on {
            self.clear();
        }
    }

    /// Drops every pending event (keeps the buffers).
    pub(crate) fn clear(&mut self) {
        self.pending.clear();
        self.keys.clear();
    }

    /// Drains every pending event once; a failed-store removal keeps only the
    /// keys for which `present` is false now (not re-allocated since).
    pub(crate) fn drain(&mut self, present: impl Fn(ChunkKey) -> bool) -> Vec<OffloadEvent> {
        let mut out = Vec::with_capacity(self.pending.len());
        for e in self.pending.drain(..) {
            let mut keys = self.keys[e.start..e.start + e.len].to_vec();
            if e.metadata_only {
                keys.retain(|&k| !present(k));
                if keys.is_empty() {
                    continue;
                }
            }
            out.push(OffloadEvent {
                keys,
                removed: e.removed,
                metadata_only: e.metadata_only,
            });
        }
        self.keys.clear();
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
    fn a_log_turned_off_keeps_nothing_until_turned_on() {
        let mut log = EventLog::default();
        log.stored(&[ChunkKey(1)]);
        log.set_logging(false);
        assert_eq!(log.len(), 0, "turning it off drops what is pending");
        log.stored(&[ChunkKey(2)]);
        log.evicted(&[ChunkKey(3)]);
        log.store_failed(&[ChunkKey(4)]);
        assert!(log.drain(|_| false).is_empty());
        log.set_logging(true);
        log.evicted(&[ChunkKey(5)]);
        let got = log.drain(|_| false);
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].keys.clone(), got[0].removed),
            (vec![ChunkKey(5)], true)
        );
    }

    #[test]
    fn events_keep_their_own_keys_across_drops_and_drains() {
        let mut log = EventLog::default();
        let n = MAX_PENDING_EVENTS as u64 + 3;
        // Events of 1, 2 or 3 keys each: event i holds keys i*10 .. i*10 + len.
        let keys_of =
            |i: u64| -> Vec<ChunkKey> { (0..1 + i % 3).map(|j| ChunkKey(i * 10 + j)).collect() };
        for i in 0..n {
            if i % 2 == 0 {
                log.evicted(&keys_of(i));
            } else {
                log.stored(&keys_of(i));
            }
        }
        let kept = log.len() as u64;
        assert_eq!(log.dropped() + kept, n);
        let drained = log.drain(|_| false);
        let first = n - kept;
        for (e, i) in drained.iter().zip(first..) {
            assert_eq!(e.keys, keys_of(i), "event {i}");
            assert_eq!(e.removed, i % 2 == 0, "event {i}");
            assert!(!e.metadata_only);
        }
        assert!(log.drain(|_| false).is_empty(), "drained once");
        log.evicted(&[ChunkKey(7)]);
        assert_eq!(
            log.drain(|_| false)[0].keys,
            vec![ChunkKey(7)],
            "buffer reused from the start"
        );
    }

    #[test]
    fn cleared_events_are_gone_and_later_ones_kept() {
        let mut log = EventLog::default();
        log.stored(&[ChunkKey(1), ChunkKey(2)]);
        log.evicted(&[ChunkKey(3)]);
        log.clear();
        assert_eq!(log.len(), 0);
        assert!(log.drain(|_| false).is_empty());
        log.stored(&[ChunkKey(4)]);
        let d = log.drain(|_| false);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].keys, vec![ChunkKey(4)]);
    }

    #[test]
    fn an_undrained_log_stays_bounded_and_counts_what_it_drops() {
        let mut log = EventLog::default();
        for i in 0..(MAX_PENDING_EVENTS as u64 + 10) {
            log.store_failed(&[ChunkKey(i)]);
        }
        assert!(log.len() <= MAX_PENDING_EVENTS);
        assert_eq!(
            log.dropped() + log.len() as u64,
            MAX_PENDING_EVENTS as u64 + 10
        );
        let kept = log.len();
        let drained = log.drain(|_| false);
        assert_eq!(drained.len(), kept, "every kept event is delivered");
        assert_eq!(log.len(), 0);
        assert_eq!(
            drained.last().unwrap().keys,
            vec![ChunkKey(MAX_PENDING_EVENTS as u64 + 9)]
        );
    }
}
