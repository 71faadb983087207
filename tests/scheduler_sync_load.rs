//! Synchronous loads (vLLM's `sync_load_budget_bytes`): a lookup hit that
//! leaves a token to compute and fits what is left of the step's budget is
//! loaded within the step; its request runs at once, other lookups do not
//! wait for its chunks, and stores may be planned beside it.

mod common;

use common::*;
use kvoffload::scheduler::LookupOutcome;

/// 4 tokens per block, chunks of one block, a budget of `budget` tokens.
fn h(budget: u64) -> H {
    H::new(Geo {
        sync_budget: budget,
        ..Geo::default()
    })
}

/// Request `id` of family `fam` with 10 tokens whose first two chunks are in the tier.
fn with_two_cached_chunks(h: &mut H, id: u64, fam: u64) {
    h.add(id, fam, 10);
    h.cache(&[key(fam, 0, 1), key(fam, 1, 1)]);
}

#[test]
fn hits_reserve_the_budget_in_lookup_order_until_it_is_spent() {
    let mut h = h(12);
    with_two_cached_chunks(&mut h, 1, 1);
    with_two_cached_chunks(&mut h, 2, 2);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    assert!(h.s.sync_load_reserved(r(1)), "8 of 12 tokens");
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(8));
    assert!(
        !h.s.sync_load_reserved(r(2)),
        "8 more do not fit in the 4 left"
    );
    // A smaller hit still fits what is left.
    assert_eq!(h.lookup(2, 4), LookupOutcome::Hit(4));
    assert!(h.s.sync_load_reserved(r(2)));
    // The step ends: the budget is whole again, no reservation is left.
    h.run(&[], &[], &[]);
    assert!(!h.s.sync_load_reserved(r(1)) && !h.s.sync_load_reserved(r(2)));
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(8));
    assert!(h.s.sync_load_reserved(r(2)));
}

#[test]
fn a_hit_that_leaves_nothing_to_compute_or_no_budget_is_asynchronous() {
    let mut h = h(64);
    h.add(1, 1, 8);
    h.cache(&[key(1, 0, 1), key(1, 1, 1)]);
    // 8 tokens, all of them hit: vLLM keeps one to compute, so no sync load.
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    assert!(!h.s.sync_load_reserved(r(1)));
    let mut off = self::h(0);
    with_two_cached_chunks(&mut off, 1, 1);
    assert_eq!(off.lookup(1, 0), LookupOutcome::Hit(8));
    assert!(!off.s.sync_load_reserved(r(1)), "no budget, no sync load");
}

#[test]
fn a_later_lookup_of_the_request_drops_its_reservation() {
    let mut h = h(64);
    with_two_cached_chunks(&mut h, 1, 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    assert!(h.s.sync_load_reserved(r(1)));
    // Asked again past its hits: a zero answer drops the reservation (its
    // bytes stay spent for the step, as in vLLM).
    assert_eq!(h.lookup(1, 8), LookupOutcome::Hit(0));
    assert!(!h.s.sync_load_reserved(r(1)));
}

#[test]
fn a_sync_load_is_listed_as_such_other_lookups_do_not_wait_and_stores_go_beside_it() {
    let mut h = h(64);
    with_two_cached_chunks(&mut h, 1, 1);
    // 12 tokens: its third chunk completes in the step that loads the first two.
    h.grow(1, 1, 10, 12);
    h.add(2, 1, 10);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let job = h.alloc(1, &b(1..=3), 8).expect("a load job");
    assert!(
        !h.s.is_being_loaded(key(1, 0, 1)),
        "ends before the step's compute"
    );
    // Another request with the same prefix is not deferred by it.
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(8));
    // The request runs in the same step: 8 tokens loaded, 4 computed.
    let plan = h.run(&[(1, b(1..=3), 8, 4)], &[], &[]);
    assert_eq!(jobs_of(&plan.loads), vec![job]);
    assert_eq!(plan.sync_loads, vec![job]);
    assert_eq!(
        plan.stores.len(),
        1,
        "the computed chunk is stored beside the load"
    );
    assert_eq!(plan.stores[0].keys.to_vec(), vec![key(1, 2, 1)]);
    // Both end; nothing is left.
    let store = plan.stores[0].job;
    h.complete(&[job, store], 1);
    assert!(h.s.state().jobs == 0, "{:?}", h.s.state());
}

#[test]
fn a_preempted_request_may_have_a_sync_load_of_an_earlier_step_in_flight() {
    let mut h = h(64);
    with_two_cached_chunks(&mut h, 1, 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    let job = h.alloc(1, &b(1..=3), 8).expect("a load job");
    h.run(&[(1, b(1..=3), 8, 2)], &[], &[]);
    // Preempted before the workers' report arrived: the load is flushed.
    let plan = h.run(&[], &[1], &[]);
    assert_eq!(plan.flush, vec![job]);
    h.complete(&[job], 1);
    assert_eq!(h.s.state().jobs, 0);
}

#[test]
fn a_reset_between_a_reservation_and_its_step_is_refused() {
    let mut h = h(64);
    with_two_cached_chunks(&mut h, 1, 1);
    assert_eq!(h.lookup(1, 0), LookupOutcome::Hit(8));
    // vLLM asserts no sync load is reserved when its cache is reset.
    assert!(matches!(
        h.s.reset(),
        Err(kvoffload::scheduler::SchedulerError::ResetMidStep)
    ));
    assert_eq!(
        h.lookup_key(key(1, 0, 1)),
        kvoffload::manager::LookupResult::Hit,
        "nothing changed"
    );
    h.run(&[], &[], &[]);
    h.s.reset().expect("between steps");
}
