//! Opening a CUDA context without ever panicking: no driver library, a driver
//! without a device, or a missing symbol all become a [`CudaError`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, sys};

use super::error::CudaError;
use crate::worker::numa::{PciAddress, PoolNear};

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

/// How many CUDA devices the driver shows this process.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let n = guarded("cuDeviceGetCount", || {
        CudaContext::device_count().map_err(|e| CudaError::Driver {
            op: "cuDeviceGetCount",
            message: format!("{e:?}"),
        })
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The PCI address of `ctx`'s device (for placing host memory on its NUMA
/// node, [`crate::worker::numa`]).
pub fn pci_address(ctx: &Arc<CudaContext>) -> Result<PciAddress, CudaError> {
    use sys::CUdevice_attribute as A;
    guarded("cuDeviceGetAttribute", || {
        let get = |a: A| {
            ctx.attribute(a).map_err(|e| CudaError::Driver {
                op: "cuDeviceGetAttribute",
                message: format!("{a:?}: {e:?}"),
            })
        };
        let domain = get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
        let bus = get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
        let device = get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
        let bad = |what: &str, v: i32| CudaError::Driver {
            op: "cuDeviceGetAttribute",
            message: format!("PCI {what} {v} out of range"),
        };
        Ok(PciAddress {
            domain: u32::try_from(domain).map_err(|_| bad("domain", domain))?,
            bus: u8::try_from(bus).map_err(|_| bad("bus", bus))?,
            device: u8::try_from(device).map_err(|_| bad("device", device))?,
            function: 0,
        })
    })
}

/// What a pool for `ctx`'s device is near: its GPU, by PCI address, or
/// why the address is unknown.
pub fn pool_near(ctx: &Arc<CudaContext>) -> PoolNear {
    match pci_address(ctx) {
        Ok(a) => PoolNear::Gpu(a),
        Err(e) => PoolNear::UnknownGpu(e.to_string()),
    }
}

/// A stream another library owns, for ordering transfers after its work
/// (the vLLM connector passes PyTorch's current stream); `raw == 0` is the
/// legacy default stream. Dropping the wrapper leaves the stream alone.
///
/// # Safety
/// `raw` must be 0 or a valid stream of `ctx`, kept alive by its owner for
/// as long as the returned stream (or a backend holding it) is used.
pub unsafe fn borrowed_stream(ctx: &Arc<CudaContext>, raw: u64) -> Arc<CudaStream> {
    if raw == 0 {
        return ctx.default_stream();
    }
    // SAFETY: the caller guarantees `raw` is a live stream of `ctx`.
    unsafe { ctx.wrap_borrowed_stream(raw as usize as sys::CUstream) }
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
