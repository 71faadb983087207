//! Composition of the two halves: the adapter between the scheduler's plan and
//! report types and the worker's, and a pool of worker threads that execute
//! step plans on host or CUDA backends (one thread per simulated GPU).

pub mod adapter;
pub mod cuda_workers;
pub mod workers;

pub use adapter::{encode_worker_plan, merge_reports, to_worker_plan};
pub use workers::{HostWorkerPool, PoolError, PoolStep, RemoteAttach, WorkerCommand, WorkerPool};
