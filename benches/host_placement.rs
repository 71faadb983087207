//! What placing a host pool on a NUMA node costs at startup
//! (`docs/dataplane.md`, "NUMA placement of the host pool"): allocating a
//! 256 MiB pool placed on the first node online (binding the thread,
//! allocating, restoring the thread, sampling where 4,096 of its pages are)
//! against allocating the same pool unplaced, in the same run; and the
//! report's page sampling alone.
//!
//! `cargo bench --bench host_placement -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvoffload::worker::HostBuffer;
use kvoffload::worker::numa::{self, HostPlacement, PoolNear, SysfsTopology, sample_page_nodes};

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

criterion_group!(benches, placement);
criterion_main!(benches);
