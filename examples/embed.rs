//! Embedding kvoffload in a serving engine, end to end, on any machine.
//!
//! A request computes a 64-token prompt into four GPU blocks; kvoffload
//! stores the blocks' KV to the host tier. A second request with the same
//! prompt (and one more token), on other GPU blocks, gets those 64 tokens
//! back from the host tier instead of recomputing them. The "GPU" is host
//! memory and the workers copy with the host backend; on a GPU machine the
//! same calls run over `worker::cuda::CudaBackend`.
//!
//! ```text
//! cargo run --release --example embed
//! ```
//!
//! What a serving engine calls, per step: the control plane (`Scheduler`)
//! hears about requests (`add_request`, `lookup`, `on_alloc`,
//! `request_finished`) and plans the step (`build_step`); each worker runs
//! its four hooks around the model's forward pass; their reports go back
//! to the control plane (`on_worker_output`).

use std::sync::Arc;

use kvoffload::adapter::{merge_reports, to_worker_plan};
use kvoffload::scheduler::{LookupOutcome, ScheduledRequest, Scheduler, StepInput, WorkerOutcome};
use kvoffload::worker::{
    GpuLayout, HostBackend, HostBackendOptions, HostBuffer, HostRowLayout, OffloadWorker,
    WorkerLayout,
};
use kvoffload::{BlockHash, GpuBlockId, MonotonicClock, OffloadConfig, RequestId};

/// Tokens a KV block holds.
const TOKENS_PER_BLOCK: u64 = 16;
/// One block's KV, every layer (a cross-layer cache: one page a block).
const BLOCK_BYTES: u64 = 4096;
/// GPU blocks in the cache.
const GPU_BLOCKS: u32 = 64;
/// Host chunks (one block each here).
const HOST_CHUNKS: u32 = 32;

/// The engine around kvoffload: its scheduler, one worker, the worker's
/// "GPU" KV cache.
struct Engine {
    scheduler: Scheduler,
    worker: OffloadWorker<HostBackend>,
    gpu: Arc<HostBuffer>,
}

impl Engine {
    fn new() -> Result<Self, Box<dyn std::error::Error>> {
        // The control plane: one KV group, a host tier of HOST_CHUNKS chunks.
        let cfg = OffloadConfig {
            tokens_per_block: TOKENS_PER_BLOCK as u32,
            blocks_per_chunk: 1,
            ..OffloadConfig::with_chunks(u64::from(HOST_CHUNKS))
        };
        cfg.validate()?;
        let scheduler = Scheduler::new(&cfg, MonotonicClock::shared())?;

        // The data plane: the worker's KV cache and its share of the host pool.
        let gpu = Arc::new(HostBuffer::new(
            (BLOCK_BYTES * u64::from(GPU_BLOCKS)) as usize,
        )?);
        let row = HostRowLayout::uniform(1, 1, &[BLOCK_BYTES])?;
        let pool = Arc::new(HostBuffer::new(
            row.pool_bytes(HOST_CHUNKS).ok_or("pool size")? as usize,
        )?);
        let layout = WorkerLayout::new(
            GpuLayout::cross_layer(gpu.addr(), GPU_BLOCKS, BLOCK_BYTES, BLOCK_BYTES)?,
            row,
            0,
            pool.addr(),
            HOST_CHUNKS,
        )?;
        let backend = HostBackend::new(
            layout,
            vec![gpu.clone(), pool],
            HostBackendOptions::default(),
        )?;
        // `true`: this worker writes the host tier (every worker does, for
        // its own share of each chunk).
        let worker = OffloadWorker::new(backend, true);
        Ok(Self {
            scheduler,
            worker,
            gpu,
        })
    }

    /// One engine step: kvoffload plans it, the worker starts the step's
    /// loads, the model computes (`forward`), the worker queues the step's
    /// stores, and the workers' reports go back to the control plane.
    fn step(
        &mut self,
        input: &StepInput,
        forward: impl FnOnce(&HostBuffer),
    ) -> Result<WorkerOutcome, Box<dyn std::error::Error>> {
        let plan = self.scheduler.build_step(input)?;
        let mut work = to_worker_plan(&plan, 1);
        self.worker.handle_preemptions(&mut work)?;
        self.worker.start_transfers(&work)?;
        forward(&self.gpu);
        self.worker.queue_stores(&mut work);
        let report = self.worker.get_finished();
        self.scheduler.recycle_plan(plan);
        Ok(self.scheduler.on_worker_output(&merge_reports([&report])))
    }

    /// Steps with nothing scheduled until every transfer has ended (a real
    /// engine goes on serving meanwhile). Returns the requests whose loads
    /// finished.
    fn drain(&mut self) -> Result<Vec<RequestId>, Box<dyn std::error::Error>> {
        let mut loaded = Vec::new();
        for _ in 0..10_000 {
            if !self.scheduler.has_pending_work() {
                return Ok(loaded);
            }
            let outcome = self.step(&StepInput::default(), |_| {})?;
            if !outcome.failed_loads.is_empty() {
                return Err(format!("loads failed: {:?}", outcome.failed_loads).into());
            }
            loaded.extend(outcome.finished_loads);
            std::thread::yield_now();
        }
        Err("transfers still running after 10,000 steps".into())
    }

    /// Block `block`'s KV.
    fn block(&self, block: u32) -> Vec<u8> {
        // SAFETY: read between steps, with no transfer touching the block.
        unsafe {
            self.gpu.read(
                (u64::from(block) * BLOCK_BYTES) as usize,
                BLOCK_BYTES as usize,
            )
        }
    }
}

/// What the model writes for block `i` of the prompt (a stand-in for KV).
fn kv_of(i: usize) -> Vec<u8> {
    (0..BLOCK_BYTES)
        .map(|b| (b as usize * 31 + i * 7) as u8)
        .collect()
}

/// Runs the example (`pub`: `tests/examples.rs` runs it as a test).
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut e = Engine::new()?;
    // The prompt's four full blocks, identified by their hashes (vLLM's
    // block hashes: each covers the tokens up to its block's end).
    let hashes: Vec<BlockHash> = (1..=4).map(|i| BlockHash(0x00C0_FFEE_0000 + i)).collect();
    let prompt = 4 * TOKENS_PER_BLOCK;

    // Request 1: nothing cached yet. It computes its prompt into GPU blocks
    // 1 to 4 in one step and finishes.
    let first = RequestId(1);
    let first_blocks: Vec<GpuBlockId> = (1..=4).map(GpuBlockId).collect();
    e.scheduler.add_request(first, prompt, &hashes)?;
    assert_eq!(e.scheduler.lookup(first, 0)?, LookupOutcome::Hit(0));
    e.scheduler.on_alloc(first, &first_blocks, 0)?;
    let prefill = StepInput {
        scheduled: vec![ScheduledRequest {
            req: first,
            new_block_ids: first_blocks.clone(),
            computed_tokens: 0,
            scheduled_tokens: prompt,
            full_table: false,
        }],
        ..StepInput::default()
    };
    e.step(&prefill, |gpu| {
        for (i, b) in first_blocks.iter().enumerate() {
            // SAFETY: the model writes its own blocks; no transfer reads them yet.
            unsafe { gpu.write((u64::from(b.0) * BLOCK_BYTES) as usize, &kv_of(i)) };
        }
    })?;
    e.scheduler
        .request_finished(first, &first_blocks, false, prompt)?;
    e.step(
        &StepInput {
            finished: vec![first],
            ..StepInput::default()
        },
        |_| {},
    )?;
    e.drain()?;
    let stored = e.scheduler.state();
    println!(
        "request 1 computed {prompt} tokens; the host tier now holds {} chunks",
        stored.manager.cached
    );

    // Request 2: the same prompt and one token more. Its GPU blocks are
    // others (say request 1's were given away), so the GPU prefix cache
    // misses; kvoffload's host tier hits the four blocks.
    let second = RequestId(2);
    let second_blocks: Vec<GpuBlockId> = (11..=15).map(GpuBlockId).collect();
    e.scheduler.add_request(second, prompt + 1, &hashes)?;
    let LookupOutcome::Hit(hit) = e.scheduler.lookup(second, 0)? else {
        return Err("the lookup deferred with nothing in flight".into());
    };
    println!(
        "request 2: {hit} of its {} tokens come from the host tier",
        prompt + 1
    );
    // The engine allocates the blocks with the hit; kvoffload plans the
    // load into the first four, and the request waits for it (vLLM's
    // WAITING_FOR_REMOTE_KVS) while other requests run.
    e.scheduler.on_alloc(second, &second_blocks, hit)?;
    let loaded = e.drain()?;
    if loaded != [second] {
        return Err(format!("expected request 2's load, got {loaded:?}").into());
    }
    for (i, b) in second_blocks[..4].iter().enumerate() {
        if e.block(b.0) != kv_of(i) {
            return Err(format!("block {} does not hold prompt block {i}'s KV", b.0).into());
        }
    }
    println!(
        "request 2's blocks {:?} hold request 1's KV: {} tokens not recomputed",
        second_blocks[..4].iter().map(|b| b.0).collect::<Vec<_>>(),
        hit
    );
    Ok(())
}
