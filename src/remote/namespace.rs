//! The namespace of a deployment in the shared store, and the keys under it.
//!
//! Two engines may share one store only if their chunks are interchangeable:
//! same model (and revision), same KV layout, same block size and bytes per
//! block, same tensor-parallel split. The namespace fingerprints exactly
//! these, so that a deployment never reads another's bytes; the fingerprint
//! is in every key (so different deployments do not even collide) and in
//! every value's header (so a colliding or misplaced value is still
//! rejected, see [`super::value`]).

use std::fmt::Write as _;

use xxhash_rust::xxh3::xxh3_64;

/// What identifies a deployment's KV bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceParts {
    /// The model, with its revision (any text; for example `org/name@rev`).
    pub model: String,
    /// The KV layout's name (for example `cross_layer` or `per_layer`), with
    /// its dtype when it matters.
    pub layout: String,
    /// Tokens per GPU block.
    pub tokens_per_block: u32,
    /// GPU blocks per chunk.
    pub blocks_per_chunk: u32,
    /// KV bytes of one block on one worker.
    pub bytes_per_block: u64,
    /// Workers (tensor-parallel ranks) sharing each chunk.
    pub world_size: u32,
}

/// A deployment's fingerprint and the key prefix derived from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    fingerprint: u64,
    prefix: String,
}

impl Namespace {
    /// The namespace of `parts`.
    pub fn new(parts: &NamespaceParts) -> Self {
        // A canonical text with every field named and the free-text fields
        // length-prefixed, so that no two different tuples give the same text.
        let text = format!(
            "kvoffload-ns-v1|model:{}:{}|layout:{}:{}|tpb:{}|bpc:{}|bpb:{}|ws:{}",
            parts.model.len(),
            parts.model,
            parts.layout.len(),
            parts.layout,
            parts.tokens_per_block,
            parts.blocks_per_chunk,
            parts.bytes_per_block,
            parts.world_size,
        );
        Self::from_fingerprint(xxh3_64(text.as_bytes()))
    }

    /// The namespace with this fingerprint (for values written elsewhere).
    pub fn from_fingerprint(fingerprint: u64) -> Self {
        Self {
            fingerprint,
            prefix: format!("kvo:{fingerprint:016x}:"),
        }
    }

    /// The fingerprint carried in every key and value header.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The store key of chunk `key`'s share held by worker `rank`:
    /// `kvo:<namespace>:<rank>:<key>` (hexadecimal).
    pub fn key(&self, key: u64, rank: u32) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 26);
        self.key_into(key, rank, &mut s);
        s
    }

    /// [`Self::key`] written into `out` (cleared first).
    pub fn key_into(&self, key: u64, rank: u32, out: &mut String) {
        out.clear();
        out.push_str(&self.prefix);
        let _ = write!(out, "{rank}:{key:016x}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> NamespaceParts {
        NamespaceParts {
            model: "facebook/opt-125m@main".into(),
            layout: "cross_layer".into(),
            tokens_per_block: 16,
            blocks_per_chunk: 1,
            bytes_per_block: 73_728,
            world_size: 2,
        }
    }

    #[test]
    fn every_field_changes_the_namespace() {
        let base = Namespace::new(&parts());
        assert_eq!(base, Namespace::new(&parts()), "deterministic");
        let variants: [fn(&mut NamespaceParts); 6] = [
            |p| p.model.push('x'),
            |p| p.layout = "per_layer".into(),
            |p| p.tokens_per_block = 32,
            |p| p.blocks_per_chunk = 2,
            |p| p.bytes_per_block += 1,
            |p| p.world_size = 1,
        ];
        for (i, change) in variants.iter().enumerate() {
            let mut p = parts();
            change(&mut p);
            assert_ne!(
                Namespace::new(&p).fingerprint(),
                base.fingerprint(),
                "variant {i}"
            );
        }
    }

    #[test]
    fn free_text_fields_cannot_be_shifted_into_each_other() {
        let mut a = parts();
        a.model = "m|layout:".into();
        a.layout = "x".into();
        let mut b = parts();
        b.model = "m".into();
        b.layout = "|layout:x".into();
        assert_ne!(Namespace::new(&a), Namespace::new(&b));
    }

    #[test]
    fn keys_name_namespace_rank_and_chunk() {
        let ns = Namespace::from_fingerprint(0xAB);
        assert_eq!(ns.key(0x1234, 3), "kvo:00000000000000ab:3:0000000000001234");
        let mut s = String::from("junk");
        ns.key_into(1, 0, &mut s);
        assert_eq!(s, "kvo:00000000000000ab:0:0000000000000001");
    }
}
