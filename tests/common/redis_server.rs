//! Real `redis-server` processes on loopback for the remote tier's tests:
//! one server, or a cluster of masters made with `redis-cli --cluster
//! create`. Each listens on a free port in its own temporary folder and is
//! killed (and the folder removed) on drop.
//!
//! Waiting here is for a server to answer (bounded by [`START_LIMIT`]),
//! never for a timer of the code under test.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a server may take to answer after it is started.
pub const START_LIMIT: Duration = Duration::from_secs(20);
/// Bound on a cluster failover (node timeout 1 s; the election follows).
pub const FAILOVER_LIMIT: Duration = Duration::from_secs(30);

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    owns_dir: bool,
    /// TLS only: the CA file redis-cli trusts.
    tls_ca: Option<PathBuf>,
}

/// Certificates made by `openssl` for a TLS server on 127.0.0.1.
pub struct TestCerts {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA and a server certificate for `IP:127.0.0.1` (P-256 keys: quick to
/// make and to handshake with), in `dir`; `None` where
/// `openssl` cannot make them (its error printed).
pub fn make_certs(dir: &Path) -> Option<TestCerts> {
    let run = |args: &[&str]| -> bool {
        match Command::new("openssl").args(args).current_dir(dir).output() {
            Ok(o) if o.status.success() => true,
            Ok(o) => {
                eprintln!("openssl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
                false
            }
            Err(e) => {
                eprintln!("openssl: {e}");
                false
            }
        }
    };
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").ok()?;
    let ok = run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kvoffload-test-ca",
    ]) && run(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]) && run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    ]);
    ok.then(|| TestCerts {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    })
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

fn temp_dir(tag: &str) -> PathBuf {
    let n = NEXT_DIR.fetch_add(1, Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!("kvoffload-redis-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create the server's folder");
    d
}

/// `redis-cli -p PORT ARGS...` (with `-a PASSWORD` when given): its stdout.
pub fn cli(port: u16, password: Option<&str>, args: &[&str]) -> Result<String, String> {
    cli_with(port, password, None, args)
}

fn cli_with(
    port: u16,
    password: Option<&str>,
    tls_ca: Option<&Path>,
    args: &[&str],
) -> Result<String, String> {
    let mut c = Command::new("redis-cli");
    c.arg("-p").arg(port.to_string());
    if let Some(ca) = tls_ca {
        c.arg("--tls").arg("--cacert").arg(ca);
    }
    if let Some(p) = password {
        c.arg("--no-auth-warning").arg("-a").arg(p);
    }
    let out = c
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("redis-cli: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl RedisServer {
    /// A server with `extra` arguments (for example `--requirepass x`),
    /// persistence off.
    pub fn start(extra: &[&str]) -> Self {
        let dir = temp_dir("single");
        Self::start_in(dir, extra, true, None)
    }

    /// A server speaking TLS only (its plain port off), with certificates
    /// made by [`make_certs`] in its folder; `None` where openssl cannot.
    pub fn start_tls() -> Option<(Self, TestCerts)> {
        let dir = temp_dir("tls");
        let certs = make_certs(&dir)?;
        let extra = [
            "--tls-cert-file".to_string(),
            certs.cert.display().to_string(),
            "--tls-key-file".to_string(),
            certs.key.display().to_string(),
            "--tls-ca-cert-file".to_string(),
            certs.ca.display().to_string(),
            "--tls-auth-clients".to_string(),
            "no".to_string(),
        ];
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let s = Self::start_in(dir, &extra, true, Some(certs.ca.clone()));
        Some((s, certs))
    }

    fn start_in(dir: PathBuf, extra: &[&str], owns_dir: bool, tls_ca: Option<PathBuf>) -> Self {
        let mut last_err = String::new();
        for _ in 0..5 {
            let port = free_port();
            let (plain, tls) = if tls_ca.is_some() {
                (
                    "0".to_string(),
                    vec!["--tls-port".to_string(), port.to_string()],
                )
            } else {
                (port.to_string(), Vec::new())
            };
            let mut args: Vec<String> = vec![
                "--port".into(),
                plain,
                "--bind".into(),
                "127.0.0.1".into(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                "--dir".into(),
                dir.display().to_string(),
                "--logfile".into(),
                dir.join("redis.log").display().to_string(),
            ];
            args.extend(tls);
            args.extend(extra.iter().map(|s| s.to_string()));
            let mut s = Self {
                port,
                dir: dir.clone(),
                args,
                child: None,
                owns_dir,
                tls_ca: tls_ca.clone(),
            };
            match s.launch() {
                Ok(()) => return s,
                Err(e) => last_err = e,
            }
        }
        panic!("redis-server did not start: {last_err}");
    }

    fn launch(&mut self) -> Result<(), String> {
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run redis-server: {e}"))?;
        self.child = Some(child);
        let t0 = Instant::now();
        let password = self.password();
        while t0.elapsed() < START_LIMIT {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                self.child = None;
                let log = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
                return Err(format!("exited with {status}: {log}"));
            }
            if cli_with(
                self.port,
                password.as_deref(),
                self.tls_ca.as_deref(),
                &["PING"],
            )
            .is_ok_and(|o| o.contains("PONG"))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("no PONG within the start limit".into())
    }

    fn password(&self) -> Option<String> {
        let i = self.args.iter().position(|a| a == "--requirepass")?;
        self.args.get(i + 1).cloned()
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` for a TLS server).
    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL: as a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes the server (SIGSTOP): it keeps its port and its connections,
    /// the kernel still accepts new ones, and nothing is answered, as a hung
    /// or partitioned node.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a [`Self::pause`]d server run again (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("a running server").id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    }

    /// Starts the killed server again on the same port, folder and arguments.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart of a running server");
        let mut last = String::new();
        for _ in 0..50 {
            match self.launch() {
                Ok(()) => return,
                // The port may linger for a moment after the kill.
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not restart on port {}: {last}", self.port);
    }

    /// `redis-cli` against this server, its failure as an error.
    pub fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        cli_with(
            self.port,
            self.password().as_deref(),
            self.tls_ca.as_deref(),
            args,
        )
    }

    /// `redis-cli` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        cli_with(
            self.port,
            self.password().as_deref(),
            self.tls_ca.as_deref(),
            args,
        )
        .expect("redis-cli")
    }

    /// The server's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        if self.owns_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A Redis Cluster of masters (no replicas) on loopback.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    dir: PathBuf,
}

impl RedisCluster {
    /// `masters` servers with `--cluster-enabled yes`, a 1 s node timeout and
    /// `cluster-require-full-coverage no` (the setting docs/remote-tier.md
    /// recommends: the other masters keep serving when one is down), joined
    /// by `redis-cli --cluster create`.
    pub fn start(masters: usize) -> Self {
        Self::start_with_replicas(masters, 0)
    }

    /// [`Self::start`] with `replicas` replicas per master (`redis-cli
    /// --cluster create --cluster-replicas`): `masters × (1 + replicas)`
    /// nodes, the first `masters` of them masters.
    pub fn start_with_replicas(masters: usize, replicas: usize) -> Self {
        Self::start_nodes(temp_dir("cluster"), masters, replicas, None)
    }

    /// [`Self::start`] speaking TLS only, clients and cluster bus alike
    /// (`--tls-cluster yes`: the slot map names the TLS ports), with
    /// certificates made by [`make_certs`]; `None` where openssl cannot.
    pub fn start_tls(masters: usize) -> Option<(Self, TestCerts)> {
        let dir = temp_dir("cluster-tls");
        let certs = make_certs(&dir)?;
        let c = Self::start_nodes(dir, masters, 0, Some(&certs));
        Some((c, certs))
    }

    fn start_nodes(dir: PathBuf, masters: usize, replicas: usize, tls: Option<&TestCerts>) -> Self {
        let mut extra: Vec<String> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
        ]
        .map(String::from)
        .to_vec();
        if let Some(c) = tls {
            for (flag, path) in [
                ("--tls-cert-file", &c.cert),
                ("--tls-key-file", &c.key),
                ("--tls-ca-cert-file", &c.ca),
            ] {
                extra.extend([flag.to_string(), path.display().to_string()]);
            }
            extra.extend(["--tls-auth-clients", "no", "--tls-cluster", "yes"].map(String::from));
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut nodes = Vec::new();
        for i in 0..masters * (1 + replicas) {
            let d = dir.join(format!("node{i}"));
            std::fs::create_dir_all(&d).expect("node folder");
            nodes.push(RedisServer::start_in(
                d,
                &extra,
                false,
                tls.map(|c| c.ca.clone()),
            ));
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut args: Vec<&str> = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        let replicas = replicas.to_string();
        args.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        nodes[0].try_cli(&args).expect("redis-cli --cluster create");
        let c = Self { nodes, dir };
        c.wait_ok();
        c
    }

    /// Waits until every running node reports `cluster_state:ok` and knows
    /// every master.
    pub fn wait_ok(&self) {
        let t0 = Instant::now();
        let want = self.nodes.len();
        loop {
            let ok = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let info = n.try_cli(&["CLUSTER", "INFO"]).unwrap_or_default();
                let known = info
                    .lines()
                    .find_map(|l| l.strip_prefix("cluster_known_nodes:"))
                    .and_then(|v| v.trim().parse::<usize>().ok());
                info.contains("cluster_state:ok") && known == Some(want)
            });
            if ok {
                return;
            }
            assert!(t0.elapsed() < START_LIMIT, "cluster did not become ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The seed URLs, comma-separated.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Keys held by each master (`DBSIZE`).
    pub fn key_counts(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .map(|n| n.cli(&["DBSIZE"]).trim().parse().unwrap_or(0))
            .collect()
    }

    /// The node that replicates `master`, if any: the running node whose own
    /// `CLUSTER NODES` line (`myself,slave <master id>`) names the master's
    /// id. A replica knows its role as soon as `redis-cli --cluster create`
    /// set it, while the master learns it by gossip, so each node's own view
    /// is asked; it is asked again until one answers or `START_LIMIT` passes.
    pub fn replica_of(&self, master: usize) -> Option<usize> {
        let id = self.id_of(master);
        let t0 = Instant::now();
        loop {
            let found = self.nodes.iter().position(|n| {
                n.child.is_some()
                    && n.try_cli(&["CLUSTER", "NODES"])
                        .unwrap_or_default()
                        .lines()
                        .any(|l| {
                            let f: Vec<&str> = l.split_whitespace().collect();
                            f.len() > 3
                                && f[2].contains("myself")
                                && f[2].contains("slave")
                                && f[3] == id
                        })
            });
            if found.is_some() || t0.elapsed() >= START_LIMIT {
                return found;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `replica` has every write its master made so far (their
    /// replication offsets agree).
    pub fn wait_replicated(&self, master: usize, replica: usize) {
        let offset = |node: usize, field: &str| -> Option<u64> {
            let info = self.nodes[node].cli(&["INFO", "replication"]);
            info.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().parse().ok())
        };
        let t0 = Instant::now();
        loop {
            let want = offset(master, "master_repl_offset:");
            if want.is_some() && offset(replica, "slave_repl_offset:") == want {
                return;
            }
            assert!(t0.elapsed() < START_LIMIT, "replica did not catch up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until `node` reports itself a master (`ROLE`): a replica
    /// promoted by a failover.
    pub fn wait_master(&self, node: usize) {
        let t0 = Instant::now();
        while !self.nodes[node].cli(&["ROLE"]).starts_with("master") {
            assert!(t0.elapsed() < FAILOVER_LIMIT, "no failover to node {node}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A node's cluster id (`CLUSTER MYID`).
    pub fn id_of(&self, node: usize) -> String {
        self.nodes[node]
            .cli(&["CLUSTER", "MYID"])
            .trim()
            .to_string()
    }

    /// Which node holds `key` (by `CLUSTER KEYSLOT` and each node's slots).
    pub fn node_of(&self, key: &str) -> usize {
        let slot = key_slot(key);
        self.owner_seen_by(0, slot)
            .unwrap_or_else(|| panic!("no owner for slot {slot}"))
    }

    /// The owner of `slot` in `viewer`'s `CLUSTER SLOTS`.
    fn owner_seen_by(&self, viewer: usize, slot: u16) -> Option<usize> {
        let owner = self.nodes[viewer].cli(&["CLUSTER", "SLOTS"]);
        // Plain-text CLUSTER SLOTS from redis-cli: start, end, then ip, port,
        // id per node of the range (the master first).
        let fields: Vec<&str> = owner.lines().map(str::trim).collect();
        let mut i = 0;
        while i + 3 < fields.len() {
            if let (Ok(start), Ok(end)) = (fields[i].parse::<u16>(), fields[i + 1].parse::<u16>())
                && fields[i + 2] == "127.0.0.1"
                && let Ok(port) = fields[i + 3].parse::<u16>()
            {
                if (start..=end).contains(&slot) {
                    return self.nodes.iter().position(|n| n.port == port);
                }
                i += 4;
                continue;
            }
            i += 1;
        }
        None
    }

    /// Waits until every running node names `node` as the owner of `key`'s
    /// slot (after a failover, the cluster's view converges by gossip).
    pub fn wait_owner(&self, key: &str, node: usize) {
        let slot = key_slot(key);
        let t0 = Instant::now();
        let running: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].child.is_some())
            .collect();
        while !running
            .iter()
            .all(|&v| self.owner_seen_by(v, slot) == Some(node))
        {
            assert!(
                t0.elapsed() < FAILOVER_LIMIT,
                "the cluster does not agree on slot {slot}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub use kvoffload::remote::cluster_slots::key_slot;

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
