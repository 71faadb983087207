//! Host backend: the right bytes for every layout, round trips, FIFO order,
//! fault injection (the host backend wrapped in a [`FaultInjector`]) and typed
//! errors. Expected addresses are recomputed here from first principles
//! (the host row layout of `docs/dataplane.md`, "Layouts"), not with the
//! library's helpers.

#[path = "common/pages.rs"]
mod pages;
#[path = "common/rng.rs"]
mod rng;

use kvoffload::Direction;

use rng::Rng;
use std::sync::Arc;
use std::time::Duration;

use kvoffload::JobId;
use kvoffload::worker::{
    BackendError, Fault, FaultControl, FaultInjector, GpuLayout, HostBackend, HostBackendOptions,
    HostBuffer, HostRowLayout, LayoutError, SpecError, TransferBackend, TransferResult,
    TransferSpec, WorkerLayout,
};

const POISON: u8 = 0xAB;
const LONG: Option<Duration> = Some(Duration::from_secs(30));

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `layers` regions, page `page`, stride `stride`.
    PerLayer {
        layers: usize,
        page: u64,
        stride: u64,
    },
    /// One region, the whole block.
    Cross { block: u64, stride: u64 },
}

/// Buffers, a backend over them (the host backend, or it in a fault injector:
/// [`Fixture::faulty`]) and the expected layout.
struct Fixture<B = HostBackend> {
    gpu: Arc<HostBuffer>,
    pool: Arc<HostBuffer>,
    backend: B,
    /// (offset of region in `gpu`, stride, page) per tensor.
    regions: Vec<(usize, usize, usize)>,
    bpc: usize,
    row: usize,
    slot_offset: usize,
    num_blocks: u32,
    num_chunks: u32,
}

/// A [`Fixture`]'s settings besides its layout, by name:
/// `Fixture::new(kind, Opts { blocks: 64, ..Opts::default() })`.
#[derive(Clone, Copy, Debug)]
struct Opts {
    /// Whether `wait` may copy jobs itself (`HostBackendOptions::help_in_wait`).
    help_in_wait: bool,
    /// GPU blocks per layer.
    blocks: u32,
    /// GPU blocks per host chunk.
    blocks_per_chunk: u32,
    /// Workers sharing a host row.
    workers: u32,
    /// This worker's rank.
    worker: u32,
    /// Host chunks (rows) in the pool.
    chunks: u32,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            help_in_wait: true,
            blocks: 32,
            blocks_per_chunk: 1,
            workers: 1,
            worker: 0,
            chunks: 16,
        }
    }
}

impl Fixture {
    /// A fixture of layout `kind` with settings `o`.
    fn new(kind: Kind, o: Opts) -> Self {
        let Opts {
            help_in_wait: help,
            blocks: num_blocks,
            blocks_per_chunk: bpc,
            workers,
            worker,
            chunks: num_chunks,
        } = o;
        let (pages, stride, layers) = match kind {
            Kind::PerLayer {
                layers,
                page,
                stride,
            } => (vec![page; layers], stride, layers),
            Kind::Cross { block, stride } => (vec![block], stride, 1),
        };
        let span = (stride * u64::from(num_blocks)) as usize;
        let gpu = Arc::new(HostBuffer::new(span * layers).unwrap());
        let bases: Vec<u64> = (0..layers)
            .map(|l| gpu.addr() + (l * span) as u64)
            .collect();
        let gpu_layout = match kind {
            Kind::PerLayer { page, .. } => {
                GpuLayout::per_layer(&bases, num_blocks, stride, page).unwrap()
            }
            Kind::Cross { block, .. } => {
                GpuLayout::cross_layer(bases[0], num_blocks, stride, block).unwrap()
            }
        };
        // Row: every worker has the same tensors; slot = sum(page) * bpc; row padded to 4096.
        let slot_bytes: u64 = pages.iter().sum::<u64>() * u64::from(bpc);
        let row = (slot_bytes * u64::from(workers)).div_ceil(4096) * 4096;
        let pool = Arc::new(HostBuffer::new((row * u64::from(num_chunks)) as usize).unwrap());
        let row_layout = HostRowLayout::uniform(bpc, workers, &pages).unwrap();
        assert_eq!(row_layout.row_bytes(), row);
        let layout =
            WorkerLayout::new(gpu_layout, row_layout, worker, pool.addr(), num_chunks).unwrap();
        let options = HostBackendOptions {
            help_in_wait: help,
            ..HostBackendOptions::default()
        };
        let backend = HostBackend::new(layout, vec![gpu.clone(), pool.clone()], options).unwrap();
        let regions = pages
            .iter()
            .enumerate()
            .map(|(l, &p)| (l * span, stride as usize, p as usize))
            .collect();
        Self {
            gpu,
            pool,
            backend,
            regions,
            bpc: bpc as usize,
            row: row as usize,
            slot_offset: (slot_bytes * u64::from(worker)) as usize,
            num_blocks,
            num_chunks,
        }
    }

    /// The same fixture, its backend wrapped in a fault injector.
    fn faulty(self) -> Fixture<FaultInjector<HostBackend>> {
        Fixture {
            gpu: self.gpu,
            pool: self.pool,
            backend: FaultInjector::new(self.backend),
            regions: self.regions,
            bpc: self.bpc,
            row: self.row,
            slot_offset: self.slot_offset,
            num_blocks: self.num_blocks,
            num_chunks: self.num_chunks,
        }
    }
}

impl<B> Fixture<B> {
    /// (gpu offset, pool offset, bytes) of every page the spec moves.
    fn pages(&self, spec: &TransferSpec) -> Vec<(usize, usize, usize)> {
        let skip = spec.first_block_index as usize % self.bpc;
        let mut v = Vec::new();
        let mut tensor_off = 0;
        for &(base, stride, page) in &self.regions {
            for (k, b) in spec.gpu_blocks.iter().enumerate() {
                let pos = skip + k;
                let chunk = spec.chunks[pos / self.bpc].0 as usize;
                let sub = pos % self.bpc;
                let host = chunk * self.row + self.slot_offset + tensor_off + sub * page;
                v.push((base + b.0 as usize * stride, host, page));
            }
            tensor_off += page * self.bpc;
        }
        v
    }

    fn poison_and_randomise(&self, rng: &mut Rng, poisoned: &HostBuffer, random: &HostBuffer) {
        // SAFETY: no job in flight.
        unsafe {
            poisoned.fill(POISON);
            random.write(0, &rng.bytes(random.len()));
        }
    }

    /// Checks the destination holds the source's pages and is poison elsewhere.
    fn check(&self, spec: &TransferSpec, dir: Direction) {
        let (src, dst) = match dir {
            Direction::Store => (&self.gpu, &self.pool),
            Direction::Load => (&self.pool, &self.gpu),
        };
        // SAFETY: no job in flight.
        let (s, d) = unsafe { (src.read(0, src.len()), dst.read(0, dst.len())) };
        if let Err(e) = pages::moved_exactly(&s, d, &self.pages(spec), dir, POISON) {
            panic!("{e}");
        }
    }

    fn random_spec(
        &self,
        rng: &mut Rng,
        blocks: usize,
        contiguous: bool,
        first: u32,
    ) -> TransferSpec {
        let gpu_blocks: Vec<u32> = if contiguous {
            let start = 1 + rng.below(u64::from(self.num_blocks) - blocks as u64) as u32;
            (start..start + blocks as u32).collect()
        } else {
            rng.distinct(blocks, 1, self.num_blocks)
        };
        let skip = first as usize % self.bpc;
        let chunks_needed = (skip + blocks).div_ceil(self.bpc);
        let chunks = if contiguous {
            let start = rng.below(u64::from(self.num_chunks) - chunks_needed as u64 + 1) as u32;
            (start..start + chunks_needed as u32).collect()
        } else {
            rng.distinct(chunks_needed, 0, self.num_chunks)
        };
        TransferSpec::new(&gpu_blocks, first, &chunks)
    }
}

fn run<B: TransferBackend>(
    backend: &mut B,
    dir: Direction,
    job: JobId,
    spec: &TransferSpec,
) -> TransferResult {
    match dir {
        Direction::Store => backend.submit_store(job, spec).unwrap(),
        Direction::Load => backend.submit_load(job, spec).unwrap(),
    }
    backend.wait(&[job], LONG).unwrap();
    let mut out = Vec::new();
    backend.poll(&mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].job, job);
    out.remove(0)
}

fn kinds() -> Vec<Kind> {
    vec![
        Kind::PerLayer {
            layers: 3,
            page: 256,
            stride: 256,
        },
        Kind::PerLayer {
            layers: 2,
            page: 200,
            stride: 512,
        },
        Kind::Cross {
            block: 3 * 1024,
            stride: 3 * 1024,
        },
        Kind::Cross {
            block: 1000,
            stride: 1024,
        },
    ]
}

#[test]
fn every_layout_moves_the_right_bytes_both_ways() {
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    let mut job = 0;
    for (i, kind) in kinds().into_iter().enumerate() {
        for bpc in [1u32, 2, 4] {
            for (workers, worker) in [(1u32, 0u32), (3, 1), (3, 2)] {
                // Both completion paths: copied by the thread, or by the waiter.
                let help = (i + bpc as usize + worker as usize).is_multiple_of(2);
                let mut f = Fixture::new(
                    kind,
                    Opts {
                        help_in_wait: help,
                        blocks: 64,
                        blocks_per_chunk: bpc,
                        workers,
                        worker,
                        chunks: 24,
                    },
                );
                for dir in Direction::ALL {
                    for contiguous in [true, false] {
                        for first in [0u32, 1, 3, 5] {
                            let blocks = 1 + rng.below(12) as usize;
                            let spec = f.random_spec(&mut rng, blocks, contiguous, first);
                            match dir {
                                Direction::Store => {
                                    f.poison_and_randomise(&mut rng, &f.pool, &f.gpu)
                                }
                                Direction::Load => {
                                    f.poison_and_randomise(&mut rng, &f.gpu, &f.pool)
                                }
                            }
                            job += 1;
                            let r = run(&mut f.backend, dir, JobId(job), &spec);
                            assert!(r.success);
                            assert_eq!(r.direction, dir);
                            let expected: usize = f.pages(&spec).iter().map(|p| p.2).sum();
                            assert_eq!(r.bytes, expected as u64);
                            f.check(&spec, dir);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn store_then_load_round_trips_into_other_blocks() {
    let mut rng = Rng::new(42);
    for kind in kinds() {
        for bpc in [1u32, 4] {
            let mut f = Fixture::new(
                kind,
                Opts {
                    blocks: 96,
                    blocks_per_chunk: bpc,
                    workers: 2,
                    worker: 1,
                    ..Opts::default()
                },
            );
            // SAFETY: no job in flight.
            unsafe { f.gpu.write(0, &rng.bytes(f.gpu.len())) };
            let src = f.random_spec(&mut rng, 9, false, 2);
            let original: Vec<Vec<u8>> = f
                .pages(&src)
                .iter()
                // SAFETY: no job in flight.
                .map(|&(g, _, n)| unsafe { f.gpu.read(g, n) })
                .collect();
            assert!(run(&mut f.backend, Direction::Store, JobId(1), &src).success);
            // SAFETY: no job in flight.
            unsafe { f.gpu.fill(POISON) };
            let mut blocks = rng.distinct(9, 1, 96);
            blocks.sort_unstable();
            let dst = TransferSpec::new(
                &blocks,
                src.first_block_index,
                &src.chunks.iter().map(|c| c.0).collect::<Vec<_>>(),
            );
            assert!(run(&mut f.backend, Direction::Load, JobId(2), &dst).success);
            for (page, &(g, _, n)) in original.iter().zip(f.pages(&dst).iter()) {
                // SAFETY: no job in flight.
                assert_eq!(unsafe { f.gpu.read(g, n) }, *page);
            }
        }
    }
}

#[test]
fn completions_are_fifo_per_direction() {
    for help in [false, true] {
        fifo(help);
    }
}

fn fifo(help: bool) {
    let mut rng = Rng::new(7);
    let mut f = Fixture::new(
        Kind::PerLayer {
            layers: 2,
            page: 4096,
            stride: 4096,
        },
        Opts {
            help_in_wait: help,
            blocks: 256,
            chunks: 256,
            ..Opts::default()
        },
    );
    let mut submitted = [Vec::new(), Vec::new()];
    for j in 0..64u64 {
        let dir = if rng.below(2) == 0 {
            Direction::Store
        } else {
            Direction::Load
        };
        // Sizes vary so a later small job could finish first if order were not kept.
        let blocks = if j % 3 == 0 { 64 } else { 1 };
        let spec = f.random_spec(&mut rng, blocks, false, 0);
        match dir {
            Direction::Store => f.backend.submit_store(JobId(j), &spec).unwrap(),
            Direction::Load => f.backend.submit_load(JobId(j), &spec).unwrap(),
        }
        submitted[dir.index()].push(JobId(j));
    }
    assert_eq!(f.backend.in_flight(), 64);
    let all: Vec<JobId> = (0..64).map(JobId).collect();
    let mut seen = [Vec::new(), Vec::new()];
    let mut out = Vec::new();
    for _ in 0..1_000_000 {
        f.backend.poll(&mut out);
        if out.len() == 64 {
            break;
        }
        f.backend
            .wait(&all[..1], Some(Duration::from_millis(1)))
            .ok();
    }
    for r in &out {
        assert!(r.success);
        seen[r.direction.index()].push(r.job);
    }
    assert_eq!(seen, submitted);
    assert_eq!(f.backend.in_flight(), 0);
}

#[test]
fn delay_holds_the_job_and_those_behind_it_for_n_polls() {
    let mut rng = Rng::new(11);
    let mut f = Fixture::new(
        Kind::Cross {
            block: 4096,
            stride: 4096,
        },
        Opts {
            chunks: 32,
            ..Opts::default()
        },
    )
    .faulty();
    let a = f.random_spec(&mut rng, 2, false, 0);
    let b = f.random_spec(&mut rng, 2, false, 0);
    f.backend.set_fault(JobId(1), Fault::DelayPolls(3));
    f.backend.submit_store(JobId(1), &a).unwrap();
    f.backend.submit_store(JobId(2), &b).unwrap();
    f.backend.wait(&[JobId(1), JobId(2)], LONG).unwrap();
    let mut out = Vec::new();
    f.backend.poll(&mut out);
    f.backend.poll(&mut out);
    assert!(out.is_empty(), "a delayed head holds its direction back");
    f.backend.poll(&mut out);
    let ids: Vec<JobId> = out.iter().map(|r| r.job).collect();
    assert_eq!(ids, vec![JobId(1), JobId(2)]);
    // A drain reports a job however late its report was set to be, in order,
    // and nothing that is stalled.
    out.clear();
    f.backend.set_fault(JobId(3), Fault::DelayPolls(u32::MAX));
    f.backend.set_fault(JobId(5), Fault::Stall);
    for j in 3..=5 {
        let spec = f.random_spec(&mut rng, 2, false, 0);
        f.backend.submit_store(JobId(j), &spec).unwrap();
    }
    f.backend.poll(&mut out);
    assert!(out.is_empty(), "job 3 holds job 4 back");
    f.backend.drain(&mut out).unwrap();
    let ids: Vec<JobId> = out.iter().map(|r| r.job).collect();
    assert_eq!(ids, vec![JobId(3), JobId(4)]);
    assert_eq!(f.backend.stalled(), vec![JobId(5)]);
}

/// The fault-injecting fixture of the stall tests: one 2 KiB cross-layer
/// region, two blocks per chunk, 32 chunks.
fn stall_fixture() -> Fixture<FaultInjector<HostBackend>> {
    let kind = Kind::Cross {
        block: 2048,
        stride: 2048,
    };
    let o = Opts {
        blocks_per_chunk: 2,
        chunks: 32,
        ..Opts::default()
    };
    Fixture::new(kind, o).faulty()
}

#[test]
fn stall_never_reports_until_released_and_moves_no_bytes() {
    let mut rng = Rng::new(13);
    let mut f = stall_fixture();
    f.poison_and_randomise(&mut rng, &f.pool, &f.gpu);
    let stalled = f.random_spec(&mut rng, 3, false, 1);
    f.backend.set_fault(JobId(1), Fault::Stall);
    f.backend.submit_store(JobId(1), &stalled).unwrap();
    // A later job in the same direction still completes.
    let other = TransferSpec::new(&[31], 0, &[31]);
    let r = run(&mut f.backend, Direction::Store, JobId(2), &other);
    assert!(r.success);
    // Drained: every delay has run out and every other copy has reported,
    // however late; the stalled job has not.
    let mut out = Vec::new();
    f.backend.drain(&mut out).unwrap();
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(f.backend.stalled(), vec![JobId(1)]);
    assert_eq!(f.backend.in_flight(), 1);
    match f.backend.wait(&[JobId(1)], Some(Duration::ZERO)) {
        Err(BackendError::WaitTimedOut { pending }) => assert_eq!(pending, vec![JobId(1)]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    // SAFETY: the stalled job moved nothing and no other job is in flight.
    let pool = unsafe { f.pool.read(0, f.row * 31) };
    assert!(
        pool.iter().all(|&x| x == POISON),
        "a stalled job must not move bytes"
    );
    // A late completion.
    assert!(f.backend.release_stalled(JobId(1)));
    assert!(!f.backend.release_stalled(JobId(1)));
    f.backend.wait(&[JobId(1)], LONG).unwrap();
    f.backend.poll(&mut out);
    assert_eq!(out.len(), 1);
    assert!(out[0].success);
    f.check_partial(&stalled);
}

impl<B> Fixture<B> {
    /// The spec's destination pages in the pool equal the GPU source pages.
    fn check_partial(&self, spec: &TransferSpec) {
        for (g, h, n) in self.pages(spec) {
            // SAFETY: no job in flight.
            unsafe { assert_eq!(self.pool.read(h, n), self.gpu.read(g, n)) };
        }
    }
}

#[test]
fn fail_reports_failure_and_copies_nothing() {
    let mut rng = Rng::new(17);
    let mut f = Fixture::new(
        Kind::PerLayer {
            layers: 2,
            page: 512,
            stride: 512,
        },
        Opts {
            chunks: 32,
            ..Opts::default()
        },
    )
    .faulty();
    f.poison_and_randomise(&mut rng, &f.gpu, &f.pool);
    let spec = f.random_spec(&mut rng, 4, true, 0);
    f.backend.set_fault(JobId(5), Fault::Fail);
    let r = run(&mut f.backend, Direction::Load, JobId(5), &spec);
    assert!(!r.success);
    assert_eq!(r.bytes, 0);
    // SAFETY: no job in flight.
    assert!(
        unsafe { f.gpu.read(0, f.gpu.len()) }
            .iter()
            .all(|&x| x == POISON)
    );
}

#[test]
fn bad_input_gives_typed_errors() {
    let mut f = Fixture::new(
        Kind::PerLayer {
            layers: 2,
            page: 256,
            stride: 256,
        },
        Opts {
            blocks: 16,
            blocks_per_chunk: 2,
            chunks: 8,
            ..Opts::default()
        },
    );
    let b = &mut f.backend;
    let err = |r: Result<(), BackendError>| match r {
        Err(BackendError::Spec(e)) => e,
        other => panic!("expected a spec error, got {other:?}"),
    };
    assert!(matches!(
        err(b.submit_store(JobId(1), &TransferSpec::new(&[16], 0, &[0]))),
        SpecError::BlockOutOfRange {
            block: 16,
            num_blocks: 16
        }
    ));
    assert!(matches!(
        err(b.submit_load(JobId(1), &TransferSpec::new(&[1], 0, &[8]))),
        SpecError::ChunkOutOfRange {
            chunk: 8,
            num_chunks: 8
        }
    ));
    assert!(matches!(
        err(b.submit_load(JobId(1), &TransferSpec::new(&[1, 2], 1, &[0]))),
        SpecError::ChunkCountMismatch {
            expected: 2,
            got: 1,
            ..
        }
    ));
    assert_eq!(
        err(b.submit_store(JobId(1), &TransferSpec::new(&[0], 0, &[0]))),
        SpecError::NullBlock { position: 0 }
    );
    assert_eq!(
        err(b.submit_store(JobId(1), &TransferSpec::default())),
        SpecError::Empty
    );
    // A transfer over several KV groups on a layout of one group is
    // refused, not moved as one group's.
    let span = kvoffload::scheduler::GroupSpan {
        num_keys: 1,
        num_blocks: 1,
        first_block_index: 0,
    };
    let grouped = TransferSpec {
        groups: vec![span; 2],
        ..TransferSpec::new(&[1, 2], 0, &[0, 1])
    };
    assert_eq!(
        err(b.submit_store(JobId(1), &grouped)),
        SpecError::GroupCountMismatch { layout: 1, spec: 2 }
    );
    assert_eq!(b.in_flight(), 0);
    // Duplicate ids in flight (one held by a stall, in the fault injector).
    let mut f = f.faulty();
    let b = &mut f.backend;
    b.set_fault(JobId(9), Fault::Stall);
    b.submit_store(JobId(9), &TransferSpec::new(&[1], 0, &[0]))
        .unwrap();
    assert!(matches!(
        b.submit_load(JobId(9), &TransferSpec::new(&[2], 0, &[1])),
        Err(BackendError::DuplicateJob(JobId(9)))
    ));
    // Unknown ids are ignored by wait.
    b.wait(&[JobId(12345)], Some(Duration::ZERO)).unwrap();
}

#[test]
fn layouts_outside_or_overlapping_the_buffers_are_refused() {
    let gpu = Arc::new(HostBuffer::new(64 * 256).unwrap());
    let pool = Arc::new(HostBuffer::new(4096 * 4).unwrap());
    let row = HostRowLayout::uniform(1, 1, &[256]).unwrap();
    let too_many_blocks = GpuLayout::per_layer(&[gpu.addr()], 65, 256, 256).unwrap();
    let l = WorkerLayout::new(too_many_blocks, row.clone(), 0, pool.addr(), 4).unwrap();
    assert!(matches!(
        HostBackend::new(
            l,
            vec![gpu.clone(), pool.clone()],
            HostBackendOptions::default()
        ),
        Err(LayoutError::OutsideBuffers { .. })
    ));
    let ok_gpu = GpuLayout::per_layer(&[gpu.addr()], 64, 256, 256).unwrap();
    let overlap = WorkerLayout::new(ok_gpu, row, 0, gpu.addr(), 4).unwrap();
    assert!(matches!(
        HostBackend::new(overlap, vec![gpu, pool], HostBackendOptions::default()),
        Err(LayoutError::PoolOverlapsGpu { region: 0 })
    ));
}

#[test]
fn jobs_to_the_same_chunk_are_copied_in_submission_order() {
    for help in [false, true] {
        let mut f = Fixture::new(
            Kind::Cross {
                block: 4096,
                stride: 4096,
            },
            Opts {
                help_in_wait: help,
                blocks: 64,
                chunks: 8,
                ..Opts::default()
            },
        );
        // SAFETY: no job in flight.
        unsafe {
            for b in 0..64usize {
                f.gpu.write(b * 4096, &[b as u8; 4096]);
            }
        }
        let mut last = 0;
        for j in 1..=40u64 {
            let block = 1 + (j as u32 % 63);
            f.backend
                .submit_store(JobId(j), &TransferSpec::new(&[block], 0, &[5]))
                .unwrap();
            last = block;
        }
        f.backend.wait(&[JobId(40)], LONG).unwrap();
        // SAFETY: every job up to 40 is finished (FIFO: wait(40) implies the earlier ones
        // in the same direction were copied first, by the thread or the waiter).
        let chunk = unsafe { f.pool.read(5 * f.row, 4096) };
        assert!(
            chunk.iter().all(|&x| x == last as u8),
            "help={help}: a later store was overwritten by an earlier one"
        );
        let mut out = Vec::new();
        f.backend
            .wait(&(1..=40).map(JobId).collect::<Vec<_>>(), LONG)
            .unwrap();
        f.backend.poll(&mut out);
        assert_eq!(
            out.iter().map(|r| r.job.0).collect::<Vec<_>>(),
            (1..=40).collect::<Vec<_>>()
        );
    }
}

#[test]
fn cancelled_stalls_are_forgotten_and_never_report_nor_move_bytes() {
    let mut rng = Rng::new(17);
    let mut f = stall_fixture();
    f.poison_and_randomise(&mut rng, &f.pool, &f.gpu);
    // Many stalled jobs, all cancelled: the backend keeps nothing of them.
    for i in 0..200u64 {
        let job = JobId(i + 1);
        let spec = f.random_spec(&mut rng, 3, false, 1);
        f.backend.set_fault(job, Fault::Stall);
        f.backend.submit_store(job, &spec).unwrap();
        assert_eq!(f.backend.in_flight(), 1);
        assert!(f.backend.cancel_stalled(job));
        assert!(!f.backend.cancel_stalled(job), "cancelled once");
        assert!(
            !f.backend.release_stalled(job),
            "a cancelled job never runs"
        );
    }
    assert!(f.backend.stalled().is_empty());
    assert_eq!(f.backend.in_flight(), 0);
    assert_eq!(f.backend.pending_faults(), 0);
    // Only a stalled job can be cancelled.
    assert!(!f.backend.cancel_stalled(JobId(999)));
    let other = TransferSpec::new(&[31], 0, &[31]);
    let r = run(&mut f.backend, Direction::Store, JobId(1000), &other);
    assert!(r.success);
    assert!(!f.backend.cancel_stalled(JobId(1000)));
    // Drained (every delay run out, every copy reported): nothing of the
    // cancelled jobs, however late.
    let mut out = Vec::new();
    f.backend.drain(&mut out).unwrap();
    assert!(out.is_empty(), "cancelled jobs never report: {out:?}");
    assert_eq!(f.backend.in_flight(), 0);
    // SAFETY: no job in flight.
    let pool = unsafe { f.pool.read(0, f.row * 31) };
    assert!(
        pool.iter().all(|&x| x == POISON),
        "a cancelled job must not move bytes"
    );
}
