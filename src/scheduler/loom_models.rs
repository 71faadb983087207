//! Loom models of the real job table, watchdog scan and completion path:
//! a real [`Scheduler`] (its `JobTable`, deadline queue and hand-over queue
//! built on loom's primitives under `--cfg loom`) with one job past its
//! deadline, the watchdog's scan on another thread, and worker reports on
//! the scheduler's. Whatever the interleaving, the job ends exactly once
//! (completed, or stalled with every later report counted as late), the hand-
//! over is applied by a hook, and nothing is left. Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --lib loom`.

use std::time::Duration;

use crate::clock::ManualClock;
use crate::config::OffloadConfig;
use crate::ids::{GpuBlockId, JobId, RequestId};
use crate::key::BlockHash;
use crate::manager::StoreOutcome;

use super::{CompletionReport, ScheduledRequest, Scheduler, StepInput};

/// Interleavings with up to this many preemptions (loom's usual bound: the
/// races here need one or two).
const PREEMPTIONS: usize = 3;

fn config(world: u32) -> OffloadConfig {
    OffloadConfig {
        tokens_per_block: 4,
        blocks_per_chunk: 1,
        world_size: world,
        offload_prompt_only: false,
        stall_timeout_ms: 1000,
        stall_scan_interval_ms: 100,
        ..OffloadConfig::with_chunks(8)
    }
}

fn report(job: JobId) -> CompletionReport {
    CompletionReport {
        completed: vec![(job, 1)],
        failed: vec![],
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(PREEMPTIONS);
    b.check(f);
}

/// One store of two workers' reports, past its deadline, scanned meanwhile.
#[test]
fn loom_real_table_store_reports_race_the_scan() {
    model(|| {
        let clock = ManualClock::new();
        let mut s = Scheduler::new(&config(2), clock.shared()).unwrap();
        let r = RequestId(1);
        s.add_request(r, 4, &[BlockHash(7)]).unwrap();
        s.lookup(r, 0).unwrap();
        s.on_alloc(r, &[GpuBlockId(1)], 0).unwrap();
        let plan = s
            .build_step(&StepInput {
                scheduled: vec![ScheduledRequest {
                    req: r,
                    new_block_ids: vec![GpuBlockId(1)],
                    computed_tokens: 0,
                    scheduled_tokens: 4,
                    full_table: false,
                }],
                ..StepInput::default()
            })
            .unwrap();
        let job = plan.stores[0].job;
        clock.advance(Duration::from_secs(2));
        let handle = s.watchdog_handle();
        let scanner = loom::thread::spawn(move || handle.scan());
        let first = s.on_worker_output(&report(job));
        let second = s.on_worker_output(&report(job));
        let handed_over = scanner.join().unwrap();
        assert!(first.rejected.is_empty() && second.rejected.is_empty());
        // The next hook applies a hand-over still queued.
        s.build_step(&StepInput::default()).unwrap();
        let m = s.metrics();
        assert!(!s.is_job_live(job));
        assert!(!s.is_job_stalled(job), "its late reports ended the stall");
        assert!(handed_over <= 1);
        assert_eq!(
            m.stalled_stores as usize, handed_over,
            "a hand-over is applied once"
        );
        let stored = s.manager().stats().cached == 1;
        if handed_over == 1 {
            assert!(!stored, "a stalled store never stores");
            assert!((1..=2).contains(&m.late_reports), "{m:?}");
        } else {
            assert!(stored, "completed: stored once");
            assert_eq!(m.late_reports, 0);
        }
        assert!(m.reports_racing_stall <= m.late_reports);
        s.check_invariants().unwrap();
        let st = s.state();
        assert_eq!(
            (
                st.jobs,
                st.stalled_jobs,
                st.quarantined_chunks,
                st.fenced_blocks
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(st.manager.pending + st.manager.quarantined, 0);
    });
}

/// One load (one worker), past its deadline, reported while scanned (by the
/// full-table scan this time): it finishes or fails exactly once.
#[test]
fn loom_real_table_load_report_races_the_full_scan() {
    model(|| {
        let clock = ManualClock::new();
        let mut s = Scheduler::new(&config(1), clock.shared()).unwrap();
        let keys = [crate::key::ChunkKey(7)];
        let m = s.manager_mut();
        let plan = m.prepare_store(&keys, None).unwrap();
        m.complete_store(&plan.keys_to_store, StoreOutcome::Success, None)
            .unwrap();
        let r = RequestId(1);
        s.add_request(r, 5, &[BlockHash(7)]).unwrap();
        assert_eq!(
            s.lookup(r, 0).unwrap(),
            super::LookupOutcome::Hit(4),
            "the chunk is in the tier"
        );
        let job = s
            .on_alloc(r, &[GpuBlockId(1), GpuBlockId(2)], 4)
            .unwrap()
            .expect("a load job");
        s.build_step(&StepInput::default()).unwrap();
        clock.advance(Duration::from_secs(2));
        let handle = s.watchdog_handle();
        let scanner = loom::thread::spawn(move || handle.scan_full());
        let out = s.on_worker_output(&report(job));
        let handed_over = scanner.join().unwrap();
        let next = s.build_step(&StepInput::default()).unwrap();
        let m = s.metrics();
        let finished = out.finished_loads == vec![r];
        let failed = out.failed_loads.contains(&r) || next.failed_loads.contains(&r);
        assert!(
            finished != failed,
            "finished or failed, once: {out:?} {next:?}"
        );
        assert_eq!(failed, handed_over == 1);
        assert_eq!(m.stalled_loads as usize, handed_over);
        assert!(!s.is_job_live(job) && !s.is_job_stalled(job));
        s.check_invariants().unwrap();
        let st = s.state();
        assert_eq!(
            (
                st.jobs,
                st.stalled_jobs,
                st.quarantined_chunks,
                st.chunks_being_loaded
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(st.manager.pinned, 0, "the chunk is unpinned either way");
    });
}
