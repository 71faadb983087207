//! The remote tier sweep: put and get throughput of [`RemoteTier`] per value
//! size, against a plain `redis` client loop (one `SET` or `GET` after the
//! other, same sizes, same server, same run). Every value read back is
//! compared with what was written.

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::clock::MonotonicClock;
use crate::key::ChunkKey;
use crate::remote::{
    Answer, MissReason, Namespace, NamespaceParts, PutOutcome, RedisConnector, RemoteError,
    RemoteTier, RemoteTierConfig, StoreError, Ticket,
};

use super::BenchRow;

/// Trials per point, the two sides alternating (the best one counts).
const TRIALS: usize = 3;
/// How long one answer may take before the bench gives up.
const ANSWER_LIMIT: Duration = Duration::from_secs(60);

/// What to sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSweep {
    /// Payload sizes in bytes (one chunk row each).
    pub value_bytes: Vec<u64>,
    /// Payload bytes to move per point and direction.
    pub bytes_per_point: u64,
}

impl Default for RemoteSweep {
    fn default() -> Self {
        Self {
            value_bytes: vec![4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20],
            bytes_per_point: 64 << 20,
        }
    }
}

/// Why the remote sweep stopped.
#[derive(Debug, Error)]
pub enum RemoteBenchError {
    /// The tier could not start.
    #[error(transparent)]
    Tier(#[from] RemoteError),
    /// The store refused a connection or an operation.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The plain client failed.
    #[error("plain redis client: {0}")]
    Plain(String),
    /// A put was dropped, an answer did not come, or bytes came back wrong.
    #[error("remote bench: {0}")]
    Check(String),
}

/// Runs the sweep against the store of `cfg`.
pub fn run_remote(
    cfg: &RemoteTierConfig,
    sweep: &RemoteSweep,
) -> Result<Vec<BenchRow>, RemoteBenchError> {
    let mut rows = Vec::new();
    let connector = RedisConnector::new(cfg)?;
    let mut plain = connector.plain_connection()?;
    let largest = sweep.value_bytes.iter().copied().max().unwrap_or(0);
    let mut tier_cfg = cfg.clone();
    // Room for the largest value; a queue as deep as one point's puts.
    tier_cfg.max_value_bytes = tier_cfg.max_value_bytes.max(largest + 4096);
    let ns = Namespace::new(&NamespaceParts {
        model: "kvoffload-bench".into(),
        layout: "bench".into(),
        tokens_per_block: 16,
        blocks_per_chunk: 1,
        bytes_per_block: 0,
        world_size: 1,
    });
    let mut tier = RemoteTier::start(
        Box::new(connector),
        &tier_cfg,
        ns.clone(),
        1,
        MonotonicClock::shared(),
    )?;
    if !tier.is_connected() {
        return Err(RemoteBenchError::Check(format!(
            "{} is unreachable",
            tier.target()
        )));
    }
    // Puts in flight at most: half the queue (lookups and fetches need room too).
    let room = (tier_cfg.queue_capacity as u64 / 2).max(1);
    for &vb in &sweep.value_bytes {
        let n = (sweep.bytes_per_point / vb.max(1)).clamp(4, 4096) as usize;
        let payloads: Vec<Vec<u8>> = (0..n.min(16))
            .map(|i| pattern(i as u64, vb as usize))
            .collect();
        let plain_keys: Vec<String> = (0..n)
            .map(|i| format!("kvo-bench-plain:{vb}:{i}"))
            .collect();
        let (mut put, mut get, mut plain_put, mut plain_get) = (0f64, 0f64, 0f64, 0f64);
        for trial in 0..TRIALS {
            let base = (vb << 20) + (trial as u64) * 65_536;
            let t = Instant::now();
            tier_put(&mut tier, room, base, n, &payloads)?;
            put = put.max(gbps(n, vb, t.elapsed()));
            let t = Instant::now();
            tier_get(&mut tier, room, base, n, &payloads)?;
            get = get.max(gbps(n, vb, t.elapsed()));
            let t = Instant::now();
            for (i, k) in plain_keys.iter().enumerate() {
                redis::cmd("SET")
                    .arg(k)
                    .arg(&payloads[i % payloads.len()])
                    .exec(plain.as_mut())
                    .map_err(|e| RemoteBenchError::Plain(e.to_string()))?;
            }
            plain_put = plain_put.max(gbps(n, vb, t.elapsed()));
            let t = Instant::now();
            for (i, k) in plain_keys.iter().enumerate() {
                let v: Vec<u8> = redis::cmd("GET")
                    .arg(k)
                    .query(plain.as_mut())
                    .map_err(|e| RemoteBenchError::Plain(e.to_string()))?;
                if v != payloads[i % payloads.len()] {
                    return Err(RemoteBenchError::Check(format!(
                        "plain GET {k}: wrong bytes"
                    )));
                }
            }
            plain_get = plain_get.max(gbps(n, vb, t.elapsed()));
            // Leave the store as it was.
            for i in 0..n {
                let _ = redis::cmd("DEL")
                    .arg(ns.key(base + i as u64, 0))
                    .exec(plain.as_mut());
            }
        }
        for k in &plain_keys {
            let _ = redis::cmd("DEL").arg(k).exec(plain.as_mut());
        }
        for (dir, g, c) in [("put", put, plain_put), ("get", get, plain_get)] {
            rows.push(BenchRow {
                backend: "remote".into(),
                strategy: "tier".into(),
                direction: dir.into(),
                block_bytes: vb,
                blocks: n as u32,
                gbps: g,
                ceiling_gbps: c,
                fraction_of_ceiling: if c > 0.0 { g / c } else { 0.0 },
                submit_us: None,
                ..BenchRow::default()
            });
        }
    }
    let s = tier.stats();
    if s.puts_dropped() > 0 || s.rejected_values > 0 || s.get_errors > 0 {
        return Err(RemoteBenchError::Check(format!(
            "puts dropped {}, values rejected {}, get errors {}",
            s.puts_dropped(),
            s.rejected_values,
            s.get_errors
        )));
    }
    Ok(rows)
}

/// Puts `n` values, at most a queue's worth in flight, and waits until all
/// are written.
fn tier_put(
    tier: &mut RemoteTier,
    room: u64,
    base: u64,
    n: usize,
    payloads: &[Vec<u8>],
) -> Result<(), RemoteBenchError> {
    for i in 0..n {
        // The bench keeps every value: it waits for room in the queue (the
        // engine would drop the put instead).
        let t0 = Instant::now();
        while tier.queued_puts() >= room {
            if t0.elapsed() > ANSWER_LIMIT {
                return Err(RemoteBenchError::Check(
                    "the put queue never drained".into(),
                ));
            }
            // Not a spin: the I/O thread and the server need the cores.
            std::thread::sleep(Duration::from_micros(20));
        }
        let p = &payloads[i % payloads.len()];
        match tier.put(ChunkKey(base + i as u64), 0, p) {
            PutOutcome::Queued => {}
            other => return Err(RemoteBenchError::Check(format!("put {i}: {other:?}"))),
        }
    }
    // A lookup answered after the puts: they are written (one queue, in
    // order). A full queue answers it at once: then ask again.
    for _ in 0..100_000 {
        let tk = tier.lookup(&[]);
        match wait(tier, tk)? {
            Answer::Miss(MissReason::QueueFull) => std::thread::yield_now(),
            _ => return Ok(()),
        }
    }
    Err(RemoteBenchError::Check("the queue never drained".into()))
}

/// Fetches `n` values (pipelined) and checks every byte.
fn tier_get(
    tier: &mut RemoteTier,
    room: u64,
    base: u64,
    n: usize,
    payloads: &[Vec<u8>],
) -> Result<(), RemoteBenchError> {
    // In flight, oldest first: the bench waits for the oldest and refills
    // the window as answers come.
    let mut pending: std::collections::BTreeMap<Ticket, usize> = std::collections::BTreeMap::new();
    let mut answers = Vec::new();
    let mut next = 0;
    // Fetches in flight: about 16 MiB of values (at least 4), as an engine
    // fetching a few prefixes at a time would have.
    let vb = payloads.first().map_or(1, Vec::len).max(1);
    let window = (16usize << 20)
        .div_ceil(vb)
        .clamp(4, 256)
        .min(room as usize);
    while next < n || !pending.is_empty() {
        while next < n && pending.len() < window {
            let len = payloads[next % payloads.len()].len();
            let tk = tier.fetch(ChunkKey(base + next as u64), 0, Some(len));
            pending.insert(tk, next);
            next += 1;
        }
        answers.clear();
        let Some((&oldest, _)) = pending.first_key_value() else {
            break;
        };
        match tier.wait(oldest, ANSWER_LIMIT, &mut answers) {
            Some(a) => answers.push((oldest, a)),
            None => return Err(RemoteBenchError::Check("a fetch was not answered".into())),
        }
        for (tk, a) in answers.drain(..) {
            let Some(i) = pending.remove(&tk) else {
                continue;
            };
            match a {
                Answer::Fetched(p) if p.bytes() == payloads[i % payloads.len()].as_slice() => {}
                other => {
                    return Err(RemoteBenchError::Check(format!("fetch {i}: {other:?}")));
                }
            }
        }
    }
    Ok(())
}

fn wait(tier: &mut RemoteTier, tk: Ticket) -> Result<Answer, RemoteBenchError> {
    let mut others = Vec::new();
    tier.wait(tk, ANSWER_LIMIT, &mut others)
        .ok_or_else(|| RemoteBenchError::Check("an answer did not come".into()))
}

fn gbps(n: usize, bytes: u64, dt: Duration) -> f64 {
    n as f64 * bytes as f64 / dt.as_secs_f64().max(1e-9) / 1e9
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
