//! `kvoffload._native`: Python bindings of kvoffload's control plane
//! ([`kvoffload::scheduler::Scheduler`]) and data plane
//! ([`kvoffload::worker::OffloadWorker`] over the host or the CUDA backend). A thin layer:
//! it translates names and values (request ids as strings, vLLM's block
//! hashes as bytes, block lists as Python lists) and holds no logic of its
//! own. The vLLM connector (`kvoffload.vllm`) is written on top of it.

mod borrowed;
mod convert;
mod kv_events;
mod names;
mod plan_tools;
mod remote;
mod scheduler_core;
mod strategy_table;
mod worker_core;

use pyo3::prelude::*;

use plan_tools::{
    chunk_key, plan_debug, plan_group_transfers, plan_jobs, plan_sync_loads, plan_transfers,
};
use remote::{check_remote_config, remote_namespace};
use scheduler_core::SchedulerCore;
use strategy_table::check_strategy_table;
use worker_core::{WorkerCore, shared_region_path};

/// kvoffload's Python module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SchedulerCore>()?;
    m.add_class::<WorkerCore>()?;
    m.add_function(wrap_pyfunction!(chunk_key, m)?)?;
    m.add_function(wrap_pyfunction!(plan_jobs, m)?)?;
    m.add_function(wrap_pyfunction!(plan_transfers, m)?)?;
    m.add_function(wrap_pyfunction!(plan_group_transfers, m)?)?;
    m.add_function(wrap_pyfunction!(plan_debug, m)?)?;
    m.add_function(wrap_pyfunction!(plan_sync_loads, m)?)?;
    m.add_function(wrap_pyfunction!(check_strategy_table, m)?)?;
    m.add_function(wrap_pyfunction!(check_remote_config, m)?)?;
    m.add_function(wrap_pyfunction!(remote_namespace, m)?)?;
    m.add_function(wrap_pyfunction!(shared_region_path, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
