//! Copy descriptors: `(src, dst, bytes)` triples, plain old data, one per
//! coalesced run of bytes. The same table feeds the host backend, DMA calls and
//! the CUDA kernels (`kernels/copy_blocks.cu` reads exactly this layout).

use bytemuck::{Pod, Zeroable};

use super::error::SpecError;
use super::layout::{TransferSpec, WorkerLayout};
use crate::Direction;

/// One contiguous copy. `#[repr(C)]`, 24 bytes, matches `CopyDesc` in the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Pod, Zeroable)]
#[repr(C)]
pub struct CopyDesc {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes to copy.
    pub bytes: u64,
}

/// Descriptors of one job and what they add up to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DescriptorTable {
    /// The descriptors, tensor-major, runs coalesced.
    pub descs: Vec<CopyDesc>,
    /// Total bytes.
    pub bytes: u64,
    /// Blocks in the spec.
    pub blocks: usize,
    /// Largest single descriptor.
    pub max_desc_bytes: u64,
}

impl DescriptorTable {
    /// The table as raw bytes (for a device upload).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.descs)
    }
}

/// Builds the descriptors for `spec` in `direction`, validating it first.
///
/// Stores copy GPU pages to host chunks, loads the reverse. For each KV group
/// (one without group spans), each of the group's tensors in slot order and
/// each block in logical order one descriptor is emitted; it is
/// merged into the previous one when both its source and destination continue
/// the previous run (adjacent blocks in adjacent sub-blocks).
pub fn plan(
    layout: &WorkerLayout,
    direction: Direction,
    spec: &TransferSpec,
    out: &mut DescriptorTable,
) -> Result<(), SpecError> {
    layout.validate(spec)?;
    out.descs.clear();
    out.bytes = 0;
    out.max_desc_bytes = 0;
    out.blocks = spec.gpu_blocks.len();
    let bpc = layout.row().blocks_per_chunk() as usize;
    for part in layout.parts(spec) {
        let skip = part.first_block_index as usize % bpc;
        for &t in part.tensors {
            let page = layout.gpu().regions()[t].page_bytes;
            for (k, &block) in part.blocks.iter().enumerate() {
                if block.0 == 0 {
                    // A hole (several groups only: `validate`).
                    continue;
                }
                let pos = skip + k;
                let chunk = part.chunks[pos / bpc];
                let sub = (pos % bpc) as u32;
                let gpu = layout.gpu_addr(t, block);
                let host = layout.host_addr(t, chunk, sub);
                let (src, dst) = match direction {
                    Direction::Store => (gpu, host),
                    Direction::Load => (host, gpu),
                };
                push_coalesced(
                    &mut out.descs,
                    CopyDesc {
                        src,
                        dst,
                        bytes: page,
                    },
                );
                out.bytes += page;
            }
        }
    }
    out.max_desc_bytes = out.descs.iter().map(|d| d.bytes).max().unwrap_or(0);
    Ok(())
}

/// Appends `d`, merging it into the last descriptor when it continues that run.
pub fn push_coalesced(descs: &mut Vec<CopyDesc>, d: CopyDesc) {
    if let Some(last) = descs.last_mut()
        && last.src + last.bytes == d.src
        && last.dst + last.bytes == d.dst
    {
        last.bytes += d.bytes;
        return;
    }
    descs.push(d);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::layout::{GpuLayout, HostRowLayout};

    fn layout(bpc: u32, stride: u64, page: u64) -> WorkerLayout {
        let gpu = GpuLayout::per_layer(&[0x10_0000, 0x20_0000], 64, stride, page).unwrap();
        let row = HostRowLayout::uniform(bpc, 2, &[page, page]).unwrap();
        WorkerLayout::new(gpu, row, 1, 0x100_0000, 16).unwrap()
    }

    #[test]
    fn desc_is_24_bytes() {
        assert_eq!(std::mem::size_of::<CopyDesc>(), 24);
    }

    #[test]
    fn adjacent_blocks_coalesce_into_one_run_per_tensor() {
        let l = layout(4, 256, 256);
        let mut t = DescriptorTable::default();
        plan(
            &l,
            Direction::Store,
            &TransferSpec::new(&[4, 5, 6, 7], 0, &[3]),
            &mut t,
        )
        .unwrap();
        assert_eq!(t.descs.len(), 2);
        assert_eq!(t.descs[0].bytes, 1024);
        assert_eq!(t.descs[0].src, 0x10_0000 + 4 * 256);
        let slot = l.slot();
        assert_eq!(
            t.descs[0].dst,
            0x100_0000 + 3 * l.row().row_bytes() + slot.offset
        );
        assert_eq!(t.bytes, 2048);
    }

    #[test]
    fn scattered_blocks_do_not_coalesce() {
        let l = layout(1, 512, 256);
        let mut t = DescriptorTable::default();
        plan(
            &l,
            Direction::Load,
            &TransferSpec::new(&[4, 5], 0, &[1, 2]),
            &mut t,
        )
        .unwrap();
        assert_eq!(t.descs.len(), 4);
        assert!(t.descs.iter().all(|d| d.bytes == 256));
        assert_eq!(t.descs[0].dst, 0x10_0000 + 4 * 512);
    }

    #[test]
    fn unaligned_first_block_skips_sub_blocks() {
        let l = layout(4, 256, 256);
        let mut t = DescriptorTable::default();
        plan(
            &l,
            Direction::Store,
            &TransferSpec::new(&[9, 10, 11], 6, &[2, 5]),
            &mut t,
        )
        .unwrap();
        // Logical 6, 7 -> chunk 2 subs 2, 3; logical 8 -> chunk 5 sub 0.
        assert_eq!(t.descs[0].dst, l.host_addr(0, crate::ids::ChunkId(2), 2));
        assert_eq!(t.descs[0].bytes, 512);
        assert_eq!(t.descs[1].dst, l.host_addr(0, crate::ids::ChunkId(5), 0));
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        let l = layout(2, 256, 256);
        let mut t = DescriptorTable::default();
        let mut check = |spec: TransferSpec| plan(&l, Direction::Store, &spec, &mut t).unwrap_err();
        assert_eq!(check(TransferSpec::new(&[], 0, &[])), SpecError::Empty);
        assert_eq!(
            check(TransferSpec::new(&[0, 1], 0, &[1])),
            SpecError::NullBlock { position: 0 }
        );
        assert!(matches!(
            check(TransferSpec::new(&[64, 1], 0, &[1])),
            SpecError::BlockOutOfRange { block: 64, .. }
        ));
        assert!(matches!(
            check(TransferSpec::new(&[3, 1], 0, &[16])),
            SpecError::ChunkOutOfRange { chunk: 16, .. }
        ));
        assert!(matches!(
            check(TransferSpec::new(&[3, 1], 1, &[1])),
            SpecError::ChunkCountMismatch {
                expected: 2,
                got: 1,
                ..
            }
        ));
    }

    proptest::proptest! {
        /// Coalesced descriptors move exactly the pages of the naive per-page mapping.
        #[test]
        #[cfg_attr(miri, ignore)] // proptest persistence needs the file system
        fn coalescing_preserves_the_page_mapping(
            layers in 1usize..4,
            page in 1u64..300,
            pad in 0u64..3,
            bpc in 1u32..5,
            workers in 1u32..4,
            first in 0u32..9,
            picks in proptest::collection::vec(1u32..40, 1..20),
            contiguous in proptest::bool::ANY,
            store in proptest::bool::ANY,
        ) {
            let stride = page * (1 + pad);
            let bases: Vec<u64> = (0..layers as u64).map(|l| 0x1000_0000 + l * 0x100_0000).collect();
            let gpu = GpuLayout::per_layer(&bases, 64, stride, page).unwrap();
            let row = HostRowLayout::uniform(bpc, workers, &vec![page; layers]).unwrap();
            let l = WorkerLayout::new(gpu, row, workers - 1, 0x8000_0000, 64).unwrap();
            let mut blocks: Vec<u32> = if contiguous {
                (picks[0]..picks[0] + picks.len() as u32).collect()
            } else {
                picks.clone()
            };
            blocks.sort_unstable();
            blocks.dedup();
            let need = ((first % bpc) as usize + blocks.len()).div_ceil(bpc as usize);
            let chunks: Vec<u32> = (0..need as u32).map(|c| (c * 7 + first) % 64).collect();
            let mut uniq = chunks.clone();
            uniq.sort_unstable();
            uniq.dedup();
            proptest::prop_assume!(uniq.len() == chunks.len());
            let spec = TransferSpec::new(&blocks, first, &chunks);
            let dir = if store { Direction::Store } else { Direction::Load };
            let mut t = DescriptorTable::default();
            plan(&l, dir, &spec, &mut t).unwrap();
            let skip = (first % bpc) as usize;
            let mut total = 0;
            for tensor in 0..layers {
                for (k, b) in spec.gpu_blocks.iter().enumerate() {
                    let pos = skip + k;
                    let g = l.gpu_addr(tensor, *b);
                    let h = l.host_addr(tensor, spec.chunks[pos / bpc as usize], (pos % bpc as usize) as u32);
                    let (src, dst) = if store { (g, h) } else { (h, g) };
                    let d = t.descs.iter().find(|d| d.dst <= dst && dst < d.dst + d.bytes).expect("page covered");
                    proptest::prop_assert!(dst + page <= d.dst + d.bytes);
                    proptest::prop_assert_eq!(d.src + (dst - d.dst), src);
                    total += page;
                }
            }
            proptest::prop_assert_eq!(t.bytes, total);
            proptest::prop_assert_eq!(t.descs.iter().map(|d| d.bytes).sum::<u64>(), total);
            proptest::prop_assert!(t.descs.len() <= layers * blocks.len());
        }
    }
}
