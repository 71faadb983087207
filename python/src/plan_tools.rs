//! Readers of a step plan's bytes and of kvoffload's keys (tests, tools).

use kvoffload::worker::{TransferSpec, decode_plan};
use pyo3::prelude::*;

use crate::convert::{block_hash, value_error};

/// The jobs of an encoded plan: `(loads, stores, flush)` job ids (tests, debugging).
#[pyfunction]
pub(crate) fn plan_jobs(plan: &[u8]) -> PyResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let p = decode_plan(plan).map_err(value_error)?;
    Ok((
        p.loads.iter().map(|l| l.job.0).collect(),
        p.stores.iter().map(|s| s.job.0).collect(),
        p.flush.iter().map(|j| j.0).collect(),
    ))
}

/// The synchronous loads of an encoded plan (no request to report to: the
/// workers finish them within the step), by job id (tests, debugging).
#[pyfunction]
pub(crate) fn plan_sync_loads(plan: &[u8]) -> PyResult<Vec<u64>> {
    let p = decode_plan(plan).map_err(value_error)?;
    Ok(p.loads
        .iter()
        .filter(|l| l.request.is_none())
        .map(|l| l.job.0)
        .collect())
}

/// A step plan's transfers with their GPU blocks, for tests and tools:
/// `(loads, stores, flush)`, each load and store as `(job, gpu_blocks)`.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn plan_transfers(
    plan: &[u8],
) -> PyResult<(Vec<(u64, Vec<u32>)>, Vec<(u64, Vec<u32>)>, Vec<u64>)> {
    let p = decode_plan(plan).map_err(value_error)?;
    let blocks = |s: &TransferSpec| s.gpu_blocks.iter().map(|b| b.0).collect();
    Ok((
        p.loads.iter().map(|l| (l.job.0, blocks(&l.spec))).collect(),
        p.stores
            .iter()
            .map(|s| (s.job.0, blocks(&s.spec)))
            .collect(),
        p.flush.iter().map(|j| j.0).collect(),
    ))
}

/// A job's GPU blocks per KV group, as vLLM lists a transfer's: per group
/// `[first block index, block ids...]` (one group: the spec's own), holes
/// (null blocks kept in place in kvoffload's spec) left out as vLLM's spec
/// leaves them.
fn group_blocks(s: &TransferSpec) -> Vec<Vec<u32>> {
    if s.groups.is_empty() {
        let mut one = vec![s.first_block_index];
        one.extend(s.gpu_blocks.iter().map(|b| b.0));
        return vec![one];
    }
    let mut at = 0;
    s.groups
        .iter()
        .map(|g| {
            let n = g.num_blocks as usize;
            let mut out = vec![g.first_block_index];
            out.extend(
                s.gpu_blocks
                    .iter()
                    .skip(at)
                    .take(n)
                    .map(|b| b.0)
                    .filter(|&b| b != 0),
            );
            at += n;
            out
        })
        .collect()
}

/// A step plan's loads and stores with their GPU blocks per KV group, for
/// tests and tools: `(loads, stores)`, each as `(job, [[first block index,
/// block ids...] per group])`.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn plan_group_transfers(
    plan: &[u8],
) -> PyResult<(Vec<(u64, Vec<Vec<u32>>)>, Vec<(u64, Vec<Vec<u32>>)>)> {
    let p = decode_plan(plan).map_err(value_error)?;
    Ok((
        p.loads
            .iter()
            .map(|l| (l.job.0, group_blocks(&l.spec)))
            .collect(),
        p.stores
            .iter()
            .map(|s| (s.job.0, group_blocks(&s.spec)))
            .collect(),
    ))
}

/// A step plan decoded, in Rust's debug form: every job with its GPU
/// blocks, host chunks and keys, the fetches and evictions (debugging).
#[pyfunction]
pub(crate) fn plan_debug(plan: &[u8]) -> PyResult<String> {
    Ok(format!("{:?}", decode_plan(plan).map_err(value_error)?))
}

/// The key kvoffload gives a block hash (for tests and events).
#[pyfunction]
pub(crate) fn chunk_key(block_hash: Vec<u8>) -> u64 {
    block_hash_to_key(&block_hash)
}

fn block_hash_to_key(h: &[u8]) -> u64 {
    block_hash(h).0
}

#[cfg(test)]
mod tests {
    use kvoffload::worker::{LoadJob, StoreJob, WorkerPlan, encode_plan};
    use kvoffload::{ChunkKey, JobId, RequestId};

    use super::*;

    #[test]
    fn an_encoded_plan_reads_back_as_its_jobs_and_blocks() {
        let plan = WorkerPlan {
            loads: vec![LoadJob {
                job: JobId(4),
                request: Some(RequestId(1)),
                spec: TransferSpec::new(&[7, 8], 0, &[2]),
            }],
            stores: vec![StoreJob {
                job: JobId(5),
                spec: TransferSpec::new(&[9], 0, &[3]),
                keys: vec![ChunkKey(11)],
            }],
            flush: vec![JobId(2)],
            ..WorkerPlan::default()
        };
        let mut bytes = Vec::new();
        encode_plan(&plan, &mut bytes);
        assert_eq!(plan_jobs(&bytes).ok(), Some((vec![4], vec![5], vec![2])));
        assert_eq!(
            plan_transfers(&bytes).ok(),
            Some((vec![(4, vec![7, 8])], vec![(5, vec![9])], vec![2]))
        );
        assert_eq!(
            plan_group_transfers(&bytes).ok(),
            Some((vec![(4, vec![vec![0, 7, 8]])], vec![(5, vec![vec![0, 9]])]))
        );
        assert!(
            plan_jobs(&bytes[..bytes.len() - 1]).is_err(),
            "a truncated plan is refused"
        );
        assert!(plan_jobs(b"nope").is_err(), "foreign bytes are refused");
    }

    #[test]
    fn a_job_over_several_groups_lists_each_group_s_blocks() {
        use kvoffload::scheduler::GroupSpan;
        let span = |num_keys, num_blocks, first_block_index| GroupSpan {
            num_keys,
            num_blocks,
            first_block_index,
        };
        let plan = WorkerPlan {
            stores: vec![StoreJob {
                job: JobId(5),
                spec: TransferSpec {
                    groups: vec![span(2, 2, 0), span(1, 1, 3), span(0, 0, 0)],
                    ..TransferSpec::new(&[7, 8, 9], 0, &[1, 2, 3])
                },
                keys: vec![ChunkKey(1), ChunkKey(2), ChunkKey(3)],
            }],
            ..WorkerPlan::default()
        };
        let mut bytes = Vec::new();
        encode_plan(&plan, &mut bytes);
        assert_eq!(
            plan_group_transfers(&bytes).ok(),
            Some((vec![], vec![(5, vec![vec![0, 7, 8], vec![3, 9], vec![0]])]))
        );
    }

    #[test]
    fn the_key_of_a_hash_is_the_binding_s_block_hash() {
        let h = vec![1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(chunk_key(h.clone()), block_hash(&h).0);
    }
}
