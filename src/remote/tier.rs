//! [`RemoteTier`]: the engine's non-blocking front to a shared remote store.
//!
//! The engine's thread never waits on the network. It hands operations to a
//! dedicated I/O thread over a bounded queue and collects their answers with
//! [`RemoteTier::poll`]:
//!
//! - **put** (write-through of a stored chunk): copied once into a value and
//!   queued; when the queue is full, or the store is unreachable, or the value
//!   is over `max_value_bytes`, the put is dropped and counted, never waited
//!   for;
//! - **lookup** (which chunks the store holds on every rank): answered later,
//!   so the caller answers "not yet" meanwhile, as vLLM's pending lookups do;
//! - **fetch** (one chunk's share for one rank): the value is checked
//!   ([`super::value::decode`]) on the I/O thread, and only a valid payload
//!   is handed back; anything else is a miss with its reason.
//!
//! Every lookup and fetch has a deadline (`op_timeout_ms`, on the injected
//! clock): past it, [`RemoteTier::poll`] gives it up as a miss, and its late
//! answer is dropped and counted, so a stalled store never holds a request.
//!
//! When the store becomes unreachable the I/O thread drops its connection,
//! warns once, answers everything as unavailable (misses, dropped puts), and
//! reconnects with exponential backoff (`backoff_initial_ms` doubling to
//! `backoff_max_ms`); when the store is back, the tier resumes. Refused
//! credentials at start are an error of [`RemoteTier::start`]; an unreachable
//! store at start is not (the engine serves from the host tier meanwhile).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::Duration;

use thiserror::Error;

use crate::clock::SharedClock;
use crate::key::ChunkKey;

use super::config::RemoteTierConfig;
use super::metrics::{Counters, RemoteStats};
use super::namespace::Namespace;
use super::store::{RemoteStore, StoreConnector, StoreError};
use super::value::{self, ValueIdentity, ValueRejected};

/// Why the tier could not start.
#[derive(Debug, Error)]
pub enum RemoteError {
    /// The store refused the credentials (or the configuration cannot work).
    #[error("remote tier {target}: {source}")]
    Store {
        /// The store, with any password removed.
        target: String,
        /// What it answered.
        source: StoreError,
    },
    /// The I/O thread could not be started.
    #[error("remote tier: cannot start its I/O thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// A lookup's or fetch's handle, answered by [`RemoteTier::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// Why a fetch (or lookup) found nothing usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MissReason {
    /// No such key (never written, or evicted by the store).
    Absent,
    /// A value came back and failed its checks.
    Rejected(ValueRejected),
    /// A value came back over `max_value_bytes`.
    TooLarge(usize),
    /// The store could not be reached or failed the read.
    Unavailable,
    /// Not answered within `op_timeout_ms`.
    TimedOut,
    /// The operation queue was full.
    QueueFull,
}

/// What a lookup or fetch came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A lookup: for each chunk asked, whether every rank's share is stored.
    Present(Vec<bool>),
    /// A fetch: the chunk row (checked).
    Fetched(Payload),
    /// A fetch (or a lookup given up) found nothing usable.
    Miss(MissReason),
}

/// A fetched value whose checks passed: its payload is the chunk row.
///
/// Holds the value as read (header and checksum around the payload), so
/// that the row is not copied once more to strip them.
#[derive(Clone, PartialEq, Eq)]
pub struct Payload(Vec<u8>);

impl Payload {
    /// The chunk row.
    pub fn bytes(&self) -> &[u8] {
        &self.0[value::HEADER_BYTES..self.0.len() - value::TRAILER_BYTES]
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes)", self.bytes().len())
    }
}

/// Whether a put was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// Queued for the I/O thread.
    Queued,
    /// Dropped: the queue was full.
    DroppedQueueFull,
    /// Dropped: the store is unreachable now.
    DroppedUnavailable,
    /// Dropped: the value would be over `max_value_bytes`.
    DroppedTooLarge,
}

enum Request {
    Put {
        key: u64,
        rank: u32,
        /// Started by [`value::begin`], payload appended; sealed by the thread.
        value: Vec<u8>,
    },
    Lookup {
        ticket: u64,
        keys: Vec<u64>,
    },
    Fetch {
        ticket: u64,
        key: u64,
        rank: u32,
        payload_bytes: Option<usize>,
    },
    /// Wakes the thread (a reconnection may be due).
    Probe,
}

impl Request {
    /// Value bytes the request moves (expected, for a fetch).
    fn bytes(&self) -> usize {
        match self {
            Request::Put { value, .. } => value.len(),
            Request::Fetch { payload_bytes, .. } => payload_bytes.unwrap_or(0),
            Request::Lookup { .. } | Request::Probe => 0,
        }
    }
}

/// Value bytes after which a batch is sent without waiting for more
/// operations.
const MAX_BATCH_BYTES: usize = 1 << 20;

struct Done {
    ticket: u64,
    answer: Answer,
}

/// The engine's front to a remote store (see the module docs).
pub struct RemoteTier {
    tx: Option<SyncSender<Request>>,
    rx: Receiver<Done>,
    counters: Arc<Counters>,
    namespace: Namespace,
    clock: SharedClock,
    cfg: RemoteTierConfig,
    target: String,
    /// Tickets in flight -> their deadline.
    in_flight: HashMap<u64, Duration>,
    /// Answers known without the thread (queue full), handed out by `poll`.
    ready: Vec<(Ticket, Answer)>,
    next_ticket: u64,
    thread: Option<JoinHandle<()>>,
    /// Shares a chunk has (a lookup finds it when all are there).
    world_size: u32,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("target", &self.target)
            .field(
                "namespace",
                &format_args!("{:016x}", self.namespace.fingerprint()),
            )
            .field("in_flight", &self.in_flight.len())
            .finish_non_exhaustive()
    }
}

impl RemoteTier {
    /// Starts the tier: connects once now (refused credentials or a
    /// configuration the store cannot use are an error; an unreachable store
    /// is not: the tier starts disconnected and retries), then starts the
    /// I/O thread. `world_size`: the ranks each chunk is split over (a
    /// lookup finds a chunk only when every rank's share is there).
    pub fn start(
        mut connector: Box<dyn StoreConnector>,
        cfg: &RemoteTierConfig,
        namespace: Namespace,
        world_size: u32,
        clock: SharedClock,
    ) -> Result<Self, RemoteError> {
        let target = connector.describe();
        let counters = Arc::new(Counters::default());
        connector.set_clock(clock.clone());
        let store = match connector.connect() {
            Ok(s) => {
                counters.connected.store(true, Ordering::Relaxed);
                tracing::info!(target = %target, "remote tier connected");
                Some(s)
            }
            Err(e) if e.is_unavailable() => {
                Counters::add(&counters.outages, 1);
                tracing::warn!(target = %target, error = %e,
                    "remote tier unreachable at start: serving from the host tier, retrying with backoff");
                None
            }
            Err(source) => {
                return Err(RemoteError::Store { target, source });
            }
        };
        let (tx, thread_rx) = mpsc::sync_channel(cfg.queue_capacity);
        let (thread_tx, rx) = mpsc::channel();
        let now = clock.now();
        let io = IoThread {
            rx: thread_rx,
            tx: thread_tx,
            connector,
            store,
            counters: counters.clone(),
            namespace: namespace.clone(),
            clock: clock.clone(),
            world_size: world_size.max(1),
            max_batch: cfg.max_batch,
            max_value_bytes: cfg.max_value_bytes as usize,
            backoff: Duration::from_millis(cfg.backoff_initial_ms),
            backoff_initial: Duration::from_millis(cfg.backoff_initial_ms),
            backoff_max: Duration::from_millis(cfg.backoff_max_ms),
            next_retry: now + Duration::from_millis(cfg.backoff_initial_ms),
            target: target.clone(),
            warned_auth: false,
        };
        let thread = std::thread::Builder::new()
            .name("kvoffload-remote".into())
            .spawn(move || io.run())?;
        Ok(Self {
            tx: Some(tx),
            rx,
            counters,
            namespace,
            clock,
            cfg: cfg.clone(),
            target,
            in_flight: HashMap::new(),
            ready: Vec::new(),
            next_ticket: 1,
            thread: Some(thread),
            world_size: world_size.max(1),
        })
    }

    /// Shares a chunk has in the store (the workers' ranks, or the KV heads
    /// where heads are the shares): a lookup finds a chunk when all are there.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// When the workers write chunks to this tier.
    pub fn write_policy(&self) -> super::config::WritePolicy {
        self.cfg.write
    }

    /// The store this tier uses, with any password removed.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The deployment's namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// Whether the store is reachable now.
    pub fn is_connected(&self) -> bool {
        self.counters.connected.load(Ordering::Relaxed)
    }

    /// Cumulative counters, gauges and latencies.
    pub fn stats(&self) -> RemoteStats {
        self.counters.snapshot()
    }

    /// Puts queued and not yet handled by the I/O thread.
    pub fn queued_puts(&self) -> u64 {
        self.counters.puts_queued.load(Ordering::Relaxed)
    }

    /// Waits (in real time, at most `limit`) until the I/O thread has handled
    /// every queued put; whether none is left. For tools and tests (another
    /// node must find what this one wrote): the engine's step never waits.
    pub fn wait_queued_puts(&self, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while self.queued_puts() > 0 && start.elapsed() < limit {
            // Waiting for the I/O thread to write, not a timer of the engine.
            std::thread::sleep(Duration::from_millis(1));
        }
        self.queued_puts() == 0
    }

    /// Lookups and fetches not answered yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len() + self.ready.len()
    }

    /// Counts a chunk not written because its store wrote only part of the
    /// host row (`RemoteStats::puts_skipped_partial`).
    pub fn note_partial_chunk_not_put(&self) {
        Counters::add(&self.counters.puts_skipped_partial, 1);
    }

    /// Writes chunk `key`'s share of worker `rank` (`payload`: its host row),
    /// asynchronously; never blocks (see [`PutOutcome`]).
    pub fn put(&mut self, key: ChunkKey, rank: u32, payload: &[u8]) -> PutOutcome {
        let c = &self.counters;
        if value::encoded_len(payload.len()) as u64 > self.cfg.max_value_bytes {
            Counters::add(&c.puts_dropped_too_large, 1);
            return PutOutcome::DroppedTooLarge;
        }
        if !self.is_connected() {
            Counters::add(&c.puts_dropped_unavailable, 1);
            self.probe();
            return PutOutcome::DroppedUnavailable;
        }
        let mut v = Vec::new();
        value::begin(&mut v, payload.len());
        v.extend_from_slice(payload);
        let req = Request::Put {
            key: key.0,
            rank,
            value: v,
        };
        // Counted before the send, so that the thread never takes it below 0.
        Counters::add(&c.puts_queued, 1);
        let sent = self.tx.as_ref().map(|tx| tx.try_send(req));
        if !matches!(sent, Some(Ok(()))) {
            c.puts_queued.fetch_sub(1, Ordering::Relaxed);
        }
        match sent {
            Some(Ok(())) => PutOutcome::Queued,
            Some(Err(TrySendError::Full(_))) => {
                Counters::add(&c.puts_dropped_queue_full, 1);
                PutOutcome::DroppedQueueFull
            }
            Some(Err(TrySendError::Disconnected(_))) | None => {
                Counters::add(&c.puts_dropped_unavailable, 1);
                PutOutcome::DroppedUnavailable
            }
        }
    }

    /// Asks which of `keys` the store holds (every rank's share); answered
    /// by [`Self::poll`] as [`Answer::Present`] (or a miss when given up).
    pub fn lookup(&mut self, keys: &[ChunkKey]) -> Ticket {
        let ticket = self.take_ticket();
        let req = Request::Lookup {
            ticket: ticket.0,
            keys: keys.iter().map(|k| k.0).collect(),
        };
        self.send(ticket, req);
        ticket
    }

    /// Reads chunk `key`'s share of worker `rank`; `payload_bytes`: the row
    /// size the caller's layout needs (a value of another size is rejected).
    /// Answered by [`Self::poll`] as [`Answer::Fetched`] or [`Answer::Miss`].
    pub fn fetch(&mut self, key: ChunkKey, rank: u32, payload_bytes: Option<usize>) -> Ticket {
        let ticket = self.take_ticket();
        let req = Request::Fetch {
            ticket: ticket.0,
            key: key.0,
            rank,
            payload_bytes,
        };
        self.send(ticket, req);
        ticket
    }

    /// Hands out the answers that arrived, and gives up the operations past
    /// their deadline (as [`MissReason::TimedOut`]). Never blocks.
    pub fn poll(&mut self, out: &mut Vec<(Ticket, Answer)>) {
        out.append(&mut self.ready);
        while let Ok(done) = self.rx.try_recv() {
            self.deliver(done, out);
        }
        self.expire(out);
    }

    /// Waits (in real time, at most `limit`) for the answer of `ticket`;
    /// other answers that arrive meanwhile are appended to `others`. For
    /// tools and tests: the engine's step uses [`Self::poll`].
    pub fn wait(
        &mut self,
        ticket: Ticket,
        limit: Duration,
        others: &mut Vec<(Ticket, Answer)>,
    ) -> Option<Answer> {
        let start = std::time::Instant::now();
        let mut got = Vec::new();
        loop {
            self.poll(&mut got);
            let mut found = None;
            for (t, a) in got.drain(..) {
                if t == ticket && found.is_none() {
                    found = Some(a);
                } else {
                    others.push((t, a));
                }
            }
            if found.is_some() {
                return found;
            }
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() || !self.in_flight.contains_key(&ticket.0) {
                return None;
            }
            match self.rx.recv_timeout(left.min(Duration::from_millis(20))) {
                Ok(done) => self.deliver(done, &mut got),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Asks the I/O thread to try reconnecting now if its backoff allows
    /// (it also does so on its own).
    pub fn probe(&self) {
        if let Some(tx) = &self.tx {
            let _ = tx.try_send(Request::Probe);
        }
    }

    fn take_ticket(&mut self) -> Ticket {
        let t = Ticket(self.next_ticket);
        self.next_ticket += 1;
        t
    }

    fn send(&mut self, ticket: Ticket, req: Request) {
        let sent = self.tx.as_ref().is_some_and(|tx| tx.try_send(req).is_ok());
        if sent {
            let deadline = self.clock.now() + self.cfg.op_timeout();
            self.in_flight.insert(ticket.0, deadline);
        } else {
            Counters::add(&self.counters.misses, 1);
            self.ready
                .push((ticket, Answer::Miss(MissReason::QueueFull)));
        }
    }

    fn deliver(&mut self, done: Done, out: &mut Vec<(Ticket, Answer)>) {
        if self.in_flight.remove(&done.ticket).is_some() {
            out.push((Ticket(done.ticket), done.answer));
        } else {
            Counters::add(&self.counters.late_answers, 1);
            tracing::debug!(
                ticket = done.ticket,
                "remote answer after its deadline, dropped"
            );
        }
    }

    fn expire(&mut self, out: &mut Vec<(Ticket, Answer)>) {
        if self.in_flight.is_empty() {
            return;
        }
        let now = self.clock.now();
        let mut expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|&(_, &d)| now >= d)
            .map(|(&t, _)| t)
            .collect();
        expired.sort_unstable();
        for t in expired {
            self.in_flight.remove(&t);
            Counters::add(&self.counters.timeouts, 1);
            Counters::add(&self.counters.misses, 1);
            tracing::debug!(ticket = t, "remote operation timed out: a miss");
            out.push((Ticket(t), Answer::Miss(MissReason::TimedOut)));
        }
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        // Closing the queue ends the thread after its current batch (bounded
        // by the store's timeouts).
        self.tx = None;
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("remote tier I/O thread panicked");
        }
    }
}

/// The I/O thread: batches requests, runs them on the store, reconnects.
struct IoThread {
    rx: Receiver<Request>,
    tx: mpsc::Sender<Done>,
    connector: Box<dyn StoreConnector>,
    store: Option<Box<dyn RemoteStore>>,
    counters: Arc<Counters>,
    namespace: Namespace,
    clock: SharedClock,
    world_size: u32,
    max_batch: usize,
    max_value_bytes: usize,
    backoff: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
    next_retry: Duration,
    target: String,
    warned_auth: bool,
}

/// How long the thread waits for work before checking a due reconnection.
const IDLE_WAKE: Duration = Duration::from_millis(50);

impl IoThread {
    fn run(mut self) {
        let mut batch: Vec<Request> = Vec::with_capacity(self.max_batch);
        loop {
            match self.rx.recv_timeout(IDLE_WAKE) {
                Ok(r) => batch.push(r),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // A batch ends at `max_batch` operations or about
            // `MAX_BATCH_BYTES` of values, so that large values stream
            // through instead of piling up in buffers on both sides.
            let mut bytes: usize = batch.iter().map(Request::bytes).sum();
            while batch.len() < self.max_batch && bytes < MAX_BATCH_BYTES {
                match self.rx.try_recv() {
                    Ok(r) => {
                        bytes += r.bytes();
                        batch.push(r);
                    }
                    Err(_) => break,
                }
            }
            self.reconnect_if_due();
            self.process(&mut batch);
        }
    }

    fn reconnect_if_due(&mut self) {
        if self.store.is_some() || self.clock.now() < self.next_retry {
            return;
        }
        Counters::add(&self.counters.reconnect_attempts, 1);
        match self.connector.connect() {
            Ok(s) => {
                self.store = Some(s);
                self.backoff = self.backoff_initial;
                self.warned_auth = false;
                self.counters.connected.store(true, Ordering::Relaxed);
                tracing::info!(target = %self.target, "remote tier reconnected");
            }
            Err(e) => {
                if matches!(e, StoreError::Auth(_)) && !self.warned_auth {
                    self.warned_auth = true;
                    tracing::error!(target = %self.target, error = %e,
                        "remote tier: credentials refused on reconnect; retrying with backoff");
                } else {
                    tracing::debug!(target = %self.target, error = %e, "remote tier reconnect failed");
                }
                self.backoff = (self.backoff * 2).min(self.backoff_max);
                self.next_retry = self.clock.now() + self.backoff;
            }
        }
    }

    /// Drops the connection after a batch found the store unreachable.
    fn disconnect(&mut self, e: &StoreError) {
        if self.store.take().is_some() {
            self.counters.connected.store(false, Ordering::Relaxed);
            Counters::add(&self.counters.outages, 1);
            tracing::warn!(target = %self.target, error = %e,
                "remote tier unreachable: serving from the host tier, retrying with backoff");
            self.backoff = self.backoff_initial;
            self.next_retry = self.clock.now() + self.backoff;
        }
    }

    fn answer(&self, ticket: u64, answer: Answer) {
        // The tier is gone only when it is being dropped: nothing to tell.
        let _ = self.tx.send(Done { ticket, answer });
    }

    fn process(&mut self, batch: &mut Vec<Request>) {
        let mut puts: Vec<(String, Vec<u8>)> = Vec::new();
        let mut lookups: Vec<(u64, Vec<u64>)> = Vec::new();
        let mut fetches: Vec<(u64, u64, u32, Option<usize>)> = Vec::new();
        for r in batch.drain(..) {
            match r {
                Request::Put {
                    key,
                    rank,
                    mut value,
                } => {
                    let id = self.identity(key, rank);
                    value::seal(&mut value, id);
                    puts.push((self.namespace.key(key, rank), value));
                }
                Request::Lookup { ticket, keys } => lookups.push((ticket, keys)),
                Request::Fetch {
                    ticket,
                    key,
                    rank,
                    payload_bytes,
                } => fetches.push((ticket, key, rank, payload_bytes)),
                Request::Probe => {}
            }
        }
        let handled = puts.len() as u64;
        self.run_puts(puts);
        self.counters
            .puts_queued
            .fetch_sub(handled, Ordering::Relaxed);
        self.run_lookups(lookups);
        self.run_fetches(fetches);
    }

    fn identity(&self, key: u64, rank: u32) -> ValueIdentity {
        ValueIdentity {
            namespace: self.namespace.fingerprint(),
            key,
            rank,
        }
    }

    /// After a batch: drops the connection when every item failed as
    /// unreachable and the store does not answer a ping either. A partial
    /// failure, or a batch whose keys all sat on one dead cluster master
    /// while the others answer, keeps it.
    fn settle<T>(&mut self, results: &[Result<T, StoreError>]) {
        let all_down = !results.is_empty()
            && results
                .iter()
                .all(|r| matches!(r, Err(e) if e.is_unavailable()));
        if !all_down {
            return;
        }
        let alive = match self.store.as_mut() {
            Some(s) => s.ping(),
            None => return,
        };
        if let Err(e) = alive {
            self.disconnect(&e);
        }
    }

    fn run_puts(&mut self, puts: Vec<(String, Vec<u8>)>) {
        if puts.is_empty() {
            return;
        }
        let c = self.counters.clone();
        let Some(store) = self.store.as_mut() else {
            Counters::add(&c.puts_dropped_unavailable, puts.len() as u64);
            return;
        };
        let items: Vec<(&str, &[u8])> = puts
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let t0 = self.clock.now();
        let results = store.put_many(&items);
        let dt = self.clock.now().saturating_sub(t0);
        observe(&c, true, dt);
        for ((_, v), r) in puts.iter().zip(&results) {
            match r {
                Ok(()) => {
                    Counters::add(&c.puts_written, 1);
                    Counters::add(&c.bytes_put, v.len() as u64);
                }
                Err(e) => {
                    Counters::add(&c.puts_failed, 1);
                    tracing::debug!(error = %e, "remote put failed");
                }
            }
        }
        self.settle(&results);
    }

    fn run_lookups(&mut self, lookups: Vec<(u64, Vec<u64>)>) {
        if lookups.is_empty() {
            return;
        }
        let c = self.counters.clone();
        let ws = self.world_size;
        let Some(store) = self.store.as_mut() else {
            for (ticket, keys) in lookups {
                Counters::add(&c.lookups, 1);
                self.answer(ticket, Answer::Present(vec![false; keys.len()]));
            }
            return;
        };
        let names: Vec<String> = lookups
            .iter()
            .flat_map(|(_, keys)| keys.iter())
            .flat_map(|&k| (0..ws).map(move |r| (k, r)))
            .map(|(k, r)| self.namespace.key(k, r))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let t0 = self.clock.now();
        let results = store.exists_many(&refs);
        observe(&c, false, self.clock.now().saturating_sub(t0));
        for e in results.iter().filter_map(|r| r.as_ref().err()) {
            Counters::add(&c.get_errors, 1);
            tracing::debug!(error = %e, "remote exists failed (counted as absent)");
        }
        // The connection state first, so that a caller who sees the answer
        // also sees an outage it revealed.
        self.settle(&results);
        let mut at = 0;
        for (ticket, keys) in &lookups {
            let present: Vec<bool> = keys
                .iter()
                .map(|_| {
                    let all = results[at..at + ws as usize]
                        .iter()
                        .all(|r| matches!(r, Ok(true)));
                    at += ws as usize;
                    all
                })
                .collect();
            Counters::add(&c.lookups, 1);
            Counters::add(
                &c.lookup_chunks_present,
                present.iter().filter(|&&p| p).count() as u64,
            );
            self.answer(*ticket, Answer::Present(present));
        }
    }

    fn run_fetches(&mut self, fetches: Vec<(u64, u64, u32, Option<usize>)>) {
        if fetches.is_empty() {
            return;
        }
        let c = self.counters.clone();
        let Some(store) = self.store.as_mut() else {
            for (ticket, ..) in fetches {
                Counters::add(&c.misses, 1);
                self.answer(ticket, Answer::Miss(MissReason::Unavailable));
            }
            return;
        };
        let names: Vec<String> = fetches
            .iter()
            .map(|&(_, k, r, _)| self.namespace.key(k, r))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let t0 = self.clock.now();
        let results = store.get_many(&refs);
        observe(&c, false, self.clock.now().saturating_sub(t0));
        let mut statuses: Vec<Result<(), StoreError>> = Vec::with_capacity(results.len());
        let mut answers: Vec<(u64, Answer)> = Vec::with_capacity(results.len());
        for (&(ticket, key, rank, payload_bytes), r) in fetches.iter().zip(results) {
            let answer = match r {
                Ok(None) => Answer::Miss(MissReason::Absent),
                Ok(Some(v)) => {
                    Counters::add(&c.bytes_got, v.len() as u64);
                    self.check(v, key, rank, payload_bytes)
                }
                Err(e) => {
                    Counters::add(&c.get_errors, 1);
                    tracing::debug!(error = %e, "remote get failed");
                    statuses.push(Err(e));
                    Answer::Miss(MissReason::Unavailable)
                }
            };
            if !matches!(answer, Answer::Miss(MissReason::Unavailable)) {
                statuses.push(Ok(()));
            }
            match &answer {
                Answer::Fetched(_) => Counters::add(&c.hits, 1),
                _ => Counters::add(&c.misses, 1),
            }
            answers.push((ticket, answer));
        }
        // The connection state first (see `run_lookups`).
        self.settle(&statuses);
        for (ticket, answer) in answers {
            self.answer(ticket, answer);
        }
    }

    /// A fetched value's payload, or why it is rejected.
    fn check(&self, v: Vec<u8>, key: u64, rank: u32, payload_bytes: Option<usize>) -> Answer {
        let c = &self.counters;
        if v.len() > self.max_value_bytes {
            Counters::add(&c.rejected_values, 1);
            tracing::warn!(
                key,
                rank,
                bytes = v.len(),
                "remote value over max_value_bytes, rejected"
            );
            return Answer::Miss(MissReason::TooLarge(v.len()));
        }
        match value::decode(&v, self.identity(key, rank), payload_bytes) {
            Ok(_) => Answer::Fetched(Payload(v)),
            Err(why) => {
                Counters::add(&c.rejected_values, 1);
                tracing::warn!(key, rank, reason = %why, "remote value rejected (a miss)");
                Answer::Miss(MissReason::Rejected(why))
            }
        }
    }
}

fn observe(c: &Counters, put: bool, dt: Duration) {
    let mut l = match c.latency.lock() {
        Ok(l) => l,
        Err(poisoned) => poisoned.into_inner(),
    };
    if put {
        l.put.observe(dt.as_secs_f64());
    } else {
        l.get.observe(dt.as_secs_f64());
    }
}

#[cfg(test)]
#[path = "tier_tests.rs"]
mod tests;
