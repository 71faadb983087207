//! Replicated KV stored into one host pool two workers share
//! (`docs/dataplane.md`, "Replicated KV by turns"): vLLM's writers (rank 0
//! copies every chunk, rank 1 acknowledges) against turns by host chunk
//! (each rank copies half), on the host backend. An iteration is one step
//! of 16 stores of 32 chunks of 64 KiB (32 MiB) on both ranks at once, each
//! rank on its own thread as tensor-parallel ranks run, until both have
//! reported every job: the step time of ranks in lockstep. A single-thread
//! memcpy of the same bytes in the same run is the reference.
//!
//! `cargo bench --bench replicated_writes -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::JobId;
use kvoffload::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, OffloadWorker, StoreJob,
    StoreWriters, TransferBackend, TransferSpec, WorkerLayout, WorkerPlan,
};

const BLOCK: u64 = 64 << 10;
const BLOCKS: u32 = 1024;
const JOBS: u32 = 16;
const CHUNKS_A_JOB: u32 = 32;

type Worker = OffloadWorker<HostBackend>;

/// A worker over its own "GPU" buffer and the shared `pool`.
fn worker(pool: &Arc<HostBuffer>, writers: StoreWriters) -> Worker {
    let gpu = Arc::new(HostBuffer::new((BLOCK * u64::from(BLOCKS)) as usize).expect("gpu"));
    // SAFETY: no job in flight.
    unsafe { gpu.fill(7) };
    let layout = WorkerLayout::new(
        GpuLayout::cross_layer(gpu.addr(), BLOCKS, BLOCK, BLOCK).expect("gpu layout"),
        HostRowLayout::uniform(1, 1, &[BLOCK]).expect("row"),
        0,
        pool.addr(),
        BLOCKS,
    )
    .expect("layout");
    let backend = HostBackend::new(
        layout,
        vec![gpu, pool.clone()],
        HostBackendOptions::default(),
    )
    .expect("backend");
    OffloadWorker::new(backend, true).with_store_writers(writers)
}

/// The step's stores, under job ids from `first`.
fn stores(first: u64) -> Vec<StoreJob> {
    (0..JOBS)
        .map(|j| {
            let blocks: Vec<u32> = (0..CHUNKS_A_JOB)
                .map(|k| 1 + j * CHUNKS_A_JOB + k)
                .collect();
            let chunks: Vec<u32> = (0..CHUNKS_A_JOB).map(|k| j * CHUNKS_A_JOB + k).collect();
            StoreJob {
                job: JobId(first + u64::from(j)),
                spec: TransferSpec::new(&blocks, 0, &chunks),
                keys: Vec::new(),
            }
        })
        .collect()
}

/// One rank's step: queue, submit, wait for every job's report.
fn run_rank(w: &mut Worker, jobs: Vec<StoreJob>) {
    let ids: Vec<JobId> = jobs.iter().map(|s| s.job).collect();
    let mut plan = WorkerPlan {
        stores: jobs,
        ..Default::default()
    };
    w.queue_stores(&mut plan);
    w.start_transfers(&WorkerPlan::default()).expect("submit");
    w.backend_mut()
        .wait(&ids, Some(Duration::from_secs(30)))
        .expect("wait");
    let mut reported = 0;
    while reported < ids.len() {
        reported += w.get_finished().completed.len();
    }
}

fn bench(c: &mut Criterion) {
    let pool = Arc::new(HostBuffer::new((BLOCK * u64::from(BLOCKS)) as usize).expect("pool"));
    // SAFETY: no job in flight.
    unsafe { pool.fill(1) };
    let bytes = BLOCK * u64::from(JOBS * CHUNKS_A_JOB);
    let mut g = c.benchmark_group("replicated_store_32MiB_2_ranks");
    g.throughput(Throughput::Bytes(bytes));

    let src = vec![3u8; bytes as usize];
    let mut dst = vec![0u8; bytes as usize];
    g.bench_function("memcpy_one_thread", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });

    let variants = [
        (
            "vllm_rank0_writes",
            [StoreWriters::Every, StoreWriters::Reader],
        ),
        (
            "turns_by_chunk",
            [
                StoreWriters::turn(0, 2).expect("turn"),
                StoreWriters::turn(1, 2).expect("turn"),
            ],
        ),
    ];
    for (name, writers) in variants {
        let mut ranks = writers.map(|w| worker(&pool, w));
        let mut next = 1u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                let first = next;
                next += u64::from(JOBS);
                std::thread::scope(|s| {
                    for w in ranks.iter_mut() {
                        s.spawn(move || run_rank(w, stores(first)));
                    }
                });
            })
        });
        // Every chunk of the step was written (by one rank or the other):
        // the pool holds the "GPU" bytes (7) where it was filled with 1.
        // SAFETY: every job was reported; none is in flight.
        let written = unsafe { pool.read(0, bytes as usize) };
        assert!(
            written.iter().all(|&b| b == 7),
            "{name}: a chunk not written"
        );
        // SAFETY: as above.
        unsafe { pool.fill(1) };
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
