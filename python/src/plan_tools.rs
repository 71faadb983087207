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
