//! Real threads: worker reports race the watchdog's scans (run from another
//! thread through `WatchdogHandle`) on jobs that are all past their deadline.
//! Whatever the interleaving, every job ends exactly once (completed, or
//! stalled with its remaining reports accepted as late), no report is
//! rejected, and nothing is left after the requests finish. The scanner
//! starts at a different point of the report sequence each round, and the
//! test runs rounds until it has seen every interleaving it is about (stalled
//! before the first report, between the two, completed while the scanner
//! ran, and the latch race inside one report), and fails if it has not. The loom models in
//! `src/scheduler/latch.rs` explore the interleavings exhaustively; this runs
//! the real job table, watchdog and completion path.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use kvoffload::scheduler::{CompletionReport, StepInput};
use kvoffload::{JobId, RequestId};

const JOBS: u64 = 32;
/// Rounds always run; more run (up to `MAX_ROUNDS`) until every interleaving
/// below has been seen.
const MIN_ROUNDS: u64 = 20;
const MAX_ROUNDS: u64 = 5_000;

/// How the reports of one job met the watchdog.
#[derive(Debug, Default)]
struct Seen {
    /// Stalled before its first report (both reports late).
    stalled_before_reports: u64,
    /// Stalled between its two reports (one counted, one late).
    stalled_between_reports: u64,
    /// Completed by its reports while the scanner was running.
    completed_while_scanning: u64,
    /// Reports that found their job handed over while the report was being
    /// applied (the latch race itself: `reports_racing_stall`).
    raced_inside_a_report: u64,
}

impl Seen {
    fn all(&self) -> bool {
        self.stalled_before_reports > 0
            && self.stalled_between_reports > 0
            && self.completed_while_scanning > 0
            && self.raced_inside_a_report > 0
    }
}

#[test]
fn reports_racing_the_watchdog_end_every_job_exactly_once() {
    let mut seen = Seen::default();
    let mut rounds = 0;
    while rounds < MIN_ROUNDS || (!seen.all() && rounds < MAX_ROUNDS) {
        race_round(rounds, &mut seen);
        rounds += 1;
    }
    println!("{rounds} rounds: {seen:?}");
    assert!(
        seen.all(),
        "after {rounds} rounds, not every interleaving occurred: {seen:?}"
    );
}

fn race_round(round: u64, seen: &mut Seen) {
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
    let go = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let scanner = {
        let handle = h.s.watchdog_handle();
        let (go, stop) = (Arc::clone(&go), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !go.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            let mut n = 0;
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                n += if i.is_multiple_of(2) {
                    handle.scan_full()
                } else {
                    handle.scan()
                };
                i += 1;
                std::thread::yield_now();
            }
            n
        })
    };
    // Two workers report each job once, in an order that changes per round;
    // the scanner starts at a point of the sequence that changes per round.
    let total = 2 * JOBS;
    let start_at = (round * 13) % (total + 1);
    let mut late_per_job = vec![[false; 2]; JOBS as usize];
    let mut scanning = false;
    for idx in 0..total {
        if idx == start_at {
            go.store(true, Ordering::Release);
            scanning = true;
        }
        let (w, k) = (idx / JOBS, idx % JOBS);
        let pos = ((k * 7 + round * 3 + w * 5) % JOBS) as usize;
        let job = jobs[pos];
        let before = h.s.metrics().late_reports;
        let out = h.s.on_worker_output(&CompletionReport {
            completed: vec![(job, 1)],
            failed: vec![],
        });
        assert!(out.rejected.is_empty(), "round {round}: {:?}", out.rejected);
        let late = h.s.metrics().late_reports > before;
        late_per_job[pos][w as usize] = late;
        if w == 1 && !late && scanning {
            seen.completed_while_scanning += 1;
        }
    }
    go.store(true, Ordering::Release);
    stop.store(true, Ordering::Release);
    let handed_over = scanner.join().expect("scanner");
    for l in &late_per_job {
        match *l {
            [true, true] => seen.stalled_before_reports += 1,
            [false, true] => seen.stalled_between_reports += 1,
            [false, false] => {}
            [true, false] => panic!("round {round}: a report counted after a late one"),
        }
    }
    // The next hook applies whatever the scanner handed over last.
    h.run(&[], &[], &[]);
    let m = h.s.metrics();
    seen.raced_inside_a_report += m.reports_racing_stall;
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
    // Every job ended exactly once: stalled (its late reports counted) or
    // completed.
    let stalled = late_per_job.iter().filter(|l| l[1]).count() as u64;
    assert_eq!(m.stalled_stores, stalled, "round {round}");
    assert_eq!(
        m.late_reports,
        late_per_job.iter().flatten().filter(|&&l| l).count() as u64
    );
    assert_eq!(m.unknown_reports, 0);
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
