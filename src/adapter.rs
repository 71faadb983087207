//! Translation between the control plane's types ([`crate::scheduler::StepPlan`],
//! [`crate::scheduler::CompletionReport`]) and the data plane's
//! ([`crate::worker::WorkerPlan`], [`crate::worker::WorkerReport`]).

use std::collections::BTreeMap;

use crate::ids::{JobId, RequestId};
use crate::scheduler::{self, TransferJob};
use crate::worker::{self, FetchJob, LoadJob, SpecParts, StoreJob, TransferSpec};

fn spec_parts(job: &TransferJob, blocks_per_chunk: u32) -> SpecParts<'_> {
    let bpc = blocks_per_chunk.max(1) as usize;
    // A job starting inside its first chunk skips that chunk's leading
    // blocks; a job over several groups carries each group's start in its
    // spans (the spec's own is unused: 0).
    let skip = if job.groups.is_empty() {
        (job.keys.len() * bpc).saturating_sub(job.block_ids.len())
    } else {
        0
    };
    SpecParts {
        gpu_blocks: &job.block_ids,
        first_block_index: skip as u32,
        chunks: &job.chunk_ids,
        groups: &job.groups,
    }
}

fn spec(job: &TransferJob, blocks_per_chunk: u32) -> TransferSpec {
    let p = spec_parts(job, blocks_per_chunk);
    TransferSpec {
        gpu_blocks: p.gpu_blocks.to_vec(),
        first_block_index: p.first_block_index,
        chunks: p.chunks.to_vec(),
        groups: p.groups.to_vec(),
    }
}

/// Encodes the workers' plan for a scheduler step ([`worker::encode_plan`]
/// of [`to_worker_plan`], the same bytes) without building it first: no
/// allocation per job.
pub fn encode_worker_plan(plan: &scheduler::StepPlan, blocks_per_chunk: u32, out: &mut Vec<u8>) {
    worker::encode_plan_parts(
        plan.loads.iter().map(|j| {
            (
                j.job,
                load_request(plan, j),
                spec_parts(j, blocks_per_chunk),
            )
        }),
        plan.stores
            .iter()
            .map(|j| (j.job, spec_parts(j, blocks_per_chunk), j.keys.as_slice())),
        &plan.flush,
        plan.fetches
            .iter()
            .map(|j| (j.job, j.keys.as_slice(), j.chunk_ids.as_slice())),
        &plan.evictions,
        out,
    );
}

/// The request a load reports to when it ends: `None` for a synchronous load
/// (the workers wait for it within the step; its request is already running).
fn load_request(plan: &scheduler::StepPlan, j: &scheduler::TransferJob) -> Option<RequestId> {
    (plan.sync_loads.binary_search(&j.job).is_err()).then_some(j.req)
}

/// The plan every worker receives for a scheduler step (loads carry their
/// request, synchronous loads none).
pub fn to_worker_plan(plan: &scheduler::StepPlan, blocks_per_chunk: u32) -> worker::WorkerPlan {
    worker::WorkerPlan {
        loads: plan
            .loads
            .iter()
            .map(|j| LoadJob {
                job: j.job,
                request: load_request(plan, j),
                spec: spec(j, blocks_per_chunk),
            })
            .collect(),
        stores: plan
            .stores
            .iter()
            .map(|j| StoreJob {
                job: j.job,
                spec: spec(j, blocks_per_chunk),
                keys: j.keys.to_vec(),
            })
            .collect(),
        flush: plan.flush.clone(),
        fetches: plan
            .fetches
            .iter()
            .map(|j| FetchJob {
                job: j.job,
                keys: j.keys.to_vec(),
                chunks: j.chunk_ids.to_vec(),
            })
            .collect(),
        evictions: plan.evictions.clone(),
    }
}

/// Sums worker reports into the scheduler's report: counts per job added up,
/// failed jobs listed once (ascending job ids).
pub fn merge_reports<'a>(
    reports: impl IntoIterator<Item = &'a worker::WorkerReport>,
) -> scheduler::CompletionReport {
    let mut completed: BTreeMap<JobId, u32> = BTreeMap::new();
    let mut failed: Vec<JobId> = Vec::new();
    for r in reports {
        for (&job, &n) in &r.completed {
            *completed.entry(job).or_insert(0) += n;
        }
        failed.extend_from_slice(&r.failed);
    }
    failed.sort_unstable();
    failed.dedup();
    scheduler::CompletionReport {
        completed: completed.into_iter().collect(),
        failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{ChunkId, GpuBlockId};
    use crate::key::ChunkKey;

    #[test]
    fn unaligned_load_skips_leading_blocks_and_reports_sum() {
        let j = TransferJob {
            job: JobId(3),
            req: RequestId(1),
            block_ids: smallvec::smallvec![GpuBlockId(7)],
            chunk_ids: smallvec::smallvec![ChunkId(2)],
            keys: smallvec::smallvec![ChunkKey(9)],
            groups: Vec::new(),
        };
        let plan = scheduler::StepPlan {
            loads: vec![j],
            ..Default::default()
        };
        let w = to_worker_plan(&plan, 2);
        assert_eq!(w.loads[0].spec.first_block_index, 1);
        assert_eq!(w.loads[0].request, Some(RequestId(1)));
        let sync = scheduler::StepPlan {
            sync_loads: vec![JobId(3)],
            ..plan.clone()
        };
        assert_eq!(
            to_worker_plan(&sync, 2).loads[0].request,
            None,
            "a synchronous load reports to no request"
        );
        let mut a = worker::WorkerReport::default();
        a.completed.insert(JobId(3), 1);
        a.failed.push(JobId(3));
        let mut b = worker::WorkerReport::default();
        b.completed.insert(JobId(3), 1);
        let m = merge_reports([&a, &b]);
        assert_eq!(m.completed, vec![(JobId(3), 2)]);
        assert_eq!(m.failed, vec![JobId(3)]);
    }

    #[test]
    fn the_direct_encoding_is_the_bytes_of_the_worker_plan() {
        let job = |id: u64, blocks: &[u32], chunks: &[u32]| TransferJob {
            job: JobId(id),
            req: RequestId(id + 100),
            block_ids: blocks.iter().map(|&b| GpuBlockId(b)).collect(),
            chunk_ids: chunks.iter().map(|&c| ChunkId(c)).collect(),
            keys: chunks.iter().map(|&c| ChunkKey(u64::from(c) + 7)).collect(),
            groups: Vec::new(),
        };
        let plans = [
            scheduler::StepPlan::default(),
            scheduler::StepPlan {
                loads: vec![job(1, &[5, 6, 7], &[2, 3]), job(2, &[9, 10], &[4])],
                stores: vec![job(3, &[1, 2, 3, 4], &[8, 9]), job(4, &[11], &[1])],
                flush: vec![JobId(1), JobId(3)],
                failed_loads: vec![RequestId(5)],
                fetches: vec![job(5, &[], &[6, 7])],
                evictions: vec![(ChunkKey(70), ChunkId(3))],
                sync_loads: vec![JobId(2)],
            },
        ];
        for plan in &plans {
            let (mut direct, mut built) = (Vec::new(), Vec::new());
            encode_worker_plan(plan, 2, &mut direct);
            worker::encode_plan(&to_worker_plan(plan, 2), &mut built);
            assert_eq!(direct, built);
            assert_eq!(
                worker::decode_plan(&direct).unwrap(),
                to_worker_plan(plan, 2)
            );
        }
    }
}
