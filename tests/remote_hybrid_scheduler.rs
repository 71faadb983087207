//! The control plane with several KV groups (full attention and sliding
//! windows) and a remote tier behind the host tier, over the in-memory
//! store: a lookup whose host-tier hit could go further asks the remote tier
//! about every group's chunks, fetches what the hit over both tiers reads,
//! and then answers the hit vLLM's lookup gives over those chunks; a fetch
//! that fails leaves the request to the host tier without asking again;
//! with hashes finer than the blocks, a Mamba state inside a block (a
//! partial tail) is asked about and fetched after the complete chunks;
//! nothing is held once the requests are gone. Manual clocks; no test
//! sleeps.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::memory_tier::MemoryStore;
use kvoffload::remote::WritePolicy;
use kvoffload::scheduler::hybrid::{
    BridgeAnswer, GroupAlloc, GroupKeys, GroupShape, HybridLookup, KeyState, KvGroups,
    PartialAnswer, PartialLookup, Retention, lookup_complete_chunks_with_ends,
    lookup_partial_tail_bridged,
};
use kvoffload::scheduler::{
    CompletionReport, LookupOutcome, RequestCaps, Scheduler, StepInput, StepPlan,
};
use kvoffload::{BlockHash, ChunkKey, GpuBlockId, JobId, ManualClock, OffloadConfig, RequestId};
use proptest::prelude::*;

const WAIT: Duration = Duration::from_secs(20);
const TPB: u64 = 4;

struct Rig {
    s: Scheduler,
    store: MemoryStore,
    shapes: Vec<GroupShape>,
    bpc: u64,
    /// The lookups [`Rig::settle`] made (each one a step the request waits
    /// while it answers "not yet").
    lookups_made: usize,
}

/// A scheduler of 4-token blocks, `bpc` blocks a chunk, 256 host chunks and
/// one worker, with `shapes`' groups and a remote tier on an in-memory store.
fn rig(shapes: Vec<GroupShape>, bpc: u64) -> Rig {
    let cfg = OffloadConfig {
        tokens_per_block: TPB as u32,
        blocks_per_chunk: bpc as u32,
        offload_prompt_only: false,
        ..OffloadConfig::with_chunks(256)
    };
    let clock = ManualClock::new();
    let groups = KvGroups {
        shapes: shapes.clone(),
        retention: Retention::BoundariesOnly,
    };
    let mut s = Scheduler::with_groups(&cfg, groups, clock.shared()).expect("scheduler");
    let store = MemoryStore::new(0x4B1D);
    s.attach_remote(store.tier(1, WritePolicy::Through, &clock));
    Rig {
        s,
        store,
        shapes,
        bpc,
        lookups_made: 0,
    }
}

fn full_and_window(window_tokens: u64) -> Vec<GroupShape> {
    let tpc = TPB; // one block a chunk
    vec![
        GroupShape::full_attention(tpc).unwrap(),
        GroupShape::sliding_window(tpc, window_tokens).unwrap(),
    ]
}

fn hashes(family: u64, blocks: u64) -> Vec<BlockHash> {
    (0..blocks).map(|i| BlockHash(family * 1000 + i)).collect()
}

impl Rig {
    /// The key of chunk `chunk` of `group` of a request of `family`.
    fn key(&self, family: u64, group: usize, chunk: usize) -> ChunkKey {
        let last = family * 1000 + (chunk as u64 + 1) * self.bpc - 1;
        ChunkKey::for_group(BlockHash(last), group as u32)
    }

    /// The worker's share of `k` in the store, as write-through leaves it.
    fn put(&self, k: ChunkKey) {
        self.store.put_share(k, 0, 7);
    }

    /// Request `req` of family 1: a 6-block prompt of 24 tokens whose
    /// chunks of both groups the remote tier holds, less those `missing`.
    fn prompt_in_the_remote_tier(&mut self, req: RequestId, missing: &[(usize, usize)]) {
        self.s.add_request(req, 24, &hashes(1, 6)).unwrap();
        for g in 0..2 {
            for c in 0..6 {
                if !missing.contains(&(g, c)) {
                    self.put(self.key(1, g, c));
                }
            }
        }
    }

    /// The requests finish: nothing is left behind.
    fn finish(&mut self, reqs: &[u64]) {
        for &q in reqs {
            self.s.request_finished(RequestId(q), &[], true, 0).unwrap();
        }
        self.step();
        assert_eq!(self.s.remote_probes(), 0);
        assert!(self.s.check_invariants().is_ok());
    }

    fn step(&mut self) -> StepPlan {
        self.s.build_step(&StepInput::default()).expect("step")
    }

    fn report(&mut self, job: JobId, failed: bool) {
        let out = self.s.on_worker_output(&CompletionReport {
            completed: vec![(job, 1)],
            failed: if failed { vec![job] } else { vec![] },
        });
        assert!(out.rejected.is_empty(), "{:?}", out.rejected);
    }

    /// Looks `req` up from no GPU hit until it answers, answering the
    /// remote lookups and completing (or failing) each fetch job; returns
    /// the answer and the keys fetched.
    fn settle(&mut self, req: RequestId, fail_fetches: bool) -> (u64, Vec<ChunkKey>) {
        let mut fetched = Vec::new();
        for _ in 0..10 {
            self.lookups_made += 1;
            match self.s.lookup(req, 0).expect("lookup") {
                LookupOutcome::Hit(h) => return (h, fetched),
                LookupOutcome::Defer => {}
            }
            self.s.wait_remote_lookups(WAIT);
            let plan = self.step();
            for f in &plan.fetches {
                assert!(f.block_ids.is_empty(), "a fetch moves no GPU block");
                let spans: u32 = f.groups.iter().map(|g| g.num_keys).sum();
                assert_eq!(spans as usize, f.keys.len(), "every key in a group span");
                assert_eq!(f.groups.len(), self.shapes.len());
                // The spans split the keys in order: group 0's keys are the
                // tests' small hashes, the other groups' are mixed.
                let mut at = 0;
                for (g, span) in f.groups.iter().enumerate() {
                    for k in &f.keys[at..at + span.num_keys as usize] {
                        assert_eq!(k.0 < 1 << 40, g == 0, "{k:?} in group {g}'s span");
                    }
                    at += span.num_keys as usize;
                }
                fetched.extend(f.keys.iter().copied());
                self.report(f.job, fail_fetches);
            }
        }
        panic!("the lookup never answered");
    }
}

/// vLLM's lookup over chunks that are all in the host tier (the oracle).
struct Present<'a> {
    num_keys: usize,
    present: &'a HashSet<(usize, usize)>,
}

impl GroupKeys for Present<'_> {
    fn num_keys(&self, _group: usize) -> usize {
        self.num_keys
    }
    fn state(&mut self, group: usize, chunk: usize) -> KeyState {
        if self.present.contains(&(group, chunk)) {
            KeyState::Hit
        } else {
            KeyState::Miss
        }
    }
    fn being_loaded(&self, _group: usize, _chunk: usize) -> bool {
        false
    }
}

fn oracle(
    shapes: &[GroupShape],
    num_tokens: u64,
    num_keys: usize,
    cap: Option<u64>,
    present: &HashSet<(usize, usize)>,
) -> u64 {
    oracle_with_ends(shapes, num_tokens, num_keys, cap, present).0
}

/// [`oracle`], with each group's end of the chunks its prefix scan found.
fn oracle_with_ends(
    shapes: &[GroupShape],
    num_tokens: u64,
    num_keys: usize,
    cap: Option<u64>,
    present: &HashSet<(usize, usize)>,
) -> (u64, Vec<usize>) {
    let lookup = HybridLookup {
        computed: 0,
        num_tokens,
        max_load_tokens: cap,
        max_new_tokens: None,
    };
    let mut ends = Vec::new();
    let mut keys = Present { num_keys, present };
    let hit = lookup_complete_chunks_with_ends(shapes, &mut keys, lookup, &mut ends);
    (hit.expect("no wait"), ends)
}

#[test]
fn a_prefix_and_its_window_are_fetched_from_the_remote_tier_then_hit() {
    // Full attention and an 8-token window (two chunks); a 6-block prompt
    // of 24 tokens: the hit leaves the last token (23 tokens).
    let mut t = rig(full_and_window(8), 1);
    let req = RequestId(1);
    t.prompt_in_the_remote_tier(req, &[]);
    let (hit, fetched) = t.settle(req, false);
    assert_eq!(hit, 23);
    // The full-attention prefix and the window before token 23 (chunks 4
    // and 5): not the window's earlier chunks.
    let mut want: Vec<ChunkKey> = (0..6).map(|c| t.key(1, 0, c)).collect();
    want.extend([t.key(1, 1, 4), t.key(1, 1, 5)]);
    assert_eq!(fetched, want);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!((st.lookups, st.fetch_jobs, st.chunks_fetched), (1, 1, 8));
    // Another request over the same prefix finds it in the host tier; it
    // asks the remote tier only about what could go further (nothing here).
    t.s.add_request(RequestId(2), 24, &hashes(1, 6)).unwrap();
    assert_eq!(t.s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Hit(23));
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 1);
    t.finish(&[1, 2]);
}

#[test]
fn a_window_the_remote_tier_lacks_ends_the_hit_where_a_whole_window_is() {
    // The full-attention prefix is all there, the window's chunks 3 and 4
    // are not: the hit ends where the window's chunks 1 and 2 end.
    let mut t = rig(full_and_window(8), 1);
    let req = RequestId(1);
    t.prompt_in_the_remote_tier(req, &[(1, 0), (1, 3), (1, 4), (1, 5)]);
    let (hit, fetched) = t.settle(req, false);
    assert_eq!(hit, 12);
    let mut want: Vec<ChunkKey> = (0..3).map(|c| t.key(1, 0, c)).collect();
    want.extend([t.key(1, 1, 1), t.key(1, 1, 2)]);
    assert_eq!(fetched, want);
    t.finish(&[1]);
}

#[test]
fn a_failed_fetch_leaves_the_request_to_the_host_tier_without_asking_again() {
    let mut t = rig(full_and_window(8), 1);
    let req = RequestId(1);
    t.prompt_in_the_remote_tier(req, &[]);
    let (hit, fetched) = t.settle(req, true);
    assert_eq!(hit, 0, "nothing reached the host tier");
    assert_eq!(fetched.len(), 8);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!((st.lookups, st.fetch_jobs, st.fetches_failed), (1, 1, 1));
    assert_eq!(t.s.lookup(req, 0).unwrap(), LookupOutcome::Hit(0));
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 1);
    t.finish(&[1]);
}

#[test]
fn a_request_gone_or_a_reset_with_a_lookup_or_a_fetch_in_flight_leaks_nothing() {
    let mut t = rig(full_and_window(8), 1);
    // Request 1 leaves with its lookup in flight.
    t.prompt_in_the_remote_tier(RequestId(1), &[]);
    assert_eq!(t.s.lookup(RequestId(1), 0).unwrap(), LookupOutcome::Defer);
    t.s.request_finished(RequestId(1), &[], true, 0).unwrap();
    // Request 2 leaves with its fetch in flight.
    t.s.add_request(RequestId(2), 24, &hashes(1, 6)).unwrap();
    assert_eq!(t.s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Defer);
    let plan = t.step();
    assert_eq!(plan.fetches.len(), 1);
    t.s.request_finished(RequestId(2), &[], true, 0).unwrap();
    t.report(plan.fetches[0].job, false);
    t.finish(&[]);
    // A reset with a lookup in flight forgets it.
    t.s.add_request(RequestId(3), 24, &hashes(2, 6)).unwrap();
    t.put(t.key(2, 0, 0));
    assert_eq!(t.s.lookup(RequestId(3), 0).unwrap(), LookupOutcome::Defer);
    assert!(t.s.reset().is_ok());
    assert_eq!(t.s.remote_probes(), 0, "the reset forgets the lookup");
    t.finish(&[3]);
}

#[test]
fn caps_bound_the_hit_over_both_tiers_and_a_request_may_skip_the_remote_tier() {
    let mut t = rig(full_and_window(8), 1);
    // Request 1 skips the remote tier: answered from the host tier at once.
    t.prompt_in_the_remote_tier(RequestId(1), &[]);
    let skip = RequestCaps {
        skip_remote_tier: true,
        ..Default::default()
    };
    t.s.set_request_caps(RequestId(1), skip).unwrap();
    assert_eq!(t.s.lookup(RequestId(1), 0).unwrap(), LookupOutcome::Hit(0));
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 0);
    assert!(t.step().fetches.is_empty());
    // Request 2 may load 13 tokens: whole chunks (12 tokens), so the
    // full-attention chunks 0..3 and the window's chunks 1 and 2, no more.
    t.s.add_request(RequestId(2), 24, &hashes(1, 6)).unwrap();
    let capped = RequestCaps {
        max_load_tokens: Some(13),
        ..Default::default()
    };
    t.s.set_request_caps(RequestId(2), capped).unwrap();
    let (hit, fetched) = t.settle(RequestId(2), false);
    assert_eq!(hit, 12);
    let mut want: Vec<ChunkKey> = (0..3).map(|c| t.key(1, 0, c)).collect();
    want.extend([t.key(1, 1, 1), t.key(1, 1, 2)]);
    assert_eq!(fetched, want);
    t.finish(&[1, 2]);
}

fn shapes_strategy() -> impl Strategy<Value = (Vec<GroupShape>, u64)> {
    (
        1u64..=2,
        1u64..=4,
        prop::option::of(1u64..=6),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(bpc, w1, w2, with_full, local, eagle)| {
            let tpc = TPB * bpc;
            let mut shapes = Vec::new();
            if with_full {
                // With an EAGLE drafter's layers or not (a hit needs the
                // chunk after its end too).
                let full = GroupShape::full_attention(tpc).unwrap();
                shapes.push(if eagle { full.eagle_draft() } else { full });
            }
            shapes.push(GroupShape::sliding_window(tpc, w1 * TPB).unwrap());
            if let Some(w) = w2 {
                // The second windowed group: a sliding window or chunked-local
                // attention (Llama 4's local layers).
                shapes.push(if local {
                    GroupShape::chunked_local(tpc, w * TPB).unwrap()
                } else {
                    GroupShape::sliding_window(tpc, w * TPB).unwrap()
                });
            }
            (shapes, bpc)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Whatever part of every group the remote tier holds, a request whose
    /// host tier is empty ends with the hit vLLM's lookup gives over those
    /// chunks (as if they were in the host tier), having fetched only
    /// chunks the remote tier holds and the hit reads, after one remote
    /// lookup, within the request's `max_load_tokens`; a failed fetch ends
    /// at no hit. A second request then reads the host tier's chunks and
    /// fetches only the rest.
    #[test]
    fn the_hit_over_both_tiers_is_vllm_s_lookup_over_the_chunks_they_hold(
        (shapes, bpc) in shapes_strategy(),
        blocks in 1u64..=14,
        extra_tokens in 0u64..4,
        held in prop::collection::vec(any::<bool>(), 3 * 14),
        more in prop::collection::vec(any::<bool>(), 3 * 14),
        fail in any::<bool>(),
        cap in prop::option::of(0u64..64),
    ) {
        let mut t = rig(shapes.clone(), bpc);
        let req = RequestId(1);
        let num_tokens = blocks * TPB + extra_tokens;
        let num_keys = (blocks / bpc) as usize;
        t.s.add_request(req, num_tokens, &hashes(1, blocks)).unwrap();
        let caps = RequestCaps { max_load_tokens: cap, ..Default::default() };
        t.s.set_request_caps(req, caps).unwrap();
        let mut present = HashSet::new();
        for g in 0..shapes.len() {
            for c in 0..num_keys {
                if held[g * 14 + c] {
                    present.insert((g, c));
                    t.put(t.key(1, g, c));
                }
            }
        }
        let want = oracle(&shapes, num_tokens, num_keys, cap, &present);
        let (hit, fetched) = t.settle(req, fail);
        prop_assert_eq!(hit, if fail && !fetched.is_empty() { 0 } else { want });
        let tpc = TPB * bpc;
        for k in &fetched {
            let place = (0..shapes.len())
                .flat_map(|g| (0..num_keys).map(move |c| (g, c)))
                .find(|&(g, c)| t.key(1, g, c) == *k);
            let Some((g, c)) = place else {
                return Err(TestCaseError::fail(format!("fetched a key of no chunk: {k:?}")));
            };
            prop_assert!(present.contains(&(g, c)), "fetched ({g}, {c}), which the remote tier lacks");
            // A draft group's hit needs the chunk after its end as well.
            let peek = u64::from(shapes[g].is_eagle_draft()) * tpc;
            prop_assert!((c as u64) * tpc < want + peek, "fetched ({g}, {c}) past the hit {want}");
        }
        let st = t.s.remote_lookup_stats().unwrap();
        prop_assert!(st.lookups <= 1 && st.fetch_jobs <= 1, "{st:?}");
        prop_assert_eq!(st.fetch_jobs == 1, !fetched.is_empty());
        t.s.request_finished(req, &[], true, 0).unwrap();
        t.step();
        prop_assert_eq!(t.s.remote_probes(), 0);

        // The remote tier gains more chunks; a second request over the same
        // prompt finds what the first fetched in the host tier and the rest
        // in the remote tier: vLLM's lookup over both.
        for g in 0..shapes.len() {
            for c in 0..num_keys {
                if more[g * 14 + c] && present.insert((g, c)) {
                    t.put(t.key(1, g, c));
                }
            }
        }
        let want = oracle(&shapes, num_tokens, num_keys, cap, &present);
        let second = RequestId(2);
        t.s.add_request(second, num_tokens, &hashes(1, blocks)).unwrap();
        t.s.set_request_caps(second, caps).unwrap();
        let (hit, fetched_again) = t.settle(second, false);
        prop_assert_eq!(hit, want);
        for k in &fetched_again {
            prop_assert!(fail || !fetched.contains(k), "fetched {k:?} again, which the host tier holds");
        }
        t.s.request_finished(second, &[], true, 0).unwrap();
        t.step();
        prop_assert_eq!(t.s.remote_probes(), 0);
        prop_assert!(t.s.check_invariants().is_ok());
    }
}

/// Full attention and a Mamba state, 4-token blocks, a hash every `tph`
/// tokens: partial tails on.
fn full_and_state_with_tails(tph: u64) -> Rig {
    let shapes = vec![
        GroupShape::full_attention(TPB).unwrap(),
        GroupShape::recurrent_state(TPB).unwrap(),
    ];
    let mut t = rig(shapes, 1);
    t.s.enable_partial_tails(tph).unwrap();
    t
}

/// A request of `family` over `tokens` tokens with a hash every `tph`
/// tokens: its hashes, and its block hashes (every block's last).
fn units(family: u64, tokens: u64, tph: u64) -> (Vec<BlockHash>, Vec<BlockHash>) {
    let units: Vec<BlockHash> = (0..tokens / tph)
        .map(|i| BlockHash(family * 1000 + 100 + i))
        .collect();
    let per_block = (TPB / tph) as usize;
    let blocks = units
        .iter()
        .skip(per_block - 1)
        .step_by(per_block)
        .copied()
        .collect();
    (units, blocks)
}

impl Rig {
    /// Puts both groups' keys at hash units `range` of `units`.
    fn put_units(&self, units: &[BlockHash], range: std::ops::Range<usize>) {
        for unit in range {
            for g in 0..2 {
                self.put(unit_key(units, unit, g));
            }
        }
    }

    /// Adds request `req` over `units` (partial tails on).
    fn add_with_units(
        &mut self,
        req: RequestId,
        tokens: u64,
        units: &(Vec<BlockHash>, Vec<BlockHash>),
    ) {
        self.s.add_request(req, tokens, &units.1).unwrap();
        self.s.add_hash_units(req, &units.0).unwrap();
    }
}

/// Group `group`'s key of the chunk ending on hash unit `unit` (a block's
/// chunk or a partial tail: vLLM's key at that boundary).
fn unit_key(units: &[BlockHash], unit: usize, group: u32) -> ChunkKey {
    ChunkKey::for_group(units[unit], group)
}

#[test]
fn a_mamba_state_inside_a_block_is_asked_about_and_fetched_with_the_complete_chunks() {
    // A 23-token prompt, a hash every 2 tokens: complete chunks to 20, and
    // the partial tail at 22 (the prompt's last token is computed).
    let mut t = full_and_state_with_tails(2);
    let u = units(1, 23, 2);
    t.put_units(&u.0, 0..u.0.len());
    let req = RequestId(1);
    t.add_with_units(req, 23, &u);
    let (hit, fetched) = t.settle(req, false);
    assert_eq!(hit, 22);
    // One remote lookup and one fetch, its keys group by group (its spans
    // split them in order): the full-attention chunks and its key at 22,
    // then the state at 20 and the one at 22.
    let mut want: Vec<ChunkKey> = [1, 3, 5, 7, 9, 10]
        .iter()
        .map(|&i| unit_key(&u.0, i, 0))
        .collect();
    want.extend([unit_key(&u.0, 9, 1), unit_key(&u.0, 10, 1)]);
    assert_eq!(fetched, want);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (
            st.lookups,
            st.fetch_jobs,
            st.chunks_fetched,
            st.partial_tails_fetched
        ),
        (1, 1, 8, 1)
    );
    // The load reads the full-attention chunks, then the tail into block
    // 6 and the state at 22 into the Mamba group's block at index 5; its
    // tokens count as the remote tier's.
    let (b0, b1): (Vec<GpuBlockId>, Vec<GpuBlockId>) = (
        (1..=6).map(GpuBlockId).collect(),
        [0, 0, 0, 0, 0, 17].into_iter().map(GpuBlockId).collect(),
    );
    let (cached0, cached1) = (vec![false; 6], vec![false; 6]);
    let groups = [
        GroupAlloc {
            block_ids: &b0,
            cached: &cached0,
        },
        GroupAlloc {
            block_ids: &b1,
            cached: &cached1,
        },
    ];
    let job =
        t.s.on_alloc_groups(req, &groups, 22)
            .unwrap()
            .expect("a load");
    let plan = t.step();
    let load = plan.loads.iter().find(|l| l.job == job).expect("the load");
    let mut keys: Vec<ChunkKey> = [1, 3, 5, 7, 9, 10]
        .iter()
        .map(|&i| unit_key(&u.0, i, 0))
        .collect();
    keys.push(unit_key(&u.0, 10, 1));
    assert_eq!(load.keys.to_vec(), keys);
    assert_eq!(
        load.block_ids.to_vec(),
        [1, 2, 3, 4, 5, 6, 17].map(GpuBlockId).to_vec()
    );
    let sources = t.s.hit_sources(req, 22).unwrap();
    assert_eq!((sources.remote_tokens, sources.host_tokens), (22, 0));
    t.report(job, false);
    // A second request over the same prompt finds it all in the host tier.
    t.add_with_units(RequestId(2), 23, &u);
    assert_eq!(t.s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Hit(22));
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 1);
    t.finish(&[1, 2]);
}

#[test]
fn a_partial_tail_one_group_lacks_or_a_failed_fetch_leaves_the_complete_hit() {
    let mut t = full_and_state_with_tails(1);
    // A 15-token prompt, a hash every token: complete chunks to 12; the
    // Mamba state at 13 without its attention block, the attention block
    // at 14 without its state: no boundary has both, the hit ends at 12.
    let u = units(1, 15, 1);
    t.put_units(&u.0, 0..12);
    t.put(unit_key(&u.0, 12, 1));
    t.put(unit_key(&u.0, 13, 0));
    t.add_with_units(RequestId(1), 15, &u);
    let (hit, _) = t.settle(RequestId(1), false);
    assert_eq!(hit, 12);
    // One remote lookup settled the chunks and the tails.
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (st.lookups, st.fetch_jobs, st.partial_tails_fetched),
        (1, 1, 0)
    );
    // Both groups at 13 now, but the tail's fetch fails: the complete hit
    // stands, and the request does not ask again.
    t.put(unit_key(&u.0, 12, 0));
    t.add_with_units(RequestId(2), 15, &u);
    let mut fetched_tail = false;
    for _ in 0..6 {
        match t.s.lookup(RequestId(2), 0).unwrap() {
            LookupOutcome::Hit(h) => {
                assert_eq!(h, 12);
                break;
            }
            LookupOutcome::Defer => {}
        }
        t.s.wait_remote_lookups(WAIT);
        let plan = t.step();
        for f in &plan.fetches {
            assert_eq!(
                f.keys.to_vec(),
                vec![unit_key(&u.0, 12, 0), unit_key(&u.0, 12, 1)]
            );
            fetched_tail = true;
            t.report(f.job, true);
        }
    }
    assert!(fetched_tail);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (st.lookups, st.fetches_failed, st.partial_tails_fetched),
        (2, 1, 0)
    );
    assert_eq!(t.s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Hit(12));
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 2);
    t.finish(&[1, 2]);
}

#[test]
fn a_tail_before_the_furthest_complete_hit_is_asked_about_in_a_second_lookup() {
    // A 23-token prompt, a hash every 2 tokens; the remote tier lacks full
    // attention's chunk 4 (tokens 16 to 20) but holds both groups' keys at
    // 18 and 22. The first lookup asks about the chunks and the tails past
    // 20 (the furthest the complete chunks could reach); the complete hit
    // ends at 16, so the tail at 22 is of no use and a second lookup asks
    // about the block after 16 as the fetch of the complete chunks starts:
    // the hit ends at 18.
    let mut t = full_and_state_with_tails(2);
    let u = units(1, 23, 2);
    t.put_units(&u.0, 0..9);
    t.put(unit_key(&u.0, 9, 1));
    t.put_units(&u.0, 10..11);
    t.add_with_units(RequestId(1), 23, &u);
    let (hit, fetched) = t.settle(RequestId(1), false);
    assert_eq!(hit, 18);
    let mut want: Vec<ChunkKey> = [1, 3, 5, 7].iter().map(|&i| unit_key(&u.0, i, 0)).collect();
    want.push(unit_key(&u.0, 7, 1));
    want.extend([unit_key(&u.0, 8, 0), unit_key(&u.0, 8, 1)]);
    assert_eq!(fetched, want);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (st.lookups, st.fetch_jobs, st.partial_tails_fetched),
        (2, 2, 1)
    );
    // Asked, fetching the complete chunks (the tails asked about meanwhile),
    // fetching the tail, hit: without the tails' lookup sent with the first
    // fetch, one "not yet" more, while the second lookup is answered.
    assert_eq!(t.lookups_made, 4);
    t.finish(&[1]);
}

/// The rig of [`a_tail_before_the_furthest_complete_hit_is_asked_about_in_a_second_lookup`]
/// with request `req`'s complete chunks being fetched and its partial
/// tails asked about: the fetch job.
fn fetching_with_tails_asked(t: &mut Rig, req: RequestId) -> JobId {
    let u = units(1, 23, 2);
    t.put_units(&u.0, 0..9);
    t.put(unit_key(&u.0, 9, 1));
    t.put_units(&u.0, 10..11);
    t.add_with_units(req, 23, &u);
    assert_eq!(t.s.lookup(req, 0).unwrap(), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.s.lookup(req, 0).unwrap(), LookupOutcome::Defer);
    let plan = t.step();
    assert_eq!(plan.fetches.len(), 1);
    assert_eq!(
        t.s.remote_lookup_stats().unwrap().lookups,
        2,
        "the tails asked about"
    );
    plan.fetches[0].job
}

#[test]
fn the_tails_asked_about_with_a_fetch_are_dropped_when_it_fails_or_its_request_goes() {
    // The fetch fails: the tails' answer goes with it, and the request
    // recomputes from the host tier's hit (none), asking about the tails
    // past it once more.
    let mut t = full_and_state_with_tails(2);
    let job = fetching_with_tails_asked(&mut t, RequestId(1));
    t.s.wait_remote_lookups(WAIT);
    t.report(job, true);
    let (hit, fetched) = t.settle(RequestId(1), false);
    // From no hit, the tail at 2 (both groups' keys at the first hash).
    let u = units(1, 23, 2);
    assert_eq!(hit, 2);
    assert_eq!(fetched, [unit_key(&u.0, 0, 0), unit_key(&u.0, 0, 1)]);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (
            st.lookups,
            st.fetch_jobs,
            st.fetches_failed,
            st.partial_tails_fetched
        ),
        (3, 2, 1, 1)
    );
    t.finish(&[1]);
    // The request goes while its fetch runs and the tails' answer is in
    // flight, then while it has come.
    for answered in [false, true] {
        let mut t = full_and_state_with_tails(2);
        let job = fetching_with_tails_asked(&mut t, RequestId(2));
        if answered {
            t.s.wait_remote_lookups(WAIT);
        }
        t.s.request_finished(RequestId(2), &[], true, 0).unwrap();
        t.report(job, false);
        t.finish(&[]);
    }
    // A reset forgets them too.
    let mut t = full_and_state_with_tails(2);
    fetching_with_tails_asked(&mut t, RequestId(3));
    assert!(t.s.reset().is_ok());
    assert_eq!(t.s.remote_probes(), 0);
    t.finish(&[3]);
}

#[test]
fn beside_a_draft_group_a_tail_in_the_second_block_is_fetched_with_its_bridge_chunk() {
    // An EAGLE draft group (full attention) and a Mamba state, a hash every
    // token: a draft tail is keyed one token past its boundary. An 11-token
    // prompt; the remote tier holds the draft group's chunk 0 (no state at
    // 4: no complete hit) and the tail at 6 (the state after 6 tokens, the
    // draft block keyed at 7). The tail lies in the block after the bridge
    // chunk 0, so both come in one fetch.
    let shapes = vec![
        GroupShape::full_attention(TPB).unwrap().eagle_draft(),
        GroupShape::recurrent_state(TPB).unwrap(),
    ];
    let mut t = rig(shapes, 1);
    t.s.enable_partial_tails(1).unwrap();
    let u = units(1, 11, 1);
    let (bridge, tail) = (
        unit_key(&u.0, 3, 0),
        [unit_key(&u.0, 6, 0), unit_key(&u.0, 5, 1)],
    );
    for k in [bridge, tail[0], tail[1]] {
        t.put(k);
    }
    t.add_with_units(RequestId(1), 11, &u);
    let (hit, fetched) = t.settle(RequestId(1), false);
    assert_eq!(hit, 6);
    assert_eq!(fetched, vec![bridge, tail[0], tail[1]]);
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (
            st.lookups,
            st.fetch_jobs,
            st.chunks_fetched,
            st.partial_tails_fetched
        ),
        (2, 1, 3, 1)
    );
    // The load reads the bridge and the draft tail, and the state; every
    // token counts as the remote tier's.
    let (b0, b1): (Vec<GpuBlockId>, Vec<GpuBlockId>) = (
        (1..=3).map(GpuBlockId).collect(),
        [0, 17, 18].into_iter().map(GpuBlockId).collect(),
    );
    let (cached0, cached1) = (vec![false; 3], vec![false; 3]);
    let groups = [
        GroupAlloc {
            block_ids: &b0,
            cached: &cached0,
        },
        GroupAlloc {
            block_ids: &b1,
            cached: &cached1,
        },
    ];
    let job =
        t.s.on_alloc_groups(RequestId(1), &groups, 6)
            .unwrap()
            .expect("a load");
    let plan = t.step();
    let load = plan.loads.iter().find(|l| l.job == job).expect("the load");
    assert_eq!(load.keys.to_vec(), vec![bridge, tail[0], tail[1]]);
    assert_eq!(load.block_ids.to_vec(), [1, 2, 17].map(GpuBlockId).to_vec());
    let sources = t.s.hit_sources(RequestId(1), 6).unwrap();
    assert_eq!((sources.remote_tokens, sources.host_tokens), (6, 0));
    t.report(job, false);
    t.finish(&[1]);

    // Another family with the tail but not the bridge: nothing is fetched,
    // no hit.
    let u2 = units(2, 11, 1);
    t.put(unit_key(&u2.0, 6, 0));
    t.put(unit_key(&u2.0, 5, 1));
    t.add_with_units(RequestId(2), 11, &u2);
    let (hit, fetched) = t.settle(RequestId(2), false);
    assert_eq!((hit, fetched.len()), (0, 0));
    t.finish(&[2]);

    // A third whose tail the host tier holds already, but not its bridge,
    // which the remote tier holds: the bridge alone is fetched, and the
    // hit ends on the tail.
    let u3 = units(3, 11, 1);
    let host_tail = [unit_key(&u3.0, 6, 0), unit_key(&u3.0, 5, 1)];
    let m = t.s.manager_mut();
    m.prepare_store(&host_tail, None).unwrap();
    m.complete_store(&host_tail, kvoffload::manager::StoreOutcome::Success, None)
        .unwrap();
    t.put(unit_key(&u3.0, 3, 0));
    t.add_with_units(RequestId(3), 11, &u3);
    let (hit, fetched) = t.settle(RequestId(3), false);
    assert_eq!(hit, 6);
    assert_eq!(fetched, vec![unit_key(&u3.0, 3, 0)]);
    t.finish(&[3]);
}

#[test]
fn a_request_gone_with_a_partial_tail_lookup_in_flight_leaks_nothing() {
    let mut t = full_and_state_with_tails(2);
    let u = units(1, 11, 2);
    t.put_units(&u.0, 0..u.0.len());
    // Request 1's complete chunks are in the host tier already (fetched by
    // request 2); its partial-tail lookup is in flight when it leaves.
    t.add_with_units(RequestId(2), 11, &u);
    assert_eq!(t.settle(RequestId(2), false).0, 10);
    t.finish(&[2]);
    let v = units(1, 9, 2);
    let w = (
        v.0.iter()
            .copied()
            .chain([BlockHash(7)])
            .collect::<Vec<_>>(),
        v.1.clone(),
    );
    t.put(unit_key(&w.0, 4, 0));
    t.put(unit_key(&w.0, 4, 1));
    t.add_with_units(RequestId(1), 11, &w);
    assert_eq!(t.s.lookup(RequestId(1), 0).unwrap(), LookupOutcome::Defer);
    t.s.request_finished(RequestId(1), &[], true, 0).unwrap();
    t.finish(&[]);
    // A reset with a partial-tail lookup in flight forgets it.
    t.add_with_units(RequestId(3), 11, &w);
    assert_eq!(t.s.lookup(RequestId(3), 0).unwrap(), LookupOutcome::Defer);
    assert!(t.s.reset().is_ok());
    assert_eq!(t.s.remote_probes(), 0);
    t.finish(&[3]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever complete chunks and partial tails the remote tier holds, a
    /// request whose host tier is empty ends with the hit vLLM's lookup
    /// gives over them (complete chunks, then the rightmost partial tail
    /// every group holds), within its `max_load_tokens`, fetching only keys
    /// the remote tier holds; a failed fetch ends where the host tier's
    /// hit is. Nothing is held once it is gone.
    #[test]
    fn the_hit_over_both_tiers_ends_on_vllm_s_partial_tail(
        tph in prop::sample::select(vec![1u64, 2]),
        tokens in 1u64..=30,
        held in prop::collection::vec(any::<bool>(), 2 * 30),
        fail in any::<bool>(),
        cap in prop::option::of(0u64..32),
        draft in any::<bool>(),
    ) {
        // Group 0 may be an EAGLE draft group: its tail at a boundary is
        // keyed one hash unit past it, and a tail in the second block past
        // the complete hit needs the bridge chunk.
        let mut t = if draft {
            let shapes = vec![
                GroupShape::full_attention(TPB).unwrap().eagle_draft(),
                GroupShape::recurrent_state(TPB).unwrap(),
            ];
            let mut t = rig(shapes, 1);
            t.s.enable_partial_tails(tph).unwrap();
            t
        } else {
            full_and_state_with_tails(tph)
        };
        let margin = if draft { tph } else { 0 };
        let u = units(1, tokens, tph);
        let per_block = (TPB / tph) as usize;
        let num_keys = u.1.len();
        let mut chunks = HashSet::new();
        for unit in 0..u.0.len() {
            for g in 0..2 {
                if held[g * 30 + unit] {
                    t.put(unit_key(&u.0, unit, g as u32));
                    if (unit + 1) % per_block == 0 {
                        chunks.insert((g, unit / per_block));
                    }
                }
            }
        }
        let req = RequestId(1);
        t.add_with_units(req, tokens, &u);
        let caps = RequestCaps { max_load_tokens: cap, ..Default::default() };
        t.s.set_request_caps(req, caps).unwrap();
        let (complete, ends) = oracle_with_ends(&t.shapes, tokens, num_keys, cap, &chunks);
        let lookup = PartialLookup {
            computed: 0,
            complete_hit: complete,
            prompt_tokens: tokens,
            max_load_tokens: cap,
            block_tokens: TPB,
            tokens_per_hash: tph,
            num_groups: 2,
            eagle_margin: margin,
            hash_tokens: u.0.len() as u64 * tph,
        };
        // Every key the remote tier holds (the host tier starts empty).
        let holds = |unit: u64, g: usize| unit >= 1 && unit <= u.0.len() as u64 && held[g * 30 + unit as usize - 1];
        let bridge = |chunk: usize| BridgeAnswer {
            miss: ends[0] <= chunk && !chunks.contains(&(0, chunk)),
            pending: false,
        };
        let want = match lookup_partial_tail_bridged(lookup, bridge, |b, g| {
            let key_tokens = b + if g == 0 { margin } else { 0 };
            if holds(key_tokens / tph, g) { KeyState::Hit } else { KeyState::Miss }
        }) {
            PartialAnswer::Tail(b) => b,
            _ => complete,
        };
        let (hit, fetched) = t.settle(req, fail);
        let all: HashSet<ChunkKey> = (0..u.0.len())
            .flat_map(|unit| (0..2).map(move |g| (unit, g)))
            .filter(|&(unit, g)| held[g * 30 + unit])
            .map(|(unit, g)| unit_key(&u.0, unit, g as u32))
            .collect();
        for k in &fetched {
            prop_assert!(all.contains(k), "fetched {:?}, which the remote tier lacks", k);
        }
        let st = t.s.remote_lookup_stats().unwrap();
        if fail {
            // Only complete chunks reach a tail lookup; a failed fetch of
            // either leaves less.
            prop_assert!(hit <= want, "{} > {}", hit, want);
            prop_assert_eq!(st.partial_tails_fetched, 0);
        } else {
            prop_assert_eq!(hit, want, "{:?}", st);
            if draft {
                // A draft tail may be keyed on a block: its keys may have
                // come in with the complete chunks.
                prop_assert!(st.partial_tails_fetched <= u64::from(want > complete));
            } else {
                prop_assert_eq!(st.partial_tails_fetched, u64::from(want > complete));
            }
        }
        // A fetch of complete chunks asks about the tails past them as it
        // starts: when it fails, a third lookup asks past the host's hit.
        prop_assert!(st.lookups <= 2 + u64::from(fail) && st.fetch_jobs <= 2, "{:?}", st);
        t.s.request_finished(req, &[], true, 0).unwrap();
        t.step();
        prop_assert_eq!(t.s.remote_probes(), 0);
        prop_assert!(t.s.check_invariants().is_ok());
    }
}
