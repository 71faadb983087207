//! The CUDA backend (cudarc, driver loaded at run time): pinned host pool, a
//! stream per direction, DMA / batched DMA / custom kernels / CUDA graphs.
//!
//! Without a driver every entry point returns [`CudaError::NoDriver`]; nothing
//! here panics. This code is compiled everywhere but runs only on a GPU machine.

mod backend;
pub(crate) mod context;
mod dma;
pub(crate) mod error;
mod kernel;
mod memory;
mod shared_table;
mod strategy;
mod tuning;

pub use backend::{CudaBackend, CudaBackendOptions, CudaBackendStats};
pub use context::{
    borrowed_stream, device_count, driver_present, open_context, pci_address, pool_near,
};
pub use error::CudaError;
pub use kernel::{LaunchShape, kernel_pieces, table_header};
pub use memory::{DeviceBuffer, MAX_REGISTER_PIECE, PinnedBuffer, PinnedKind};
pub use shared_table::SharedStrategyTable;
pub use strategy::{Strategy, StrategyFileError, StrategyRule, StrategyTable, StrategyTableError};
pub use tuning::BackendTuning;
