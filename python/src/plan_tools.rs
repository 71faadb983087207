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
        assert!(
            plan_jobs(&bytes[..bytes.len() - 1]).is_err(),
            "a truncated plan is refused"
        );
        assert!(plan_jobs(b"nope").is_err(), "foreign bytes are refused");
    }

    #[test]
    fn the_key_of_a_hash_is_the_binding_s_block_hash() {
        let h = vec![1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(chunk_key(h.clone()), block_hash(&h).0);
    }
}
