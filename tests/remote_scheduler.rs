//! The control plane with a remote tier behind the host tier
//! (`docs/remote-tier.md`), over the in-memory store: a host miss asks the
//! remote tier and defers; a remote hit becomes a fetch job whose completion
//! makes the chunks host hits; a miss, a failed fetch or a stalled one makes
//! the request answer from the host tier alone; nothing is held once the
//! requests are gone. Manual clocks; no test sleeps.

mod common;

use std::time::Duration;

use common::memory_tier::MemoryStore;
use common::{b, hashes, key, r};
use kvoffload::remote::WritePolicy;
use kvoffload::scheduler::{CompletionReport, LookupOutcome, Scheduler, StepInput, StepPlan};
use kvoffload::{ChunkKey, JobId, ManualClock, OffloadConfig};

const WAIT: Duration = Duration::from_secs(20);

struct Rig {
    s: Scheduler,
    store: MemoryStore,
    clock: ManualClock,
}

/// A scheduler (4 tokens a block, one block a chunk, 16 host chunks, 2
/// workers) with a remote tier on an in-memory store.
fn rig() -> Rig {
    rig_with(16, WritePolicy::Through)
}

/// [`rig`] with `chunks` host chunks and the tier written by `write`.
fn rig_with(chunks: u64, write: WritePolicy) -> Rig {
    let cfg = OffloadConfig {
        tokens_per_block: 4,
        world_size: 2,
        stall_timeout_ms: 1_000,
        ..OffloadConfig::with_chunks(chunks)
    };
    let clock = ManualClock::new();
    let mut s = Scheduler::new(&cfg, clock.shared()).expect("scheduler");
    let store = MemoryStore::new(0xC0DE);
    s.attach_remote(store.tier(2, write, &clock));
    Rig { s, store, clock }
}

impl Rig {
    /// Both workers' shares of `k` in the store, as write-through leaves them.
    fn put(&self, k: ChunkKey) {
        for rank in 0..2 {
            self.store.put_share(k, rank, rank as u8);
        }
    }

    fn lookup(&mut self, req: u64) -> LookupOutcome {
        self.s.lookup(r(req), 0).expect("lookup")
    }

    /// A step with nothing scheduled: the plan (the lookups' fetch jobs).
    fn step(&mut self) -> StepPlan {
        self.s.build_step(&StepInput::default()).expect("step")
    }

    /// Every worker reports `job` (failed or not).
    fn report(&mut self, job: JobId, failed: bool) {
        let out = self.s.on_worker_output(&CompletionReport {
            completed: vec![(job, 2)],
            failed: if failed { vec![job] } else { vec![] },
        });
        assert!(out.rejected.is_empty(), "{:?}", out.rejected);
    }
}

#[test]
fn a_remote_hit_is_fetched_into_the_host_tier_then_loaded() {
    let mut t = rig();
    // A 5-block prompt: 4 full chunks to look up (the last token is computed).
    t.s.add_request(r(1), 20, &hashes(1, 0..5)).unwrap();
    for c in 0..3 {
        t.put(key(1, c, 1));
    }
    // The host tier misses: the remote tier is asked; not yet.
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    assert_eq!(t.s.remote_in_flight(), 1, "the lookup is in flight");
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.s.remote_in_flight(), 0, "its answer came");
    // The answer: chunks 0..3 are there (3 is not): a fetch job for them.
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    let plan = t.step();
    assert_eq!(t.s.remote_in_flight(), 1, "the fetch job is in flight");
    assert_eq!(plan.fetches.len(), 1);
    let f = &plan.fetches[0];
    assert_eq!(
        f.keys.to_vec(),
        (0..3).map(|c| key(1, c, 1)).collect::<Vec<_>>()
    );
    assert_eq!(f.chunk_ids.len(), 3);
    assert!(f.block_ids.is_empty(), "a fetch moves no GPU block");
    // Deferred while the fetch is in flight (the request's own job).
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    t.report(f.job, false);
    assert_eq!(
        t.s.remote_in_flight(),
        0,
        "nothing in flight; the request keeps its probe"
    );
    assert!(t.s.remote_probes() > 0);
    // The chunks are host hits now: 3 chunks of 4 tokens, no second ask.
    assert_eq!(t.lookup(1), LookupOutcome::Hit(12));
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(
        (
            st.lookups,
            st.chunks_found,
            st.fetch_jobs,
            st.chunks_fetched
        ),
        (1, 3, 1, 3)
    );
    t.s.request_finished(r(1), &[], true, 0).unwrap();
    t.step();
    assert_eq!(t.s.remote_probes(), 0);
    assert!(t.s.check_invariants().is_ok());
}

/// Fetches (for `req`, looked up from `computed` tokens) what the remote tier
/// holds past the host tier's hits, and returns the lookup's answer once the
/// fetch is done.
fn fetch_then_lookup(t: &mut Rig, req: u64, computed: u64) -> LookupOutcome {
    assert_eq!(t.s.lookup(r(req), computed).unwrap(), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.s.lookup(r(req), computed).unwrap(), LookupOutcome::Defer);
    let plan = t.step();
    assert_eq!(plan.fetches.len(), 1);
    t.report(plan.fetches[0].job, false);
    t.s.lookup(r(req), computed).unwrap()
}

#[test]
fn hit_sources_name_the_chunks_a_request_fetched_remote_and_the_rest_host() {
    let mut t = rig();
    // Request 3 fetches chunk 0 of prefix 1 into the host tier.
    t.put(key(1, 0, 1));
    t.s.add_request(r(3), 8, &hashes(1, 0..2)).unwrap();
    assert_eq!(fetch_then_lookup(&mut t, 3, 0), LookupOutcome::Hit(4));
    let src = t.s.hit_sources(r(3), 4).unwrap();
    assert_eq!((src.host_tokens, src.remote_tokens), (0, 4));
    // Request 1 finds chunk 0 in the host tier and fetches chunks 1 and 2.
    t.put(key(1, 1, 1));
    t.put(key(1, 2, 1));
    t.s.add_request(r(1), 20, &hashes(1, 0..5)).unwrap();
    assert_eq!(fetch_then_lookup(&mut t, 1, 0), LookupOutcome::Hit(12));
    let src = t.s.hit_sources(r(1), 12).unwrap();
    assert_eq!((src.host_tokens, src.remote_tokens), (4, 8));
    // From a GPU hit of one block on, only the fetched chunks remain.
    assert_eq!(t.s.lookup(r(1), 4).unwrap(), LookupOutcome::Hit(8));
    let src = t.s.hit_sources(r(1), 8).unwrap();
    assert_eq!((src.host_tokens, src.remote_tokens), (0, 8));
    // Another request reading the same chunks reads them from the host tier.
    t.s.add_request(r(2), 20, &hashes(1, 0..5)).unwrap();
    assert_eq!(t.lookup(2), LookupOutcome::Defer, "chunk 3 is asked for");
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.lookup(2), LookupOutcome::Hit(12));
    let src = t.s.hit_sources(r(2), 12).unwrap();
    assert_eq!((src.host_tokens, src.remote_tokens), (12, 0));
    for q in [1, 2, 3] {
        t.s.request_finished(r(q), &[], true, 0).unwrap();
    }
    t.step();
    assert_eq!(
        t.s.remote_probes(),
        0,
        "the fetched ranges go with their request"
    );
}

#[test]
fn a_request_that_skips_the_remote_tier_never_asks_it() {
    let mut t = rig();
    for c in 0..3 {
        t.put(key(1, c, 1));
    }
    t.s.add_request(r(1), 20, &hashes(1, 0..5)).unwrap();
    t.s.set_request_caps(
        r(1),
        kvoffload::scheduler::RequestCaps {
            skip_remote_tier: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        t.lookup(1),
        LookupOutcome::Hit(0),
        "answered from the host tier at once"
    );
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 0);
    assert!(t.step().fetches.is_empty());
    // The same prefix without the filter asks, and is fetched.
    t.s.add_request(r(2), 20, &hashes(1, 0..5)).unwrap();
    assert_eq!(fetch_then_lookup(&mut t, 2, 0), LookupOutcome::Hit(12));
    for q in [1, 2] {
        t.s.request_finished(r(q), &[], true, 0).unwrap();
    }
    t.step();
    assert_eq!(t.s.remote_probes(), 0);
}

#[test]
fn a_remote_miss_answers_from_the_host_tier_and_asks_once() {
    let mut t = rig();
    t.s.add_request(r(1), 20, &hashes(1, 0..5)).unwrap();
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.lookup(1), LookupOutcome::Hit(0));
    // Known absent: no second ask.
    assert_eq!(t.lookup(1), LookupOutcome::Hit(0));
    assert_eq!(t.s.remote_lookup_stats().unwrap().lookups, 1);
    assert!(t.step().fetches.is_empty());
    t.s.request_finished(r(1), &[], true, 0).unwrap();
    assert_eq!(t.s.remote_probes(), 0);
}

#[test]
fn a_failed_or_stalled_fetch_makes_the_request_recompute() {
    let mut t = rig();
    t.s.add_request(r(1), 20, &hashes(1, 0..5)).unwrap();
    t.s.add_request(r(2), 20, &hashes(2, 0..5)).unwrap();
    for c in 0..2 {
        t.put(key(1, c, 1));
        t.put(key(2, c, 1));
    }
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    assert_eq!(t.lookup(2), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    assert_eq!(t.lookup(2), LookupOutcome::Defer);
    let plan = t.step();
    assert_eq!(plan.fetches.len(), 2);
    // Request 1's fetch fails on a worker (a key evicted, a corrupt value).
    t.report(plan.fetches[0].job, true);
    assert_eq!(t.lookup(1), LookupOutcome::Hit(0), "recomputes");
    // Request 2's fetch stalls past the stall timeout.
    t.clock.advance(Duration::from_millis(1_001));
    t.s.scan_now();
    assert_eq!(t.lookup(2), LookupOutcome::Hit(0), "recomputes");
    let st = t.s.remote_lookup_stats().unwrap();
    assert_eq!(st.fetches_failed, 2);
    // The stalled fetch's late reports still arrive and free its slots.
    t.report(plan.fetches[1].job, false);
    for q in [1, 2] {
        t.s.request_finished(r(q), &[], true, 0).unwrap();
    }
    t.step();
    assert_eq!(t.s.remote_probes(), 0);
    assert!(!t.s.has_pending_work());
    assert!(t.s.check_invariants().is_ok());
    let st = t.s.state();
    assert_eq!((st.jobs, st.stalled_jobs, st.quarantined_chunks), (0, 0, 0));
}

#[test]
fn a_reset_forgets_every_probe_and_fetch() {
    let mut t = rig();
    t.s.add_request(r(1), 20, &hashes(1, 0..5)).unwrap();
    t.put(key(1, 0, 1));
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.lookup(1), LookupOutcome::Defer);
    let plan = t.step();
    let job = plan.fetches[0].job;
    t.s.reset().unwrap();
    // The fetch's reports count down the reset fence.
    t.report(job, false);
    assert_eq!(t.s.remote_probes(), 0);
    t.s.request_finished(r(1), &[], true, 0).unwrap();
    t.step();
    assert!(!t.s.has_pending_work());
    assert!(t.s.check_invariants().is_ok());
}

/// Fetches 2 chunks for each of requests 1 and 2 into a 2-chunk host tier:
/// the second fetch evicts the first's chunks. Returns the second plan.
fn evict_through_fetches(t: &mut Rig) -> StepPlan {
    for q in [1, 2] {
        t.s.add_request(r(q), 12, &hashes(q, 0..3)).unwrap();
        for c in 0..2 {
            t.put(key(q, c, 1));
        }
        assert_eq!(t.lookup(q), LookupOutcome::Defer);
        t.s.wait_remote_lookups(WAIT);
        assert_eq!(t.lookup(q), LookupOutcome::Defer);
        let plan = t.step();
        assert_eq!(plan.fetches.len(), 1);
        t.report(plan.fetches[0].job, false);
        if q == 2 {
            return plan;
        }
        assert!(plan.evictions.is_empty(), "nothing evicted yet");
    }
    unreachable!()
}

/// Stores the 2 chunks of request `q` (8 tokens, blocks `blocks`) into the
/// host tier; returns the step's plan (its store and evictions).
fn store_request(t: &mut Rig, q: u64, blocks: [u32; 2]) -> StepPlan {
    use kvoffload::scheduler::ScheduledRequest;
    t.s.add_request(r(q), 8, &hashes(q, 0..2)).unwrap();
    // Nothing remote: asked once, then the host answer.
    assert_eq!(t.lookup(q), LookupOutcome::Defer);
    t.s.wait_remote_lookups(WAIT);
    assert_eq!(t.lookup(q), LookupOutcome::Hit(0));
    let ids = b(blocks);
    assert_eq!(t.s.on_alloc(r(q), &ids, 0).unwrap(), None);
    let plan =
        t.s.build_step(&StepInput {
            scheduled: vec![ScheduledRequest {
                req: r(q),
                new_block_ids: ids,
                computed_tokens: 0,
                scheduled_tokens: 8,
                full_table: true,
            }],
            ..StepInput::default()
        })
        .unwrap();
    assert_eq!(plan.stores.len(), 1, "{plan:?}");
    t.report(plan.stores[0].job, false);
    plan
}

#[test]
fn on_eviction_the_plan_lists_evicted_chunks_with_their_slots() {
    let mut t = rig_with(2, WritePolicy::OnEviction);
    let first = store_request(&mut t, 1, [1, 2]);
    assert!(first.evictions.is_empty(), "nothing evicted yet");
    // Request 2's store evicts request 1's chunks: listed with their slots,
    // which request 2's store reuses.
    let plan = store_request(&mut t, 2, [3, 4]);
    let mut evicted: Vec<ChunkKey> = plan.evictions.iter().map(|&(k, _)| k).collect();
    evicted.sort_unstable();
    assert_eq!(evicted, vec![key(1, 0, 1), key(1, 1, 1)]);
    let mut slots: Vec<u32> = plan.evictions.iter().map(|&(_, c)| c.0).collect();
    let mut reused: Vec<u32> = plan.stores[0].chunk_ids.iter().map(|c| c.0).collect();
    slots.sort_unstable();
    reused.sort_unstable();
    assert_eq!(slots, reused);
    // Write-through lists none.
    let mut t = rig_with(2, WritePolicy::Through);
    store_request(&mut t, 1, [1, 2]);
    assert!(store_request(&mut t, 2, [3, 4]).evictions.is_empty());
}

#[test]
fn on_eviction_chunks_the_remote_tier_gave_are_not_written_back() {
    let mut t = rig_with(2, WritePolicy::OnEviction);
    let plan = evict_through_fetches(&mut t);
    assert_eq!(plan.fetches.len(), 1);
    assert!(
        plan.evictions.is_empty(),
        "request 1's fetched chunks are in the remote tier already: {:?}",
        plan.evictions
    );
}
