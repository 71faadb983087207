//! [`RemoteStore`] on Redis ≥ 7 (or any RESP server such as Valkey),
//! standalone or Redis Cluster, through the `redis` crate's blocking client.
//!
//! Batches are pipelined: one round trip for a standalone server; in a
//! cluster, one pipeline per master on a plain connection of its own
//! ([`super::cluster_nodes`]), so that a master that is down or hung costs a
//! batch one timeout and the other masters' keys are still served; the
//! crate's cluster client takes the redirections (a slot migrating) and
//! serves while no slot map is known.
//!
//! The cluster client retries a command once at most; anything longer is
//! the tier's job (backoff).

use std::sync::Once;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConnection};
use redis::{Client, Connection, ConnectionLike, ErrorKind, IntoConnectionInfo, RedisError, Value};

use crate::clock::{MonotonicClock, SharedClock};

use super::cluster_nodes::{ClusterNodes, NodeAnswer, NodeOpener};
use super::cluster_slots::NodeAddr;
use super::config::{RemoteTierConfig, Secret};
use super::redis_op::{KEPT_PACKED_BYTES, Op};
use super::store::{ItemResult, RemoteStore, StoreConnector, StoreError};

/// Opens [`RedisStore`] connections for a [`RemoteTierConfig`].
pub struct RedisConnector {
    cfg: RemoteTierConfig,
    password: Option<Secret>,
    username: Option<String>,
    /// The tier's clock (a monotonic clock until it is given).
    clock: SharedClock,
}

impl std::fmt::Debug for RedisConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnector")
            .field("url", &self.cfg.redacted_url())
            .field("cluster", &self.cfg.cluster)
            .finish_non_exhaustive()
    }
}

impl RedisConnector {
    /// A connector for `cfg` (validated here; credentials resolved from the
    /// config, then the environment).
    pub fn new(cfg: &RemoteTierConfig) -> Result<Self, StoreError> {
        cfg.validate()
            .map_err(|e| StoreError::Config(e.to_string()))?;
        Ok(Self {
            cfg: cfg.clone(),
            password: cfg.effective_password(),
            username: cfg.effective_username(),
            clock: MonotonicClock::shared(),
        })
    }

    fn connection_info(&self, url: &str) -> Result<redis::ConnectionInfo, StoreError> {
        let info = url
            .into_connection_info()
            .map_err(|e| StoreError::Config(self.scrub(&e)))?;
        Ok(with_credentials(
            info,
            self.username.as_deref(),
            self.password.as_ref(),
        ))
    }

    fn tls_certs(&self) -> Result<Option<redis::TlsCertificates>, StoreError> {
        let Some(path) = &self.cfg.tls_ca_file else {
            return Ok(None);
        };
        let pem = std::fs::read(path).map_err(|e| {
            StoreError::Config(format!("cannot read tls_ca_file {}: {e}", path.display()))
        })?;
        Ok(Some(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem),
        }))
    }

    fn connect_standalone(&self) -> Result<Conn, StoreError> {
        let urls = self.cfg.seed_urls();
        let info = self.connection_info(urls[0])?;
        let client = match self.tls_certs()? {
            Some(certs) => Client::build_with_tls(info, certs),
            None => Client::open(info),
        }
        .map_err(|e| classify(&e, self.scrub(&e)))?;
        let conn = client
            .get_connection_with_timeout(self.cfg.connect_timeout())
            .map_err(|e| classify(&e, self.scrub(&e)))?;
        let timeout = Some(self.cfg.response_timeout());
        conn.set_read_timeout(timeout)
            .and_then(|()| conn.set_write_timeout(timeout))
            .map_err(|e| classify(&e, self.scrub(&e)))?;
        Ok(Conn::Single(Box::new(conn)))
    }

    fn connect_cluster(&self) -> Result<Conn, StoreError> {
        let mut nodes = Vec::new();
        for u in self.cfg.seed_urls() {
            nodes.push(self.connection_info(u)?);
        }
        let mut b: ClusterClientBuilder = ClusterClient::builder(nodes)
            .connection_timeout(self.cfg.connect_timeout())
            .response_timeout(self.cfg.response_timeout())
            // One retry: after a broken connection (a master restarted) the
            // client reconnects to that node and sends again; waits between
            // tries stay short, so a dead node holds the I/O thread for at
            // most about one connect timeout per command.
            .retries(1)
            .min_retry_wait(5)
            .max_retry_wait(50);
        if let Some(u) = &self.username {
            b = b.username(u);
        }
        if let Some(p) = &self.password {
            b = b.password(p.expose());
        }
        if let Some(certs) = self.tls_certs()? {
            b = b.certs(certs);
        }
        let client = b.build().map_err(|e| classify(&e, self.scrub(&e)))?;
        let conn = client
            .get_connection()
            .map_err(|e| classify(&e, self.scrub(&e)))?;
        let mut seeds = Vec::new();
        for u in self.cfg.seed_urls() {
            if let redis::ConnectionAddr::Tcp(host, port)
            | redis::ConnectionAddr::TcpTls { host, port, .. } = self.connection_info(u)?.addr()
            {
                seeds.push(NodeAddr {
                    host: host.clone(),
                    port: *port,
                });
            }
        }
        let backoff = (
            Duration::from_millis(self.cfg.backoff_initial_ms),
            Duration::from_millis(self.cfg.backoff_max_ms),
        );
        let mut nodes = ClusterNodes::new(self.node_opener()?, seeds, backoff, self.clock.clone());
        nodes.refresh_slot_map();
        Ok(Conn::Cluster {
            client: Box::new(client),
            conn: Box::new(conn),
            dirty: false,
            nodes: Box::new(nodes),
        })
    }

    /// Opens a plain connection to one cluster node with this connector's
    /// credentials, TLS and timeouts.
    fn node_opener(&self) -> Result<NodeOpener, StoreError> {
        let certs = self.tls_certs()?;
        let scheme = if self.cfg.tls() { "rediss" } else { "redis" };
        let (username, password) = (self.username.clone(), self.password.clone());
        let (connect, respond) = (self.cfg.connect_timeout(), self.cfg.response_timeout());
        Ok(Box::new(move |n: &NodeAddr| {
            let host = if n.host.contains(':') {
                format!("[{}]", n.host)
            } else {
                n.host.clone()
            };
            let info = format!("{scheme}://{host}:{}", n.port).into_connection_info()?;
            let info = with_credentials(info, username.as_deref(), password.as_ref());
            let client = match &certs {
                Some(c) => Client::build_with_tls(info, c.clone())?,
                None => Client::open(info)?,
            };
            let conn = client.get_connection_with_timeout(connect)?;
            conn.set_read_timeout(Some(respond))?;
            conn.set_write_timeout(Some(respond))?;
            Ok(conn)
        }))
    }

    /// A plain `redis` connection with the same address, credentials and
    /// timeouts (standalone or cluster), for comparing the tier with a plain
    /// client loop (`kvoffload bench --backend remote`).
    pub fn plain_connection(&self) -> Result<Box<dyn ConnectionLike + Send>, StoreError> {
        if self.cfg.tls() {
            install_crypto_provider();
        }
        Ok(match self.connect_standalone_or_cluster()? {
            Conn::Single(c) => c,
            Conn::Cluster { conn, .. } => conn,
        })
    }

    fn connect_standalone_or_cluster(&self) -> Result<Conn, StoreError> {
        if self.cfg.cluster {
            self.connect_cluster()
        } else {
            self.connect_standalone()
        }
    }

    /// The error's text with the password (if any) removed.
    fn scrub(&self, e: &RedisError) -> String {
        scrub_text(&e.to_string(), self.password.as_ref(), &self.cfg)
    }
}

impl StoreConnector for RedisConnector {
    fn connect(&mut self) -> Result<Box<dyn RemoteStore>, StoreError> {
        if self.cfg.tls() {
            install_crypto_provider();
        }
        let conn = self.connect_standalone_or_cluster()?;
        let mut store = RedisStore {
            conn,
            password: self.password.clone(),
            cfg: self.cfg.clone(),
            broken: false,
            packed: Vec::new(),
        };
        // A connection that cannot answer (or whose credentials are refused
        // on first use) is not a connection.
        store.ping()?;
        Ok(Box::new(store))
    }

    fn set_clock(&mut self, clock: SharedClock) {
        self.clock = clock;
    }

    fn describe(&self) -> String {
        let mode = if self.cfg.cluster {
            "cluster"
        } else {
            "standalone"
        };
        format!("redis {mode} {}", self.cfg.redacted_url())
    }
}

/// `info` with the username and password, where given.
fn with_credentials(
    info: redis::ConnectionInfo,
    username: Option<&str>,
    password: Option<&Secret>,
) -> redis::ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(u) = username {
        settings = settings.set_username(u);
    }
    if let Some(p) = password {
        settings = settings.set_password(p.expose());
    }
    info.set_redis_settings(settings)
}

/// Installs rustls' ring provider as the process default, once (rustls
/// needs one before its first TLS connection).
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another part of the process may have installed one already: keep it.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

enum Conn {
    Single(Box<Connection>),
    Cluster {
        client: Box<ClusterClient>,
        conn: Box<ClusterConnection>,
        /// A batch failed on this connection: it may hold unread replies
        /// of the failed commands (the cluster client does not drain them),
        /// so the next batch starts on a fresh connection.
        dirty: bool,
        /// The masters on plain connections: batches go there, node by
        /// node; the cluster client above takes the redirections.
        nodes: Box<ClusterNodes>,
    },
}

/// One connection to Redis (standalone or cluster).
pub struct RedisStore {
    conn: Conn,
    password: Option<Secret>,
    cfg: RemoteTierConfig,
    /// A standalone batch failed at the connection level: replies may be
    /// left unread, so the connection is never used again (the tier
    /// reconnects).
    broken: bool,
    /// The standalone pipeline's packed commands, kept between batches.
    packed: Vec<u8>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.cfg.redacted_url())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Runs `ops` as one pipeline; one answer per op (a connection-level
    /// failure fails every op).
    fn run(&mut self, ops: &[Op<'_>]) -> Vec<ItemResult<Value>> {
        if ops.is_empty() {
            return Vec::new();
        }
        let answers = match &mut self.conn {
            Conn::Single(c) => {
                if self.broken {
                    let e =
                        StoreError::Unavailable("connection dropped after a failed batch".into());
                    return ops.iter().map(|_| Err(e.clone())).collect();
                }
                // Packed here into one buffer kept between batches: one copy
                // of each value (the crate's pipeline makes two, into a
                // fresh buffer each time).
                self.packed.clear();
                for op in ops {
                    op.pack(&mut self.packed);
                }
                let r = c.req_packed_commands(&self.packed, 0, ops.len());
                if self.packed.capacity() > KEPT_PACKED_BYTES {
                    self.packed = Vec::new();
                }
                match r {
                    Ok(v) => Ok(v.into_iter().map(Ok).collect()),
                    Err(e) => {
                        self.broken = true;
                        Err(e)
                    }
                }
            }
            Conn::Cluster {
                client,
                conn,
                dirty,
                nodes,
            } => {
                if nodes.wants_slot_map() {
                    nodes.refresh_slot_map();
                }
                if nodes.owners().is_empty() {
                    Ok(cluster_pipeline(client, conn, dirty, ops))
                } else {
                    let answers = nodes.run(ops);
                    Ok(ops
                        .iter()
                        .zip(answers)
                        .map(|(op, a)| match a {
                            NodeAnswer::Done(r) => r,
                            NodeAnswer::Redirect => through_client(client, conn, dirty, op),
                        })
                        .collect())
                }
            }
        };
        let (password, cfg) = (self.password.as_ref(), &self.cfg);
        let err = |e: &RedisError| classify(e, scrub_text(&e.to_string(), password, cfg));
        match answers {
            Ok(v) if v.len() == ops.len() => v
                .into_iter()
                .map(|r| match r {
                    Ok(Value::ServerError(se)) => {
                        let e: RedisError = se.into();
                        Err(err(&e))
                    }
                    Ok(v) => Ok(v),
                    Err(e) => Err(err(&e)),
                })
                .collect(),
            Ok(v) => {
                let msg = format!("{} answers to {} commands", v.len(), ops.len());
                ops.iter()
                    .map(|_| Err(StoreError::Refused(msg.clone())))
                    .collect()
            }
            Err(e) => {
                let e = err(&e);
                ops.iter().map(|_| Err(e.clone())).collect()
            }
        }
    }
}

/// Replaces the cluster client's connection with a fresh one (after a
/// failure left it in an unknown state).
fn reconnect(
    client: &ClusterClient,
    conn: &mut Box<ClusterConnection>,
    dirty: &mut bool,
) -> redis::RedisResult<()> {
    **conn = client.get_connection()?;
    *dirty = false;
    Ok(())
}

/// One command through the cluster client (it follows `MOVED` and `ASK`),
/// on a fresh connection if the last one failed.
fn through_client(
    client: &ClusterClient,
    conn: &mut Box<ClusterConnection>,
    dirty: &mut bool,
    op: &Op<'_>,
) -> redis::RedisResult<Value> {
    if *dirty {
        reconnect(client, conn, dirty)?;
    }
    let r = op.cmd().query::<Value>(conn.as_mut());
    *dirty = r.is_err();
    r
}

/// The batch through the cluster client's pipeline (while no slot map is
/// known): on failure, key by key on a fresh connection, so that the other
/// masters' keys are still served.
fn cluster_pipeline(
    client: &ClusterClient,
    conn: &mut Box<ClusterConnection>,
    dirty: &mut bool,
    ops: &[Op<'_>],
) -> Vec<redis::RedisResult<Value>> {
    if *dirty && let Err(e) = reconnect(client, conn, dirty) {
        return ops.iter().map(|_| Err(e.clone())).collect();
    }
    let mut p = redis::cluster::cluster_pipe();
    for op in ops {
        p.add_command(op.cmd());
    }
    match p.query::<Vec<Value>>(conn.as_mut()) {
        Ok(v) => v.into_iter().map(Ok).collect(),
        Err(e) => match reconnect(client, conn, dirty) {
            Ok(()) => {
                let v: Vec<redis::RedisResult<Value>> = ops
                    .iter()
                    .map(|op| op.cmd().query::<Value>(conn.as_mut()))
                    .collect();
                *dirty = v.iter().any(Result::is_err);
                v
            }
            Err(_) => {
                *dirty = true;
                ops.iter().map(|_| Err(e.clone())).collect()
            }
        },
    }
}

impl RemoteStore for RedisStore {
    fn put_many(&mut self, items: &[(&str, &[u8])]) -> Vec<ItemResult<()>> {
        let ops: Vec<Op<'_>> = items.iter().map(|&(k, v)| Op::Set(k, v)).collect();
        self.run(&ops)
            .into_iter()
            .map(|r| match r? {
                Value::Okay => Ok(()),
                Value::SimpleString(s) if s == "OK" => Ok(()),
                other => Err(StoreError::Refused(format!("SET answered {other:?}"))),
            })
            .collect()
    }

    fn get_many(&mut self, keys: &[&str]) -> Vec<ItemResult<Option<Vec<u8>>>> {
        let ops: Vec<Op<'_>> = keys.iter().map(|&k| Op::Get(k)).collect();
        self.run(&ops)
            .into_iter()
            .map(|r| match r? {
                Value::Nil => Ok(None),
                Value::BulkString(b) => Ok(Some(b)),
                other => Err(StoreError::Refused(format!(
                    "GET answered a {}",
                    value_kind(&other)
                ))),
            })
            .collect()
    }

    fn exists_many(&mut self, keys: &[&str]) -> Vec<ItemResult<bool>> {
        let ops: Vec<Op<'_>> = keys.iter().map(|&k| Op::Exists(k)).collect();
        self.run(&ops)
            .into_iter()
            .map(|r| match r? {
                Value::Int(n) => Ok(n > 0),
                other => Err(StoreError::Refused(format!(
                    "EXISTS answered a {}",
                    value_kind(&other)
                ))),
            })
            .collect()
    }

    fn ping(&mut self) -> Result<(), StoreError> {
        let (password, cfg) = (self.password.as_ref(), &self.cfg);
        let err = |e: &RedisError| classify(e, scrub_text(&e.to_string(), password, cfg));
        let r = match &mut self.conn {
            Conn::Single(_) if self.broken => {
                return Err(StoreError::Unavailable(
                    "connection dropped after a failed batch".into(),
                ));
            }
            Conn::Single(c) => redis::cmd("PING").query::<Value>(c.as_mut()),
            // The cluster answers if a master (or a seed) gives the slot
            // map: one master down is a partial outage, not an unreachable
            // store. Asked on the plain connections, which skip a master
            // that did not answer; the cluster client's fresh connection
            // (which may wait on a hung master) only where no slot map
            // could be had that way.
            Conn::Cluster {
                client,
                conn,
                dirty,
                nodes,
            } => {
                if nodes.refresh_slot_map() {
                    Ok(Value::Okay)
                } else {
                    reconnect(client, conn, dirty).map(|()| Value::Okay)
                }
            }
        };
        r.map(|_| ()).map_err(|e| err(&e))
    }
}

fn value_kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Int(_) => "integer",
        Value::BulkString(_) => "string",
        Value::Array(_) => "array",
        Value::SimpleString(_) => "status",
        Value::Okay => "OK",
        _ => "value of another type",
    }
}

/// Whether the error is a TLS certificate the client does not trust (a
/// deployment mistake: retrying cannot help).
fn untrusted_certificate(e: &RedisError, text: &str) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(rustls::Error::InvalidCertificate(_)) = err.downcast_ref::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(rustls::Error::InvalidCertificate(_)) =
                io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
        {
            return true;
        }
        cur = err.source();
    }
    text.contains("invalid peer certificate")
}

/// The store error for a client error (`text`: its message, scrubbed).
fn classify(e: &RedisError, text: String) -> StoreError {
    if untrusted_certificate(e, &text) {
        return StoreError::Config(format!(
            "{text} (the server's TLS certificate is not trusted: set tls_ca_file to its CA)"
        ));
    }
    let auth = matches!(e.kind(), ErrorKind::AuthenticationFailed)
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
        || text.contains("WRONGPASS")
        || text.contains("NOAUTH");
    if auth {
        return StoreError::Auth(text);
    }
    if matches!(e.kind(), ErrorKind::InvalidClientConfig) {
        return StoreError::Config(text);
    }
    let down = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(e.kind(), ErrorKind::ClusterConnectionNotFound)
        || matches!(
            e.code(),
            Some("CLUSTERDOWN" | "MASTERDOWN" | "TRYAGAIN" | "LOADING" | "MOVED" | "ASK")
        );
    if down {
        StoreError::Unavailable(text)
    } else {
        StoreError::Refused(text)
    }
}

/// `text` with every occurrence of the password, and of any password in the
/// configured URLs, replaced by `***`.
fn scrub_text(text: &str, password: Option<&Secret>, cfg: &RemoteTierConfig) -> String {
    let mut out = text.to_string();
    let mut secrets: Vec<String> = password
        .map(|p| p.expose().to_string())
        .into_iter()
        .collect();
    for u in cfg.seed_urls() {
        if let Some(p) = url_password(u) {
            secrets.push(p);
        }
    }
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        out = out.replace(s.as_str(), "***");
    }
    out
}

/// The password of a URL's `user:password@` part.
fn url_password(url: &str) -> Option<String> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    Some(match userinfo.find(':') {
        Some(c) => userinfo[c + 1..].to_string(),
        None => userinfo.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrubbing_removes_config_and_url_passwords() {
        let cfg = RemoteTierConfig::for_url("redis://u:urlpass@h:1");
        let s = Secret::new("cfgpass");
        let t = scrub_text("a cfgpass b urlpass c", Some(&s), &cfg);
        assert_eq!(t, "a *** b *** c");
        assert_eq!(url_password("redis://h:1"), None);
        assert_eq!(url_password("redis://pw@h:1").as_deref(), Some("pw"));
    }

    #[test]
    fn a_refused_connection_is_unavailable_not_fatal() {
        // Port 1 on loopback: nothing listens there.
        let cfg = RemoteTierConfig {
            connect_timeout_ms: 200,
            ..RemoteTierConfig::for_url("redis://127.0.0.1:1")
        };
        let mut c = RedisConnector::new(&cfg).unwrap();
        match c.connect() {
            Err(StoreError::Unavailable(_)) => {}
            Err(e) => panic!("expected unavailable, got {e}"),
            Ok(_) => panic!("connected to port 1"),
        }
        assert_eq!(c.describe(), "redis standalone redis://127.0.0.1:1");
    }

    #[test]
    fn a_missing_ca_file_is_a_config_error() {
        let cfg = RemoteTierConfig {
            tls_ca_file: Some("/nonexistent/ca.pem".into()),
            ..RemoteTierConfig::for_url("rediss://127.0.0.1:1")
        };
        let mut c = RedisConnector::new(&cfg).unwrap();
        assert!(matches!(c.connect(), Err(StoreError::Config(_))));
    }
}
