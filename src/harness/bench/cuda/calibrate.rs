//! The calibrated strategy table: per direction, a grid over the measured
//! descriptor sizes and descriptor counts (cross-layer and per-layer points
//! together: a per-layer block is one descriptor per tensor), each cell
//! taking the strategy that won at the nearest measured point. Where the
//! sweep ran with `--contend`, a strategy that slowed the model by more than
//! the policy allows wins only where none stayed within it. The table's
//! `tuning` comes from the measured variants ([`super::tune`]).

use crate::Direction;
use crate::worker::cuda::{Strategy, StrategyRule, StrategyTable};

use super::CudaPoint;
use super::tune::calibrated_tuning;

/// How calibration weighs what a strategy costs the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CalibrationPolicy {
    /// Largest model slowdown (0.05: 5 %) a strategy may cause, where the
    /// sweep measured it, to be chosen on its copy rate under contention.
    pub max_compute_slowdown: f64,
}

impl Default for CalibrationPolicy {
    fn default() -> Self {
        Self {
            max_compute_slowdown: 0.05,
        }
    }
}

/// A measured point's place in the grid: (bytes per descriptor, descriptors).
fn key(p: &CudaPoint) -> (u64, u64) {
    let tensors = u64::from(p.tensors.max(1));
    (p.block_bytes / tensors, u64::from(p.blocks) * tensors)
}

fn log2(x: u64) -> f64 {
    (x.max(1) as f64).log2()
}

/// The winner among one key's points (one per strategy).
fn winner(points: &[&CudaPoint], policy: CalibrationPolicy) -> Option<Strategy> {
    let contended: Vec<&&CudaPoint> = points
        .iter()
        .filter(|p| p.compute_slowdown.is_some_and(f64::is_finite))
        .collect();
    if contended.is_empty() {
        return points
            .iter()
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
            .map(|p| p.strategy);
    }
    let rate = |p: &CudaPoint| p.contended_gbps.unwrap_or(p.gbps);
    let within: Vec<&&CudaPoint> = contended
        .iter()
        .copied()
        .filter(|p| p.compute_slowdown.unwrap_or(f64::INFINITY) <= policy.max_compute_slowdown)
        .collect();
    if within.is_empty() {
        contended
            .iter()
            .min_by(|a, b| {
                let sa = a.compute_slowdown.unwrap_or(f64::INFINITY);
                let sb = b.compute_slowdown.unwrap_or(f64::INFINITY);
                sa.total_cmp(&sb)
            })
            .map(|p| p.strategy)
    } else {
        within
            .iter()
            .max_by(|a, b| rate(a).total_cmp(&rate(b)))
            .map(|p| p.strategy)
    }
}

/// The table calibrated from `points` (those of the backend's default
/// options, measured one job at a time; points of other launch shapes, with
/// `prefer_overlap` or pipelined through a ring are reported, not used here). Every cell between measured
/// sizes and counts gets a rule, so the fallback serves only a direction
/// without any measured point.
pub fn calibrated_table(points: &[CudaPoint], policy: CalibrationPolicy) -> StrategyTable {
    let mut rules = Vec::new();
    for dir in Direction::ALL {
        let usable: Vec<&CudaPoint> = points
            .iter()
            .filter(|p| {
                p.direction == dir
                    && p.launch.is_none()
                    && !p.prefer_overlap
                    && p.ring.is_none()
                    && p.gbps.is_finite()
            })
            .collect();
        let mut keys: Vec<(u64, u64)> = usable.iter().map(|p| key(p)).collect();
        keys.sort_unstable();
        keys.dedup();
        let mut sizes: Vec<u64> = keys.iter().map(|k| k.0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut counts: Vec<u64> = keys.iter().map(|k| k.1).collect();
        counts.sort_unstable();
        counts.dedup();
        for (si, &size) in sizes.iter().enumerate() {
            for (ci, &count) in counts.iter().enumerate() {
                let distance = |k: &(u64, u64)| {
                    let ds = log2(k.0) - log2(size);
                    let dc = log2(k.1) - log2(count);
                    ds * ds + dc * dc
                };
                let Some(nearest) = keys
                    .iter()
                    .min_by(|a, b| distance(a).total_cmp(&distance(b)))
                else {
                    continue;
                };
                let at: Vec<&CudaPoint> = usable
                    .iter()
                    .copied()
                    .filter(|p| key(p) == *nearest)
                    .collect();
                let Some(strategy) = winner(&at, policy) else {
                    continue;
                };
                rules.push(StrategyRule {
                    direction: Some(dir),
                    min_bytes_per_descriptor: if si == 0 { 0 } else { size },
                    max_bytes_per_descriptor: sizes.get(si + 1).map(|n| n - 1),
                    min_descriptors: if ci == 0 { 0 } else { count as usize },
                    max_descriptors: counts.get(ci + 1).map(|&n| n as usize - 1),
                    strategy,
                });
            }
        }
    }
    StrategyTable {
        rules,
        fallback: StrategyTable::default().fallback,
        tuning: calibrated_tuning(points, policy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::bench::cuda::{LaunchVariant, test_point as p};
    use Direction::{Load, Store};
    use Strategy::{BatchDma, Dma, Kernel, KernelGraph};

    fn table(points: &[CudaPoint]) -> StrategyTable {
        calibrated_table(points, CalibrationPolicy::default())
    }

    #[test]
    fn the_fastest_strategy_wins_its_point_and_the_ranges_around_it() {
        let points = [
            p(Store, 4096, 64, Dma, 1.0),
            p(Store, 4096, 64, KernelGraph, 9.0),
            p(Store, 4096, 1024, Kernel, 20.0),
            p(Store, 4096, 1024, Dma, 2.0),
            p(Store, 1 << 20, 64, BatchDma, 50.0),
            p(Store, 1 << 20, 64, Kernel, f64::NAN),
            p(Store, 1 << 20, 1024, BatchDma, 52.0),
            p(Load, 4096, 64, Dma, 3.0),
        ];
        let t = table(&points);
        assert_eq!(t.choose(Store, 4096, 64), KernelGraph);
        assert_eq!(t.choose(Store, 100, 8), KernelGraph, "below the smallest");
        assert_eq!(t.choose(Store, 8192, 1023), KernelGraph);
        assert_eq!(
            t.choose(Store, 4096, 5000),
            Kernel,
            "above the largest count"
        );
        assert_eq!(t.choose(Store, 2 << 20, 64), BatchDma);
        assert_eq!(t.choose(Store, 1 << 20, 1024), BatchDma);
        // Load measured at one point: it covers every load.
        assert_eq!(t.choose(Load, 4096, 64), Dma);
        assert_eq!(t.choose(Load, 1 << 20, 4096), Dma);
        assert!(t.validate().is_ok());
        assert!(table(&[]).rules.is_empty());
        assert_eq!(table(&[]).fallback, StrategyTable::default().fallback);
    }

    #[test]
    fn per_layer_points_are_placed_by_descriptor_and_fill_unmeasured_cells() {
        // Cross-layer 64 KiB x 64 blocks: 64 descriptors of 64 KiB.
        // Per-layer 64 KiB over 16 tensors x 1024 blocks: 16,384 of 4 KiB.
        let mut per_layer = p(Store, 64 << 10, 1024, Kernel, 30.0);
        per_layer.tensors = 16;
        let mut per_layer_dma = p(Store, 64 << 10, 1024, Dma, 3.0);
        per_layer_dma.tensors = 16;
        let points = [p(Store, 64 << 10, 64, Dma, 40.0), per_layer, per_layer_dma];
        let t = table(&points);
        assert_eq!(t.choose(Store, 64 << 10, 64), Dma);
        assert_eq!(t.choose(Store, 4 << 10, 16_384), Kernel);
        // (4 KiB, 64) and (64 KiB, 16,384) were never measured: the nearest
        // point in log2 steps wins (4 size steps beat 8 count steps).
        assert_eq!(t.choose(Store, 4 << 10, 100), Dma);
        assert_eq!(t.choose(Store, 64 << 10, 20_000), Kernel);
        assert_eq!(t.choose(Store, 60 << 10, 70), Dma);
        assert!(t.validate().is_ok());
    }

    #[test]
    fn under_contention_the_fastest_strategy_within_the_slowdown_wins() {
        let with = |mut q: CudaPoint, gbps: f64, slow: f64| {
            q.contended_gbps = Some(gbps);
            q.compute_slowdown = Some(slow);
            q
        };
        // The kernel is fastest alone and under contention, but slows the
        // model by 20 %; batch DMA stays within 5 %.
        let points = [
            with(p(Load, 16 << 10, 256, Kernel, 45.0), 40.0, 0.20),
            with(p(Load, 16 << 10, 256, BatchDma, 30.0), 28.0, 0.01),
            with(p(Load, 16 << 10, 256, Dma, 10.0), 9.0, 0.00),
        ];
        assert_eq!(table(&points).choose(Load, 16 << 10, 256), BatchDma);
        // A looser policy lets the kernel win.
        let loose = CalibrationPolicy {
            max_compute_slowdown: 0.25,
        };
        assert_eq!(
            calibrated_table(&points, loose).choose(Load, 16 << 10, 256),
            Kernel
        );
        // When every strategy slows the model too much, the gentlest wins.
        let all_slow = [
            with(p(Load, 16 << 10, 256, Kernel, 45.0), 40.0, 0.30),
            with(p(Load, 16 << 10, 256, Dma, 10.0), 9.0, 0.10),
        ];
        assert_eq!(table(&all_slow).choose(Load, 16 << 10, 256), Dma);
    }

    #[test]
    fn points_of_other_backend_options_do_not_choose_the_strategy() {
        let mut wide = p(Store, 4096, 64, Kernel, 99.0);
        wide.launch = Some(LaunchVariant {
            ctas: 64,
            max_piece_bytes: 16 << 10,
        });
        let mut overlapped = p(Store, 4096, 64, BatchDma, 80.0);
        overlapped.prefer_overlap = true;
        let mut pipelined = p(Store, 4096, 64, KernelGraph, 70.0);
        pipelined.ring = Some((16, 0));
        let points = [p(Store, 4096, 64, Dma, 5.0), wide, overlapped, pipelined];
        assert_eq!(table(&points).choose(Store, 4096, 64), Dma);
    }
}
