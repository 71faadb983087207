//! What a CUDA sweep measured: one point per (direction, block size, count,
//! tensors, strategy, variant), and the output's bench rows.

use crate::Direction;
use crate::worker::cuda::{CudaBackendStats, Strategy};

use super::super::BenchRow;
use super::geometry::Geometry;
use super::sweep::{LaunchVariant, PIPELINE};

/// One measured (direction, block size, count, tensors, strategy) point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CudaPoint {
    /// Direction.
    pub direction: Direction,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks per job.
    pub blocks: u32,
    /// Tensors per block (1: cross-layer).
    pub tensors: u32,
    /// The strategy forced for this point.
    pub strategy: Strategy,
    /// GB/s over the best job's device time (events).
    pub gbps: f64,
    /// Best host time to submit one job, microseconds.
    pub submit_us: f64,
    /// Best device time of one job, microseconds.
    pub device_us: f64,
    /// Bytes of the last job compared with the pattern and found equal
    /// (`None`: not checked).
    pub verified_bytes: Option<u64>,
    /// GB/s (all jobs' bytes over their device time) beside the compute
    /// train (`None`: not measured).
    pub contended_gbps: Option<f64>,
    /// The compute train's slowdown while the copies ran (0.1: 10 % longer).
    pub compute_slowdown: Option<f64>,
    /// The kernel launch shape, where not the default.
    pub launch: Option<LaunchVariant>,
    /// Measured with `batch_prefer_overlap` on (batch DMA only).
    pub prefer_overlap: bool,
    /// Measured pipelined with this ring depth (and the staging waits the
    /// jobs met): GB/s is then [`PIPELINE`] jobs' bytes over their wall time.
    pub ring: Option<(u32, u64)>,
}

impl CudaPoint {
    /// A point of `strategy` at `g` with the backend's default options and
    /// only its rates measured (the variants, checks and contention are set
    /// by the caller).
    pub(super) fn measured(
        direction: Direction,
        g: Geometry,
        strategy: Strategy,
        gbps: f64,
        submit_us: f64,
        device_us: f64,
    ) -> Self {
        Self {
            direction,
            block_bytes: g.block,
            blocks: g.count,
            tensors: g.tensors,
            strategy,
            gbps,
            submit_us,
            device_us,
            verified_bytes: None,
            contended_gbps: None,
            compute_slowdown: None,
            launch: None,
            prefer_overlap: false,
            ring: None,
        }
    }
}

/// A point for the unit tests: `blocks` blocks of `block_bytes`, cross-layer,
/// 1 µs per submit and job.
#[cfg(test)]
pub(crate) fn test_point(
    direction: Direction,
    block_bytes: u64,
    blocks: u32,
    strategy: Strategy,
    gbps: f64,
) -> CudaPoint {
    let g = Geometry {
        block: block_bytes,
        count: blocks,
        tensors: 1,
        page: block_bytes,
        tensor_span: block_bytes * (2 * u64::from(blocks) + 1),
    };
    CudaPoint::measured(direction, g, strategy, gbps, 1.0, 1.0)
}

/// What a CUDA sweep measured.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaSweepOutput {
    /// The device's name.
    pub device: String,
    /// The ceiling per direction (`Direction::index`), GB/s.
    pub ceiling_gbps: [f64; 2],
    /// Every measured point.
    pub points: Vec<CudaPoint>,
    /// The backend's counters per (block size, count, tensors) after its jobs.
    pub stats: Vec<(u64, u32, u32, CudaBackendStats)>,
    /// Jobs whose bytes differed from the pattern, described (empty: all
    /// checked jobs were right).
    pub mismatches: Vec<String>,
    /// Whether contention was measured (`false` where it was asked for but
    /// the burn kernel was not built).
    pub contended: bool,
    /// Where the pinned pool was placed (its NUMA node), one line.
    pub host_placement: String,
}

impl CudaSweepOutput {
    /// The points as bench rows (`backend = "cuda"`, the strategy's name).
    pub fn rows(&self) -> Vec<BenchRow> {
        self.points
            .iter()
            .map(|p| {
                let ceiling = self.ceiling_gbps[p.direction.index()];
                BenchRow {
                    backend: "cuda".into(),
                    strategy: p.strategy.name().into(),
                    direction: p.direction.to_string(),
                    block_bytes: p.block_bytes,
                    blocks: p.blocks,
                    gbps: p.gbps,
                    ceiling_gbps: ceiling,
                    fraction_of_ceiling: if ceiling > 0.0 { p.gbps / ceiling } else { 0.0 },
                    submit_us: Some(p.submit_us),
                    tensors: Some(p.tensors),
                    verified_bytes: p.verified_bytes,
                    contended_gbps: p.contended_gbps,
                    compute_slowdown: p.compute_slowdown,
                    launch: match (p.ring, p.prefer_overlap) {
                        (Some((depth, waits)), _) => Some(format!(
                            "ring={depth},pipelined={PIPELINE},staging_waits={waits}"
                        )),
                        (None, true) => Some("prefer_overlap".into()),
                        (None, false) => p.launch.map(|l| l.label()),
                    },
                }
            })
            .collect()
    }

    /// Per (direction, block size, count), the launch shape (default or a
    /// variant) whose `kernel` job was fastest, where variants were measured.
    pub fn best_launches(&self) -> Vec<(Direction, u64, u32, Option<LaunchVariant>, f64)> {
        let mut out: Vec<(Direction, u64, u32, Option<LaunchVariant>, f64)> = Vec::new();
        for p in self
            .points
            .iter()
            .filter(|p| p.strategy == Strategy::Kernel && p.tensors == 1 && p.gbps.is_finite())
        {
            let measured_variants = self.points.iter().any(|q| {
                q.launch.is_some()
                    && q.direction == p.direction
                    && q.block_bytes == p.block_bytes
                    && q.blocks == p.blocks
            });
            if !measured_variants {
                continue;
            }
            match out
                .iter_mut()
                .find(|o| o.0 == p.direction && o.1 == p.block_bytes && o.2 == p.blocks)
            {
                Some(o) if o.4 >= p.gbps => {}
                Some(o) => {
                    o.3 = p.launch;
                    o.4 = p.gbps;
                }
                None => out.push((p.direction, p.block_bytes, p.blocks, p.launch, p.gbps)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    fn point(direction: Direction, strategy: Strategy, gbps: f64) -> CudaPoint {
        CudaPoint {
            verified_bytes: Some(4096 * 64),
            ..test_point(direction, 4096, 64, strategy, gbps)
        }
    }
    #[test]
    fn rows_carry_the_same_run_ceiling_and_the_checked_bytes() {
        let mut contended = point(Direction::Load, Strategy::Dma, 10.0);
        contended.contended_gbps = Some(8.0);
        contended.compute_slowdown = Some(0.02);
        contended.launch = Some(LaunchVariant {
            ctas: 16,
            max_piece_bytes: 65536,
        });
        let mut overlapped = point(Direction::Store, Strategy::BatchDma, 30.0);
        overlapped.prefer_overlap = true;
        let mut ring = point(Direction::Load, Strategy::KernelGraph, 35.0);
        ring.ring = Some((8, 2));
        let out = CudaSweepOutput {
            device: "x".into(),
            ceiling_gbps: [50.0, 40.0],
            points: vec![
                point(Direction::Store, Strategy::Kernel, 25.0),
                contended,
                overlapped,
                ring,
            ],
            stats: Vec::new(),
            mismatches: Vec::new(),
            contended: true,
            host_placement: String::new(),
        };
        let rows = out.rows();
        assert_eq!(rows[0].backend, "cuda");
        assert_eq!(rows[0].strategy, "kernel");
        assert_eq!(rows[0].direction, "store");
        assert_eq!(rows[0].fraction_of_ceiling, 0.5);
        assert_eq!(rows[0].verified_bytes, Some(4096 * 64));
        assert_eq!(rows[0].tensors, Some(1));
        assert_eq!(rows[1].ceiling_gbps, 40.0);
        assert_eq!(rows[1].fraction_of_ceiling, 0.25);
        assert_eq!(rows[1].contended_gbps, Some(8.0));
        assert_eq!(rows[1].compute_slowdown, Some(0.02));
        assert_eq!(rows[1].launch.as_deref(), Some("ctas=16,piece=65536"));
        assert_eq!(rows[2].launch.as_deref(), Some("prefer_overlap"));
        assert_eq!(
            rows[3].launch.as_deref(),
            Some("ring=8,pipelined=16,staging_waits=2")
        );
        assert_eq!(rows[0].launch, None);
    }
    #[test]
    fn the_best_launch_shape_is_reported_per_point_where_variants_ran() {
        let mut default = point(Direction::Store, Strategy::Kernel, 20.0);
        let mut wide = default;
        wide.launch = Some(LaunchVariant {
            ctas: 32,
            max_piece_bytes: 16 << 10,
        });
        wide.gbps = 30.0;
        let mut narrow = default;
        narrow.launch = Some(LaunchVariant {
            ctas: 4,
            max_piece_bytes: 256 << 10,
        });
        narrow.gbps = 10.0;
        let mut other = point(Direction::Load, Strategy::Kernel, 5.0);
        other.blocks = 1024;
        let out = CudaSweepOutput {
            device: "x".into(),
            ceiling_gbps: [50.0, 50.0],
            points: vec![default, wide, narrow, other],
            stats: Vec::new(),
            mismatches: Vec::new(),
            contended: false,
            host_placement: String::new(),
        };
        let best = out.best_launches();
        assert_eq!(best.len(), 1, "only where variants ran: {best:?}");
        assert_eq!(best[0].3, wide.launch);
        default.gbps = 40.0;
        let out = CudaSweepOutput {
            points: vec![default, wide, narrow],
            ..out
        };
        assert_eq!(out.best_launches()[0].3, None, "the default shape can win");
    }
}
