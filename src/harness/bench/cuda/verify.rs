//! Byte checks of the CUDA sweep. A point's source side is filled with a
//! pattern that is a function of each byte's offset in its buffer (GPU
//! blocks for stores, the pinned pool for loads); the destination is cleared
//! before each strategy's jobs; afterwards every byte the job's descriptors
//! name is compared with the pattern at its source offset. A strategy that
//! copied nothing, the wrong bytes, or to the wrong place fails its point.

use crate::worker::CopyDesc;

/// Pattern seed of the GPU side (the sources of stores).
pub const GPU_SEED: u64 = 0x6b76_6f66_666c_6f61;
/// Pattern seed of the pinned pool (the sources of loads).
pub const POOL_SEED: u64 = 0x706f_6f6c_7365_6564;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `index` of the pattern seeded with `seed`.
fn word(seed: u64, index: u64) -> u64 {
    splitmix64(seed ^ index.wrapping_mul(0x2545_f491_4f6c_dd1d))
}

/// Writes into `out` the pattern bytes `[offset, offset + len)` of a buffer
/// seeded with `seed` (byte `o` is byte `o % 8` of word `o / 8`).
pub fn pattern_into(seed: u64, offset: u64, len: usize, out: &mut Vec<u8>) {
    let skip = (offset % 8) as usize;
    let first = offset / 8;
    let words = (skip + len).div_ceil(8);
    out.clear();
    out.resize(words * 8, 0);
    for (w, bytes) in out.chunks_exact_mut(8).enumerate() {
        bytes.copy_from_slice(&word(seed, first + w as u64).to_le_bytes());
    }
    if skip > 0 {
        out.copy_within(skip..skip + len, 0);
    }
    out.truncate(len);
}

/// The pattern bytes `[0, len)` of a buffer seeded with `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::new();
    pattern_into(seed, 0, len, &mut v);
    v
}

/// Where a job's bytes differ from the pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Index of the descriptor.
    pub descriptor: usize,
    /// First differing byte within it.
    pub byte: u64,
    /// The descriptor's bytes.
    pub bytes: u64,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "descriptor {} differs from byte {} (of {})",
            self.descriptor, self.byte, self.bytes
        )
    }
}

/// Compares each descriptor's destination bytes (`dst(desc)`, `None` when
/// they lie outside what the caller can read) with the pattern `seed` at
/// the descriptor's source offset from `src_base`. Returns the bytes
/// verified, or the first mismatch.
pub fn check_descriptors<'a>(
    descs: &[CopyDesc],
    src_base: u64,
    seed: u64,
    mut dst: impl FnMut(&CopyDesc) -> Option<&'a [u8]>,
) -> Result<u64, Mismatch> {
    let mut expected = Vec::new();
    let mut verified = 0;
    for (i, d) in descs.iter().enumerate() {
        let mismatch = |byte| Mismatch {
            descriptor: i,
            byte,
            bytes: d.bytes,
        };
        let actual = dst(d)
            .filter(|a| a.len() as u64 == d.bytes)
            .ok_or_else(|| mismatch(0))?;
        let Some(offset) = d.src.checked_sub(src_base) else {
            return Err(mismatch(0));
        };
        pattern_into(seed, offset, actual.len(), &mut expected);
        // A whole-slice compare (memcmp) first; the byte only on a mismatch.
        if actual != expected.as_slice() {
            let b = actual
                .iter()
                .zip(&expected)
                .position(|(a, e)| a != e)
                .unwrap_or(0);
            return Err(mismatch(b as u64));
        }
        verified += d.bytes;
    }
    Ok(verified)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_of_the_pattern_is_the_same_bytes_as_the_whole() {
        let whole = pattern(7, 1000);
        for (off, len) in [(0, 1000), (1, 31), (8, 64), (13, 987), (999, 1), (500, 0)] {
            let mut w = Vec::new();
            pattern_into(7, off as u64, len, &mut w);
            assert_eq!(w, whole[off..off + len], "{off}+{len}");
        }
        assert_ne!(pattern(7, 64), pattern(8, 64), "seeds differ");
    }

    #[test]
    fn copied_bytes_pass_and_a_wrong_or_missing_byte_fails() {
        let src = pattern(GPU_SEED, 4096);
        // Two descriptors: [100, 300) -> dst[0..200), [1000, 1016) -> dst[200..216).
        let mut dst = [&src[100..300], &src[1000..1016]].concat();
        let base = 0x1000u64;
        let descs = [
            CopyDesc {
                src: base + 100,
                dst: 0,
                bytes: 200,
            },
            CopyDesc {
                src: base + 1000,
                dst: 200,
                bytes: 16,
            },
        ];
        let view = |d: &CopyDesc, buf: &[u8]| -> Vec<u8> {
            buf[d.dst as usize..(d.dst + d.bytes) as usize].to_vec()
        };
        let copies: Vec<Vec<u8>> = descs.iter().map(|d| view(d, &dst)).collect();
        let mut k = 0;
        let ok = check_descriptors(&descs, base, GPU_SEED, |_| {
            k += 1;
            Some(&copies[k - 1][..])
        });
        assert_eq!(ok, Ok(216));
        dst[205] ^= 1;
        let copies: Vec<Vec<u8>> = descs.iter().map(|d| view(d, &dst)).collect();
        let mut k = 0;
        let bad = check_descriptors(&descs, base, GPU_SEED, |_| {
            k += 1;
            Some(&copies[k - 1][..])
        });
        assert_eq!(
            bad,
            Err(Mismatch {
                descriptor: 1,
                byte: 5,
                bytes: 16
            })
        );
        // A cleared destination (nothing copied) fails on the first byte.
        let zeros = [0u8; 200];
        assert!(check_descriptors(&descs[..1], base, GPU_SEED, |_| Some(&zeros[..])).is_err());
        // A destination the caller cannot read fails too.
        assert!(check_descriptors(&descs, base, GPU_SEED, |_| None).is_err());
    }
}
