//! Copy descriptors: `(src, dst, bytes)` triples, plain old data, one per
//! coalesced run of bytes. The same table feeds the host backend, DMA calls and
//! the CUDA kernels (`kernels/copy_blocks.cu` reads exactly this layout).

use bytemuck::{Pod, Zeroable};

use super::backend::Direction;
use super::error::SpecError;
use super::layout::{TransferSpec, WorkerLayout};

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
/// Stores copy GPU pages to host chunks, loads the reverse. For each tensor in
/// slot order and each block in logical order one descriptor is emitted; it is
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
    let bpc = layout.row().blocks_per_chunk();
    let skip = spec.first_block_index % bpc;
    let tensors = layout.gpu().regions().len();
    for t in 0..tensors {
        let page = layout.gpu().regions()[t].page_bytes;
        for (k, &block) in spec.gpu_blocks.iter().enumerate() {
            let pos = skip as usize + k;
            let chunk = spec.chunks[pos / bpc as usize];
            let sub = (pos % bpc as usize) as u32;
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
}
