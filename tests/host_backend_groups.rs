//! Host backend with several KV groups (vLLM's hybrid manager): a job moves
//! each group's blocks to and from that group's chunks, over the tensors the
//! group's layers use, and nothing else. Expected addresses are recomputed
//! here from the host row layout (`docs/dataplane.md`, "Layouts"), not with
//! the library's helpers.

#[path = "common/pages.rs"]
mod pages;

use std::sync::Arc;
use std::time::Duration;

use kvoffload::scheduler::GroupSpan;
use kvoffload::worker::{
    GpuLayout, GpuLayoutKind, GpuRegion, HostBackend, HostBackendOptions, HostBuffer,
    HostRowLayout, SpecError, TransferBackend, TransferSpec, WorkerLayout,
};
use kvoffload::{Direction, JobId};
use proptest::prelude::*;

const POISON: u8 = 0xAB;
const NUM_BLOCKS: u32 = 40;
const NUM_CHUNKS: u32 = 48;
/// Page bytes of the three tensors (different, to catch a tensor mixed up).
const PAGES: [u64; 3] = [48, 64, 32];
const PAD: u64 = 16;

struct Fixture {
    gpu: Arc<HostBuffer>,
    pool: Arc<HostBuffer>,
    backend: HostBackend,
    bpc: usize,
    row: usize,
    /// Offset of each tensor's region in `gpu`.
    bases: Vec<usize>,
    groups: Vec<Vec<usize>>,
}

fn stride(t: usize) -> usize {
    (PAGES[t] + PAD) as usize
}

impl Fixture {
    fn new(bpc: u32, groups: Vec<Vec<usize>>) -> Self {
        let spans: Vec<usize> = (0..PAGES.len())
            .map(|t| stride(t) * NUM_BLOCKS as usize)
            .collect();
        let gpu = Arc::new(HostBuffer::new(spans.iter().sum()).unwrap());
        let bases: Vec<usize> = spans
            .iter()
            .scan(0, |at, s| {
                let b = *at;
                *at += s;
                Some(b)
            })
            .collect();
        let regions = (0..PAGES.len())
            .map(|t| GpuRegion {
                base: gpu.addr() + bases[t] as u64,
                block_stride: stride(t) as u64,
                page_bytes: PAGES[t],
            })
            .collect();
        let gpu_layout =
            GpuLayout::from_regions(GpuLayoutKind::PerLayer, regions, NUM_BLOCKS).unwrap();
        let row_layout = HostRowLayout::uniform(bpc, 1, &PAGES).unwrap();
        let row = (PAGES.iter().sum::<u64>() * u64::from(bpc)).div_ceil(4096) * 4096;
        assert_eq!(row_layout.row_bytes(), row);
        let pool = Arc::new(HostBuffer::new((row * u64::from(NUM_CHUNKS)) as usize).unwrap());
        let layout = WorkerLayout::new(gpu_layout, row_layout, 0, pool.addr(), NUM_CHUNKS)
            .unwrap()
            .with_groups(groups.clone())
            .unwrap();
        let backend = HostBackend::new(
            layout,
            vec![gpu.clone(), pool.clone()],
            HostBackendOptions::default(),
        )
        .unwrap();
        Self {
            gpu,
            pool,
            backend,
            bpc: bpc as usize,
            row: row as usize,
            bases,
            groups,
        }
    }

    /// (gpu offset, pool offset, bytes) of every page `spec` moves.
    fn pages(&self, spec: &TransferSpec) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        let (mut block, mut chunk) = (0, 0);
        for (g, span) in spec.groups.iter().enumerate() {
            let blocks = &spec.gpu_blocks[block..block + span.num_blocks as usize];
            let chunks = &spec.chunks[chunk..chunk + span.num_keys as usize];
            let skip = span.first_block_index as usize % self.bpc;
            for &t in &self.groups[g] {
                let page = PAGES[t] as usize;
                let tensor_off: usize = PAGES[..t].iter().sum::<u64>() as usize * self.bpc;
                for (k, b) in blocks.iter().enumerate() {
                    if b.0 == 0 {
                        // A hole: nothing copied.
                        continue;
                    }
                    let pos = skip + k;
                    let host = chunks[pos / self.bpc].0 as usize * self.row
                        + tensor_off
                        + (pos % self.bpc) * page;
                    out.push((self.bases[t] + b.0 as usize * stride(t), host, page));
                }
            }
            block += span.num_blocks as usize;
            chunk += span.num_keys as usize;
        }
        out
    }

    fn run(&mut self, dir: Direction, job: u64, spec: &TransferSpec) {
        let job = JobId(job);
        match dir {
            Direction::Store => self.backend.submit_store(job, spec).unwrap(),
            Direction::Load => self.backend.submit_load(job, spec).unwrap(),
        }
        self.backend
            .wait(&[job], Some(Duration::from_secs(30)))
            .unwrap();
        let mut out = Vec::new();
        self.backend.poll(&mut out);
        assert_eq!(out.len(), 1);
        assert!(out[0].success);
    }

    /// Checks the destination holds the source's pages of `spec` and poison elsewhere.
    fn check(&self, spec: &TransferSpec, dir: Direction) -> Result<(), TestCaseError> {
        let (src, dst) = match dir {
            Direction::Store => (&self.gpu, &self.pool),
            Direction::Load => (&self.pool, &self.gpu),
        };
        // SAFETY: no job in flight.
        let (s, d) = unsafe { (src.read(0, src.len()), dst.read(0, dst.len())) };
        pages::moved_exactly(&s, d, &self.pages(spec), dir, POISON).map_err(TestCaseError::fail)
    }
}

/// A spec over `groups` groups: group `g` moves `sizes[g].0` blocks from
/// logical index `sizes[g].1`; blocks and chunks distinct across the job
/// (a block belongs to one group at a time, each key has its own chunk);
/// with `holes`, some blocks inside a group (not its first or last) are
/// holes (null: a window block freed before the store).
fn spec(bpc: usize, sizes: &[(usize, u32)], seed: u64, holes: bool) -> TransferSpec {
    let mut blocks: Vec<u32> = (1..NUM_BLOCKS).collect();
    let mut chunks: Vec<u32> = (0..NUM_CHUNKS).collect();
    let mut x = seed | 1;
    for v in [&mut blocks, &mut chunks] {
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    let mut out = TransferSpec::default();
    let (mut b, mut c) = (0, 0);
    for &(n, first) in sizes {
        let keys = if n == 0 {
            0
        } else {
            (first as usize % bpc + n).div_ceil(bpc)
        };
        out.gpu_blocks
            .extend(blocks[b..b + n].iter().enumerate().map(|(k, &i)| {
                let inside = k > 0 && k + 1 < n;
                let hole = holes && inside && (i as u64 ^ seed).is_multiple_of(3);
                kvoffload::GpuBlockId(if hole { 0 } else { i })
            }));
        out.chunks
            .extend(chunks[c..c + keys].iter().map(|&i| kvoffload::ChunkId(i)));
        out.groups.push(GroupSpan {
            num_keys: keys as u32,
            num_blocks: n as u32,
            first_block_index: first,
        });
        b += n;
        c += keys;
    }
    out
}

fn layouts() -> impl Strategy<Value = Vec<Vec<usize>>> {
    prop_oneof![
        // vLLM's hybrid layout: every group's layers overlay the same tensors.
        Just(vec![vec![0, 1, 2], vec![0, 1, 2]]),
        // A padded group with fewer layers, its tensors named out of order.
        Just(vec![vec![0, 1, 2], vec![2, 0]]),
        Just(vec![vec![1], vec![0, 1, 2], vec![2]]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// A store writes each group's pages of its tensors into that group's
    /// chunks and nothing else (a hole's sub-block untouched, the blocks
    /// after it in place); the load back into poisoned GPU memory restores
    /// exactly those pages.
    #[test]
    #[cfg_attr(miri, ignore)] // proptest persistence needs the file system
    fn each_group_moves_its_own_tensors_between_its_blocks_and_chunks(
        groups in layouts(),
        bpc in 1u32..4,
        sizes in proptest::collection::vec((0usize..6, 0u32..10), 3),
        seed in any::<u64>(),
        holes in any::<bool>(),
    ) {
        let sizes = &sizes[..groups.len()];
        prop_assume!(sizes.iter().any(|s| s.0 > 0));
        let mut f = Fixture::new(bpc, groups);
        let spec = spec(bpc as usize, sizes, seed, holes);
        let random: Vec<u8> = (0..f.gpu.len()).map(|i| (i * 31 + seed as usize) as u8).collect();
        // SAFETY: no job in flight.
        unsafe {
            f.gpu.write(0, &random);
            f.pool.fill(POISON);
        }
        f.run(Direction::Store, 1, &spec);
        f.check(&spec, Direction::Store)?;
        // SAFETY: no job in flight.
        unsafe { f.gpu.fill(POISON) };
        f.run(Direction::Load, 2, &spec);
        f.check(&spec, Direction::Load)?;
    }
}

#[test]
fn specs_that_do_not_fit_the_groups_are_typed_errors() {
    let mut f = Fixture::new(2, vec![vec![0, 1, 2], vec![0, 1, 2]]);
    let mut err = |spec: &TransferSpec| f.backend.submit_store(JobId(1), spec).unwrap_err();
    let good = spec(2, &[(3, 1), (2, 4)], 7, false);
    // One group on a layout of two.
    let one = TransferSpec {
        groups: Vec::new(),
        ..good.clone()
    };
    assert!(matches!(
        err(&one).source_spec(),
        Some(SpecError::GroupCountMismatch { layout: 2, spec: 1 })
    ));
    // Spans that do not add up to the blocks.
    let mut short = good.clone();
    short.groups[1].num_blocks = 1;
    assert!(matches!(
        err(&short).source_spec(),
        Some(SpecError::GroupSpansMismatch { .. })
    ));
    // A group's chunks that do not cover its blocks: group 1's 2 blocks
    // from logical index 3 need 2 chunks of 2 blocks (from index 4, 1).
    let mut moved = good.clone();
    moved.groups[1].first_block_index = 3;
    assert!(matches!(
        err(&moved).source_spec(),
        Some(SpecError::ChunkCountMismatch {
            group: 1,
            expected: 2,
            got: 1,
            ..
        })
    ));
    assert_eq!(f.backend.in_flight(), 0);
}

/// The spec error inside a backend error.
trait SourceSpec {
    fn source_spec(&self) -> Option<&SpecError>;
}

impl SourceSpec for kvoffload::worker::BackendError {
    fn source_spec(&self) -> Option<&SpecError> {
        match self {
            kvoffload::worker::BackendError::Spec(e) => Some(e),
            _ => None,
        }
    }
}
