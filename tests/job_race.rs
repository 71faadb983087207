//! Real threads: worker reports race the watchdog's scans (run from another
//! thread through `WatchdogHandle`) on jobs that are all past their deadline.
//! Whatever the interleaving, every job ends exactly once (completed, or
//! stalled with its remaining reports accepted as late), no report is
//! rejected, and nothing is left after the requests finish. The loom models in
//! `src/scheduler/latch.rs` explore the interleavings exhaustively; this runs
//! the real job table, watchdog and completion path.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use kvoffload::scheduler::{StepInput, WorkerReport};
use kvoffload::{JobId, RequestId};

const JOBS: u64 = 32;
const ROUNDS: u64 = 20;

#[test]
fn reports_racing_the_watchdog_end_every_job_exactly_once() {
    let mut total_stalled = 0;
    for round in 0..ROUNDS {
        let mut h = H::new(Geo {
            world: 2,
            chunks: 256,
            ..Geo::default()
        });
        let mut jobs = Vec::new();
        for i in 0..JOBS {
            h.add(i, i + 1, 4);
            h.lookup(i, 0);
            h.alloc(i, &b([i as u32 + 1]), 0);
            jobs.push(h.run(&[(i, b([i as u32 + 1]), 0, 4)], &[], &[]).stores[0].job);
        }
        // Every job is past its deadline: any scan may stall any of them.
        h.advance_s(400);
        let stop = Arc::new(AtomicBool::new(false));
        let scanner = {
            let handle = h.s.watchdog_handle();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Acquire) {
                    n += if n % 2 == 0 {
                        handle.scan_full()
                    } else {
                        handle.scan()
                    };
                    std::thread::yield_now();
                }
                n
            })
        };
        // Two workers report each job once, in an order that changes per round.
        for w in 0..2u64 {
            for k in 0..JOBS {
                let job = jobs[((k * 7 + round * 3 + w * 5) % JOBS) as usize];
                let out = h.s.on_worker_output(&WorkerReport {
                    completed: vec![(job, 1)],
                    failed: vec![],
                });
                assert!(out.rejected.is_empty(), "round {round}: {:?}", out.rejected);
            }
        }
        stop.store(true, Ordering::Release);
        let handed_over = scanner.join().expect("scanner");
        // The next hook applies whatever the scanner handed over last.
        h.run(&[], &[], &[]);
        let m = h.s.metrics();
        for &job in &jobs {
            assert!(!h.s.is_job_live(job), "round {round}: {job} still live");
            assert!(
                !h.s.is_job_stalled(job),
                "round {round}: {job} still owes late reports"
            );
        }
        assert!(
            m.stalled_stores as usize <= handed_over,
            "stalls only through hand-overs"
        );
        assert!(m.stalled_stores <= JOBS);
        assert_eq!(m.unknown_reports, 0);
        total_stalled += m.stalled_stores;
        // Finish every request: nothing is left.
        for i in 0..JOBS {
            h.s.request_finished(RequestId(i), &b([i as u32 + 1]), false, 4)
                .expect("finish");
        }
        let plan = h.step(StepInput {
            finished: (0..JOBS).map(RequestId).collect(),
            ..StepInput::default()
        });
        let more: Vec<(JobId, u32)> = plan.stores.iter().map(|s| (s.job, 2)).collect();
        h.report(&more);
        let st = h.s.state();
        assert_eq!(
            (
                st.jobs,
                st.requests,
                st.stalled_jobs,
                st.quarantined_chunks,
                st.fenced_blocks
            ),
            (0, 0, 0, 0, 0),
            "round {round}: {st:?}"
        );
        assert_eq!(
            st.manager.pending + st.manager.pinned + st.manager.quarantined,
            0
        );
    }
    println!("stalled {total_stalled} of {} jobs", JOBS * ROUNDS);
}
