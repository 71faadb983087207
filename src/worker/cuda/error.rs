//! Errors of the CUDA backend. A missing driver is an error, never a panic.

use cudarc::driver::DriverError;
use thiserror::Error;

/// An error of the CUDA backend.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded.
    #[error("libcuda.so not found (no NVIDIA driver)")]
    NoDriver,
    /// The driver is there but there is no usable device.
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("{op} failed: {message}")]
    Driver {
        /// The call.
        op: &'static str,
        /// The driver's message.
        message: String,
    },
    /// A driver call panicked inside cudarc (for example a missing symbol).
    #[error("{op} panicked in the CUDA bindings: {message}")]
    Panicked {
        /// The call.
        op: &'static str,
        /// The panic message.
        message: String,
    },
    /// The library was built without nvcc: the copy kernels are missing.
    #[error("kernels not built (the library was built without nvcc)")]
    KernelsNotBuilt,
    /// The device cannot address host memory the way the kernels need.
    #[error("unsupported device: {0}")]
    Unsupported(String),
    /// A layout given to the backend is unusable.
    #[error(transparent)]
    Layout(#[from] crate::worker::LayoutError),
}

/// Maps a cudarc driver error of `op` (formatting calls into libcuda, which is
/// loaded whenever a `DriverError` exists).
pub fn driver(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: format!("{e:?}"),
    }
}

/// Turns a raw `CUresult` into a `CudaError`.
pub fn check(op: &'static str, r: cudarc::driver::sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(driver(op))
}
