//! The CUDA strategy table a deployment may give the connector
//! (`kv_connector_extra_config`'s `strategy_table`: a file written by
//! `kvoffload bench --calibrate`): read and checked at configuration time,
//! so a bad file stops startup naming itself, then used by each CUDA worker.

use std::path::Path;
use std::sync::Arc;

use kvoffload::worker::cuda::{CudaBackendOptions, SharedStrategyTable, StrategyTable};
use pyo3::prelude::*;

use crate::convert::value_error;

/// Reads and validates the strategy table file at `path`; raises
/// `ValueError` naming the file and what is wrong with it.
#[pyfunction]
pub fn check_strategy_table(path: &str) -> PyResult<()> {
    StrategyTable::load(Path::new(path))
        .map(|_| ())
        .map_err(value_error)
}

/// The CUDA backend's options with the table at `path` (its rules and its
/// tuning), or the defaults without one.
pub(crate) fn cuda_options(path: Option<&str>) -> PyResult<CudaBackendOptions> {
    let mut options = CudaBackendOptions::default();
    if let Some(p) = path {
        let table = StrategyTable::load(Path::new(p)).map_err(value_error)?;
        table.tuning.apply(&mut options);
        options.strategies = Arc::new(SharedStrategyTable::new(table));
    }
    Ok(options)
}
