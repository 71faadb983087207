//! Conversions between Python values and kvoffload's, and the errors
//! Python sees.

use kvoffload::{BlockHash, GpuBlockId};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pub(crate) fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

pub(crate) fn runtime_error(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// A block hash as kvoffload's key: vLLM's hashes are cryptographic digests
/// (sha256 by default), so their first 8 bytes are a uniform 64-bit key.
/// Shorter inputs (or ints) are folded with FNV-1a.
pub(crate) fn block_hash(h: &[u8]) -> BlockHash {
    if h.len() >= 8 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&h[..8]);
        // Keys below 2^63 print as plain integers in traces.
        BlockHash(u64::from_le_bytes(a) & (u64::MAX >> 1))
    } else {
        let mut x: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in h {
            x = (x ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        BlockHash(x & (u64::MAX >> 1))
    }
}

pub(crate) fn blocks(ids: &[u32]) -> Vec<GpuBlockId> {
    ids.iter().map(|&b| GpuBlockId(b)).collect()
}
