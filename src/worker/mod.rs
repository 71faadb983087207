//! The data plane: layouts, descriptor tables, transfer backends (host memcpy
//! and CUDA) and the worker's per-step hooks.
//!
//! - layouts ([`GpuLayout`], [`HostRowLayout`], [`WorkerLayout`]): GPU pages
//!   and host chunk rows, paired per worker;
//! - descriptors ([`DescriptorTable`]): `(src, dst, bytes)` tables with runs
//!   coalesced;
//! - the [`TransferBackend`] trait;
//! - [`HostBackend`]: memcpy on threads, the reference and no-GPU default;
//! - [`cuda`]: DMA, custom kernels and CUDA graphs (needs a driver at run time);
//! - [`numa`]: placing a worker's host pool on its GPU's NUMA node;
//! - [`SharedRegion`]: a host pool mapped by every worker process of an
//!   engine (one copy of replicated KV), written by turns ([`StoreWriters`]);
//! - [`OffloadWorker`]: the worker's hooks, driven by a [`WorkerPlan`] each step;
//! - [`encode_plan`] / [`decode_plan`]: the step plan as compact bytes, for
//!   workers in other processes.

mod backend;
pub mod cuda;
mod descriptors;
mod error;
mod fault;
mod fault_injector;
mod host_backend;
mod host_buffer;
mod layout;
pub mod numa;
mod plan;
mod plan_wire;
mod remote_shares;
mod shared_region;
mod store_turns;
mod worker_hooks;

pub use backend::{HostShare, TransferBackend, TransferResult};
pub use descriptors::{CopyDesc, DescriptorTable, plan as plan_descriptors};
pub use error::{BackendError, LayoutError, SpecError};
pub use fault::Fault;
pub use fault_injector::{FaultControl, FaultInjector};
pub use host_backend::{HostBackend, HostBackendOptions};
pub use host_buffer::{HostBuffer, HostBufferError};
pub use layout::{
    GpuLayout, GpuLayoutKind, GpuRegion, HostRowLayout, SlotLayout, TransferSpec, WorkerLayout,
};
pub use plan::{
    DirectionStats, FetchJob, LoadJob, StoreJob, TransferStats, WorkerPlan, WorkerReport,
};
pub use plan_wire::{
    PLAN_WIRE_VERSION, PlanWireError, SpecParts, decode_plan, encode_plan, encode_plan_parts,
};
pub use remote_shares::{
    HeadOrder, HeadPage, HeadPlacement, HeldShare, RemoteShares, ShareError, SlotRange,
};
pub use shared_region::{SharedRegion, SharedRegionError};
pub use store_turns::{KeptChunks, StoreWriters, TurnError, keep_chunks};
pub use worker_hooks::{OffloadWorker, WorkerError};
