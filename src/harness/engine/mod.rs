//! A pool of worker threads that execute step plans on host or CUDA backends
//! (one thread per simulated GPU), for the simulation and the benchmarks.

pub mod cuda_workers;
pub mod workers;

pub use workers::{HostWorkerPool, PoolError, PoolStep, RemoteAttach, WorkerCommand, WorkerPool};
