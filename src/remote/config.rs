//! The remote tier's configuration: where the store is, how to log in, and
//! the bounds that keep it from ever slowing the engine down.
//!
//! Credentials come from the config or from the environment
//! ([`PASSWORD_ENV`], [`USERNAME_ENV`]); a password is held as a [`Secret`],
//! whose `Debug` and `Display` print `***`, and URLs are shown through
//! [`redact_url`], so no log line or error message ever carries one.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, out_of_range};

/// Environment variable read for the password when the config has none.
pub const PASSWORD_ENV: &str = "KVOFFLOAD_REMOTE_PASSWORD";
/// Environment variable read for the ACL user name when the config has none.
pub const USERNAME_ENV: &str = "KVOFFLOAD_REMOTE_USERNAME";

/// When the workers write a chunk to the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// As soon as its store completes (write-through): every stored chunk.
    #[default]
    Through,
    /// When the host tier evicts it: only chunks that leave the host tier,
    /// fewer writes, and the remote tier holds what the host tier does not.
    OnEviction,
}

/// A password: printed as `***` by `Debug` and `Display`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a password.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The password itself (only for handing it to the store's client).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Where and how the remote tier reaches its store.
///
/// Its `Debug` shows the URL redacted and the password as `***`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteTierConfig {
    /// `redis://host:port` or `rediss://host:port` (TLS); with `cluster`, a
    /// comma-separated list of seed nodes. A `user:password@` part is
    /// accepted and never printed.
    pub url: String,
    /// Redis Cluster mode (`--cluster-enabled yes` servers).
    pub cluster: bool,
    /// ACL user (else [`USERNAME_ENV`], else the URL's, else `default`).
    pub username: Option<String>,
    /// Password (else [`PASSWORD_ENV`], else the URL's).
    pub password: Option<Secret>,
    /// PEM file of the CA that signed the servers' TLS certificates
    /// (`rediss://` only; else the system's roots).
    pub tls_ca_file: Option<PathBuf>,
    /// Time to open a connection (milliseconds).
    pub connect_timeout_ms: u64,
    /// Time for the store to answer one batch (milliseconds).
    pub response_timeout_ms: u64,
    /// A lookup or fetch not answered within this is given up as a miss, and
    /// its late answer dropped (milliseconds): the remote tier's own stall
    /// timeout.
    pub op_timeout_ms: u64,
    /// Operations queued for the I/O thread at most; a put that finds the
    /// queue full is dropped and counted, never waited for.
    pub queue_capacity: usize,
    /// Operations sent to the store in one pipelined batch at most.
    pub max_batch: usize,
    /// Largest value written or accepted back (bytes, header included).
    pub max_value_bytes: u64,
    /// First wait before reconnecting after the store became unavailable
    /// (milliseconds); doubled after each failed try.
    pub backoff_initial_ms: u64,
    /// Longest wait between reconnection tries (milliseconds).
    pub backoff_max_ms: u64,
    /// When chunks are written: `through` (every stored chunk) or
    /// `on_eviction` (chunks the host tier evicts).
    pub write: WritePolicy,
}

impl Default for RemoteTierConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            cluster: false,
            username: None,
            password: None,
            tls_ca_file: None,
            connect_timeout_ms: 1_000,
            response_timeout_ms: 2_000,
            op_timeout_ms: 5_000,
            queue_capacity: 1_024,
            max_batch: 64,
            max_value_bytes: 64 << 20,
            backoff_initial_ms: 100,
            backoff_max_ms: 5_000,
            write: WritePolicy::Through,
        }
    }
}

impl std::fmt::Debug for RemoteTierConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTierConfig")
            .field("url", &self.redacted_url())
            .field("cluster", &self.cluster)
            .field("username", &self.username)
            .field("password", &self.password)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("response_timeout_ms", &self.response_timeout_ms)
            .field("op_timeout_ms", &self.op_timeout_ms)
            .field("queue_capacity", &self.queue_capacity)
            .field("max_batch", &self.max_batch)
            .field("max_value_bytes", &self.max_value_bytes)
            .field("backoff_initial_ms", &self.backoff_initial_ms)
            .field("backoff_max_ms", &self.backoff_max_ms)
            .field("write", &self.write)
            .finish()
    }
}

impl RemoteTierConfig {
    /// A default configuration for the store at `url`.
    pub fn for_url(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    /// Parses JSON (unknown keys rejected) and validates.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            format: "JSON",
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every field; the first problem found names its key. The
    /// messages never contain a password.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let urls = self.seed_urls();
        if urls.is_empty() {
            return Err(out_of_range(
                "url",
                "\"\"",
                "redis://host:port or rediss://host:port",
            ));
        }
        for u in &urls {
            if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
                return Err(out_of_range(
                    "url",
                    redact_url(u),
                    "redis://host:port or rediss://host:port",
                ));
            }
        }
        if urls.len() > 1 && !self.cluster {
            return Err(ConfigError::Conflict(
                "url lists several servers: set cluster = true for Redis Cluster".into(),
            ));
        }
        let tls: Vec<bool> = urls.iter().map(|u| u.starts_with("rediss://")).collect();
        if tls.iter().any(|&t| t != tls[0]) {
            return Err(ConfigError::Conflict(
                "url mixes redis:// and rediss:// servers".into(),
            ));
        }
        if self.tls_ca_file.is_some() && !tls[0] {
            return Err(ConfigError::Conflict(
                "tls_ca_file needs rediss:// URLs".into(),
            ));
        }
        for (field, v) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("response_timeout_ms", self.response_timeout_ms),
            ("op_timeout_ms", self.op_timeout_ms),
            ("backoff_initial_ms", self.backoff_initial_ms),
        ] {
            if v == 0 || v > 3_600_000 {
                return Err(out_of_range(field, v, "1..=3600000"));
            }
        }
        if self.backoff_max_ms < self.backoff_initial_ms || self.backoff_max_ms > 3_600_000 {
            return Err(out_of_range(
                "backoff_max_ms",
                self.backoff_max_ms,
                "backoff_initial_ms..=3600000",
            ));
        }
        if self.queue_capacity == 0 || self.queue_capacity > 1 << 20 {
            return Err(out_of_range(
                "queue_capacity",
                self.queue_capacity,
                "1..=1048576",
            ));
        }
        if self.max_batch == 0 || self.max_batch > 65_536 {
            return Err(out_of_range("max_batch", self.max_batch, "1..=65536"));
        }
        // Redis refuses bulk strings over 512 MiB by default.
        if self.max_value_bytes < 64 || self.max_value_bytes > 512 << 20 {
            return Err(out_of_range(
                "max_value_bytes",
                self.max_value_bytes,
                "64..=536870912",
            ));
        }
        Ok(())
    }

    /// The seed URLs, trimmed, empty entries left out.
    pub fn seed_urls(&self) -> Vec<&str> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect()
    }

    /// Whether the URLs ask for TLS.
    pub fn tls(&self) -> bool {
        self.seed_urls()
            .first()
            .is_some_and(|u| u.starts_with("rediss://"))
    }

    /// The URL(s) with any password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        self.seed_urls()
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The password to use: the config's, else [`PASSWORD_ENV`]'s (the
    /// URL's, if any, is used by the client when this is `None`).
    pub fn effective_password(&self) -> Option<Secret> {
        self.password.clone().or_else(|| {
            std::env::var(PASSWORD_ENV)
                .ok()
                .filter(|p| !p.is_empty())
                .map(Secret)
        })
    }

    /// The ACL user to use: the config's, else [`USERNAME_ENV`]'s.
    pub fn effective_username(&self) -> Option<String> {
        self.username
            .clone()
            .or_else(|| std::env::var(USERNAME_ENV).ok().filter(|u| !u.is_empty()))
    }

    /// [`Self::connect_timeout_ms`] as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// [`Self::response_timeout_ms`] as a duration.
    pub fn response_timeout(&self) -> Duration {
        Duration::from_millis(self.response_timeout_ms)
    }

    /// [`Self::op_timeout_ms`] as a duration.
    pub fn op_timeout(&self) -> Duration {
        Duration::from_millis(self.op_timeout_ms)
    }
}

/// `url` with the password of its `user:password@` part replaced by `***`
/// (a URL without one is returned as it is).
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_string();
    };
    let userinfo = &authority[..at];
    let shown = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        // `redis://password@host` is read by some clients as a password.
        None => "***".to_string(),
    };
    format!("{}{}@{}", &url[..scheme_end + 3], shown, &rest[at + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s} {s:?}"), "*** ***");
        let cfg = RemoteTierConfig {
            password: Some(Secret::new("hunter2")),
            url: "redis://alice:hunter2@host:6379/0".into(),
            ..RemoteTierConfig::default()
        };
        let shown = format!("{cfg:?} {}", cfg.redacted_url());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert_eq!(cfg.redacted_url(), "redis://alice:***@host:6379/0");
    }

    #[test]
    fn redaction_covers_every_url_shape() {
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(redact_url("redis://:pw@h:1"), "redis://:***@h:1");
        assert_eq!(redact_url("rediss://u:p@w@h:1/2"), "rediss://u:***@h:1/2");
        assert_eq!(redact_url("redis://pw@h"), "redis://***@h");
        assert_eq!(redact_url("no scheme"), "no scheme");
        assert_eq!(redact_url("redis://h/x@y"), "redis://h/x@y");
    }

    #[test]
    fn bad_values_are_named() {
        let bad = |f: &dyn Fn(&mut RemoteTierConfig)| {
            let mut c = RemoteTierConfig::default();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(bad(&|c| c.url = "http://x".into()).contains("url"));
        assert!(bad(&|c| c.url = String::new()).contains("url"));
        assert!(bad(&|c| c.url = "redis://a:1,redis://b:2".into()).contains("cluster"));
        assert!(
            bad(&|c| {
                c.cluster = true;
                c.url = "redis://a:1,rediss://b:2".into();
            })
            .contains("mixes")
        );
        assert!(bad(&|c| c.tls_ca_file = Some("ca.pem".into())).contains("tls_ca_file"));
        assert!(bad(&|c| c.op_timeout_ms = 0).contains("op_timeout_ms"));
        assert!(bad(&|c| c.backoff_max_ms = 1).contains("backoff_max_ms"));
        assert!(bad(&|c| c.queue_capacity = 0).contains("queue_capacity"));
        assert!(bad(&|c| c.max_batch = 0).contains("max_batch"));
        assert!(bad(&|c| c.max_value_bytes = 1).contains("max_value_bytes"));
        let msg = bad(&|c| c.url = "http://u:topsecret@x".into());
        assert!(!msg.contains("topsecret"), "{msg}");
    }

    #[test]
    fn json_rejects_unknown_keys() {
        let err = RemoteTierConfig::from_json_str(r#"{"url": "redis://h:1", "pasword": "x"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pasword"), "{err}");
        let ok = RemoteTierConfig::from_json_str(
            r#"{"url": "redis://a:1, redis://b:2", "cluster": true}"#,
        )
        .unwrap();
        assert_eq!(ok.seed_urls(), vec!["redis://a:1", "redis://b:2"]);
    }
}
