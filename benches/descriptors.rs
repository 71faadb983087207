//! Building a job's copy descriptors (`plan_descriptors`), the per-job CPU
//! cost on the submit path of every backend: 48 scattered blocks over 64
//! per-layer tensors (3,072 pages), as one KV group and as two groups of
//! 24 blocks each over the same tensors (vLLM's hybrid layout), against a
//! plain loop writing the same number of descriptors in the same run.
//!
//! `cargo bench --bench descriptors -- --warm-up-time 1 --measurement-time 3`

#[path = "common/scattered.rs"]
mod scattered;

use std::hint::black_box;

use scattered::scattered;

use criterion::{Criterion, criterion_group, criterion_main};
use kvoffload::Direction;
use kvoffload::scheduler::GroupSpan;
use kvoffload::worker::{
    CopyDesc, DescriptorTable, GpuLayout, HostRowLayout, TransferSpec, WorkerLayout,
    plan_descriptors,
};

const LAYERS: u64 = 64;
const PAGE: u64 = 16 << 10;
const BLOCKS: u32 = 4096;
const MOVED: u32 = 48;
const CHUNKS: u32 = 1024;

fn layout() -> WorkerLayout {
    // Addresses only: planning reads no memory.
    let span = PAGE * u64::from(BLOCKS);
    let bases: Vec<u64> = (0..LAYERS).map(|l| (1 << 40) + l * span).collect();
    let gpu = GpuLayout::per_layer(&bases, BLOCKS, PAGE, PAGE).unwrap();
    let row = HostRowLayout::uniform(1, 1, &vec![PAGE; LAYERS as usize]).unwrap();
    WorkerLayout::new(gpu, row, 0, 1 << 46, CHUNKS).unwrap()
}

fn bench(c: &mut Criterion) {
    let blocks = scattered(7, MOVED as usize, 1, BLOCKS);
    let chunks = scattered(11, MOVED as usize, 0, CHUNKS);
    let one = layout();
    let single = TransferSpec::new(&blocks, 0, &chunks);
    let two = layout()
        .with_groups(vec![(0..LAYERS as usize).collect(); 2])
        .unwrap();
    let half = MOVED / 2;
    let mut grouped = TransferSpec::new(&blocks, 0, &chunks);
    grouped.groups = vec![
        GroupSpan {
            num_keys: half,
            num_blocks: half,
            first_block_index: 0,
        };
        2
    ];

    let mut g = c.benchmark_group("plan_descriptors_48_blocks_x64_layers");
    let pages = (MOVED as u64 * LAYERS) as usize;
    let mut plain = Vec::with_capacity(pages);
    g.bench_function("plain_loop_same_count", |b| {
        b.iter(|| {
            plain.clear();
            for l in 0..LAYERS {
                for (k, &blk) in blocks.iter().enumerate() {
                    plain.push(CopyDesc {
                        src: (l << 36) + u64::from(blk) * PAGE,
                        dst: (1 << 46) + k as u64 * PAGE,
                        bytes: PAGE,
                    });
                }
            }
            black_box(&plain);
        })
    });
    let mut table = DescriptorTable::default();
    g.bench_function("one_group", |b| {
        b.iter(|| {
            plan_descriptors(&one, Direction::Store, black_box(&single), &mut table).unwrap();
            black_box(&table);
        })
    });
    g.bench_function("two_groups", |b| {
        b.iter(|| {
            plan_descriptors(&two, Direction::Store, black_box(&grouped), &mut table).unwrap();
            black_box(&table);
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
