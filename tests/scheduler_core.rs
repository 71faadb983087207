//! Core scheduler scenarios (the hooks in the order of `docs/scheduler.md`, "Hooks,
//! in the order a serving backend calls them"), one KV group, host tier,
//! asynchronous loads. Invariants are checked after every hook.

mod common;

use common::*;
use kvoffload::JobId;
use kvoffload::manager::{LookupResult, StoreOutcome};
use kvoffload::scheduler::{CompletionReport, LookupOutcome, SchedulerError};

const TPC3: u64 = 12; // tokens per chunk with tpb=4, bpc=3

fn geo3() -> Geo {
    Geo {
        bpc: 3,
        ..Geo::default()
    }
}

#[test]
fn offloading_connector_basic_flow() {
    let mut h = H::new(geo3());
    h.add(1, 1, 36);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0));
    assert_eq!(h.alloc(1, &b(1..=9), 0), None);
    // The host tier already holds chunks 0 and 2: only the middle one is stored.
    let m = h.s.manager_mut();
    let k = [key(1, 0, 3), key(1, 2, 3)];
    m.prepare_store(&k, None).unwrap();
    m.complete_store(&k, StoreOutcome::Success, None).unwrap();
    let plan = h.run(&[(1, b(1..=9), 0, 36)], &[], &[]);
    assert_eq!(plan.stores.len(), 1);
    assert_eq!(plan.stores[0].keys.to_vec(), vec![key(1, 1, 3)]);
    assert_eq!(plan.stores[0].block_ids.to_vec(), b(4..=6));
    assert!(plan.loads.is_empty() && plan.flush.is_empty());
    assert_eq!(h.lookup_key(key(1, 1, 3)), LookupResult::HitPending);
    h.complete(&jobs_of(&plan.stores), 1);
    assert_eq!(h.lookup_key(key(1, 1, 3)), LookupResult::Hit);
    // Decoding fills chunk 3: stored when complete.
    h.grow(1, 1, 36, 48);
    let plan = h.run(&[(1, b(10..=12), 36, 12)], &[], &[]);
    assert_eq!(plan.stores.len(), 1);
    assert_eq!(plan.stores[0].block_ids.to_vec(), b(10..=12));
    h.complete(&jobs_of(&plan.stores), 1);

    // A middle-chunk hit for another request of the same prefix loads chunks 1..3.
    h.add(2, 1, 36);
    assert_eq!(h.lookup(2, TPC3), LookupOutcome::Hit(24));
    let load = h.alloc(2, &b(20..=28), 24).expect("a load");
    let plan = h.run(&[], &[], &[]);
    assert_eq!(jobs_of(&plan.loads), vec![load]);
    assert_eq!(plan.loads[0].block_ids.to_vec(), b(23..=28));
    assert_eq!(
        plan.loads[0].keys.to_vec(),
        vec![key(1, 1, 3), key(1, 2, 3)]
    );
    assert!(h.s.is_being_loaded(key(1, 1, 3)));
    let out = h.complete(&[load], 1);
    assert_eq!(out.finished_loads, vec![r(2)]);
    assert!(!h.s.is_being_loaded(key(1, 1, 3)));

    // Fewer than one chunk of new tokens: zero, whatever the tier holds.
    h.add(3, 1, 8);
    assert_eq!(h.lookup(3, 0), LookupOutcome::Hit(0));
}

/// Request 1 of 16 tokens (4 chunks of 1 block) whose chunk 0 is in the
/// tier, chunk 1 being written, chunk 2 absent and chunk 3 in the tier.
fn hit_pending_miss_hit() -> H {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 16);
    let m = h.s.manager_mut();
    m.prepare_store(&[key(1, 0, 1), key(1, 1, 1), key(1, 3, 1)], None)
        .unwrap();
    m.complete_store(&[key(1, 0, 1), key(1, 3, 1)], StoreOutcome::Success, None)
        .unwrap();
    h
}

#[test]
fn maximal_prefix_lookup_rules() {
    let mut h = hit_pending_miss_hit();
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer, "pending defers");
    h.s.manager_mut()
        .complete_store(&[key(1, 1, 1)], StoreOutcome::Success, None)
        .unwrap();
    assert_eq!(
        h.lookup(1, 0),
        LookupOutcome::Hit(8),
        "the miss stops the scan"
    );
    // Miss first: zero even though later chunks hit.
    h.add(2, 2, 16);
    let k = [key(2, 1, 1)];
    h.cache(&k);
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(0));
    // A hit smaller than a chunk counts as zero (bpc=3, 13 tokens, computed 0: the
    // only chunk key covers 12 tokens, 13 - 12 < 12 is not the rule; computed 8 is).
    let mut h3 = H::new(geo3());
    h3.add(1, 1, 24);
    let k = [key(1, 0, 3), key(1, 1, 3)];
    h3.cache(&k);
    assert_eq!(h3.lookup(1, 8), LookupOutcome::Hit(16));
    assert_eq!(
        h3.lookup(1, 14),
        LookupOutcome::Hit(0),
        "10 tokens < 1 chunk"
    );
}

/// Found by the differential test against vLLM's OffloadingConnector
/// (python/tests/test_differential.py): vLLM bounds a hit by the request's
/// full chunks before it looks anything up, so a pending chunk that could
/// only give less than a chunk of new tokens answers zero, not "defer".
#[test]
fn a_pending_chunk_beyond_the_last_useful_one_does_not_defer() {
    let mut h = H::new(Geo {
        bpc: 2,
        ..Geo::default()
    });
    // 20 tokens: 5 full blocks of 4, 2 full chunks of 8 (16 tokens).
    h.add(1, 1, 20);
    h.s.manager_mut()
        .prepare_store(&[key(1, 1, 2)], None)
        .unwrap();
    assert_eq!(h.lookup_key(key(1, 1, 2)), LookupResult::HitPending);
    // 12 computed: at most 4 more tokens in full chunks, less than one chunk.
    assert_eq!(h.lookup(1, 12), LookupOutcome::Hit(0));
    // From 8 computed the pending chunk is a whole chunk of new tokens: defer.
    assert_eq!(h.lookup(1, 8), LookupOutcome::Defer);
}

/// The chunks a lookup's scan found (vLLM's `record_lookup` set for its
/// self-describing KV events): the leading run of hit or pending chunks from
/// the computed boundary, whatever the answer made of it.
#[test]
fn last_lookup_hits_is_the_scanned_run() {
    let mut h = hit_pending_miss_hit();
    // Deferred by the pending chunk: both leading chunks were found.
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer);
    assert_eq!(h.s.last_lookup_hits(), Some(0..2));
    // From 4 computed tokens the scan starts at chunk 1.
    assert_eq!(h.lookup(1, 4), LookupOutcome::Defer);
    assert_eq!(h.s.last_lookup_hits(), Some(1..2));
    // From 8 the scan misses at once.
    assert_eq!(h.lookup(1, 8), LookupOutcome::Hit(0));
    assert_eq!(h.s.last_lookup_hits(), Some(2..2));
    // Less than a chunk left to find: nothing is scanned.
    assert_eq!(h.lookup(1, 13), LookupOutcome::Hit(0));
    assert_eq!(h.s.last_lookup_hits(), None);
    // The request's own job in flight defers before any scan.
    h.s.manager_mut()
        .complete_store(&[key(1, 1, 1)], StoreOutcome::Success, None)
        .unwrap();
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    assert_eq!(h.s.last_lookup_hits(), Some(0..2));
    h.alloc(1, &b(1..=4), 8);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer);
    assert_eq!(h.s.last_lookup_hits(), None);
}

#[test]
fn pending_transfer_defers_prefix_lookup_and_clears_blocks() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let plan = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]);
    assert_eq!(plan.stores.len(), 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Defer);
    assert_eq!(h.s.next_stored_chunk(r(1)), Some(0));
    h.complete(&jobs_of(&plan.stores), 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
}

fn preemption(cpu_hit: bool, asynchronous: bool) {
    let mut h = H::new(geo3());
    h.add(1, 1, 36);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=9), 0);
    let plan = h.run(&[(1, b(1..=9), 0, 36)], &[], &[]);
    let stores = jobs_of(&plan.stores);
    assert_eq!(plan.stores[0].block_ids.to_vec(), b(1..=9));
    h.grow(1, 1, 36, 37);
    // Preempted with the stores in flight: they are flushed.
    let plan = h.run(&[], &[1], &[]);
    assert_eq!(plan.flush, stores);
    if asynchronous {
        // Re-admission before the flush report is consumed: deferred, nothing changes.
        assert_eq!(h.lookup(1, 0), LookupOutcome::Defer);
        let plan = h.run(&[], &[], &[]);
        assert!(plan.loads.is_empty());
        assert_eq!(h.s.request_jobs(r(1)), Some(stores.clone()));
    }
    let out = h.s.on_worker_output(&CompletionReport {
        completed: vec![(stores[0], 1)],
        failed: if cpu_hit { vec![] } else { vec![stores[0]] },
    });
    assert!(out.rejected.is_empty());
    h.check();
    if cpu_hit {
        assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(36));
        let load = h.alloc(1, &b(11..=20), 36).expect("reload");
        let plan = h.run(&[], &[], &[]);
        assert_eq!(plan.loads[0].block_ids.to_vec(), b(11..=19));
        assert_eq!(jobs_of(&plan.loads), vec![load]);
        assert_eq!(h.complete(&[load], 1).finished_loads, vec![r(1)]);
        let plan = h.run(&[(1, b(11..=20), 36, 1)], &[], &[]);
        assert!(
            plan.stores.is_empty(),
            "the loaded prefix is not stored again"
        );
    } else {
        assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0));
        h.alloc(1, &b(11..=20), 0);
        let plan = h.run(&[(1, b(11..=20), 0, 37)], &[], &[]);
        assert_eq!(plan.stores.len(), 1);
        assert_eq!(plan.stores[0].block_ids.to_vec(), b(11..=19), "re-stored");
        h.complete(&jobs_of(&plan.stores), 1);
    }
    // EOS at 49 tokens: chunk 3 (blocks 20..22) is stored at finish.
    h.grow(1, 1, 37, 49);
    let plan = h.run(&[(1, b(21..=22), 37, 11)], &[], &[]);
    let mut stored = jobs_of(&plan.stores);
    h.finish(1, &b(11..=22));
    let plan = h.run(&[], &[], &[1]);
    stored.extend(jobs_of(&plan.stores));
    assert_eq!(stored.len(), 1);
    assert!(h.s.has_request(r(1)));
    h.complete(&stored, 1);
    assert!(!h.s.has_request(r(1)));
    assert_eq!(h.s.state().fenced_blocks, 0);
    assert_eq!(h.lookup_key(key(1, 3, 3)), LookupResult::Hit);
}

#[test]
fn request_preemption_with_host_hit_sync() {
    preemption(true, false);
}
#[test]
fn request_preemption_with_host_hit_async() {
    preemption(true, true);
}
#[test]
fn request_preemption_without_host_hit_sync() {
    preemption(false, false);
}
#[test]
fn request_preemption_without_host_hit_async() {
    preemption(false, true);
}

#[test]
fn concurrent_lookups_of_the_same_prefix() {
    let mut h = H::new(Geo::default());
    let k = [key(1, 0, 1), key(1, 1, 1)];
    h.cache(&k);
    h.add(1, 1, 9);
    h.add(2, 1, 9);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let load = h.alloc(1, &b(1..=3), 8).unwrap();
    assert_eq!(
        h.lookup(2, 0),
        LookupOutcome::Defer,
        "no second load of a prefix being loaded"
    );
    h.alloc(2, &[], 0);
    let plan = h.run(&[], &[], &[]);
    assert_eq!(plan.loads.len(), 1);
    h.complete(&[load], 1);
    // The second request now finds the prefix in the GPU prefix cache.
    assert_eq!(h.lookup(2, 8), LookupOutcome::Hit(0));
    assert_eq!(h.s.state().fenced_blocks, 0);
}

#[test]
fn abort_while_loading_keeps_the_request_until_the_load_completes() {
    let mut h = H::new(Geo::default());
    let k = [key(1, 0, 1), key(1, 1, 1)];
    h.cache(&k);
    h.add(1, 1, 9);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let load = h.alloc(1, &b(1..=3), 8).unwrap();
    h.run(&[], &[], &[]);
    h.abort(1, &b(1..=3), 0);
    let plan = h.run(&[], &[], &[1]);
    assert!(plan.stores.is_empty() && plan.flush.is_empty());
    assert!(h.s.has_request(r(1)), "tracked while its load is in flight");
    assert_eq!(h.s.metrics().manager_request_finished, 1);
    let out = h.complete(&[load], 1);
    assert_eq!(out.finished_loads, vec![r(1)]);
    assert!(!h.s.has_request(r(1)));
    assert_eq!(h.s.state().requests, 0);
    assert_eq!(h.s.manager().stats().pinned, 0);
}

#[test]
fn abort_queued_request_builds_no_store() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 16);
    h.abort(1, &[], 0);
    let plan = h.run(&[], &[], &[1]);
    assert!(plan.stores.is_empty());
    assert!(!h.s.has_request(r(1)));
}

/// A finished request's store still reads block 1 when block 1 is allocated
/// again at `alloc`: the store is flushed.
#[test]
fn fence_at_alloc() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let plan = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]);
    let store = plan.stores[0].job;
    h.finish(1, &b(1..=2));
    assert_eq!(h.s.fenced_jobs(kvoffload::GpuBlockId(1)), vec![store]);
    let plan = h.run(&[], &[], &[1]);
    assert!(plan.flush.is_empty());
    h.add(2, 2, 8);
    h.lookup(2, 0);
    h.alloc(2, &b([1, 5]), 0);
    let plan = h.run(&[(2, b([1, 5]), 0, 8)], &[], &[]);
    assert_eq!(plan.flush, vec![store]);
    h.complete(&[store], 1);
    assert_eq!(h.s.state().fenced_blocks, 0);
    assert!(!h.s.has_request(r(1)));
}

/// The last store of a finished request is planned in the step that reallocates
/// its source block: it is stored and flushed at once.
#[test]
fn fence_at_store_planning() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let plan = h.run(&[(1, b(1..=2), 0, 4)], &[], &[]);
    let first = plan.stores[0].job;
    h.complete(&[first], 1);
    h.grow(1, 1, 8, 9);
    h.finish(1, &b(1..=2));
    // Block 2 goes to request 2 in the step that plans request 1's last store.
    h.add(2, 2, 8);
    h.lookup(2, 0);
    h.alloc(2, &b([2, 7]), 0);
    let plan = h.run(&[(2, b([2, 7]), 0, 8)], &[], &[1]);
    let last = plan
        .stores
        .iter()
        .find(|s| s.req == r(1))
        .expect("last store");
    assert_eq!(last.block_ids.to_vec(), b([2]));
    assert!(plan.flush.contains(&last.job));
    let all = jobs_of(&plan.stores);
    h.complete(&all, 1);
    assert_eq!(h.s.state().fenced_blocks, 0);
}

#[test]
fn finished_request_with_several_in_flight_stores_all_flushed_by_fence() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 12);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=3), 0);
    let s1 = h.run(&[(1, b(1..=3), 0, 4)], &[], &[]).stores[0].job;
    let s2 = h.run(&[(1, vec![], 4, 4)], &[], &[]).stores[0].job;
    let s3 = h.run(&[(1, vec![], 8, 4)], &[], &[]).stores[0].job;
    h.finish(1, &b(1..=3));
    h.run(&[], &[], &[1]);
    assert_eq!(h.s.state().fenced_blocks, 3);
    h.add(2, 2, 12);
    h.lookup(2, 0);
    h.alloc(2, &b([3, 2, 1]), 0);
    let plan = h.run(&[(2, b([3, 2, 1]), 0, 12)], &[], &[]);
    assert_eq!(plan.flush, vec![s1, s2, s3]);
    h.complete(&[s1, s2, s3], 1);
    assert_eq!(h.s.state().fenced_blocks, 0);
    assert!(!h.s.has_request(r(1)));
}

#[test]
fn loads_do_not_populate_the_fence_index() {
    let mut h = H::new(Geo::default());
    let k = [key(1, 0, 1)];
    h.cache(&k);
    h.add(1, 1, 5);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(4));
    h.alloc(1, &b(1..=2), 4).unwrap();
    h.run(&[], &[], &[]);
    h.abort(1, &b(1..=2), 0);
    assert_eq!(h.s.state().fenced_blocks, 0);
}

#[test]
fn on_request_finished_once_after_the_last_store_and_before_completion() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let s1 = h.run(&[(1, b(1..=2), 0, 4)], &[], &[]).stores[0].job;
    h.grow(1, 1, 8, 9);
    h.finish(1, &b(1..=2));
    assert_eq!(
        h.s.metrics().manager_request_finished,
        0,
        "deferred to the step"
    );
    let plan = h.run(&[], &[], &[1]);
    assert_eq!(plan.stores.len(), 1, "the final store is planned at finish");
    assert_eq!(h.s.metrics().manager_request_finished, 1);
    assert_eq!(
        h.s.manager().stats().pending,
        2,
        "before any complete_store"
    );
    h.complete(&[s1, plan.stores[0].job], 1);
    h.run(&[], &[], &[1]);
    assert_eq!(h.s.metrics().manager_request_finished, 1, "exactly once");
}

#[test]
fn complete_store_waits_for_all_worker_acks() {
    let mut h = H::new(Geo {
        world: 3,
        ..Geo::default()
    });
    h.add(1, 1, 4);
    h.lookup(1, 0);
    h.alloc(1, &b([1]), 0);
    let s = h.run(&[(1, b([1]), 0, 4)], &[], &[]).stores[0].job;
    h.report(&[(s, 1)]);
    assert!(h.s.is_job_live(s));
    assert_eq!(h.lookup_key(key(1, 0, 1)), LookupResult::HitPending);
    h.report(&[(s, 2)]);
    assert!(!h.s.is_job_live(s));
    assert_eq!(h.lookup_key(key(1, 0, 1)), LookupResult::Hit);
    // Reports beyond what a job expects are rejected, not applied.
    let out = h.s.on_worker_output(&CompletionReport {
        completed: vec![(s, 1)],
        failed: vec![],
    });
    assert_eq!(out.rejected.len(), 1);
}

#[test]
fn allocation_failure_retries_the_same_chunks() {
    let mut h = H::new(Geo {
        chunks: 2,
        ..Geo::default()
    });
    // Two pending stores fill the tier.
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let s1 = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]).stores[0].job;
    h.add(2, 2, 12);
    h.lookup(2, 0);
    h.alloc(2, &b(5..=7), 0);
    let plan = h.run(&[(2, b(5..=7), 0, 4)], &[], &[]);
    assert!(plan.stores.is_empty());
    assert_eq!(h.s.metrics().allocation_failures, 1);
    assert_eq!(h.s.next_stored_chunk(r(2)), Some(0), "not advanced");
    h.complete(&[s1], 1);
    let plan = h.run(&[(2, vec![], 4, 4)], &[], &[]);
    assert_eq!(
        plan.stores[0].keys.to_vec(),
        vec![key(2, 0, 1), key(2, 1, 1)],
        "same chunks retried"
    );
    // At finish: the tier is full of pending chunks again, the final store fails and the
    // manager still hears request_finished once.
    h.grow(2, 2, 12, 13);
    h.finish(2, &b(5..=7));
    let plan2 = h.run(&[], &[], &[2]);
    assert!(plan2.stores.is_empty());
    assert_eq!(h.s.metrics().allocation_failures, 2);
    assert_eq!(h.s.metrics().manager_request_finished, 1);
    h.complete(&jobs_of(&plan.stores), 1);
    assert!(!h.s.has_request(r(2)));
}

#[test]
fn offload_prompt_only_stores_prompt_chunks_only() {
    let mut h = H::new(Geo {
        prompt_only: true,
        ..Geo::default()
    });
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let plan = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]);
    assert_eq!(plan.stores[0].keys.len(), 2);
    h.grow(1, 1, 8, 17);
    let plan = h.run(&[(1, b(3..=5), 8, 8)], &[], &[]);
    assert!(plan.stores.is_empty(), "output chunks are not stored");
    h.finish(1, &b(1..=5));
    assert!(h.run(&[], &[], &[1]).stores.is_empty());
}

#[test]
fn final_sampled_token_does_not_complete_a_stored_chunk() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 4);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let plan = h.run(&[(1, b(1..=2), 0, 4)], &[], &[]);
    assert_eq!(plan.stores.len(), 1);
    // 4 decoded tokens make 8: the 8th token is the last sampled one, never written.
    h.grow(1, 1, 4, 8);
    h.finish(1, &b(1..=2));
    let fin = h.run(&[], &[], &[1]);
    assert!(fin.stores.is_empty());
    h.complete(&jobs_of(&plan.stores), 1);
    assert_eq!(h.lookup_key(key(1, 1, 1)), LookupResult::Miss);
}

#[test]
fn reset_with_in_flight_jobs() {
    let mut h = H::new(Geo::default());
    let k = [key(1, 0, 1), key(1, 1, 1)];
    h.cache(&k);
    h.add(1, 1, 9);
    h.lookup(1, 0);
    let load = h.alloc(1, &b(1..=3), 8).unwrap();
    h.run(&[], &[], &[]);
    h.add(2, 2, 8);
    h.lookup(2, 0);
    h.alloc(2, &b(5..=6), 0);
    let store = h.run(&[(2, b(5..=6), 0, 8)], &[], &[]).stores[0].job;
    let counter = h.s.next_job_id();
    h.s.reset().unwrap();
    h.check();
    assert_eq!(h.s.stale_threshold(), counter);
    assert_eq!(h.s.state().jobs, 0);
    assert_eq!(h.s.state().chunks_being_loaded, 0);
    assert_eq!(h.s.state().fenced_blocks, 0);
    assert_eq!(h.s.next_stored_chunk(r(2)), Some(0));
    assert!(h.s.has_pending_work(), "the reset fence waits for reports");
    let plan = h.run(&[], &[], &[]);
    assert_eq!(plan.flush, vec![load, store]);
    let out = h.complete(&[load, store], 1);
    assert_eq!(
        out.finished_loads,
        vec![r(1)],
        "the backend resumes the request"
    );
    assert_eq!(h.s.reset_fence_len(), 0);
    assert!(!h.s.has_pending_work());
    assert_eq!(
        h.lookup_key(key(2, 0, 1)),
        LookupResult::Miss,
        "stale reports are ignored"
    );
}

#[test]
fn reset_finalizes_finished_request_with_pending_store() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let s = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]).stores[0].job;
    h.finish(1, &b(1..=2));
    assert_eq!(h.s.metrics().manager_request_finished, 0);
    h.s.reset().unwrap();
    h.check();
    assert_eq!(h.s.metrics().manager_request_finished, 1);
    assert!(!h.s.has_request(r(1)));
    h.complete(&[s], 1);
    assert!(!h.s.has_pending_work());
}

fn same_step_resume(asynchronous: bool) {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let stores = jobs_of(&h.run(&[(1, b(1..=2), 0, 8)], &[], &[]).stores);
    h.grow(1, 1, 8, 9);
    if asynchronous {
        // Step N+1 runs before the store report of step N is processed.
        let plan = h.run(&[(1, b([3]), 8, 1)], &[], &[]);
        assert!(plan.stores.is_empty());
    }
    h.complete(&stores, 1);
    // A reset that also preempts the running request.
    h.s.reset().unwrap();
    h.check();
    assert_eq!(h.s.request_jobs(r(1)), Some(vec![]));
    let k = [key(1, 0, 1), key(1, 1, 1)];
    h.cache(&k);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let load = h.alloc(1, &b(4..=6), 8).unwrap();
    // The preemption notice arrives in the same step as the new load.
    let plan = h.run(&[], &[1], &[]);
    assert_eq!(jobs_of(&plan.loads), vec![load]);
    assert!(!plan.flush.contains(&load), "the new load is not flushed");
    assert_eq!(h.s.request_jobs(r(1)), Some(vec![load]));
    assert_eq!(h.complete(&[load], 1).finished_loads, vec![r(1)]);
    h.finish(1, &b(4..=6));
    h.run(&[], &[], &[1]);
    assert_eq!(h.s.state().jobs, 0);
    assert_eq!(h.s.state().requests, 0);
}

#[test]
fn same_step_resume_sync() {
    same_step_resume(false);
}
#[test]
fn same_step_resume_async() {
    same_step_resume(true);
}

#[test]
fn older_pending_load_at_preemption_flush_is_an_error() {
    let mut h = H::new(Geo::default());
    let k = [key(1, 0, 1)];
    h.cache(&k);
    h.add(1, 1, 5);
    h.lookup(1, 0);
    let load = h.alloc(1, &b(1..=2), 4).unwrap();
    h.run(&[], &[], &[]);
    let before = h.s.state();
    let err =
        h.s.build_step(&kvoffload::scheduler::StepInput {
            preempted: vec![r(1)],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(
        err,
        SchedulerError::PreemptedWithPendingLoad {
            req: r(1),
            job: load,
            kind: "load"
        }
    );
    assert_eq!(h.s.state(), before, "nothing changed");
    h.check();
}

#[test]
fn complete_store_is_called_per_job_with_its_own_keys() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let s1 = h.run(&[(1, b(1..=2), 0, 4)], &[], &[]).stores[0].job;
    let s2 = h.run(&[(1, vec![], 4, 4)], &[], &[]).stores[0].job;
    h.complete(&[s2], 1);
    assert_eq!(h.lookup_key(key(1, 0, 1)), LookupResult::HitPending);
    assert_eq!(h.lookup_key(key(1, 1, 1)), LookupResult::Hit);
    h.complete(&[s1], 1);
    assert_eq!(h.lookup_key(key(1, 0, 1)), LookupResult::Hit);
    let _ = JobId(0);
}

#[test]
fn max_offload_tokens_caps_stores() {
    // 0 disables storing; 24 tokens store 2 chunks of 12.
    for (cap, chunks) in [(Some(0u64), 0usize), (Some(24), 2), (None, 3)] {
        let mut h = H::new(geo3());
        h.add(1, 1, 36);
        h.s.set_request_caps(
            r(1),
            kvoffload::scheduler::RequestCaps {
                max_offload_tokens: cap,
                ..Default::default()
            },
        )
        .unwrap();
        h.lookup(1, 0);
        h.alloc(1, &b(1..=9), 0);
        let plan = h.run(&[(1, b(1..=9), 0, 36)], &[], &[]);
        let stored: usize = plan.stores.iter().map(|s| s.keys.len()).sum();
        assert_eq!(stored, chunks, "cap {cap:?}");
    }
}

#[test]
fn max_load_tokens_caps_hits() {
    let mut h = H::new(Geo::default());
    let k = [key(1, 0, 1), key(1, 1, 1), key(1, 2, 1)];
    h.cache(&k);
    h.add(1, 1, 13);
    h.s.set_request_caps(
        r(1),
        kvoffload::scheduler::RequestCaps {
            max_load_tokens: Some(9),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        h.lookup(1, 0),
        LookupOutcome::Hit(8),
        "min(cap, covered chunks) rounded down to a chunk, as vLLM 0.33.0"
    );
    // The cap counts from the GPU prefix hit: 4 computed + 9 reaches token
    // 13, past the last full chunk (12): 8 more tokens.
    assert_eq!(h.lookup(1, 4), LookupOutcome::Hit(8));
    h.s.set_request_caps(
        r(1),
        kvoffload::scheduler::RequestCaps {
            max_load_tokens: Some(7),
            ..Default::default()
        },
    )
    .unwrap();
    // 4 + 7 = 11, rounded down to 8: one chunk past the computed ones.
    assert_eq!(h.lookup(1, 4), LookupOutcome::Hit(4));
    // 0 + 7 rounded down to 4.
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(4));
    h.s.set_request_caps(
        r(1),
        kvoffload::scheduler::RequestCaps {
            max_load_tokens: Some(3),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0), "less than a chunk");
    h.s.set_request_caps(
        r(1),
        kvoffload::scheduler::RequestCaps {
            max_load_tokens: Some(0),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0), "0 loads nothing");
}

#[test]
fn store_waits_for_a_missing_chunk_key() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=3), 0);
    h.run(&[(1, b(1..=3), 0, 8)], &[], &[]);
    // 4 more tokens complete block 3, but its hash is not known yet.
    h.s.update_request(r(1), 12, &[]).unwrap();
    let plan = h.run(&[(1, vec![], 8, 4)], &[], &[]);
    assert!(plan.stores.is_empty(), "no key, no store");
    h.grow(1, 1, 8, 12);
    let plan = h.run(&[(1, vec![], 12, 0)], &[], &[]);
    assert_eq!(plan.stores[0].keys.to_vec(), vec![key(1, 2, 1)]);
}

#[test]
fn a_restarted_request_re_offers_every_chunk() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let plan = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]);
    h.s.on_worker_output(&CompletionReport {
        completed: vec![(plan.stores[0].job, 1)],
        failed: vec![plan.stores[0].job],
    });
    h.check();
    assert_eq!(h.s.next_stored_chunk(r(1)), Some(2));
    // Preempted and re-admitted: the failed chunks are offered again.
    h.run(&[], &[1], &[]);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0));
    assert_eq!(h.s.next_stored_chunk(r(1)), Some(0));
    h.alloc(1, &b(5..=6), 0);
    let plan = h.run(&[(1, b(5..=6), 0, 8)], &[], &[]);
    assert_eq!(
        plan.stores[0].keys.to_vec(),
        vec![key(1, 0, 1), key(1, 1, 1)]
    );
    assert_eq!(plan.stores[0].block_ids.to_vec(), b(5..=6));
}

#[test]
fn a_recycled_plan_lends_its_buffers_and_nothing_else() {
    let mut h = H::new(geo3());
    h.add(1, 1, 36);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(0));
    assert_eq!(h.alloc(1, &b(1..=9), 0), None);
    let plan = h.run(&[(1, b(1..=9), 0, 36)], &[], &[]);
    assert_eq!(plan.stores.len(), 1, "one store of the three chunks");
    let stores = jobs_of(&plan.stores);
    h.s.recycle_plan(plan);
    // A load created after the recycle (between steps) is kept, and the next
    // plan holds only what the next step planned.
    h.add(2, 1, 36);
    h.complete(&stores, 1);
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(36));
    let load = h.alloc(2, &b(20..=28), 36).expect("a load");
    let plan = h.run(&[], &[], &[]);
    assert_eq!(jobs_of(&plan.loads), vec![load]);
    assert!(
        plan.stores.is_empty(),
        "no store leaks from the recycled plan"
    );
    h.s.recycle_plan(plan);
    let plan = h.run(&[], &[], &[]);
    assert!(plan.loads.is_empty() && plan.stores.is_empty() && plan.flush.is_empty());
}

/// vLLM's `skip_reading_prefix_cache` (prompt-logprob requests): no hit
/// however much the tier holds, no lookup delay observed, the request
/// restarted all the same; its own jobs in flight still defer it.
#[test]
fn a_request_that_skips_reading_the_cache_gets_no_hit() {
    let mut h = H::new(Geo::default());
    h.add(1, 1, 12);
    h.cache(&[key(1, 0, 1), key(1, 1, 1)]);
    let _ = h.s.take_lookup_delays();
    assert_eq!(
        h.s.lookup_skip_reading(r(1), 0).unwrap(),
        LookupOutcome::Hit(0)
    );
    assert_eq!(
        h.s.take_lookup_delays(),
        (vec![], vec![]),
        "no lookup observed"
    );
    assert_eq!(h.s.last_lookup_hits(), None);
    // It computes its prompt and stores it as any request does.
    assert_eq!(h.alloc(1, &b(1..=3), 0), None);
    let plan = h.run(&[(1, b(1..=3), 0, 12)], &[], &[]);
    assert_eq!(plan.stores.len(), 1, "the third chunk is stored");
    // With that store in flight it is deferred, as every request is.
    assert_eq!(
        h.s.lookup_skip_reading(r(1), 0).unwrap(),
        LookupOutcome::Defer
    );
    // A request of the same prefix that reads the cache hits.
    h.add(2, 1, 9);
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(8));
}
