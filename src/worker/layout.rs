//! Memory layouts of the data plane: GPU KV pages, host chunk rows, and the
//! pairing of both for one worker.
//!
//! GPU side: one region per tensor. A per-layer cache has one region per layer
//! (one page per layer and block, K and V inside the page); a cross-layer cache
//! has a single region whose page holds every layer of a block. A region is a
//! base address, a block stride and the page bytes copied per block.
//!
//! Host side (vLLM's layout; `docs/dataplane.md`, "Layouts"): row = chunk; a row holds every
//! worker's slot back to back, padded to [`HOST_PAGE_BYTES`]; a slot holds the
//! worker's tensors in order, each `page_bytes x blocks_per_chunk` bytes.
//!
//! Addresses are plain `u64`: host virtual addresses for the host backend, CUDA
//! device pointers (unified addressing) for the CUDA backend.

use serde::{Deserialize, Serialize};

use crate::config::HOST_PAGE_BYTES;
use crate::ids::{ChunkId, GpuBlockId};

use super::backend::HostShare;
use super::error::{LayoutError, SpecError};

/// One GPU tensor: `num_blocks` pages at `base + block * block_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRegion {
    /// Address of block 0.
    pub base: u64,
    /// Bytes between consecutive blocks.
    pub block_stride: u64,
    /// Bytes copied per block (the unpadded page).
    pub page_bytes: u64,
}

/// How the GPU KV cache is organised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuLayoutKind {
    /// One region per layer; K and V inside each page.
    PerLayer,
    /// One region; each block holds every layer contiguously.
    CrossLayer,
}

/// The GPU KV cache of one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLayout {
    kind: GpuLayoutKind,
    regions: Vec<GpuRegion>,
    num_blocks: u32,
}

impl GpuLayout {
    /// A per-layer cache: one region per layer base, all with the same stride and page.
    pub fn per_layer(
        layer_bases: &[u64],
        num_blocks: u32,
        block_stride: u64,
        page_bytes: u64,
    ) -> Result<Self, LayoutError> {
        let regions = layer_bases
            .iter()
            .map(|&base| GpuRegion {
                base,
                block_stride,
                page_bytes,
            })
            .collect();
        Self::from_regions(GpuLayoutKind::PerLayer, regions, num_blocks)
    }

    /// A cross-layer cache: one region whose page is the whole block (all layers).
    pub fn cross_layer(
        base: u64,
        num_blocks: u32,
        block_stride: u64,
        block_bytes: u64,
    ) -> Result<Self, LayoutError> {
        let region = GpuRegion {
            base,
            block_stride,
            page_bytes: block_bytes,
        };
        Self::from_regions(GpuLayoutKind::CrossLayer, vec![region], num_blocks)
    }

    /// Any set of regions (for example layers with different page sizes).
    pub fn from_regions(
        kind: GpuLayoutKind,
        regions: Vec<GpuRegion>,
        num_blocks: u32,
    ) -> Result<Self, LayoutError> {
        if regions.is_empty() {
            return Err(LayoutError::NoRegions);
        }
        if num_blocks == 0 {
            return Err(LayoutError::NoBlocks);
        }
        for (i, r) in regions.iter().enumerate() {
            if r.page_bytes == 0 {
                return Err(LayoutError::ZeroPageBytes { region: i });
            }
            if r.page_bytes > r.block_stride {
                return Err(LayoutError::PageExceedsStride {
                    region: i,
                    page_bytes: r.page_bytes,
                    block_stride: r.block_stride,
                });
            }
            region_span(r, num_blocks)
                .and_then(|span| r.base.checked_add(span))
                .ok_or(LayoutError::Overflow("GPU region end"))?;
        }
        Ok(Self {
            kind,
            regions,
            num_blocks,
        })
    }

    /// Per-layer or cross-layer.
    pub fn kind(&self) -> GpuLayoutKind {
        self.kind
    }

    /// The regions (tensors), in host slot order.
    pub fn regions(&self) -> &[GpuRegion] {
        &self.regions
    }

    /// Blocks in the cache (block ids are `0..num_blocks`; 0 is the null block).
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Bytes moved per block, all regions together.
    pub fn bytes_per_block(&self) -> u64 {
        self.regions.iter().map(|r| r.page_bytes).sum()
    }

    /// `[start, end)` addresses of region `i`.
    pub fn region_range(&self, i: usize) -> Option<(u64, u64)> {
        let r = self.regions.get(i)?;
        let span = region_span(r, self.num_blocks)?;
        Some((r.base, r.base.checked_add(span)?))
    }
}

/// Bytes from a region's base to the end of its last page.
pub fn region_span(r: &GpuRegion, num_blocks: u32) -> Option<u64> {
    r.block_stride
        .checked_mul(u64::from(num_blocks.saturating_sub(1)))?
        .checked_add(r.page_bytes)
}

/// One worker's slot inside a host chunk row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotLayout {
    /// Offset of the slot inside the row.
    pub offset: u64,
    /// Page bytes of each tensor, in order.
    pub tensor_page_bytes: Vec<u64>,
    /// Offset of each tensor inside the slot (`page_bytes x blocks_per_chunk` each).
    pub tensor_offsets: Vec<u64>,
    /// Bytes of the slot.
    pub bytes: u64,
}

/// The layout of one host chunk row: every worker's slot, padded to the host page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRowLayout {
    blocks_per_chunk: u32,
    slots: Vec<SlotLayout>,
    row_bytes: u64,
}

impl HostRowLayout {
    /// A row for workers whose tensors have the given page sizes (`worker_pages[w][t]`).
    pub fn new(blocks_per_chunk: u32, worker_pages: &[Vec<u64>]) -> Result<Self, LayoutError> {
        if blocks_per_chunk == 0 {
            return Err(LayoutError::ZeroBlocksPerChunk);
        }
        if worker_pages.is_empty() {
            return Err(LayoutError::NoWorkers);
        }
        let bpc = u64::from(blocks_per_chunk);
        let overflow = LayoutError::Overflow("host row bytes");
        let mut offset = 0u64;
        let mut slots = Vec::with_capacity(worker_pages.len());
        for pages in worker_pages {
            let mut tensor_offsets = Vec::with_capacity(pages.len());
            let mut bytes = 0u64;
            for (t, &p) in pages.iter().enumerate() {
                if p == 0 {
                    return Err(LayoutError::ZeroPageBytes { region: t });
                }
                tensor_offsets.push(bytes);
                bytes = p
                    .checked_mul(bpc)
                    .and_then(|b| bytes.checked_add(b))
                    .ok_or(overflow.clone())?;
            }
            slots.push(SlotLayout {
                offset,
                tensor_page_bytes: pages.clone(),
                tensor_offsets,
                bytes,
            });
            offset = offset.checked_add(bytes).ok_or(overflow.clone())?;
        }
        let row_bytes = offset
            .max(1)
            .checked_next_multiple_of(HOST_PAGE_BYTES)
            .ok_or(overflow)?;
        Ok(Self {
            blocks_per_chunk,
            slots,
            row_bytes,
        })
    }

    /// A row for `num_workers` workers that all have the same tensors.
    pub fn uniform(
        blocks_per_chunk: u32,
        num_workers: u32,
        page_bytes: &[u64],
    ) -> Result<Self, LayoutError> {
        let pages = vec![page_bytes.to_vec(); num_workers as usize];
        Self::new(blocks_per_chunk, &pages)
    }

    /// GPU blocks per chunk.
    pub fn blocks_per_chunk(&self) -> u32 {
        self.blocks_per_chunk
    }

    /// Bytes of one row (the stride between chunks), a multiple of [`HOST_PAGE_BYTES`].
    pub fn row_bytes(&self) -> u64 {
        self.row_bytes
    }

    /// Worker slots in the row.
    pub fn num_workers(&self) -> u32 {
        self.slots.len() as u32
    }

    /// The slot of `worker`.
    pub fn slot(&self, worker: u32) -> Option<&SlotLayout> {
        self.slots.get(worker as usize)
    }

    /// Bytes of a pool of `num_chunks` rows.
    pub fn pool_bytes(&self, num_chunks: u32) -> Option<u64> {
        self.row_bytes.checked_mul(u64::from(num_chunks))
    }
}

/// Which GPU blocks move to or from which host chunks.
///
/// `gpu_blocks[k]` is logical block `first_block_index + k` of the request. With
/// `blocks_per_chunk = n`, the first `first_block_index % n` sub-blocks of the
/// first chunk are skipped (an unaligned start); `chunks` must hold exactly the
/// chunks the blocks fall into.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TransferSpec {
    /// GPU blocks, in logical order.
    pub gpu_blocks: Vec<GpuBlockId>,
    /// Logical index (within the request) of `gpu_blocks[0]` (with group
    /// spans unused: each span has its own).
    pub first_block_index: u32,
    /// Host chunk rows, in logical order.
    pub chunks: Vec<ChunkId>,
    /// A transfer over several KV groups: each group's part of the blocks
    /// and chunks, in group order ([`crate::scheduler::GroupSpan`]; group
    /// `g` moves the tensors [`WorkerLayout::with_groups`] gave it); empty
    /// for one group (then `first_block_index` applies to every block).
    /// With spans, a null block (0) is a hole: that sub-block is not copied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<crate::scheduler::GroupSpan>,
}

impl TransferSpec {
    /// A spec from raw ids.
    pub fn new(gpu_blocks: &[u32], first_block_index: u32, chunks: &[u32]) -> Self {
        Self {
            gpu_blocks: gpu_blocks.iter().map(|&b| GpuBlockId(b)).collect(),
            first_block_index,
            chunks: chunks.iter().map(|&c| ChunkId(c)).collect(),
            groups: Vec::new(),
        }
    }

    /// Per entry of `chunks`, whether the transfer moves all of that chunk:
    /// each of its `blocks_per_chunk` sub-blocks, none skipped by an
    /// unaligned start, a short end or (with group spans) a hole. A store
    /// leaves the rest of a partial chunk as the slot held it before.
    pub fn whole_chunks(&self, blocks_per_chunk: u32) -> Vec<bool> {
        let bpc = blocks_per_chunk.max(1) as usize;
        let spans: Vec<(usize, usize, u32)> = if self.groups.is_empty() {
            vec![(
                self.gpu_blocks.len(),
                self.chunks.len(),
                self.first_block_index,
            )]
        } else {
            self.groups
                .iter()
                .map(|g| {
                    (
                        g.num_blocks as usize,
                        g.num_keys as usize,
                        g.first_block_index,
                    )
                })
                .collect()
        };
        let mut whole = Vec::with_capacity(self.chunks.len());
        let mut at = 0;
        for (num_blocks, num_keys, first) in spans {
            let blocks = self.gpu_blocks.get(at..at + num_blocks).unwrap_or(&[]);
            at += num_blocks;
            let lead = first as usize % bpc;
            let mut moved = vec![0usize; num_keys];
            for (k, b) in blocks.iter().enumerate() {
                let hole = !self.groups.is_empty() && b.0 == 0;
                if let Some(n) = moved.get_mut((lead + k) / bpc).filter(|_| !hole) {
                    *n += 1;
                }
            }
            whole.extend(moved.iter().map(|&n| n == bpc));
        }
        whole
    }

    /// Chunks needed for these blocks with `blocks_per_chunk`.
    pub fn chunks_needed(&self, blocks_per_chunk: u32) -> usize {
        chunks_for(
            self.gpu_blocks.len(),
            self.first_block_index,
            blocks_per_chunk,
        )
    }
}

/// Chunks that `num_blocks` blocks from logical index `first_block_index`
/// fall into, `blocks_per_chunk` blocks a chunk (none for no block).
fn chunks_for(num_blocks: usize, first_block_index: u32, blocks_per_chunk: u32) -> usize {
    if num_blocks == 0 {
        return 0;
    }
    let bpc = blocks_per_chunk.max(1);
    ((first_block_index % bpc) as usize + num_blocks).div_ceil(bpc as usize)
}

/// One worker's view: its GPU cache paired with its slot in the host pool.
///
/// With several KV groups (vLLM's hybrid manager, [`Self::with_groups`]),
/// each group names the tensors its layers use; a chunk row holds one
/// group's key, so a transfer of group `g` moves only group `g`'s tensors of
/// each row (vLLM's layout: groups overlay the same tensors, so a row is
/// normally full whichever group it holds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLayout {
    gpu: GpuLayout,
    row: HostRowLayout,
    worker: u32,
    host_base: u64,
    num_chunks: u32,
    group_tensors: Vec<Vec<usize>>,
}

/// One KV group's part of a validated [`TransferSpec`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpecPart<'a> {
    /// The group's GPU blocks, in logical order.
    pub blocks: &'a [GpuBlockId],
    /// Logical index of `blocks[0]` (only its remainder by the chunk size matters).
    pub first_block_index: u32,
    /// The group's chunk rows.
    pub chunks: &'a [ChunkId],
    /// The tensors the group's layers use.
    pub tensors: &'a [usize],
}

/// The parts of a spec, one per KV group ([`WorkerLayout::parts`]).
pub(crate) struct SpecParts<'a> {
    layout: &'a WorkerLayout,
    spec: &'a TransferSpec,
    group: usize,
    block: usize,
    chunk: usize,
}

impl<'a> Iterator for SpecParts<'a> {
    type Item = SpecPart<'a>;

    fn next(&mut self) -> Option<SpecPart<'a>> {
        let spec = self.spec;
        let (num_blocks, num_keys, first) = if spec.groups.is_empty() {
            if self.group > 0 {
                return None;
            }
            (
                spec.gpu_blocks.len(),
                spec.chunks.len(),
                spec.first_block_index,
            )
        } else {
            let span = spec.groups.get(self.group)?;
            (
                span.num_blocks as usize,
                span.num_keys as usize,
                span.first_block_index,
            )
        };
        let tensors = self.layout.group_tensors.get(self.group)?;
        let blocks = spec.gpu_blocks.get(self.block..self.block + num_blocks)?;
        let chunks = spec.chunks.get(self.chunk..self.chunk + num_keys)?;
        self.group += 1;
        self.block += num_blocks;
        self.chunk += num_keys;
        Some(SpecPart {
            blocks,
            first_block_index: first,
            chunks,
            tensors,
        })
    }
}

impl WorkerLayout {
    /// Pairs `gpu` with slot `worker` of `row` in a pool of `num_chunks` rows at `host_base`.
    pub fn new(
        gpu: GpuLayout,
        row: HostRowLayout,
        worker: u32,
        host_base: u64,
        num_chunks: u32,
    ) -> Result<Self, LayoutError> {
        if num_chunks == 0 {
            return Err(LayoutError::NoChunks);
        }
        let slot = row.slot(worker).ok_or(LayoutError::WorkerOutOfRange {
            worker,
            num_workers: row.num_workers(),
        })?;
        if slot.tensor_page_bytes.len() != gpu.regions.len() {
            return Err(LayoutError::TensorCountMismatch {
                host: slot.tensor_page_bytes.len(),
                gpu: gpu.regions.len(),
            });
        }
        for (t, (h, g)) in slot
            .tensor_page_bytes
            .iter()
            .zip(gpu.regions.iter())
            .enumerate()
        {
            if *h != g.page_bytes {
                return Err(LayoutError::PageBytesMismatch {
                    tensor: t,
                    host: *h,
                    gpu: g.page_bytes,
                });
            }
        }
        row.pool_bytes(num_chunks)
            .and_then(|b| host_base.checked_add(b))
            .ok_or(LayoutError::Overflow("host pool end"))?;
        let group_tensors = vec![(0..gpu.regions.len()).collect()];
        Ok(Self {
            gpu,
            row,
            worker,
            host_base,
            num_chunks,
            group_tensors,
        })
    }

    /// The same layout for several KV groups: `group_tensors[g]` lists the
    /// tensors (regions, in slot order) of group `g`'s layers. A tensor may
    /// serve several groups (vLLM overlays the groups' layers); within a
    /// group each tensor appears once.
    pub fn with_groups(mut self, group_tensors: Vec<Vec<usize>>) -> Result<Self, LayoutError> {
        if group_tensors.is_empty() {
            return Err(LayoutError::NoGroups);
        }
        let tensors = self.gpu.regions.len();
        for (group, list) in group_tensors.iter().enumerate() {
            if list.is_empty() {
                return Err(LayoutError::EmptyGroup { group });
            }
            let mut seen = vec![false; tensors];
            for &tensor in list {
                match seen.get_mut(tensor) {
                    None => {
                        return Err(LayoutError::GroupTensorOutOfRange {
                            group,
                            tensor,
                            tensors,
                        });
                    }
                    Some(true) => return Err(LayoutError::GroupTensorRepeated { group, tensor }),
                    Some(s) => *s = true,
                }
            }
        }
        self.group_tensors = group_tensors;
        Ok(self)
    }

    /// The tensors of each KV group (one group of every tensor unless
    /// [`Self::with_groups`] said otherwise).
    pub fn group_tensors(&self) -> &[Vec<usize>] {
        &self.group_tensors
    }

    /// Each KV group's part of `spec` (one part for a spec without group
    /// spans); call after [`Self::validate`].
    pub(crate) fn parts<'a>(&'a self, spec: &'a TransferSpec) -> SpecParts<'a> {
        SpecParts {
            layout: self,
            spec,
            group: 0,
            block: 0,
            chunk: 0,
        }
    }

    /// The GPU side.
    pub fn gpu(&self) -> &GpuLayout {
        &self.gpu
    }

    /// The host row layout (all workers).
    pub fn row(&self) -> &HostRowLayout {
        &self.row
    }

    /// This worker's slot index.
    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// This worker's slot.
    pub fn slot(&self) -> &SlotLayout {
        // Checked in `new`.
        &self.row.slots[self.worker as usize]
    }

    /// Address of chunk row 0.
    pub fn host_base(&self) -> u64 {
        self.host_base
    }

    /// Chunk rows in the pool.
    pub fn num_chunks(&self) -> u32 {
        self.num_chunks
    }

    /// Where this worker's share of chunk row `chunk` lies (`None` past the
    /// pool's rows).
    pub fn host_share(&self, chunk: ChunkId) -> Option<HostShare> {
        if chunk.0 >= self.num_chunks {
            return None;
        }
        let slot = self.slot();
        let addr = self
            .row
            .row_bytes
            .checked_mul(u64::from(chunk.0))
            .and_then(|o| o.checked_add(slot.offset))
            .and_then(|o| o.checked_add(self.host_base))?;
        Some(HostShare {
            addr,
            len: usize::try_from(slot.bytes).ok()?,
        })
    }

    /// `[start, end)` of the whole host pool.
    pub fn host_range(&self) -> (u64, u64) {
        // Overflow checked in `new`.
        let bytes = self.row.row_bytes * u64::from(self.num_chunks);
        (self.host_base, self.host_base + bytes)
    }

    /// Checks a spec against this layout without building descriptors.
    pub fn validate(&self, spec: &TransferSpec) -> Result<(), SpecError> {
        if spec.gpu_blocks.is_empty() {
            return Err(SpecError::Empty);
        }
        let groups = self.group_tensors.len();
        let spec_groups = spec.groups.len().max(1);
        if spec_groups != groups {
            return Err(SpecError::GroupCountMismatch {
                layout: groups,
                spec: spec_groups,
            });
        }
        let bpc = self.row.blocks_per_chunk;
        if spec.groups.is_empty() {
            let expected = spec.chunks_needed(bpc);
            if spec.chunks.len() != expected {
                return Err(SpecError::ChunkCountMismatch {
                    group: 0,
                    blocks: spec.gpu_blocks.len(),
                    first_block_index: spec.first_block_index,
                    expected,
                    got: spec.chunks.len(),
                });
            }
        } else {
            let span_blocks: u64 = spec.groups.iter().map(|g| u64::from(g.num_blocks)).sum();
            let span_keys: u64 = spec.groups.iter().map(|g| u64::from(g.num_keys)).sum();
            if span_blocks != spec.gpu_blocks.len() as u64 || span_keys != spec.chunks.len() as u64
            {
                return Err(SpecError::GroupSpansMismatch {
                    blocks: spec.gpu_blocks.len(),
                    chunks: spec.chunks.len(),
                    span_blocks,
                    span_keys,
                });
            }
            for (group, g) in spec.groups.iter().enumerate() {
                let expected = chunks_for(g.num_blocks as usize, g.first_block_index, bpc);
                if g.num_keys as usize != expected {
                    return Err(SpecError::ChunkCountMismatch {
                        group,
                        blocks: g.num_blocks as usize,
                        first_block_index: g.first_block_index,
                        expected,
                        got: g.num_keys as usize,
                    });
                }
            }
        }
        for (position, b) in spec.gpu_blocks.iter().enumerate() {
            if b.0 == 0 {
                // With group spans a null block is a hole: its sub-block
                // is not copied (the scheduler keeps the blocks after it
                // in place).
                if !spec.groups.is_empty() {
                    continue;
                }
                return Err(SpecError::NullBlock { position });
            }
            if b.0 >= self.gpu.num_blocks {
                return Err(SpecError::BlockOutOfRange {
                    block: b.0,
                    num_blocks: self.gpu.num_blocks,
                });
            }
        }
        for c in &spec.chunks {
            if c.0 >= self.num_chunks {
                return Err(SpecError::ChunkOutOfRange {
                    chunk: c.0,
                    num_chunks: self.num_chunks,
                });
            }
        }
        Ok(())
    }

    /// GPU address of `block` in region `tensor` (unchecked ids; in range after `validate`).
    pub(crate) fn gpu_addr(&self, tensor: usize, block: GpuBlockId) -> u64 {
        let r = &self.gpu.regions[tensor];
        r.base + u64::from(block.0) * r.block_stride
    }

    /// Host address of sub-block `sub` of tensor `tensor` in `chunk`.
    pub(crate) fn host_addr(&self, tensor: usize, chunk: ChunkId, sub: u32) -> u64 {
        let slot = self.slot();
        self.host_base
            + u64::from(chunk.0) * self.row.row_bytes
            + slot.offset
            + slot.tensor_offsets[tensor]
            + u64::from(sub) * slot.tensor_page_bytes[tensor]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_is_padded_and_slots_follow_each_other() {
        let row = HostRowLayout::new(2, &[vec![100, 50], vec![100, 50]]).unwrap();
        assert_eq!(row.slot(0).unwrap().bytes, 300);
        assert_eq!(row.slot(1).unwrap().offset, 300);
        assert_eq!(row.slot(0).unwrap().tensor_offsets, vec![0, 200]);
        assert_eq!(row.row_bytes(), 4096);
        let big = HostRowLayout::uniform(4, 1, &[4096]).unwrap();
        assert_eq!(big.row_bytes(), 16384);
    }

    #[test]
    fn bad_layouts_are_typed_errors() {
        assert_eq!(
            GpuLayout::per_layer(&[], 4, 64, 64),
            Err(LayoutError::NoRegions)
        );
        assert_eq!(
            GpuLayout::per_layer(&[0], 0, 64, 64),
            Err(LayoutError::NoBlocks)
        );
        assert!(matches!(
            GpuLayout::per_layer(&[0], 4, 32, 64),
            Err(LayoutError::PageExceedsStride { .. })
        ));
        assert!(matches!(
            GpuLayout::per_layer(&[u64::MAX - 10], 4, 64, 64),
            Err(LayoutError::Overflow(_))
        ));
        assert_eq!(
            HostRowLayout::new(0, &[vec![1]]),
            Err(LayoutError::ZeroBlocksPerChunk)
        );
        let gpu = GpuLayout::per_layer(&[0, 4096], 4, 64, 64).unwrap();
        let row = HostRowLayout::uniform(1, 2, &[64]).unwrap();
        assert!(matches!(
            WorkerLayout::new(gpu.clone(), row, 0, 1 << 20, 4),
            Err(LayoutError::TensorCountMismatch { host: 1, gpu: 2 })
        ));
        let row = HostRowLayout::uniform(1, 2, &[64, 32]).unwrap();
        assert!(matches!(
            WorkerLayout::new(gpu.clone(), row.clone(), 0, 1 << 20, 4),
            Err(LayoutError::PageBytesMismatch { tensor: 1, .. })
        ));
        let row = HostRowLayout::uniform(1, 2, &[64, 64]).unwrap();
        assert!(matches!(
            WorkerLayout::new(gpu.clone(), row.clone(), 2, 1 << 20, 4),
            Err(LayoutError::WorkerOutOfRange { .. })
        ));
        assert_eq!(
            WorkerLayout::new(gpu, row, 0, 1 << 20, 0),
            Err(LayoutError::NoChunks)
        );
    }

    #[test]
    fn groups_name_existing_tensors_once_each() {
        let gpu = GpuLayout::per_layer(&[0, 4096], 4, 64, 64).unwrap();
        let row = HostRowLayout::uniform(1, 1, &[64, 64]).unwrap();
        let l = WorkerLayout::new(gpu, row, 0, 1 << 20, 4).unwrap();
        assert_eq!(l.group_tensors(), &[vec![0, 1]]);
        assert_eq!(l.clone().with_groups(vec![]), Err(LayoutError::NoGroups));
        assert_eq!(
            l.clone().with_groups(vec![vec![0, 1], vec![]]),
            Err(LayoutError::EmptyGroup { group: 1 })
        );
        assert_eq!(
            l.clone().with_groups(vec![vec![2]]),
            Err(LayoutError::GroupTensorOutOfRange {
                group: 0,
                tensor: 2,
                tensors: 2
            })
        );
        assert_eq!(
            l.clone().with_groups(vec![vec![1], vec![0, 1, 0]]),
            Err(LayoutError::GroupTensorRepeated {
                group: 1,
                tensor: 0
            })
        );
        let two = l.with_groups(vec![vec![0, 1], vec![1]]).unwrap();
        assert_eq!(two.group_tensors(), &[vec![0, 1], vec![1]]);
    }

    #[test]
    fn chunks_needed_counts_the_unaligned_start() {
        let spec = TransferSpec::new(&[1, 2, 3], 3, &[]);
        assert_eq!(spec.chunks_needed(4), 2);
        assert_eq!(spec.chunks_needed(1), 3);
        let spec = TransferSpec::new(&[1, 2, 3, 4], 4, &[]);
        assert_eq!(spec.chunks_needed(4), 1);
    }

    #[test]
    fn whole_chunks_leave_out_unaligned_starts_short_ends_and_holes() {
        // One group: blocks 1..=4 from logical block 1, chunks of two: the
        // first chunk misses its first sub-block, the last its second.
        let spec = TransferSpec::new(&[1, 2, 3, 4], 1, &[7, 8, 9]);
        assert_eq!(spec.whole_chunks(2), [false, true, false]);
        let spec = TransferSpec::new(&[1, 2, 3], 0, &[7, 8, 9]);
        assert_eq!(spec.whole_chunks(1), [true; 3]);
        // Two groups: group 0 whole; group 1 with a hole (null block 0) in
        // its first chunk.
        let mut spec = TransferSpec::new(&[1, 2, 0, 4, 5, 6], 0, &[7, 8, 9]);
        spec.groups = vec![
            crate::scheduler::GroupSpan {
                num_keys: 1,
                num_blocks: 2,
                first_block_index: 0,
            },
            crate::scheduler::GroupSpan {
                num_keys: 2,
                num_blocks: 4,
                first_block_index: 2,
            },
        ];
        assert_eq!(spec.whole_chunks(2), [true, false, true]);
    }
}
