//! GPU tests of the CUDA backend (named `gpu_*`). Built where no NVIDIA driver
//! is, they are `#[ignore]`d with the reason, so the test summary counts them
//! as not run; `scripts/gpu-check.sh run` runs them on a GPU machine
//! (`--ignored gpu_`). Run there without a device, each prints
//! `SKIP: <reason>` and returns. With a GPU, every strategy (DMA, batch DMA,
//! kernel, kernel in a graph) is checked against the host backend on random
//! data, with the pinned pool, events, and graph replay with refreshed tables.

#[path = "common/rng.rs"]
mod rng;

use kvoffload::Direction;

use rng::Rng;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use kvoffload::JobId;
use kvoffload::worker::cuda::{
    CudaBackend, CudaBackendOptions, CudaError, DeviceBuffer, PinnedBuffer, PinnedKind, Strategy,
    open_context,
};
use kvoffload::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, KeptChunks,
    SharedRegion, TransferBackend, TransferResult, TransferSpec, WorkerLayout, keep_chunks,
};

const LONG: Option<Duration> = Some(Duration::from_secs(60));

fn gpu_or_skip(test: &str) -> Option<Arc<CudaContext>> {
    match open_context(0) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            println!("SKIP: {e} [{test}]");
            None
        }
    }
}

/// Shape of one test layout.
#[derive(Clone, Copy, Debug)]
struct Shape {
    layers: usize,
    page: u64,
    stride: u64,
    cross: bool,
    bpc: u32,
    blocks: u32,
    chunks: u32,
    /// The tensors of each KV group (empty: one group of every tensor).
    groups: &'static [&'static [usize]],
}

fn layout(s: Shape, gpu_base: u64, pool_base: u64) -> WorkerLayout {
    let span = s.stride * u64::from(s.blocks);
    let gpu = if s.cross {
        GpuLayout::cross_layer(gpu_base, s.blocks, s.stride, s.page).unwrap()
    } else {
        let bases: Vec<u64> = (0..s.layers as u64).map(|l| gpu_base + l * span).collect();
        GpuLayout::per_layer(&bases, s.blocks, s.stride, s.page).unwrap()
    };
    let tensors = if s.cross { 1 } else { s.layers };
    let row = HostRowLayout::uniform(s.bpc, 2, &vec![s.page; tensors]).unwrap();
    let l = WorkerLayout::new(gpu, row, 1, pool_base, s.chunks).unwrap();
    if s.groups.is_empty() {
        return l;
    }
    l.with_groups(s.groups.iter().map(|g| g.to_vec()).collect())
        .unwrap()
}

/// A shared region's file for a pool of `bytes` in this test process.
fn shared_path(bytes: usize) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "kvoffload-gpu-test-{}-{bytes}.mmap",
        std::process::id()
    ))
}

fn gpu_bytes(s: Shape) -> usize {
    (s.stride * u64::from(s.blocks)) as usize * if s.cross { 1 } else { s.layers }
}

fn finish<B: TransferBackend>(b: &mut B, job: JobId) -> TransferResult {
    b.wait(&[job], LONG).unwrap();
    let mut out = Vec::new();
    for _ in 0..10_000 {
        b.poll(&mut out);
        if !out.is_empty() {
            break;
        }
    }
    assert_eq!(out.len(), 1, "{job} did not report");
    out.remove(0)
}

/// The device side and its host-backend reference, loaded with the same bytes.
/// Field order matters: the backends drop (and synchronise) before the buffers.
struct Pair {
    cuda: CudaBackend,
    host: HostBackend,
    /// The compute stream the CUDA backend orders its copies after.
    compute: Arc<cudarc::driver::CudaStream>,
    dev_gpu: DeviceBuffer,
    pool: PinnedBuffer,
    ref_gpu: Arc<HostBuffer>,
    ref_pool: Arc<HostBuffer>,
}

impl Pair {
    fn new(ctx: &Arc<CudaContext>, s: Shape, pinned: PinnedKind) -> Result<Self, CudaError> {
        Self::with_options(ctx, s, pinned, CudaBackendOptions::default())
    }

    fn with_options(
        ctx: &Arc<CudaContext>,
        s: Shape,
        pinned: PinnedKind,
        options: CudaBackendOptions,
    ) -> Result<Self, CudaError> {
        let gbytes = gpu_bytes(s);
        let row =
            HostRowLayout::uniform(s.bpc, 2, &vec![s.page; if s.cross { 1 } else { s.layers }])
                .unwrap()
                .row_bytes();
        let pbytes = (row * u64::from(s.chunks)) as usize;
        let dev_gpu = DeviceBuffer::new(ctx, gbytes)?;
        let pool = match pinned {
            PinnedKind::HostAlloc => PinnedBuffer::host_alloc(ctx, pbytes)?,
            PinnedKind::Registered => PinnedBuffer::registered(ctx, pbytes, 1 << 20, row as usize)?,
            PinnedKind::Shared => {
                let region = SharedRegion::open(&shared_path(pbytes), pbytes).unwrap();
                PinnedBuffer::over_shared(ctx, region, 1 << 20, row as usize)?
            }
        };
        let ref_gpu = Arc::new(HostBuffer::new(gbytes).unwrap());
        let ref_pool = Arc::new(HostBuffer::new(pbytes).unwrap());
        let compute = ctx.new_stream().map_err(|e| CudaError::Driver {
            op: "stream",
            message: format!("{e:?}"),
        })?;
        // SAFETY: the device buffer and pinned pool live in the same `Pair`, whose
        // field order drops the backend (which synchronises its streams) first.
        let cuda = unsafe {
            CudaBackend::new(
                ctx.clone(),
                layout(s, dev_gpu.addr(), pool.addr()),
                compute.clone(),
                options,
            )?
        };
        let host = HostBackend::new(
            layout(s, ref_gpu.addr(), ref_pool.addr()),
            vec![ref_gpu.clone(), ref_pool.clone()],
            HostBackendOptions::default(),
        )
        .unwrap();
        Ok(Self {
            dev_gpu,
            pool,
            ref_gpu,
            ref_pool,
            cuda,
            host,
            compute,
        })
    }

    fn randomise(&self, rng: &mut Rng) -> Result<(), CudaError> {
        let g = rng.bytes(self.ref_gpu.len());
        let p = rng.bytes(self.ref_pool.len());
        self.dev_gpu.upload(0, &g)?;
        // SAFETY: no job in flight on either backend.
        unsafe {
            self.ref_gpu.write(0, &g);
            self.pool.write(0, &p);
            self.ref_pool.write(0, &p);
        }
        Ok(())
    }

    /// Runs every job on both backends at once (all submitted before any is
    /// waited for), then compares both sides in full.
    fn check_many(
        &mut self,
        dir: Direction,
        jobs: &[(JobId, TransferSpec)],
        what: &str,
    ) -> Result<(), CudaError> {
        for b in [&mut self.cuda as &mut dyn TransferBackend, &mut self.host] {
            for (job, spec) in jobs {
                match dir {
                    Direction::Store => b.submit_store(*job, spec).unwrap(),
                    Direction::Load => b.submit_load(*job, spec).unwrap(),
                }
            }
        }
        let ids: Vec<JobId> = jobs.iter().map(|j| j.0).collect();
        for b in [&mut self.cuda as &mut dyn TransferBackend, &mut self.host] {
            b.wait(&ids, LONG).unwrap();
            let mut out = Vec::new();
            for _ in 0..10_000 {
                b.poll(&mut out);
                if out.len() == ids.len() {
                    break;
                }
            }
            assert_eq!(out.len(), ids.len(), "{what}: not every job reported");
            assert!(out.iter().all(|r| r.success), "{what}: a job failed");
        }
        self.compare(what)
    }

    /// Both sides of both backends are byte for byte the same.
    fn compare(&self, what: &str) -> Result<(), CudaError> {
        // SAFETY: no job in flight on either backend (the callers waited).
        let (pool, ref_pool) = unsafe {
            (
                self.pool.read(0, self.pool.len()),
                self.ref_pool.read(0, self.ref_pool.len()),
            )
        };
        assert!(
            pool == ref_pool,
            "{what}: host pool differs from the reference"
        );
        let dev = self.dev_gpu.download(0, self.dev_gpu.len())?;
        // SAFETY: as above.
        let reference = unsafe { self.ref_gpu.read(0, self.ref_gpu.len()) };
        assert!(
            dev == reference,
            "{what}: GPU cache differs from the reference"
        );
        Ok(())
    }

    /// Runs `spec` on both backends and compares both sides in full.
    fn check(
        &mut self,
        dir: Direction,
        job: JobId,
        spec: &TransferSpec,
        what: &str,
    ) -> Result<(), CudaError> {
        for b in [&mut self.cuda as &mut dyn TransferBackend, &mut self.host] {
            match dir {
                Direction::Store => b.submit_store(job, spec).unwrap(),
                Direction::Load => b.submit_load(job, spec).unwrap(),
            }
        }
        let rc = finish(&mut self.cuda, job);
        let rh = finish(&mut self.host, job);
        assert!(rc.success, "{what}: CUDA job failed");
        assert_eq!(rc.bytes, rh.bytes, "{what}");
        assert_eq!(rc.direction, dir);
        self.compare(what)
    }
}

fn shapes() -> Vec<Shape> {
    vec![
        // Per-layer, 16 KiB pages (aligned, vectorised path), one block per chunk.
        Shape {
            layers: 4,
            page: 16 << 10,
            stride: 16 << 10,
            cross: false,
            bpc: 1,
            blocks: 256,
            chunks: 128,
            groups: &[],
        },
        // Per-layer, padded stride and odd page bytes (byte path), 4 blocks per chunk.
        Shape {
            layers: 3,
            page: 1000,
            stride: 1024,
            cross: false,
            bpc: 4,
            blocks: 128,
            chunks: 64,
            groups: &[],
        },
        // Cross-layer, 256 KiB blocks.
        Shape {
            layers: 1,
            page: 256 << 10,
            stride: 256 << 10,
            cross: true,
            bpc: 2,
            blocks: 64,
            chunks: 48,
            groups: &[],
        },
    ]
}

fn spec(rng: &mut Rng, s: Shape, n: usize, contiguous: bool, first: u32) -> TransferSpec {
    let blocks: Vec<u32> = if contiguous {
        let start = 1 + (rng.next() % u64::from(s.blocks - n as u32)) as u32;
        (start..start + n as u32).collect()
    } else {
        rng.distinct(n, 1, s.blocks)
    };
    let need = ((first % s.bpc) as usize + n).div_ceil(s.bpc as usize);
    let chunks = rng.distinct(need, 0, s.chunks);
    TransferSpec::new(&blocks, first, &chunks)
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_every_strategy_matches_the_host_backend() {
    let Some(ctx) = gpu_or_skip("gpu_every_strategy_matches_the_host_backend") else {
        return;
    };
    let mut rng = Rng::new(0xC0FFEE);
    let mut job = 0u64;
    for s in shapes() {
        let mut p = Pair::new(&ctx, s, PinnedKind::HostAlloc).expect("setup");
        if !p.cuda.has_kernels() {
            println!("SKIP: kernels not built; kernel strategies fall back to DMA [{s:?}]");
        }
        if !p.cuda.has_batch_copy() {
            println!("NOTE: cuMemcpyBatchAsync absent; batch DMA falls back to per-run DMA");
        }
        for strategy in Strategy::ALL {
            p.cuda.force_strategy(Some(strategy));
            for dir in Direction::ALL {
                for (n, contiguous, first) in
                    [(1, true, 0), (16, true, 1), (24, false, 3), (48, false, 0)]
                {
                    let n = n.min(s.blocks as usize - 2);
                    p.randomise(&mut rng).expect("randomise");
                    job += 1;
                    let sp = spec(&mut rng, s, n, contiguous, first);
                    let what = format!(
                        "{strategy:?} {dir} n={n} contiguous={contiguous} first={first} {s:?}"
                    );
                    p.check(dir, JobId(job), &sp, &what).expect("check");
                }
            }
        }
        let st = p.cuda.stats();
        println!("stats {s:?}: {st:?}");
        if p.cuda.has_kernels() {
            assert!(st.jobs_by_strategy[2] > 0 && st.jobs_by_strategy[3] > 0);
        }
    }
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_graph_replays_with_a_refreshed_table() {
    let Some(ctx) = gpu_or_skip("gpu_graph_replays_with_a_refreshed_table") else {
        return;
    };
    let s = shapes()[0];
    let mut p = Pair::new(&ctx, s, PinnedKind::HostAlloc).expect("setup");
    if !p.cuda.has_kernels() {
        println!("SKIP: kernels not built [graph_replays_with_a_refreshed_table]");
        return;
    }
    p.cuda.force_strategy(Some(Strategy::KernelGraph));
    // Every graph is captured when the backend is built (one per ring slot,
    // bucket and direction), none on the submit path.
    let options = CudaBackendOptions::default();
    let slots = (options.capacities.len() * options.ring_slots * 2) as u64;
    assert_eq!(p.cuda.stats().graphs_captured, slots);
    let mut rng = Rng::new(99);
    // Small jobs (48..=160 descriptors after splitting), many different tables.
    for j in 0..8u64 {
        p.randomise(&mut rng).expect("randomise");
        let dir = if j % 2 == 0 {
            Direction::Store
        } else {
            Direction::Load
        };
        let sp = spec(&mut rng, s, 3 + j as usize, false, 0);
        p.check(dir, JobId(100 + j), &sp, &format!("replay {j}"))
            .expect("check");
    }
    let st = p.cuda.stats().clone();
    assert_eq!(
        st.graphs_captured, slots,
        "no capture while submitting: {st:?}"
    );
    assert_eq!(st.jobs_by_strategy[3], 8);
    // Job j has b = 3 + j blocks of 4 tensors x 16 KiB, split into pieces of
    // max(4 KiB, 64 KiB x b / 128) (two pieces per warp of the 8 x 256 grid):
    // 4 pieces per tensor page, n = 16 b descriptors, in the 64- or the
    // 256-entry bucket. A replay narrowed to the live entries copies
    // (n + 1) x 24 bytes: at most 24 x sum(16 b + 1) = 20,160 for the 8
    // jobs, where whole tables would be 2 x 65 x 24 + 6 x 257 x 24 = 40,128.
    println!(
        "table bytes copied by 8 replays: {} (live entries at most 20160, whole tables 40128)",
        st.table_bytes_copied
    );
    assert!(
        st.table_bytes_copied > 0 && st.table_bytes_copied <= 20_160,
        "graph replays copied more than their live entries: {st:?}"
    );
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_registered_pool_and_fifo_events() {
    let Some(ctx) = gpu_or_skip("gpu_registered_pool_and_fifo_events") else {
        return;
    };
    let s = shapes()[1];
    let mut p = Pair::new(&ctx, s, PinnedKind::Registered).expect("setup");
    assert_eq!(p.pool.kind(), PinnedKind::Registered);
    let mut rng = Rng::new(5);
    p.randomise(&mut rng).expect("randomise");
    // Many jobs in flight at once: FIFO per direction from event queries.
    let mut submitted = [Vec::new(), Vec::new()];
    for j in 0..32u64 {
        let dir = if j % 3 == 0 {
            Direction::Load
        } else {
            Direction::Store
        };
        let sp = spec(&mut rng, s, 1 + (j as usize % 7), false, 0);
        match dir {
            Direction::Store => p.cuda.submit_store(JobId(j), &sp).unwrap(),
            Direction::Load => p.cuda.submit_load(JobId(j), &sp).unwrap(),
        }
        submitted[dir.index()].push(JobId(j));
    }
    let all: Vec<JobId> = (0..32).map(JobId).collect();
    p.cuda.wait(&all, LONG).unwrap();
    let mut out = Vec::new();
    p.cuda.poll(&mut out);
    let mut seen = [Vec::new(), Vec::new()];
    for r in &out {
        assert!(r.success);
        seen[r.direction.index()].push(r.job);
    }
    assert_eq!(seen, submitted);
    assert!(
        out.iter().map(|r| r.duration).sum::<Duration>() > Duration::ZERO,
        "event timing"
    );
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(kvoffload_gpu, ignore = "checks the no-driver path: a driver is here")]
fn without_a_driver_everything_is_a_typed_error() {
    match open_context(0) {
        Ok(_) => {
            println!("SKIP: a driver is present [without_a_driver_everything_is_a_typed_error]")
        }
        Err(e) => {
            println!("no driver here ({e}): the gpu_* tests are the GPU half");
            assert!(matches!(
                e,
                CudaError::NoDriver | CudaError::NoDevice(_) | CudaError::Panicked { .. }
            ));
        }
    }
}

/// Jobs of `n` scattered blocks each, on distinct blocks and chunks.
/// A spec over `sizes.len()` KV groups: group `g` moves `sizes[g].0` blocks
/// from logical index `sizes[g].1`; blocks and chunks distinct across groups.
fn group_spec(rng: &mut Rng, s: Shape, sizes: &[(usize, u32)]) -> TransferSpec {
    let total: usize = sizes.iter().map(|x| x.0).sum();
    let blocks = rng.distinct(total, 1, s.blocks);
    let keys: Vec<usize> = sizes
        .iter()
        .map(|&(n, first)| {
            if n == 0 {
                0
            } else {
                ((first % s.bpc) as usize + n).div_ceil(s.bpc as usize)
            }
        })
        .collect();
    let chunks = rng.distinct(keys.iter().sum(), 0, s.chunks);
    let mut out = TransferSpec::new(&blocks, 0, &chunks);
    out.groups = sizes
        .iter()
        .zip(&keys)
        .map(|(&(n, first), &k)| kvoffload::scheduler::GroupSpan {
            num_keys: k as u32,
            num_blocks: n as u32,
            first_block_index: first,
        })
        .collect();
    out
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_jobs_over_several_kv_groups_match_the_host_backend() {
    let Some(ctx) = gpu_or_skip("gpu_jobs_over_several_kv_groups_match_the_host_backend") else {
        return;
    };
    let mut rng = Rng::new(0x6A0B5);
    // vLLM's hybrid layout (every group over the same tensors) and a group
    // over fewer tensors, with chunks of two blocks.
    let s = Shape {
        layers: 3,
        page: 8 << 10,
        stride: 8 << 10,
        cross: false,
        bpc: 2,
        blocks: 128,
        chunks: 96,
        groups: &[&[0, 1, 2], &[0, 1, 2], &[2, 0]],
    };
    let mut p = Pair::new(&ctx, s, PinnedKind::HostAlloc).expect("setup");
    let mut job = 0u64;
    for strategy in Strategy::ALL {
        p.cuda.force_strategy(Some(strategy));
        for dir in Direction::ALL {
            for sizes in [
                [(4, 0), (3, 5), (0, 0)],
                [(16, 2), (1, 7), (9, 1)],
                [(0, 0), (24, 0), (2, 3)],
            ] {
                p.randomise(&mut rng).expect("randomise");
                job += 1;
                let sp = group_spec(&mut rng, s, &sizes);
                p.check(
                    dir,
                    JobId(job),
                    &sp,
                    &format!("{strategy:?} {dir} {sizes:?}"),
                )
                .expect("check");
            }
        }
    }
}

fn disjoint_jobs(rng: &mut Rng, s: Shape, jobs: usize, n: usize) -> Vec<(JobId, TransferSpec)> {
    let blocks = rng.distinct(jobs * n, 1, s.blocks);
    let per_job_chunks = n.div_ceil(s.bpc as usize);
    let chunks = rng.distinct(jobs * per_job_chunks, 0, s.chunks);
    (0..jobs)
        .map(|j| {
            let b = &blocks[j * n..(j + 1) * n];
            let c = &chunks[j * per_job_chunks..(j + 1) * per_job_chunks];
            (JobId(500 + j as u64), TransferSpec::new(b, 0, c))
        })
        .collect()
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_a_store_waits_for_the_kv_written_on_the_compute_stream() {
    let Some(ctx) = gpu_or_skip("gpu_a_store_waits_for_the_kv_written_on_the_compute_stream")
    else {
        return;
    };
    let s = shapes()[0];
    let mut p = Pair::new(&ctx, s, PinnedKind::HostAlloc).unwrap();
    let mut rng = Rng::new(0x5eed_c0de);
    p.randomise(&mut rng).unwrap();
    // Keep the compute stream busy first (memsets of a large scratch buffer),
    // then write the whole KV cache there: a store submitted at once must
    // copy these bytes, not the ones before.
    let scratch = DeviceBuffer::new(&ctx, 512 << 20).unwrap();
    let stream = p.compute.cu_stream();
    for round in 0..8u8 {
        // SAFETY: `scratch` holds 512 MiB of device memory and outlives the
        // stream's work (synchronised below before it drops).
        let r = unsafe {
            cudarc::driver::sys::cuMemsetD8Async(scratch.addr(), round, 512 << 20, stream)
        };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    }
    // SAFETY: the device buffer holds `len` bytes; no copy job is in flight.
    let r = unsafe {
        cudarc::driver::sys::cuMemsetD8Async(p.dev_gpu.addr(), 0xab, p.dev_gpu.len(), stream)
    };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    // SAFETY: no job in flight on the host backend.
    unsafe { p.ref_gpu.write(0, &vec![0xab; p.ref_gpu.len()]) };
    let spec = spec(&mut rng, s, 32, false, 0);
    p.check(Direction::Store, JobId(1), &spec, "store after compute")
        .unwrap();
    p.compute.synchronize().unwrap();
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_kernel_jobs_in_flight_together_reuse_ring_slots_without_corruption() {
    let Some(ctx) =
        gpu_or_skip("gpu_kernel_jobs_in_flight_together_reuse_ring_slots_without_corruption")
    else {
        return;
    };
    let s = shapes()[0];
    for strategy in [Strategy::Kernel, Strategy::KernelGraph] {
        let options = CudaBackendOptions {
            ring_slots: 2,
            ..CudaBackendOptions::default()
        };
        let mut p = Pair::with_options(&ctx, s, PinnedKind::HostAlloc, options).unwrap();
        if !p.cuda.has_kernels() {
            println!("SKIP: kernels not built [{strategy:?} ring reuse]");
            return;
        }
        p.cuda.force_strategy(Some(strategy));
        let mut rng = Rng::new(0x0dd_ba11 + strategy as u64);
        p.randomise(&mut rng).unwrap();
        // Three times as many jobs as ring slots, one bucket, one direction,
        // all in flight before any is waited for; then loads back.
        let stores = disjoint_jobs(&mut rng, s, 6, 12);
        p.check_many(Direction::Store, &stores, &format!("{strategy:?} stores"))
            .unwrap();
        let loads: Vec<(JobId, TransferSpec)> = stores
            .iter()
            .map(|(j, sp)| (JobId(j.0 + 100), sp.clone()))
            .collect();
        p.check_many(Direction::Load, &loads, &format!("{strategy:?} loads"))
            .unwrap();
    }
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_a_kernel_job_past_the_largest_table_falls_back_to_dma_with_the_same_bytes() {
    let Some(ctx) = gpu_or_skip(
        "gpu_a_kernel_job_past_the_largest_table_falls_back_to_dma_with_the_same_bytes",
    ) else {
        return;
    };
    let s = shapes()[0];
    let options = CudaBackendOptions {
        capacities: vec![64],
        ..CudaBackendOptions::default()
    };
    let mut p = Pair::with_options(&ctx, s, PinnedKind::Registered, options).unwrap();
    p.cuda.force_strategy(Some(Strategy::KernelGraph));
    let mut rng = Rng::new(0xb16_b00c);
    p.randomise(&mut rng).unwrap();
    // 4 layers x 40 blocks: 160 descriptors, past a 64-entry table.
    let spec = spec(&mut rng, s, 40, false, 0);
    p.check(Direction::Store, JobId(7), &spec, "past the largest table")
        .unwrap();
    assert!(p.cuda.stats().fallbacks >= 1, "{:?}", p.cuda.stats());
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_the_registered_pool_with_kernel_and_batch_strategies_matches_the_host_backend() {
    let Some(ctx) = gpu_or_skip(
        "gpu_the_registered_pool_with_kernel_and_batch_strategies_matches_the_host_backend",
    ) else {
        return;
    };
    for s in shapes() {
        let mut p = Pair::new(&ctx, s, PinnedKind::Registered).unwrap();
        let mut rng = Rng::new(0xfee1_900d ^ s.page);
        p.randomise(&mut rng).unwrap();
        for (i, strategy) in [Strategy::BatchDma, Strategy::Kernel, Strategy::KernelGraph]
            .into_iter()
            .enumerate()
        {
            p.cuda.force_strategy(Some(strategy));
            let n = (s.blocks as usize / 4).min(24);
            let sp = spec(&mut rng, s, n, false, 0);
            let what = format!("registered pool, {strategy:?}, page {}", s.page);
            p.check(Direction::Store, JobId(10 + i as u64), &sp, &what)
                .unwrap();
            p.check(Direction::Load, JobId(20 + i as u64), &sp, &what)
                .unwrap();
        }
    }
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_host_share_reads_the_pinned_rows_a_store_wrote() {
    let Some(ctx) = gpu_or_skip("gpu_host_share_reads_the_pinned_rows_a_store_wrote") else {
        return;
    };
    let mut rng = Rng::new(0x5EA7);
    let s = shapes()[0];
    let mut p = Pair::new(&ctx, s, PinnedKind::HostAlloc).expect("setup");
    p.randomise(&mut rng).expect("randomise");
    let sp = spec(&mut rng, s, 8.min(s.blocks as usize - 2), false, 0);
    p.check(Direction::Store, JobId(1), &sp, "store for host_share")
        .expect("check");
    // What the remote tier's write-through reads: the same bytes from the
    // CUDA backend's pinned pool as from the host backend's reference pool.
    for &c in &sp.chunks {
        let (a, b) = (
            p.cuda.host_share(c).expect("a CUDA share"),
            p.host.host_share(c).expect("a host share"),
        );
        assert_eq!(a.len, b.len);
        // SAFETY: both stores finished (checked above) and no job is in
        // flight; both shares lie in pools that live as long as `p`.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(a.addr as *const u8, a.len),
                std::slice::from_raw_parts(b.addr as *const u8, b.len),
            )
        };
        assert_eq!(x, y, "chunk {c:?}");
    }
}

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_a_shared_region_pool_matches_the_host_backend_and_another_mapping_sees_its_stores() {
    let Some(ctx) = gpu_or_skip(
        "gpu_a_shared_region_pool_matches_the_host_backend_and_another_mapping_sees_its_stores",
    ) else {
        return;
    };
    for s in shapes() {
        let mut p = Pair::new(&ctx, s, PinnedKind::Shared).unwrap();
        assert_eq!(p.pool.kind(), PinnedKind::Shared);
        // Another worker's mapping of the same file (as rank 1 maps rank 0's).
        let other = SharedRegion::open(&shared_path(p.pool.len()), p.pool.len()).unwrap();
        other.unlink().unwrap();
        let mut rng = Rng::new(0x5A4E ^ s.page);
        p.randomise(&mut rng).unwrap();
        for (i, strategy) in [Strategy::Dma, Strategy::BatchDma, Strategy::Kernel]
            .into_iter()
            .enumerate()
        {
            p.cuda.force_strategy(Some(strategy));
            let n = (s.blocks as usize / 4).min(24);
            let sp = spec(&mut rng, s, n, false, 0);
            let what = format!("shared region, {strategy:?}, page {}", s.page);
            p.check(Direction::Store, JobId(10 + i as u64), &sp, &what)
                .unwrap();
            // SAFETY: the store finished (checked) and no job is in flight.
            let (seen, reference) =
                unsafe { (other.read(0, other.len()), p.ref_pool.read(0, other.len())) };
            assert!(seen == reference, "{what}: the other mapping differs");
            p.check(Direction::Load, JobId(20 + i as u64), &sp, &what)
                .unwrap();
            // One turn of two (replicated KV written by turns): the other
            // turn's chunks are holes this store leaves as they are.
            if let KeptChunks::Some(turn) = keep_chunks(&sp, s.bpc, |c| c.0 % 2 == 1) {
                let what = format!("{what}, odd chunks' turn");
                // New bytes on both sides: a hole copied would show.
                p.randomise(&mut rng).unwrap();
                p.check(Direction::Store, JobId(30 + i as u64), &turn, &what)
                    .unwrap();
            }
        }
    }
}

/// The child half of the sticky-error test runs when this is set.
const STICKY_CHILD: &str = "KVOFFLOAD_GPU_STICKY_CHILD";

#[test]
#[cfg_attr(miri, ignore)]
#[cfg_attr(
    not(kvoffload_gpu),
    ignore = "needs an NVIDIA GPU: no driver where this was built (scripts/gpu-check.sh runs it)"
)]
fn gpu_a_sticky_error_becomes_typed_errors_and_failed_jobs_not_panics() {
    const NAME: &str = "gpu_a_sticky_error_becomes_typed_errors_and_failed_jobs_not_panics";
    if std::env::var_os(STICKY_CHILD).is_some() {
        sticky_child();
        return;
    }
    if gpu_or_skip(NAME).is_none() {
        return;
    }
    // A sticky error leaves the context unusable for the rest of the
    // process: the faulting half runs in a child process of this binary.
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            NAME,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STICKY_CHILD, "1")
        .output()
        .expect("running the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("child stdout:\n{stdout}\nchild stderr:\n{stderr}");
    assert!(out.status.success(), "the child failed: {:?}", out.status);
    assert!(
        stdout.contains("sticky: checked"),
        "the child did not run its checks"
    );
}

/// Makes a kernel job read an unmapped device address (an illegal address:
/// a sticky error), then checks that the job reports failed and that every
/// later call returns a typed error or a failed result, without a panic.
fn sticky_child() {
    let ctx = open_context(0).expect("a device");
    let s = Shape {
        layers: 1,
        page: 64 << 10,
        stride: 64 << 10,
        cross: true,
        bpc: 1,
        blocks: 16,
        chunks: 16,
        groups: &[],
    };
    let row = HostRowLayout::uniform(s.bpc, 2, &[s.page])
        .unwrap()
        .row_bytes();
    let pool = PinnedBuffer::host_alloc(&ctx, (row * u64::from(s.chunks)) as usize).unwrap();
    let compute = ctx.new_stream().unwrap();
    // An address far from any allocation: the kernel's first read faults.
    let bogus_gpu = 0x7f00_0000_0000u64;
    // SAFETY: deliberately not upheld for the GPU side (the test wants the
    // fault); the pinned pool outlives the backend, dropped first below.
    let mut b = unsafe {
        CudaBackend::new(
            ctx.clone(),
            layout(s, bogus_gpu, pool.addr()),
            compute,
            CudaBackendOptions::default(),
        )
    }
    .expect("a backend");
    if !b.has_kernels() {
        println!("SKIP: kernels not built: no kernel job to fault");
        println!("sticky: checked (skipped)");
        return;
    }
    b.force_strategy(Some(Strategy::Kernel));
    let sp = TransferSpec::new(&[1, 3, 5], 0, &[0, 1, 2]);
    b.submit_store(JobId(1), &sp)
        .expect("the faulting job is queued");
    let waited = b.wait(&[JobId(1)], LONG);
    println!("wait after the fault: {waited:?}");
    let mut out = Vec::new();
    for _ in 0..1000 {
        b.poll(&mut out);
        if !out.is_empty() {
            break;
        }
    }
    assert_eq!(out.len(), 1, "the faulting job reports");
    assert!(!out[0].success, "the faulting job reports failed: {out:?}");
    assert_eq!(b.in_flight(), 0);
    // Every later job, on every strategy: refused with a typed error, or
    // accepted and reported failed; never a panic, never a success.
    for (i, strategy) in Strategy::ALL.into_iter().enumerate() {
        b.force_strategy(Some(strategy));
        let job = JobId(10 + i as u64);
        match b.submit_load(job, &sp) {
            Err(e) => println!("{strategy:?} after the fault: refused: {e}"),
            Ok(()) => {
                let _ = b.wait(&[job], LONG);
                let mut out = Vec::new();
                for _ in 0..1000 {
                    b.poll(&mut out);
                    if !out.is_empty() {
                        break;
                    }
                }
                assert_eq!(out.len(), 1, "{strategy:?}: the job reports");
                assert!(
                    !out[0].success,
                    "{strategy:?} succeeded after a sticky error"
                );
                println!("{strategy:?} after the fault: accepted, reported failed");
            }
        }
    }
    drop(b);
    println!("sticky: checked");
}
