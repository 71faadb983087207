//! One host pool shared by two worker processes (`SharedRegion`, for KV
//! replicated on every rank): a child process (the writer, rank 0) stores
//! its KV blocks into the region with the host backend and exits; this
//! process (a reader) loads them from its own mapping of the same file into
//! its own KV cache, and gets the child's bytes, block for block.

#[path = "common/rng.rs"]
mod rng;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvoffload::JobId;
use kvoffload::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, SharedRegion,
    TransferBackend, TransferSpec, WorkerLayout,
};
use rng::Rng;

/// The child half runs when this names the region's path.
const CHILD: &str = "KVOFFLOAD_SHARED_REGION_CHILD";
const LAYERS: usize = 3;
const PAGE: u64 = 1000;
const STRIDE: u64 = 1024;
const BLOCKS: u32 = 32;
const BPC: u32 = 2;
const CHUNKS: u32 = 16;
/// The blocks the writer stores, two a chunk, into chunks 5, 9 and 2.
const STORED: [u32; 6] = [3, 4, 10, 11, 20, 21];
const INTO: [u32; 3] = [5, 9, 2];

fn row() -> HostRowLayout {
    HostRowLayout::uniform(BPC, 1, &[PAGE; LAYERS]).unwrap()
}

fn pool_bytes() -> usize {
    row().pool_bytes(CHUNKS).unwrap() as usize
}

/// A KV cache of `LAYERS` per-layer regions in `cache`, and a backend moving
/// its blocks to and from the pool at `pool`.
fn backend(cache: &Arc<HostBuffer>, pool: u64) -> HostBackend {
    let span = STRIDE * u64::from(BLOCKS);
    let bases: Vec<u64> = (0..LAYERS as u64)
        .map(|l| cache.addr() + l * span)
        .collect();
    let gpu = GpuLayout::per_layer(&bases, BLOCKS, STRIDE, PAGE).unwrap();
    let layout = WorkerLayout::new(gpu, row(), 0, pool, CHUNKS).unwrap();
    // SAFETY: `cache` and the region behind `pool` outlive the backend in
    // every caller (dropped after it), and nothing else touches them while
    // a job runs.
    unsafe { HostBackend::from_raw(layout, HostBackendOptions::default()) }
}

fn finish(b: &mut HostBackend, job: JobId) {
    b.wait(&[job], Some(Duration::from_secs(60))).unwrap();
    let mut out = Vec::new();
    while out.is_empty() {
        b.poll(&mut out);
    }
    assert!(out.len() == 1 && out[0].success, "{out:?}");
}

fn cache_bytes() -> usize {
    (STRIDE * u64::from(BLOCKS)) as usize * LAYERS
}

/// The bytes of `blocks` in `cache`, page by page.
fn pages(cache: &HostBuffer, blocks: &[u32]) -> Vec<u8> {
    let span = STRIDE * u64::from(BLOCKS);
    let mut out = Vec::new();
    for l in 0..LAYERS as u64 {
        for &b in blocks {
            let at = (l * span + u64::from(b) * STRIDE) as usize;
            // SAFETY: no job in flight.
            out.extend(unsafe { cache.read(at, PAGE as usize) });
        }
    }
    out
}

/// The writer: fills its cache from `seed`, stores `STORED` into the region.
fn child(path: &Path, seed: u64) {
    let region = SharedRegion::open(path, pool_bytes()).unwrap();
    let cache = Arc::new(HostBuffer::new(cache_bytes()).unwrap());
    // SAFETY: no job in flight.
    unsafe { cache.write(0, &Rng::new(seed).bytes(cache_bytes())) };
    let mut b = backend(&cache, region.addr());
    b.submit_store(JobId(1), &TransferSpec::new(&STORED, 0, &INTO))
        .unwrap();
    finish(&mut b, JobId(1));
    drop(b);
}

fn temp_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "kvoffload-shared-region-test-{}.mmap",
        std::process::id()
    ))
}

#[test]
#[cfg_attr(miri, ignore)]
fn a_reader_process_loads_the_blocks_a_writer_process_stored_in_the_shared_region() {
    if let Ok(path) = std::env::var(CHILD) {
        let seed = std::env::var("KVOFFLOAD_SHARED_REGION_SEED").unwrap();
        child(Path::new(&path), seed.parse().unwrap());
        return;
    }
    let path = temp_path();
    // The reader maps the region first (either order works: whoever comes
    // first sizes the file).
    let region = SharedRegion::open(&path, pool_bytes()).unwrap();
    let seed = 0x5EED_u64;
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_reader_process_loads_the_blocks_a_writer_process_stored_in_the_shared_region",
            "--nocapture",
        ])
        .env(CHILD, &path)
        .env("KVOFFLOAD_SHARED_REGION_SEED", seed.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "the writer process failed: {status}");
    region.unlink().unwrap();
    assert!(!path.exists());

    // The reader's own cache, other bytes; it loads the writer's chunks
    // into other blocks.
    let cache = Arc::new(HostBuffer::new(cache_bytes()).unwrap());
    // SAFETY: no job in flight.
    unsafe { cache.write(0, &Rng::new(seed ^ 1).bytes(cache_bytes())) };
    let mut b = backend(&cache, region.addr());
    let into: [u32; 6] = [30, 31, 1, 2, 14, 15];
    b.submit_load(JobId(7), &TransferSpec::new(&into, 0, &INTO))
        .unwrap();
    finish(&mut b, JobId(7));
    drop(b);

    let writer = HostBuffer::new(cache_bytes()).unwrap();
    // SAFETY: no job in flight.
    unsafe { writer.write(0, &Rng::new(seed).bytes(cache_bytes())) };
    assert!(
        pages(&cache, &into) == pages(&writer, &STORED),
        "the reader's blocks differ from what the writer stored"
    );
    // A block the load did not touch keeps the reader's own bytes.
    assert!(pages(&cache, &[0]) != pages(&writer, &[0]));
}
