//! The remote tier for the connector: the configuration check, the
//! deployment's namespace, starting a tier on a Redis (or Redis Cluster)
//! store, and its stats as a Python dict. The scheduler core attaches one for
//! its lookups, each worker core one for its write-through and fetches
//! ([`kvoffload::remote`] does the work; nothing here decides anything).

use kvoffload::SharedClock;
use kvoffload::remote::{
    Namespace, NamespaceParts, RedisConnector, RemoteError, RemoteStats, RemoteTier,
    RemoteTierConfig, StoreError,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{runtime_error, value_error};

/// Checks a remote tier configuration (`RemoteTierConfig`'s JSON keys:
/// unknown keys and bad values raise `ValueError` naming the key, never a
/// password). Returns the store's URL with any password replaced by `***`.
#[pyfunction]
pub(crate) fn check_remote_config(config_json: &str) -> PyResult<String> {
    let cfg = RemoteTierConfig::from_json_str(config_json).map_err(value_error)?;
    Ok(cfg.redacted_url())
}

/// The namespace fingerprint of a deployment's KV bytes: every node (and
/// every role of a node) that computes the same fingerprint may share chunks
/// through the store; any difference in a part keeps them apart.
#[pyfunction]
pub(crate) fn remote_namespace(
    model: String,
    layout: String,
    tokens_per_block: u32,
    blocks_per_chunk: u32,
    bytes_per_block: u64,
    world_size: u32,
) -> u64 {
    Namespace::new(&NamespaceParts {
        model,
        layout,
        tokens_per_block,
        blocks_per_chunk,
        bytes_per_block,
        world_size,
    })
    .fingerprint()
}

/// Starts a tier on the Redis store of `config_json` under the namespace
/// `fingerprint`, for chunks split over `world_size` ranks, timing its
/// operations on `clock`. A bad configuration is a `ValueError`; refused
/// credentials or an untrusted TLS certificate a `RuntimeError`. An
/// unreachable store is not an error: the tier starts disconnected and
/// retries with backoff (lookups find nothing meanwhile).
pub(crate) fn start_tier(
    config_json: &str,
    fingerprint: u64,
    world_size: u32,
    clock: SharedClock,
) -> PyResult<RemoteTier> {
    let cfg = RemoteTierConfig::from_json_str(config_json).map_err(value_error)?;
    let connector = RedisConnector::new(&cfg).map_err(value_error)?;
    RemoteTier::start(
        Box::new(connector),
        &cfg,
        Namespace::from_fingerprint(fingerprint),
        world_size,
        clock,
    )
    .map_err(|e| match &e {
        RemoteError::Store {
            source: StoreError::Config(_),
            ..
        } => value_error(e),
        _ => runtime_error(e),
    })
}

/// The tier's counters and gauges as a dict (`RemoteStats`' field names;
/// the latency histograms as their observation counts and sums).
pub(crate) fn stats_dict<'py>(py: Python<'py>, s: &RemoteStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("connected", s.connected)?;
    for (name, v) in [
        ("outages", s.outages),
        ("reconnect_attempts", s.reconnect_attempts),
        ("hits", s.hits),
        ("misses", s.misses),
        ("rejected_values", s.rejected_values),
        ("lookups", s.lookups),
        ("lookup_chunks_present", s.lookup_chunks_present),
        ("bytes_put", s.bytes_put),
        ("bytes_got", s.bytes_got),
        ("puts_written", s.puts_written),
        ("puts_failed", s.puts_failed),
        ("puts_queued", s.puts_queued),
        ("puts_dropped", s.puts_dropped()),
        ("partial_chunks_not_put", s.puts_skipped_partial),
        ("get_errors", s.get_errors),
        ("timeouts", s.timeouts),
        ("late_answers", s.late_answers),
    ] {
        d.set_item(name, v)?;
    }
    d.set_item("put_batches", s.put_latency.count())?;
    d.set_item("put_seconds", s.put_latency.sum())?;
    d.set_item("get_batches", s.get_latency.count())?;
    d.set_item("get_seconds", s.get_latency.sum())?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint(change: impl FnOnce(&mut (String, String, u32, u32, u64, u32))) -> u64 {
        let mut p = ("m@rev".to_owned(), "LBHNC".to_owned(), 16, 4, 4096, 2);
        change(&mut p);
        remote_namespace(p.0, p.1, p.2, p.3, p.4, p.5)
    }

    #[test]
    fn every_part_of_the_namespace_separates() {
        let base = fingerprint(|_| {});
        assert_eq!(
            fingerprint(|_| {}),
            base,
            "the same parts, the same namespace"
        );
        let changed = [
            fingerprint(|p| p.0.push('x')),
            fingerprint(|p| p.1 = "NLBHC".to_owned()),
            fingerprint(|p| p.2 = 32),
            fingerprint(|p| p.3 = 8),
            fingerprint(|p| p.4 = 8192),
            fingerprint(|p| p.5 = 4),
        ];
        for (i, f) in changed.iter().enumerate() {
            assert_ne!(*f, base, "part {i}");
        }
    }

    #[test]
    fn a_good_configuration_is_checked_without_its_password() {
        let url = check_remote_config(r#"{"url": "redis://:hunter2@127.0.0.1:6379"}"#)
            .expect("a good configuration");
        assert!(!url.contains("hunter2"), "{url}");
        assert!(url.contains("127.0.0.1:6379"), "{url}");
        assert!(check_remote_config(r#"{"url": "redis://127.0.0.1:6379", "bogus": 1}"#).is_err());
        assert!(check_remote_config("{not json").is_err());
    }
}
