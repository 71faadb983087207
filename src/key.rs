//! Chunk keys and the rule that derives them from a request's block hashes.
//!
//! Block hashes are chained (each covers the whole prefix), so the hash of the
//! last block in a chunk identifies the whole prefix up to the end of that
//! chunk. A chunk key is that hash, mixed with the KV group index.

use serde::{Deserialize, Serialize};

/// Hash of one GPU block of tokens (chained over the prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

/// Identity of one offloaded chunk: the prefix it ends, in one KV group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkKey(pub u64);

impl ChunkKey {
    /// The key of a chunk whose last block has hash `last_block` in KV group `group`.
    ///
    /// Group 0 keeps the hash unchanged, so single-group users (and traces) see
    /// their own numbers; other groups are mixed in so keys never collide across groups.
    pub fn for_group(last_block: BlockHash, group: u32) -> Self {
        if group == 0 {
            return ChunkKey(last_block.0);
        }
        // splitmix64 finaliser over (hash ^ group): cheap and well distributed.
        let mut z = last_block.0 ^ (u64::from(group)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ChunkKey(z ^ (z >> 31))
    }
}

impl std::fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Keys of the complete chunks of a request, in prefix order.
///
/// Chunk `i` has key `block_hashes[(i+1)*blocks_per_chunk - 1]`; a trailing
/// partial chunk has no key yet. Returns an empty list when `blocks_per_chunk` is 0.
pub fn chunk_keys(
    block_hashes: &[BlockHash],
    blocks_per_chunk: usize,
    group: u32,
) -> Vec<ChunkKey> {
    if blocks_per_chunk == 0 {
        return Vec::new();
    }
    block_hashes
        .chunks_exact(blocks_per_chunk)
        .map(|c| ChunkKey::for_group(c[blocks_per_chunk - 1], group))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(n: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(100 + i)).collect()
    }

    #[test]
    fn chunk_key_is_last_block_hash_of_each_chunk() {
        assert_eq!(
            chunk_keys(&hashes(7), 3, 0),
            vec![ChunkKey(102), ChunkKey(105)],
            "the 7th block does not complete a chunk"
        );
        assert_eq!(
            chunk_keys(&hashes(2), 1, 0),
            vec![ChunkKey(100), ChunkKey(101)]
        );
        assert!(chunk_keys(&hashes(4), 0, 0).is_empty());
    }

    #[test]
    fn groups_do_not_collide() {
        let h = BlockHash(42);
        assert_eq!(ChunkKey::for_group(h, 0), ChunkKey(42));
        assert_ne!(ChunkKey::for_group(h, 1), ChunkKey::for_group(h, 0));
        assert_ne!(ChunkKey::for_group(h, 1), ChunkKey::for_group(h, 2));
    }
}

/// A fast hasher for maps keyed by [`ChunkKey`] (or any single integer).
///
/// Keys are already hashes, but traces and tests use small integers, so the
/// value is mixed with one multiply and a rotate (the FxHash step) to spread
/// the top bits that hash tables use for their control bytes.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        self.0 ^= self.0 >> 29;
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
}

/// Builds [`KeyHasher`]s.
pub type KeyBuildHasher = std::hash::BuildHasherDefault<KeyHasher>;
