//! The CUDA backend (cudarc, driver loaded at run time): pinned host pool, a
//! stream per direction, DMA / batched DMA / custom kernels / CUDA graphs.
//!
//! Without a driver every entry point returns [`CudaError::NoDriver`]; nothing
//! here panics. This code is compiled everywhere but runs only on a GPU machine.

pub mod backend;
pub mod context;
pub mod dma;
pub mod error;
pub mod kernel;
pub mod memory;
pub mod shared_table;
pub mod strategy;

pub use backend::{CudaBackend, CudaBackendOptions, CudaBackendStats};
pub use context::{borrowed_stream, driver_present, open_context};
pub use error::CudaError;
pub use kernel::LaunchShape;
pub use memory::{DeviceBuffer, PinnedBuffer, PinnedKind};
pub use shared_table::SharedStrategyTable;
pub use strategy::{Strategy, StrategyFileError, StrategyRule, StrategyTable, StrategyTableError};
