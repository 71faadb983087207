//! The serving simulation behind `kvoffload sim`: a synthetic workload (shared
//! system prompts, multi-turn conversations), a small model of the serving
//! backend's scheduler (admission, GPU block allocation with a prefix cache,
//! preemption), the real control plane, worker threads on host backends (or
//! CUDA backends, [`SimBackend::Cuda`]), faults injected into every backend by
//! a [`crate::worker::FaultInjector`], an end-to-end check of the bytes the
//! workers move ([`content`]), and a summary whose leak counts come from the
//! engine's state after a full drain. Everything runs on a manual clock, so a seed gives
//! the same control-plane decisions every time.

mod config;
pub mod content;
mod cuda_workers;
mod faults;
pub mod gpu_pool;
pub mod limits;
mod recorder;
mod rng;
mod run;
pub mod step_times;
mod summary;
mod workers;
mod workload;

pub use config::{
    SIM_BLOCK_BYTES, config_from_path, default_config, overlay, set_sync_load_budget,
};
pub use faults::{FaultPlan, FaultRates, MAX_STALL_FATE_STEPS, StallFate};
pub use recorder::Recorder;
pub use rng::SimRng;
pub use run::{Progress, Sim, SimError, SimOutput};
pub use summary::{
    ContentCounts, ContentMismatch, FaultCounts, Held, Leaks, RemoteCounts, SimSummary, StepTimes,
    TransferCounts, WorkCounts,
};
pub use workers::{PoolError, PoolGeometry, PoolStep, RemoteAttach, WorkerCommand, WorkerPool};
pub use workload::{Workload, WorkloadShape};

/// The transfer backend the simulation's worker threads run (always wrapped in
/// a [`crate::worker::FaultInjector`], which injects the faults).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SimBackend {
    /// Host memory stands in for the GPU (memcpy on copy threads): any machine.
    #[default]
    Host,
    /// The CUDA backend: device buffers hold the GPU pool's blocks, the host
    /// pool is pinned; needs an NVIDIA driver and a device.
    Cuda {
        /// The copy strategy table (the default, or a calibrated one).
        strategies: crate::worker::cuda::StrategyTable,
    },
}

impl SimBackend {
    /// `host` or `cuda`.
    pub fn name(&self) -> &'static str {
        match self {
            SimBackend::Host => "host",
            SimBackend::Cuda { .. } => "cuda",
        }
    }
}

/// Knobs of a simulation (the engine's own knobs are in [`crate::OffloadConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// Seed of the workload and the fault plan.
    pub seed: u64,
    /// Requests (conversation turns) to create.
    pub requests: u64,
    /// GPU blocks per worker in the serving backend's pool.
    pub gpu_blocks: u32,
    /// Most requests running at once.
    pub max_running: usize,
    /// Token budget of one step.
    pub max_batch_tokens: u64,
    /// Simulated duration of one step, milliseconds.
    pub step_ms: u64,
    /// Probability that a new conversation arrives in a step (while fewer
    /// than `max_conversations` are open).
    pub arrival_rate: f64,
    /// Most conversations open at once (a turn waiting, running, or the user
    /// thinking before the next turn): the users of the service. A new
    /// conversation arrives only when one of them is free, so the backlog and
    /// the run's memory are bounded by this, not by `requests`.
    pub max_conversations: u64,
    /// Reset the prefix cache every this many steps (0: never).
    pub reset_every: u64,
    /// Bytes of one GPU block on one worker.
    pub block_bytes: u64,
    /// Faults.
    pub faults: FaultRates,
    /// The workload's shape.
    pub shape: WorkloadShape,
    /// Steps the run may go without finishing a request (or, once every
    /// request has finished, steps the drain may take) before it stops as
    /// stuck; `None`: [`limits::derived_progress_limit`], which follows from
    /// the workload and the stall handling, whatever the number of requests.
    pub progress_limit_steps: Option<u64>,
    /// The workers' transfer backend.
    pub backend: SimBackend,
    /// A remote tier every worker writes its stored chunks through to (host
    /// backends only); `None`: no remote tier.
    pub remote: Option<crate::remote::RemoteTierConfig>,
    /// Check the bytes the workers move ([`content`]): computed blocks are
    /// written with a pattern of their hash, loaded blocks and GPU prefix
    /// hits compared with it. It changes no decision.
    pub content_check: bool,
    /// Every worker holds the same KV (vLLM's MLA replicated on every
    /// tensor-parallel rank): one copy of a chunk in the host pool, mapped
    /// by every worker, the stores written by turns of host chunk, one
    /// share of a chunk in a remote tier.
    pub replicated: bool,
    /// Where the host pool goes: `auto` (the first GPU's NUMA node on the
    /// CUDA backend, where the machine has several), `off`, or a node.
    pub numa: crate::worker::numa::HostPlacement,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self {
            seed: 1,
            requests: 2000,
            gpu_blocks: 384,
            max_running: 24,
            max_batch_tokens: 4096,
            step_ms: 10,
            arrival_rate: 0.35,
            max_conversations: 64,
            reset_every: 1500,
            block_bytes: config::SIM_BLOCK_BYTES,
            faults: FaultRates::default(),
            shape: WorkloadShape::default(),
            progress_limit_steps: None,
            backend: SimBackend::Host,
            remote: None,
            content_check: true,
            replicated: false,
            numa: crate::worker::numa::HostPlacement::Auto,
        }
    }
}
