//! KV heads as remote shares (`RemoteShares::kv_heads`): what gathering a
//! chunk's head shares before a put (and scattering them after a fetch)
//! costs against one plain copy of the worker's slot, in the same run. A
//! Llama-3-8B-like worker: 32 layers, 8 KV heads of 128 bf16 values, 16
//! tokens a block, 1 block a chunk (a 2 MiB slot of 256 KiB shares), its
//! pages NHD (a range a token and half: 32 of 256 bytes a head and layer)
//! or HND (a range a half: 2 of 4 KiB).
//!
//! `cargo bench --bench remote_shares -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvoffload::worker::{HeadOrder, HeadPage, HeadPlacement, HostRowLayout, RemoteShares};

const LAYERS: usize = 32;
const HEADS: u32 = 8;
const TOKENS: u64 = 16;
const HEAD_BYTES: u64 = 128 * 2;

fn shares(order: HeadOrder) -> (RemoteShares, usize) {
    let page = 2 * TOKENS * u64::from(HEADS) * HEAD_BYTES;
    let row = HostRowLayout::uniform(1, 1, &[page; LAYERS]).unwrap();
    let slot = row.slot(0).unwrap();
    let p = HeadPage {
        order,
        halves: 2,
        block_tokens: TOKENS,
        heads: HEADS,
        head_bytes: HEAD_BYTES,
    };
    let placement = HeadPlacement {
        total_heads: HEADS,
        tp_size: 1,
        tp_rank: 0,
    };
    let s = RemoteShares::kv_heads(&[p; LAYERS], slot, 1, placement).unwrap();
    (s, slot.bytes as usize)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("remote_head_shares_2MiB_slot");
    let (_, slot_bytes) = shares(HeadOrder::TokenMajor);
    g.throughput(Throughput::Bytes(slot_bytes as u64));
    let slot: Vec<u8> = (0..slot_bytes).map(|i| i as u8).collect();
    let mut out = vec![0u8; slot_bytes];
    g.bench_function("plain_copy_of_the_slot", |b| {
        b.iter(|| {
            out.copy_from_slice(black_box(&slot));
            black_box(&out);
        })
    });
    for (name, order) in [
        ("nhd", HeadOrder::TokenMajor),
        ("hnd", HeadOrder::HeadMajor),
    ] {
        let (s, _) = shares(order);
        let mut buf = Vec::with_capacity(slot_bytes / HEADS as usize);
        g.bench_function(format!("gather_every_head_{name}"), |b| {
            b.iter(|| {
                for h in s.held() {
                    assert!(h.gather(black_box(&slot), &mut buf));
                    black_box(&buf);
                }
            })
        });
        let values: Vec<Vec<u8>> = s
            .held()
            .iter()
            .map(|h| {
                let mut v = Vec::new();
                assert!(h.gather(&slot, &mut v));
                v
            })
            .collect();
        let mut dst = vec![0u8; slot_bytes];
        g.bench_function(format!("scatter_every_head_{name}"), |b| {
            b.iter(|| {
                for (h, v) in s.held().iter().zip(&values) {
                    assert!(h.scatter(black_box(v), &mut dst));
                }
                black_box(&dst);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
