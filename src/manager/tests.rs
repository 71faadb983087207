//! Unit tests of the host-tier manager: the reference LRU scenario step by
//! step, the ARC scenarios, bad input, events, quarantine and reset.

use super::*;
use crate::config::EvictionPolicyKind::{Arc, Lru};

fn k(v: &[u64]) -> Vec<ChunkKey> {
    v.iter().map(|&x| ChunkKey(x)).collect()
}

fn ids(v: &[u32]) -> Vec<ChunkId> {
    v.iter().map(|&x| ChunkId(x)).collect()
}

fn mgr(cap: u64, policy: EvictionPolicyKind) -> OffloadManager {
    OffloadManager::new(cap, policy).expect("valid capacity")
}

/// Stores and completes `keys`, asserting the store could allocate.
fn store_ok(m: &mut OffloadManager, keys: &[u64]) -> PrepareStoreOutput {
    let out = m.prepare_store(&k(keys), None).expect("store allocates");
    m.complete_store(&out.keys_to_store, StoreOutcome::Success, None)
        .expect("known keys");
    m.check_invariants().unwrap();
    out
}

fn removed(ev: &[OffloadEvent]) -> Vec<Vec<ChunkKey>> {
    ev.iter()
        .filter(|e| e.removed)
        .map(|e| e.keys.clone())
        .collect()
}

fn stored(ev: &[OffloadEvent]) -> Vec<Vec<ChunkKey>> {
    ev.iter()
        .filter(|e| !e.removed)
        .map(|e| e.keys.clone())
        .collect()
}

#[test]
fn zero_or_oversized_capacity_is_a_typed_error() {
    assert_eq!(
        OffloadManager::new(0, Lru).unwrap_err(),
        ManagerError::ZeroCapacity
    );
    assert!(matches!(
        OffloadManager::new(u64::from(u32::MAX), Arc),
        Err(ManagerError::CapacityTooLarge(_))
    ));
}

/// vLLM `test_cpu_manager` (its LRU scenario, replayed call by call), step by step.
#[test]
fn lru_reference_scenario() {
    let mut m = mgr(4, Lru);
    let req = RequestId(1);

    // store [1,2] -> ids [0,1]; pending until completed; no events yet
    let out = m.prepare_store(&k(&[1, 2]), None).unwrap();
    assert_eq!(out.keys_to_store, k(&[1, 2]));
    assert_eq!(out.chunk_ids, ids(&[0, 1]));
    assert!(out.evicted.is_empty());
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::HitPending);
    assert!(m.take_events().is_empty());
    m.complete_store(&k(&[1, 2]), StoreOutcome::Success, None)
        .unwrap();
    let ev = m.take_events();
    assert_eq!(stored(&ev), vec![k(&[1, 2])]);
    assert!(removed(&ev).is_empty());
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
    assert_eq!(m.lookup(ChunkKey(2)), LookupResult::Hit);
    assert_eq!(m.lookup(ChunkKey(3)), LookupResult::Miss);

    // store [2,3,4,5] -> stores [3,4,5] in [2,3,0], evicts [1]
    let out = m.prepare_store(&k(&[2, 3, 4, 5]), None).unwrap();
    assert_eq!(out.keys_to_store, k(&[3, 4, 5]));
    assert_eq!(out.chunk_ids, ids(&[2, 3, 0]));
    assert_eq!(out.evicted, k(&[1]));
    assert_eq!(removed(&m.take_events()), vec![k(&[1])]);

    // no space: 3,4,5 are pending and 2 is the only evictable chunk
    assert_eq!(m.prepare_store(&k(&[1, 6]), None), None);
    m.check_invariants().unwrap();
    m.complete_store(&k(&[2, 3, 4, 5]), StoreOutcome::Success, None)
        .unwrap();
    assert_eq!(stored(&m.take_events()), vec![k(&[3, 4, 5])]);

    // load [2,3] -> ids [1,2], co-indexed
    assert_eq!(
        m.prepare_load(&k(&[2, 3]), Some(req)).unwrap(),
        ids(&[1, 2])
    );
    // no space while 2 and 3 are pinned
    assert_eq!(m.prepare_store(&k(&[6, 7, 8]), None), None);
    m.complete_load(&k(&[2, 3]), Some(req)).unwrap();
    m.request_finished(req);

    // store [6,7,8] evicts [4,5,3] and reuses their slots LIFO: [2,0,3]
    let out = m.prepare_store(&k(&[6, 7, 8]), None).unwrap();
    assert_eq!(out.evicted, k(&[4, 5, 3]));
    assert_eq!(out.chunk_ids, ids(&[2, 0, 3]));
    m.complete_store(&k(&[6, 7, 8]), StoreOutcome::Success, None)
        .unwrap();
    let ev = m.take_events();
    assert_eq!(removed(&ev), vec![k(&[4, 5, 3])]);
    assert_eq!(stored(&ev), vec![k(&[6, 7, 8])]);
    assert!(
        ev.iter().position(|e| e.removed) < ev.iter().position(|e| !e.removed),
        "evictions are announced before the stores that reuse their space"
    );

    // touch [2,6,7], then store [9] evicts [8]
    m.touch(&k(&[2, 6, 7]), None);
    assert_eq!(m.lru_order().unwrap(), k(&[8, 7, 6, 2]));
    let out = m.prepare_store(&k(&[9]), None).unwrap();
    assert_eq!(out.evicted, k(&[8]));
    assert_eq!(out.chunk_ids, ids(&[3]));

    // a failed store of [7,9]: 7 was already stored and stays; 9 is removed
    m.complete_store(&k(&[7, 9]), StoreOutcome::Failure, None)
        .unwrap();
    assert_eq!(m.lookup(ChunkKey(7)), LookupResult::Hit);
    assert_eq!(m.lookup(ChunkKey(9)), LookupResult::Miss);
    let ev = m.take_events();
    assert_eq!(removed(&ev), vec![k(&[8]), k(&[9])]);
    assert!(ev.last().unwrap().metadata_only);
    m.check_invariants().unwrap();
    assert_eq!(m.stats().free, 1, "9's slot went back to the pool");
}

#[test]
fn lru_request_finish_keeps_the_prefix_head_most_recent() {
    let mut m = mgr(8, Lru);
    let req = RequestId(7);
    let out = m.prepare_store(&k(&[1, 2, 3]), Some(req)).unwrap();
    m.complete_store(&out.keys_to_store, StoreOutcome::Success, Some(req))
        .unwrap();
    store_ok(&mut m, &[4]);
    m.request_finished(req);
    assert_eq!(m.lru_order().unwrap(), k(&[4, 3, 2, 1]));
    m.request_finished(req); // a second call is a no-op
    assert_eq!(m.lru_order().unwrap(), k(&[4, 3, 2, 1]));
}

#[test]
fn prepare_load_preserves_key_order() {
    let mut m = mgr(8, Lru);
    store_ok(&mut m, &[10, 11, 12, 13]);
    let got = m.prepare_load(&k(&[13, 10, 12]), None).unwrap();
    assert_eq!(got, ids(&[3, 0, 2]));
}

#[test]
fn already_stored_chunk_not_evicted_during_prepare_store() {
    for policy in [Lru, Arc] {
        let mut m = mgr(2, policy);
        store_ok(&mut m, &[1, 2]);
        // offering [1, 3]: 1 is present and protected, so 2 must go
        let out = m.prepare_store(&k(&[1, 3]), None).unwrap();
        assert_eq!(out.keys_to_store, k(&[3]));
        assert_eq!(out.evicted, k(&[2]), "{policy:?}");
        assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
        m.check_invariants().unwrap();
    }
}

#[test]
fn duplicate_offers_are_stored_once() {
    let mut m = mgr(4, Lru);
    let out = m.prepare_store(&k(&[5, 5, 6, 5]), None).unwrap();
    assert_eq!(out.keys_to_store, k(&[5, 6]));
    assert_eq!(out.chunk_ids.len(), 2);
    m.check_invariants().unwrap();
    let many: Vec<u64> = (0..100).map(|i| i % 3).collect();
    let mut m = mgr(4, Lru);
    let out = m.prepare_store(&k(&many), None).unwrap();
    assert_eq!(out.keys_to_store, k(&[0, 1, 2]));
    m.check_invariants().unwrap();
}

#[test]
fn bad_input_returns_typed_errors_and_changes_nothing() {
    let mut m = mgr(4, Lru);
    store_ok(&mut m, &[1]);
    m.prepare_store(&k(&[2]), None).unwrap(); // 2 stays pending
    let before = m.stats();

    assert_eq!(
        m.prepare_load(&k(&[1, 99]), None),
        Err(ManagerError::UnknownKey(ChunkKey(99)))
    );
    assert_eq!(
        m.prepare_load(&k(&[1, 2]), None),
        Err(ManagerError::NotReady(ChunkKey(2)))
    );
    assert_eq!(m.stats(), before, "1 was not pinned by the failed loads");

    assert_eq!(
        m.complete_load(&k(&[1]), None),
        Err(ManagerError::NotPinned(ChunkKey(1)))
    );
    m.prepare_load(&k(&[1]), None).unwrap();
    assert_eq!(
        m.complete_load(&k(&[1, 1]), None),
        Err(ManagerError::NotPinned(ChunkKey(1))),
        "pinned once, unpinned twice"
    );
    assert_eq!(m.stats().pinned, 1);
    m.complete_load(&k(&[1]), None).unwrap();

    // vLLM ignores complete_store keys that are not pending in the tier:
    // the unknown 42 and the already ready 1 are skipped and counted.
    assert_eq!(
        m.complete_store(&k(&[42, 1]), StoreOutcome::Success, None),
        Ok(vec![])
    );
    assert_eq!(m.stats().ignored_complete_keys, 2);
    assert_eq!(
        m.lookup(ChunkKey(2)),
        LookupResult::HitPending,
        "2 untouched"
    );
    let before = ManagerStats {
        ignored_complete_keys: 2,
        ..before
    };
    assert_eq!(
        m.release_quarantined(&ids(&[0])),
        Err(ManagerError::NotQuarantined(ChunkId(0)))
    );
    assert_eq!(
        m.release_quarantined(&ids(&[77])),
        Err(ManagerError::NotQuarantined(ChunkId(77)))
    );
    assert_eq!(m.stats(), before);
    m.check_invariants().unwrap();
}

#[test]
fn pinned_chunks_can_be_loaded_twice_and_need_two_unpins() {
    let mut m = mgr(2, Lru);
    store_ok(&mut m, &[1, 2]);
    m.prepare_load(&k(&[1]), None).unwrap();
    m.prepare_load(&k(&[1]), None).unwrap();
    m.complete_load(&k(&[1]), None).unwrap();
    assert_eq!(m.prepare_store(&k(&[3, 4]), None), None, "1 still pinned");
    m.complete_load(&k(&[1]), None).unwrap();
    assert!(m.prepare_store(&k(&[3, 4]), None).is_some());
    m.check_invariants().unwrap();
}

#[test]
fn failed_store_removal_is_dropped_when_the_key_is_stored_again() {
    let mut m = mgr(4, Lru);
    m.prepare_store(&k(&[1, 2]), None).unwrap();
    m.complete_store(&k(&[1, 2]), StoreOutcome::Failure, None)
        .unwrap();
    // 1 is offered again before the events are drained
    store_ok(&mut m, &[1]);
    let ev = m.take_events();
    assert_eq!(
        ev,
        vec![
            OffloadEvent {
                keys: k(&[2]),
                removed: true,
                metadata_only: true
            },
            OffloadEvent {
                keys: k(&[1]),
                removed: false,
                metadata_only: false
            },
        ]
    );
    assert!(m.take_events().is_empty(), "drained once");
}

#[test]
fn quarantined_store_leaves_lookups_but_holds_its_slot() {
    let mut m = mgr(2, Lru);
    let out = m.prepare_store(&k(&[1, 2]), None).unwrap();
    assert_eq!(out.chunk_ids, ids(&[0, 1]));
    let held = m
        .complete_store(&k(&[1]), StoreOutcome::Quarantined, None)
        .unwrap();
    assert_eq!(held, ids(&[0]));
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Miss);
    assert_eq!(m.stats().quarantined, 1);
    assert_eq!(m.quarantined_chunks(), ids(&[0]));
    m.complete_store(&k(&[2]), StoreOutcome::Success, None)
        .unwrap();
    // the tier is full: 2 is evictable, slot 0 is held
    let out = m.prepare_store(&k(&[1]), None).unwrap();
    assert_eq!(out.evicted, k(&[2]));
    assert_eq!(
        out.chunk_ids,
        ids(&[1]),
        "the quarantined slot is never reused"
    );
    assert_eq!(m.prepare_store(&k(&[3]), None), None);
    m.check_invariants().unwrap();
    // the late transfer is over: the slot comes back
    m.release_quarantined(&ids(&[0])).unwrap();
    assert_eq!(m.stats().quarantined, 0);
    assert_eq!(
        m.prepare_store(&k(&[3]), None).unwrap().chunk_ids,
        ids(&[0])
    );
    assert_eq!(
        m.release_quarantined(&ids(&[0])),
        Err(ManagerError::NotQuarantined(ChunkId(0)))
    );
    m.check_invariants().unwrap();
}

#[test]
fn reset_evicts_everything_silently_but_keeps_quarantine_and_events() {
    let mut m = mgr(4, Lru);
    store_ok(&mut m, &[1, 2]);
    m.prepare_store(&k(&[3]), None).unwrap();
    m.complete_store(&k(&[3]), StoreOutcome::Quarantined, None)
        .unwrap();
    m.prepare_store(&k(&[4]), None).unwrap();
    m.prepare_load(&k(&[1]), None).unwrap();
    let undrained = m.pending_events();
    m.reset();
    assert_eq!(
        m.pending_events(),
        undrained,
        "no per-chunk events, none lost"
    );
    for key in 1..=4 {
        assert_eq!(m.lookup(ChunkKey(key)), LookupResult::Miss);
    }
    let s = m.stats();
    assert_eq!(
        (s.cached, s.pending, s.pinned, s.quarantined, s.free),
        (0, 0, 0, 1, 3)
    );
    assert_eq!(m.generation(), 1);
    m.check_invariants().unwrap();
    // fresh ids restart in order, skipping the quarantined slot 2
    let out = m.prepare_store(&k(&[5, 6, 7]), None).unwrap();
    assert_eq!(out.chunk_ids, ids(&[0, 1, 3]));
    assert_eq!(m.prepare_store(&k(&[8]), None), None);
    m.release_quarantined(&ids(&[2])).unwrap();
    assert_eq!(
        m.prepare_store(&k(&[8]), None).unwrap().chunk_ids,
        ids(&[2])
    );
    m.check_invariants().unwrap();
}

#[test]
fn stats_split_usage_into_read_and_write() {
    let mut m = mgr(10, Lru);
    store_ok(&mut m, &[1, 2, 3]);
    m.prepare_store(&k(&[4, 5]), None).unwrap();
    m.prepare_load(&k(&[1]), None).unwrap();
    let s = m.stats();
    assert_eq!(
        (s.cached, s.pending, s.pinned, s.evictable, s.free),
        (3, 2, 1, 2, 5)
    );
    assert!((s.usage - 0.3).abs() < 1e-12);
    assert!((s.write_usage - 0.2).abs() < 1e-12);
    assert!((s.read_usage - 0.1).abs() < 1e-12);
    m.complete_store(&k(&[4, 5]), StoreOutcome::Failure, None)
        .unwrap();
    assert_eq!(
        m.stats().write_usage,
        0.0,
        "a failed store clears write usage"
    );
    // allocation sizes: 3 then 2 chunks -> bucket 1 ([2,4)) twice
    assert_eq!(m.allocation_size_histogram()[1], 2);
}

#[test]
fn allocation_failures_are_counted() {
    let mut m = mgr(1, Lru);
    m.prepare_store(&k(&[1]), None).unwrap();
    assert!(m.prepare_store(&k(&[2]), None).is_none());
    assert!(m.prepare_store(&k(&[2, 3]), None).is_none());
    assert_eq!(m.stats().allocation_failures, 2);
    // an offer of present keys only is not a failure
    assert_eq!(
        m.prepare_store(&k(&[1]), None).unwrap().keys_to_store,
        vec![]
    );
    assert_eq!(m.stats().allocation_failures, 2);
}

#[test]
fn allocation_sizes_are_kept_raw_until_taken_failures_included() {
    let mut m = mgr(1, Lru);
    m.prepare_store(&k(&[1]), None).unwrap();
    assert!(m.prepare_store(&k(&[2, 3]), None).is_none());
    // Present keys only: nothing to allocate, nothing recorded (as vLLM).
    m.prepare_store(&k(&[1]), None).unwrap();
    assert_eq!(m.take_allocation_sizes(), vec![1, 2]);
    assert!(m.take_allocation_sizes().is_empty(), "taken once");
}

#[test]
fn store_threshold_filters_first_offers() {
    let mut m = mgr(4, Lru).with_store_threshold(2, 100);
    let out = m.prepare_store(&k(&[1, 2]), None).unwrap();
    assert!(out.keys_to_store.is_empty());
    assert_eq!(m.stats().stores_skipped, 2);
    let out = m.prepare_store(&k(&[1, 3]), None).unwrap();
    assert_eq!(out.keys_to_store, k(&[1]));
    assert_eq!(m.stats().stores_skipped, 3);
    m.complete_store(&k(&[1]), StoreOutcome::Success, None)
        .unwrap();
    // a stored key is a hit however often it was offered
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
    let out = m.prepare_store(&k(&[1]), None).unwrap();
    assert!(out.keys_to_store.is_empty());
    assert_eq!(
        m.stats().stores_skipped,
        3,
        "present keys are not counted as skipped"
    );
    let cfg = OffloadConfig {
        store_threshold: 3,
        ..OffloadConfig::with_chunks(4)
    };
    let mut m = OffloadManager::from_config(&cfg).unwrap();
    for _ in 0..2 {
        assert!(
            m.prepare_store(&k(&[9]), None)
                .unwrap()
                .keys_to_store
                .is_empty()
        );
    }
    assert_eq!(
        m.prepare_store(&k(&[9]), None).unwrap().keys_to_store,
        k(&[9])
    );
}

// ---------------------------------------------------------------- ARC

fn arc(m: &OffloadManager) -> ArcState {
    m.arc_state().expect("ARC manager")
}

#[test]
fn arc_basic_store_and_lookup() {
    let mut m = mgr(4, Arc);
    assert!(m.lru_order().is_none());
    let out = store_ok(&mut m, &[1, 2]);
    assert_eq!(out.chunk_ids, ids(&[0, 1]));
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
    let s = arc(&m);
    assert_eq!((s.t1, s.t2), (k(&[1, 2]), k(&[])));
    assert_eq!(m.prepare_load(&k(&[2, 1]), None).unwrap(), ids(&[1, 0]));
}

#[test]
fn arc_t1_to_t2_promotion() {
    let mut m = mgr(4, Arc);
    store_ok(&mut m, &[1, 2]);
    m.prepare_store(&k(&[3]), None).unwrap(); // 3 pending
    m.touch(&k(&[1, 3]), None);
    let s = arc(&m);
    assert_eq!(s.t2, k(&[1]), "a ready key is promoted");
    assert_eq!(
        s.t1,
        k(&[2, 3]),
        "a pending key stays in T1, at the MRU end"
    );
    m.touch(&k(&[1]), None);
    assert_eq!(arc(&m).t2, k(&[1]), "T2 hits stay in T2");

    // a request that reads a key promotes it once at finish; its own inserts stay in T1
    let req = RequestId(1);
    m.prepare_load(&k(&[2]), Some(req)).unwrap();
    m.complete_load(&k(&[2]), Some(req)).unwrap();
    m.prepare_store(&k(&[4]), Some(req)).unwrap();
    m.request_finished(req);
    let s = arc(&m);
    assert_eq!(s.t2, k(&[1, 2]));
    assert_eq!(s.t1, k(&[3, 4]));
    m.check_invariants().unwrap();
}

#[test]
fn arc_pinned_keys_are_never_evicted() {
    let mut m = mgr(4, Arc);
    store_ok(&mut m, &[1, 2, 3, 4]);
    m.prepare_load(&k(&[1, 2]), None).unwrap();
    let out = store_ok(&mut m, &[5, 6]);
    assert_eq!(out.evicted, k(&[3, 4]));
    assert_eq!(
        m.prepare_store(&k(&[7, 8, 9]), None),
        None,
        "only 5 and 6 are evictable"
    );
    let out = store_ok(&mut m, &[7, 8]);
    assert_eq!(out.evicted, k(&[5, 6]));
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
    assert_eq!(m.lookup(ChunkKey(2)), LookupResult::Hit);
    m.complete_load(&k(&[1, 2]), None).unwrap();
    assert_eq!(store_ok(&mut m, &[9]).evicted, k(&[1]));
}

#[test]
fn arc_adaptive_target_and_t1_t2_choice() {
    let mut m = mgr(2, Arc);
    store_ok(&mut m, &[1]);
    m.touch(&k(&[1]), None); // T2 = [1]
    store_ok(&mut m, &[2]); // T1 = [2]
    // |T1| = 1 >= target 0: evict from T1
    assert_eq!(store_ok(&mut m, &[3]).evicted, k(&[2]));
    assert_eq!(arc(&m).b1, k(&[2]));
    // 2 comes back from B1: target grows by max(1, |B2|/|B1|) = 1
    assert_eq!(
        store_ok(&mut m, &[2]).evicted,
        k(&[3]),
        "|T1| = 1 >= int(1)"
    );
    let s = arc(&m);
    assert_eq!(s.target_t1, 1.0);
    assert_eq!(s.b1, k(&[3]), "2 left the ghost list when stored again");
    m.touch(&k(&[2]), None); // T2 = [1, 2], T1 = []
    // |T1| = 0 < target 1: evict from T2's LRU end
    assert_eq!(store_ok(&mut m, &[4]).evicted, k(&[1]));
    assert_eq!(arc(&m).b2, k(&[1]));
    // 1 comes back from B2: target shrinks by max(1, |B1|/|B2|) = 1, floored at 0
    assert_eq!(store_ok(&mut m, &[1]).evicted, k(&[4]));
    let s = arc(&m);
    assert_eq!(s.target_t1, 0.0);
    assert_eq!((s.t1, s.t2), (k(&[1]), k(&[2])));
    m.check_invariants().unwrap();
}

#[test]
fn arc_target_is_capped_at_capacity() {
    let mut m = mgr(2, Arc);
    for round in 0..6u64 {
        // cycle 3 keys through a 2-slot cache: every store is a B1 hit after warm-up
        store_ok(&mut m, &[round % 3 + 10]);
    }
    assert!(arc(&m).target_t1 <= 2.0);
}

#[test]
fn arc_batch_eviction_is_atomic() {
    let mut m = mgr(4, Arc);
    store_ok(&mut m, &[1, 2, 3, 4]);
    m.prepare_load(&k(&[1, 2]), None).unwrap();
    let before = arc(&m);
    // 3 and 4 are evictable by count, but both are offered (protected)
    assert_eq!(m.prepare_store(&k(&[3, 4, 5, 6]), None), None);
    assert_eq!(arc(&m), before, "a failed batch evicts nothing");
    m.check_invariants().unwrap();
    // falls back from T2 to T1 when T2 cannot satisfy the batch
    let mut m = mgr(4, Arc);
    store_ok(&mut m, &[1, 2, 3, 4]);
    m.touch(&k(&[1, 2]), None); // T2 = [2, 1], T1 = [3, 4]
    m.prepare_load(&k(&[1]), None).unwrap();
    let out = store_ok(&mut m, &[5, 6, 7]);
    assert_eq!(out.evicted.len(), 3);
    assert!(!out.evicted.contains(&ChunkKey(1)));
    assert_eq!(m.lookup(ChunkKey(1)), LookupResult::Hit);
}

#[test]
fn arc_ghost_lists_are_bounded_by_capacity() {
    let mut m = mgr(2, Arc);
    for key in 1..=10 {
        store_ok(&mut m, &[key]);
        let s = arc(&m);
        assert!(s.b1.len() <= 2 && s.b2.len() <= 2);
    }
    assert_eq!(arc(&m).b1, k(&[7, 8]));
}

#[test]
fn arc_touch_makes_the_first_key_most_recent() {
    let mut m = mgr(4, Arc);
    store_ok(&mut m, &[1, 2, 3]);
    m.touch(&k(&[3, 1]), None);
    assert_eq!(arc(&m).t2, k(&[1, 3]));
    assert_eq!(arc(&m).t1, k(&[2]));
}

#[test]
fn arc_failed_store_cleans_up() {
    let mut m = mgr(2, Arc);
    m.prepare_store(&k(&[1, 2]), None).unwrap();
    m.complete_store(&k(&[1]), StoreOutcome::Success, None)
        .unwrap();
    m.complete_store(&k(&[2]), StoreOutcome::Failure, None)
        .unwrap();
    assert_eq!(m.lookup(ChunkKey(2)), LookupResult::Miss);
    let s = arc(&m);
    assert_eq!(
        (s.t1, s.b1.len()),
        (k(&[1]), 0),
        "a failed store leaves no ghost"
    );
    assert_eq!(store_ok(&mut m, &[3]).chunk_ids, ids(&[1]));
    m.check_invariants().unwrap();
}

#[test]
fn quarantine_pinned_holds_the_slots_of_a_stalled_load_across_reset() {
    let mut m = mgr(3, Lru);
    store_ok(&mut m, &[1, 2, 3]);
    assert_eq!(
        m.quarantine_pinned(&k(&[1])),
        Err(ManagerError::NotPinned(ChunkKey(1)))
    );
    assert_eq!(
        m.quarantine_pinned(&k(&[9])),
        Err(ManagerError::UnknownKey(ChunkKey(9)))
    );
    m.prepare_load(&k(&[1, 2]), None).unwrap();
    let held = m.quarantine_pinned(&k(&[2, 2])).unwrap();
    assert_eq!(held, ids(&[1]), "a key listed twice is quarantined once");
    assert_eq!(m.lookup(ChunkKey(2)), LookupResult::Miss);
    m.check_invariants().unwrap();
    m.reset();
    let out = m.prepare_store(&k(&[4, 5, 6]), None);
    assert!(
        out.is_none(),
        "only two slots are free while slot 1 is held"
    );
    assert_eq!(
        m.prepare_store(&k(&[4, 5]), None).unwrap().chunk_ids,
        ids(&[0, 2])
    );
    m.release_quarantined(&held).unwrap();
    m.check_invariants().unwrap();
}
