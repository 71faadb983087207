//! The remote tier against real Redis servers on loopback (Debian's
//! `redis-server`, started and stopped by the tests on free ports): one
//! server, a 3-master Redis Cluster, a master killed mid-run and restarted,
//! a slot migration mid-run (`ASK`, then `MOVED`), a master failing over to
//! its replica, values corrupted, foreign or evicted, refused credentials.
//!
//! Without `redis-server` these tests are ignored with their reason (see
//! `build.rs`, `cfg(kvoffload_redis)`); `scripts/test.sh` installs it.

#[path = "common/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use kvoffload::remote::value::{self, ValueIdentity, ValueRejected};
use kvoffload::remote::{
    Answer, MissReason, Namespace, NamespaceParts, PutOutcome, RedisConnector, RemoteError,
    RemoteTier, RemoteTierConfig, Secret, StoreError, Ticket,
};
use kvoffload::{ChunkKey, ManualClock};
use redis_server::{RedisCluster, RedisServer, key_slot};

/// Real-time bound on one answer (the answers are what the tests wait for).
const LIMIT: Duration = Duration::from_secs(20);

fn namespace(model: &str) -> Namespace {
    Namespace::new(&NamespaceParts {
        model: model.into(),
        layout: "cross_layer".into(),
        tokens_per_block: 16,
        blocks_per_chunk: 1,
        bytes_per_block: 4096,
        world_size: 1,
    })
}

/// The tier's config for a test server. Timeouts leave room for a loaded CI
/// machine (a refused connection to a killed server still fails at once).
fn config(url: &str, cluster: bool) -> RemoteTierConfig {
    RemoteTierConfig {
        cluster,
        connect_timeout_ms: 2_000,
        response_timeout_ms: 2_000,
        op_timeout_ms: 10_000,
        backoff_initial_ms: 100,
        backoff_max_ms: 1_000,
        ..RemoteTierConfig::for_url(url)
    }
}

fn start(cfg: &RemoteTierConfig, ns: Namespace, clock: &ManualClock) -> RemoteTier {
    let connector = RedisConnector::new(cfg).expect("a valid config");
    RemoteTier::start(Box::new(connector), cfg, ns, 1, clock.shared()).expect("the tier starts")
}

fn row(seed: u64, n: usize) -> Vec<u8> {
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

fn wait(t: &mut RemoteTier, ticket: Ticket) -> Answer {
    let mut others = Vec::new();
    let a = t
        .wait(ticket, LIMIT, &mut others)
        .expect("answered in time");
    assert!(others.is_empty(), "unexpected answers: {others:?}");
    a
}

/// The answers of `tickets`, in their order (they may come in any order).
fn wait_all(t: &mut RemoteTier, tickets: &[Ticket]) -> Vec<Answer> {
    let mut got: std::collections::HashMap<Ticket, Answer> = std::collections::HashMap::new();
    for &tk in tickets {
        if got.contains_key(&tk) {
            continue;
        }
        let mut others = Vec::new();
        let a = t.wait(tk, LIMIT, &mut others).expect("answered in time");
        got.insert(tk, a);
        got.extend(others);
    }
    tickets
        .iter()
        .map(|tk| got.remove(tk).expect("every ticket answered"))
        .collect()
}

/// Every put queued so far is written once a later lookup is answered.
fn flush(t: &mut RemoteTier) {
    let tk = t.lookup(&[]);
    assert_eq!(wait(t, tk), Answer::Present(vec![]));
}

fn fetch(t: &mut RemoteTier, key: u64, bytes: usize) -> Answer {
    let tk = t.fetch(ChunkKey(key), 0, Some(bytes));
    wait(t, tk)
}

fn fetched(a: &Answer) -> Option<&[u8]> {
    match a {
        Answer::Fetched(p) => Some(p.bytes()),
        _ => None,
    }
}

/// Puts rank 0's share of each chunk in `keys` (`row(k, bytes)`), then
/// waits until they are written.
fn put_rows(t: &mut RemoteTier, keys: impl IntoIterator<Item = u64>, bytes: usize) {
    for k in keys {
        t.put(ChunkKey(k), 0, &row(k, bytes));
    }
    flush(t);
}

/// Fetches every chunk in `keys` in one batch and checks its bytes
/// (`when`: for the failure message).
fn assert_rows(t: &mut RemoteTier, keys: &[u64], bytes: usize, when: &str) {
    let tickets: Vec<Ticket> = keys
        .iter()
        .map(|&k| t.fetch(ChunkKey(k), 0, Some(bytes)))
        .collect();
    for (k, a) in keys.iter().zip(wait_all(t, &tickets)) {
        assert_eq!(fetched(&a), Some(&row(*k, bytes)[..]), "chunk {k} {when}");
    }
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn one_server_round_trips_rows_of_every_size() {
    let server = RedisServer::start(&[]);
    let clock = ManualClock::new();
    let mut t = start(&config(&server.url(), false), namespace("m"), &clock);
    assert!(t.is_connected());
    let sizes = [1usize, 4096, 65_536, 1 << 20];
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(
            t.put(ChunkKey(i as u64), 0, &row(i as u64, n)),
            PutOutcome::Queued
        );
    }
    flush(&mut t);
    let keys: Vec<ChunkKey> = (0..5).map(ChunkKey).collect();
    let tk = t.lookup(&keys);
    assert_eq!(
        wait(&mut t, tk),
        Answer::Present(vec![true, true, true, true, false])
    );
    for (i, &n) in sizes.iter().enumerate() {
        let a = fetch(&mut t, i as u64, n);
        assert_eq!(fetched(&a), Some(&row(i as u64, n)[..]), "size {n}");
    }
    assert_eq!(fetch(&mut t, 4, 1), Answer::Miss(MissReason::Absent));
    let s = t.stats();
    assert_eq!(
        (s.hits, s.misses, s.puts_written, s.get_errors),
        (4, 1, 4, 0)
    );
    let stored: u64 = sizes.iter().map(|&n| value::encoded_len(n) as u64).sum();
    assert_eq!(s.bytes_put, stored);
    assert_eq!(server.cli(&["DBSIZE"]).trim(), "4");
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn corrupt_foreign_and_vanished_values_are_misses() {
    let server = RedisServer::start(&[]);
    let clock = ManualClock::new();
    let ns = namespace("m");
    let mut t = start(&config(&server.url(), false), ns.clone(), &clock);
    for k in 0..4 {
        t.put(ChunkKey(k), 0, &row(k, 4096));
    }
    flush(&mut t);
    let mut plain = redis::Client::open(server.url())
        .and_then(|c| c.get_connection())
        .expect("a plain client");
    // Corrupt chunk 0's payload in place (SETRANGE inside the payload).
    let _: () = redis::cmd("SETRANGE")
        .arg(ns.key(0, 0))
        .arg(100)
        .arg(b"garbage".as_slice())
        .query(&mut plain)
        .expect("SETRANGE");
    // Chunk 1's value cut short.
    let _: () = redis::cmd("SET")
        .arg(ns.key(1, 0))
        .arg(vec![0x4Bu8; 20])
        .query(&mut plain)
        .expect("SET");
    // Chunk 2: another deployment's (valid) value under our key.
    let foreign = namespace("another-model");
    let v = value::encode(
        ValueIdentity {
            namespace: foreign.fingerprint(),
            key: 2,
            rank: 0,
        },
        &row(2, 4096),
    );
    let _: () = redis::cmd("SET")
        .arg(ns.key(2, 0))
        .arg(v)
        .query(&mut plain)
        .expect("SET");
    // Chunk 3 evicted between the lookup and the fetch.
    let tk = t.lookup(&[ChunkKey(3)]);
    assert_eq!(wait(&mut t, tk), Answer::Present(vec![true]));
    let _: () = redis::cmd("DEL")
        .arg(ns.key(3, 0))
        .query(&mut plain)
        .expect("DEL");

    assert_eq!(
        fetch(&mut t, 0, 4096),
        Answer::Miss(MissReason::Rejected(ValueRejected::Checksum))
    );
    assert!(matches!(
        fetch(&mut t, 1, 4096),
        Answer::Miss(MissReason::Rejected(ValueRejected::Truncated { .. }))
    ));
    assert_eq!(
        fetch(&mut t, 2, 4096),
        Answer::Miss(MissReason::Rejected(ValueRejected::Namespace {
            found: foreign.fingerprint()
        }))
    );
    assert_eq!(fetch(&mut t, 3, 4096), Answer::Miss(MissReason::Absent));
    let s = t.stats();
    assert_eq!(
        (s.rejected_values, s.misses, s.hits, s.get_errors),
        (3, 4, 0, 0)
    );
    // The other deployment never sees our keys at all.
    let mut other = start(&config(&server.url(), false), foreign, &clock);
    let tk = other.lookup(&[ChunkKey(0), ChunkKey(1)]);
    assert_eq!(wait(&mut other, tk), Answer::Present(vec![false, false]));
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn keys_evicted_by_redis_are_misses_not_errors() {
    // 4 MiB of memory and allkeys-lru: Redis evicts on its own.
    let server = RedisServer::start(&["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]);
    let clock = ManualClock::new();
    let mut t = start(&config(&server.url(), false), namespace("m"), &clock);
    let n = 200u64;
    for k in 0..n {
        t.put(ChunkKey(k), 0, &row(k, 65_536));
        if k % 16 == 15 {
            flush(&mut t);
        }
    }
    flush(&mut t);
    let (mut hits, mut absent) = (0, 0);
    for k in 0..n {
        match fetch(&mut t, k, 65_536) {
            Answer::Fetched(p) => {
                assert_eq!(p.bytes(), &row(k, 65_536)[..]);
                hits += 1;
            }
            Answer::Miss(MissReason::Absent) => absent += 1,
            other => panic!("chunk {k}: {other:?}"),
        }
    }
    assert!(hits > 0 && absent > 0, "hits {hits}, evicted {absent}");
    let s = t.stats();
    assert_eq!((s.get_errors, s.rejected_values), (0, 0));
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_server_killed_and_restarted_degrades_then_resumes() {
    let mut server = RedisServer::start(&[]);
    let clock = ManualClock::new();
    let mut t = start(&config(&server.url(), false), namespace("m"), &clock);
    t.put(ChunkKey(1), 0, &row(1, 4096));
    flush(&mut t);
    server.kill();
    assert_eq!(
        fetch(&mut t, 1, 4096),
        Answer::Miss(MissReason::Unavailable)
    );
    assert!(!t.is_connected());
    assert_eq!(
        t.put(ChunkKey(2), 0, &row(2, 4096)),
        PutOutcome::DroppedUnavailable
    );
    let tk = t.lookup(&[ChunkKey(1)]);
    assert_eq!(wait(&mut t, tk), Answer::Present(vec![false]));
    server.restart();
    // Not before the backoff has passed on the tier's clock.
    let tk = t.lookup(&[ChunkKey(1)]);
    wait(&mut t, tk);
    assert!(!t.is_connected());
    clock.advance(Duration::from_millis(100));
    let tk = t.lookup(&[]);
    wait(&mut t, tk);
    assert!(t.is_connected(), "reconnected after the backoff");
    // The restarted server has no data (persistence off): write again.
    assert_eq!(fetch(&mut t, 1, 4096), Answer::Miss(MissReason::Absent));
    assert_eq!(t.put(ChunkKey(1), 0, &row(1, 4096)), PutOutcome::Queued);
    flush(&mut t);
    assert_eq!(fetched(&fetch(&mut t, 1, 4096)), Some(&row(1, 4096)[..]));
    let s = t.stats();
    assert_eq!(s.outages, 1);
    assert_eq!(s.puts_dropped_unavailable, 1);
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn an_unreachable_server_at_start_is_not_fatal() {
    let mut server = RedisServer::start(&[]);
    let url = server.url();
    server.kill();
    let clock = ManualClock::new();
    let mut t = start(&config(&url, false), namespace("m"), &clock);
    assert!(!t.is_connected());
    assert_eq!(fetch(&mut t, 1, 64), Answer::Miss(MissReason::Unavailable));
    server.restart();
    clock.advance(Duration::from_millis(100));
    let tk = t.lookup(&[]);
    wait(&mut t, tk);
    assert!(t.is_connected());
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_wrong_password_fails_the_start_and_is_never_shown() {
    let server = RedisServer::start(&["--requirepass", "right-pw-4f9a"]);
    let clock = ManualClock::new();
    let wrong = "wrong-pw-7c2e";
    let cfg = RemoteTierConfig {
        password: Some(Secret::new(wrong)),
        ..config(&server.url(), false)
    };
    let connector = RedisConnector::new(&cfg).expect("valid config");
    let shown_connector = format!("{connector:?}");
    let err = RemoteTier::start(Box::new(connector), &cfg, namespace("m"), 1, clock.shared())
        .expect_err("a wrong password must fail the start");
    assert!(
        matches!(
            err,
            RemoteError::Store {
                source: StoreError::Auth(_),
                ..
            }
        ),
        "{err:?}"
    );
    let shown = format!("{err} | {err:?} | {cfg:?} | {shown_connector}");
    assert!(!shown.contains(wrong), "password shown: {shown}");
    assert!(shown.contains("credentials"), "{shown}");
    // The same password in the URL: still never shown.
    let cfg = config(
        &format!("redis://default:{wrong}@127.0.0.1:{}", server.port),
        false,
    );
    let err = RemoteTier::start(
        Box::new(RedisConnector::new(&cfg).expect("valid config")),
        &cfg,
        namespace("m"),
        1,
        clock.shared(),
    )
    .expect_err("a wrong password must fail the start");
    let shown = format!("{err} | {err:?} | {cfg:?}");
    assert!(!shown.contains(wrong), "password shown: {shown}");
    // The right one, and an ACL user.
    server.cli(&[
        "ACL",
        "SETUSER",
        "kvo",
        "on",
        ">kvo-pw-1b3d",
        "~kvo:*",
        "+@all",
    ]);
    let cfg = RemoteTierConfig {
        username: Some("kvo".into()),
        password: Some(Secret::new("kvo-pw-1b3d")),
        ..config(&server.url(), false)
    };
    let mut t = start(&cfg, namespace("m"), &clock);
    t.put(ChunkKey(5), 0, &row(5, 100));
    flush(&mut t);
    assert_eq!(fetched(&fetch(&mut t, 5, 100)), Some(&row(5, 100)[..]));
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_three_master_cluster_spreads_and_serves_chunks() {
    let cluster = RedisCluster::start(3);
    let clock = ManualClock::new();
    let ns = namespace("m");
    let mut t = start(&config(&cluster.url(), true), ns.clone(), &clock);
    let n = 96u64;
    for k in 0..n {
        assert_eq!(t.put(ChunkKey(k), 0, &row(k, 8192)), PutOutcome::Queued);
    }
    flush(&mut t);
    let counts = cluster.key_counts();
    assert_eq!(counts.iter().sum::<u64>(), n);
    assert!(
        counts.iter().all(|&c| c > 0),
        "keys on every master: {counts:?}"
    );
    let keys: Vec<ChunkKey> = (0..n + 4).map(ChunkKey).collect();
    let tk = t.lookup(&keys);
    let mut want = vec![true; n as usize];
    want.extend([false; 4]);
    assert_eq!(wait(&mut t, tk), Answer::Present(want));
    // One pipelined batch of fetches across all masters.
    let tickets: Vec<Ticket> = (0..n)
        .map(|k| t.fetch(ChunkKey(k), 0, Some(8192)))
        .collect();
    for (k, a) in wait_all(&mut t, &tickets).iter().enumerate() {
        assert_eq!(fetched(a), Some(&row(k as u64, 8192)[..]), "chunk {k}");
    }
    assert_eq!(t.stats().get_errors, 0);
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_cluster_master_killed_mid_run_then_restarted() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("kvoffload=debug")
        .with_test_writer()
        .try_init();
    let mut cluster = RedisCluster::start(3);
    let clock = ManualClock::new();
    let ns = namespace("m");
    let mut t = start(&config(&cluster.url(), true), ns.clone(), &clock);
    let n = 60u64;
    for k in 0..n {
        t.put(ChunkKey(k), 0, &row(k, 4096));
    }
    flush(&mut t);
    let owner: Vec<usize> = (0..n).map(|k| cluster.node_of(&ns.key(k, 0))).collect();
    let victim = 1;
    assert!(owner.contains(&victim));
    cluster.nodes[victim].kill();

    // The dead master's chunks miss; the others are still served.
    let tickets: Vec<Ticket> = (0..n)
        .map(|k| t.fetch(ChunkKey(k), 0, Some(4096)))
        .collect();
    let answers = wait_all(&mut t, &tickets);
    for (k, a) in answers.iter().enumerate() {
        if owner[k] == victim {
            assert_eq!(
                *a,
                Answer::Miss(MissReason::Unavailable),
                "chunk {k} on the dead master"
            );
        } else {
            assert_eq!(
                fetched(a),
                Some(&row(k as u64, 4096)[..]),
                "chunk {k} on a live master"
            );
        }
    }
    // Writes to the live masters go on.
    for k in n..n + 30 {
        t.put(ChunkKey(k), 0, &row(k, 4096));
    }
    flush(&mut t);
    let s = t.stats();
    assert!(s.puts_written > n, "{s:?}");

    cluster.nodes[victim].restart();
    cluster.wait_ok();
    clock.advance(Duration::from_millis(1_000));
    // Every chunk written again (the restarted master lost its keys) is
    // served again, from every master.
    for k in 0..n + 30 {
        t.put(ChunkKey(k), 0, &row(k, 4096));
    }
    flush(&mut t);
    let keys: Vec<ChunkKey> = (0..n + 30).map(ChunkKey).collect();
    let tk = t.lookup(&keys);
    assert_eq!(
        wait(&mut t, tk),
        Answer::Present(vec![true; (n + 30) as usize]),
        "{:?}",
        t.stats()
    );
    for k in 0..n + 30 {
        assert_eq!(
            fetched(&fetch(&mut t, k, 4096)),
            Some(&row(k, 4096)[..]),
            "chunk {k} after the restart"
        );
    }
    assert!(t.is_connected());
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_hung_cluster_master_costs_a_batch_one_timeout_not_one_per_key() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("kvoffload=debug")
        .with_test_writer()
        .try_init();
    // A master frozen (SIGSTOP: the kernel still accepts, nothing answers)
    // as a hung process or a partition. The crate's cluster pipeline reads
    // its replies one by one, a response timeout each: 20 or so keys on it
    // held the tier's I/O thread for over 10 s at a 500 ms timeout. Now the
    // batch waits one timeout for it; then it is skipped (its keys miss at
    // once) until its window on the tier's clock passes, and it is served
    // again once it answers.
    let cluster = RedisCluster::start(3);
    let clock = ManualClock::new();
    let ns = namespace("h");
    let cfg = RemoteTierConfig {
        response_timeout_ms: 500,
        connect_timeout_ms: 500,
        op_timeout_ms: 60_000,
        ..config(&cluster.url(), true)
    };
    let mut t = start(&cfg, ns.clone(), &clock);
    let n = 60u64;
    put_rows(&mut t, 0..n, 1024);
    let owner: Vec<usize> = (0..n).map(|k| cluster.node_of(&ns.key(k, 0))).collect();
    let victim = 2;
    let on_victim = owner.iter().filter(|&&o| o == victim).count();
    assert!(on_victim > 5, "{owner:?}");
    let keys: Vec<u64> = (0..n).collect();
    let check = |t: &mut RemoteTier, victim_served: bool| {
        let t0 = std::time::Instant::now();
        let tickets: Vec<Ticket> = keys
            .iter()
            .map(|&k| t.fetch(ChunkKey(k), 0, Some(1024)))
            .collect();
        let answers = wait_all(t, &tickets);
        for (k, a) in answers.iter().enumerate() {
            if owner[k] == victim && !victim_served {
                assert_eq!(*a, Answer::Miss(MissReason::Unavailable), "chunk {k}");
            } else {
                assert_eq!(fetched(a), Some(&row(k as u64, 1024)[..]), "chunk {k}");
            }
        }
        t0.elapsed()
    };
    cluster.nodes[victim].pause();
    let first = check(&mut t, false);
    assert!(
        first < Duration::from_millis(5_000),
        "{on_victim} keys on the hung master took {first:?}"
    );
    // Skipped now: no wait at all for it.
    let skipped = check(&mut t, false);
    assert!(
        skipped < Duration::from_millis(450),
        "{skipped:?} {:?}",
        t.stats()
    );
    // It answers again: served once its window has passed.
    cluster.nodes[victim].resume();
    clock.advance(Duration::from_millis(cfg.backoff_max_ms));
    check(&mut t, true);
    assert_eq!(t.stats().rejected_values, 0);
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_tls_cluster_is_served_master_by_master_and_checks_certificates() {
    // A cluster speaking TLS only (clients and bus; the slot map names TLS
    // ports), as managed clusters with in-transit encryption run. The
    // tier's batches go to each master on its own TLS connection (trusting
    // only the configured CA): every chunk reads back; with one master
    // frozen its chunks miss as unavailable while the others are served
    // (the per-master path, not the cluster client's pipeline, which would
    // fail the whole batch); served again once it answers.
    let (cluster, certs) = RedisCluster::start_tls(3).expect("openssl makes the test certificates");
    assert!(cluster.url().starts_with("rediss://"), "{}", cluster.url());
    let clock = ManualClock::new();
    let ns = namespace("tls");
    // TLS handshakes in this unoptimized build on a loaded CI machine.
    let tls_config = |url: &str| RemoteTierConfig {
        connect_timeout_ms: 10_000,
        response_timeout_ms: 2_000,
        op_timeout_ms: 60_000,
        ..config(url, true)
    };
    let cfg = RemoteTierConfig {
        tls_ca_file: Some(certs.ca.clone()),
        ..tls_config(&cluster.url())
    };
    let mut t = start(&cfg, ns.clone(), &clock);
    let n = 60u64;
    put_rows(&mut t, 0..n, 2048);
    let keys: Vec<u64> = (0..n).collect();
    assert_rows(&mut t, &keys, 2048, "over TLS");
    let counts = cluster.key_counts();
    assert!(
        counts.iter().all(|&c| c > 0),
        "every master holds chunks: {counts:?}"
    );
    let owner: Vec<usize> = keys
        .iter()
        .map(|&k| cluster.node_of(&ns.key(k, 0)))
        .collect();
    let victim = owner[0];
    let fetch_all = |t: &mut RemoteTier| {
        let tickets: Vec<Ticket> = keys
            .iter()
            .map(|&k| t.fetch(ChunkKey(k), 0, Some(2048)))
            .collect();
        wait_all(t, &tickets)
    };
    cluster.nodes[victim].pause();
    for (k, a) in fetch_all(&mut t).iter().enumerate() {
        if owner[k] == victim {
            assert_eq!(*a, Answer::Miss(MissReason::Unavailable), "chunk {k}");
        } else {
            assert_eq!(fetched(a), Some(&row(k as u64, 2048)[..]), "chunk {k}");
        }
    }
    cluster.nodes[victim].resume();
    clock.advance(Duration::from_millis(cfg.backoff_max_ms));
    for (k, a) in fetch_all(&mut t).iter().enumerate() {
        assert_eq!(
            fetched(a),
            Some(&row(k as u64, 2048)[..]),
            "chunk {k} after resume"
        );
    }
    assert_eq!(t.stats().rejected_values, 0);
    // Without the CA no node is trusted: a clear error at start.
    let cfg = tls_config(&cluster.url());
    let err = RemoteTier::start(
        Box::new(RedisConnector::new(&cfg).expect("valid config")),
        &cfg,
        namespace("tls"),
        1,
        clock.shared(),
    )
    .expect_err("an untrusted certificate fails the start");
    assert!(err.to_string().contains("tls_ca_file"), "{err}");
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_slot_migration_mid_run_is_followed_by_reads_and_writes() {
    // What an operator's `redis-cli --cluster reshard` does, one step at a
    // time: two slots of master A are set migrating to master B; one
    // chunk's key is moved (A answers ASK for it), another stays on A; new
    // chunks are written into the migrating slot; then the slots are given
    // to B (A answers MOVED). Every chunk must read back with its bytes, and
    // no operation may fail.
    let cluster = RedisCluster::start(3);
    let clock = ManualClock::new();
    let ns = namespace("m");
    let mut t = start(&config(&cluster.url(), true), ns.clone(), &clock);
    let n = 48u64;
    put_rows(&mut t, 0..n, 4096);
    let a = cluster.node_of(&ns.key(0, 0));
    let b = (a + 1) % cluster.nodes.len();
    let moved = 0u64;
    let stay = (1..n)
        .find(|&k| {
            cluster.node_of(&ns.key(k, 0)) == a
                && key_slot(&ns.key(k, 0)) != key_slot(&ns.key(moved, 0))
        })
        .expect("a second chunk on master A");
    let slots = [key_slot(&ns.key(moved, 0)), key_slot(&ns.key(stay, 0))];
    for k in [moved, stay] {
        let by_redis = cluster.nodes[a].cli(&["CLUSTER", "KEYSLOT", &ns.key(k, 0)]);
        assert_eq!(
            by_redis.trim(),
            key_slot(&ns.key(k, 0)).to_string(),
            "slot of {k}"
        );
    }
    let (id_a, id_b) = (cluster.id_of(a), cluster.id_of(b));
    for s in slots {
        let s = s.to_string();
        cluster.nodes[b].cli(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &id_a]);
        cluster.nodes[a].cli(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &id_b]);
    }
    let port_b = cluster.nodes[b].port.to_string();
    let migrate = |key: &str| {
        let out = cluster.nodes[a].cli(&[
            "MIGRATE",
            "127.0.0.1",
            &port_b,
            "",
            "0",
            "5000",
            "KEYS",
            key,
        ]);
        assert!(out.trim() == "OK", "MIGRATE {key}: {out}");
    };
    migrate(&ns.key(moved, 0));
    // New chunks whose keys fall in the migrating slot of the moved one.
    let fresh: Vec<u64> = (n..)
        .filter(|&k| key_slot(&ns.key(k, 0)) == slots[0])
        .take(2)
        .collect();
    let check = |t: &mut RemoteTier, keys: &[u64], when: &str| {
        assert_rows(t, keys, 4096, when);
        let tk = t.lookup(&keys.iter().map(|&k| ChunkKey(k)).collect::<Vec<_>>());
        assert_eq!(
            wait(t, tk),
            Answer::Present(vec![true; keys.len()]),
            "lookup {when}"
        );
    };
    let all: Vec<u64> = (0..n).collect();
    check(&mut t, &all, "while its slot migrates");
    put_rows(&mut t, fresh.iter().copied(), 4096);
    check(&mut t, &fresh, "written while its slot migrates");
    // Written through ASK: the migrating slot's keys (the moved chunk and
    // the new ones) are all on B, none on A.
    let in_slot = |node: usize| {
        let out = cluster.nodes[node].cli(&["CLUSTER", "COUNTKEYSINSLOT", &slots[0].to_string()]);
        out.trim().parse::<usize>().expect("a count")
    };
    assert_eq!((in_slot(a), in_slot(b)), (0, 1 + fresh.len()));
    // The migration ends: the rest of the keys move, the slots go to B.
    migrate(&ns.key(stay, 0));
    for s in slots {
        let s = s.to_string();
        for node in &cluster.nodes {
            node.cli(&["CLUSTER", "SETSLOT", &s, "NODE", &id_b]);
        }
    }
    let mut every = all.clone();
    every.extend(&fresh);
    check(&mut t, &every, "after the slots moved");
    let more: Vec<u64> = (fresh[1] + 1..)
        .filter(|&k| slots.contains(&key_slot(&ns.key(k, 0))))
        .take(2)
        .collect();
    put_rows(&mut t, more.iter().copied(), 4096);
    check(&mut t, &more, "written after the slots moved");
    let st = t.stats();
    assert_eq!(
        (
            st.get_errors,
            st.puts_failed,
            st.outages,
            st.rejected_values
        ),
        (0, 0, 0, 0),
        "{st:?}"
    );
    assert!(t.is_connected());
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn a_master_killed_in_a_cluster_with_replicas_fails_over_and_loses_nothing() {
    // docs/remote-tier.md's advice: with a replica per master, a master's
    // crash is a failover, not lost chunks. Three masters, one replica each;
    // the master of chunk 0 is killed once its replica has every write; the
    // replica is promoted, and once the cluster agrees on it the tier reads
    // every chunk back with its bytes and writes to it.
    let cluster = RedisCluster::start_with_replicas(3, 1);
    let clock = ManualClock::new();
    let ns = namespace("m");
    let mut t = start(&config(&cluster.url(), true), ns.clone(), &clock);
    let n = 60u64;
    put_rows(&mut t, 0..n, 4096);
    let victim = cluster.node_of(&ns.key(0, 0));
    let replica = cluster.replica_of(victim).expect("a replica of the master");
    cluster.wait_replicated(victim, replica);
    let mut cluster = cluster;
    cluster.nodes[victim].kill();
    cluster.wait_master(replica);
    cluster.wait_owner(&ns.key(0, 0), replica);
    // Once the cluster agrees, the first read serves every chunk: the
    // batch that meets the dead master's connection is retried key by key on
    // a fresh connection (the new slot map), within the same answer.
    let keys: Vec<u64> = (0..n).collect();
    assert_rows(&mut t, &keys, 4096, "after the failover");
    // Writes reach the promoted master.
    put_rows(&mut t, n..n + 20, 4096);
    let more: Vec<u64> = (n..n + 20).collect();
    assert_rows(&mut t, &more, 4096, "written after the failover");
    assert!(t.is_connected());
    assert_eq!(t.stats().rejected_values, 0);
}

fn kvoffload(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvoffload"))
        .args(args)
        .output()
        .expect("run kvoffload")
}

#[test]
fn bench_remote_needs_its_url_and_names_a_bad_one() {
    let out = kvoffload(&["bench", "--backend", "remote"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--remote-tier"));
    let out = kvoffload(&[
        "bench",
        "--backend",
        "remote",
        "--remote-tier",
        "http://u:pw-9z@h:1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("url") && !err.contains("pw-9z"), "{err}");
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn bench_remote_measures_the_tier_against_a_plain_client() {
    let server = RedisServer::start(&[]);
    let out = kvoffload(&[
        "bench",
        "--backend",
        "remote",
        "--remote-tier",
        &server.url(),
        "--block-bytes",
        "4096,65536",
        "--bytes-per-point",
        "1048576",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON rows");
    let rows = rows.as_array().expect("an array");
    assert_eq!(rows.len(), 4, "put and get per size");
    for r in rows {
        assert_eq!(r["backend"], "remote");
        assert!(r["gbps"].as_f64().is_some_and(|g| g > 0.0), "{r}");
        assert!(r["ceiling_gbps"].as_f64().is_some_and(|g| g > 0.0), "{r}");
    }
    // The bench leaves nothing behind.
    assert_eq!(server.cli(&["DBSIZE"]).trim(), "0");
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn tls_rediss_round_trips_and_checks_the_server_certificate() {
    let (server, certs) = RedisServer::start_tls().expect("openssl makes the test certificates");
    let clock = ManualClock::new();
    assert!(server.url().starts_with("rediss://"));
    // The TLS handshake runs in this unoptimized test build, beside the
    // other tests' servers and sims on a small CI machine: give it the
    // time a loaded machine needs (CI once took over 500 ms), so that the
    // check below is about TLS, not about the machine's load.
    let tls_config = |url: &str| RemoteTierConfig {
        connect_timeout_ms: 10_000,
        response_timeout_ms: 10_000,
        ..config(url, false)
    };
    let cfg = RemoteTierConfig {
        tls_ca_file: Some(certs.ca.clone()),
        ..tls_config(&server.url())
    };
    let mut t = start(&cfg, namespace("m"), &clock);
    assert!(t.is_connected());
    t.put(ChunkKey(3), 0, &row(3, 65_536));
    flush(&mut t);
    assert_eq!(
        fetched(&fetch(&mut t, 3, 65_536)),
        Some(&row(3, 65_536)[..])
    );
    // Without the CA the server's certificate is not trusted: a clear error
    // at start (retrying could not help).
    let cfg = tls_config(&server.url());
    let err = RemoteTier::start(
        Box::new(RedisConnector::new(&cfg).expect("valid config")),
        &cfg,
        namespace("m"),
        1,
        clock.shared(),
    )
    .expect_err("an untrusted certificate fails the start");
    assert!(
        matches!(
            err,
            RemoteError::Store {
                source: StoreError::Config(_),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("tls_ca_file"), "{err}");
    // Plain redis:// to a TLS port: no connection either.
    let cfg = config(&format!("redis://127.0.0.1:{}", server.port), false);
    let t = start(&cfg, namespace("m"), &clock);
    assert!(!t.is_connected());
}

/// The sim's summary without what depends on the machine's speed or on the
/// remote tier: what the engine decided.
fn decisions(s: &kvoffload::harness::sim::SimSummary) -> serde_json::Value {
    let mut v = serde_json::to_value(s).expect("a summary serializes");
    let o = v.as_object_mut().expect("an object");
    for k in ["wall_s", "step_time", "remote"] {
        o.remove(k);
    }
    if let Some(t) = o.get_mut("transfers").and_then(|t| t.as_object_mut()) {
        t.remove("store_gbps");
        t.remove("load_gbps");
    }
    v
}

fn sim_opts(remote: Option<RemoteTierConfig>) -> kvoffload::harness::sim::SimOptions {
    kvoffload::harness::sim::SimOptions {
        requests: 150,
        remote,
        ..kvoffload::harness::sim::SimOptions::default()
    }
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn the_sim_with_a_remote_tier_is_reproducible_and_a_second_node_hits_more() {
    use kvoffload::harness::sim::{Sim, default_config};
    let run = |remote| {
        Sim::new(default_config(), sim_opts(remote))
            .expect("a sim")
            .run(&mut |_| {})
            .expect("the sim runs to the end")
            .summary
    };
    // Node A on two fresh stores: the same decisions (the sim waits for the
    // tier's answers each step, so thread timing does not matter).
    let (s1, s2) = (RedisServer::start(&[]), RedisServer::start(&[]));
    let a1 = run(Some(RemoteTierConfig::for_url(s1.url())));
    let a2 = run(Some(RemoteTierConfig::for_url(s2.url())));
    assert_eq!(decisions(&a1), decisions(&a2));
    let (r1, r2) = (a1.remote.clone().unwrap(), a2.remote.clone().unwrap());
    assert_eq!(
        (r1.lookups, r1.chunks_fetched, r1.puts_written),
        (r2.lookups, r2.chunks_fetched, r2.puts_written)
    );
    assert!(r1.puts_written > 0, "{r1:?}");
    assert_eq!(
        (r1.puts_failed, r1.puts_queued, r1.outages, r1.probes_left),
        (0, 0, 0, 0)
    );
    assert_eq!(r1.connected_workers, a1.world_size);
    // Node B on node A's store, same workload: it finds A's prefixes.
    let b = run(Some(RemoteTierConfig::for_url(s1.url())));
    let alone = run(None);
    assert!(alone.remote.is_none());
    let rb = b.remote.clone().unwrap();
    assert!(rb.chunks_fetched > r1.chunks_fetched, "{rb:?} vs {r1:?}");
    assert!(
        b.hit_rate_with_offload > alone.hit_rate_with_offload,
        "node B {} vs alone {}",
        b.hit_rate_with_offload,
        alone.hit_rate_with_offload
    );
    for s in [&a1, &a2, &b, &alone] {
        assert_eq!(s.leaks.total, 0, "{:?}", s.leaks);
        assert_eq!(s.work.finished, s.work.requests);
        // The chunks that came back through Redis (node B) hold the bytes
        // node A's workers computed.
        assert!(s.content.loaded_checked > 0, "{:?}", s.content);
        assert_eq!(s.content.mismatches, 0, "{:?}", s.content);
    }
    let keys: u64 = s1.cli(&["DBSIZE"]).trim().parse().expect("a count");
    assert!(keys > 0);
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn the_sim_serves_on_when_the_store_is_down_or_a_master_dies() {
    use kvoffload::harness::sim::{Sim, default_config};
    // Unreachable from the start: every put dropped, nothing else changes.
    let mut dead = RedisServer::start(&[]);
    let url = dead.url();
    dead.kill();
    let out = Sim::new(
        default_config(),
        sim_opts(Some(RemoteTierConfig::for_url(url))),
    )
    .expect("an unreachable store does not stop the start")
    .run(&mut |_| {})
    .expect("the sim runs to the end");
    let s = out.summary;
    assert_eq!(s.leaks.total, 0);
    assert_eq!(s.work.finished, s.work.requests);
    let r = s.remote.expect("remote counts");
    assert_eq!((r.puts_written, r.connected_workers), (0, 0), "{r:?}");
    assert!(r.puts_dropped > 0, "{r:?}");

    // A cluster master killed mid-run, then restarted.
    let cluster = std::cell::RefCell::new(RedisCluster::start(3));
    let cfg = RemoteTierConfig {
        cluster: true,
        connect_timeout_ms: 200,
        ..RemoteTierConfig::for_url(cluster.borrow().url())
    };
    let mut killed = false;
    let mut restarted = false;
    let out = Sim::new(default_config(), sim_opts(Some(cfg)))
        .expect("a sim")
        .run(&mut |p| {
            if p.step >= 300 && !killed {
                cluster.borrow_mut().nodes[1].kill();
                killed = true;
            } else if p.step >= 600 && !restarted {
                cluster.borrow_mut().nodes[1].restart();
                restarted = true;
            }
        })
        .expect("the sim runs to the end");
    assert!(
        killed && restarted,
        "the run was long enough to kill and restart"
    );
    let s = out.summary;
    assert_eq!(s.leaks.total, 0);
    assert_eq!(s.work.finished, s.work.requests);
    let r = s.remote.expect("remote counts");
    assert!(r.puts_written > 0, "{r:?}");
    assert!(r.puts_failed > 0, "the dead master's puts failed: {r:?}");
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn the_sim_cli_prints_the_remote_line_and_refuses_a_wrong_password() {
    let server = RedisServer::start(&["--requirepass", "sim-pw-8e1f"]);
    let url = format!("redis://:sim-pw-8e1f@127.0.0.1:{}", server.port);
    let out = kvoffload(&["sim", "--requests", "60", "--remote-tier", &url]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("remote tier (write-through)"), "{stdout}");
    assert!(!stdout.contains("sim-pw-8e1f"), "{stdout}");
    // Two nodes over the same workload and store: one summary each, then
    // their hit rates side by side; without a store, refused.
    let out = kvoffload(&[
        "sim",
        "--requests",
        "60",
        "--nodes",
        "2",
        "--remote-tier",
        &url,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("node 2 of 2"), "{stdout}");
    assert!(
        stdout.contains("prefix hit rate with offload, by node: node 1 "),
        "{stdout}"
    );
    let out = kvoffload(&["sim", "--nodes", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--remote-tier"));
    let wrong = format!("redis://:wrong-pw-3c9a@127.0.0.1:{}", server.port);
    let out = kvoffload(&["sim", "--requests", "60", "--remote-tier", &wrong]);
    assert_eq!(out.status.code(), Some(2));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        all.contains("credentials") && !all.contains("wrong-pw-3c9a"),
        "{all}"
    );
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn on_eviction_the_sim_writes_only_evicted_chunks_and_still_drains_clean() {
    use kvoffload::harness::sim::{Sim, default_config};
    use kvoffload::remote::WritePolicy;
    // A small host tier (64 chunks), so that it evicts.
    let cfg = || {
        let mut c = default_config();
        c.num_cpu_chunks = Some(64);
        c.cpu_bytes_to_use = None;
        c
    };
    let run = |remote: RemoteTierConfig| {
        Sim::new(cfg(), sim_opts(Some(remote)))
            .expect("a sim")
            .run(&mut |_| {})
            .expect("the sim runs to the end")
            .summary
    };
    let (s1, s2) = (RedisServer::start(&[]), RedisServer::start(&[]));
    let through = run(RemoteTierConfig::for_url(s1.url()));
    let evicting = run(RemoteTierConfig {
        write: WritePolicy::OnEviction,
        ..RemoteTierConfig::for_url(s2.url())
    });
    let (rt, re) = (through.remote.unwrap(), evicting.remote.clone().unwrap());
    assert_eq!(
        (rt.write.as_str(), re.write.as_str()),
        ("through", "on_eviction")
    );
    let printed = evicting.render();
    assert!(printed.contains("remote tier (on eviction)"), "{printed}");
    assert!(!printed.contains("write-through"), "{printed}");
    assert!(re.puts_written > 0, "the small tier evicts: {re:?}");
    // Every evicted chunk is written, but not one the remote tier gave back.
    assert!(re.puts_written <= rt.puts_written, "{re:?} vs {rt:?}");
    assert!(re.chunks_fetched > 0, "evicted chunks come back: {re:?}");
    assert_eq!(evicting.leaks.total, 0, "{:?}", evicting.leaks);
    assert_eq!(evicting.work.finished, evicting.work.requests);
}

#[test]
#[cfg_attr(
    not(kvoffload_redis),
    ignore = "redis-server not found: scripts/setup-redis.sh installs Debian's redis-server"
)]
fn replicated_sim_nodes_fetch_the_chunks_each_worker_put_by_its_turn() {
    // Two nodes of two workers that hold the same KV: each worker puts the
    // chunks of its turn (one share of a chunk), the second node's workers
    // fetch their turns' chunks into the region they share, and every block
    // loaded is the model's (a mismatch or a leak exits 1).
    let server = RedisServer::start(&[]);
    let url = server.url();
    let out = kvoffload(&[
        "sim",
        "--replicated",
        "--requests",
        "200",
        "--nodes",
        "2",
        "--remote-tier",
        &url,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node2 = stdout
        .split("node 2 of 2")
        .nth(1)
        .expect("a summary of node 2");
    let fetched = node2
        .lines()
        .find(|l| l.contains("remote tier (reads)"))
        .and_then(|l| l.split("; ").nth(1))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .expect("node 2's fetched chunks");
    assert!(fetched > 0, "{node2}");
    assert!(node2.contains(" 0 fetches failed"), "{node2}");
    assert_eq!(
        stdout
            .matches("(same KV: one copy, stores by turns)")
            .count(),
        2
    );
    assert_eq!(stdout.matches("; 0 mismatches").count(), 2, "{stdout}");
}
