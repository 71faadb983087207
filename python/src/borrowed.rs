//! Reads of vLLM's per-step lists and dicts without reference-count traffic.
//!
//! The scheduler output holds a thousand entries a step in each of its
//! lists. Under the limited API (an abi3 wheel), pyo3's `get_item` takes and
//! drops a reference per item (two calls into the interpreter) and its
//! iterators also ask the container's length per item; these helpers return
//! borrowed references instead. A borrowed item is valid while its container
//! holds it: callers read what they need from it before running any Python
//! code (an attribute read, a comparison, a conversion that may call
//! `__index__`), or take their own reference first (`Borrowed::to_owned`).

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// Item `i` of `list`, borrowed; an `IndexError` past its end.
pub(crate) fn list_item<'a, 'py>(
    list: &'a Bound<'py, PyList>,
    i: usize,
) -> PyResult<Borrowed<'a, 'py, PyAny>> {
    let i = ffi::Py_ssize_t::try_from(i)
        .map_err(|_| pyo3::exceptions::PyIndexError::new_err("list index out of range"))?;
    // SAFETY: `list` is a live list object (the `Bound` holds a reference and
    // proves the GIL is held). `PyList_GetItem` checks the index and returns
    // either a borrowed reference to the item or NULL with an exception set,
    // which `from_ptr_or_err` turns into the error. The item lives as long as
    // the list holds it; the borrow is tied to `list`, and callers run no
    // Python code while they use it (the module's contract).
    unsafe { Borrowed::from_ptr_or_err(list.py(), ffi::PyList_GetItem(list.as_ptr(), i)) }
}

/// Calls `f(key, value)` for each entry of `dict` in its order, with borrowed
/// references. `f` must not run Python code while it holds them (it may
/// after it has read what it needs, as it returns its own data). An error of
/// `f` stops the walk; a dict whose size changed during it is an error.
pub(crate) fn for_each_entry<'py>(
    dict: &Bound<'py, PyDict>,
    mut f: impl FnMut(Borrowed<'_, 'py, PyAny>, Borrowed<'_, 'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    let py = dict.py();
    let len = dict.len();
    let mut pos: ffi::Py_ssize_t = 0;
    let mut key: *mut ffi::PyObject = std::ptr::null_mut();
    let mut value: *mut ffi::PyObject = std::ptr::null_mut();
    loop {
        // SAFETY: `dict` is a live dict (held by the `Bound`, GIL held);
        // `PyDict_Next` writes borrowed references to the next entry's key and
        // value, or returns 0 at the end. They are valid while the dict holds
        // them; `f` uses them before running Python code (its contract).
        let more = unsafe { ffi::PyDict_Next(dict.as_ptr(), &mut pos, &mut key, &mut value) };
        if more == 0 {
            break;
        }
        // SAFETY: both pointers are non-NULL borrowed references just written
        // by `PyDict_Next` (it returned non-zero).
        let (k, v) = unsafe { (Borrowed::from_ptr(py, key), Borrowed::from_ptr(py, value)) };
        f(k, v)?;
        if dict.len() != len {
            return Err(PyRuntimeError::new_err(
                "dictionary changed size during iteration",
            ));
        }
    }
    Ok(())
}
