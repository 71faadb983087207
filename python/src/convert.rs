//! Conversions between Python values and kvoffload's, and the errors
//! Python sees.

use kvoffload::{BlockHash, GpuBlockId};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::borrowed::list_item;

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

/// An int as `u64`: an exact `int` read directly (no `__index__` lookup,
/// no reference taken), anything else through pyo3's conversion; a negative
/// or too large value is an `OverflowError`.
pub(crate) fn int_u64(v: Borrowed<'_, '_, PyAny>) -> PyResult<u64> {
    // SAFETY: `v` is a live object (a borrowed reference, GIL held); the
    // check reads its type pointer only.
    if unsafe { ffi::PyLong_CheckExact(v.as_ptr()) } != 0 {
        // SAFETY: `v` is an exact int, for which the call runs no Python
        // code; it returns `(u64)-1` with an exception set when the value
        // is negative or does not fit.
        let x = unsafe { ffi::PyLong_AsUnsignedLongLong(v.as_ptr()) };
        if x == u64::MAX
            && let Some(e) = PyErr::take(v.py())
        {
            return Err(e);
        }
        return Ok(x);
    }
    v.extract()
}

/// A Python sequence of block ids (vLLM's lists of ints) as kvoffload's.
pub(crate) fn block_list(ids: &Bound<'_, PyAny>) -> PyResult<Vec<GpuBlockId>> {
    let Ok(list) = ids.cast::<PyList>() else {
        return Ok(blocks(&ids.extract::<Vec<u32>>()?));
    };
    let mut out = Vec::with_capacity(list.len());
    for i in 0..list.len() {
        out.push(GpuBlockId(list_item(list, i)?.extract()?));
    }
    Ok(out)
}

pub(crate) fn blocks(ids: &[u32]) -> Vec<GpuBlockId> {
    ids.iter().map(|&b| GpuBlockId(b)).collect()
}
