//! The calibrated table's `tuning`: which launch shape, ring depth and
//! prefer-overlap setting beat the backend's defaults over the measured
//! points (`--sweep-launch`, `--sweep-ring`, `--sweep-batch-overlap`). A
//! variant wins on the geometric mean of its rate over the default's at the
//! same points, by more than [`MARGIN`]; under `--contend` it is compared on
//! its rate beside the compute train, and a variant that slowed the train
//! by more than the policy allows (on average) is not chosen.

use crate::Direction;
use crate::worker::cuda::{BackendTuning, CudaBackendOptions, Strategy};

use super::{CalibrationPolicy, CudaPoint, LaunchVariant};

/// How much better (geometric mean of rate ratios) a variant must be.
pub const MARGIN: f64 = 0.02;

/// (direction, block bytes, blocks): where variants are compared.
type Place = (Direction, u64, u32);

fn place(p: &CudaPoint) -> Place {
    (p.direction, p.block_bytes, p.blocks)
}

/// The rate a point is compared on: under contention where measured.
fn rate(p: &CudaPoint) -> f64 {
    p.contended_gbps.unwrap_or(p.gbps)
}

fn geomean(ratios: &[f64]) -> Option<f64> {
    let logs: Vec<f64> = ratios
        .iter()
        .filter(|r| r.is_finite() && **r > 0.0)
        .map(|r| r.ln())
        .collect();
    (!logs.is_empty()).then(|| (logs.iter().sum::<f64>() / logs.len() as f64).exp())
}

/// Mean compute slowdown of `points`, where measured.
fn mean_slowdown(points: &[&CudaPoint]) -> Option<f64> {
    let s: Vec<f64> = points
        .iter()
        .filter_map(|p| p.compute_slowdown)
        .filter(|s| s.is_finite())
        .collect();
    (!s.is_empty()).then(|| s.iter().sum::<f64>() / s.len() as f64)
}

/// The best of `candidates` against `baseline` (both single-job points of
/// one strategy): its score and key, if it beats the baseline by more than
/// the margin and stays within the policy's slowdown.
fn best_variant<K: Copy + PartialEq>(
    baseline: &[&CudaPoint],
    candidates: &[(K, Vec<&CudaPoint>)],
    policy: CalibrationPolicy,
) -> Option<K> {
    let mut best: Option<(f64, K)> = None;
    for (key, points) in candidates {
        if mean_slowdown(points).is_some_and(|s| s > policy.max_compute_slowdown) {
            continue;
        }
        let ratios: Vec<f64> = points
            .iter()
            .filter_map(|p| {
                let b = baseline.iter().find(|b| place(b) == place(p))?;
                Some(rate(p) / rate(b))
            })
            .collect();
        let Some(score) = geomean(&ratios) else {
            continue;
        };
        if score > 1.0 + MARGIN && best.is_none_or(|(s, _)| score > s) {
            best = Some((score, *key));
        }
    }
    best.map(|(_, k)| k)
}

/// The tuning the measured variants support (empty where none beat the
/// defaults or none were measured).
pub fn calibrated_tuning(points: &[CudaPoint], policy: CalibrationPolicy) -> BackendTuning {
    let finite = |p: &&CudaPoint| p.gbps.is_finite() && p.gbps > 0.0;
    let plain = |p: &&CudaPoint| p.launch.is_none() && !p.prefer_overlap && p.ring.is_none();
    let mut tuning = BackendTuning::default();

    // Launch shape: kernel jobs, one at a time, cross-layer.
    let kernel: Vec<&CudaPoint> = points
        .iter()
        .filter(finite)
        .filter(|p| p.strategy == Strategy::Kernel && p.tensors == 1 && p.ring.is_none())
        .collect();
    let baseline: Vec<&CudaPoint> = kernel.iter().copied().filter(plain).collect();
    let mut shapes: Vec<(LaunchVariant, Vec<&CudaPoint>)> = Vec::new();
    for p in kernel.iter().copied() {
        let Some(v) = p.launch else { continue };
        match shapes.iter_mut().find(|(k, _)| *k == v) {
            Some((_, ps)) => ps.push(p),
            None => shapes.push((v, vec![p])),
        }
    }
    if let Some(v) = best_variant(&baseline, &shapes, policy) {
        tuning.kernel_ctas = Some(v.ctas);
        tuning.kernel_max_piece_bytes = Some(v.max_piece_bytes);
    }

    // Prefer-overlap: batch DMA jobs with the flag against without.
    let batch: Vec<&CudaPoint> = points
        .iter()
        .filter(finite)
        .filter(|p| p.strategy == Strategy::BatchDma && p.launch.is_none() && p.ring.is_none())
        .collect();
    let without: Vec<&CudaPoint> = batch
        .iter()
        .copied()
        .filter(|p| !p.prefer_overlap)
        .collect();
    let with: Vec<&CudaPoint> = batch.iter().copied().filter(|p| p.prefer_overlap).collect();
    if !with.is_empty() && best_variant(&without, &[(true, with)], policy).is_some() {
        tuning.batch_prefer_overlap = Some(true);
    }

    // Ring depth: pipelined jobs; the smallest depth within the margin of
    // the best (deeper rings cost pinned staging and graphs).
    let mut depths: Vec<u32> = points.iter().filter_map(|p| p.ring.map(|r| r.0)).collect();
    depths.sort_unstable();
    depths.dedup();
    let pipelined: Vec<&CudaPoint> = points
        .iter()
        .filter(finite)
        .filter(|p| p.ring.is_some())
        .collect();
    let score = |depth: u32| {
        let ratios: Vec<f64> = pipelined
            .iter()
            .filter(|p| p.ring.is_some_and(|r| r.0 == depth))
            .filter_map(|p| {
                let best = pipelined
                    .iter()
                    .filter(|q| place(q) == place(p))
                    .map(|q| q.gbps)
                    .fold(0.0, f64::max);
                (best > 0.0).then(|| p.gbps / best)
            })
            .collect();
        geomean(&ratios)
    };
    if let Some(&depth) = depths
        .iter()
        .find(|&&d| score(d).is_some_and(|s| s >= 1.0 - MARGIN))
        && depth as usize != CudaBackendOptions::default().ring_slots
    {
        tuning.ring_slots = Some(depth as usize);
    }
    tuning
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::bench::cuda::test_point;
    use Direction::{Load, Store};

    fn p(direction: Direction, blocks: u32, strategy: Strategy, gbps: f64) -> CudaPoint {
        test_point(direction, 16 << 10, blocks, strategy, gbps)
    }

    fn shaped(mut q: CudaPoint, ctas: u32) -> CudaPoint {
        q.launch = Some(LaunchVariant {
            ctas,
            max_piece_bytes: 16 << 10,
        });
        q
    }

    #[test]
    fn nothing_measured_nothing_tuned() {
        let points = [p(Store, 64, Strategy::Kernel, 10.0)];
        assert!(calibrated_tuning(&points, CalibrationPolicy::default()).is_empty());
        assert!(calibrated_tuning(&[], CalibrationPolicy::default()).is_empty());
    }

    #[test]
    fn the_launch_shape_that_beats_the_default_everywhere_is_chosen() {
        let k = Strategy::Kernel;
        let points = [
            p(Store, 64, k, 10.0),
            p(Load, 64, k, 20.0),
            shaped(p(Store, 64, k, 15.0), 32),
            shaped(p(Load, 64, k, 30.0), 32),
            shaped(p(Store, 64, k, 11.0), 16),
            shaped(p(Load, 64, k, 19.0), 16),
        ];
        let t = calibrated_tuning(&points, CalibrationPolicy::default());
        assert_eq!(t.kernel_ctas, Some(32));
        assert_eq!(t.kernel_max_piece_bytes, Some(16 << 10));
        // Within the margin of the default: not worth a change.
        let close = [p(Store, 64, k, 10.0), shaped(p(Store, 64, k, 10.1), 32)];
        assert!(calibrated_tuning(&close, CalibrationPolicy::default()).is_empty());
    }

    #[test]
    fn under_contention_a_shape_that_slows_compute_too_much_is_not_chosen() {
        let k = Strategy::Kernel;
        let contended = |mut q: CudaPoint, rate: f64, slow: f64| {
            q.contended_gbps = Some(rate);
            q.compute_slowdown = Some(slow);
            q
        };
        let points = [
            contended(p(Store, 64, k, 10.0), 8.0, 0.02),
            contended(shaped(p(Store, 64, k, 30.0), 64), 25.0, 0.30),
            contended(shaped(p(Store, 64, k, 12.0), 4), 9.0, 0.01),
        ];
        let t = calibrated_tuning(&points, CalibrationPolicy::default());
        assert_eq!(t.kernel_ctas, Some(4), "64 CTAs slow compute by 30 %");
    }

    #[test]
    fn prefer_overlap_is_set_only_where_it_helped() {
        let b = Strategy::BatchDma;
        let mut on = p(Store, 64, b, 30.0);
        on.prefer_overlap = true;
        let points = [p(Store, 64, b, 20.0), on];
        let t = calibrated_tuning(&points, CalibrationPolicy::default());
        assert_eq!(t.batch_prefer_overlap, Some(true));
        let mut worse = p(Store, 64, b, 15.0);
        worse.prefer_overlap = true;
        let t = calibrated_tuning(
            &[p(Store, 64, b, 20.0), worse],
            CalibrationPolicy::default(),
        );
        assert_eq!(t.batch_prefer_overlap, None);
    }

    #[test]
    fn the_smallest_ring_within_the_margin_of_the_best_is_chosen() {
        let g = Strategy::KernelGraph;
        let ring = |depth: u32, gbps: f64| {
            let mut q = p(Store, 64, g, gbps);
            q.ring = Some((depth, 0));
            q
        };
        let points = [ring(2, 10.0), ring(4, 15.0), ring(8, 20.0), ring(16, 20.1)];
        let t = calibrated_tuning(&points, CalibrationPolicy::default());
        assert_eq!(t.ring_slots, Some(8));
        // The default depth (4) winning leaves the field absent.
        let points = [ring(2, 10.0), ring(4, 20.0), ring(8, 20.0)];
        assert_eq!(
            calibrated_tuning(&points, CalibrationPolicy::default()).ring_slots,
            None
        );
    }
}
