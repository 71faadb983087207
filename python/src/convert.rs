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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_digest_s_first_eight_bytes_are_the_key_with_the_top_bit_cleared() {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&0xF123_4567_89AB_CDEFu64.to_le_bytes());
        h[8] = 0xFF; // bytes past the eighth do not matter
        assert_eq!(block_hash(&h), BlockHash(0x7123_4567_89AB_CDEF));
        let mut other = h;
        other[31] = 1;
        assert_eq!(block_hash(&other), block_hash(&h));
        assert_eq!(block_hash(&h[..8]), block_hash(&h));
    }

    #[test]
    fn short_hashes_are_folded_and_stay_apart() {
        let keys: Vec<BlockHash> = [&b""[..], b"\x00", b"\x01", b"\x00\x00", b"abcdefg"]
            .iter()
            .map(|h| block_hash(h))
            .collect();
        for (i, a) in keys.iter().enumerate() {
            assert!(a.0 < 1 << 63, "{a:?} prints as a plain integer");
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // FNV-1a of the empty input is its offset basis (top bit cleared).
        assert_eq!(keys[0], BlockHash(0xcbf2_9ce4_8422_2325 & (u64::MAX >> 1)));
    }

    /// Runs `f` with the interpreter (started once per test binary).
    pub(crate) fn with_python<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
        Python::initialize();
        Python::attach(f)
    }

    #[test]
    fn ints_are_read_exactly_and_out_of_range_ones_refused() {
        with_python(|py| {
            let read = |src: &str| {
                let v = py
                    .eval(&std::ffi::CString::new(src).unwrap(), None, None)
                    .unwrap();
                int_u64(v.as_borrowed())
            };
            assert_eq!(read("0").ok(), Some(0));
            assert_eq!(
                read("2**64 - 1").ok(),
                Some(u64::MAX),
                "the largest u64 is not an error"
            );
            assert_eq!(
                read("True").ok(),
                Some(1),
                "an int subclass goes through pyo3"
            );
            for bad in ["-1", "2**64", "1.5", "'7'", "None"] {
                let e = read(bad).expect_err(bad);
                assert!(
                    !PyErr::occurred(py),
                    "{bad}: the error is returned, not left set"
                );
                let overflow = e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py);
                assert_eq!(overflow, bad.starts_with(['-', '2']), "{bad}: {e}");
            }
        });
    }

    #[test]
    fn block_lists_come_from_lists_and_other_sequences() {
        with_python(|py| {
            let read = |src: &str| {
                let v = py
                    .eval(&std::ffi::CString::new(src).unwrap(), None, None)
                    .unwrap();
                block_list(&v)
            };
            assert_eq!(read("[4, 2]").ok(), Some(blocks(&[4, 2])));
            assert_eq!(read("(4, 2)").ok(), Some(blocks(&[4, 2])));
            assert_eq!(read("[]").ok(), Some(vec![]));
            for bad in ["[-1]", "[2**32]", "['a']", "[1, None]", "7"] {
                assert!(read(bad).is_err(), "{bad}");
            }
        });
    }

    #[test]
    fn block_ids_keep_their_order() {
        assert_eq!(
            blocks(&[3, 1, u32::MAX]),
            vec![GpuBlockId(3), GpuBlockId(1), GpuBlockId(u32::MAX)]
        );
    }
}
