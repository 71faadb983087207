//! The simulation's end-to-end content check: the bytes the workers move must
//! be the bytes the model computed.
//!
//! When the serving model computes a block, every worker writes the block's
//! bytes in its simulated GPU memory with a pattern derived from the block's
//! hash and the worker's rank ([`fill_pattern`]: a SplitMix64 value per
//! 64-byte line, spread over the line's eight words, so that any part of it
//! can be generated on its own). When a load completes (its blocks are then a
//! prefix hit) and when the GPU prefix cache hands a request cached blocks,
//! every worker compares the blocks with the pattern of the hash they must
//! hold. The comparison is sampled: the first and the last 64-byte line of
//! the block and [`RANDOM_LINES`] lines chosen from the hash
//! ([`sampled_lines`]); a copy that is missing, truncated, shifted, from the
//! wrong row or of the wrong worker fails it.
//!
//! Each worker thread owns its memory through a [`GpuMemory`] (a host buffer,
//! or a CUDA device buffer) and runs the check in lock step with its hooks
//! ([`super::WorkerCommand::content`]): checks before anything of the step
//! runs and writes after the step's transfers were waited for, both at points
//! where none of the worker's transfers is in flight.

use serde::Serialize;
use thiserror::Error;

use crate::ids::GpuBlockId;
use crate::key::BlockHash;
use crate::worker::HostBuffer;
use crate::worker::cuda::CudaError;

/// Bytes of one pattern line (the unit that is sampled).
pub const LINE_BYTES: usize = 64;

/// Pseudo-random lines checked per block, besides its first and last line.
pub const RANDOM_LINES: usize = 6;

/// Lines checked per block (at most; a small block has fewer).
pub const SAMPLED_LINES: usize = 2 + RANDOM_LINES;

/// Mismatches a worker describes per step (the others are only counted).
const MAX_DESCRIBED: usize = 8;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Per-word constants that make the eight words of a line differ.
const WORD_SALT: [u64; 8] = [
    0,
    0xD6E8_FEB8_6659_FD93,
    0xA076_1D64_78BD_642F,
    0xE703_7ED1_A0B4_28DB,
    0x8EBC_6AF0_9C88_C6E3,
    0x5899_65CC_7537_4CC3,
    0x1D8E_4E27_C47D_124F,
    0xC2B2_AE3D_27D4_EB4F,
];

/// The SplitMix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of the pattern of `hash` on worker `rank`.
pub fn pattern_seed(hash: BlockHash, rank: u32) -> u64 {
    mix(hash.0 ^ mix(u64::from(rank).wrapping_add(GAMMA)))
}

/// Fills `out` with the pattern of `seed` from byte `line * LINE_BYTES` of the
/// block on (`out` starts on a line boundary; its last line may be partial).
pub fn fill_pattern(seed: u64, line: usize, out: &mut [u8]) {
    for (i, chunk) in out.chunks_mut(LINE_BYTES).enumerate() {
        let key = mix(seed.wrapping_add(((line + i) as u64 + 1).wrapping_mul(GAMMA)));
        if chunk.len() == LINE_BYTES {
            for (w, salt) in chunk.chunks_exact_mut(8).zip(WORD_SALT) {
                w.copy_from_slice(&(key ^ salt).to_le_bytes());
            }
        } else {
            for (w, salt) in chunk.chunks_mut(8).zip(WORD_SALT) {
                let bytes = (key ^ salt).to_le_bytes();
                w.copy_from_slice(&bytes[..w.len()]);
            }
        }
    }
}

/// The lines of a block of `lines` lines that are checked: the first, the
/// last, then [`RANDOM_LINES`] drawn from `seed` (repeats possible).
pub fn sampled_lines(seed: u64, lines: usize) -> [usize; SAMPLED_LINES] {
    let mut out = [0usize; SAMPLED_LINES];
    let n = lines.max(1) as u64;
    out[1] = (n - 1) as usize;
    for (k, slot) in out.iter_mut().enumerate().skip(2) {
        *slot = (mix(seed ^ (k as u64).wrapping_mul(GAMMA)) % n) as usize;
    }
    out
}

/// Why the content check could not read or write a worker's memory.
#[derive(Debug, Error)]
pub enum ContentError {
    /// A block outside the worker's memory.
    #[error("block {block} is outside the simulated GPU memory ({blocks} blocks)")]
    OutOfRange {
        /// The block.
        block: u32,
        /// Blocks in the memory.
        blocks: u64,
    },
    /// The device memory could not be read or written.
    #[error("cuda: {0}")]
    Cuda(#[from] CudaError),
}

/// A worker's simulated GPU memory, as the content check writes and reads it.
pub trait GpuMemory: Send {
    /// Bytes of the memory.
    fn len(&self) -> usize;

    /// Always false (the memory holds the pool's blocks).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills the `len` bytes at byte `offset` with `fill` (in place where the
    /// memory allows it).
    ///
    /// # Safety
    /// No transfer in flight may read or write these bytes; the range is in
    /// bounds.
    unsafe fn fill(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), ContentError>;

    /// Reads the 64-byte lines `lines` (line indices) of the block of
    /// `block_bytes` bytes at byte `base` into `out` (cleared first), one
    /// after the other; a partial last line of the block is read as far as
    /// the block goes.
    ///
    /// # Safety
    /// No transfer in flight may write these bytes; the block is in bounds.
    unsafe fn read_lines(
        &mut self,
        base: usize,
        block_bytes: usize,
        lines: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<(), ContentError>;
}

/// A [`HostBuffer`] standing in for a worker's GPU memory (the host backend).
#[derive(Debug)]
pub struct HostGpuMemory {
    buf: std::sync::Arc<HostBuffer>,
}

impl HostGpuMemory {
    /// The memory of `buf` (shared with the worker's backend, which copies from
    /// and into it).
    pub fn new(buf: std::sync::Arc<HostBuffer>) -> Self {
        Self { buf }
    }
}

impl GpuMemory for HostGpuMemory {
    fn len(&self) -> usize {
        self.buf.len()
    }

    unsafe fn fill(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), ContentError> {
        // SAFETY: in bounds and no transfer in flight on these bytes (this
        // function's contract, upheld by the worker loop's ordering); nothing
        // else touches them while `fill` runs (this thread does only that).
        unsafe { self.buf.with_bytes_mut(offset, len, |b| fill(b)) };
        Ok(())
    }

    unsafe fn read_lines(
        &mut self,
        base: usize,
        block_bytes: usize,
        lines: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<(), ContentError> {
        out.clear();
        for &l in lines {
            let start = l * LINE_BYTES;
            let len = LINE_BYTES.min(block_bytes.saturating_sub(start));
            let at = out.len();
            out.resize(at + len, 0);
            // SAFETY: inside the block (`start + len <= block_bytes`), the
            // block in bounds, and no transfer in flight writes it (this
            // function's contract).
            unsafe { self.buf.read_into(base + start, &mut out[at..]) };
        }
        Ok(())
    }
}

/// Why a block is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    /// A load that completed: its blocks are a prefix hit.
    Load,
    /// A hit in the GPU prefix cache (a cached block handed to a request).
    PrefixHit,
}

impl CheckKind {
    /// `load` or `prefix hit`.
    pub fn name(self) -> &'static str {
        match self {
            CheckKind::Load => "load",
            CheckKind::PrefixHit => "prefix hit",
        }
    }
}

/// A block that must hold the pattern of `hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCheck {
    /// The GPU block.
    pub block: GpuBlockId,
    /// The hash whose pattern it must hold.
    pub hash: BlockHash,
    /// Why it is checked.
    pub kind: CheckKind,
}

/// What one worker does to its GPU memory for the content check in one step.
#[derive(Debug, Clone, Default)]
pub struct ContentOps {
    /// Blocks to compare with their pattern, before anything of the step runs.
    pub check: Vec<BlockCheck>,
    /// Blocks computed in the step, written with their pattern once the step's
    /// transfers were waited for (before a store of the next step reads them).
    pub write: Vec<(GpuBlockId, BlockHash)>,
    /// Test hook: flip byte 0 of every block written in the step, after
    /// writing it (a check of such a block must then fail).
    #[doc(hidden)]
    pub corrupt_written: bool,
}

impl ContentOps {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.check.is_empty() && self.write.is_empty()
    }
}

/// A block that did not hold its pattern, on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMismatch {
    /// The check.
    pub check: BlockCheck,
    /// The first differing byte, from the block's start.
    pub offset: u64,
}

/// What one worker's content check did in one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContentResult {
    /// Blocks compared.
    pub checked: u64,
    /// Blocks written.
    pub written: u64,
    /// Blocks that did not hold their pattern.
    pub mismatches: u64,
    /// The first few of them.
    pub described: Vec<BlockMismatch>,
}

/// A worker's side of the content check: its memory and scratch buffers.
pub struct ContentChecker {
    memory: Box<dyn GpuMemory>,
    rank: u32,
    block_bytes: usize,
    blocks: u64,
    got: Vec<u8>,
    want: Vec<u8>,
}

impl std::fmt::Debug for ContentChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContentChecker")
            .field("rank", &self.rank)
            .field("block_bytes", &self.block_bytes)
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl ContentChecker {
    /// The check of worker `rank` over `memory`, which holds blocks of
    /// `block_bytes` bytes one after the other (a cross-layer layout).
    pub fn new(memory: Box<dyn GpuMemory>, rank: u32, block_bytes: u64) -> Self {
        let block_bytes = usize::try_from(block_bytes).unwrap_or(usize::MAX).max(1);
        let blocks = (memory.len() / block_bytes) as u64;
        Self {
            memory,
            rank,
            block_bytes,
            blocks,
            got: Vec::new(),
            want: Vec::new(),
        }
    }

    fn base(&self, block: GpuBlockId) -> Result<usize, ContentError> {
        if u64::from(block.0) >= self.blocks {
            return Err(ContentError::OutOfRange {
                block: block.0,
                blocks: self.blocks,
            });
        }
        Ok(block.0 as usize * self.block_bytes)
    }

    /// Runs `ops.check` (the writes are [`Self::write`]'s).
    ///
    /// # Safety
    /// No transfer in flight may write the checked blocks.
    pub unsafe fn check(&mut self, ops: &ContentOps) -> Result<ContentResult, ContentError> {
        let mut r = ContentResult::default();
        let lines = self.block_bytes.div_ceil(LINE_BYTES);
        for c in &ops.check {
            let base = self.base(c.block)?;
            let seed = pattern_seed(c.hash, self.rank);
            let picked = sampled_lines(seed, lines);
            // SAFETY: the block is in bounds (`base`); no transfer writes it
            // (this function's contract).
            unsafe {
                self.memory
                    .read_lines(base, self.block_bytes, &picked, &mut self.got)?
            };
            self.want.clear();
            for &l in &picked {
                let len = LINE_BYTES.min(self.block_bytes - l * LINE_BYTES);
                let at = self.want.len();
                self.want.resize(at + len, 0);
                fill_pattern(seed, l, &mut self.want[at..]);
            }
            r.checked += 1;
            if self.got != self.want {
                r.mismatches += 1;
                if r.described.len() < MAX_DESCRIBED {
                    r.described.push(BlockMismatch {
                        check: *c,
                        offset: first_difference(&picked, self.block_bytes, &self.got, &self.want),
                    });
                }
            }
        }
        Ok(r)
    }

    /// Runs `ops.write` (and the corruption test hook), adding to `r`.
    ///
    /// # Safety
    /// No transfer in flight may read or write the written blocks.
    pub unsafe fn write(
        &mut self,
        ops: &ContentOps,
        r: &mut ContentResult,
    ) -> Result<(), ContentError> {
        for &(block, hash) in &ops.write {
            let base = self.base(block)?;
            let seed = pattern_seed(hash, self.rank);
            let mut pattern = |bytes: &mut [u8]| {
                fill_pattern(seed, 0, bytes);
                if ops.corrupt_written
                    && let Some(b) = bytes.first_mut()
                {
                    *b ^= 0xFF;
                }
            };
            // SAFETY: the block is in bounds (`base`); no transfer reads or
            // writes it (this function's contract).
            unsafe { self.memory.fill(base, self.block_bytes, &mut pattern)? };
            r.written += 1;
        }
        Ok(())
    }
}

/// The offset in the block of the first byte where `got` and `want` (the
/// sampled `lines`, one after the other) differ.
fn first_difference(lines: &[usize], block_bytes: usize, got: &[u8], want: &[u8]) -> u64 {
    let mut at = 0usize;
    let mut first = u64::MAX;
    for &l in lines {
        let len = LINE_BYTES.min(block_bytes - l * LINE_BYTES);
        let (g, w) = (&got[at..at + len], &want[at..at + len]);
        if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
            first = first.min((l * LINE_BYTES + i) as u64);
        }
        at += len;
    }
    if first == u64::MAX { 0 } else { first }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn checker(blocks: usize, block_bytes: usize, rank: u32) -> (ContentChecker, Arc<HostBuffer>) {
        let buf = Arc::new(HostBuffer::new(blocks * block_bytes).unwrap());
        let mem = HostGpuMemory::new(Arc::clone(&buf));
        (
            ContentChecker::new(Box::new(mem), rank, block_bytes as u64),
            buf,
        )
    }

    fn ops_write(pairs: &[(u32, u64)]) -> ContentOps {
        ContentOps {
            write: pairs
                .iter()
                .map(|&(b, h)| (GpuBlockId(b), BlockHash(h)))
                .collect(),
            ..ContentOps::default()
        }
    }

    fn ops_check(pairs: &[(u32, u64)]) -> ContentOps {
        ContentOps {
            check: pairs
                .iter()
                .map(|&(b, h)| BlockCheck {
                    block: GpuBlockId(b),
                    hash: BlockHash(h),
                    kind: CheckKind::Load,
                })
                .collect(),
            ..ContentOps::default()
        }
    }

    #[test]
    fn patterns_depend_on_hash_rank_and_position_and_parts_match_the_whole() {
        let mut whole = vec![0u8; 1000];
        fill_pattern(pattern_seed(BlockHash(7), 0), 0, &mut whole);
        let mut part = vec![0u8; 1000 - 3 * LINE_BYTES];
        fill_pattern(pattern_seed(BlockHash(7), 0), 3, &mut part);
        assert_eq!(&whole[3 * LINE_BYTES..], &part[..]);
        let mut other = vec![0u8; 1000];
        fill_pattern(pattern_seed(BlockHash(7), 1), 0, &mut other);
        assert_ne!(whole, other, "rank changes the pattern");
        fill_pattern(pattern_seed(BlockHash(8), 0), 0, &mut other);
        assert_ne!(whole, other, "hash changes the pattern");
        // No two 8-byte words of a block repeat (a shifted copy cannot pass).
        let words: std::collections::HashSet<&[u8]> = whole.chunks_exact(8).collect();
        assert_eq!(words.len(), 1000 / 8);
    }

    #[test]
    fn sampled_lines_include_the_first_and_last_and_stay_in_the_block() {
        for lines in [1, 2, 3, 256] {
            for seed in 0..50 {
                let s = sampled_lines(seed, lines);
                assert_eq!(s[0], 0);
                assert_eq!(s[1], lines - 1);
                assert!(s.iter().all(|&l| l < lines));
            }
        }
    }

    #[test]
    fn written_blocks_pass_their_check_and_fail_another_hash_or_rank() {
        // A block size that is not a whole number of lines.
        let (mut c, buf) = checker(4, 1000, 1);
        let mut r = ContentResult::default();
        // SAFETY: no transfers exist in these tests.
        unsafe {
            c.write(&ops_write(&[(1, 11), (2, 22)]), &mut r).unwrap();
            assert_eq!(r.written, 2);
            let ok = c.check(&ops_check(&[(1, 11), (2, 22)])).unwrap();
            assert_eq!((ok.checked, ok.mismatches), (2, 0));
            let bad = c.check(&ops_check(&[(1, 22), (3, 11)])).unwrap();
            assert_eq!((bad.checked, bad.mismatches), (2, 2));
            assert_eq!(bad.described[0].check.block, GpuBlockId(1));
            assert_eq!(bad.described[0].offset, 0);
            // Worker 0 reading worker 1's bytes: a mismatch.
            let mut rank0 =
                ContentChecker::new(Box::new(HostGpuMemory::new(Arc::clone(&buf))), 0, 1000);
            assert_eq!(rank0.check(&ops_check(&[(1, 11)])).unwrap().mismatches, 1);
            // One wrong byte in the last (partial) line is seen.
            buf.write(2 * 1000 + 999, &[buf.read(2 * 1000 + 999, 1)[0] ^ 1]);
            let one = c.check(&ops_check(&[(2, 22)])).unwrap();
            assert_eq!(one.mismatches, 1);
            assert_eq!(one.described[0].offset, 999);
        }
    }

    #[test]
    fn the_corruption_hook_makes_the_check_fail_and_blocks_out_of_range_are_errors() {
        let (mut c, _buf) = checker(4, 4096, 0);
        let mut r = ContentResult::default();
        let mut ops = ops_write(&[(1, 5)]);
        ops.corrupt_written = true;
        // SAFETY: no transfers exist in this test.
        unsafe {
            c.write(&ops, &mut r).unwrap();
            assert_eq!(c.check(&ops_check(&[(1, 5)])).unwrap().mismatches, 1);
            assert!(matches!(
                c.check(&ops_check(&[(4, 5)])),
                Err(ContentError::OutOfRange { block: 4, .. })
            ));
            assert!(c.write(&ops_write(&[(9, 5)]), &mut r).is_err());
        }
    }
}
