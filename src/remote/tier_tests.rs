//! The tier's own logic over the in-memory store: queueing, deadlines on a
//! manual clock, reconnection with backoff, value checks, counters.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::clock::ManualClock;
use crate::remote::memory_store::{MemoryConnector, MemoryState};
use crate::remote::value::{self, ValueIdentity, ValueRejected};

/// Real-time bound on waiting for the I/O thread's answer (never reached
/// when the code is right; the answer itself is what the tests wait for).
const LIMIT: Duration = Duration::from_secs(10);

struct Fixture {
    state: Arc<MemoryState>,
    clock: ManualClock,
    tier: RemoteTier,
}

fn config() -> RemoteTierConfig {
    RemoteTierConfig {
        op_timeout_ms: 1_000,
        backoff_initial_ms: 100,
        backoff_max_ms: 400,
        ..RemoteTierConfig::for_url("redis://unused:1")
    }
}

fn fixture_with(cfg: RemoteTierConfig, world_size: u32, state: Arc<MemoryState>) -> Fixture {
    let clock = ManualClock::new();
    let tier = RemoteTier::start(
        Box::new(MemoryConnector::new(state.clone())),
        &cfg,
        Namespace::from_fingerprint(0xF00D),
        world_size,
        clock.shared(),
    )
    .expect("the memory store starts");
    Fixture { state, clock, tier }
}

fn fixture() -> Fixture {
    fixture_with(config(), 1, MemoryState::new())
}

fn wait(t: &mut RemoteTier, ticket: Ticket) -> Answer {
    let mut others = Vec::new();
    let a = t.wait(ticket, LIMIT, &mut others).expect("answered");
    assert!(others.is_empty(), "unexpected answers: {others:?}");
    a
}

/// A lookup answered: every put queued before it has been written (the I/O
/// thread runs a batch's puts first, and batches in queue order).
fn flush(t: &mut RemoteTier) {
    let tk = t.lookup(&[]);
    assert_eq!(wait(t, tk), Answer::Present(vec![]));
}

fn row(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn put_then_lookup_then_fetch_round_trips() {
    let mut f = fixture();
    let r = row(1, 4096);
    assert_eq!(f.tier.put(ChunkKey(7), 0, &r), PutOutcome::Queued);
    flush(&mut f.tier);
    let tk = f.tier.lookup(&[ChunkKey(7), ChunkKey(8)]);
    assert_eq!(wait(&mut f.tier, tk), Answer::Present(vec![true, false]));
    let tk = f.tier.fetch(ChunkKey(7), 0, Some(4096));
    match wait(&mut f.tier, tk) {
        Answer::Fetched(p) => assert_eq!(p.bytes(), &r[..]),
        other => panic!("{other:?}"),
    }
    let tk = f.tier.fetch(ChunkKey(8), 0, None);
    assert_eq!(wait(&mut f.tier, tk), Answer::Miss(MissReason::Absent));
    let s = f.tier.stats();
    assert_eq!((s.hits, s.misses, s.puts_written), (1, 1, 1));
    assert_eq!(s.bytes_put, value::encoded_len(4096) as u64);
    assert_eq!(s.lookup_chunks_present, 1);
    assert!(s.connected);
    assert_eq!(f.tier.in_flight(), 0);
}

#[test]
fn a_chunk_is_present_only_when_every_rank_has_its_share() {
    let mut f = fixture_with(config(), 2, MemoryState::new());
    f.tier.put(ChunkKey(1), 0, &row(1, 64));
    f.tier.put(ChunkKey(1), 1, &row(2, 64));
    f.tier.put(ChunkKey(2), 0, &row(3, 64));
    flush(&mut f.tier);
    let tk = f.tier.lookup(&[ChunkKey(1), ChunkKey(2)]);
    assert_eq!(wait(&mut f.tier, tk), Answer::Present(vec![true, false]));
    // Each rank reads its own share.
    let tk = f.tier.fetch(ChunkKey(1), 1, Some(64));
    match wait(&mut f.tier, tk) {
        Answer::Fetched(p) => assert_eq!(p.bytes(), &row(2, 64)[..]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_values_are_misses_that_never_reach_the_caller() {
    let mut f = fixture();
    let ns = f.tier.namespace().clone();
    let id = ValueIdentity {
        namespace: ns.fingerprint(),
        key: 1,
        rank: 0,
    };
    let good = value::encode(id, &row(5, 256));
    // Corrupted in the middle of the payload.
    let mut corrupt = good.clone();
    corrupt[100] ^= 1;
    f.state.insert_raw(&ns.key(1, 0), corrupt);
    // Cut short.
    f.state
        .insert_raw(&ns.key(2, 0), good[..good.len() - 3].to_vec());
    // Another deployment's value under our key.
    let foreign = value::encode(
        ValueIdentity {
            namespace: 0xBAD,
            key: 3,
            rank: 0,
        },
        &row(5, 256),
    );
    f.state.insert_raw(&ns.key(3, 0), foreign);
    // Our value, but for another chunk.
    f.state.insert_raw(&ns.key(4, 0), good.clone());
    // The right chunk, wrong size for the reader's layout.
    let sized = value::encode(ValueIdentity { key: 5, ..id }, &row(5, 128));
    f.state.insert_raw(&ns.key(5, 0), sized);
    let expect = [
        (1, MissReason::Rejected(ValueRejected::Checksum)),
        (
            2,
            MissReason::Rejected(ValueRejected::Truncated {
                got: good.len() - 3,
                expected: good.len(),
            }),
        ),
        (
            3,
            MissReason::Rejected(ValueRejected::Namespace { found: 0xBAD }),
        ),
        (
            4,
            MissReason::Rejected(ValueRejected::OtherChunk { key: 1, rank: 0 }),
        ),
        (
            5,
            MissReason::Rejected(ValueRejected::PayloadSize {
                got: 128,
                expected: 256,
            }),
        ),
    ];
    for (key, why) in expect {
        let tk = f.tier.fetch(ChunkKey(key), 0, Some(256));
        assert_eq!(wait(&mut f.tier, tk), Answer::Miss(why), "key {key}");
    }
    let s = f.tier.stats();
    assert_eq!((s.rejected_values, s.misses, s.hits), (5, 5, 0));
}

#[test]
fn oversized_values_are_refused_both_ways() {
    let cfg = RemoteTierConfig {
        max_value_bytes: 1024,
        ..config()
    };
    let mut f = fixture_with(cfg, 1, MemoryState::new());
    assert_eq!(
        f.tier.put(ChunkKey(1), 0, &row(0, 1024)),
        PutOutcome::DroppedTooLarge
    );
    let ns = f.tier.namespace().clone();
    let big = value::encode(
        ValueIdentity {
            namespace: ns.fingerprint(),
            key: 2,
            rank: 0,
        },
        &row(0, 2000),
    );
    let len = big.len();
    f.state.insert_raw(&ns.key(2, 0), big);
    let tk = f.tier.fetch(ChunkKey(2), 0, None);
    assert_eq!(
        wait(&mut f.tier, tk),
        Answer::Miss(MissReason::TooLarge(len))
    );
    let s = f.tier.stats();
    assert_eq!((s.puts_dropped_too_large, s.rejected_values), (1, 1));
}

#[test]
fn a_key_evicted_between_lookup_and_fetch_is_a_miss() {
    let mut f = fixture();
    f.tier.put(ChunkKey(9), 0, &row(9, 512));
    flush(&mut f.tier);
    let tk = f.tier.lookup(&[ChunkKey(9)]);
    assert_eq!(wait(&mut f.tier, tk), Answer::Present(vec![true]));
    assert!(f.state.remove(&f.tier.namespace().key(9, 0)));
    let tk = f.tier.fetch(ChunkKey(9), 0, Some(512));
    assert_eq!(wait(&mut f.tier, tk), Answer::Miss(MissReason::Absent));
    assert_eq!(
        f.tier.stats().get_errors,
        0,
        "a vanished key is not an error"
    );
}

#[test]
fn a_full_queue_drops_puts_without_waiting() {
    let cfg = RemoteTierConfig {
        queue_capacity: 2,
        max_batch: 1,
        ..config()
    };
    let mut f = fixture_with(cfg, 1, MemoryState::new());
    f.state.hold();
    assert_eq!(f.tier.put(ChunkKey(1), 0, &row(1, 64)), PutOutcome::Queued);
    // The thread took the first put and is held inside the store.
    f.state.wait_calls_entered(1);
    assert_eq!(f.tier.put(ChunkKey(2), 0, &row(2, 64)), PutOutcome::Queued);
    assert_eq!(f.tier.put(ChunkKey(3), 0, &row(3, 64)), PutOutcome::Queued);
    assert_eq!(
        f.tier.put(ChunkKey(4), 0, &row(4, 64)),
        PutOutcome::DroppedQueueFull
    );
    // A lookup finding the queue full is answered at once as a miss.
    let tk = f.tier.lookup(&[ChunkKey(1)]);
    let mut out = Vec::new();
    f.tier.poll(&mut out);
    assert_eq!(out, vec![(tk, Answer::Miss(MissReason::QueueFull))]);
    f.state.release();
    // One batch per put (max_batch 1): the third call means the queue is empty.
    f.state.wait_calls_entered(3);
    flush(&mut f.tier);
    let s = f.tier.stats();
    assert_eq!((s.puts_written, s.puts_dropped_queue_full), (3, 1));
    assert_eq!(f.state.len(), 3);
}

#[test]
fn a_stalled_store_times_out_and_its_late_answer_is_dropped() {
    let mut f = fixture();
    f.state.hold();
    let tk = f.tier.fetch(ChunkKey(1), 0, None);
    f.state.wait_calls_entered(1);
    let mut out = Vec::new();
    f.tier.poll(&mut out);
    assert!(out.is_empty(), "not due yet");
    f.clock.advance(Duration::from_millis(999));
    f.tier.poll(&mut out);
    assert!(out.is_empty(), "not due yet");
    f.clock.advance(Duration::from_millis(1));
    f.tier.poll(&mut out);
    assert_eq!(out, vec![(tk, Answer::Miss(MissReason::TimedOut))]);
    assert_eq!(f.tier.in_flight(), 0);
    f.state.release();
    // The next answer comes after the late one (one channel, in order).
    flush(&mut f.tier);
    let s = f.tier.stats();
    assert_eq!((s.timeouts, s.late_answers, s.misses), (1, 1, 2));
}

#[test]
fn an_outage_degrades_then_the_tier_resumes_after_backoff() {
    let mut f = fixture();
    f.tier.put(ChunkKey(1), 0, &row(1, 64));
    flush(&mut f.tier);
    f.state.set_down(true);
    // The first batch to fail drops the connection.
    let tk = f.tier.fetch(ChunkKey(1), 0, None);
    assert_eq!(wait(&mut f.tier, tk), Answer::Miss(MissReason::Unavailable));
    assert!(!f.tier.is_connected());
    let s = f.tier.stats();
    assert_eq!((s.outages, s.get_errors), (1, 1));
    // Meanwhile: puts dropped at once, lookups find nothing, fetches miss.
    assert_eq!(
        f.tier.put(ChunkKey(2), 0, &row(2, 64)),
        PutOutcome::DroppedUnavailable
    );
    let tk = f.tier.lookup(&[ChunkKey(1)]);
    assert_eq!(wait(&mut f.tier, tk), Answer::Present(vec![false]));
    // The store is back, but the backoff (100 ms) has not passed.
    f.state.set_down(false);
    let tk = f.tier.lookup(&[ChunkKey(1)]);
    assert_eq!(wait(&mut f.tier, tk), Answer::Present(vec![false]));
    assert!(!f.tier.is_connected());
    let connects = f.state.connects();
    f.clock.advance(Duration::from_millis(100));
    let tk = f.tier.lookup(&[ChunkKey(1)]);
    assert_eq!(wait(&mut f.tier, tk), Answer::Present(vec![true]));
    assert!(f.tier.is_connected());
    assert_eq!(f.state.connects(), connects + 1);
    let s = f.tier.stats();
    assert_eq!(s.puts_dropped_unavailable, 1);
    assert_eq!(s.outages, 1);
}

#[test]
fn reconnection_backs_off_exponentially_up_to_the_cap() {
    let mut f = fixture();
    f.state.set_down(true);
    let tk = f.tier.lookup(&[ChunkKey(1)]);
    wait(&mut f.tier, tk);
    assert!(!f.tier.is_connected());
    // Tries at 100 ms (fails; next wait 200), 300 (fails; 400), 700 (fails;
    // 400, the cap), 1100.
    let mut tries = Vec::new();
    for _ in 0..12 {
        f.clock.advance(Duration::from_millis(100));
        let tk = f.tier.lookup(&[]);
        wait(&mut f.tier, tk);
        tries.push(f.tier.stats().reconnect_attempts);
    }
    assert_eq!(tries, vec![1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]);
}

#[test]
fn refused_credentials_stop_the_start_with_a_clear_error() {
    let state = MemoryState::new();
    state.set_refuse_credentials(true);
    let clock = ManualClock::new();
    let err = RemoteTier::start(
        Box::new(MemoryConnector::new(state)),
        &config(),
        Namespace::from_fingerprint(1),
        1,
        clock.shared(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            RemoteError::Store {
                source: StoreError::Auth(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("refused the credentials"), "{err}");
}

#[test]
fn an_unreachable_store_at_start_is_not_an_error() {
    let state = MemoryState::new();
    state.set_down(true);
    let mut f = fixture_with(config(), 1, state);
    assert!(!f.tier.is_connected());
    assert_eq!(f.tier.stats().outages, 1);
    f.state.set_down(false);
    f.clock.advance(Duration::from_millis(100));
    let tk = f.tier.lookup(&[]);
    wait(&mut f.tier, tk);
    assert!(f.tier.is_connected());
}

#[test]
fn dropping_the_tier_ends_its_thread() {
    let f = fixture();
    let state = f.state.clone();
    drop(f);
    // The thread held a connection (an Arc of the state): gone with it.
    assert_eq!(Arc::strong_count(&state), 1);
}
