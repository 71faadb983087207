//! What a CUDA sweep measures: block sizes, counts, layouts, strategies,
//! and the variants of the backend's options (`--sweep-launch`,
//! `--sweep-batch-overlap`, `--sweep-ring`).

use crate::Direction;
use crate::worker::cuda::Strategy;
use crate::worker::numa::HostPlacement;

/// Jobs in flight together in a ring-depth measurement.
pub const PIPELINE: u32 = 16;
/// The ring depths `--sweep-ring` measures.
pub const STANDARD_RING_DEPTHS: [usize; 4] = [2, 4, 8, 16];

/// A kernel launch shape other than the default, measured with the
/// `kernel` strategy (`--sweep-launch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchVariant {
    /// CTAs of the copy kernel's grid.
    pub ctas: u32,
    /// Largest piece a descriptor is split into (`kernel_split_bytes`).
    pub max_piece_bytes: u64,
}

impl LaunchVariant {
    /// `ctas=N,piece=BYTES`.
    pub fn label(&self) -> String {
        format!("ctas={},piece={}", self.ctas, self.max_piece_bytes)
    }

    /// The variants `--sweep-launch` measures: 4 … 64 CTAs, 16 … 256 KiB
    /// pieces.
    pub fn standard() -> Vec<Self> {
        let mut v = Vec::new();
        for ctas in [4, 16, 32, 64] {
            for max_piece_bytes in [16 << 10, 64 << 10, 256 << 10] {
                v.push(Self {
                    ctas,
                    max_piece_bytes,
                });
            }
        }
        v
    }
}

/// What to sweep on the CUDA backend.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaSweep {
    /// Device ordinal.
    pub device: usize,
    /// Block sizes in bytes.
    pub block_bytes: Vec<u64>,
    /// Blocks per job.
    pub blocks: Vec<u32>,
    /// Tensors a block is split over: 1 is a cross-layer cache (one
    /// descriptor per block), `n` a per-layer cache of `n` tensors (`n`
    /// descriptors of `block_bytes / n` per block).
    pub tensors: Vec<u32>,
    /// Directions.
    pub directions: Vec<Direction>,
    /// Strategies (each point is measured with each, forced).
    pub strategies: Vec<Strategy>,
    /// Jobs per (point, strategy); the fastest counts.
    pub reps: u32,
    /// Size of the pinned pool and of the ceiling memcpy; points moving more
    /// bytes per job are skipped.
    pub max_job_bytes: u64,
    /// Points with more descriptors per job are skipped (per-run DMA of
    /// very many descriptors only measures the driver's call cost).
    pub max_descriptors: u64,
    /// Check every job's bytes against a pattern (the strategy's last job
    /// per point).
    pub verify: bool,
    /// Also measure each strategy beside a train of compute kernels: the
    /// copies' rate under contention and the model's slowdown.
    pub contend: bool,
    /// Other kernel launch shapes, measured with the `kernel` strategy on
    /// cross-layer points of at most 1,024 blocks.
    pub launches: Vec<LaunchVariant>,
    /// Also measure `batch_dma` with the driver asked to overlap the copies
    /// with compute (`CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`), on the
    /// same points as `launches`.
    pub batch_prefer_overlap: bool,
    /// Descriptor-table ring depths to measure with `kernel_graph` jobs
    /// pipelined ([`PIPELINE`] in flight before the first is waited for),
    /// on the same points as `launches`.
    pub ring_depths: Vec<usize>,
    /// Where the pinned pool goes (`auto`: the device's NUMA node where the
    /// machine has several); a node number measures the copies from there.
    pub numa: HostPlacement,
}

impl Default for CudaSweep {
    /// 4 KiB … 2 MiB per block, 64 … 4096 blocks, cross-layer and 16
    /// tensors per block, both directions, every strategy, best of 7, a 1 GiB
    /// pool and ceiling copy, bytes verified, no contention, no other shapes.
    fn default() -> Self {
        Self {
            device: 0,
            block_bytes: vec![
                4 << 10,
                16 << 10,
                32 << 10,
                64 << 10,
                256 << 10,
                1 << 20,
                2 << 20,
            ],
            blocks: vec![64, 256, 1024, 4096],
            tensors: vec![1, 16],
            directions: Direction::ALL.to_vec(),
            strategies: Strategy::ALL.to_vec(),
            reps: 7,
            max_job_bytes: 1 << 30,
            max_descriptors: 16_384,
            verify: true,
            contend: false,
            launches: Vec::new(),
            batch_prefer_overlap: false,
            ring_depths: Vec::new(),
            numa: HostPlacement::Auto,
        }
    }
}

impl CudaSweep {
    /// A short sweep (4 sizes, 2 counts, best of 3).
    pub fn quick() -> Self {
        Self {
            block_bytes: vec![4 << 10, 16 << 10, 64 << 10, 2 << 20],
            blocks: vec![64, 1024],
            reps: 3,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_variants_are_labelled_and_the_standard_set_is_complete() {
        let v = LaunchVariant::standard();
        assert_eq!(v.len(), 12);
        assert!(v.iter().all(|l| l.ctas > 0 && l.max_piece_bytes >= 16));
        assert_eq!(v[0].label(), "ctas=4,piece=16384");
    }
}
