//! Backend options a calibration run found better than the defaults: the
//! optional `tuning` section of a strategy table file. Unlike the rules, they
//! take effect when a backend is built ([`BackendTuning::apply`]): a running
//! backend's graphs are captured with its launch shape and its rings sized,
//! so a table swapped in later changes its strategy choices, not these.

use serde::{Deserialize, Serialize};

use super::backend::CudaBackendOptions;
use super::strategy::StrategyTableError;

/// Most CTAs a tuned copy kernel may take.
pub const MAX_KERNEL_CTAS: u32 = 1024;
/// Most tables per ring a tuning may ask for.
pub const MAX_RING_SLOTS: usize = 64;

/// Calibrated backend options; an absent field keeps the default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendTuning {
    /// CTAs of the copy kernel's grid (`LaunchShape::ctas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_ctas: Option<u32>,
    /// Largest piece a kernel descriptor is split into
    /// (`CudaBackendOptions::kernel_split_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_max_piece_bytes: Option<u64>,
    /// Tables per ring (`CudaBackendOptions::ring_slots`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring_slots: Option<usize>,
    /// Batched copies prefer overlapping with compute
    /// (`CudaBackendOptions::batch_prefer_overlap`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_prefer_overlap: Option<bool>,
}

impl BackendTuning {
    /// Nothing to change.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Checks every field is in range.
    pub fn validate(&self) -> Result<(), StrategyTableError> {
        let out_of_range = |field: &'static str, value: u64, allowed: &'static str| {
            Err(StrategyTableError::Tuning {
                field,
                value,
                allowed,
            })
        };
        if let Some(c) = self.kernel_ctas
            && !(1..=MAX_KERNEL_CTAS).contains(&c)
        {
            return out_of_range("kernel_ctas", u64::from(c), "1..=1024");
        }
        if let Some(p) = self.kernel_max_piece_bytes
            && p < 16
        {
            return out_of_range("kernel_max_piece_bytes", p, "16..");
        }
        if let Some(r) = self.ring_slots
            && !(1..=MAX_RING_SLOTS).contains(&r)
        {
            return out_of_range("ring_slots", r as u64, "1..=64");
        }
        Ok(())
    }

    /// Sets the tuned fields in `options`.
    pub fn apply(&self, options: &mut CudaBackendOptions) {
        if let Some(c) = self.kernel_ctas {
            options.shape.ctas = c;
        }
        if let Some(p) = self.kernel_max_piece_bytes {
            options.kernel_split_bytes = p;
        }
        if let Some(r) = self.ring_slots {
            options.ring_slots = r;
        }
        if let Some(o) = self.batch_prefer_overlap {
            options.batch_prefer_overlap = o;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuned_fields_replace_the_defaults_and_absent_ones_keep_them() {
        let mut o = CudaBackendOptions::default();
        let before = (
            o.shape,
            o.kernel_split_bytes,
            o.ring_slots,
            o.batch_prefer_overlap,
        );
        BackendTuning::default().apply(&mut o);
        assert_eq!(
            (
                o.shape,
                o.kernel_split_bytes,
                o.ring_slots,
                o.batch_prefer_overlap
            ),
            before
        );
        let t = BackendTuning {
            kernel_ctas: Some(32),
            kernel_max_piece_bytes: Some(16 << 10),
            ring_slots: Some(8),
            batch_prefer_overlap: Some(true),
        };
        t.apply(&mut o);
        assert_eq!(o.shape.ctas, 32);
        assert_eq!(o.shape.threads, before.0.threads);
        assert_eq!(o.kernel_split_bytes, 16 << 10);
        assert_eq!(o.ring_slots, 8);
        assert!(o.batch_prefer_overlap);
        assert!(t.validate().is_ok() && !t.is_empty());
        assert!(BackendTuning::default().is_empty());
    }

    #[test]
    fn out_of_range_fields_are_named() {
        for (t, field) in [
            (
                BackendTuning {
                    kernel_ctas: Some(0),
                    ..BackendTuning::default()
                },
                "kernel_ctas = 0",
            ),
            (
                BackendTuning {
                    kernel_ctas: Some(5000),
                    ..BackendTuning::default()
                },
                "kernel_ctas = 5000",
            ),
            (
                BackendTuning {
                    kernel_max_piece_bytes: Some(8),
                    ..BackendTuning::default()
                },
                "kernel_max_piece_bytes = 8",
            ),
            (
                BackendTuning {
                    ring_slots: Some(0),
                    ..BackendTuning::default()
                },
                "ring_slots = 0",
            ),
        ] {
            let e = t.validate().unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
    }
}
