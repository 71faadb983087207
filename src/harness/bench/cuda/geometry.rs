//! A sweep point's geometry: how its blocks lie on the device (cross-layer,
//! or one region per tensor), or why the point is skipped.

use crate::worker::{GpuLayout, LayoutError};

use super::sweep::CudaSweep;

/// One point's geometry: block size, count and tensors, or why it is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) block: u64,
    pub(super) count: u32,
    pub(super) tensors: u32,
    /// Bytes of one tensor's page of a block.
    pub(super) page: u64,
    /// Device bytes of one tensor's region (every other block is copied:
    /// 2 × count + 1 pages).
    pub(super) tensor_span: u64,
}

impl Geometry {
    pub(super) fn new(
        block: u64,
        count: u32,
        tensors: u32,
        sweep: &CudaSweep,
        dev_len: u64,
    ) -> Result<Self, &'static str> {
        let tensors = tensors.max(1);
        if !block.is_multiple_of(u64::from(tensors)) {
            return Err("block size not a multiple of the tensors");
        }
        let page = block / u64::from(tensors);
        if page < 16 {
            return Err("pages under 16 bytes");
        }
        if block.saturating_mul(u64::from(count)) > sweep.max_job_bytes {
            return Err("larger than the pool");
        }
        if u64::from(count) * u64::from(tensors) > sweep.max_descriptors {
            return Err("more descriptors than max_descriptors");
        }
        let tensor_span = page.saturating_mul(2 * u64::from(count) + 1);
        if tensor_span.saturating_mul(u64::from(tensors)) > dev_len {
            return Err("larger than the device buffer");
        }
        Ok(Self {
            block,
            count,
            tensors,
            page,
            tensor_span,
        })
    }

    pub(super) fn device_bytes(&self) -> u64 {
        self.tensor_span * u64::from(self.tensors)
    }

    pub(super) fn gpu_layout(&self, base: u64) -> Result<GpuLayout, LayoutError> {
        let blocks = 2 * self.count + 1;
        if self.tensors == 1 {
            GpuLayout::cross_layer(base, blocks, self.block, self.block)
        } else {
            let bases: Vec<u64> = (0..u64::from(self.tensors))
                .map(|t| base + t * self.tensor_span)
                .collect();
            GpuLayout::per_layer(&bases, blocks, self.page, self.page)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_skips_what_cannot_be_laid_out() {
        let sweep = CudaSweep::default();
        let dev = 3u64 << 30;
        let g = Geometry::new(64 << 10, 1024, 16, &sweep, dev).unwrap();
        assert_eq!(g.page, 4 << 10);
        assert_eq!(g.tensor_span, (4 << 10) * 2049);
        assert_eq!(g.device_bytes(), g.tensor_span * 16);
        assert!(Geometry::new(4 << 10, 64, 1, &sweep, dev).is_ok());
        assert!(
            Geometry::new(1000, 64, 16, &sweep, dev).is_err(),
            "not a multiple"
        );
        assert!(
            Geometry::new(128, 64, 16, &sweep, dev).is_err(),
            "8-byte pages"
        );
        assert!(
            Geometry::new(2 << 20, 4096, 1, &sweep, dev).is_err(),
            "8 GiB job"
        );
        assert!(
            Geometry::new(4 << 10, 4096, 16, &sweep, dev).is_err(),
            "65,536 descriptors"
        );
        assert!(
            Geometry::new(1 << 20, 1024, 1, &sweep, 1 << 30).is_err(),
            "device span"
        );
        // Per-layer layouts lay their tensors one after another.
        let l = g.gpu_layout(1 << 40).unwrap();
        assert!(format!("{l:?}").contains("1099511627776"));
    }
}
