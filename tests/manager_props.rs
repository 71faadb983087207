//! Property test of the host-tier manager: random call sequences, checked
//! against a small reference model after every call.
//!
//! Properties: a pinned or pending chunk is never evicted; a slot is never
//! owned by two chunks (nor handed out while quarantined); every answer and
//! every error matches the model; a rejected call changes nothing; the
//! manager's counters always equal a recount.

use std::collections::{BTreeMap, BTreeSet};

use kvoffload::manager::{LookupResult, ManagerError, OffloadManager, StoreOutcome};
use kvoffload::{ChunkId, ChunkKey, EvictionPolicyKind, RequestId};
use proptest::prelude::*;

const KEYS: u64 = 12;
const CAP: u64 = 5;

#[derive(Debug, Clone)]
enum Op {
    Lookup(u64),
    Store(Vec<u64>, Option<u64>),
    CompleteStore(Vec<u64>, u8),
    Load(Vec<u64>, Option<u64>),
    CompleteLoad(Vec<u64>),
    Touch(Vec<u64>),
    Finish(u64),
    Release(u32),
    Reset,
}

fn keys() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0..KEYS, 0..5)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..KEYS).prop_map(Op::Lookup),
        6 => (keys(), prop::option::of(0..3u64)).prop_map(|(k, r)| Op::Store(k, r)),
        5 => (keys(), 0..3u8).prop_map(|(k, o)| Op::CompleteStore(k, o)),
        4 => (keys(), prop::option::of(0..3u64)).prop_map(|(k, r)| Op::Load(k, r)),
        4 => keys().prop_map(Op::CompleteLoad),
        1 => keys().prop_map(Op::Touch),
        1 => (0..3u64).prop_map(Op::Finish),
        2 => (0..CAP as u32 + 1).prop_map(Op::Release),
        1 => Just(Op::Reset),
    ]
}

/// The reference model: key -> (slot, ref count), plus quarantined slots.
#[derive(Debug, Default, Clone, PartialEq)]
struct Model {
    chunks: BTreeMap<u64, (u32, i32)>,
    quarantined: BTreeSet<u32>,
}

impl Model {
    fn used_slots(&self) -> BTreeSet<u32> {
        let mut s: BTreeSet<u32> = self.chunks.values().map(|c| c.0).collect();
        s.extend(&self.quarantined);
        s
    }
}

fn ck(v: &[u64]) -> Vec<ChunkKey> {
    v.iter().map(|&x| ChunkKey(x)).collect()
}

fn run(policy: EvictionPolicyKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut m = OffloadManager::new(CAP, policy).unwrap();
    let mut model = Model::default();
    for (step, op) in ops.into_iter().enumerate() {
        let before_stats = m.stats();
        match &op {
            Op::Lookup(key) => {
                let expect = match model.chunks.get(key) {
                    None => LookupResult::Miss,
                    Some(&(_, -1)) => LookupResult::HitPending,
                    Some(_) => LookupResult::Hit,
                };
                prop_assert_eq!(m.lookup(ChunkKey(*key)), expect);
            }
            Op::Store(keys, req) => {
                let out = m.prepare_store(&ck(keys), req.map(RequestId));
                let mut want: Vec<u64> = Vec::new();
                for k in keys {
                    if !model.chunks.contains_key(k) && !want.contains(k) {
                        want.push(*k);
                    }
                }
                match out {
                    None => {
                        // legal only if there really was no room
                        let free = CAP as usize - model.used_slots().len();
                        let evictable = model
                            .chunks
                            .iter()
                            .filter(|(k, c)| c.1 == 0 && !keys.contains(k))
                            .count();
                        prop_assert!(
                            want.len() > free + evictable,
                            "step {step}: refused with room"
                        );
                        let after = m.stats();
                        prop_assert_eq!(
                            after.allocation_failures,
                            before_stats.allocation_failures + 1
                        );
                        prop_assert_eq!(
                            kvoffload::manager::ManagerStats {
                                allocation_failures: 0,
                                ..after
                            },
                            kvoffload::manager::ManagerStats {
                                allocation_failures: 0,
                                ..before_stats
                            },
                            "a refused store changed the state"
                        );
                    }
                    Some(out) => {
                        prop_assert_eq!(&out.keys_to_store, &ck(&want));
                        prop_assert_eq!(out.chunk_ids.len(), want.len());
                        for e in &out.evicted {
                            let c = model.chunks.remove(&e.0);
                            prop_assert!(
                                matches!(c, Some((_, 0))),
                                "step {step}: evicted {e} in state {c:?} (pinned or pending)"
                            );
                            prop_assert!(!keys.contains(&e.0), "evicted an offered key");
                        }
                        let used = model.used_slots();
                        let mut fresh = BTreeSet::new();
                        for (k, ChunkId(s)) in want.iter().zip(&out.chunk_ids) {
                            prop_assert!(*s < CAP as u32);
                            prop_assert!(
                                !used.contains(s),
                                "step {step}: slot {s} handed out twice"
                            );
                            prop_assert!(fresh.insert(*s), "slot {s} twice in one store");
                            model.chunks.insert(*k, (*s, -1));
                        }
                    }
                }
            }
            Op::CompleteStore(keys, o) => {
                let outcome = [
                    StoreOutcome::Success,
                    StoreOutcome::Failure,
                    StoreOutcome::Quarantined,
                ][*o as usize];
                let res = m.complete_store(&ck(keys), outcome, None);
                // Keys not pending in the tier (unknown, ready, listed twice)
                // are ignored, as vLLM ignores them; the others complete.
                let held = res.unwrap();
                let mut want_held = Vec::new();
                let mut ignored = 0;
                for k in keys {
                    if let Some(&(s, -1)) = model.chunks.get(k) {
                        match outcome {
                            StoreOutcome::Success => {
                                model.chunks.insert(*k, (s, 0));
                            }
                            StoreOutcome::Failure => {
                                model.chunks.remove(k);
                            }
                            StoreOutcome::Quarantined => {
                                model.chunks.remove(k);
                                model.quarantined.insert(s);
                                want_held.push(ChunkId(s));
                            }
                        }
                    } else {
                        ignored += 1;
                    }
                }
                prop_assert_eq!(held, want_held);
                prop_assert_eq!(
                    m.stats().ignored_complete_keys,
                    before_stats.ignored_complete_keys + ignored
                );
            }
            Op::Load(keys, req) => {
                let res = m.prepare_load(&ck(keys), req.map(RequestId));
                let bad = keys.iter().find_map(|k| match model.chunks.get(k) {
                    None => Some(ManagerError::UnknownKey(ChunkKey(*k))),
                    Some(&(_, -1)) => Some(ManagerError::NotReady(ChunkKey(*k))),
                    _ => None,
                });
                match bad {
                    Some(e) => prop_assert_eq!(res, Err(e)),
                    None => {
                        let got = res.unwrap();
                        for (k, c) in keys.iter().zip(&got) {
                            let entry = model.chunks.get_mut(k).unwrap();
                            prop_assert_eq!(c.0, entry.0, "co-indexed slots");
                            entry.1 += 1;
                        }
                    }
                }
            }
            Op::CompleteLoad(keys) => {
                let res = m.complete_load(&ck(keys), None);
                let mut counts: BTreeMap<u64, i32> = BTreeMap::new();
                let mut bad = None;
                for k in keys {
                    let n = counts.entry(*k).or_insert(0);
                    *n += 1;
                    match model.chunks.get(k) {
                        None => {
                            bad = Some(ManagerError::UnknownKey(ChunkKey(*k)));
                            break;
                        }
                        Some(&(_, r)) if r < *n => {
                            bad = Some(ManagerError::NotPinned(ChunkKey(*k)));
                            break;
                        }
                        _ => {}
                    }
                }
                match bad {
                    Some(e) => prop_assert_eq!(res, Err(e)),
                    None => {
                        prop_assert!(res.is_ok());
                        for (k, n) in counts {
                            model.chunks.get_mut(&k).unwrap().1 -= n;
                        }
                    }
                }
            }
            Op::Touch(keys) => m.touch(&ck(keys), None),
            Op::Finish(r) => m.request_finished(RequestId(*r)),
            Op::Release(s) => {
                let res = m.release_quarantined(&[ChunkId(*s)]);
                if model.quarantined.remove(s) {
                    prop_assert!(res.is_ok());
                } else {
                    prop_assert_eq!(res, Err(ManagerError::NotQuarantined(ChunkId(*s))));
                }
            }
            Op::Reset => {
                m.reset();
                model.chunks.clear();
            }
        }
        if let Err(e) = m.check_invariants() {
            return Err(TestCaseError::fail(format!("step {step} {op:?}: {e}")));
        }
        // the manager agrees with the model on every key and on the counters
        for key in 0..KEYS {
            let want = model.chunks.get(&key).map(|&(s, _)| ChunkId(s));
            prop_assert_eq!(m.slot_of(ChunkKey(key)), want, "step {} key {}", step, key);
        }
        let s = m.stats();
        let pending = model.chunks.values().filter(|c| c.1 == -1).count() as u32;
        let pinned = model.chunks.values().filter(|c| c.1 > 0).count() as u32;
        prop_assert_eq!(s.pending, pending);
        prop_assert_eq!(s.pinned, pinned);
        prop_assert_eq!(s.cached, model.chunks.len() as u32 - pending);
        prop_assert_eq!(s.quarantined, model.quarantined.len() as u32);
        prop_assert_eq!(m.quarantined_chunks().len(), model.quarantined.len());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn lru_manager_matches_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(EvictionPolicyKind::Lru, ops)?;
    }

    #[test]
    fn arc_manager_matches_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(EvictionPolicyKind::Arc, ops)?;
    }
}
