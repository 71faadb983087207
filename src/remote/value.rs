//! The bytes of one remote value: a fixed header, then one chunk row.
//!
//! The remote store is shared by many engines and evicts on its own, so a
//! value read back is untrusted input: it may be truncated (a half-written or
//! size-capped value), corrupted, written by an older format, written by a
//! deployment with another model or KV layout under a colliding key, or
//! written for another chunk. [`decode`] checks each of these and answers a
//! typed [`ValueRejected`]; only a value that passes every check reaches a
//! host row (and so, later, GPU memory).
//!
//! Layout (little-endian, [`HEADER_BYTES`] = 40 bytes):
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVOR` |
//! | 4 | 2 | format version ([`FORMAT_VERSION`]) |
//! | 6 | 2 | reserved, 0 |
//! | 8 | 8 | namespace fingerprint ([`super::Namespace`]) |
//! | 16 | 8 | chunk key |
//! | 24 | 4 | worker rank |
//! | 28 | 4 | reserved, 0 |
//! | 32 | 8 | payload length |
//! | 40 | .. | payload (the chunk row) |
//!
//! followed by an 8-byte XXH3-64 checksum of header and payload at the end,
//! so that a value cut short anywhere fails either the length or the checksum.

use thiserror::Error;
use xxhash_rust::xxh3::Xxh3;

/// Bytes before the payload.
pub const HEADER_BYTES: usize = 40;
/// Bytes after the payload (the checksum).
pub const TRAILER_BYTES: usize = 8;
/// The format written by this version; values of any other are rejected.
pub const FORMAT_VERSION: u16 = 1;
const MAGIC: [u8; 4] = *b"KVOR";

/// What a value claims to be: checked against what the reader asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueIdentity {
    /// The deployment's namespace fingerprint.
    pub namespace: u64,
    /// The chunk key.
    pub key: u64,
    /// The worker rank whose share of the chunk this is.
    pub rank: u32,
}

/// Why a value read back was not accepted (it counts as a miss).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ValueRejected {
    /// Shorter than a header and checksum, or its length field disagrees
    /// with its size.
    #[error("truncated value: {got} bytes, expected {expected}")]
    Truncated {
        /// Bytes read.
        got: usize,
        /// Bytes the header implies (or the minimum).
        expected: usize,
    },
    /// Not a kvoffload value.
    #[error("not a kvoffload value (bad magic)")]
    BadMagic,
    /// Written by another format version.
    #[error("format version {0} (this build reads {FORMAT_VERSION})")]
    Version(u16),
    /// Written by another deployment (model, layout, world size).
    #[error("value from another namespace ({found:016x})")]
    Namespace {
        /// The namespace the value carries.
        found: u64,
    },
    /// Written for another chunk key or rank.
    #[error("value for another chunk (key {key:016x}, rank {rank})")]
    OtherChunk {
        /// The key the value carries.
        key: u64,
        /// The rank the value carries.
        rank: u32,
    },
    /// The payload is not the size the reader's layout needs.
    #[error("payload of {got} bytes, the layout needs {expected}")]
    PayloadSize {
        /// Bytes in the value.
        got: usize,
        /// Bytes one chunk row holds.
        expected: usize,
    },
    /// The bytes changed after they were written.
    #[error("checksum mismatch")]
    Checksum,
}

/// Bytes of an encoded value with `payload` bytes of payload.
pub fn encoded_len(payload: usize) -> usize {
    HEADER_BYTES + payload + TRAILER_BYTES
}

/// Encodes `payload` as the value of `id`, into `out` (cleared first).
pub fn encode_into(id: ValueIdentity, payload: &[u8], out: &mut Vec<u8>) {
    begin(out, payload.len());
    out.extend_from_slice(payload);
    seal(out, id);
}

/// Starts a value in `out` (cleared first): room for the header, and for
/// `payload` bytes, which the caller appends before [`seal`]. This lets the
/// caller copy its payload once, and leaves the header and checksum to
/// whichever thread seals it.
pub fn begin(out: &mut Vec<u8>, payload: usize) {
    out.clear();
    out.reserve(encoded_len(payload));
    out.resize(HEADER_BYTES, 0);
}

/// Finishes a value started by [`begin`] whose payload has been appended:
/// writes the header of `id` and appends the checksum.
pub fn seal(value: &mut Vec<u8>, id: ValueIdentity) {
    let payload = value.len().saturating_sub(HEADER_BYTES) as u64;
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&id.namespace.to_le_bytes());
    h[16..24].copy_from_slice(&id.key.to_le_bytes());
    h[24..28].copy_from_slice(&id.rank.to_le_bytes());
    h[32..40].copy_from_slice(&payload.to_le_bytes());
    value[..HEADER_BYTES].copy_from_slice(&h);
    let sum = checksum(&value[..HEADER_BYTES], &value[HEADER_BYTES..]);
    value.extend_from_slice(&sum.to_le_bytes());
}

/// Encodes `payload` as the value of `id`.
pub fn encode(id: ValueIdentity, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_into(id, payload, &mut out);
    out
}

/// Checks `value` against what the reader asked for (`want`, and a payload
/// of `payload_bytes` when given) and returns its payload.
pub fn decode(
    value: &[u8],
    want: ValueIdentity,
    payload_bytes: Option<usize>,
) -> Result<&[u8], ValueRejected> {
    let min = HEADER_BYTES + TRAILER_BYTES;
    if value.len() < min {
        return Err(ValueRejected::Truncated {
            got: value.len(),
            expected: min,
        });
    }
    if value[0..4] != MAGIC {
        return Err(ValueRejected::BadMagic);
    }
    let version = u16::from_le_bytes([value[4], value[5]]);
    if version != FORMAT_VERSION {
        return Err(ValueRejected::Version(version));
    }
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&value[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let namespace = u64_at(8);
    let key = u64_at(16);
    let rank = u32::from_le_bytes([value[24], value[25], value[26], value[27]]);
    let len = u64_at(32);
    let expected = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(min))
        .unwrap_or(usize::MAX);
    if expected != value.len() {
        return Err(ValueRejected::Truncated {
            got: value.len(),
            expected,
        });
    }
    let payload = &value[HEADER_BYTES..value.len() - TRAILER_BYTES];
    let stored = u64_at(value.len() - TRAILER_BYTES);
    if stored != checksum(&value[..HEADER_BYTES], payload) {
        return Err(ValueRejected::Checksum);
    }
    // Identity after the checksum: a corrupted identity field is reported as
    // corruption, not as a foreign value.
    if namespace != want.namespace {
        return Err(ValueRejected::Namespace { found: namespace });
    }
    if key != want.key || rank != want.rank {
        return Err(ValueRejected::OtherChunk { key, rank });
    }
    if let Some(n) = payload_bytes
        && n != payload.len()
    {
        return Err(ValueRejected::PayloadSize {
            got: payload.len(),
            expected: n,
        });
    }
    Ok(payload)
}

fn checksum(header: &[u8], payload: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(header);
    h.update(payload);
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: ValueIdentity = ValueIdentity {
        namespace: 0xABCD,
        key: 42,
        rank: 1,
    };

    fn payload() -> Vec<u8> {
        (0..1000u32).map(|i| (i * 7) as u8).collect()
    }

    #[test]
    fn a_value_round_trips() {
        let p = payload();
        let v = encode(ID, &p);
        assert_eq!(v.len(), encoded_len(p.len()));
        assert_eq!(decode(&v, ID, Some(p.len())), Ok(&p[..]));
        assert_eq!(decode(&v, ID, None), Ok(&p[..]));
        let empty = encode(ID, &[]);
        assert_eq!(decode(&empty, ID, Some(0)), Ok(&[][..]));
    }

    #[test]
    fn every_cut_is_rejected() {
        let v = encode(ID, &payload());
        for cut in 0..v.len() {
            let r = decode(&v[..cut], ID, None);
            assert!(
                matches!(r, Err(ValueRejected::Truncated { .. })),
                "cut at {cut}: {r:?}"
            );
        }
        let mut longer = v.clone();
        longer.push(0);
        assert!(matches!(
            decode(&longer, ID, None),
            Err(ValueRejected::Truncated { .. })
        ));
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let v = encode(ID, &payload());
        for i in 0..v.len() {
            let mut bad = v.clone();
            bad[i] ^= 0x5A;
            assert!(decode(&bad, ID, None).is_err(), "flip at byte {i} accepted");
        }
    }

    #[test]
    fn foreign_values_are_named() {
        let p = payload();
        let other_ns = encode(ValueIdentity { namespace: 7, ..ID }, &p);
        assert_eq!(
            decode(&other_ns, ID, None),
            Err(ValueRejected::Namespace { found: 7 })
        );
        let other_key = encode(ValueIdentity { key: 43, ..ID }, &p);
        assert_eq!(
            decode(&other_key, ID, None),
            Err(ValueRejected::OtherChunk { key: 43, rank: 1 })
        );
        let other_rank = encode(ValueIdentity { rank: 0, ..ID }, &p);
        assert!(matches!(
            decode(&other_rank, ID, None),
            Err(ValueRejected::OtherChunk { rank: 0, .. })
        ));
        let v = encode(ID, &p);
        assert_eq!(
            decode(&v, ID, Some(999)),
            Err(ValueRejected::PayloadSize {
                got: 1000,
                expected: 999
            })
        );
        assert_eq!(
            decode(
                b"hello world, this is not a kvoffload value, and it is long enough",
                ID,
                None
            ),
            Err(ValueRejected::BadMagic)
        );
        let mut v2 = v.clone();
        v2[4] = 2;
        assert_eq!(decode(&v2, ID, None), Err(ValueRejected::Version(2)));
    }

    #[test]
    fn a_huge_length_field_is_truncation_not_overflow() {
        let mut v = encode(ID, &payload());
        v[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode(&v, ID, None),
            Err(ValueRejected::Truncated { .. })
        ));
    }
}
