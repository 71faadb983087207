//! The [`Scheduler`] with several KV groups (a full-attention group and a
//! sliding-window group, vLLM's hybrid manager): lookups over both groups,
//! one load carrying each group's blocks, one store per request carrying
//! each group's chunks, the sliding-window fences and stale blocks, and the
//! errors of calls that do not match the groups; a proptest of a random
//! backend (a sliding-window or chunked-local group) with failed and
//! stalled jobs, preemptions and resets; a Mamba group's states stored
//! from vLLM's hand-offs and loaded at a hit's end, inside a block too
//! (partial tails, with hashes finer than the blocks), beside an EAGLE
//! draft group too (with the random backend run on fixed seeds in that
//! configuration alone, where tails are stored and hit). Which chunks each group
//! offers and loads is vLLM's (checked against its recorded answers in
//! `hybrid_corpus.rs`); these tests check how the scheduler wires them.

use kvoffload::manager::LookupResult;
use kvoffload::scheduler::hybrid::{BoundaryState, GroupAlloc, GroupShape, KvGroups, Retention};
use kvoffload::scheduler::{
    CompletionReport, GroupSpan, LookupOutcome, RequestCaps, ScheduledRequest, Scheduler,
    SchedulerError, StepInput, StepPlan, TransferJob,
};
use kvoffload::{BlockHash, ChunkKey, GpuBlockId, JobId, ManualClock, OffloadConfig, RequestId};
use proptest::prelude::*;

/// 4-token blocks, one block a chunk, 64 host chunks.
fn config() -> OffloadConfig {
    config_with_chunks(64)
}

/// 4-token blocks, one block a chunk, `chunks` host chunks.
fn config_with_chunks(chunks: u64) -> OffloadConfig {
    OffloadConfig {
        tokens_per_block: 4,
        blocks_per_chunk: 1,
        offload_prompt_only: false,
        ..OffloadConfig::with_chunks(chunks)
    }
}

/// Group 0: full attention; group 1: a window of 8 tokens (two chunks).
fn full_and_window(retention: Retention) -> KvGroups {
    KvGroups {
        shapes: vec![
            GroupShape::full_attention(4).unwrap(),
            GroupShape::sliding_window(4, 8).unwrap(),
        ],
        retention,
    }
}

fn scheduler(retention: Retention) -> (Scheduler, ManualClock) {
    scheduler_with_chunks(retention, 64)
}

fn scheduler_with_chunks(retention: Retention, chunks: u64) -> (Scheduler, ManualClock) {
    let clock = ManualClock::new();
    let cfg = config_with_chunks(chunks);
    let s = Scheduler::with_groups(&cfg, full_and_window(retention), clock.shared()).unwrap();
    (s, clock)
}

/// Group 0: full attention; group 1: a Mamba group in vLLM's align mode
/// (its state at each 4-token boundary).
fn full_and_state() -> (Scheduler, ManualClock) {
    let clock = ManualClock::new();
    let groups = KvGroups {
        shapes: vec![
            GroupShape::full_attention(4).unwrap(),
            GroupShape::recurrent_state(4).unwrap(),
        ],
        retention: Retention::BoundariesOnly,
    };
    let s = Scheduler::with_groups(&config(), groups, clock.shared()).unwrap();
    (s, clock)
}

fn ids(v: &[u32]) -> Vec<GpuBlockId> {
    v.iter().map(|&b| GpuBlockId(b)).collect()
}

fn hashes(family: u64, n: u64) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(family * 1000 + i)).collect()
}

fn key(family: u64, chunk: u64, group: u32) -> ChunkKey {
    ChunkKey::for_group(BlockHash(family * 1000 + chunk), group)
}

/// A running request's entry in a step, with its new blocks in group 0
/// (`g0`) and group 1 (`g1`).
type Entry = (ScheduledRequest, Vec<GpuBlockId>);

fn entry(req: u64, computed: u64, scheduled: u64, g0: &[u32], g1: &[u32]) -> Entry {
    let e = ScheduledRequest {
        req: RequestId(req),
        new_block_ids: ids(g0),
        computed_tokens: computed,
        scheduled_tokens: scheduled,
        full_table: false,
    };
    (e, ids(g1))
}

/// A step of `entries` (group 1's blocks in `group_block_ids`).
fn step_of(entries: Vec<Entry>) -> StepInput {
    let (scheduled, g1): (Vec<_>, Vec<_>) = entries.into_iter().unzip();
    StepInput {
        scheduled,
        group_block_ids: g1.into_iter().map(|b| vec![b]).collect(),
        ..StepInput::default()
    }
}

/// Request `req` finishes with group 0's blocks `g0` and `computed` tokens,
/// and a step lists it (its last stores).
fn finish(s: &mut Scheduler, req: RequestId, g0: &[u32], computed: u64) {
    s.request_finished(req, &ids(g0), false, computed).unwrap();
    s.build_step(&StepInput {
        finished: vec![req],
        ..StepInput::default()
    })
    .unwrap();
}

/// Every job of `plan` reported done by the one worker.
fn all_done(plan: &StepPlan) -> CompletionReport {
    CompletionReport {
        completed: plan
            .loads
            .iter()
            .chain(&plan.stores)
            .map(|j| (j.job, 1))
            .collect(),
        failed: vec![],
    }
}

/// A group's span of `n` chunks of one block each, from block `first`.
fn span(n: u32, first: u32) -> GroupSpan {
    GroupSpan {
        num_keys: n,
        num_blocks: n,
        first_block_index: first,
    }
}

/// The spans cut the job's keys, slots and blocks exactly.
fn assert_spans_cover(job: &TransferJob) {
    let keys: u32 = job.groups.iter().map(|s| s.num_keys).sum();
    let blocks: u32 = job.groups.iter().map(|s| s.num_blocks).sum();
    assert_eq!(keys as usize, job.keys.len(), "{job:?}");
    assert_eq!(keys as usize, job.chunk_ids.len(), "{job:?}");
    assert_eq!(blocks as usize, job.block_ids.len(), "{job:?}");
}

/// Request `req` of `family` with a 16-token prompt (four chunks) computed
/// in one step into blocks `g0` and `g1`; returns that step's plan.
fn prefill(s: &mut Scheduler, req: u64, family: u64, g0: &[u32], g1: &[u32]) -> StepPlan {
    let r = RequestId(req);
    s.add_request(r, 16, &hashes(family, 4)).unwrap();
    assert_eq!(s.lookup(r, 0).unwrap(), LookupOutcome::Hit(0));
    let (b0, b1) = (ids(g0), ids(g1));
    assert_eq!(alloc_groups(s, r, &[b0, b1], 0), None);
    s.build_step(&step_of(vec![entry(req, 0, 16, g0, g1)]))
        .unwrap()
}

#[test]
fn one_full_attention_group_is_the_single_group_scheduler_and_bad_groups_are_refused() {
    let clock = ManualClock::new();
    let one = KvGroups {
        shapes: vec![GroupShape::full_attention(4).unwrap()],
        retention: Retention::Dense,
    };
    let s = Scheduler::with_groups(&config(), one, clock.shared()).unwrap();
    assert_eq!(s.num_groups(), 1);
    let (hybrid, _) = scheduler(Retention::Dense);
    assert_eq!(hybrid.num_groups(), 2);
    // A chunk that is not whole configuration blocks (6 tokens over 4).
    let wrong_chunk = KvGroups {
        shapes: vec![
            GroupShape::full_attention(4).unwrap(),
            GroupShape::sliding_window(6, 8).unwrap(),
        ],
        retention: Retention::Dense,
    };
    let err = Scheduler::with_groups(&config(), wrong_chunk, clock.shared()).unwrap_err();
    assert!(
        matches!(&err, SchedulerError::Groups(m) if m.contains("group 1")),
        "{err}"
    );
    let none = KvGroups {
        shapes: vec![],
        retention: Retention::Dense,
    };
    assert!(matches!(
        Scheduler::with_groups(&config(), none, clock.shared()),
        Err(SchedulerError::Groups(_))
    ));
}

#[test]
fn a_prompt_stored_in_both_groups_loads_the_full_prefix_and_the_window() {
    let (mut s, _clock) = scheduler(Retention::Dense);
    let plan = prefill(&mut s, 1, 7, &[1, 2, 3, 4], &[5, 6, 7, 8]);
    assert_eq!(plan.stores.len(), 1, "one store carries both groups");
    let store = &plan.stores[0];
    assert_spans_cover(store);
    // Dense retention: every boundary is a hit end, so every window block is
    // reachable and the window group stores all four chunks too.
    let want: Vec<ChunkKey> = (0..4)
        .map(|c| key(7, c, 0))
        .chain((0..4).map(|c| key(7, c, 1)))
        .collect();
    assert_eq!(store.keys.to_vec(), want);
    assert_eq!(store.block_ids.to_vec(), ids(&[1, 2, 3, 4, 5, 6, 7, 8]));
    assert_eq!(
        store.groups,
        vec![
            GroupSpan {
                num_keys: 4,
                num_blocks: 4,
                first_block_index: 0
            };
            2
        ]
    );
    // The running request's window blocks are fenced from the store's
    // creation; its full-attention blocks only once it finishes.
    assert_eq!(s.fenced_jobs(GpuBlockId(5)), vec![store.job]);
    assert!(s.fenced_jobs(GpuBlockId(1)).is_empty());
    s.check_invariants().unwrap();
    s.on_worker_output(&all_done(&plan));
    assert!(s.fenced_jobs(GpuBlockId(5)).is_empty());
    finish(&mut s, RequestId(1), &[1, 2, 3, 4], 16);

    // Request 2: the same 16 tokens and one more. The hit leaves the last
    // token to compute: 16 tokens, both groups ending at chunk 4.
    let r2 = RequestId(2);
    let mut h = hashes(7, 4);
    h.push(BlockHash(99));
    s.add_request(r2, 17, &h[..4]).unwrap();
    assert_eq!(s.lookup(r2, 0).unwrap(), LookupOutcome::Hit(16));
    // The full-attention chunks the lookup found, as vLLM's `record_lookup`
    // sees them (its self-describing events): group 0's four, none of the
    // window group's.
    assert_eq!(
        s.last_lookup_group_hits(),
        &[(0, 0), (0, 1), (0, 2), (0, 3)]
    );
    assert_eq!(s.last_lookup_hits(), None);
    // vLLM allocates the window group's blocks behind the window as null.
    let (b0, b1) = (ids(&[11, 12, 13, 14, 15]), ids(&[0, 0, 17, 18, 19]));
    let job = alloc_groups(&mut s, r2, &[b0, b1], 16).unwrap();
    // A third request with the same prefix waits for the window's chunks.
    s.add_request(RequestId(3), 17, &h[..4]).unwrap();
    assert_eq!(s.lookup(RequestId(3), 0).unwrap(), LookupOutcome::Defer);
    let plan = s.build_step(&StepInput::default()).unwrap();
    let load = &plan.loads[0];
    assert_eq!(load.job, job);
    assert_spans_cover(load);
    assert_eq!(
        load.keys.to_vec(),
        vec![
            key(7, 0, 0),
            key(7, 1, 0),
            key(7, 2, 0),
            key(7, 3, 0),
            key(7, 2, 1),
            key(7, 3, 1)
        ]
    );
    assert_eq!(load.block_ids.to_vec(), ids(&[11, 12, 13, 14, 17, 18]));
    assert_eq!(
        load.groups,
        vec![
            GroupSpan {
                num_keys: 4,
                num_blocks: 4,
                first_block_index: 0
            },
            GroupSpan {
                num_keys: 2,
                num_blocks: 2,
                first_block_index: 2
            }
        ]
    );
    // Full attention covers the whole hit: every token from the host tier.
    let sources = s.hit_sources(r2, 16).unwrap();
    assert_eq!((sources.host_tokens, sources.uncovered_tokens), (16, 0));
    assert!(s.is_being_loaded(key(7, 3, 1)));
    assert!(
        !s.is_being_loaded(key(7, 1, 1)),
        "chunks behind the window are not loaded"
    );
    s.check_invariants().unwrap();
    let outcome = s.on_worker_output(&all_done(&plan));
    assert_eq!(outcome.finished_loads, vec![r2]);
    assert_eq!(
        s.lookup(RequestId(3), 0).unwrap(),
        LookupOutcome::Hit(16),
        "the wait ends with the load"
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_mamba_state_is_stored_from_its_hand_off_and_loaded_at_the_hits_end() {
    let (mut s, _clock) = full_and_state();
    let r1 = RequestId(1);
    s.add_request(r1, 16, &hashes(7, 4)).unwrap();
    assert_eq!(s.lookup(r1, 0).unwrap(), LookupOutcome::Hit(0));
    // vLLM's align mode keeps only the running state's block.
    let (g0, g1) = (ids(&[1, 2, 3, 4]), ids(&[0, 0, 0, 5]));
    assert_eq!(alloc_groups(&mut s, r1, &[g0, g1], 0), None);
    let state = |req: u64, group: usize, block: u32, boundary: u64| BoundaryState {
        req: RequestId(req),
        group,
        block: GpuBlockId(block),
        boundary,
    };
    let mut step = step_of(vec![entry(1, 0, 16, &[1, 2, 3, 4], &[0, 0, 0, 5])]);
    step.boundary_states = vec![
        // Skipped: an unknown request, a group that is not Mamba's, the
        // null block, a boundary inside a chunk, one past the request's
        // tokens.
        state(9, 1, 5, 16),
        state(1, 0, 4, 16),
        state(1, 1, 0, 16),
        state(1, 1, 5, 14),
        state(1, 1, 5, 20),
        // The state after 16 tokens, in block 5.
        state(1, 1, 5, 16),
    ];
    let plan = s.build_step(&step).unwrap();
    assert_eq!(plan.stores.len(), 2, "{:?}", plan.stores);
    // The hand-off's store comes first (vLLM plans it before the others):
    // group 1's chunk 3 from block 5, its only block.
    let handed = &plan.stores[0];
    assert_spans_cover(handed);
    assert_eq!(handed.keys.to_vec(), vec![key(7, 3, 1)]);
    assert_eq!(handed.block_ids.to_vec(), ids(&[5]));
    assert_eq!(handed.groups, vec![span(0, 0), span(1, 3)]);
    // The block table's store offers only the full-attention chunks.
    let table = &plan.stores[1];
    assert_eq!(
        table.keys.to_vec(),
        (0..4).map(|c| key(7, c, 0)).collect::<Vec<_>>()
    );
    assert_eq!(table.groups[1].num_keys, 0);
    // The state's block is fenced from the store's creation.
    assert_eq!(s.fenced_jobs(GpuBlockId(5)), vec![handed.job]);
    s.check_invariants().unwrap();
    // A hand-off of a chunk already stored (or being stored) is no store.
    let again = StepInput {
        boundary_states: vec![state(1, 1, 5, 16)],
        ..StepInput::default()
    };
    assert!(s.build_step(&again).unwrap().stores.is_empty());
    s.on_worker_output(&all_done(&plan));
    assert!(s.fenced_jobs(GpuBlockId(5)).is_empty());
    finish(&mut s, r1, &[1, 2, 3, 4], 16);

    // Request 2: the 16 tokens and one more. The hit ends on the state's
    // boundary (16), and the Mamba group loads that one state.
    let r2 = RequestId(2);
    let mut h = hashes(7, 4);
    h.push(BlockHash(99));
    s.add_request(r2, 17, &h[..4]).unwrap();
    assert_eq!(s.lookup(r2, 0).unwrap(), LookupOutcome::Hit(16));
    let (b0, b1) = (ids(&[11, 12, 13, 14, 15]), ids(&[0, 0, 0, 18, 19]));
    let job = alloc_groups(&mut s, r2, &[b0, b1], 16).unwrap();
    let plan = s.build_step(&StepInput::default()).unwrap();
    let load = plan.loads.iter().find(|l| l.job == job).expect("the load");
    assert_spans_cover(load);
    // Group 0's four chunks, and the state after them.
    let want: Vec<ChunkKey> = (0..4).map(|c| key(7, c, 0)).chain([key(7, 3, 1)]).collect();
    assert_eq!(load.keys.to_vec(), want);
    assert_eq!(load.block_ids.to_vec(), ids(&[11, 12, 13, 14, 18]));
    assert_eq!(load.groups[1], span(1, 3));
    // The state stands for the whole prefix: every token from the host tier.
    let sources = s.hit_sources(r2, 16).unwrap();
    assert_eq!((sources.host_tokens, sources.uncovered_tokens), (16, 0));
    s.check_invariants().unwrap();

    // Request 3: 15 tokens of the prefix. Its hit would end at 14 (the last
    // token is computed again), which is no state boundary: it ends at 12,
    // where no state was stored, so there is none.
    let r3 = RequestId(3);
    s.add_request(r3, 15, &h[..3]).unwrap();
    assert_eq!(s.lookup(r3, 0).unwrap(), LookupOutcome::Hit(0));
}

/// Hashes every 2 tokens (vLLM's `prefix_match_unit` finer than the
/// 4-token blocks): `n` of `family`'s.
fn hash_units(family: u64, n: u64) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(family * 1000 + 100 + i)).collect()
}

/// The block hashes of `units` (each block's last: every second one).
fn blocks_of(units: &[BlockHash]) -> Vec<BlockHash> {
    units.iter().skip(1).step_by(2).copied().collect()
}

/// `family`'s first `n` hashes every 2 tokens, whose every second one is
/// its block hash (`hashes`).
fn units_of(family: u64, n: u64) -> Vec<BlockHash> {
    (0..n)
        .map(|i| {
            if i % 2 == 1 {
                BlockHash(family * 1000 + i / 2)
            } else {
                BlockHash(family * 1000 + 500 + i / 2)
            }
        })
        .collect()
}

/// The partial-tail key of `group` at `boundary` tokens over `units`.
fn tail_key(units: &[BlockHash], boundary: usize, group: u32) -> ChunkKey {
    ChunkKey::for_group(units[boundary / 2 - 1], group)
}

#[test]
fn partial_tails_need_vllms_conditions() {
    // Windows beside the state, chunks of several blocks, hashes not finer
    // than the block, no recurrent state: vLLM builds no partial tails.
    let clock = ManualClock::new();
    let mut windowed = Scheduler::with_groups(
        &config(),
        KvGroups {
            shapes: vec![
                GroupShape::recurrent_state(4).unwrap(),
                GroupShape::sliding_window(4, 8).unwrap(),
            ],
            retention: Retention::BoundariesOnly,
        },
        clock.shared(),
    )
    .unwrap();
    let err = windowed.enable_partial_tails(2).unwrap_err().to_string();
    assert!(err.contains("group 1 is windowed"), "{err}");
    let (mut s, _c) = scheduler(Retention::BoundariesOnly);
    let err = s.enable_partial_tails(2).unwrap_err().to_string();
    assert!(err.contains("no recurrent-state group"), "{err}");
    let wide = OffloadConfig {
        blocks_per_chunk: 2,
        ..config()
    };
    let mut two = Scheduler::with_groups(
        &wide,
        KvGroups {
            shapes: vec![
                GroupShape::full_attention(8).unwrap(),
                GroupShape::recurrent_state(8).unwrap(),
            ],
            retention: Retention::BoundariesOnly,
        },
        clock.shared(),
    )
    .unwrap();
    let err = two.enable_partial_tails(2).unwrap_err().to_string();
    assert!(err.contains("chunks of 2 blocks"), "{err}");
    let (mut s, _c) = full_and_state();
    for tph in [0, 3, 4, 8] {
        assert!(s.enable_partial_tails(tph).is_err(), "{tph} tokens a hash");
    }
    assert!(!s.partial_tails_enabled());
    s.enable_partial_tails(2).unwrap();
    assert!(s.partial_tails_enabled());
}

#[test]
fn a_mamba_state_inside_a_block_is_stored_with_its_attention_block_and_loaded_as_the_hits_tail() {
    let (mut s, _clock) = full_and_state();
    s.enable_partial_tails(2).unwrap();
    // Request 1: an 11-token prompt, hashed every 2 tokens (5 hashes: the
    // last at 10). vLLM computes the prompt to its last hash boundary.
    let r1 = RequestId(1);
    let u1 = hash_units(7, 5);
    s.add_request(r1, 11, &blocks_of(&u1)).unwrap();
    s.add_hash_units(r1, &u1).unwrap();
    assert_eq!(s.num_hash_units(r1), 5);
    assert_eq!(s.lookup(r1, 0).unwrap(), LookupOutcome::Hit(0));
    let (g0, g1) = (ids(&[1, 2, 3]), ids(&[0, 0, 5]));
    assert_eq!(alloc_groups(&mut s, r1, &[g0, g1], 0), None);
    let plan = s
        .build_step(&step_of(vec![entry(1, 0, 10, &[1, 2, 3], &[0, 0, 5])]))
        .unwrap();
    s.on_worker_output(&all_done(&plan));
    let state = |block: u32, boundary: u64| BoundaryState {
        req: r1,
        group: 1,
        block: GpuBlockId(block),
        boundary,
    };
    // vLLM's core hands over the state at 8 (a block boundary) and, copied
    // out of the running block 5 into block 6, the state at 10. Skipped:
    // a boundary off the hash unit, one past the prompt.
    let step = StepInput {
        boundary_states: vec![state(4, 8), state(6, 10)],
        ..StepInput::default()
    };
    let plan = s.build_step(&step).unwrap();
    assert_eq!(plan.stores.len(), 2, "{:?}", plan.stores);
    let tail = &plan.stores[1];
    assert_spans_cover(tail);
    // One job: the full-attention block holding tokens 8..10 (block 3, at
    // index 2) and the handed state, each under its key at 10.
    assert_eq!(
        tail.keys.to_vec(),
        vec![tail_key(&u1, 10, 0), tail_key(&u1, 10, 1)]
    );
    assert_eq!(tail.block_ids.to_vec(), ids(&[3, 6]));
    assert_eq!(tail.groups, vec![span(1, 2), span(1, 2)]);
    // Both blocks fenced from the store's creation.
    assert_eq!(s.fenced_jobs(GpuBlockId(3)), vec![tail.job]);
    assert_eq!(s.fenced_jobs(GpuBlockId(6)), vec![tail.job]);
    let named: Vec<(usize, u64)> = s
        .last_partial_tails()
        .iter()
        .map(|t| (t.group, t.boundary))
        .collect();
    assert_eq!(named, vec![(0, 10), (1, 10)]);
    s.check_invariants().unwrap();
    // Held already, offered again: no store. Off the hash unit, or past
    // the prompt: skipped.
    let again = StepInput {
        boundary_states: vec![state(6, 10)],
        ..StepInput::default()
    };
    let odd = StepInput {
        boundary_states: vec![state(6, 9)],
        ..StepInput::default()
    };
    let past = StepInput {
        boundary_states: vec![state(6, 14)],
        ..StepInput::default()
    };
    for input in [again, odd, past] {
        assert!(s.build_step(&input).unwrap().stores.is_empty());
    }
    s.on_worker_output(&all_done(&plan));
    assert!(s.fenced_jobs(GpuBlockId(6)).is_empty());
    finish(&mut s, r1, &[1, 2, 3], 10);

    // Request 2 shares the first 10 tokens (13 in all). The complete
    // chunks hit to 8 (the state there), the partial tail at 10 in both
    // groups ends the hit there.
    let r2 = RequestId(2);
    let mut u2 = u1.clone();
    u2.push(BlockHash(99));
    s.add_request(r2, 13, &blocks_of(&u2)).unwrap();
    s.add_hash_units(r2, &u2).unwrap();
    assert_eq!(s.lookup(r2, 0).unwrap(), LookupOutcome::Hit(10));
    let (b0, b1) = (ids(&[11, 12, 13, 14]), ids(&[0, 0, 17, 18]));
    let job = alloc_groups(&mut s, r2, &[b0, b1], 10).unwrap();
    let plan = s.build_step(&StepInput::default()).unwrap();
    let load = plan.loads.iter().find(|l| l.job == job).expect("the load");
    assert_spans_cover(load);
    // Group 0: its two chunks, then the tail into block 13; group 1: the
    // state after 10 tokens into block 17 (index 2).
    let want = vec![
        key(7, 101, 0),
        key(7, 103, 0),
        tail_key(&u1, 10, 0),
        tail_key(&u1, 10, 1),
    ];
    assert_eq!(load.keys.to_vec(), want);
    assert_eq!(load.block_ids.to_vec(), ids(&[11, 12, 13, 17]));
    assert_eq!(load.groups, vec![span(3, 0), span(1, 2)]);
    let sources = s.hit_sources(r2, 10).unwrap();
    assert_eq!((sources.host_tokens, sources.uncovered_tokens), (10, 0));
    s.check_invariants().unwrap();
    s.on_worker_output(&all_done(&plan));

    // Request 3 has 11 tokens of that prefix but its load may take 9: the
    // tail at 10 is past the cap, and no state is stored at the other
    // boundaries past 8.
    let r3 = RequestId(3);
    s.add_request(r3, 11, &blocks_of(&u1)).unwrap();
    s.add_hash_units(r3, &u1).unwrap();
    s.set_request_caps(
        r3,
        RequestCaps {
            max_load_tokens: Some(9),
            ..RequestCaps::default()
        },
    )
    .unwrap();
    assert_eq!(s.lookup(r3, 0).unwrap(), LookupOutcome::Hit(8));
}

/// Puts `keys` in the host tier, ready (another node's or an earlier
/// request's stores).
fn seed_tier(s: &mut Scheduler, keys: &[ChunkKey]) {
    let m = s.manager_mut();
    let out = m.prepare_store(keys, None).unwrap();
    assert_eq!(out.keys_to_store.len(), keys.len());
    m.complete_store(keys, kvoffload::manager::StoreOutcome::Success, None)
        .unwrap();
}

/// An EAGLE/MTP draft group (full attention) beside a Mamba group, 4-token
/// blocks, a hash every token: partial tails with a proof margin of 1.
fn draft_and_state() -> Scheduler {
    let groups = KvGroups {
        shapes: vec![
            GroupShape::full_attention(4).unwrap().eagle_draft(),
            GroupShape::recurrent_state(4).unwrap(),
        ],
        retention: Retention::BoundariesOnly,
    };
    let mut s = Scheduler::with_groups(&config(), groups, ManualClock::new().shared()).unwrap();
    s.enable_partial_tails(1).unwrap();
    s
}

#[test]
fn a_draft_groups_partial_tail_is_keyed_a_proof_margin_past_its_boundary() {
    let mut s = draft_and_state();
    assert_eq!(s.partial_tail_eagle_margin(), 1);
    // vLLM's margin is the hash unit or the block, nothing else.
    assert!(s.set_partial_tail_eagle_margin(3).is_err());
    s.set_partial_tail_eagle_margin(4).unwrap();
    s.set_partial_tail_eagle_margin(1).unwrap();
    // `family`'s hashes, one a token (`u[i]` at token i + 1); its block
    // hashes every fourth.
    let units = |family: u64| hash_units(family, 19);
    let blocks = |u: &[BlockHash]| u.iter().skip(3).step_by(4).copied().collect::<Vec<_>>();
    let at = |u: &[BlockHash], tokens: usize, group: u32| ChunkKey::for_group(u[tokens - 1], group);
    let add = |s: &mut Scheduler, req: u64, family: u64| {
        let u = units(family);
        s.add_request(RequestId(req), 19, &blocks(&u)).unwrap();
        s.add_hash_units(RequestId(req), &u).unwrap();
    };

    // Family 7: the draft group's chunks 0 and 1, no state at a block
    // boundary, and a partial tail at 6: the state after 6 tokens and the
    // draft block keyed by the hash at 7.
    let u = units(7);
    seed_tier(
        &mut s,
        &[at(&u, 4, 0), at(&u, 8, 0), at(&u, 6, 1), at(&u, 7, 0)],
    );
    add(&mut s, 1, 7);
    // The complete chunks find nothing (no state at 4), the tail at 7
    // misses its state, the one at 6 hits (its bridge, chunk 0, was
    // confirmed by the complete lookup).
    assert_eq!(s.lookup(RequestId(1), 0).unwrap(), LookupOutcome::Hit(6));
    let named: Vec<(usize, u64, u64)> = s
        .last_partial_tails()
        .iter()
        .map(|t| (t.group, t.boundary, t.key_tokens))
        .collect();
    assert_eq!(named, vec![(0, 6, 7), (1, 6, 6)]);
    let (g0, g1) = (ids(&[11, 12, 13, 14, 15]), ids(&[0, 17, 18, 19, 20]));
    let job = alloc_groups(&mut s, RequestId(1), &[g0, g1], 6).unwrap();
    let plan = s.build_step(&StepInput::default()).unwrap();
    let load = plan.loads.iter().find(|l| l.job == job).expect("the load");
    assert_spans_cover(load);
    // The draft group: chunk 0 (the bridge), then the tail keyed at 7
    // into the block holding token 5; the state into block 17.
    assert_eq!(
        load.keys.to_vec(),
        vec![at(&u, 4, 0), at(&u, 7, 0), at(&u, 6, 1)]
    );
    assert_eq!(load.block_ids.to_vec(), ids(&[11, 12, 17]));
    assert_eq!(load.groups, vec![span(2, 0), span(1, 1)]);
    s.on_worker_output(&all_done(&plan));
    s.check_invariants().unwrap();

    // Family 8: the same tail keys, but no chunk 0: the complete lookup
    // never confirmed the bridge, its lookup misses, and only boundaries
    // before it (up to 3) are tried. No hit.
    let u8 = units(8);
    seed_tier(&mut s, &[at(&u8, 7, 0), at(&u8, 6, 1)]);
    add(&mut s, 2, 8);
    assert_eq!(s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Hit(0));
    assert!(s.last_partial_tails().is_empty());

    // Request 1 (it loaded from the tier) runs on. A hand-off at 9 while
    // the step computes to 9 only: its draft KV up to 10 is not computed,
    // no store. Computing to 10: stored, the draft block (token 9 is in
    // block 13) under the hash at 10, the handed state under the hash at 9.
    let tail_keys = [at(&u, 10, 0), at(&u, 9, 1)];
    let handed = |boundary: u64| BoundaryState {
        req: RequestId(1),
        group: 1,
        block: GpuBlockId(30),
        boundary,
    };
    let mut early = step_of(vec![entry(
        1,
        6,
        3,
        &[11, 12, 13, 14, 15],
        &[0, 17, 18, 19, 20],
    )]);
    early.boundary_states = vec![handed(9)];
    let plan = s.build_step(&early).unwrap();
    assert!(
        plan.stores
            .iter()
            .all(|j| !j.keys.iter().any(|k| tail_keys.contains(k))),
        "{:?}",
        plan.stores
    );
    s.on_worker_output(&all_done(&plan));
    let mut done = step_of(vec![entry(1, 9, 1, &[], &[])]);
    done.boundary_states = vec![handed(9)];
    let plan = s.build_step(&done).unwrap();
    let tail = plan
        .stores
        .iter()
        .find(|j| j.keys.contains(&tail_keys[1]))
        .expect("the tail's store");
    assert_spans_cover(tail);
    assert_eq!(tail.keys.to_vec(), tail_keys.to_vec());
    assert_eq!(tail.block_ids.to_vec(), ids(&[13, 30]));
    assert_eq!(tail.groups, vec![span(1, 2), span(1, 2)]);
    let named: Vec<(usize, u64, u64)> = s
        .last_partial_tails()
        .iter()
        .map(|t| (t.group, t.boundary, t.key_tokens))
        .collect();
    assert_eq!(named, vec![(0, 9, 10), (1, 9, 9)]);
    s.on_worker_output(&all_done(&plan));
    s.check_invariants().unwrap();

    // Request 3 never loaded from the tier: its tails stay in the GPU's
    // prefix cache (vLLM stores none).
    add(&mut s, 3, 9);
    assert_eq!(s.lookup(RequestId(3), 0).unwrap(), LookupOutcome::Hit(0));
    let (g0, g1) = (ids(&[41, 42, 43, 44, 45]), ids(&[0, 0, 0, 0, 46]));
    assert_eq!(alloc_groups(&mut s, RequestId(3), &[g0, g1], 0), None);
    let mut first = step_of(vec![entry(
        3,
        0,
        10,
        &[41, 42, 43, 44, 45],
        &[0, 0, 0, 0, 46],
    )]);
    first.boundary_states = vec![BoundaryState {
        req: RequestId(3),
        group: 1,
        block: GpuBlockId(47),
        boundary: 9,
    }];
    let plan = s.build_step(&first).unwrap();
    let u9 = units(9);
    assert!(
        plan.stores.iter().all(|j| !j.keys.contains(&at(&u9, 9, 1))),
        "{:?}",
        plan.stores
    );
    s.check_invariants().unwrap();
}

/// Request 1 (8 tokens of family 3) computed in one step, its state after
/// them handed over in block 5, the block it got in that step: the plan.
fn handed_over_in_its_own_block(s: &mut Scheduler) -> StepPlan {
    let r1 = RequestId(1);
    s.add_request(r1, 8, &hashes(3, 2)).unwrap();
    assert_eq!(s.lookup(r1, 0).unwrap(), LookupOutcome::Hit(0));
    assert_eq!(alloc_groups(s, r1, &[ids(&[1, 2]), ids(&[0, 5])], 0), None);
    let mut step = step_of(vec![entry(1, 0, 8, &[1, 2], &[0, 5])]);
    step.boundary_states = vec![BoundaryState {
        req: r1,
        group: 1,
        block: GpuBlockId(5),
        boundary: 8,
    }];
    s.build_step(&step).unwrap()
}

#[test]
fn a_block_holding_a_handed_over_state_flushes_its_store_when_allocated_again() {
    let (mut s, _clock) = full_and_state();
    let plan = handed_over_in_its_own_block(&mut s);
    let handed = plan.stores[0].job;
    assert_eq!(plan.stores[0].block_ids.to_vec(), ids(&[5]));
    // vLLM moves the state on (align mode frees the block behind it), and
    // gives block 5 to another request while the store still reads it: the
    // store is flushed before the model writes there.
    s.note_allocated_elsewhere(&ids(&[5]));
    let next = s.build_step(&StepInput::default()).unwrap();
    assert_eq!(next.flush, vec![handed]);
    s.check_invariants().unwrap();
}

#[test]
fn a_hand_off_whose_block_goes_to_another_request_in_its_step_is_flushed() {
    let (mut s, _clock) = full_and_state();
    let r1 = RequestId(1);
    // The state handed over in the step that computes it, in the block
    // the request got in that step: stored after the step's compute.
    let plan = handed_over_in_its_own_block(&mut s);
    assert_eq!(plan.stores[0].block_ids.to_vec(), ids(&[5]));
    assert!(plan.flush.is_empty(), "{:?}", plan.flush);
    assert!(s.handoff_flushes().is_empty());
    s.on_worker_output(&all_done(&plan));
    finish(&mut s, r1, &[1, 2], 8);
    assert_eq!(s.build_step(&StepInput::default()).unwrap().stores.len(), 0);

    // A second request of other tokens; in the step it gets block 5, the
    // hand-off of a third request's state in block 5 arrives (vLLM freed
    // the block as speculative decoding moved that request past it): the
    // new owner writes block 5 in this step's compute, so the hand-off's
    // store is flushed (copied before it).
    let (r2, r3) = (RequestId(2), RequestId(3));
    s.add_request(r3, 8, &hashes(9, 2)).unwrap();
    assert_eq!(s.lookup(r3, 0).unwrap(), LookupOutcome::Hit(0));
    assert_eq!(
        alloc_groups(&mut s, r3, &[ids(&[11, 12]), ids(&[0, 13])], 0),
        None
    );
    s.build_step(&step_of(vec![entry(3, 0, 8, &[11, 12], &[0, 13])]))
        .unwrap();
    s.add_request(r2, 8, &hashes(4, 2)).unwrap();
    assert_eq!(s.lookup(r2, 0).unwrap(), LookupOutcome::Hit(0));
    assert_eq!(
        alloc_groups(&mut s, r2, &[ids(&[6, 7]), ids(&[0, 5])], 0),
        None
    );
    let mut step = step_of(vec![entry(2, 0, 8, &[6, 7], &[0, 5])]);
    step.boundary_states = vec![BoundaryState {
        req: r3,
        group: 1,
        block: GpuBlockId(5),
        boundary: 8,
    }];
    let plan = s.build_step(&step).unwrap();
    let handed = plan
        .stores
        .iter()
        .find(|t| t.req == r3)
        .expect("the hand-off's store");
    assert_eq!(handed.block_ids.to_vec(), ids(&[5]));
    assert_eq!(plan.flush, vec![handed.job]);
    assert_eq!(s.handoff_flushes(), &[handed.job]);
    assert_eq!(s.metrics().handoffs_flushed, 1);
    s.check_invariants().unwrap();
    // The next plan has none.
    s.on_worker_output(&all_done(&plan));
    s.build_step(&StepInput::default()).unwrap();
    assert!(s.handoff_flushes().is_empty());
}

#[test]
fn a_hand_off_of_an_earlier_state_whose_block_its_request_gets_back_in_its_step_is_flushed() {
    // vLLM 0.33.0 under speculative decoding (seed 72006): the state after
    // 8 tokens, committed in an earlier step, is handed over in block 5 in
    // the step whose allocation retired it and gave block 5 back to the
    // same request as its next speculative column. This step's forward
    // writes that column: the store is flushed (copied before it).
    let (mut s, _clock) = full_and_state();
    let r1 = RequestId(1);
    s.add_request(r1, 12, &hashes(3, 3)).unwrap();
    assert_eq!(s.lookup(r1, 0).unwrap(), LookupOutcome::Hit(0));
    assert_eq!(
        alloc_groups(&mut s, r1, &[ids(&[1, 2]), ids(&[0, 5])], 0),
        None
    );
    let first = s
        .build_step(&step_of(vec![entry(1, 0, 8, &[1, 2], &[0, 5])]))
        .unwrap();
    s.on_worker_output(&all_done(&first));
    let mut step = step_of(vec![entry(1, 8, 4, &[3], &[5])]);
    step.boundary_states = vec![BoundaryState {
        req: r1,
        group: 1,
        block: GpuBlockId(5),
        boundary: 8,
    }];
    let plan = s.build_step(&step).unwrap();
    let handed = plan
        .stores
        .iter()
        .find(|t| t.block_ids.to_vec() == ids(&[5]))
        .expect("the hand-off's store");
    assert_eq!(plan.flush, vec![handed.job]);
    assert_eq!(s.handoff_flushes(), &[handed.job]);
    assert_eq!(s.metrics().handoffs_flushed, 1);
    s.check_invariants().unwrap();
}

#[test]
fn a_group_of_larger_blocks_keys_each_chunk_by_the_last_hash_in_it() {
    // Group 0: full attention over 4-token blocks; group 1: a 16-token
    // window over 8-token blocks (vLLM grows a group of smaller pages to
    // larger blocks). The requests carry one hash per 4 tokens.
    let clock = ManualClock::new();
    let groups = KvGroups {
        shapes: vec![
            GroupShape::full_attention(4).unwrap(),
            GroupShape::sliding_window(8, 16).unwrap(),
        ],
        retention: Retention::Dense,
    };
    let mut s = Scheduler::with_groups(&config(), groups, clock.shared()).unwrap();
    let r1 = RequestId(1);
    s.add_request(r1, 16, &hashes(7, 4)).unwrap();
    assert_eq!(s.lookup(r1, 0).unwrap(), LookupOutcome::Hit(0));
    let (b0, b1) = (ids(&[1, 2, 3, 4]), ids(&[5, 6]));
    assert_eq!(alloc_groups(&mut s, r1, &[b0, b1], 0), None);
    let plan = s
        .build_step(&step_of(vec![entry(1, 0, 16, &[1, 2, 3, 4], &[5, 6])]))
        .unwrap();
    let store = &plan.stores[0];
    assert_spans_cover(store);
    // Group 1's chunk c spans hashes 2c and 2c + 1: its key is the latter.
    let want: Vec<ChunkKey> = (0..4)
        .map(|c| key(7, c, 0))
        .chain([key(7, 1, 1), key(7, 3, 1)])
        .collect();
    assert_eq!(store.keys.to_vec(), want);
    assert_eq!(store.block_ids.to_vec(), ids(&[1, 2, 3, 4, 5, 6]));
    s.on_worker_output(&all_done(&plan));
    finish(&mut s, r1, &[1, 2, 3, 4], 16);

    // The same 16 tokens and one more: both groups hit 16 tokens (group
    // 1's two chunks end at tokens 8 and 16).
    let r2 = RequestId(2);
    s.add_request(r2, 17, &hashes(7, 4)).unwrap();
    assert_eq!(s.lookup(r2, 0).unwrap(), LookupOutcome::Hit(16));
    let (b0, b1) = (ids(&[11, 12, 13, 14, 15]), ids(&[16, 17, 18]));
    let job = alloc_groups(&mut s, r2, &[b0, b1], 16).unwrap();
    let plan = s.build_step(&StepInput::default()).unwrap();
    let load = &plan.loads[0];
    assert_eq!(load.job, job);
    assert_spans_cover(load);
    assert_eq!(
        &load.keys[..4],
        &(0..4).map(|c| key(7, c, 0)).collect::<Vec<_>>()[..]
    );
    assert_eq!(&load.block_ids[..4], &ids(&[11, 12, 13, 14])[..]);
    // Group 1 loads its window's chunks, each into its own 8-token block.
    let window = load.groups[1];
    assert!(
        window.num_keys >= 1 && window.num_keys == window.num_blocks,
        "{window:?}"
    );
    let first = window.first_block_index as usize;
    assert_eq!(
        first + window.num_blocks as usize,
        2,
        "ends at the hit's end"
    );
    let want_keys: Vec<ChunkKey> = [key(7, 1, 1), key(7, 3, 1)][first..].to_vec();
    assert_eq!(&load.keys[4..], &want_keys[..]);
    assert_eq!(&load.block_ids[4..], &ids(&[16, 17])[first..]);
    let sources = s.hit_sources(r2, 16).unwrap();
    assert_eq!((sources.host_tokens, sources.uncovered_tokens), (16, 0));
    s.check_invariants().unwrap();
    let outcome = s.on_worker_output(&all_done(&plan));
    assert_eq!(outcome.finished_loads, vec![r2]);
    s.check_invariants().unwrap();
}

#[test]
fn with_windows_only_the_history_before_the_windows_is_not_from_the_host_tier() {
    let clock = ManualClock::new();
    let windows = KvGroups {
        shapes: vec![
            GroupShape::sliding_window(4, 8).unwrap(),
            GroupShape::sliding_window(4, 4).unwrap(),
        ],
        retention: Retention::Dense,
    };
    let mut s = Scheduler::with_groups(&config(), windows, clock.shared()).unwrap();
    let plan = prefill(&mut s, 1, 2, &[1, 2, 3, 4], &[5, 6, 7, 8]);
    s.on_worker_output(&all_done(&plan));
    s.request_finished(RequestId(1), &[], false, 16).unwrap();
    s.build_step(&StepInput {
        finished: vec![RequestId(1)],
        ..StepInput::default()
    })
    .unwrap();
    let r2 = RequestId(2);
    s.add_request(r2, 17, &hashes(2, 4)).unwrap();
    assert_eq!(s.lookup(r2, 0).unwrap(), LookupOutcome::Hit(16));
    // The 8-token window loads blocks 2 and 3, the 4-token one block 3.
    let (b0, b1) = (ids(&[0, 0, 11, 12, 13]), ids(&[0, 0, 0, 14, 15]));
    alloc_groups(&mut s, r2, &[b0, b1], 16).unwrap();
    let plan = s.build_step(&StepInput::default()).unwrap();
    assert_eq!(
        plan.loads[0].groups,
        vec![
            GroupSpan {
                num_keys: 2,
                num_blocks: 2,
                first_block_index: 2
            },
            GroupSpan {
                num_keys: 1,
                num_blocks: 1,
                first_block_index: 3
            }
        ]
    );
    // Tokens 8..16 come from host chunks; 0..8 from none (vLLM:
    // external_unspecified).
    let sources = s.hit_sources(r2, 16).unwrap();
    assert_eq!(
        (
            sources.host_tokens,
            sources.remote_tokens,
            sources.uncovered_tokens
        ),
        (8, 0, 8)
    );
    s.check_invariants().unwrap();
}

#[test]
fn a_window_block_allocated_again_flushes_its_store_or_drops_out_of_the_table() {
    let (mut s, _clock) = scheduler(Retention::Dense);
    // Request 1 computes 6 of its 16 tokens: chunk 0 is stored (window block
    // 5 fenced); chunk 1's window block 6 is not complete yet.
    let r1 = RequestId(1);
    s.add_request(r1, 16, &hashes(3, 4)).unwrap();
    assert_eq!(s.lookup(r1, 0).unwrap(), LookupOutcome::Hit(0));
    let plan = s
        .build_step(&step_of(vec![entry(1, 0, 6, &[1, 2], &[5, 6])]))
        .unwrap();
    let store = plan.stores[0].job;
    assert_eq!(
        plan.stores[0].keys.to_vec(),
        vec![key(3, 0, 0), key(3, 0, 1)]
    );
    assert_eq!(s.fenced_jobs(GpuBlockId(5)), vec![store]);
    // Blocks 5 and 6 go to request 2 in the next step (vLLM frees window
    // blocks behind the computed tokens, which may not be stored yet when a
    // store could not be allocated). The pending store reading 5 is flushed;
    // block 6, not stored yet, leaves request 1's table.
    s.add_request(RequestId(2), 8, &hashes(4, 2)).unwrap();
    assert_eq!(s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Hit(0));
    let plan = s
        .build_step(&step_of(vec![
            entry(1, 6, 10, &[3, 4], &[7, 8]),
            entry(2, 0, 8, &[9, 10], &[5, 6]),
        ]))
        .unwrap();
    assert_eq!(plan.flush, vec![store]);
    let r1_store = plan
        .stores
        .iter()
        .find(|j| j.req == r1)
        .expect("request 1 stores chunks 1 to 3");
    assert_spans_cover(r1_store);
    assert_eq!(
        r1_store.keys.to_vec(),
        vec![
            key(3, 1, 0),
            key(3, 2, 0),
            key(3, 3, 0),
            key(3, 2, 1),
            key(3, 3, 1)
        ],
        "window chunk 1 lost its block: it is not stored"
    );
    assert_eq!(r1_store.block_ids.to_vec(), ids(&[2, 3, 4, 7, 8]));
    assert_eq!(r1_store.groups[1].first_block_index, 2);
    s.check_invariants().unwrap();
}

#[test]
fn a_block_allocated_to_a_group_left_out_flushes_the_store_still_reading_it() {
    // vLLM's groups that are not prefix-cacheable (a circular buffer, a
    // bounded-replay window) are left out of the scheduler's groups but
    // share the GPU block pool: a finished request's store still reading
    // block 2 must be flushed when vLLM gives block 2 to such a group, or
    // the model overwrites it under the copy.
    for noted in [false, true] {
        let (mut s, _clock) = scheduler(Retention::Dense);
        let plan = prefill(&mut s, 1, 5, &[1, 2, 3, 4], &[5, 6, 7, 8]);
        let store = plan.stores[0].job;
        s.request_finished(RequestId(1), &ids(&[1, 2, 3, 4]), false, 16)
            .unwrap();
        // Block 2 goes to a left-out group (of a new request with nothing
        // to store), told to the scheduler before the step.
        if noted {
            s.note_allocated_elsewhere(&ids(&[0, 2]));
        }
        let plan2 = s
            .build_step(&StepInput {
                finished: vec![RequestId(1)],
                ..StepInput::default()
            })
            .unwrap();
        assert_eq!(plan2.flush.contains(&store), noted, "noted: {noted}");
        s.on_worker_output(&all_done(&plan));
        s.check_invariants().unwrap();
    }
}

#[test]
fn a_finished_request_fences_every_block_of_its_stores() {
    let (mut s, _clock) = scheduler(Retention::Dense);
    let plan = prefill(&mut s, 1, 5, &[1, 2, 3, 4], &[5, 6, 7, 8]);
    let store = plan.stores[0].job;
    assert!(s.fenced_jobs(GpuBlockId(2)).is_empty());
    s.request_finished(RequestId(1), &ids(&[1, 2, 3, 4]), false, 16)
        .unwrap();
    for b in 1..=8 {
        assert_eq!(s.fenced_jobs(GpuBlockId(b)), vec![store], "block {b}");
    }
    s.check_invariants().unwrap();
    // Block 2 goes to another request before the store came back: flushed.
    s.add_request(RequestId(2), 4, &hashes(6, 1)).unwrap();
    s.lookup(RequestId(2), 0).unwrap();
    let plan2 = s
        .build_step(&StepInput {
            finished: vec![RequestId(1)],
            ..step_of(vec![entry(2, 0, 4, &[2], &[9])])
        })
        .unwrap();
    assert!(plan2.flush.contains(&store));
    s.on_worker_output(&all_done(&plan));
    for b in 1..=8 {
        assert!(s.fenced_jobs(GpuBlockId(b)).is_empty(), "block {b}");
    }
    s.check_invariants().unwrap();
}

#[test]
fn calls_that_do_not_match_the_groups_are_refused_and_change_nothing() {
    let (mut s, _clock) = scheduler(Retention::Dense);
    let r = RequestId(1);
    s.add_request(r, 16, &hashes(1, 4)).unwrap();
    s.lookup(r, 0).unwrap();
    assert!(matches!(
        s.on_alloc(r, &ids(&[1, 2, 3, 4]), 0),
        Err(SchedulerError::Groups(_))
    ));
    let b = ids(&[1, 2]);
    let one = [GroupAlloc {
        block_ids: &b,
        cached: &[false, false],
    }];
    assert!(matches!(
        s.on_alloc_groups(r, &one, 0),
        Err(SchedulerError::Groups(_))
    ));
    let short = [
        GroupAlloc {
            block_ids: &b,
            cached: &[false],
        },
        GroupAlloc {
            block_ids: &b,
            cached: &[false, false],
        },
    ];
    assert!(matches!(
        s.on_alloc_groups(r, &short, 0),
        Err(SchedulerError::Groups(_))
    ));
    // New blocks in group 0 and no list for group 1; lists for one request
    // of two.
    let mut no_group_1 = step_of(vec![entry(1, 0, 16, &[1, 2, 3, 4], &[])]);
    no_group_1.group_block_ids[0].clear();
    let mut short = step_of(vec![
        entry(1, 0, 16, &[1, 2, 3, 4], &[5, 6, 7, 8]),
        entry(1, 0, 16, &[], &[]),
    ]);
    short.group_block_ids.pop();
    let before = s.next_job_id();
    for bad in [no_group_1, short] {
        assert!(matches!(s.build_step(&bad), Err(SchedulerError::Groups(_))));
    }
    assert_eq!(s.next_job_id(), before);
    s.check_invariants().unwrap();

    // A single-group scheduler takes no group lists.
    let clock = ManualClock::new();
    let mut single = Scheduler::new(&config(), clock.shared()).unwrap();
    single.add_request(r, 4, &hashes(1, 1)).unwrap();
    assert!(matches!(
        single.build_step(&step_of(vec![entry(1, 0, 4, &[1], &[2])])),
        Err(SchedulerError::Groups(_))
    ));
}

/// One operation of the random backend below.
#[derive(Debug, Clone)]
enum Op {
    /// Admit a request of family `family` (shared prefixes) with a prompt of
    /// `blocks` blocks plus `extra` tokens.
    Admit { family: u8, blocks: u8, extra: u8 },
    /// Run the step: every running request computes up to `tokens` more.
    Step { tokens: u8 },
    /// The worker reports the oldest `n` jobs (as failed with `fail`).
    Report { n: u8, fail: bool },
    /// Running request `pick` (modulo those with no load in flight) is
    /// preempted: its blocks are freed at once, it is listed in the next
    /// step and looked up again in a later one.
    Preempt { pick: u8 },
    /// Time passes beyond the stall timeout and the watchdog scans: every
    /// job in flight is stalled (a stalled load fails its request).
    Stall,
    /// Request `pick` (modulo the running ones) finishes.
    Finish { pick: u8 },
    /// The cache is reset between steps, with no job in flight. Requests may
    /// be running (vLLM refuses that, or preempts them first; an embedder
    /// may not): each re-offers its chunks from the start.
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 1u8..6, 0u8..4).prop_map(|(family, blocks, extra)| Op::Admit {
            family,
            blocks,
            extra
        }),
        4 => (1u8..12).prop_map(|tokens| Op::Step { tokens }),
        4 => (1u8..4, proptest::bool::weighted(0.2)).prop_map(|(n, fail)| Op::Report { n, fail }),
        2 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Preempt { pick }),
        1 => Just(Op::Stall),
        1 => Just(Op::Reset),
    ]
}

/// A request as the random backend runs it.
struct Running {
    id: RequestId,
    tokens: u64,
    computed: u64,
    /// Blocks per group, as the backend holds them (freed window blocks null).
    blocks: [Vec<GpuBlockId>; 2],
    /// Its tables went to the scheduler (its first step).
    sent: bool,
    /// Its first step sends its whole table (`full_table`: resumed after a
    /// preemption, or recomputing after a failed load).
    full: bool,
    /// Its load, until the worker reports it.
    load: Option<JobId>,
}

/// Each group's blocks of store `job` (one block a chunk here) are its
/// request's blocks of the chunks its keys name, in order: key `j` of a
/// group is chunk `c` of the request's prefix (`family`), and block `j` is
/// the request's block `c` in that group, as the worker copies it. Group
/// `g`'s blocks span `factors[g]` of the requests' hashes (its chunk's key
/// is the last of them). `held`: for a Mamba group 1, the request's blocks
/// in it as the backend holds them (a state's store reads the block the
/// backend handed over, which the scheduler's table need not hold: a reset
/// forgets the window blocks behind the store cursor).
fn blocks_in_place(
    s: &Scheduler,
    job: &TransferJob,
    family: u64,
    factors: [u64; 2],
    held: Option<&[GpuBlockId]>,
) -> Result<(), TestCaseError> {
    let (mut at, mut key_at) = (0, 0);
    for (g, span) in job.groups.iter().enumerate() {
        prop_assert_eq!(
            span.num_blocks,
            span.num_keys,
            "{} group {}: one block a chunk",
            job.job,
            g
        );
        let table = match (g, held) {
            (1, Some(held)) => held.to_vec(),
            _ => s.request_group_blocks(job.req, g).unwrap_or_default(),
        };
        let f = factors[g];
        for j in 0..span.num_keys as usize {
            let k = job.keys[key_at + j];
            let c = (0..64).find(|&c| key(family, (c + 1) * f - 1, g as u32) == k);
            prop_assert!(
                c.is_some(),
                "{} group {}: key {:?} is not the request's",
                job.job,
                g,
                k
            );
            let want = table.get(c.unwrap_or(0) as usize).copied();
            prop_assert_eq!(
                Some(job.block_ids[at + j]),
                want,
                "{} group {} key {}",
                job.job,
                g,
                j
            );
        }
        at += span.num_blocks as usize;
        key_at += span.num_keys as usize;
    }
    Ok(())
}

/// Group 1's attention in the random backend: an 8-token sliding window,
/// chunked-local attention over 8-token chunks, or a Mamba state (vLLM's
/// align mode: the state at each block boundary, stored from the backend's
/// hand-offs).
#[derive(Debug, Clone, Copy)]
enum Attention {
    Sliding,
    ChunkedLocal,
    State,
}

/// Group 1 in the random backend: its attention, over blocks of 4 tokens
/// (group 0's) or 8 (vLLM's larger blocks for a group of smaller pages).
#[derive(Debug, Clone, Copy)]
struct Window {
    attention: Attention,
    block_tokens: u64,
}

impl Window {
    fn shape(self) -> GroupShape {
        let t = self.block_tokens;
        match self.attention {
            Attention::Sliding => GroupShape::sliding_window(t, 8).unwrap(),
            Attention::ChunkedLocal => GroupShape::chunked_local(t, 8).unwrap(),
            Attention::State => GroupShape::recurrent_state(t).unwrap(),
        }
    }

    /// Group 1's blocks for `tokens` tokens.
    fn blocks(self, tokens: u64) -> usize {
        tokens.div_ceil(self.block_tokens) as usize
    }

    /// Whether group 1's block `block` is wholly behind what the token at
    /// `end` attends to (vLLM frees it): a sliding window holds the 7
    /// tokens before `end`; chunked-local attention its own 8-token chunk
    /// (vLLM's `get_num_skipped_tokens`); a Mamba state only the block of
    /// the token before `end`.
    fn behind(self, block: usize, end: u64) -> bool {
        let skipped = match self.attention {
            Attention::Sliding => end.saturating_sub(7),
            Attention::ChunkedLocal => end / 8 * 8,
            Attention::State => end.saturating_sub(1),
        };
        (block as u64 + 1) * self.block_tokens <= skipped
    }
}

/// The random backend's GPU blocks: freed ones are handed out again first.
#[derive(Default)]
struct Pool {
    highest: u32,
    free: Vec<GpuBlockId>,
}

impl Pool {
    fn take(&mut self) -> GpuBlockId {
        self.free.pop().unwrap_or_else(|| {
            self.highest += 1;
            GpuBlockId(self.highest)
        })
    }

    /// Frees every held (non-null) block of `blocks`.
    fn release<'a>(&mut self, blocks: impl IntoIterator<Item = &'a GpuBlockId>) {
        self.free.extend(blocks.into_iter().filter(|b| b.0 != 0));
    }

    /// Both groups' blocks for a request of `tokens` whose hit ends at
    /// `hit`: group 1's blocks behind what the hit's end attends to are
    /// null (vLLM allocates them so).
    fn allocate(&mut self, tokens: u64, hit: u64, window: Window) -> [Vec<GpuBlockId>; 2] {
        let n = tokens.div_ceil(4) as usize;
        let b0 = (0..n).map(|_| self.take()).collect();
        let b1 = (0..window.blocks(tokens))
            .map(|i| {
                if window.behind(i, hit) {
                    GpuBlockId(0)
                } else {
                    self.take()
                }
            })
            .collect();
        [b0, b1]
    }
}

/// `on_alloc_groups` with both groups' blocks, none cached.
fn alloc_groups(
    s: &mut Scheduler,
    id: RequestId,
    blocks: &[Vec<GpuBlockId>; 2],
    hit: u64,
) -> Option<JobId> {
    let (fresh0, fresh1) = (vec![false; blocks[0].len()], vec![false; blocks[1].len()]);
    let groups = [
        GroupAlloc {
            block_ids: &blocks[0],
            cached: &fresh0,
        },
        GroupAlloc {
            block_ids: &blocks[1],
            cached: &fresh1,
        },
    ];
    s.on_alloc_groups(id, &groups, hit).unwrap()
}

/// Loads that failed (on a worker, or stalled): the request recomputes
/// from its first token, with blocks for group 1's nulls, and sends its
/// whole table at its first step.
fn fail_loads(running: &mut [Running], failed: &[RequestId], pool: &mut Pool) {
    for r in running.iter_mut().filter(|r| failed.contains(&r.id)) {
        r.load = None;
        r.computed = 0;
        r.full = true;
        for b in r.blocks[1].iter_mut().filter(|b| b.0 == 0) {
            *b = pool.take();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// [`serve`] over every configuration of the random backend.
    #[test]
    fn random_hybrid_serving_keeps_every_invariant(
        ops in proptest::collection::vec(op(), 1..100),
        retention in retention(),
        host_chunks in prop_oneof![Just(3u64), Just(8), Just(64)],
        attention in prop_oneof![
            Just(Attention::Sliding),
            Just(Attention::ChunkedLocal),
            Just(Attention::State),
        ],
        larger_blocks in any::<bool>(),
        eagle in any::<bool>(),
        partial in any::<bool>(),
    ) {
        let serving = Serving { retention, host_chunks, attention, larger_blocks, eagle, partial };
        serve(ops, serving, &mut Reached::default())?;
    }
}

/// With partial tails, a hit of `hit` tokens (over prompt `family`) that
/// ends inside a block ends on a partial tail the host tier holds: the state's key at `hit`,
/// group 0's `margin` tokens past it (beside a draft group: the hash that
/// proves the draft KV there). Counted in `reached`.
fn tail_held(
    s: &Scheduler,
    family: u64,
    hit: u64,
    margin: u64,
    reached: &mut Reached,
) -> Result<(), TestCaseError> {
    if hit.is_multiple_of(4) {
        return Ok(());
    }
    reached.tail_hits += 1;
    let units = units_of(family, (hit + margin) / 2);
    for (group, at) in [(0, hit + margin), (1, hit)] {
        let key = tail_key(&units, at as usize, group);
        prop_assert_eq!(
            s.manager().lookup(key),
            LookupResult::Hit,
            "a hit of {} tokens ends on group {}'s tail at {}, which the host tier lacks",
            hit,
            group,
            at
        );
    }
    Ok(())
}

/// The retentions the random backend runs.
fn retention() -> impl Strategy<Value = Retention> {
    prop_oneof![
        Just(Retention::Dense),
        Just(Retention::BoundariesOnly),
        Just(Retention::Every(8)),
    ]
}

/// The random backend's configuration.
#[derive(Debug, Clone, Copy)]
struct Serving {
    retention: Retention,
    /// The host tier's chunks.
    host_chunks: u64,
    /// Group 1's attention.
    attention: Attention,
    /// Group 1's blocks twice group 0's (not with a Mamba state).
    larger_blocks: bool,
    /// Group 0 holds an EAGLE drafter's layers.
    eagle: bool,
    /// Partial tails (with a Mamba state only).
    partial: bool,
}

/// What a run of [`serve`] reached: draft-group partial tails stored, and
/// lookups whose hit ends on a partial tail.
#[derive(Debug, Default)]
struct Reached {
    draft_tail_stores: u64,
    tail_hits: u64,
}

/// A backend that admits requests of a few shared prefixes (loading what
/// the host tier has, with null window blocks behind the window), runs
/// them, frees each window's blocks as it moves on and hands them to new
/// requests, finishes and preempts requests (looked up again later),
/// reports jobs in order (some as failed: a failed load recomputes) and
/// stalls every job in flight now and then (their late reports come in
/// later): no hook fails, every job's spans cut it exactly, every
/// invariant holds after every operation, a new store reads no block
/// another request holds, and a pending store whose block is handed to
/// a new request is in that step's flush. Group 1's blocks are group
/// 0's or twice as long (groups of different block sizes); group 1 may
/// be a Mamba state, stored from the blocks the backend hands over.
fn serve(ops: Vec<Op>, serving: Serving, reached: &mut Reached) -> Result<(), TestCaseError> {
    let Serving {
        retention,
        host_chunks,
        attention,
        larger_blocks,
        eagle,
        partial,
    } = serving;
    // Group 1's blocks may be twice group 0's (vLLM's larger blocks
    // for a group of smaller pages): its chunk's key is every other hash.
    // (vLLM keeps a Mamba state's block at the hash block's size.)
    let larger_blocks = larger_blocks && !matches!(attention, Attention::State);
    let window = Window {
        attention,
        block_tokens: if larger_blocks { 8 } else { 4 },
    };
    let factors = [1, window.block_tokens / 4];
    // A small host tier refuses stores while others are in flight: their
    // chunks are offered again while the windows move on. Group 0 may
    // hold an EAGLE drafter's layers (its hits need one chunk more).
    let full = GroupShape::full_attention(4).unwrap();
    let groups = KvGroups {
        shapes: vec![
            if eagle { full.eagle_draft() } else { full },
            window.shape(),
        ],
        retention,
    };
    let clock = ManualClock::new();
    let cfg = config_with_chunks(host_chunks);
    let past_the_stall_timeout = std::time::Duration::from_millis(cfg.stall_timeout_ms + 1);
    let mut s = Scheduler::with_groups(&cfg, groups, clock.shared()).unwrap();
    // A Mamba group with hashes every 2 tokens: states inside a block
    // too (vLLM's partial tails), handed over in blocks copied out of
    // the running state (never given back to the pool here).
    // Beside an EAGLE draft group (group 0) too: its tail key is the
    // hash a proof margin (one hash unit) past the boundary.
    let partial = partial && matches!(attention, Attention::State) && !larger_blocks;
    let margin = if eagle { 2 } else { 0 };
    if partial {
        s.enable_partial_tails(2).unwrap();
    }
    let mut pool = Pool::default();
    let mut running: Vec<Running> = Vec::new();
    // Preempted, to be looked up again at a later step.
    let mut waiting: Vec<Running> = Vec::new();
    // Preempted since the last step (the next step lists them).
    let mut preempted: Vec<RequestId> = Vec::new();
    let mut pending: Vec<(JobId, Vec<GpuBlockId>)> = Vec::new();
    // Stalled jobs whose late report has not come in.
    let mut stalled: Vec<JobId> = Vec::new();
    // Jobs a step's flush named: the workers finished them in that step.
    let mut flushed: std::collections::HashSet<JobId> = Default::default();
    let mut next_req = 0u64;
    let mut families: std::collections::HashMap<RequestId, u64> = Default::default();
    // Requests that loaded from the tier (vLLM's `loaded_from_offload`).
    let mut r_loaded: std::collections::HashSet<RequestId> = Default::default();
    let mut mid_step = false;
    for op in ops {
        match op {
            Op::Admit {
                family,
                blocks,
                extra,
            } => {
                next_req += 1;
                let id = RequestId(next_req);
                families.insert(id, u64::from(family));
                let tokens = u64::from(blocks) * 4 + u64::from(extra);
                let h = hashes(u64::from(family), tokens / 4);
                s.add_request(id, tokens, &h).unwrap();
                if partial {
                    s.add_hash_units(id, &units_of(u64::from(family), tokens / 2))
                        .unwrap();
                }
                let hit = match s.lookup(id, 0).unwrap() {
                    LookupOutcome::Hit(n) => n,
                    LookupOutcome::Defer => continue,
                };
                if partial {
                    tail_held(&s, u64::from(family), hit, margin, reached)?;
                }
                let blocks = pool.allocate(tokens, hit, window);
                let load = alloc_groups(&mut s, id, &blocks, hit);
                if load.is_some() {
                    r_loaded.insert(id);
                }
                mid_step = true;
                running.push(Running {
                    id,
                    tokens,
                    computed: hit,
                    blocks,
                    sent: false,
                    full: false,
                    load,
                });
            }
            Op::Step { tokens } => {
                // Requests preempted in earlier steps come back: looked
                // up again and allocated, their whole table sent.
                for mut r in std::mem::take(&mut waiting) {
                    match s.lookup(r.id, 0).unwrap() {
                        LookupOutcome::Defer => waiting.push(r),
                        LookupOutcome::Hit(hit) => {
                            if partial {
                                tail_held(&s, families[&r.id], hit, margin, reached)?;
                            }
                            r.blocks = pool.allocate(r.tokens, hit, window);
                            r.load = alloc_groups(&mut s, r.id, &r.blocks, hit);
                            if r.load.is_some() {
                                r_loaded.insert(r.id);
                            }
                            r.computed = hit;
                            (r.sent, r.full) = (false, true);
                            running.push(r);
                        }
                    }
                }
                let mut input = StepInput {
                    preempted: std::mem::take(&mut preempted),
                    ..StepInput::default()
                };
                let mut handed: Vec<GpuBlockId> = Vec::new();
                // Partial tails handed over: (request, boundary, block).
                let mut tails: Vec<(RequestId, u64, GpuBlockId)> = Vec::new();
                for r in running.iter_mut().filter(|r| r.load.is_none()) {
                    let n = u64::from(tokens).min(r.tokens.saturating_sub(r.computed));
                    let mut e = ScheduledRequest {
                        req: r.id,
                        new_block_ids: Vec::new(),
                        computed_tokens: r.computed,
                        scheduled_tokens: n,
                        full_table: false,
                    };
                    let mut others = Vec::new();
                    if !r.sent {
                        // Its first step hands it its blocks.
                        r.sent = true;
                        e.new_block_ids = r.blocks[0].clone();
                        e.full_table = std::mem::take(&mut r.full);
                        others = vec![r.blocks[1].clone()];
                        handed.extend(r.blocks.iter().flatten().filter(|b| b.0 != 0));
                    }
                    input.scheduled.push(e);
                    input.group_block_ids.push(others);
                    let before = r.computed;
                    r.computed += n;
                    // A Mamba group: the backend hands over the block
                    // holding the state at the last boundary this step
                    // reached (vLLM's align mode caches it).
                    let bt = window.block_tokens;
                    let boundary = r.computed / bt * bt;
                    if let (Attention::State, true) = (window.attention, boundary > before) {
                        let block = r.blocks[1][(boundary / bt - 1) as usize];
                        input.boundary_states.push(BoundaryState {
                            req: r.id,
                            group: 1,
                            block,
                            boundary,
                        });
                    }
                    // A prompt's step ending on a hash inside a block:
                    // vLLM copies the state there into a new block.
                    // With a draft group, a state the step passes,
                    // handed over as the step computes a hash unit
                    // past it (its draft KV then proven by the tokens
                    // after).
                    let handed_at = match (eagle, r.computed.checked_sub(2)) {
                        (false, _) => r.computed,
                        (true, Some(hi)) if hi >= 2 => hi - (hi + 2) % 4,
                        (true, _) => 1,
                    };
                    if partial
                        && r.computed > before
                        && handed_at >= before
                        && handed_at % 4 == 2
                        && handed_at <= r.tokens
                    {
                        let block = pool.take();
                        let boundary = handed_at;
                        input.boundary_states.push(BoundaryState {
                            req: r.id,
                            group: 1,
                            block,
                            boundary,
                        });
                        tails.push((r.id, boundary, block));
                    }
                }
                let plan = s.build_step(&input).unwrap();
                for job in plan.loads.iter().chain(&plan.stores) {
                    assert_spans_cover(job);
                }
                for job in &plan.stores {
                    let theirs = running
                        .iter()
                        .filter(|r| r.id != job.req && r.sent)
                        .flat_map(|r| r.blocks.iter().flatten())
                        .filter(|b| b.0 != 0)
                        .find(|b| job.block_ids.contains(b));
                    prop_assert!(
                        theirs.is_none(),
                        "{} reads {theirs:?}, another request's",
                        job.job
                    );
                    // A draft group's tail keyed on a block boundary
                    // (boundary + margin) is its complete chunk there,
                    // the same key and block (as in vLLM): told apart
                    // by the state's key only.
                    let tail_keys = |boundary: u64| {
                        let units = units_of(families[&job.req], (boundary + margin) / 2);
                        let mut keys = vec![tail_key(&units, boundary as usize, 1)];
                        if !(boundary + margin).is_multiple_of(4) {
                            keys.push(tail_key(&units, (boundary + margin) as usize, 0));
                        }
                        keys
                    };
                    if let Some(&(_, boundary, cow)) = tails.iter().find(|t| t.0 == job.req)
                        && tail_keys(boundary).iter().any(|k| job.keys.contains(k))
                    {
                        reached.draft_tail_stores += u64::from(margin != 0);
                        prop_assert!(
                            margin == 0 || r_loaded.contains(&job.req),
                            "{} stores a draft group's tail of a request that never loaded",
                            job.job
                        );
                        // A partial tail: group 0's block holding its
                        // last token, group 1's the handed block; only
                        // the groups whose keys the host tier lacks (as
                        // vLLM stores `keys_to_store`: another request
                        // of the family may have stored the state).
                        let idx = (boundary / 4) as usize;
                        let table = s.request_group_blocks(job.req, 0).unwrap_or_default();
                        let mut want = Vec::new();
                        if job.groups[0].num_keys == 1 {
                            want.push(table[idx]);
                        }
                        if job.groups[1].num_keys == 1 {
                            want.push(cow);
                        }
                        prop_assert_eq!(
                            job.block_ids.to_vec(),
                            want,
                            "{} partial tail at {}",
                            job.job,
                            boundary
                        );
                        continue;
                    }
                    let held = running
                        .iter()
                        .find(|r| r.id == job.req && matches!(window.attention, Attention::State))
                        .map(|r| r.blocks[1].as_slice());
                    blocks_in_place(&s, job, families[&job.req], factors, held)?;
                }
                // A preempted request's stores are flushed in the step
                // that lists it (its blocks may go to others from then on).
                flushed.extend(plan.flush.iter().copied());
                for (job, blocks) in &pending {
                    if s.is_job_live(*job) && blocks.iter().any(|b| handed.contains(b)) {
                        prop_assert!(flushed.contains(job), "{job} reads a block handed on");
                    }
                }
                pending.retain(|(j, _)| s.is_job_live(*j));
                pending.extend(plan.stores.iter().map(|j| (j.job, j.block_ids.to_vec())));
                fail_loads(&mut running, &plan.failed_loads, &mut pool);
                mid_step = false;
                // Each window moves on: its blocks wholly behind it are
                // freed (the scheduler is not told) and may go to a new
                // request.
                for r in running.iter_mut().filter(|r| r.sent) {
                    for (i, b) in r.blocks[1].iter_mut().enumerate() {
                        if b.0 != 0 && window.behind(i, r.computed) {
                            pool.free.push(*b);
                            *b = GpuBlockId(0);
                        }
                    }
                }
            }
            Op::Report { n, fail } => {
                let loads: Vec<JobId> = running.iter().filter_map(|r| r.load).collect();
                let jobs: Vec<JobId> = pending
                    .iter()
                    .map(|(j, _)| *j)
                    .chain(loads)
                    .chain(stalled.iter().copied())
                    .take(usize::from(n))
                    .collect();
                stalled.retain(|j| !jobs.contains(j));
                let report = if fail {
                    CompletionReport {
                        completed: vec![],
                        failed: jobs,
                    }
                } else {
                    CompletionReport {
                        completed: jobs.iter().map(|&j| (j, 1)).collect(),
                        failed: vec![],
                    }
                };
                let out = s.on_worker_output(&report);
                prop_assert!(out.rejected.is_empty(), "{:?}", out.rejected);
                fail_loads(&mut running, &out.failed_loads, &mut pool);
                for r in &mut running {
                    if r.load.is_some_and(|j| !s.is_job_live(j)) {
                        r.load = None;
                    }
                }
                pending.retain(|(j, _)| s.is_job_live(*j));
            }
            Op::Finish { pick } => {
                if running.is_empty() {
                    continue;
                }
                let r = running.remove(usize::from(pick) % running.len());
                s.request_finished(r.id, &r.blocks[0], false, r.computed)
                    .unwrap();
                let plan = s
                    .build_step(&StepInput {
                        finished: vec![r.id],
                        preempted: std::mem::take(&mut preempted),
                        ..StepInput::default()
                    })
                    .unwrap();
                for job in plan.loads.iter().chain(&plan.stores) {
                    assert_spans_cover(job);
                }
                for job in &plan.stores {
                    blocks_in_place(&s, job, families[&job.req], factors, None)?;
                }
                flushed.extend(plan.flush.iter().copied());
                pending.extend(plan.stores.iter().map(|j| (j.job, j.block_ids.to_vec())));
                mid_step = false;
                pool.release(r.blocks.iter().flatten());
            }
            Op::Preempt { pick } => {
                // vLLM preempts running requests (none waiting for its
                // load), freeing their blocks at once.
                let candidates: Vec<usize> = (0..running.len())
                    .filter(|&i| running[i].sent && running[i].load.is_none())
                    .collect();
                if mid_step || candidates.is_empty() {
                    continue;
                }
                let mut r = running.remove(candidates[usize::from(pick) % candidates.len()]);
                pool.release(r.blocks.iter().flatten());
                r.blocks = [Vec::new(), Vec::new()];
                r.computed = 0;
                preempted.push(r.id);
                waiting.push(r);
            }
            Op::Stall => {
                clock.advance(past_the_stall_timeout);
                let out = s.scan_now();
                stalled.extend(out.stalled.iter().copied());
                fail_loads(&mut running, &out.failed_loads, &mut pool);
                pending.retain(|(j, _)| s.is_job_live(*j));
            }
            Op::Reset => {
                if mid_step || !pending.is_empty() || running.iter().any(|r| r.load.is_some()) {
                    continue;
                }
                s.reset().unwrap();
            }
        }
        // The invariants hold between steps (not between an admission's
        // allocation and its step).
        if !mid_step {
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
    Ok(())
}

#[test]
fn a_reset_forgets_the_window_blocks_behind_each_store_cursor() {
    let (mut s, _clock) = scheduler(Retention::Dense);
    let r1 = RequestId(1);
    let plan = prefill(&mut s, 1, 3, &[1, 2, 3, 4], &[5, 6, 7, 8]);
    s.on_worker_output(&all_done(&plan));
    // The window freed block 6 and it went to request 2 while it sat behind
    // request 1's store cursor (its chunk offered already): the scheduler is
    // not told, and request 1's table keeps it.
    s.add_request(RequestId(2), 8, &hashes(4, 2)).unwrap();
    assert_eq!(s.lookup(RequestId(2), 0).unwrap(), LookupOutcome::Hit(0));
    let plan = s
        .build_step(&step_of(vec![entry(2, 0, 8, &[9, 10], &[6, 11])]))
        .unwrap();
    s.on_worker_output(&all_done(&plan));
    assert_eq!(s.request_group_blocks(r1, 1).unwrap(), ids(&[5, 6, 7, 8]));
    // A reset moves every store cursor back to the start: the window blocks
    // behind the cursors are forgotten, so that re-offering the chunks never
    // reads block 6 (request 2's now) as request 1's. Full attention keeps
    // its blocks.
    s.reset().unwrap();
    assert_eq!(s.request_group_blocks(r1, 1).unwrap(), ids(&[0, 0, 0, 0]));
    assert_eq!(s.request_group_blocks(r1, 0).unwrap(), ids(&[1, 2, 3, 4]));
    assert_eq!(
        s.request_group_blocks(RequestId(2), 1).unwrap(),
        ids(&[0, 0])
    );
    // Block 6 allocated again finds no place to empty.
    s.add_request(RequestId(3), 8, &hashes(5, 2)).unwrap();
    assert_eq!(s.lookup(RequestId(3), 0).unwrap(), LookupOutcome::Hit(0));
    s.build_step(&step_of(vec![entry(3, 0, 8, &[12, 13], &[6, 14])]))
        .unwrap();
    assert_eq!(s.request_group_blocks(r1, 1).unwrap(), ids(&[0, 0, 0, 0]));
    s.check_invariants().unwrap();
}

/// The operations of a backend whose requests share two prompts' prefixes
/// more often than [`op`]'s (so later requests find what earlier ones stored).
fn shared_prefix_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..2, 1u8..6, 0u8..4).prop_map(|(family, blocks, extra)| Op::Admit {
            family,
            blocks,
            extra
        }),
        5 => (1u8..12).prop_map(|tokens| Op::Step { tokens }),
        4 => (1u8..4, proptest::bool::weighted(0.1)).prop_map(|(n, fail)| Op::Report { n, fail }),
        3 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Preempt { pick }),
        1 => Just(Op::Stall),
    ]
}

/// Beside an EAGLE/MTP draft group, with Mamba states inside a block
/// (partial tails keyed a proof margin past their boundary): [`serve`]
/// keeps every invariant, and over a fixed set of random runs it stores
/// draft tails and later lookups hit them (the proptest over every
/// configuration seldom reaches them).
#[test]
fn beside_a_draft_group_random_serving_stores_and_hits_partial_tails() {
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let reached = std::cell::RefCell::new(Reached::default());
    let config = Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = (
        proptest::collection::vec(shared_prefix_op(), 1..150),
        retention(),
        prop_oneof![Just(8u64), Just(64)],
    );
    let result = runner.run(&strategy, |(ops, retention, host_chunks)| {
        let serving = Serving {
            retention,
            host_chunks,
            attention: Attention::State,
            larger_blocks: false,
            eagle: true,
            partial: true,
        };
        serve(ops, serving, &mut reached.borrow_mut())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let reached = reached.into_inner();
    eprintln!("{reached:?}");
    // The seeds are fixed: 451 stores and 223 hits when written; the bound
    // leaves room for a change in how the operations play out.
    assert!(
        reached.draft_tail_stores >= 100 && reached.tail_hits >= 50,
        "{reached:?}"
    );
}
