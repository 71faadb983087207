//! Host backend gather (store) and scatter (load) of 256 scattered 16 KiB blocks,
//! against a plain memcpy of the same bytes in the same run (target: >= 80%).
//! Each iteration is submit + wait + poll of one job; `_thread_only` variants
//! disable `help_in_wait`, so the copy always runs on the backend's thread.
//!
//! `cargo bench --bench host_backend -- --warm-up-time 1 --measurement-time 3`

#[path = "common/scattered.rs"]
mod scattered;

use kvoffload::Direction;
use std::hint::black_box;

use scattered::scattered;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::JobId;
use kvoffload::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, TransferBackend,
    TransferSpec, WorkerLayout, plan_descriptors,
};

const BLOCK: u64 = 16 << 10;
const BLOCKS: u32 = 1024;
const MOVED: usize = 256;

fn bench(c: &mut Criterion) {
    let gpu = Arc::new(HostBuffer::new((BLOCK * u64::from(BLOCKS)) as usize).expect("gpu buffer"));
    let pool = Arc::new(HostBuffer::new((BLOCK * u64::from(BLOCKS)) as usize).expect("pool"));
    let layout = WorkerLayout::new(
        GpuLayout::cross_layer(gpu.addr(), BLOCKS, BLOCK, BLOCK).expect("gpu layout"),
        HostRowLayout::uniform(1, 1, &[BLOCK]).expect("row"),
        0,
        pool.addr(),
        BLOCKS,
    )
    .expect("layout");
    let spec = TransferSpec::new(
        &scattered(0x1234_5678, MOVED, 1, BLOCKS),
        0,
        &scattered(0x9abc_def0, MOVED, 0, BLOCKS),
    );
    let mut table = Default::default();
    plan_descriptors(&layout, Direction::Store, &spec, &mut table).expect("plan");
    let descs = table.descs.clone();
    assert_eq!(descs.len(), MOVED);
    // Default (the waiter may copy an unclaimed job itself) and thread-only copies.
    let mut helped = HostBackend::new(
        layout.clone(),
        vec![gpu.clone(), pool.clone()],
        HostBackendOptions::default(),
    )
    .expect("backend");
    let thread_only = HostBackendOptions {
        help_in_wait: false,
        ..HostBackendOptions::default()
    };
    let mut threaded =
        HostBackend::new(layout, vec![gpu.clone(), pool.clone()], thread_only).expect("backend");
    // Touch every page once so no variant pays first-touch faults.
    // SAFETY: no job in flight.
    unsafe {
        gpu.fill(1);
        pool.fill(2);
    }

    let bytes = BLOCK * MOVED as u64;
    let mut g = c.benchmark_group("host_backend_16KiB_x256");
    g.throughput(Throughput::Bytes(bytes));

    let src = vec![3u8; bytes as usize];
    let mut dst = vec![0u8; bytes as usize];
    g.bench_function("memcpy_contiguous", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    g.bench_function("memcpy_scattered_same_blocks", |b| {
        b.iter(|| {
            for d in black_box(&descs) {
                // SAFETY: the descriptors name pages inside `gpu` and `pool`, which
                // live for the whole bench; no backend job is in flight here.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        d.src as *const u8,
                        d.dst as *mut u8,
                        d.bytes as usize,
                    )
                };
            }
        })
    });

    let mut job = 0u64;
    let mut out = Vec::with_capacity(4);
    for (variant, backend) in [("", &mut helped), ("_thread_only", &mut threaded)] {
        for dir in Direction::ALL {
            let name = match dir {
                Direction::Store => format!("host_backend_gather_store{variant}"),
                Direction::Load => format!("host_backend_scatter_load{variant}"),
            };
            g.bench_function(name, |b| {
                b.iter(|| {
                    job += 1;
                    let id = JobId(job);
                    match dir {
                        Direction::Store => backend.submit_store(id, &spec),
                        Direction::Load => backend.submit_load(id, &spec),
                    }
                    .expect("submit");
                    backend
                        .wait(&[id], Some(Duration::from_secs(10)))
                        .expect("wait");
                    out.clear();
                    backend.poll(&mut out);
                    assert_eq!(out.len(), 1);
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
