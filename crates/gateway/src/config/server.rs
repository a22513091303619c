//! `[server]`: the proxy listener, the request path's limits and timers, the ledger's
//! settings, and their checks.

use super::err;
use crate::wire::labels::ClassMap;
use serde::Deserialize;
use slackgate_core::ConfigError;
use std::net::SocketAddr;

/// Default of `server.upstream_idle_timeout_ms`: 2 s. The common model servers close a
/// keep-alive connection idle for 5 s (llama.cpp's server through cpp-httplib, uvicorn under
/// vLLM, hypercorn, Node); the server starts counting when it wrote the last byte and the
/// gate only when it read it, later on a busy gate, so the gate gives up well before, at
/// 40% of that. A new connection to an upstream next to the gate costs well under a
/// millisecond against a model call's hundreds, so giving connections up early costs almost
/// nothing.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS: u64 = 2_000;

// Checked when compiling: the default must stay below those servers' 5 s.
const _: () = assert!(DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS < 5_000);

/// Largest `server.upstream_idle_timeout_ms` accepted (one hour).
pub const MAX_UPSTREAM_IDLE_TIMEOUT_MS: u64 = 3_600_000;

/// How hard each commit pushes to the disk (`PRAGMA synchronous`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    /// A flushed record is committed to the WAL (in the OS page cache): it survives a process
    /// crash; a power loss or OS crash may lose the last commits (never corrupts the file).
    #[default]
    Normal,
    /// Syncs the WAL at every commit before the flush is answered: survives power loss and
    /// OS crashes too, at one disk sync per group commit.
    Full,
}

/// The default of `SqliteOptions::flush_timeout_ms` (`server.ledger_flush_timeout_ms`): well
/// above a group commit (under a millisecond to a few with `full`), below the default
/// `busy_timeout` (5 s), so a file locked by another process is refused by fail-closed
/// classes within 2 s instead of holding their requests for the writer's retries.
pub const DEFAULT_FLUSH_TIMEOUT_MS: u64 = 2_000;

/// Listener and request-path settings.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address of the proxy listener.
    pub listen: SocketAddr,
    /// Largest request body accepted (413 `body_too_large` beyond).
    pub max_body_bytes: usize,
    /// How often queued jobs are re-checked for dead slack (ms).
    pub tick_ms: u64,
    /// Time to wait for upstream response headers when a request has no deadline (ms).
    pub upstream_timeout_ms: u64,
    /// A response body that receives nothing from upstream for this long is cut off and its
    /// slot released (ms): a stalled stream must not hold a slot until the client gives up.
    pub stream_idle_timeout_ms: u64,
    /// How long an idle upstream keep-alive connection is kept for reuse (ms); 0 keeps none.
    /// Must stay below the upstream's own keep-alive timeout (see
    /// [`DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS`]), or the gate writes requests onto connections the
    /// server is closing (each then costs a retry on a fresh connection).
    pub upstream_idle_timeout_ms: u64,
    /// Ask upstreams for the final usage chunk of streams (`stream_options.include_usage`)
    /// when the client did not say, so holds settle on the upstream's own token count. The
    /// client then also receives that chunk (`choices: []`); turn off for clients that
    /// cannot ignore it.
    pub stream_usage: bool,
    /// Ledger store: a SQLite file path (durable; the default) or `memory`.
    pub ledger: String,
    /// `synchronous` for the SQLite ledger: `normal` (survives a process crash) or `full`
    /// (also survives power loss).
    pub ledger_synchronous: Synchronous,
    /// The secret tenant ids are hashed under (32 hex digits); none: generated once and kept
    /// in the ledger file. Set it to keep ids stable across ledger files or with the memory
    /// ledger (grants name tenants by id).
    pub tenant_hash_key: Option<String>,
    /// How often the SQLite ledger prunes settled keys past `ledger.retention_ms` (ms).
    pub ledger_prune_interval_ms: u64,
    /// How long a request waits for the SQLite ledger to store its hold before dispatch (ms);
    /// past it the hold counts as not durable (the class's `fail_mode` decides).
    pub ledger_flush_timeout_ms: u64,
    /// Take the tenant from an `X-Tenant` header instead of the bearer key. Only behind a
    /// proxy that sets it: otherwise any client could choose a fresh tenant and escape its
    /// grant.
    pub trust_tenant_header: bool,
    /// The header a request's fairness id is read from (`[fairness]`), for example
    /// `x-llm-d-inference-fairness-id`. Naming it trusts it: only behind a proxy that sets it
    /// (and strips it from clients). Unset: the fairness id is the tenant id.
    pub fairness_header: Option<String>,
    /// Use a request's `X-Expected-Output-Tokens` as its output estimate. Any client can send
    /// it, so only for clients you trust to tell the truth about their own sizes (internal
    /// services, evals, the drill); a lie can get a long request admitted ahead of others.
    /// It never lowers the request's token hold.
    pub trust_size_hint: bool,
    /// A client whose connection accepts no bytes for this long (it stopped reading) is
    /// disconnected and its job cancelled (ms): a client that never reads must not pin a slot.
    pub client_write_timeout_ms: u64,
    /// Longest time to receive a whole request body once its headers arrived (ms); a slower
    /// upload gets 408 `body_read_timeout`.
    pub body_read_timeout_ms: u64,
    /// On shutdown, how long queued and in-flight requests may take to finish before their
    /// connections are closed anyway (ms). Queued work that cannot finish by then is told so
    /// at once (`shutting_down`).
    pub shutdown_grace_ms: u64,
    /// How often the config file is checked for changes (ms); 0 turns the watcher off
    /// (SIGHUP and `POST /admin/reload` still reload).
    pub config_poll_ms: u64,
    /// A request's headers must be complete within this long of its first byte (of the
    /// accept, for a connection's first request), however slowly they trickle in; the
    /// connection is closed otherwise (ms). Shrinks under connection overload.
    pub header_read_timeout_ms: u64,
    /// A keep-alive connection with no request for this long is closed (ms). Shrinks under
    /// connection overload.
    pub idle_timeout_ms: u64,
    /// Open client connections at most; at the cap the idlest connection not serving a
    /// request is closed to let a new one in.
    pub max_connections: usize,
    /// Open client connections at most from one client IP address; beyond it a new
    /// connection is closed at once. Behind a proxy every client shares its address: set it
    /// to `max_connections` there.
    pub max_connections_per_addr: usize,
    /// Classes for requests labelled the way other tools label them (llm-d's objective, a
    /// priority number): `[server.class_map]`, see [`ClassMap`].
    pub class_map: ClassMap,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 4 * 1024 * 1024,
            tick_ms: 50,
            upstream_timeout_ms: 600_000,
            stream_idle_timeout_ms: 120_000,
            upstream_idle_timeout_ms: DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
            stream_usage: true,
            ledger: "slackgate-ledger.db".into(),
            ledger_synchronous: Synchronous::default(),
            ledger_prune_interval_ms: 60_000,
            ledger_flush_timeout_ms: DEFAULT_FLUSH_TIMEOUT_MS,
            tenant_hash_key: None,
            trust_tenant_header: false,
            fairness_header: None,
            trust_size_hint: false,
            client_write_timeout_ms: 30_000,
            body_read_timeout_ms: 30_000,
            shutdown_grace_ms: 30_000,
            config_poll_ms: 1_000,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 75_000,
            max_connections: 10_000,
            max_connections_per_addr: 1_000,
            class_map: ClassMap::default(),
        }
    }
}

impl ServerConfig {
    /// The request path's limits and timers: a body size, the tick, the upstream and client
    /// timeouts.
    pub(super) fn check_request_path(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(err("server.max_body_bytes", "must be at least 1"));
        }
        if !(1..=60_000).contains(&self.tick_ms) {
            return Err(err("server.tick_ms", "must be between 1 and 60000"));
        }
        if self.upstream_timeout_ms == 0 {
            return Err(err("server.upstream_timeout_ms", "must be at least 1"));
        }
        if self.stream_idle_timeout_ms == 0 {
            return Err(err("server.stream_idle_timeout_ms", "must be at least 1"));
        }
        if self.upstream_idle_timeout_ms > MAX_UPSTREAM_IDLE_TIMEOUT_MS {
            return Err(err(
                "server.upstream_idle_timeout_ms",
                &format!(
                    "must be at most {MAX_UPSTREAM_IDLE_TIMEOUT_MS} (0 keeps no idle connection)"
                ),
            ));
        }
        if self.client_write_timeout_ms == 0 {
            return Err(err("server.client_write_timeout_ms", "must be at least 1"));
        }
        if self.body_read_timeout_ms == 0 {
            return Err(err("server.body_read_timeout_ms", "must be at least 1"));
        }
        Ok(())
    }

    /// The ledger's timers and the tenant hash key.
    pub(super) fn check_ledger(&self) -> Result<(), ConfigError> {
        if !(1..=86_400_000).contains(&self.ledger_prune_interval_ms) {
            return Err(err(
                "server.ledger_prune_interval_ms",
                "must be between 1 and 86400000",
            ));
        }
        if !(1..=600_000).contains(&self.ledger_flush_timeout_ms) {
            return Err(err(
                "server.ledger_flush_timeout_ms",
                "must be between 1 and 600000",
            ));
        }
        if let Some(k) = &self.tenant_hash_key {
            crate::support::tenant::parse_key(k)
                .map_err(|m| err("server.tenant_hash_key", &m.to_string()))?;
        }
        Ok(())
    }

    /// The client connections' timeouts and caps.
    pub(super) fn check_connections(&self) -> Result<(), ConfigError> {
        if self.header_read_timeout_ms == 0 {
            return Err(err("server.header_read_timeout_ms", "must be at least 1"));
        }
        if self.idle_timeout_ms == 0 {
            return Err(err("server.idle_timeout_ms", "must be at least 1"));
        }
        if self.max_connections == 0 {
            return Err(err("server.max_connections", "must be at least 1"));
        }
        if self.max_connections_per_addr == 0 {
            return Err(err("server.max_connections_per_addr", "must be at least 1"));
        }
        Ok(())
    }

    /// The config watcher's poll interval (checked after `[admin]`, as it always was).
    pub(super) fn check_config_poll(&self) -> Result<(), ConfigError> {
        if self.config_poll_ms > 3_600_000 {
            return Err(err(
                "server.config_poll_ms",
                "must be at most 3600000 (0 turns the watcher off)",
            ));
        }
        Ok(())
    }

    /// `fairness_header`: a header name (lowercase token characters), and not one the gate
    /// reads for something else.
    pub(super) fn check_fairness_header(&self) -> Result<(), ConfigError> {
        let Some(h) = &self.fairness_header else {
            return Ok(());
        };
        let token = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_';
        if h.is_empty() || h.len() > 64 || !h.bytes().all(token) {
            return Err(err(
                "server.fairness_header",
                "must be a lowercase header name of 1 to 64 letters, digits, '-' or '_'",
            ));
        }
        const GATE_OWN: [&str; 15] = [
            "authorization",
            "x-job-class",
            "x-deadline-ms",
            "x-deadline",
            "idempotency-key",
            "x-idempotency-key",
            "x-attempt",
            "x-stainless-retry-count",
            "x-tenant",
            "x-slo-ttft-ms",
            "x-llm-d-slo-ttft-ms",
            "x-expected-output-tokens",
            "x-llm-d-inference-objective",
            "host",
            "content-length",
        ];
        // The cluster's own headers (`x-slackgate-*`) are the gate's too.
        if GATE_OWN.contains(&h.as_str()) || h.starts_with("x-slackgate-") {
            return Err(err(
                "server.fairness_header",
                "names a header the gate already reads for something else",
            ));
        }
        Ok(())
    }
}
