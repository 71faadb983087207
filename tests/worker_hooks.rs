//! Worker step hooks over the host backend (`docs/dataplane.md`, "Worker hooks"), wrapped in
//! the fault injector, as every worker that injects faults is.

use std::sync::Arc;
use std::time::Duration;

use kvoffload::ChunkKey;
use kvoffload::worker::{
    Fault, FaultControl, FaultInjector, GpuLayout, HostBackend, HostBackendOptions, HostBuffer,
    HostRowLayout, LoadJob, OffloadWorker, StoreJob, TransferBackend, TransferSpec, WorkerLayout,
    WorkerPlan, WorkerReport,
};
use kvoffload::{JobId, RequestId};

const PAGE: u64 = 1024;
const BLOCKS: u32 = 32;
const CHUNKS: u32 = 16;

/// The workers' backend: the host backend, faults injected by the wrapper.
type Backend = FaultInjector<HostBackend>;

struct Rig {
    gpu: Arc<HostBuffer>,
    pool: Arc<HostBuffer>,
    worker: OffloadWorker<Backend>,
}

fn rig(store_writer: bool) -> Rig {
    let gpu = Arc::new(HostBuffer::new((PAGE * u64::from(BLOCKS)) as usize).unwrap());
    let pool = Arc::new(HostBuffer::new(4096 * CHUNKS as usize).unwrap());
    let layout = WorkerLayout::new(
        GpuLayout::cross_layer(gpu.addr(), BLOCKS, PAGE, PAGE).unwrap(),
        HostRowLayout::uniform(1, 1, &[PAGE]).unwrap(),
        0,
        pool.addr(),
        CHUNKS,
    )
    .unwrap();
    let backend = HostBackend::new(
        layout,
        vec![gpu.clone(), pool.clone()],
        HostBackendOptions::default(),
    )
    .unwrap();
    let worker = OffloadWorker::new(FaultInjector::new(backend), store_writer)
        .with_wait_timeout(Some(Duration::from_secs(30)));
    // SAFETY: no job in flight.
    unsafe {
        for b in 0..BLOCKS {
            gpu.write(
                (u64::from(b) * PAGE) as usize,
                &vec![b as u8; PAGE as usize],
            );
        }
        pool.fill(0xEE);
    }
    Rig { gpu, pool, worker }
}

fn store(job: u64, block: u32, chunk: u32) -> StoreJob {
    StoreJob {
        job: JobId(job),
        spec: TransferSpec::new(&[block], 0, &[chunk]),
        keys: vec![ChunkKey(1000 + u64::from(chunk))],
    }
}

fn load(job: u64, req: Option<u64>, block: u32, chunk: u32) -> LoadJob {
    LoadJob {
        job: JobId(job),
        request: req.map(RequestId),
        spec: TransferSpec::new(&[block], 0, &[chunk]),
    }
}

/// Runs the four hooks of one step.
fn step(w: &mut OffloadWorker<Backend>, mut plan: WorkerPlan) -> WorkerReport {
    w.handle_preemptions(&mut plan).unwrap();
    w.start_transfers(&plan).unwrap();
    w.queue_stores(&mut plan);
    w.get_finished()
}

/// Collects reports until `n` jobs completed (bounded; waits on the backend, never a timer).
fn drain(w: &mut OffloadWorker<Backend>, jobs: &[JobId], n: usize) -> WorkerReport {
    w.backend_mut()
        .wait(jobs, Some(Duration::from_secs(30)))
        .unwrap();
    let mut all = WorkerReport::default();
    for _ in 0..1000 {
        let r = w.get_finished();
        for (k, v) in r.completed {
            *all.completed.entry(k).or_insert(0) += v;
        }
        all.finished_loads.extend(r.finished_loads);
        all.failed_loads.extend(r.failed_loads);
        all.failed.extend(r.failed);
        all.stats.store.bytes += r.stats.store.bytes;
        all.stats.load.bytes += r.stats.load.bytes;
        all.stats.store.jobs += r.stats.store.jobs;
        all.stats.load.jobs += r.stats.load.jobs;
        if all.completed.len() >= n {
            break;
        }
    }
    all
}

fn chunk_byte(r: &Rig, chunk: u32) -> u8 {
    // SAFETY: callers only read after the jobs touching this chunk finished.
    unsafe { r.pool.read(4096 * chunk as usize, 1)[0] }
}

#[test]
fn stores_are_queued_for_the_next_step_then_complete_with_stats() {
    let mut r = rig(true);
    let report = step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(1, 5, 2)],
            ..Default::default()
        },
    );
    assert!(report.is_empty());
    assert_eq!(r.worker.queued_stores(), 1);
    assert_eq!(
        r.worker.backend().in_flight(),
        0,
        "not submitted in its own step"
    );
    // The store may already finish within the step that submits it.
    let early = step(&mut r.worker, WorkerPlan::default());
    let report = if early.completed.is_empty() {
        drain(&mut r.worker, &[JobId(1)], 1)
    } else {
        early
    };
    assert_eq!(report.completed.get(&JobId(1)), Some(&1));
    assert_eq!(report.stats.store.bytes, PAGE);
    assert_eq!(report.stats.store.jobs, 1);
    assert_eq!(chunk_byte(&r, 2), 5);
}

#[test]
fn loads_start_in_their_step_and_report_their_request() {
    let mut r = rig(true);
    // Put a known chunk in the pool first.
    step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(1, 7, 3)],
            ..Default::default()
        },
    );
    step(&mut r.worker, WorkerPlan::default());
    drain(&mut r.worker, &[JobId(1)], 1);
    let report = step(
        &mut r.worker,
        WorkerPlan {
            loads: vec![load(2, Some(40), 9, 3)],
            ..Default::default()
        },
    );
    let mut report2 = drain(&mut r.worker, &[JobId(2)], 1);
    report2.completed.extend(report.completed);
    report2.finished_loads.extend(report.finished_loads);
    assert_eq!(report2.completed.get(&JobId(2)), Some(&1));
    assert_eq!(report2.finished_loads, vec![RequestId(40)]);
    // SAFETY: the load finished.
    assert_eq!(
        unsafe { r.gpu.read(9 * PAGE as usize, PAGE as usize) },
        vec![7u8; PAGE as usize]
    );
}

#[test]
fn sync_loads_are_waited_in_the_step_and_not_reported_as_recving() {
    let mut r = rig(true);
    let mut plan = WorkerPlan {
        loads: vec![load(3, None, 4, 0)],
        ..Default::default()
    };
    r.worker.handle_preemptions(&mut plan).unwrap();
    r.worker.start_transfers(&plan).unwrap();
    // Already done without polling: the bytes are in place.
    // SAFETY: the sync load was waited for.
    assert_eq!(unsafe { r.gpu.read(4 * PAGE as usize, 1) }, vec![0xEE]);
    let report = drain(&mut r.worker, &[JobId(3)], 1);
    assert_eq!(report.completed.get(&JobId(3)), Some(&1));
    assert!(report.finished_loads.is_empty());
}

#[test]
fn preemption_flushes_this_steps_and_queued_stores_before_compute() {
    let mut r = rig(true);
    // Step N queues store 1; step N+1 plans store 2 and flushes both.
    step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(1, 1, 1)],
            ..Default::default()
        },
    );
    let mut plan = WorkerPlan {
        stores: vec![store(2, 2, 2), store(3, 3, 3)],
        flush: vec![JobId(1), JobId(2), JobId(99)],
        ..Default::default()
    };
    r.worker.handle_preemptions(&mut plan).unwrap();
    assert_eq!(plan.stores.len(), 1, "the flushed store left the plan");
    assert_eq!(plan.stores[0].job, JobId(3));
    // Both flushed stores are done (waited), before any poll.
    assert_eq!(chunk_byte(&r, 1), 1);
    assert_eq!(chunk_byte(&r, 2), 2);
    assert_eq!(
        chunk_byte(&r, 3),
        0xEE,
        "the unflushed store waits for the next step"
    );
    r.worker.start_transfers(&plan).unwrap();
    r.worker.queue_stores(&mut plan);
    assert_eq!(r.worker.queued_stores(), 1);
    let report = drain(&mut r.worker, &[JobId(1), JobId(2)], 2);
    assert_eq!(report.completed.len(), 2);
}

#[test]
fn a_non_writer_acknowledges_stores_without_copying() {
    let mut r = rig(false);
    let report = step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(1, 5, 2)],
            ..Default::default()
        },
    );
    assert_eq!(report.completed.get(&JobId(1)), Some(&1));
    assert_eq!(report.stats.store.bytes, 0);
    step(&mut r.worker, WorkerPlan::default());
    assert_eq!(r.worker.backend().in_flight(), 0);
    assert_eq!(chunk_byte(&r, 2), 0xEE);
}

#[test]
fn failed_and_refused_jobs_are_reported_failed() {
    let mut r = rig(true);
    r.worker.backend_mut().set_fault(JobId(1), Fault::Fail);
    let plan = WorkerPlan {
        loads: vec![
            load(1, Some(10), 3, 0),
            load(2, Some(11), 0, 0),
            load(3, Some(12), 4, CHUNKS),
        ],
        ..Default::default()
    };
    let report = step(&mut r.worker, plan);
    // Jobs 2 (null block) and 3 (chunk out of range) were refused at submit.
    let mut all = drain(&mut r.worker, &[JobId(1)], 1);
    all.completed.extend(report.completed);
    all.failed.extend(report.failed);
    all.failed_loads.extend(report.failed_loads);
    all.failed.sort();
    all.failed_loads.sort();
    assert_eq!(all.failed, vec![JobId(1), JobId(2), JobId(3)]);
    assert_eq!(
        all.failed_loads,
        vec![RequestId(10), RequestId(11), RequestId(12)]
    );
    assert!(all.finished_loads.is_empty());
    assert_eq!(all.completed.len(), 3);
}

#[test]
fn a_cancelled_stalled_load_is_forgotten_by_the_worker_and_its_backend() {
    let mut r = rig(true);
    for i in 0..100u64 {
        let job = JobId(i + 1);
        r.worker.backend_mut().set_fault(job, Fault::Stall);
        let report = step(
            &mut r.worker,
            WorkerPlan {
                loads: vec![load(i + 1, Some(i), 3, 0)],
                ..Default::default()
            },
        );
        assert!(
            report.completed.is_empty(),
            "a stalled load does not report"
        );
        assert_eq!(r.worker.pending_loads(), 1);
        assert!(r.worker.backend_mut().cancel_stalled(job));
        assert!(r.worker.forget_job(job));
        assert!(!r.worker.forget_job(job));
        assert_eq!(r.worker.pending_loads(), 0);
        assert_eq!(r.worker.backend().in_flight(), 0);
    }
    assert!(r.worker.get_finished().completed.is_empty());
}

/// A worker writing through to an in-memory remote store.
fn remote_rig(
    fail_job: Option<u64>,
) -> (
    Rig,
    Arc<kvoffload::remote::MemoryState>,
    kvoffload::remote::Namespace,
) {
    remote_rig_on(fail_job, kvoffload::remote::MemoryState::new())
}

/// [`remote_rig`] on an existing store (another worker's view of it).
fn remote_rig_on(
    fail_job: Option<u64>,
    state: Arc<kvoffload::remote::MemoryState>,
) -> (
    Rig,
    Arc<kvoffload::remote::MemoryState>,
    kvoffload::remote::Namespace,
) {
    remote_rig_with(
        fail_job,
        state,
        kvoffload::remote::RemoteTierConfig::default(),
    )
}

/// [`remote_rig_on`] with the tier configured by `cfg`.
fn remote_rig_with(
    fail_job: Option<u64>,
    state: Arc<kvoffload::remote::MemoryState>,
    cfg: kvoffload::remote::RemoteTierConfig,
) -> (
    Rig,
    Arc<kvoffload::remote::MemoryState>,
    kvoffload::remote::Namespace,
) {
    use kvoffload::remote::{MemoryConnector, Namespace, RemoteTier};
    let mut r = rig(true);
    let ns = Namespace::from_fingerprint(0x51);
    let clock = kvoffload::ManualClock::new();
    let tier = RemoteTier::start(
        Box::new(MemoryConnector::new(state.clone())),
        &cfg,
        ns.clone(),
        1,
        clock.shared(),
    )
    .unwrap();
    let Rig { gpu, pool, worker } = r;
    let mut worker = worker.with_remote_tier(tier, 3);
    if let Some(j) = fail_job {
        worker.backend_mut().set_fault(JobId(j), Fault::Fail);
    }
    r = Rig { gpu, pool, worker };
    (r, state, ns)
}

/// Waits until `puts` puts are written (or failed) by the worker's tier.
fn flush_remote(w: &OffloadWorker<Backend>, puts: u64) {
    let t = w.remote_tier().expect("a tier");
    let t0 = std::time::Instant::now();
    while t.stats().puts_written + t.stats().puts_failed < puts {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "puts not written: {:?}",
            t.stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn completed_stores_are_written_through_with_the_row_bytes() {
    use kvoffload::remote::value::{ValueIdentity, decode};
    let (mut r, state, ns) = remote_rig(None);
    step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(1, 5, 2), store(2, 6, 3)],
            ..Default::default()
        },
    );
    let early = step(&mut r.worker, WorkerPlan::default());
    let report = drain(
        &mut r.worker,
        &[JobId(1), JobId(2)],
        2 - early.completed.len(),
    );
    assert_eq!(early.completed.len() + report.completed.len(), 2);
    assert!(early.failed.is_empty() && report.failed.is_empty());
    assert_eq!(r.worker.pending_remote_writes(), 0);
    flush_remote(&r.worker, 2);
    for (chunk, block, key) in [(2u32, 5u8, 1002u64), (3, 6, 1003)] {
        let v = state
            .get_raw(&ns.key(key, 3))
            .expect("written through under rank 3");
        let id = ValueIdentity {
            namespace: ns.fingerprint(),
            key,
            rank: 3,
        };
        // This worker's share of the row: its slot, the block's page.
        let payload = decode(&v, id, Some(PAGE as usize)).expect("a valid value");
        assert_eq!(payload, &vec![block; PAGE as usize][..]);
        assert_eq!(chunk_byte(&r, chunk), block);
    }
    assert_eq!(state.len(), 2);
}

#[test]
fn failed_or_cancelled_stores_are_not_written_through() {
    let (mut r, state, _) = remote_rig(Some(1));
    step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(1, 5, 2)],
            ..Default::default()
        },
    );
    let early = step(&mut r.worker, WorkerPlan::default());
    let report = drain(&mut r.worker, &[JobId(1)], 1 - early.completed.len());
    let failed: Vec<JobId> = early.failed.into_iter().chain(report.failed).collect();
    assert_eq!(failed, vec![JobId(1)]);
    assert_eq!(r.worker.pending_remote_writes(), 0);
    // A stalled store the backend cancels is forgotten, with its write.
    r.worker.backend_mut().set_fault(JobId(2), Fault::Stall);
    step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![store(2, 6, 3)],
            ..Default::default()
        },
    );
    step(&mut r.worker, WorkerPlan::default());
    assert_eq!(r.worker.pending_remote_writes(), 1);
    assert!(r.worker.backend_mut().cancel_stalled(JobId(2)));
    assert!(r.worker.forget_job(JobId(2)));
    assert_eq!(r.worker.pending_remote_writes(), 0);
    let t = r.worker.remote_tier().unwrap();
    assert_eq!(t.stats().puts_written + t.queued_puts(), 0);
    assert!(state.is_empty());
}

#[test]
fn fetches_read_shares_written_by_another_worker_into_host_slots() {
    use kvoffload::ChunkId;
    use kvoffload::worker::FetchJob;
    // Worker A stores block 5 into its chunk 2 and writes it through (key 1002).
    let (mut a, state, _) = remote_rig(None);
    step(
        &mut a.worker,
        WorkerPlan {
            stores: vec![store(1, 5, 2)],
            ..Default::default()
        },
    );
    let early = step(&mut a.worker, WorkerPlan::default());
    drain(&mut a.worker, &[JobId(1)], 1 - early.completed.len());
    flush_remote(&a.worker, 1);
    // Worker B (its own buffers, the same store and rank) fetches key 1002
    // into its slot 7, then a key nobody wrote into slot 8.
    let (mut b, _, _) = remote_rig_on(None, state);
    // SAFETY: no job touches B's slot 7 yet.
    assert_ne!(chunk_byte(&b, 7), 5);
    let fetch = |job: u64, key: u64, chunk: u32| FetchJob {
        job: JobId(job),
        keys: vec![ChunkKey(key)],
        chunks: vec![ChunkId(chunk)],
    };
    let plan = WorkerPlan {
        fetches: vec![fetch(10, 1002, 7), fetch(11, 4242, 8)],
        ..Default::default()
    };
    b.worker.start_transfers(&plan).unwrap();
    assert_eq!(b.worker.pending_fetches(), 2);
    b.worker.wait_fetches(Duration::from_secs(30));
    let report = b.worker.get_finished();
    assert_eq!(report.completed.len(), 2, "{report:?}");
    assert_eq!(
        report.failed,
        vec![JobId(11)],
        "the absent key fails its job"
    );
    assert_eq!(b.worker.pending_fetches(), 0);
    // The share came through: B's slot 7 holds A's block 5.
    // SAFETY: the fetch job is reported; nothing else touches slot 7.
    let got = unsafe { b.pool.read(4096 * 7, PAGE as usize) };
    assert_eq!(got, vec![5u8; PAGE as usize]);
    // A worker without a tier fails a fetch at once.
    let mut plain = rig(true);
    plain.worker.start_transfers(&plan).unwrap();
    let report = plain.worker.get_finished();
    assert_eq!(report.failed, vec![JobId(10), JobId(11)]);
    // A replicated layout's reader (not the store writer) has no tier of
    // its own: the writer's fetch fills the shared slot, this one counts the
    // jobs done and touches nothing.
    let mut reader = rig(false);
    let before = chunk_byte(&reader, 7);
    reader.worker.start_transfers(&plan).unwrap();
    let report = reader.worker.get_finished();
    assert_eq!(report.completed.len(), 2, "{report:?}");
    assert!(report.failed.is_empty(), "{report:?}");
    assert_eq!(reader.worker.backend().in_flight(), 0);
    assert_eq!(chunk_byte(&reader, 7), before);
}

#[test]
fn on_eviction_chunks_are_written_when_evicted_not_when_stored() {
    use kvoffload::ChunkId;
    let (mut r, state, ns) = on_eviction_rig();
    store_and_drain(&mut r, store(1, 5, 2));
    assert_eq!(
        r.worker.pending_remote_writes(),
        0,
        "nothing kept for write-through"
    );
    // The host tier evicts chunk 2's key (1002), whose slot a store of the
    // same plan reuses (block 6): the share is written before that store runs.
    let plan = WorkerPlan {
        evictions: vec![(ChunkKey(1002), ChunkId(2))],
        stores: vec![store(2, 6, 2)],
        flush: vec![JobId(2)],
        ..Default::default()
    };
    step(&mut r.worker, plan);
    flush_remote(&r.worker, 1);
    let v = state
        .get_raw(&ns.key(1002, 3))
        .expect("written on eviction");
    let id = kvoffload::remote::value::ValueIdentity {
        namespace: ns.fingerprint(),
        key: 1002,
        rank: 3,
    };
    let payload = kvoffload::remote::value::decode(&v, id, Some(PAGE as usize)).unwrap();
    assert_eq!(
        payload,
        &vec![5u8; PAGE as usize][..],
        "the evicted bytes, not the new store's"
    );
    assert_eq!(state.len(), 1, "the stores themselves are not written");
}

/// A worker writing to an in-memory remote store on eviction.
fn on_eviction_rig() -> (
    Rig,
    Arc<kvoffload::remote::MemoryState>,
    kvoffload::remote::Namespace,
) {
    use kvoffload::remote::{MemoryState, RemoteTierConfig, WritePolicy};
    let cfg = RemoteTierConfig {
        write: WritePolicy::OnEviction,
        ..RemoteTierConfig::default()
    };
    remote_rig_with(None, MemoryState::new(), cfg)
}

/// Runs store `s` to its report (the step that queues it, the next that
/// submits it, then waiting).
fn store_and_drain(r: &mut Rig, s: StoreJob) {
    let job = s.job;
    step(
        &mut r.worker,
        WorkerPlan {
            stores: vec![s],
            ..Default::default()
        },
    );
    let early = step(&mut r.worker, WorkerPlan::default());
    drain(&mut r.worker, &[job], 1 - early.completed.len());
}

/// A store of blocks `blocks` (0: a hole, a window's null block) into
/// `chunks` of one KV group, one block a chunk.
fn store_with_holes(job: u64, blocks: &[u32], chunks: &[u32]) -> StoreJob {
    let mut spec = TransferSpec::new(blocks, 0, chunks);
    spec.groups = vec![kvoffload::scheduler::GroupSpan {
        num_keys: chunks.len() as u32,
        num_blocks: blocks.len() as u32,
        first_block_index: 0,
    }];
    StoreJob {
        job: JobId(job),
        spec,
        keys: chunks
            .iter()
            .map(|&c| ChunkKey(1000 + u64::from(c)))
            .collect(),
    }
}

#[test]
fn a_chunk_stored_in_part_is_not_written_through_until_a_store_fills_its_slot() {
    // A sliding window's store keeps a hole where the request's block is
    // null: that part of the slot is stale, and another node loading the
    // chunk would load it whole. Found on two nodes with windows of 8 and
    // 13 tokens (scripts/widen-hybrid-remote.py, seed 40013).
    let (mut r, state, ns) = remote_rig(None);
    store_and_drain(&mut r, store_with_holes(1, &[5, 0], &[2, 3]));
    flush_remote(&r.worker, 1);
    assert!(state.get_raw(&ns.key(1002, 3)).is_some());
    assert!(
        state.get_raw(&ns.key(1003, 3)).is_none(),
        "the chunk with a hole"
    );
    let stats = r.worker.remote_tier().expect("a tier").stats();
    assert_eq!((stats.puts_written, stats.puts_skipped_partial), (1, 1));
    // The slot stored whole later is written.
    store_and_drain(&mut r, store(2, 6, 3));
    flush_remote(&r.worker, 2);
    assert!(state.get_raw(&ns.key(1003, 3)).is_some());
    assert_eq!(state.len(), 2);
}

#[test]
fn an_evicted_chunk_stored_in_part_is_not_written() {
    use kvoffload::ChunkId;
    let (mut r, state, ns) = on_eviction_rig();
    store_and_drain(&mut r, store_with_holes(1, &[0, 5], &[2, 3]));
    step(
        &mut r.worker,
        WorkerPlan {
            evictions: vec![(ChunkKey(1002), ChunkId(2)), (ChunkKey(1003), ChunkId(3))],
            ..Default::default()
        },
    );
    flush_remote(&r.worker, 1);
    assert!(
        state.get_raw(&ns.key(1002, 3)).is_none(),
        "the chunk with a hole"
    );
    assert!(state.get_raw(&ns.key(1003, 3)).is_some());
    assert_eq!(state.len(), 1);
    let stats = r.worker.remote_tier().expect("a tier").stats();
    assert_eq!(stats.puts_skipped_partial, 1);
}
