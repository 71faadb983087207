//! Stall detection (`docs/scheduler.md`, "Jobs, the watchdog and stalls", with
//! quarantine).
//! No test sleeps: time is a manual clock and scans are synchronous.

mod common;

use common::*;
use kvoffload::manager::{LookupResult, StoreOutcome};
use kvoffload::scheduler::{CompletionReport, LookupOutcome, SchedulerError, StepPlan};
use kvoffload::{ChunkId, GpuBlockId, JobId};

/// One request (family 1, 8 tokens = 2 chunks) with a store in flight.
fn with_store(world: u32) -> (H, JobId) {
    let mut h = H::new(Geo {
        world,
        ..Geo::default()
    });
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let s = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]).stores[0].job;
    (h, s)
}

/// Request 2 (family 1) loading the 2 chunks stored for it beforehand.
fn with_load(world: u32) -> (H, JobId) {
    let mut h = H::new(Geo {
        world,
        ..Geo::default()
    });
    let k = [key(1, 0, 1), key(1, 1, 1)];
    h.cache(&k);
    h.add(2, 1, 9);
    assert_eq!(h.lookup(2, 0), LookupOutcome::Hit(8));
    let l = h.alloc(2, &b(1..=3), 8).unwrap();
    h.run(&[], &[], &[]);
    (h, l)
}

fn late(h: &mut H, job: JobId, n: u32) {
    let out = h.s.on_worker_output(&CompletionReport {
        completed: vec![(job, n)],
        failed: vec![],
    });
    assert!(out.rejected.is_empty(), "{:?}", out.rejected);
    assert!(
        out.finished_loads.is_empty(),
        "late loads are never finished loads"
    );
    h.check();
}

/// A new request `id` (family `fam`, 4 tokens, one chunk) admitted into the
/// GPU block `block` and prefilled: the step's plan.
fn prefill_one_block(h: &mut H, id: u64, fam: u64, block: u32) -> StepPlan {
    h.add(id, fam, 4);
    h.lookup(id, 0);
    h.alloc(id, &b([block]), 0);
    h.run(&[(id, b([block]), 0, 4)], &[], &[])
}

// E.4.1
#[test]
fn stalled_store_job_detected() {
    let (mut h, s) = with_store(1);
    h.advance_s(300);
    assert!(
        h.s.scan_now().stalled.is_empty(),
        "not past the timeout yet"
    );
    h.advance_s(1);
    let out = h.s.scan_now();
    h.check();
    assert_eq!(out.stalled, vec![s]);
    assert!(!h.s.is_job_live(s));
    assert!(h.s.is_job_stalled(s));
    assert_eq!(h.s.request_jobs(r(1)), Some(vec![]));
    assert_eq!(
        h.lookup_key(key(1, 0, 1)),
        LookupResult::Miss,
        "MISS at once"
    );
    assert_eq!(h.s.state().quarantined_chunks, 2);
    assert_eq!(h.s.manager().stats().quarantined, 2);
    assert_eq!(h.s.metrics().stalled_stores, 1);
}

// E.4.2
#[test]
fn stalled_load_unblocks_being_loaded() {
    let (mut h, l) = with_load(1);
    h.add(3, 1, 9);
    assert_eq!(h.lookup(3, 0), LookupOutcome::Defer);
    h.alloc(3, &[], 0);
    h.run(&[], &[], &[]);
    h.advance_s(301);
    let out = h.s.scan_now();
    h.check();
    assert_eq!(out.stalled, vec![l]);
    assert!(!h.s.is_being_loaded(key(1, 0, 1)));
    assert_eq!(h.lookup(3, 0), LookupOutcome::Hit(8), "no longer deferred");
}

// E.4.3
#[test]
fn stalled_job_counts_down_late_reports_silently() {
    let (mut h, s) = with_store(2);
    h.advance_s(301);
    h.s.scan_now();
    h.check();
    late(&mut h, s, 1);
    assert!(h.s.is_job_stalled(s));
    assert_eq!(h.s.state().quarantined_chunks, 2);
    late(&mut h, s, 1);
    assert!(!h.s.is_job_stalled(s));
    assert_eq!(h.s.state().quarantined_chunks, 0);
    assert_eq!(h.s.manager().stats().quarantined, 0);
    assert_eq!(h.s.metrics().late_reports, 2);
}

// E.4.4
#[test]
fn stalled_job_whose_request_state_is_gone() {
    let (mut h, s) = with_store(1);
    h.finish(1, &b(1..=2));
    h.run(&[], &[], &[1]);
    h.advance_s(301);
    h.s.scan_now();
    h.check();
    assert!(
        !h.s.has_request(r(1)),
        "cleanup deleted the finished request"
    );
    assert_eq!(h.s.state().fenced_blocks, 2, "source blocks stay fenced");
    late(&mut h, s, 1);
    assert_eq!(h.s.state().fenced_blocks, 0);
    assert_eq!(h.s.manager().stats().quarantined, 0);
}

// E.4.5: the scan interval replaces the throttle.
#[test]
fn stall_scan_runs_once_per_interval() {
    let (mut h, s) = with_store(1);
    assert!(h.s.scan_if_due().is_some(), "the first scan is due");
    h.advance_s(305);
    assert_eq!(h.s.scan_if_due().map(|o| o.stalled), Some(vec![s]));
    let (mut h, s) = with_store(1);
    h.advance_s(295);
    assert_eq!(h.s.scan_if_due().map(|o| o.stalled), Some(vec![]));
    h.advance_s(9); // 304 s: the job is old, but the last scan was 9 s ago
    assert_eq!(h.s.scan_if_due(), None);
    assert!(h.s.is_job_live(s));
    h.advance_s(1);
    assert_eq!(h.s.scan_if_due().map(|o| o.stalled), Some(vec![s]));
    h.check();
}

// E.4.6, adapted: reset drops the stalled jobs from the job table, the reset
// fence and has_pending_work, but their host slots stay quarantined (a stalled
// load's pins become quarantined slots) until their late reports arrive.
#[test]
fn reset_clears_stalled_state_but_keeps_the_quarantine() {
    let (mut h, l) = with_load(1);
    h.add(1, 2, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(5..=6), 0);
    let s = h.run(&[(1, b(5..=6), 0, 8)], &[], &[]).stores[0].job;
    h.advance_s(301);
    assert_eq!(h.s.scan_now().stalled, vec![l, s]);
    let load_slots = [
        h.s.manager().slot_of(key(1, 0, 1)).unwrap(),
        h.s.manager().slot_of(key(1, 1, 1)).unwrap(),
    ];
    h.s.reset().unwrap();
    h.check();
    assert_eq!(
        h.s.reset_fence_len(),
        0,
        "stalled jobs are not in the reset fence"
    );
    assert!(!h.s.has_pending_work());
    assert_eq!(h.s.state().jobs, 0);
    assert_eq!(h.s.manager().stats().pinned, 0);
    assert_eq!(
        h.s.manager().stats().quarantined,
        4,
        "2 store slots + 2 load slots"
    );
    assert_eq!(h.s.state().quarantined_chunks, 4);
    assert_eq!(h.lookup_key(key(1, 0, 1)), LookupResult::Miss);
    // New stores after the reset never get the slots a late load may still read.
    h.add(7, 7, 16);
    h.lookup(7, 0);
    h.alloc(7, &b(20..=23), 0);
    let plan = h.run(&[(7, b(20..=23), 0, 16)], &[], &[]);
    for c in &plan.stores[0].chunk_ids {
        assert!(!load_slots.contains(c));
    }
    h.complete(&jobs_of(&plan.stores), 1);
    late(&mut h, l, 1);
    late(&mut h, s, 1);
    assert_eq!(h.s.state().stalled_jobs, 0);
    assert_eq!(h.s.manager().stats().quarantined, 0);
    assert_eq!(h.s.manager().stats().free, 60);
}

// E.4.7
#[test]
fn stalled_job_never_repeats_on_request_finished() {
    let (mut h, _s) = with_store(1);
    h.finish(1, &b(1..=2));
    h.run(&[], &[], &[1]);
    assert_eq!(h.s.metrics().manager_request_finished, 1);
    h.advance_s(301);
    h.s.scan_now();
    h.check();
    assert!(!h.s.has_request(r(1)));
    assert_eq!(h.s.metrics().manager_request_finished, 1);
}

// E.4.8
#[test]
fn normal_load_completion_clears_being_loaded() {
    let (mut h, l) = with_load(1);
    assert!(h.s.is_being_loaded(key(1, 0, 1)));
    h.complete(&[l], 1);
    assert!(!h.s.is_being_loaded(key(1, 0, 1)));
    assert_eq!(h.s.state().chunks_being_loaded, 0);
}

// E.4.9
#[test]
fn normal_last_job_deletes_request_state() {
    let (mut h, s) = with_store(1);
    h.finish(1, &b(1..=2));
    h.run(&[], &[], &[1]);
    assert!(h.s.has_request(r(1)));
    h.complete(&[s], 1);
    assert!(!h.s.has_request(r(1)));
}

// E.4.10
#[test]
fn completion_clears_fence_entries() {
    let (mut h, s) = with_store(1);
    h.finish(1, &b(1..=2));
    assert_eq!(h.s.fenced_jobs(GpuBlockId(1)), vec![s]);
    h.run(&[], &[], &[1]);
    h.complete(&[s], 1);
    assert!(h.s.fenced_jobs(GpuBlockId(1)).is_empty());
    assert_eq!(h.s.state().fenced_blocks, 0);
}

// E.4.11: a stalled load is not completed at cleanup; its chunks stay pinned
// until the late reports, then complete_load runs (no success flag exists).
#[test]
fn stalled_load_keeps_its_pins_until_late_reports() {
    let (mut h, l) = with_load(1);
    h.advance_s(301);
    h.s.scan_now();
    h.check();
    assert_eq!(h.s.manager().stats().pinned, 2);
    assert_eq!(h.s.state().quarantined_chunks, 2);
    late(&mut h, l, 1);
    assert_eq!(h.s.manager().stats().pinned, 0);
    assert_eq!(h.s.state().quarantined_chunks, 0);
}

#[test]
fn late_store_dma_never_touches_a_reused_slot() {
    let mut h = H::new(Geo {
        chunks: 4,
        ..Geo::default()
    });
    h.add(1, 1, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(1..=2), 0);
    let st = h.run(&[(1, b(1..=2), 0, 8)], &[], &[]).stores[0].clone();
    h.advance_s(301);
    h.s.scan_now();
    h.check();
    // Fill the tier twice over: the two quarantined slots are never handed out.
    for (id, fam) in [(2u64, 2u64), (3, 3), (4, 4)] {
        h.add(id, fam, 8);
        h.lookup(id, 0);
        h.alloc(id, &b(10..=11), 0);
        let plan = h.run(&[(id, b(10..=11), 0, 8)], &[], &[]);
        assert_eq!(plan.stores[0].keys.len(), 2);
        for c in &plan.stores[0].chunk_ids {
            assert!(!st.chunk_ids.contains(c), "{c} was quarantined");
        }
        h.complete(&jobs_of(&plan.stores), 1);
    }
    assert_eq!(h.s.metrics().allocation_failures, 0);
    // The late DMA lands: the slots come back.
    late(&mut h, st.job, 1);
    assert_eq!(h.s.manager().stats().quarantined, 0);
}

#[test]
fn late_load_dma_never_reads_a_reused_slot() {
    let (mut h, l) = with_load(1);
    let held: Vec<ChunkId> =
        h.s.manager()
            .quarantined_chunks()
            .into_iter()
            .chain([
                h.s.manager().slot_of(key(1, 0, 1)).unwrap(),
                h.s.manager().slot_of(key(1, 1, 1)).unwrap(),
            ])
            .collect();
    h.advance_s(301);
    h.s.scan_now();
    // Fill the tier with other stores: the loaded chunks stay pinned, never evicted.
    for f in 10..80u64 {
        let k = [key(f, 0, 1)];
        if let Some(out) = h.s.manager_mut().prepare_store(&k, None) {
            for c in &out.chunk_ids {
                assert!(!held.contains(c), "{c} is pinned by a stalled load");
            }
            h.s.manager_mut()
                .complete_store(&out.keys_to_store, StoreOutcome::Success, None)
                .unwrap();
        }
    }
    assert_eq!(h.lookup_key(key(1, 0, 1)), LookupResult::Hit);
    h.check();
    late(&mut h, l, 1);
    assert_eq!(h.s.manager().stats().pinned, 0);
}

#[test]
fn stalled_load_is_reported_as_a_failed_load() {
    let (mut h, l) = with_load(1);
    h.advance_s(301);
    let out = h.s.scan_now();
    assert_eq!(out.failed_loads, vec![r(2)]);
    let plan = h.run(&[], &[], &[]);
    assert_eq!(plan.failed_loads, vec![r(2)], "the backend recomputes");
    assert!(
        h.run(&[], &[], &[]).failed_loads.is_empty(),
        "reported once"
    );
    late(&mut h, l, 1);
    // The request can be looked up and stored again.
    assert_eq!(h.s.request_jobs(r(2)), Some(vec![]));
}

// A stalled load is reported failed, so the backend may free (or recompute
// into) its destination blocks while its late DMA may still write them: the
// blocks are fenced, a reuse flushes the load, and the late reports end it.
#[test]
fn stalled_load_fences_its_destination_blocks_until_its_late_reports() {
    let (mut h, l) = with_load(1);
    h.advance_s(301);
    assert_eq!(h.s.scan_now().stalled, vec![l]);
    h.check();
    // Blocks 1 and 2 receive the 8 loaded tokens; block 3 is computed.
    assert_eq!(h.s.fenced_jobs(GpuBlockId(1)), vec![l]);
    assert_eq!(h.s.fenced_jobs(GpuBlockId(2)), vec![l]);
    assert!(h.s.fenced_jobs(GpuBlockId(3)).is_empty());
    assert_eq!(h.s.state().fenced_blocks, 2);
    // The backend gives up on request 2 and hands block 2 to request 3.
    h.finish(2, &b(1..=3));
    h.run(&[], &[], &[2]);
    let plan = prefill_one_block(&mut h, 3, 3, 2);
    assert_eq!(
        plan.flush,
        vec![l],
        "a reused destination block waits for the stalled load"
    );
    late(&mut h, l, 1);
    assert_eq!(
        h.s.state().fenced_blocks,
        0,
        "the late reports end the fence"
    );
    h.finish(3, &b([2]));
    h.run(&[], &[], &[3]);
    assert!(prefill_one_block(&mut h, 4, 4, 1).flush.is_empty());
}

// A reset drops stalled stores' GPU fences (a late store only lands in its own
// quarantined slot) but keeps stalled loads' (a late load writes GPU blocks);
// a confirmed cancellation ends them.
#[test]
fn stalled_load_keeps_its_block_fences_across_a_reset() {
    let (mut h, l) = with_load(1);
    h.add(1, 2, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(5..=6), 0);
    let s = h.run(&[(1, b(5..=6), 0, 8)], &[], &[]).stores[0].job;
    h.finish(1, &b(5..=6));
    h.run(&[], &[], &[1]);
    h.advance_s(301);
    assert_eq!(h.s.scan_now().stalled, vec![l, s]);
    assert_eq!(
        h.s.state().fenced_blocks,
        4,
        "2 load blocks + 2 store blocks"
    );
    h.s.reset().unwrap();
    h.check();
    assert_eq!(h.s.state().fenced_blocks, 2);
    assert_eq!(h.s.fenced_jobs(GpuBlockId(1)), vec![l]);
    assert!(h.s.fenced_jobs(GpuBlockId(5)).is_empty());
    h.finish(2, &b(1..=3));
    h.run(&[], &[], &[2]);
    h.add(3, 3, 8);
    h.lookup(3, 0);
    h.alloc(3, &b([1, 5]), 0);
    let plan = h.run(&[(3, b([1, 5]), 0, 8)], &[], &[]);
    assert_eq!(plan.flush, vec![l], "only the load's block still fences");
    h.s.confirm_cancelled(l).unwrap();
    h.check();
    assert_eq!(h.s.state().fenced_blocks, 0);
    late(&mut h, s, 1);
    assert_eq!(h.s.state().stalled_jobs, 0);
}

/// The real watchdog thread does the scan (nothing here scans): once the
/// manual clock passes the deadline and the thread is woken, a scan at or
/// after that time hands the store over; the scheduler cleans it up only at
/// its next hook.
#[test]
fn watchdog_thread_hands_over_and_the_next_hook_cleans_up() {
    let (mut h, s) = with_store(1);
    h.s.start_watchdog().unwrap();
    assert!(h.s.watchdog_running());
    let handle = h.s.watchdog_handle();
    h.advance_s(301);
    let past_deadline = kvoffload::Clock::now(&h.clock);
    handle.wake();
    assert!(
        handle.wait_for_scan_since(past_deadline, std::time::Duration::from_secs(20)),
        "the watchdog thread scanned after the deadline"
    );
    // Handed over, not yet cleaned up: no hook has run since.
    assert!(!h.s.is_job_stalled(s));
    assert_eq!(h.s.metrics().stalled_stores, 0);
    assert_eq!(h.s.manager().stats().quarantined, 0);
    // The next hook applies it: the store is stalled, its slots quarantined,
    // its blocks fenced.
    let plan = h.run(&[], &[], &[]);
    assert!(plan.stores.is_empty() && plan.loads.is_empty());
    assert!(h.s.is_job_stalled(s));
    assert!(!h.s.is_job_live(s));
    assert_eq!(h.s.metrics().stalled_stores, 1);
    assert_eq!(h.s.manager().stats().quarantined, 2);
    assert_eq!(h.s.fenced_jobs(GpuBlockId(1)), vec![s]);
    h.check();
    drop(h); // stops and joins the thread
}

#[test]
fn confirm_cancelled_ends_the_quarantine() {
    let (mut h, s) = with_store(1);
    assert_eq!(h.s.confirm_cancelled(s), Err(SchedulerError::NotStalled(s)));
    h.advance_s(301);
    h.s.scan_now();
    h.s.confirm_cancelled(s).unwrap();
    h.check();
    assert_eq!(h.s.manager().stats().quarantined, 0);
    assert_eq!(h.s.state().fenced_blocks, 0);
    // A report after that is for a job that no longer exists: rejected, counted.
    let out = h.s.on_worker_output(&CompletionReport {
        completed: vec![(s, 1)],
        failed: vec![],
    });
    assert_eq!(out.rejected.len(), 1);
    assert_eq!(h.s.metrics().unknown_reports, 1);
}

#[test]
fn unknown_reports_are_counted_never_a_panic() {
    let (mut h, s) = with_store(1);
    let out = h.s.on_worker_output(&CompletionReport {
        completed: vec![(JobId(999), 1), (s, 1)],
        failed: vec![],
    });
    assert_eq!(
        out.rejected,
        vec![(JobId(999), SchedulerError::UnknownJob(JobId(999)))]
    );
    assert_eq!(h.s.metrics().unknown_reports, 1);
    assert!(!h.s.is_job_live(s), "the valid entry was applied");
    h.check();
}

#[test]
fn stalled_store_of_a_finished_request_keeps_fencing_its_blocks() {
    let (mut h, s) = with_store(1);
    h.finish(1, &b(1..=2));
    h.run(&[], &[], &[1]);
    h.advance_s(301);
    h.s.scan_now();
    let plan = prefill_one_block(&mut h, 2, 2, 2);
    assert_eq!(
        plan.flush,
        vec![s],
        "a reused source block still flushes the stalled store"
    );
    late(&mut h, s, 1);
    assert_eq!(h.s.state().fenced_blocks, 0);
}

#[test]
fn metrics_track_stalls() {
    let (mut h, _l) = with_load(1);
    h.add(1, 2, 8);
    h.lookup(1, 0);
    h.alloc(1, &b(5..=6), 0);
    h.run(&[(1, b(5..=6), 0, 8)], &[], &[]);
    assert_eq!(h.s.metrics().jobs_in_flight, 2);
    h.advance_s(301);
    h.s.scan_now();
    let m = h.s.metrics();
    assert_eq!((m.stalled_loads, m.stalled_stores), (1, 1));
    assert_eq!(m.jobs_in_flight, 0);
    assert_eq!(m.stalled_jobs, 2);
    assert_eq!(m.quarantined_chunks, 4);
}

#[test]
fn deadline_queue_scan_matches_a_full_table_scan() {
    // Jobs created at different times, some completed: both scans expire the same jobs.
    let mut ids = Vec::new();
    let mut results = Vec::new();
    for full in [false, true] {
        let mut h = H::new(Geo::default());
        let mut made = Vec::new();
        for i in 0..6u64 {
            h.add(i, i + 1, 4);
            h.lookup(i, 0);
            h.alloc(i, &b([i as u32 + 1]), 0);
            made.push(h.run(&[(i, b([i as u32 + 1]), 0, 4)], &[], &[]).stores[0].job);
            h.advance_s(100);
        }
        h.complete(&[made[1], made[4]], 1);
        // now = 600 s: jobs created at 0, 100, 200 are past 300 s; job 1 is gone.
        let handle = h.s.watchdog_handle();
        let n = if full {
            handle.scan_full()
        } else {
            handle.scan()
        };
        // The next hook cleans up what the scan handed over.
        h.run(&[], &[], &[]);
        let stalled: Vec<JobId> = made
            .iter()
            .copied()
            .filter(|&j| h.s.is_job_stalled(j))
            .collect();
        results.push((n, stalled));
        ids = made;
    }
    assert_eq!(results[0], results[1]);
    assert_eq!(results[0].0, 2);
    assert_eq!(results[0].1, vec![ids[0], ids[2]]);
}

#[test]
fn stalled_store_of_a_running_request_fences_its_blocks_too() {
    let (mut h, s) = with_store(1);
    h.advance_s(301);
    h.s.scan_now();
    h.check();
    assert_eq!(h.s.fenced_jobs(GpuBlockId(1)), vec![s]);
    // Preempted: its blocks go back to the pool and block 1 is reused at once.
    h.run(&[], &[1], &[]);
    let plan = prefill_one_block(&mut h, 2, 2, 1);
    assert!(plan.flush.contains(&s));
    h.s.confirm_cancelled(s).unwrap();
    h.check();
    assert!(h.s.fenced_jobs(GpuBlockId(1)).is_empty());
}

/// A chunk loaded by two stalled loads (the second started after the first
/// stalled, when the chunk had left the being-loaded set), then a reset: both
/// loads stay tracked, and the chunk's slot stays quarantined until the late
/// reports of *both* have arrived (either late DMA may still read it).
#[test]
fn a_chunk_of_two_stalled_loads_stays_quarantined_until_both_end() {
    let (mut h, l1) = with_load(1);
    h.advance_s(301);
    assert_eq!(h.s.scan_now().stalled, vec![l1]);
    h.run(&[], &[], &[]);
    h.add(3, 1, 9);
    assert_eq!(h.lookup(3, 0), LookupOutcome::Hit(8));
    let l2 = h.alloc(3, &b(11..=13), 8).unwrap();
    h.run(&[], &[], &[]);
    h.advance_s(301);
    assert_eq!(h.s.scan_now().stalled, vec![l2]);
    assert_eq!(
        h.s.state().quarantined_chunks,
        2,
        "two chunks, each pinned by both loads"
    );
    let slots = [
        h.s.manager().slot_of(key(1, 0, 1)).unwrap(),
        h.s.manager().slot_of(key(1, 1, 1)).unwrap(),
    ];
    h.s.reset().unwrap();
    h.check();
    assert_eq!(
        h.s.state().stalled_jobs,
        2,
        "both loads await their late reports"
    );
    assert!(h.s.is_job_stalled(l1) && h.s.is_job_stalled(l2));
    assert_eq!(h.s.manager().stats().quarantined, 2);
    assert_eq!(h.s.state().quarantined_chunks, 2);
    late(&mut h, l1, 1);
    assert_eq!(
        h.s.manager().stats().quarantined,
        2,
        "the second load's late DMA may still read the slots"
    );
    // Fill the tier with other chunks: the held slots are never handed out.
    for f in 10..80u64 {
        let k = [key(f, 0, 1)];
        if let Some(out) = h.s.manager_mut().prepare_store(&k, None) {
            for c in &out.chunk_ids {
                assert!(!slots.contains(c), "{c} is held by a stalled load");
            }
            h.s.manager_mut()
                .complete_store(&out.keys_to_store, StoreOutcome::Success, None)
                .unwrap();
        }
    }
    h.check();
    late(&mut h, l2, 1);
    assert_eq!(h.s.state().stalled_jobs, 0);
    assert_eq!(h.s.manager().stats().quarantined, 0);
    assert_eq!(h.s.state().quarantined_chunks, 0);
    assert_eq!(h.s.metrics().unknown_reports, 0, "no report went unmatched");
}
