//! The model's stand-in for `bench --contend`: a train of short compute-bound
//! kernels (`kernels/bench_burn.cu`) on a stream of its own, filling every
//! SM, timed alone and while a strategy's copies run. Its slowdown is what
//! the strategy costs the model; the copies' rate meanwhile is what the
//! model costs the strategy.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;

use crate::worker::cuda::error::driver;
use crate::worker::cuda::{CudaError, DeviceBuffer};

/// Threads per burn CTA.
const THREADS: u32 = 256;
/// Burn CTAs per SM (8 × 256 threads: a full SM on sm_80 and sm_90).
const CTAS_PER_SM: u32 = 8;

/// The burn kernel, sized to `kernel_us` per launch and `launches` per train.
#[derive(Debug)]
pub struct Burn {
    stream: Arc<CudaStream>,
    function: CudaFunction,
    out: DeviceBuffer,
    grid: u32,
    iters: u32,
    launches: u32,
    start: CudaEvent,
    end: CudaEvent,
}

impl Burn {
    /// Loads the burn kernel and sizes one launch to about `kernel_us`
    /// microseconds; `None` where the kernels were not built.
    pub fn new(
        ctx: &Arc<CudaContext>,
        kernel_us: f64,
        launches: u32,
    ) -> Result<Option<Self>, CudaError> {
        let Some(module) = crate::kernels::module("bench_burn") else {
            return Ok(None);
        };
        ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        let m = ctx
            .load_module(Ptx::from_binary(module.fatbin.to_vec()))
            .map_err(driver("cuModuleLoadData"))?;
        let function = m
            .load_function("kv_bench_burn")
            .map_err(driver("cuModuleGetFunction"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("cuDeviceGetAttribute"))?;
        let grid = u32::try_from(sms).unwrap_or(1).max(1) * CTAS_PER_SM;
        let out = DeviceBuffer::new(ctx, (grid * THREADS) as usize * 4)?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut burn = Self {
            stream: ctx.new_stream().map_err(driver("cuStreamCreate"))?,
            function,
            out,
            grid,
            iters: 4096,
            launches: 1,
            start: ctx.new_event(flags).map_err(driver("cuEventCreate"))?,
            end: ctx.new_event(flags).map_err(driver("cuEventCreate"))?,
        };
        // Size one launch: time 4096 iterations (after a warm-up), scale.
        burn.time_alone_us()?;
        let probe = burn.time_alone_us()?.max(1e-3);
        burn.iters = iters_for(kernel_us, probe, 4096);
        burn.launches = launches.max(1);
        Ok(Some(burn))
    }

    fn enqueue_train(&self) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let out = self.out.addr();
        for _ in 0..self.launches {
            let mut b = self.stream.launch_builder(&self.function);
            b.arg(&out).arg(&self.iters);
            // SAFETY: the kernel takes (float*, unsigned) and writes one float
            // per thread: `out` holds grid × THREADS floats.
            unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
        }
        Ok(())
    }

    /// Queues a train between the two events and returns at once.
    pub fn start(&self) -> Result<(), CudaError> {
        self.start
            .record(&self.stream)
            .map_err(driver("cuEventRecord"))?;
        self.enqueue_train()?;
        self.end
            .record(&self.stream)
            .map_err(driver("cuEventRecord"))
    }

    /// Whether the train queued by [`Burn::start`] has finished.
    pub fn done(&self) -> Result<bool, CudaError> {
        self.end.try_is_complete().map_err(driver("cuEventQuery"))
    }

    /// Waits for the train and returns its device time in microseconds.
    pub fn finish_us(&self) -> Result<f64, CudaError> {
        self.end
            .synchronize()
            .map_err(driver("cuEventSynchronize"))?;
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(driver("cuEventElapsedTime"))?;
        Ok(f64::from(ms) * 1e3)
    }

    /// One train with nothing else running, in microseconds.
    pub fn time_alone_us(&self) -> Result<f64, CudaError> {
        self.start()?;
        self.finish_us()
    }
}

/// Iterations for a launch of about `target_us`, from `probe_us` measured
/// for `probe_iters` iterations (at least 1, at most 2^24).
pub fn iters_for(target_us: f64, probe_us: f64, probe_iters: u32) -> u32 {
    let per_iter = probe_us / f64::from(probe_iters.max(1));
    if per_iter.is_nan() || per_iter <= 0.0 || !target_us.is_finite() {
        return probe_iters.max(1);
    }
    (target_us / per_iter)
        .round()
        .clamp(1.0, f64::from(1u32 << 24)) as u32
}

/// The model's slowdown: `with_us / alone_us - 1` (0 where `alone_us` is 0).
pub fn slowdown(alone_us: f64, with_us: f64) -> f64 {
    if alone_us > 0.0 {
        with_us / alone_us - 1.0
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_is_scaled_to_the_target_time() {
        // 4096 iterations took 40 us: 50 us needs 5120.
        assert_eq!(iters_for(50.0, 40.0, 4096), 5120);
        assert_eq!(iters_for(0.0, 40.0, 4096), 1, "at least one iteration");
        assert_eq!(iters_for(1e12, 1.0, 4096), 1 << 24, "bounded");
        assert_eq!(iters_for(50.0, 0.0, 4096), 4096, "a zero probe keeps it");
        assert_eq!(iters_for(f64::NAN, 10.0, 4096), 4096);
    }

    #[test]
    fn slowdown_is_relative_to_the_time_alone() {
        assert!((slowdown(100.0, 125.0) - 0.25).abs() < 1e-12);
        assert_eq!(slowdown(0.0, 5.0), 0.0);
        assert!(slowdown(100.0, 99.0) < 0.0, "noise may read faster");
    }
}
