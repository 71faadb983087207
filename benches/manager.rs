//! Host-tier manager benchmarks on a tier of 1 M chunks:
//! - `lookup`: one key lookup (hits and misses alternate);
//! - `store_cycle_16`: `prepare_store` of 16 new keys (evicting 16) + `complete_store`
//!   + draining the events, as a serving step does;
//! - the metadata bytes per cached chunk are printed once (target <= 64).
//!
//! Run: `cargo bench --bench manager -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvoffload::manager::{OffloadManager, StoreOutcome};
use kvoffload::{ChunkKey, EvictionPolicyKind};

const CHUNKS: u64 = 1 << 20;

fn full_manager(policy: EvictionPolicyKind) -> OffloadManager {
    let mut m = OffloadManager::new(CHUNKS, policy).expect("capacity");
    let keys: Vec<ChunkKey> = (0..CHUNKS).map(ChunkKey).collect();
    for batch in keys.chunks(4096) {
        let out = m.prepare_store(batch, None).expect("room");
        m.complete_store(&out.keys_to_store, StoreOutcome::Success, None)
            .expect("known keys");
    }
    m
}

fn bench(c: &mut Criterion) {
    for policy in [EvictionPolicyKind::Lru, EvictionPolicyKind::Arc] {
        let mut m = full_manager(policy);
        eprintln!(
            "manager per-chunk structures ({policy}, {CHUNKS} cached chunks, self-reported; \
             the whole heap: tests/manager_heap.rs): {:.1} bytes per chunk",
            m.metadata_bytes() as f64 / CHUNKS as f64
        );
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        c.bench_function(&format!("manager/{policy}/lookup_1M"), |b| {
            b.iter(|| {
                // xorshift: half the keys are present (< CHUNKS), half are misses
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                black_box(m.lookup(ChunkKey(x % (2 * CHUNKS))))
            })
        });
        let mut next = 1u64 << 40;
        let mut batch = [ChunkKey(0); 16];
        c.bench_function(
            &format!("manager/{policy}/store_cycle_16_with_eviction_1M"),
            |b| {
                b.iter(|| {
                    for k in batch.iter_mut() {
                        *k = ChunkKey(next);
                        next += 1;
                    }
                    let out = m.prepare_store(&batch, None).expect("evictable room");
                    debug_assert_eq!(out.evicted.len(), 16);
                    m.complete_store(&out.keys_to_store, StoreOutcome::Success, None)
                        .expect("known keys");
                    black_box(m.take_events().len())
                })
            },
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
