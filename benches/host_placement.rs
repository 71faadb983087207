//! What placing a host pool on a NUMA node costs at startup
//! (`docs/dataplane.md`, "NUMA placement of the host pool"): allocating a
//! 256 MiB pool placed on the first node online (binding the thread,
//! allocating, restoring the thread, sampling where 4,096 of its pages are)
//! against allocating the same pool unplaced, in the same run; and the
//! report's page sampling alone. And what running the host backend's copy
//! threads on the pool's node does to its copies: a store and a load of 64
//! blocks of 64 KiB with the threads bound to the first node's CPUs against
//! unbound threads, in the same run.
//!
//! `cargo bench --bench host_placement -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::JobId;
use kvoffload::worker::numa::{
    self, HostPlacement, NodeCpus, PoolNear, SysfsTopology, sample_page_nodes,
};
use kvoffload::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, TransferBackend,
    TransferSpec, WorkerLayout,
};

const POOL: usize = 256 << 20;

fn placement(c: &mut Criterion) {
    let topo = SysfsTopology::system();
    let node = topo.online_nodes().expect("online nodes")[0];
    let mut g = c.benchmark_group("host_pool_256MiB");
    g.sample_size(20);
    g.bench_function("unplaced", |b| {
        b.iter(|| black_box(HostBuffer::new(POOL).expect("pool")));
    });
    g.bench_function("placed_on_a_node", |b| {
        b.iter(|| {
            let guard =
                numa::enter(HostPlacement::Node(node), &PoolNear::NoGpu, &topo).expect("placement");
            let pool = HostBuffer::new(POOL).expect("pool");
            let p = guard.finish(pool.addr() as usize, pool.len());
            assert_eq!(p.pages.on(node), p.pages.sampled, "{p}");
            black_box((pool, p))
        });
    });
    g.finish();
    let pool = HostBuffer::new(POOL).expect("pool");
    c.bench_function("sample_4096_pages_of_256MiB", |b| {
        b.iter(|| black_box(sample_page_nodes(pool.addr() as usize, pool.len(), 4096)));
    });
}

const BLOCK: u64 = 64 << 10;
const BLOCKS: u32 = 64;

/// A host backend over 2 x 64 GPU blocks and a pool of 64 chunks of one
/// block, its copy threads at `home`.
fn backend(home: Option<NodeCpus>) -> HostBackend {
    let gpu_blocks = 2 * BLOCKS + 1;
    let gpu = Arc::new(HostBuffer::new((u64::from(gpu_blocks) * BLOCK) as usize).expect("gpu"));
    let row = HostRowLayout::uniform(1, 1, &[BLOCK]).expect("row");
    let pool =
        Arc::new(HostBuffer::new(row.pool_bytes(BLOCKS).expect("size") as usize).expect("pool"));
    let layout = WorkerLayout::new(
        GpuLayout::cross_layer(gpu.addr(), gpu_blocks, BLOCK, BLOCK).expect("gpu layout"),
        row,
        0,
        pool.addr(),
        BLOCKS,
    )
    .expect("layout");
    // The copy threads copy every job (`wait` helping would copy some on
    // the bench's own thread).
    let options = HostBackendOptions {
        home,
        help_in_wait: false,
        ..HostBackendOptions::default()
    };
    HostBackend::new(layout, vec![gpu, pool], options).expect("backend")
}

fn copy_threads(c: &mut Criterion) {
    let topo = SysfsTopology::system();
    let node = topo.online_nodes().expect("online nodes")[0];
    let cpus = topo.node_cpus(node).expect("node cpus");
    // Every other GPU block (scattered), into chunks 0..64, and back.
    let blocks: Vec<u32> = (0..BLOCKS).map(|i| 2 * i + 1).collect();
    let chunks: Vec<u32> = (0..BLOCKS).collect();
    let spec = TransferSpec::new(&blocks, 0, &chunks);
    let mut g = c.benchmark_group("host_copy_threads_store_load_64x64KiB");
    g.throughput(Throughput::Bytes(2 * u64::from(BLOCKS) * BLOCK));
    for (name, home) in [
        ("anywhere", None),
        ("on_the_pool_s_node", Some(NodeCpus { node, cpus })),
    ] {
        let mut b = backend(home);
        let mut next = 1u64;
        let mut out = Vec::new();
        g.bench_function(name, |bench| {
            bench.iter(|| {
                let (store, load) = (JobId(next), JobId(next + 1));
                next += 2;
                b.submit_store(store, &spec).expect("store");
                b.submit_load(load, &spec).expect("load");
                b.wait(&[store, load], Some(Duration::from_secs(60)))
                    .expect("wait");
                out.clear();
                b.poll(&mut out);
                black_box(&out);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, placement, copy_threads);
criterion_main!(benches);
