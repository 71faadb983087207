//! The copy kernels (`kernels/copy_blocks.cu`) run on the CPU: built as host
//! C++ (`kernels/emulation/`: a shim for the few CUDA names they use and a
//! launcher that runs a grid's threads one after the other) and fed the
//! tables the CUDA backend builds. The kernels share nothing between threads
//! (no shared memory, barriers or warp intrinsics), so this computes what a
//! GPU computes: every byte of every descriptor copied, nothing else
//! written, for every entry point, launch shape and alignment (16-byte,
//! 8-byte and byte paths), and the table header's count clamped to the
//! capacity. What only a GPU shows (the memory model, the cache hints,
//! speed) is `tests/gpu.rs`'s and `scripts/gpu-check.sh`'s.
//!
//! Needs a C++ compiler (`$CXX`, else `c++`); without one these tests are
//! ignored, with that reason.

#[path = "common/rng.rs"]
mod rng;

use std::ffi::c_void;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use kvoffload::Direction;
use kvoffload::worker::cuda::{LaunchShape, kernel_pieces, table_header};
use kvoffload::worker::{
    CopyDesc, DescriptorTable, GpuLayout, HostRowLayout, TransferSpec, WorkerLayout,
    plan_descriptors,
};
use rng::Rng;

/// The launcher's signature (`kvemu_launch` in `kernels/emulation/launch.cpp`).
type Launch = unsafe extern "C" fn(i32, *const c_void, u32, u32, u32, u32) -> i32;

/// The kernels built for the CPU, loaded once per test binary.
struct Kernels {
    launch: Launch,
    /// Keeps the library (and so `launch`) loaded.
    _lib: libloading::Library,
}

/// The kernel entry points, numbered as the launcher numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// `kv_gather(descs, n)`.
    Gather = 0,
    /// `kv_scatter(descs, n)`.
    Scatter = 1,
    /// `kv_gather_table(table, capacity)`: what stores launch.
    GatherTable = 2,
    /// `kv_scatter_table(table, capacity)`: what loads launch.
    ScatterTable = 3,
}

const ENTRIES: [Entry; 4] = [
    Entry::Gather,
    Entry::Scatter,
    Entry::GatherTable,
    Entry::ScatterTable,
];

fn kernels() -> &'static Kernels {
    static KERNELS: OnceLock<Kernels> = OnceLock::new();
    KERNELS.get_or_init(build)
}

/// Compiles `kernels/emulation/launch.cpp` (which includes the real kernel
/// source) into a shared library and loads it; the build folder is removed
/// once the library is loaded.
fn build() -> Kernels {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emulation");
    let dir = tempfile::Builder::new()
        .prefix("kvoffload-kernel-emulation-")
        .tempdir()
        .expect("create a temporary folder");
    let lib = dir.path().join("libkvemu.so");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unknown-pragmas",
        ])
        .arg(root.join("launch.cpp"))
        .arg("-o")
        .arg(&lib)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
    assert!(
        out.status.success(),
        "the kernels do not build as host C++:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the library is ours (built just now from the repository's
    // sources); it has no initialisers beyond four thread-local globals.
    let lib = unsafe { libloading::Library::new(&lib) }.expect("load the emulated kernels");
    // SAFETY: `kvemu_launch` has exactly the `Launch` signature (launch.cpp).
    let launch: Launch = unsafe {
        *lib.get::<Launch>(b"kvemu_launch\0")
            .expect("kvemu_launch in the library")
    };
    Kernels { launch, _lib: lib }
}

/// Runs `entry` over `descs` (the plain entry points: the descriptors and
/// their count; the table entry points: a header with `count`, then the
/// descriptors, capacity `descs.len()`) on a grid of `shape`.
///
/// # Safety
/// Every descriptor must name `bytes` readable bytes at `src` and writable
/// bytes at `dst`, no destination overlapping another's or any source.
unsafe fn run(entry: Entry, descs: &[CopyDesc], count: usize, shape: LaunchShape, order: u32) {
    let (ctas, threads) = shape.dims();
    let table: Vec<CopyDesc>;
    let (ptr, arg) = match entry {
        Entry::Gather | Entry::Scatter => (descs.as_ptr(), count as u32),
        Entry::GatherTable | Entry::ScatterTable => {
            table = std::iter::once(table_header(count))
                .chain(descs.iter().copied())
                .collect();
            (table.as_ptr(), descs.len() as u32)
        }
    };
    // SAFETY: `ptr` points at `arg` descriptors (plus the header for the
    // table entry points), alive for the call; the caller vouches for the
    // memory they name. The launcher runs synchronously.
    let rc = unsafe { (kernels().launch)(entry as i32, ptr.cast(), arg, ctas, threads, order) };
    assert_eq!(rc, 0, "{entry:?} on {shape:?} refused by the launcher");
}

/// A 16-byte aligned buffer of `n` bytes.
struct Arena(Vec<u128>, usize);

impl Arena {
    fn new(n: usize, mut fill: impl FnMut() -> u8) -> Self {
        let mut a = Self(vec![0; n.div_ceil(16)], n);
        for b in a.bytes_mut() {
            *b = fill();
        }
        a
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..self.1]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.1;
        &mut bytemuck::cast_slice_mut(&mut self.0)[..n]
    }
    fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

/// What copying `descs` in order does to `dst` (the reference: one
/// `copy_from_slice` a descriptor), with `src` and `dst` the arenas the
/// descriptors' addresses point into.
fn reference(descs: &[CopyDesc], src: &Arena, dst: &Arena) -> Vec<u8> {
    let mut out = dst.bytes().to_vec();
    for d in descs {
        let s = (d.src - src.addr()) as usize;
        let t = (d.dst - dst.addr()) as usize;
        let n = d.bytes as usize;
        out[t..t + n].copy_from_slice(&src.bytes()[s..s + n]);
    }
    out
}

const SRC_BYTES: usize = 2 << 20;
const DST_BYTES: usize = 2 << 20;

/// Random descriptors from `src` into `dst`: destinations disjoint, with
/// gaps; starts 16-byte aligned, 8-byte aligned only, or anywhere; lengths
/// from 0 to past the kernel's unrolled stride and a 64 KiB piece.
fn random_descs(rng: &mut Rng, src: &Arena, dst: &Arena) -> Vec<CopyDesc> {
    let mut descs = Vec::new();
    let mut cursor = 0u64;
    for _ in 0..1 + rng.below(40) {
        let align = [16, 8, 1][rng.below(3) as usize];
        let bytes = match rng.below(4) {
            0 => rng.below(64),
            1 => rng.below(5000),
            2 => 4096 * (1 + rng.below(16)),
            _ => 60_000 + rng.below(80_000),
        };
        cursor += rng.below(64);
        let mut t = cursor.next_multiple_of(16);
        let mut s = rng.below((SRC_BYTES as u64 - bytes - 32) / 16) * 16;
        match align {
            16 => {}
            // Aligned to 8, not 16, on one side at least.
            8 => {
                t += 8;
                s += 8 * rng.below(2);
            }
            _ => {
                t += 1 + rng.below(15);
                s += rng.below(16);
            }
        }
        if t + bytes > DST_BYTES as u64 {
            break;
        }
        descs.push(CopyDesc {
            src: src.addr() + s,
            dst: dst.addr() + t,
            bytes,
        });
        cursor = t + bytes;
    }
    descs
}

fn table_of(descs: &[CopyDesc]) -> DescriptorTable {
    DescriptorTable {
        descs: descs.to_vec(),
        bytes: descs.iter().map(|d| d.bytes).sum(),
        blocks: descs.len(),
        max_desc_bytes: descs.iter().map(|d| d.bytes).max().unwrap_or(0),
    }
}

const SHAPES: [LaunchShape; 4] = [
    LaunchShape {
        ctas: 1,
        threads: 32,
    },
    LaunchShape {
        ctas: 3,
        threads: 96,
    },
    LaunchShape {
        ctas: 8,
        threads: 256,
    },
    LaunchShape {
        ctas: 16,
        threads: 64,
    },
];

#[test]
#[cfg_attr(
    not(kvoffload_cxx),
    ignore = "needs a C++ compiler ($CXX or c++) to build the kernels for the CPU"
)]
fn every_entry_point_copies_every_byte_of_random_descriptors_and_nothing_else() {
    let mut rng = Rng::new(0x5EED_C0DE);
    let src = Arena::new(SRC_BYTES, {
        let mut r = Rng::new(7);
        move || r.next() as u8
    });
    let (mut copied, mut runs) = (0u64, 0);
    for case in 0..12 {
        let mut dst = Arena::new(DST_BYTES, || 0xA5);
        let descs = random_descs(&mut rng, &src, &dst);
        let want = reference(&descs, &src, &dst);
        for (k, &shape) in SHAPES.iter().enumerate() {
            // As submitted (one descriptor a run), and split into pieces
            // as the kernel strategies split a job.
            let mut pieces = Vec::new();
            kernel_pieces(&table_of(&descs), shape, 64 << 10, &mut pieces);
            for (split, job) in [(false, &descs), (true, &pieces)] {
                let entry = ENTRIES[(case + k + usize::from(split)) % ENTRIES.len()];
                let order = (case % 3) as u32;
                dst.bytes_mut().fill(0xA5);
                // SAFETY: the descriptors name bytes of `src` and of `dst`
                // (checked when built), destinations disjoint.
                unsafe { run(entry, job, job.len(), shape, order) };
                assert!(
                    dst.bytes() == want.as_slice(),
                    "case {case}: {entry:?} on {shape:?} (split {split}, order {order}): first wrong byte at {:?}",
                    dst.bytes().iter().zip(&want).position(|(a, b)| a != b)
                );
                copied += job.iter().map(|d| d.bytes).sum::<u64>();
                runs += 1;
            }
        }
    }
    assert!(
        runs == 96 && copied > 10 << 20,
        "{runs} runs, {copied} bytes"
    );
}

#[test]
#[cfg_attr(
    not(kvoffload_cxx),
    ignore = "needs a C++ compiler ($CXX or c++) to build the kernels for the CPU"
)]
fn a_table_copies_the_count_in_its_header_never_past_its_capacity() {
    let src = Arena::new(64 << 10, || 0x3C);
    let descs: Vec<CopyDesc> = (0..8u64)
        .map(|i| CopyDesc {
            src: src.addr() + i * 4096,
            dst: 0,
            bytes: 4096,
        })
        .collect();
    for (count, copied) in [(0, 0), (3, 3), (8, 8), (1000, 8)] {
        for entry in [Entry::GatherTable, Entry::ScatterTable] {
            let dst = Arena::new(64 << 10, || 0);
            let job: Vec<CopyDesc> = descs
                .iter()
                .map(|d| CopyDesc {
                    dst: dst.addr() + (d.src - src.addr()),
                    ..*d
                })
                .collect();
            // SAFETY: descriptor i copies page i of `src` to page i of `dst`.
            unsafe { run(entry, &job, count, LaunchShape::default(), 0) };
            let pages_written = dst
                .bytes()
                .chunks(4096)
                .take_while(|p| p.iter().all(|&b| b == 0x3C))
                .count();
            assert_eq!(pages_written, copied, "{entry:?}, header count {count}");
            assert!(dst.bytes()[copied * 4096..].iter().all(|&b| b == 0));
        }
    }
}

/// A layout over real memory: the "GPU" pages and the host pool are arenas.
struct Rig {
    gpu: Arena,
    host: Arena,
    layout: WorkerLayout,
}

/// Per-layer caches (`tensors` tensors of `page` bytes a block, blocks
/// `stride` apart) or one cross-layer cache (`tensors == 0`: blocks of
/// `page` bytes), 64 blocks, chunks of `bpc` blocks, 32 chunks.
fn rig(tensors: u64, page: u64, stride: u64, bpc: u32) -> Rig {
    let blocks = 64u32;
    let span = stride * u64::from(blocks);
    let layers = tensors.max(1);
    let mut r = Rng::new(page ^ (stride << 20) ^ u64::from(bpc));
    let gpu = Arena::new((span * layers) as usize, move || r.next() as u8);
    let gpu_layout = if tensors == 0 {
        GpuLayout::cross_layer(gpu.addr(), blocks, stride, page)
    } else {
        let bases: Vec<u64> = (0..tensors).map(|t| gpu.addr() + t * span).collect();
        GpuLayout::per_layer(&bases, blocks, stride, page)
    }
    .expect("a GPU layout");
    let row = HostRowLayout::uniform(bpc, 1, &vec![page; layers as usize]).expect("a row layout");
    let chunks = 32;
    let pool = row.pool_bytes(chunks).expect("pool bytes");
    let host = Arena::new(pool as usize, || 0);
    let layout = WorkerLayout::new(gpu_layout, row, 0, host.addr(), chunks).expect("a layout");
    Rig { gpu, host, layout }
}

#[test]
#[cfg_attr(
    not(kvoffload_cxx),
    ignore = "needs a C++ compiler ($CXX or c++) to build the kernels for the CPU"
)]
fn kernel_jobs_of_real_layouts_store_and_load_back_every_byte() {
    // (tensors, page bytes, block stride, blocks a chunk): pages 16-byte
    // aligned, 8-byte aligned only, odd; per-layer and cross-layer.
    let layouts = [
        (4, 2048, 2048, 4),
        (2, 1032, 1040, 2),
        (3, 1001, 1024, 1),
        (0, 16384, 16384, 2),
        (0, 40_968, 40_976, 1),
    ];
    let mut rng = Rng::new(42);
    for (tensors, page, stride, bpc) in layouts {
        let mut rig = rig(tensors, page, stride, bpc);
        let original = rig.gpu.bytes().to_vec();
        for &shape in &SHAPES {
            // A request's blocks (scattered on the GPU) into whole chunks,
            // starting part way into the first one.
            let first = rng.below(u64::from(bpc)) as u32;
            let n = 1 + rng.below(12) as usize;
            let gpu_blocks: Vec<u32> = (0..n).map(|_| 1 + rng.below(63) as u32).collect::<Vec<_>>();
            let mut unique = gpu_blocks.clone();
            unique.sort_unstable();
            unique.dedup();
            let gpu_blocks = if unique.len() == n {
                gpu_blocks
            } else {
                unique
            };
            let n_chunks = (first as usize + gpu_blocks.len()).div_ceil(bpc as usize);
            let chunks: Vec<u32> = (0..n_chunks as u32).map(|c| (c * 7 + 3) % 32).collect();
            let spec = TransferSpec::new(&gpu_blocks, first, &chunks);
            for direction in [Direction::Store, Direction::Load] {
                let mut table = DescriptorTable::default();
                plan_descriptors(&rig.layout, direction, &spec, &mut table).expect("a valid spec");
                let (from, to) = match direction {
                    Direction::Store => (&rig.gpu, &rig.host),
                    Direction::Load => (&rig.host, &rig.gpu),
                };
                let want = match direction {
                    Direction::Store => reference(&table.descs, from, to),
                    // Loads bring back what the store wrote: the original.
                    Direction::Load => original.clone(),
                };
                if direction == Direction::Load {
                    // Wipe the blocks the load fills.
                    for d in &table.descs {
                        let at = (d.dst - rig.gpu.addr()) as usize;
                        rig.gpu.bytes_mut()[at..at + d.bytes as usize].fill(0);
                    }
                }
                let mut pieces = Vec::new();
                kernel_pieces(&table, shape, 64 << 10, &mut pieces);
                let entry = match direction {
                    Direction::Store => Entry::GatherTable,
                    Direction::Load => Entry::ScatterTable,
                };
                // SAFETY: the layout's descriptors name bytes of the two
                // arenas (it validated the spec), destinations disjoint.
                unsafe { run(entry, &pieces, pieces.len(), shape, 1) };
                let got = match direction {
                    Direction::Store => rig.host.bytes(),
                    Direction::Load => rig.gpu.bytes(),
                };
                assert!(
                    got == want.as_slice(),
                    "{tensors} tensors of {page} bytes, {direction:?} on {shape:?}: {} pieces from {} descriptors",
                    pieces.len(),
                    table.descs.len()
                );
            }
        }
    }
}
