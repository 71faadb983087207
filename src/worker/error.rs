//! Typed errors of the data plane: layout construction, transfer specs, backends.

use thiserror::Error;

use crate::ids::JobId;

use crate::Direction;

/// A layout (GPU pages or host chunk rows) that cannot describe real memory.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// A GPU layout needs at least one region (tensor).
    #[error("a GPU layout needs at least one region")]
    NoRegions,
    /// A GPU layout needs at least one block.
    #[error("a GPU layout needs at least one block")]
    NoBlocks,
    /// A page (bytes copied per block and region) must not be empty.
    #[error("region {region}: page bytes must be at least 1")]
    ZeroPageBytes {
        /// Index of the offending region (tensor).
        region: usize,
    },
    /// A page must fit inside the block stride, or blocks would overlap.
    #[error("region {region}: page of {page_bytes} bytes exceeds the block stride {block_stride}")]
    PageExceedsStride {
        /// Index of the offending region.
        region: usize,
        /// Page bytes.
        page_bytes: u64,
        /// Block stride in bytes.
        block_stride: u64,
    },
    /// `blocks_per_chunk` must be at least 1.
    #[error("blocks_per_chunk must be at least 1")]
    ZeroBlocksPerChunk,
    /// A host row needs at least one worker slot.
    #[error("a host row needs at least one worker slot")]
    NoWorkers,
    /// The host pool needs at least one chunk row.
    #[error("the host pool needs at least one chunk")]
    NoChunks,
    /// The worker index is not one of the row's slots.
    #[error("worker {worker} out of range: the row has {num_workers} slots")]
    WorkerOutOfRange {
        /// Requested worker.
        worker: u32,
        /// Slots in the row.
        num_workers: u32,
    },
    /// The worker's host slot does not hold the same tensors as its GPU layout.
    #[error("the host slot holds {host} tensors but the GPU layout has {gpu} regions")]
    TensorCountMismatch {
        /// Tensors in the host slot.
        host: usize,
        /// Regions in the GPU layout.
        gpu: usize,
    },
    /// A host tensor's page size differs from the GPU region's page size.
    #[error("tensor {tensor}: host page {host} bytes, GPU page {gpu} bytes")]
    PageBytesMismatch {
        /// Tensor index.
        tensor: usize,
        /// Host page bytes.
        host: u64,
        /// GPU page bytes.
        gpu: u64,
    },
    /// A layout of KV groups needs at least one group.
    #[error("a layout of KV groups needs at least one group")]
    NoGroups,
    /// A KV group must use at least one tensor.
    #[error("KV group {group} names no tensor")]
    EmptyGroup {
        /// The group.
        group: usize,
    },
    /// A KV group names a tensor the GPU layout does not have.
    #[error("KV group {group} names tensor {tensor}; the GPU layout has {tensors}")]
    GroupTensorOutOfRange {
        /// The group.
        group: usize,
        /// The tensor named.
        tensor: usize,
        /// Tensors (regions) in the GPU layout.
        tensors: usize,
    },
    /// A KV group names one tensor twice (its bytes would move twice).
    #[error("KV group {group} names tensor {tensor} twice")]
    GroupTensorRepeated {
        /// The group.
        group: usize,
        /// The tensor.
        tensor: usize,
    },
    /// Address arithmetic overflowed 64 bits.
    #[error("layout arithmetic overflows: {0}")]
    Overflow(&'static str),
    /// The host pool overlaps a GPU region (copies would alias).
    #[error("the host pool overlaps GPU region {region}")]
    PoolOverlapsGpu {
        /// The overlapping region.
        region: usize,
    },
    /// Memory named by the layout is not inside any buffer given to the backend.
    #[error("{what} [{start:#x}, {end:#x}) is not inside any buffer given to the backend")]
    OutsideBuffers {
        /// What was checked ("GPU region 3", "host pool").
        what: String,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
}

/// A transfer spec that does not fit the layout: refused before any byte moves.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    /// A transfer must move at least one block.
    #[error("a transfer must name at least one GPU block")]
    Empty,
    /// The spec names another number of KV groups than the layout has.
    #[error("the transfer names {spec} KV groups; this worker's layout has {layout}")]
    GroupCountMismatch {
        /// Groups in the worker's layout.
        layout: usize,
        /// Groups in the spec (1 without group spans).
        spec: usize,
    },
    /// The group spans do not add up to the spec's blocks and chunks.
    #[error(
        "the group spans add up to {span_blocks} blocks and {span_keys} chunks; \
         the transfer has {blocks} blocks and {chunks} chunks"
    )]
    GroupSpansMismatch {
        /// Blocks in the spec.
        blocks: usize,
        /// Chunks in the spec.
        chunks: usize,
        /// Blocks the spans add up to.
        span_blocks: u64,
        /// Chunks the spans add up to.
        span_keys: u64,
    },
    /// GPU block 0 is the null block, never stored or loaded.
    #[error("GPU block at position {position} is the null block 0")]
    NullBlock {
        /// Position in the spec's block list.
        position: usize,
    },
    /// A GPU block id beyond the GPU layout.
    #[error("GPU block {block} out of range: the layout has {num_blocks} blocks")]
    BlockOutOfRange {
        /// Offending block id.
        block: u32,
        /// Blocks in the layout.
        num_blocks: u32,
    },
    /// A chunk id beyond the host pool.
    #[error("chunk {chunk} out of range: the pool has {num_chunks} chunks")]
    ChunkOutOfRange {
        /// Offending chunk id.
        chunk: u32,
        /// Chunks in the pool.
        num_chunks: u32,
    },
    /// The number of chunks does not match the blocks (with the unaligned first block).
    #[error(
        "group {group}: {blocks} blocks from logical index {first_block_index} need {expected} chunks, got {got}"
    )]
    ChunkCountMismatch {
        /// The KV group (0 for a spec of one group).
        group: usize,
        /// Blocks in the spec.
        blocks: usize,
        /// Logical index of the first block.
        first_block_index: u32,
        /// Chunks needed.
        expected: usize,
        /// Chunks given.
        got: usize,
    },
    /// The descriptor table would exceed a backend's fixed capacity.
    #[error("{descriptors} descriptors exceed the capacity {capacity}")]
    TooManyDescriptors {
        /// Descriptors needed.
        descriptors: usize,
        /// Capacity.
        capacity: usize,
    },
}

/// An error of a transfer backend.
#[derive(Debug, Error)]
pub enum BackendError {
    /// The spec was refused.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The job id is already in flight on this backend.
    #[error("{0} is already in flight")]
    DuplicateJob(JobId),
    /// The copy thread of a direction is gone (it panicked or was shut down).
    #[error("the {0} copy thread is gone")]
    WorkerGone(Direction),
    /// `wait` gave up before these jobs finished.
    #[error("wait timed out with {} jobs still in flight", pending.len())]
    WaitTimedOut {
        /// Jobs still in flight.
        pending: Vec<JobId>,
    },
    /// The CUDA backend failed.
    #[error(transparent)]
    Cuda(#[from] super::cuda::CudaError),
}
