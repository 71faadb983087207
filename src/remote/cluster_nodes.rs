//! A Redis Cluster batch sent to each master on a plain connection of its
//! own: the batch's commands are grouped by the master of their slot, each
//! group is written as one pipeline, then each master's replies are read.
//!
//! Why not the `redis` crate's cluster pipeline: it reads a master's replies
//! one by one, each with the full response timeout, so a master that hangs
//! (a frozen process, a partition: the kernel still accepts, nothing
//! answers) costs one timeout per key of the batch (21 keys: ~42 s with the
//! default 2 s timeout). Here a master that does not answer costs the batch
//! one timeout: its first read fails, its other keys fail with it, and its
//! connection is dropped (replies may be left unread). The slot map is asked
//! for at once, and the failed keys whose slots another master now holds (a
//! failover the cluster already agreed on) are sent again in the same batch.
//! A master that still holds them is skipped (its keys fail at once, as
//! unavailable) for a window on the tier's clock (`backoff_initial_ms`,
//! doubling while it keeps failing, up to `backoff_max_ms`), and the slot map
//! is asked for before each batch meanwhile, so that a failover is followed
//! as soon as the cluster agrees on it.
//!
//! Commands answered with a redirection (`MOVED`, `ASK`: a slot migrating or
//! moved) and keys whose slot has no known master are left to the caller,
//! which sends them through the crate's cluster client (it follows
//! redirections); a `MOVED` also asks for the slot map again.

use std::collections::HashMap;
use std::time::Duration;

use redis::{Connection, RedisError, RedisResult, Value};

use crate::clock::SharedClock;

use super::cluster_slots::{NodeAddr, SlotOwners, key_slot};
use super::redis_op::Op;

/// Opens a plain connection to one master (the configuration's credentials,
/// TLS and timeouts).
pub(super) type NodeOpener = Box<dyn Fn(&NodeAddr) -> RedisResult<Connection> + Send>;

/// What became of one command of a batch.
#[derive(Debug)]
pub(super) enum NodeAnswer {
    /// The master's reply (error replies other than redirections included),
    /// or why it could not be had.
    Done(RedisResult<Value>),
    /// For the cluster client: a redirection, or no known master.
    Redirect,
}

/// The plain connections to the cluster's masters, and what is known of
/// them.
pub(super) struct ClusterNodes {
    owners: SlotOwners,
    conns: HashMap<NodeAddr, Connection>,
    /// The configured nodes, asked for the slot map when no known master
    /// answers.
    seeds: Vec<NodeAddr>,
    /// Masters that could not be reached: skipped until this time (on
    /// `clock`), their keys failing with this error.
    skipped: HashMap<NodeAddr, (Duration, RedisError)>,
    /// Each failing master's current skip window (doubled at each failure,
    /// forgotten once it answers).
    windows: HashMap<NodeAddr, Duration>,
    /// First and longest skip window.
    backoff: (Duration, Duration),
    clock: SharedClock,
    /// The slot map must be asked again before the next batch.
    stale: bool,
    /// A node answered `CLUSTER SLOTS` in a shape not understood (an
    /// unknown endpoint, "?"): batches go through the cluster client, and
    /// the slot map is not asked for again.
    unmappable: bool,
    open: NodeOpener,
}

impl std::fmt::Debug for ClusterNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNodes")
            .field("owners", &self.owners)
            .field("connected", &self.conns.len())
            .field("skipped", &self.skipped.len())
            .finish_non_exhaustive()
    }
}

impl ClusterNodes {
    /// No master known yet; `open` connects to one, `seeds` are the
    /// configured nodes; an unreachable master is skipped for `backoff.0`,
    /// doubling up to `backoff.1`, on `clock`.
    pub(super) fn new(
        open: NodeOpener,
        seeds: Vec<NodeAddr>,
        backoff: (Duration, Duration),
        clock: SharedClock,
    ) -> Self {
        Self {
            owners: SlotOwners::default(),
            conns: HashMap::new(),
            seeds,
            skipped: HashMap::new(),
            windows: HashMap::new(),
            backoff,
            clock,
            stale: true,
            unmappable: false,
            open,
        }
    }

    /// The slot map as last learned (empty if never).
    pub(super) fn owners(&self) -> &SlotOwners {
        &self.owners
    }

    /// Whether the slot map should be asked for before the next batch (never
    /// learned, a `MOVED` seen, or a master being skipped).
    pub(super) fn wants_slot_map(&self) -> bool {
        !self.unmappable && (self.stale || !self.skipped.is_empty() || self.owners.is_empty())
    }

    /// A fresh slot map: masters no longer in it are forgotten.
    pub(super) fn set_owners(&mut self, owners: SlotOwners) {
        let masters = owners.masters();
        self.conns.retain(|n, _| masters.contains(n));
        self.skipped.retain(|n, _| masters.contains(n));
        self.windows.retain(|n, _| masters.contains(n));
        self.owners = owners;
        self.stale = false;
    }

    /// Asks for the slot map (`CLUSTER SLOTS`): the known masters not being
    /// skipped, then the configured nodes, until one answers; a node that
    /// fails to is skipped like an unreachable master. Keeps the map it had
    /// when none answers; returns whether one did.
    pub(super) fn refresh_slot_map(&mut self) -> bool {
        let mut sources = self.owners.masters();
        for s in &self.seeds {
            if !sources.contains(s) {
                sources.push(s.clone());
            }
        }
        sources.retain(|n| !self.skipped.contains_key(n));
        for node in sources {
            let reply = self
                .conn(&node)
                .and_then(|c| redis::cmd("CLUSTER").arg("SLOTS").query::<Value>(c));
            match reply {
                Ok(v) => match SlotOwners::from_reply(&v) {
                    Some(o) => {
                        self.set_owners(o);
                        return true;
                    }
                    None => {
                        tracing::warn!(host = %node.host, port = node.port,
                            "CLUSTER SLOTS answered in a shape not understood: \
                             batches go through the cluster client's pipeline");
                        self.unmappable = true;
                        return false;
                    }
                },
                Err(e)
                    if e.is_io_error()
                        || e.is_timeout()
                        || e.is_connection_dropped()
                        || e.is_connection_refusal() =>
                {
                    self.unreachable(node, e)
                }
                Err(e) => tracing::debug!(host = %node.host, port = node.port, error = %e,
                    "CLUSTER SLOTS refused"),
            }
        }
        false
    }

    /// Runs `ops`: one answer per op, in order.
    pub(super) fn run(&mut self, ops: &[Op<'_>]) -> Vec<NodeAnswer> {
        let now = self.clock.now();
        self.skipped.retain(|_, (until, _)| *until > now);
        let all: Vec<usize> = (0..ops.len()).collect();
        let mut answers: Vec<NodeAnswer> = (0..ops.len()).map(|_| NodeAnswer::Redirect).collect();
        let failed = self.round(ops, &all, &mut answers);
        // A master could not be reached: if the cluster already moved its
        // slots (a failover), its keys go to the new master now.
        if failed.is_empty() || !self.refresh_slot_map() {
            return answers;
        }
        let again: Vec<usize> = failed
            .into_iter()
            .filter(|(i, node)| {
                self.owners
                    .owner_of(key_slot(ops[*i].key()))
                    .is_some_and(|n| n != node && !self.skipped.contains_key(n))
            })
            .map(|(i, _)| i)
            .collect();
        if !again.is_empty() {
            self.round(ops, &again, &mut answers);
        }
        answers
    }

    /// Sends the ops `idx` to their masters and reads the replies into
    /// `answers`; returns the ops whose master could not be reached, with it.
    fn round(
        &mut self,
        ops: &[Op<'_>],
        idx: &[usize],
        answers: &mut [NodeAnswer],
    ) -> Vec<(usize, NodeAddr)> {
        let mut failed = Vec::new();
        let mut groups: Vec<(NodeAddr, Vec<usize>)> = Vec::new();
        for &i in idx {
            let Some(node) = self.owners.owner_of(key_slot(ops[i].key())) else {
                answers[i] = NodeAnswer::Redirect;
                continue;
            };
            if let Some((_, e)) = self.skipped.get(node) {
                answers[i] = NodeAnswer::Done(Err(e.clone()));
                continue;
            }
            match groups.iter_mut().find(|(n, _)| n == node) {
                Some((_, g)) => g.push(i),
                None => groups.push((node.clone(), vec![i])),
            }
        }
        // Every master's pipeline is written before any reply is read.
        let mut sent = Vec::with_capacity(groups.len());
        let mut buf = Vec::new();
        for (node, g) in groups {
            buf.clear();
            for &i in &g {
                ops[i].pack(&mut buf);
            }
            match self.send(&node, &buf) {
                Ok(()) => sent.push((node, g)),
                Err(e) => {
                    for &i in &g {
                        answers[i] = NodeAnswer::Done(Err(e.clone()));
                        failed.push((i, node.clone()));
                    }
                    self.unreachable(node, e);
                }
            }
        }
        for (node, g) in sent {
            let mut broke: Option<RedisError> = None;
            for &i in &g {
                answers[i] = match (&broke, self.conns.get_mut(&node)) {
                    (Some(e), _) => NodeAnswer::Done(Err(e.clone())),
                    (None, None) => NodeAnswer::Redirect,
                    (None, Some(c)) => match c.recv_response() {
                        Ok(Value::ServerError(se)) if matches!(se.code(), "MOVED" | "ASK") => {
                            self.stale |= se.code() == "MOVED";
                            NodeAnswer::Redirect
                        }
                        Ok(v) => NodeAnswer::Done(Ok(v)),
                        Err(e) => {
                            broke = Some(e.clone());
                            NodeAnswer::Done(Err(e))
                        }
                    },
                };
            }
            match broke {
                Some(e) => {
                    failed.extend(g.iter().map(|&i| (i, node.clone())));
                    self.unreachable(node, e);
                }
                None => {
                    self.windows.remove(&node);
                }
            }
        }
        failed
    }

    fn send(&mut self, node: &NodeAddr, buf: &[u8]) -> RedisResult<()> {
        self.conn(node)?.send_packed_command(buf)
    }

    /// `node`'s connection, opened if there is none.
    fn conn(&mut self, node: &NodeAddr) -> RedisResult<&mut Connection> {
        if !self.conns.contains_key(node) {
            let c = (self.open)(node)?;
            self.conns.insert(node.clone(), c);
        }
        self.conns
            .get_mut(node)
            .ok_or_else(|| RedisError::from((redis::ErrorKind::Io, "connection lost")))
    }

    /// `node` could not be reached: its connection (which may hold unread
    /// replies) is dropped, and it is skipped for a window.
    fn unreachable(&mut self, node: NodeAddr, e: RedisError) {
        let (first, longest) = self.backoff;
        let window = self
            .windows
            .get(&node)
            .map_or(first, |w| w.saturating_mul(2).min(longest));
        tracing::debug!(host = %node.host, port = node.port, error = %e, ?window,
            "cluster master unreachable: its keys fail at once meanwhile");
        self.conns.remove(&node);
        self.windows.insert(node.clone(), window);
        self.skipped.insert(node, (self.clock.now() + window, e));
        self.stale = true;
    }
}
