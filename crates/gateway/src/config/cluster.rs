//! `[cluster]`: the section that makes several replicas one gate through Redis, and its checks.

use super::err;
use serde::Deserialize;
use slackgate_core::ConfigError;
use std::net::SocketAddr;

/// `[cluster]`: replicas that share one gate through Redis (see the `cluster` module).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// `redis://[:PASSWORD@]HOST:PORT[/DB]`. Required.
    pub redis: String,
    /// The cluster's name: every key it keeps in Redis starts with `slackgate:<name>:`, so
    /// several gates (or test runs) can share one Redis. Replicas of one gate use the same.
    pub name: String,
    /// This replica's id (unique in the cluster); default: the host name and process id.
    pub replica_id: Option<String>,
    /// The base URL other replicas forward this gate's requests to while this replica leads,
    /// `http://HOST:PORT` reaching its proxy listener. Default: `http://` + `server.listen`,
    /// which must then not be an unspecified address (`0.0.0.0`, `::`): set the pod's IP.
    pub advertise: Option<String>,
    /// How long the leader's lease lives without a renewal (ms). The leader renews it every
    /// third of this; when the leader dies another replica takes over within about this long.
    pub lease_ttl_ms: u64,
    /// Longest wait for any Redis call (connect, read, write; ms). A slower Redis counts as
    /// down for that call: each class then follows its `fail_mode`.
    pub redis_timeout_ms: u64,
    /// Longest wait to connect to the leader when forwarding (ms); past it the leader counts
    /// as unreachable and the request follows its class's `fail_mode`.
    pub forward_connect_timeout_ms: u64,
    /// How many replicas run (the Deployment's `replicas`). A replica deciding alone takes
    /// `1 / max(this, replicas seen in Redis recently)` of each pool's slots: set it, so a
    /// replica that has never reached Redis does not take a whole pool for itself.
    pub expected_replicas: u32,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            redis: String::new(),
            name: "default".into(),
            replica_id: None,
            advertise: None,
            lease_ttl_ms: 3_000,
            redis_timeout_ms: 250,
            forward_connect_timeout_ms: 500,
            expected_replicas: 1,
        }
    }
}

impl ClusterConfig {
    /// Check the section alone; `listen` is the proxy listener (the default `advertise`).
    pub fn validate(&self, listen: SocketAddr) -> Result<(), ConfigError> {
        let url = self.redis.trim();
        if url.is_empty() {
            return Err(err("cluster.redis", "missing: redis://HOST:PORT[/DB]"));
        }
        if url.starts_with("rediss://") {
            return Err(err(
                "cluster.redis",
                "TLS to Redis (rediss://) is not supported yet: use redis:// on a private network",
            ));
        }
        if !url.starts_with("redis://") {
            return Err(err("cluster.redis", "must start with redis://"));
        }
        let name_ok = |v: &str| {
            !v.is_empty()
                && v.len() <= 64
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if !name_ok(&self.name) {
            return Err(err(
                "cluster.name",
                "1 to 64 characters of letters, digits, '-', '_' or '.'",
            ));
        }
        if let Some(id) = &self.replica_id {
            if !name_ok(id) {
                return Err(err(
                    "cluster.replica_id",
                    "1 to 64 characters of letters, digits, '-', '_' or '.'",
                ));
            }
        }
        if !(300..=60_000).contains(&self.lease_ttl_ms) {
            return Err(err("cluster.lease_ttl_ms", "must be between 300 and 60000"));
        }
        if self.redis_timeout_ms == 0 || self.redis_timeout_ms.saturating_mul(3) > self.lease_ttl_ms
        {
            return Err(err(
                "cluster.redis_timeout_ms",
                "must be at least 1 and at most a third of cluster.lease_ttl_ms (a renewal must \
                 fit inside the lease)",
            ));
        }
        if !(1..=1_000).contains(&self.expected_replicas) {
            return Err(err(
                "cluster.expected_replicas",
                "must be between 1 and 1000",
            ));
        }
        if !(1..=60_000).contains(&self.forward_connect_timeout_ms) {
            return Err(err(
                "cluster.forward_connect_timeout_ms",
                "must be between 1 and 60000",
            ));
        }
        match &self.advertise {
            Some(a) => {
                crate::wire::url::parse_base(a)
                    .map_err(|e| err("cluster.advertise", &e.to_string()))?;
                if !a.starts_with("http://") {
                    return Err(err(
                        "cluster.advertise",
                        "must be an http:// URL of this replica's proxy listener",
                    ));
                }
            }
            None if listen.ip().is_unspecified() => {
                return Err(err(
                    "cluster.advertise",
                    "required when server.listen is an unspecified address (0.0.0.0 or ::): \
                     set the URL other replicas reach this one at, e.g. http://POD_IP:8080",
                ));
            }
            None => {}
        }
        Ok(())
    }

    /// The URL other replicas forward to.
    pub fn advertise_url(&self, listen: SocketAddr) -> String {
        self.advertise
            .clone()
            .unwrap_or_else(|| format!("http://{listen}"))
    }
}
