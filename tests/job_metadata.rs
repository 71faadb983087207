//! Heap bytes per in-flight job (target: at most 256 bytes per in-flight job;
//! figures in `docs/perf.md`, "Heap per in-flight job"), measured with a byte-counting global
//! allocator: the live heap grows by the job table's entry, the watchdog's
//! deadline entry, the request's job list and the manager's access record of
//! each new one-chunk store job, which then stays in flight (no worker reports).
//!
//! Run with `--nocapture` to see the figure.

#[path = "common/counting_alloc.rs"]
mod counting_alloc;

use kvoffload::scheduler::{ScheduledRequest, Scheduler, StepInput};
use kvoffload::{BlockHash, GpuBlockId, ManualClock, OffloadConfig, RequestId};

#[global_allocator]
static ALLOCATOR: counting_alloc::Counting = counting_alloc::Counting;

const RUNNING: u64 = 1024;
/// Steps before the measurement (every request's lists have grown past their
/// first capacities) and measured steps: 1024 new one-chunk jobs each.
const WARM_STEPS: u64 = 16;
const MEASURED_STEPS: u64 = 48;

#[test]
fn an_in_flight_job_costs_at_most_256_heap_bytes() {
    // One token per block, one block per chunk: every request plans a
    // one-chunk store in every step (the smallest job, so per-job overhead
    // is not diluted by its chunks). The tier has room for every chunk.
    let cfg = OffloadConfig {
        tokens_per_block: 1,
        blocks_per_chunk: 1,
        offload_prompt_only: false,
        ..OffloadConfig::with_chunks(RUNNING * (WARM_STEPS + MEASURED_STEPS + 1))
    };
    let mut s = Scheduler::new(&cfg, ManualClock::new().shared()).expect("scheduler");
    let mut input = StepInput::default();
    for r in 0..RUNNING {
        s.add_request(RequestId(r), 1, &[]).unwrap();
        s.lookup(RequestId(r), 0).unwrap();
        s.on_alloc(RequestId(r), &[], 0).unwrap();
        input.scheduled.push(ScheduledRequest {
            req: RequestId(r),
            new_block_ids: Vec::with_capacity(1),
            computed_tokens: 0,
            scheduled_tokens: 1,
            full_table: false,
        });
    }
    // The requests' own block and hash lists grow in the window too (12 bytes
    // per block): they are counted, which makes the figure an upper bound.
    let total_steps = WARM_STEPS + MEASURED_STEPS;
    let mut next_block = 1u32;
    let mut step = |s: &mut Scheduler, t: u64| {
        for (i, e) in input.scheduled.iter_mut().enumerate() {
            e.new_block_ids.clear();
            e.new_block_ids.push(GpuBlockId(next_block));
            next_block += 1;
            e.computed_tokens = t;
            let hash = [BlockHash((i as u64) << 40 | (t + 1))];
            s.update_request(RequestId(i as u64), t + 1, &hash).unwrap();
        }
        let plan = s.build_step(&input).expect("step");
        assert_eq!(plan.stores.len() as u64, RUNNING, "every request stores");
        drop(s.take_events());
    };
    for t in 0..WARM_STEPS {
        step(&mut s, t);
    }
    let jobs_before = s.state().jobs;
    let before = counting_alloc::live_bytes();
    for t in WARM_STEPS..total_steps {
        step(&mut s, t);
    }
    let after = counting_alloc::live_bytes();
    let jobs = (s.state().jobs - jobs_before) as u64;
    assert_eq!(jobs, RUNNING * MEASURED_STEPS, "every job stays in flight");
    let per_job = (after - before) as f64 / jobs as f64;
    println!(
        "heap per in-flight one-chunk store job: {per_job:.1} B \
         ({jobs} jobs, {} bytes, request block and hash lists included)",
        after - before
    );
    assert!(
        per_job <= 256.0,
        "{per_job:.1} heap bytes per in-flight job; the target is at most 256"
    );
    assert!(per_job > 0.0, "in-flight jobs hold memory");
}
