//! KV heads as remote shares (`docs/remote-tier.md`, "Keys and values": shares): workers of
//! different tensor-parallel sizes (and page orders) write and read each
//! other's chunks through one store, every byte where it belongs.

use std::sync::Arc;
use std::time::Duration;

use kvoffload::remote::{
    Answer, MemoryConnector, MemoryState, Namespace, RemoteTier, RemoteTierConfig,
};
use kvoffload::worker::{
    FetchJob, GpuLayout, HeadOrder, HeadPage, HeadPlacement, HostBackend, HostBackendOptions,
    HostBuffer, HostRowLayout, LoadJob, OffloadWorker, RemoteShares, StoreJob, TransferBackend,
    TransferSpec, WorkerLayout, WorkerPlan,
};
use kvoffload::{ChunkId, ChunkKey, JobId, ManualClock};

/// KV heads of the model.
const HEADS: u32 = 4;
/// Tokens a block.
const TOKENS: u64 = 4;
/// Bytes of one head of one token in one half (K or V).
const HEAD_BYTES: u64 = 8;
const LAYERS: usize = 2;
const BLOCKS: u32 = 8;
const CHUNKS: u32 = 4;
/// Blocks a chunk.
const BPC: u32 = 2;

/// One worker of a tensor-parallel group: its per-layer GPU pages (host
/// memory here), its host pool, and the worker writing through to `store`.
struct Rank {
    gpu: Vec<Arc<HostBuffer>>,
    order: HeadOrder,
    placement: HeadPlacement,
    worker: OffloadWorker<HostBackend>,
}

fn local_heads(p: HeadPlacement) -> u32 {
    (p.total_heads / p.tp_size).max(1)
}

fn first_head(p: HeadPlacement) -> u32 {
    if p.total_heads >= p.tp_size {
        p.tp_rank * local_heads(p)
    } else {
        p.tp_rank / (p.tp_size / p.total_heads)
    }
}

fn page_bytes(p: HeadPlacement) -> u64 {
    2 * TOKENS * u64::from(local_heads(p)) * HEAD_BYTES
}

/// The byte the model writes at (layer, block's tokens, K/V, token, global head, i).
fn model_byte(layer: usize, first_token: u64, half: u64, token: u64, head: u32, i: u64) -> u8 {
    (layer as u64 * 101 + (first_token + token) * 13 + half * 57 + u64::from(head) * 29 + i * 3)
        as u8
}

/// Where (half, token, local head j, byte i) lies in a page of `order`.
fn offset(order: HeadOrder, heads: u64, half: u64, token: u64, j: u64, i: u64) -> u64 {
    match order {
        HeadOrder::TokenMajor => ((half * TOKENS + token) * heads + j) * HEAD_BYTES + i,
        HeadOrder::HeadMajor => ((half * heads + j) * TOKENS + token) * HEAD_BYTES + i,
    }
}

/// A page as rank `p` holds block `first_token / TOKENS` of `layer`.
fn page(order: HeadOrder, p: HeadPlacement, layer: usize, first_token: u64) -> Vec<u8> {
    let heads = u64::from(local_heads(p));
    let mut out = vec![0u8; page_bytes(p) as usize];
    for half in 0..2 {
        for token in 0..TOKENS {
            for j in 0..heads {
                for i in 0..HEAD_BYTES {
                    let at = offset(order, heads, half, token, j, i) as usize;
                    out[at] =
                        model_byte(layer, first_token, half, token, first_head(p) + j as u32, i);
                }
            }
        }
    }
    out
}

fn rank(state: &Arc<MemoryState>, order: HeadOrder, placement: HeadPlacement) -> Rank {
    let page = page_bytes(placement);
    let gpu: Vec<Arc<HostBuffer>> = (0..LAYERS)
        .map(|_| Arc::new(HostBuffer::new((page * u64::from(BLOCKS)) as usize).unwrap()))
        .collect();
    let bases: Vec<u64> = gpu.iter().map(|b| b.addr()).collect();
    let row = HostRowLayout::uniform(BPC, 1, &[page; LAYERS]).unwrap();
    let slot = row.slot(0).unwrap().clone();
    let pool = Arc::new(HostBuffer::new((row.row_bytes() * u64::from(CHUNKS)) as usize).unwrap());
    let layout = WorkerLayout::new(
        GpuLayout::per_layer(&bases, BLOCKS, page, page).unwrap(),
        row,
        0,
        pool.addr(),
        CHUNKS,
    )
    .unwrap();
    let mut buffers = gpu.clone();
    buffers.push(pool);
    let backend = HostBackend::new(layout, buffers, HostBackendOptions::default()).unwrap();
    let head_page = HeadPage {
        order,
        halves: 2,
        block_tokens: TOKENS,
        heads: local_heads(placement),
        head_bytes: HEAD_BYTES,
    };
    let shares = RemoteShares::kv_heads(&[head_page; LAYERS], &slot, BPC, placement).unwrap();
    let tier = tier(state, shares.total());
    let mut worker =
        OffloadWorker::new(backend, true).with_wait_timeout(Some(Duration::from_secs(30)));
    worker.set_remote_tier_shares(tier, shares);
    Rank {
        gpu,
        order,
        placement,
        worker,
    }
}

fn tier(state: &Arc<MemoryState>, shares: u32) -> RemoteTier {
    RemoteTier::start(
        Box::new(MemoryConnector::new(state.clone())),
        &RemoteTierConfig::default(),
        Namespace::from_fingerprint(0x4ead),
        shares,
        ManualClock::new().shared(),
    )
    .unwrap()
}

/// A group of `tp` ranks over `state`, every page in `order`.
fn group(state: &Arc<MemoryState>, tp: u32, order: HeadOrder) -> Vec<Rank> {
    (0..tp)
        .map(|r| {
            rank(
                state,
                order,
                HeadPlacement {
                    total_heads: HEADS,
                    tp_size: tp,
                    tp_rank: r,
                },
            )
        })
        .collect()
}

/// Writes the model's KV of blocks 1 and 2 (tokens 0..8), stores them into
/// chunk 1 under key 77 and waits until the tier has written the shares.
fn compute_and_store(r: &mut Rank, puts: u64) {
    for (layer, buf) in r.gpu.iter().enumerate() {
        for block in 1..=2u64 {
            let bytes = page(r.order, r.placement, layer, (block - 1) * TOKENS);
            // SAFETY: no job in flight touches this worker's GPU pages.
            unsafe { buf.write((block * page_bytes(r.placement)) as usize, &bytes) };
        }
    }
    let store = StoreJob {
        job: JobId(1),
        spec: TransferSpec::new(&[1, 2], 0, &[1]),
        keys: vec![ChunkKey(77)],
    };
    let w = &mut r.worker;
    let mut plan = WorkerPlan {
        stores: vec![store],
        ..Default::default()
    };
    w.handle_preemptions(&mut plan).unwrap();
    w.start_transfers(&plan).unwrap();
    w.queue_stores(&mut plan);
    w.get_finished();
    let mut next = WorkerPlan::default();
    w.start_transfers(&next).unwrap();
    w.queue_stores(&mut next);
    w.backend_mut()
        .wait(&[JobId(1)], Some(Duration::from_secs(30)))
        .unwrap();
    let report = w.get_finished();
    assert!(report.failed.is_empty(), "{report:?}");
    let t = w.remote_tier().unwrap();
    let t0 = std::time::Instant::now();
    while t.stats().puts_written < puts {
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Fetches key 77 into chunk 2, loads it into blocks 5 and 6 and checks
/// every byte of both blocks against the model's, as this rank holds them.
fn fetch_load_and_check(r: &mut Rank) {
    let w = &mut r.worker;
    let fetch = WorkerPlan {
        fetches: vec![FetchJob {
            job: JobId(10),
            keys: vec![ChunkKey(77)],
            chunks: vec![ChunkId(2)],
        }],
        ..Default::default()
    };
    w.start_transfers(&fetch).unwrap();
    w.wait_fetches(Duration::from_secs(30));
    let report = w.get_finished();
    assert!(
        report.failed.is_empty() && report.completed.len() == 1,
        "{report:?}"
    );
    let load = WorkerPlan {
        loads: vec![LoadJob {
            job: JobId(11),
            request: None,
            spec: TransferSpec::new(&[5, 6], 0, &[2]),
        }],
        ..Default::default()
    };
    w.start_transfers(&load).unwrap();
    w.backend_mut()
        .wait(&[JobId(11)], Some(Duration::from_secs(30)))
        .unwrap();
    assert!(w.get_finished().failed.is_empty());
    for (layer, buf) in r.gpu.iter().enumerate() {
        for (k, block) in [5u64, 6].into_iter().enumerate() {
            // SAFETY: the load is reported; nothing else touches these pages.
            let got = unsafe {
                buf.read(
                    (block * page_bytes(r.placement)) as usize,
                    page_bytes(r.placement) as usize,
                )
            };
            let want = page(r.order, r.placement, layer, k as u64 * TOKENS);
            assert_eq!(got, want, "layer {layer}, block {block}, {:?}", r.placement);
        }
    }
}

/// Whether every share of key 77 is in the store, as a lookup sees it.
fn found(state: &Arc<MemoryState>) -> bool {
    let mut t = tier(state, HEADS);
    let ticket = t.lookup(&[ChunkKey(77)]);
    match t.wait(ticket, Duration::from_secs(30), &mut Vec::new()) {
        Some(Answer::Present(p)) => p == [true],
        other => panic!("lookup answered {other:?}"),
    }
}

#[test]
fn two_ranks_write_a_chunk_that_one_rank_of_another_page_order_reads() {
    let state = MemoryState::new();
    let mut writers = group(&state, 2, HeadOrder::TokenMajor);
    // One rank's heads are half the chunk: a lookup does not find it yet.
    compute_and_store(&mut writers[0], 2);
    assert!(!found(&state));
    compute_and_store(&mut writers[1], 2);
    assert!(found(&state));
    let mut reader = group(&state, 1, HeadOrder::HeadMajor).remove(0);
    fetch_load_and_check(&mut reader);
}

#[test]
fn one_rank_writes_a_chunk_that_every_wider_group_reads() {
    let state = MemoryState::new();
    let mut writer = group(&state, 1, HeadOrder::TokenMajor).remove(0);
    compute_and_store(&mut writer, u64::from(HEADS));
    assert!(found(&state));
    // Four ranks of one head each, and eight: two ranks a head (the first
    // of them writes it; both read it).
    for tp in [2, 4, 8] {
        for mut r in group(&state, tp, HeadOrder::HeadMajor) {
            fetch_load_and_check(&mut r);
        }
    }
}

#[test]
fn with_more_ranks_than_heads_one_rank_of_each_head_writes_it() {
    let state = MemoryState::new();
    let mut ranks = group(&state, 8, HeadOrder::TokenMajor);
    for (i, r) in ranks.iter_mut().enumerate() {
        let puts = if i % 2 == 0 { 1 } else { 0 };
        compute_and_store(r, puts);
        let s = r.worker.remote_tier().unwrap().stats();
        assert_eq!(s.puts_written, puts, "rank {i}");
    }
    assert!(found(&state));
    let mut reader = group(&state, 1, HeadOrder::TokenMajor).remove(0);
    fetch_load_and_check(&mut reader);
}
