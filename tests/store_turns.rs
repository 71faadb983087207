//! Replicated KV written once, by turns (`docs/dataplane.md`, "Replicated KV
//! by turns"): two workers over one host pool, each copying the chunks of
//! its turn, putting them to a remote tier and fetching them back; together
//! they write every chunk once.

use std::sync::Arc;
use std::time::Duration;

use kvoffload::remote::{
    MemoryConnector, MemoryState, Namespace, RemoteTier, RemoteTierConfig, WritePolicy,
};
use kvoffload::worker::{
    FaultInjector, FetchJob, GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout,
    OffloadWorker, StoreJob, StoreWriters, TransferBackend, TransferSpec, WorkerLayout, WorkerPlan,
    WorkerReport,
};
use kvoffload::{ChunkId, ChunkKey, JobId, ManualClock};

const PAGE: u64 = 1024;
const BLOCKS: u32 = 32;
const CHUNKS: u32 = 16;
/// Two GPU blocks a chunk: a row of 2 KiB, padded to a 4 KiB host page.
const BPC: u32 = 2;
const ROW: usize = 4096;

type Worker = OffloadWorker<FaultInjector<HostBackend>>;

/// Two workers (turns 0 and 1 of 2) whose GPUs hold the same KV (block `b`
/// filled with byte `b`) over one host pool, filled with 0xEE.
struct Pair {
    pool: Arc<HostBuffer>,
    workers: [Worker; 2],
}

fn pair(remote: Option<(&Arc<MemoryState>, WritePolicy)>) -> Pair {
    let pool = Arc::new(HostBuffer::new(ROW * CHUNKS as usize).unwrap());
    // SAFETY: no job in flight.
    unsafe { pool.fill(0xEE) };
    let make = |index: u32| {
        let gpu = Arc::new(HostBuffer::new((PAGE * u64::from(BLOCKS)) as usize).unwrap());
        // SAFETY: no job in flight.
        unsafe {
            for b in 0..BLOCKS {
                gpu.write(
                    (u64::from(b) * PAGE) as usize,
                    &vec![b as u8; PAGE as usize],
                );
            }
        }
        let layout = WorkerLayout::new(
            GpuLayout::cross_layer(gpu.addr(), BLOCKS, PAGE, PAGE).unwrap(),
            HostRowLayout::uniform(BPC, 1, &[PAGE]).unwrap(),
            0,
            pool.addr(),
            CHUNKS,
        )
        .unwrap();
        let backend = HostBackend::new(
            layout,
            vec![gpu, pool.clone()],
            HostBackendOptions::default(),
        )
        .unwrap();
        let mut w = OffloadWorker::new(FaultInjector::new(backend), true)
            .with_store_writers(StoreWriters::turn(index, 2).unwrap())
            .with_wait_timeout(Some(Duration::from_secs(30)));
        if let Some((state, write)) = remote {
            let cfg = RemoteTierConfig {
                write,
                ..RemoteTierConfig::default()
            };
            let tier = RemoteTier::start(
                Box::new(MemoryConnector::new(state.clone())),
                &cfg,
                Namespace::from_fingerprint(0x77),
                1,
                ManualClock::new().shared(),
            )
            .unwrap();
            // One share a chunk, whichever worker wrote it.
            w.set_remote_tier(tier, 0);
        }
        w
    };
    Pair {
        workers: [make(0), make(1)],
        pool,
    }
}

/// A store of `blocks` from logical index `first` into `chunks` (keys 1000 + chunk).
fn store(job: u64, blocks: &[u32], first: u32, chunks: &[u32]) -> StoreJob {
    StoreJob {
        job: JobId(job),
        spec: TransferSpec::new(blocks, first, chunks),
        keys: chunks
            .iter()
            .map(|&c| ChunkKey(1000 + u64::from(c)))
            .collect(),
    }
}

/// Runs one plan's four hooks on `w`.
fn step(w: &mut Worker, mut plan: WorkerPlan) -> WorkerReport {
    w.handle_preemptions(&mut plan).unwrap();
    w.start_transfers(&plan).unwrap();
    w.queue_stores(&mut plan);
    w.get_finished()
}

/// Gathers `w`'s reports until each of `jobs` is reported (waiting on the backend).
fn drain(w: &mut Worker, mut got: WorkerReport, jobs: &[JobId]) -> WorkerReport {
    w.backend_mut()
        .wait(jobs, Some(Duration::from_secs(30)))
        .unwrap();
    for _ in 0..1000 {
        if jobs.iter().all(|j| got.completed.contains_key(j)) {
            break;
        }
        let r = w.get_finished();
        for (k, v) in r.completed {
            *got.completed.entry(k).or_insert(0) += v;
        }
        got.failed.extend(r.failed);
        got.stats.store.bytes += r.stats.store.bytes;
        got.stats.store.jobs += r.stats.store.jobs;
    }
    got
}

/// Both workers run `stores` (queued in one step, submitted in the next) to their reports.
fn run_stores(p: &mut Pair, stores: &[StoreJob]) -> [WorkerReport; 2] {
    let jobs: Vec<JobId> = stores.iter().map(|s| s.job).collect();
    p.workers.each_mut().map(|w| {
        let mut got = step(
            w,
            WorkerPlan {
                stores: stores.to_vec(),
                ..Default::default()
            },
        );
        let next = step(w, WorkerPlan::default());
        for (k, v) in next.completed {
            *got.completed.entry(k).or_insert(0) += v;
        }
        got.stats.store.bytes += next.stats.store.bytes;
        got.stats.store.jobs += next.stats.store.jobs;
        got.failed.extend(next.failed);
        drain(w, got, &jobs)
    })
}

/// Byte `at` of chunk row `chunk`'s sub-block `sub`.
fn pool_byte(p: &Pair, chunk: u32, sub: u32) -> u8 {
    // SAFETY: read after every job touching the pool was reported.
    unsafe {
        p.pool
            .read(ROW * chunk as usize + (PAGE * u64::from(sub)) as usize, 1)[0]
    }
}

fn flush_puts(w: &Worker, puts: u64) {
    let t = w.remote_tier().expect("a tier");
    let t0 = std::time::Instant::now();
    while t.stats().puts_written + t.stats().puts_failed < puts {
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn the_turns_together_write_every_block_of_a_store_once() {
    let mut p = pair(None);
    // Blocks 3..=9 from logical index 1: chunk 4 holds index 1 alone,
    // chunks 5, 6 and 7 two blocks each.
    let job = store(1, &[3, 4, 5, 6, 7, 8, 9], 1, &[4, 5, 6, 7]);
    // A store of one chunk of turn 1's: turn 0 acknowledges it at once.
    let other = store(2, &[10, 11], 0, &[9]);
    let reports = run_stores(&mut p, &[job, other]);
    for (w, r) in reports.iter().enumerate() {
        assert!(r.failed.is_empty(), "worker {w}: {r:?}");
        assert_eq!(r.completed.get(&JobId(1)), Some(&1), "worker {w}");
        assert_eq!(r.completed.get(&JobId(2)), Some(&1), "worker {w}");
    }
    // Turn 0 copied chunks 4 and 6 (blocks 3, 6, 7), turn 1 chunks 5, 7
    // and 9 (blocks 4, 5, 8, 9, 10, 11).
    assert_eq!(reports[0].stats.store.bytes, 3 * PAGE);
    assert_eq!(reports[0].stats.store.jobs, 1);
    assert_eq!(reports[1].stats.store.bytes, (4 + 2) * PAGE);
    assert_eq!(reports[1].stats.store.jobs, 2);
    // Every block once, where the store puts it.
    let expect = [
        (4, 0, 0xEE), // index 0: before the store
        (4, 1, 3),
        (5, 0, 4),
        (5, 1, 5),
        (6, 0, 6),
        (6, 1, 7),
        (7, 0, 8),
        (7, 1, 9),
        (9, 0, 10),
        (9, 1, 11),
    ];
    for (chunk, sub, byte) in expect {
        assert_eq!(pool_byte(&p, chunk, sub), byte, "chunk {chunk} sub {sub}");
    }
    assert_eq!(pool_byte(&p, 8, 0), 0xEE, "no store touched chunk 8");
    for w in &p.workers {
        assert_eq!(w.backend().in_flight(), 0);
    }
}

#[test]
fn each_chunk_is_put_by_its_writer_and_fetched_back_by_it() {
    let state = MemoryState::new();
    let mut p = pair(Some((&state, WritePolicy::Through)));
    let reports = run_stores(&mut p, &[store(1, &[3, 4, 5, 6], 0, &[2, 3])]);
    assert!(reports.iter().all(|r| r.failed.is_empty()));
    flush_puts(&p.workers[0], 1);
    flush_puts(&p.workers[1], 1);
    for w in &p.workers {
        let s = w.remote_tier().unwrap().stats();
        assert_eq!(s.puts_written, 1, "one chunk each: {s:?}");
    }
    assert_eq!(state.len(), 2, "each chunk once");
    // Both chunks fetched into slots 10 and 11: turn 0 fetches slot 10's,
    // turn 1 slot 11's; the pool then holds both.
    let fetch = FetchJob {
        job: JobId(5),
        keys: vec![ChunkKey(1002), ChunkKey(1003)],
        chunks: vec![ChunkId(10), ChunkId(11)],
    };
    for w in &mut p.workers {
        let plan = WorkerPlan {
            fetches: vec![fetch.clone()],
            ..Default::default()
        };
        w.start_transfers(&plan).unwrap();
        assert_eq!(w.pending_fetches(), 1);
        w.wait_fetches(Duration::from_secs(30));
        let r = w.get_finished();
        assert_eq!(r.completed.get(&JobId(5)), Some(&1), "{r:?}");
        assert!(r.failed.is_empty(), "{r:?}");
        assert_eq!(w.remote_tier().unwrap().stats().hits, 1);
    }
    for (chunk, blocks) in [(10, [3, 4]), (11, [5, 6])] {
        for (sub, b) in blocks.into_iter().enumerate() {
            assert_eq!(pool_byte(&p, chunk, sub as u32), b, "chunk {chunk}");
        }
    }
    // A fetch of turn 1's chunk alone: turn 0 only counts it.
    let plan = WorkerPlan {
        fetches: vec![FetchJob {
            job: JobId(6),
            keys: vec![ChunkKey(1002)],
            chunks: vec![ChunkId(13)],
        }],
        ..Default::default()
    };
    p.workers[0].start_transfers(&plan).unwrap();
    assert_eq!(p.workers[0].pending_fetches(), 0);
    let r = p.workers[0].get_finished();
    assert_eq!(r.completed.get(&JobId(6)), Some(&1));
    assert!(r.failed.is_empty());
}

#[test]
fn an_evicted_chunk_is_put_by_its_writer_alone() {
    let state = MemoryState::new();
    let mut p = pair(Some((&state, WritePolicy::OnEviction)));
    run_stores(&mut p, &[store(1, &[3, 4, 5, 6], 0, &[2, 3])]);
    assert!(
        state.is_empty(),
        "stores are not written on eviction's policy"
    );
    let plan = WorkerPlan {
        evictions: vec![(ChunkKey(1002), ChunkId(2)), (ChunkKey(1003), ChunkId(3))],
        ..Default::default()
    };
    for w in &mut p.workers {
        step(w, plan.clone());
    }
    flush_puts(&p.workers[0], 1);
    flush_puts(&p.workers[1], 1);
    for w in &p.workers {
        assert_eq!(w.remote_tier().unwrap().stats().puts_written, 1);
    }
    assert_eq!(state.len(), 2);
}
