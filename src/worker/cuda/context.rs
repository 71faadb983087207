//! Opening a CUDA context without ever panicking: no driver library, a driver
//! without a device, or a missing symbol all become a [`CudaError`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::error::CudaError;

/// Whether `libcuda.so` can be loaded.
pub fn driver_present() -> bool {
    #[cfg(miri)]
    {
        false
    }
    #[cfg(not(miri))]
    {
        // SAFETY: dlopen of the driver library by name, then dropped; no other effect.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }
}

/// Runs `f`, turning a panic inside the CUDA bindings into [`CudaError::Panicked`].
pub fn guarded<T>(
    op: &'static str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let message = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(CudaError::Panicked { op, message })
        }
    }
}

/// Opens (the primary context of) device `ordinal`.
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    guarded("cuCtxCreate", || {
        CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice(format!("{e:?}")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore)]
    fn no_driver_is_an_error_not_a_panic() {
        match open_context(0) {
            Ok(_) => {}
            Err(CudaError::NoDriver) => assert!(!driver_present()),
            Err(e) => assert!(matches!(
                e,
                CudaError::NoDevice(_) | CudaError::Panicked { .. }
            )),
        }
    }

    #[test]
    fn guarded_turns_panics_into_errors() {
        let r: Result<(), _> = guarded("probe", || panic!("Missing symbol cuFoo"));
        assert!(
            matches!(r, Err(CudaError::Panicked { op: "probe", ref message }) if message.contains("cuFoo"))
        );
    }
}
