//! The gateway's configuration file: one TOML document holding the server settings, the
//! decision log and the admission core's classes and pools.
//!
//! ```toml
//! default_class = "interactive"
//! [server]
//! listen = "127.0.0.1:8080"
//! [[pools]]
//! name = "default"
//! slots = 4
//! upstream = "http://127.0.0.1:8000"
//! [[classes]]
//! name = "interactive"
//! priority = 100
//! deadline_ms = 30000
//! ```
//!
//! Unknown fields are errors (a typo in a threshold must not silently keep the default).

pub mod path;

use serde::Deserialize;
use slackgate_core::{ClassConfig, ConfigError, GateConfig, PoolConfig, RetryConfig};
use std::net::SocketAddr;
use std::path::PathBuf;

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

/// Largest `log.channel_capacity` accepted (2^24 lines).
pub const MAX_LOG_CHANNEL_CAPACITY: usize = 1 << 24;

/// Everything `slackgate serve` needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Config {
    /// Listener, body limits, timers.
    pub server: ServerConfig,
    /// Where decision lines go.
    pub log: LogConfig,
    /// The admission core's configuration.
    pub gate: GateConfig,
    /// The admin API's listener and token (`[admin]`; off without the section).
    pub admin: AdminConfig,
    /// Several replicas as one gate, sharing state through Redis (`[cluster]`; without the
    /// section the gate stands alone and needs no Redis).
    pub cluster: Option<ClusterConfig>,
}

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

/// Default address of the admin API: loopback only.
pub const DEFAULT_ADMIN_LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 9090);

/// The admin API (`[admin]`): flags, drains, reload, queue and estimator views, on a listener
/// of its own, behind a bearer token.
#[derive(Clone, Debug, PartialEq)]
pub struct AdminConfig {
    /// Where the admin API listens; `None` (no `[admin]` section): no admin listener.
    pub listen: Option<SocketAddr>,
    /// File holding the bearer token (whitespace trimmed); read at start and at each reload.
    /// Without it the token comes from `SLACKGATE_ADMIN_TOKEN`; without either, every admin
    /// call is refused (401).
    pub token_file: Option<PathBuf>,
    /// Allow a non-loopback `listen` address (the admin API can roll back or drain the gate).
    pub allow_remote: bool,
    /// With `allow_remote`, accept a plain-HTTP listener beyond loopback anyway (the gate
    /// has no TLS of its own: a bearer token over plain HTTP on a network is readable by
    /// anyone on the path). Only behind a TLS-terminating proxy or on a trusted network.
    pub insecure_remote: bool,
    /// Open admin connections at most, all addresses together.
    pub max_connections: usize,
    /// Open admin connections at most from one client address.
    pub max_connections_per_addr: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: None,
            token_file: None,
            allow_remote: false,
            insecure_remote: false,
            max_connections: DEFAULT_ADMIN_MAX_CONNECTIONS,
            max_connections_per_addr: DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR,
        }
    }
}

/// Default of `admin.max_connections`.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: usize = 64;
/// Default of `admin.max_connections_per_addr`.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR: usize = 16;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct AdminFile {
    listen: Option<SocketAddr>,
    token_file: Option<PathBuf>,
    allow_remote: bool,
    insecure_remote: bool,
    max_connections: Option<usize>,
    max_connections_per_addr: Option<usize>,
}

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
            trust_size_hint: false,
            client_write_timeout_ms: 30_000,
            body_read_timeout_ms: 30_000,
            shutdown_grace_ms: 30_000,
            config_poll_ms: 1_000,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 75_000,
            max_connections: 10_000,
            max_connections_per_addr: 1_000,
        }
    }
}

/// The decision log: one JSON line per decision, dispatch, drop and completion.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `-` for stdout, `off` to disable, or a file path (appended to).
    pub path: String,
    /// Lines buffered between the request path and the writer; beyond it lines are dropped
    /// (and counted) rather than slowing requests down.
    pub channel_capacity: usize,
    /// A log file past this many bytes is renamed to `<path>.1` (replacing it) and a new one
    /// started; 0: never (rotate with logrotate and SIGHUP instead).
    pub max_bytes: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            path: "-".into(),
            channel_capacity: 65_536,
            max_bytes: 0,
        }
    }
}

impl LogConfig {
    /// The target the path names.
    pub fn target(&self) -> LogTarget {
        match self.path.as_str() {
            "-" | "stdout" => LogTarget::Stdout,
            "off" | "" => LogTarget::Off,
            p => LogTarget::File(PathBuf::from(p)),
        }
    }
}

/// Where the decision log is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogTarget {
    /// Standard output.
    Stdout,
    /// Appended to a file.
    File(PathBuf),
    /// Not written (lines are still counted in metrics).
    Off,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    server: ServerConfig,
    #[serde(default)]
    log: LogConfig,
    #[serde(default)]
    pools: Option<Vec<PoolConfig>>,
    #[serde(default)]
    classes: Option<Vec<ClassConfig>>,
    #[serde(default)]
    default_class: Option<String>,
    #[serde(default)]
    admit_always: bool,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    admin: Option<AdminFile>,
    #[serde(default)]
    retry: RetryConfig,
    #[serde(default)]
    ledger: slackgate_core::ledger::LedgerConfig,
    #[serde(default)]
    cluster: Option<ClusterConfig>,
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown/mistyped fields.
    #[error("{0}")]
    Parse(String),
    /// The values do not make a runnable gate.
    #[error("invalid configuration: {0}")]
    Invalid(#[from] ConfigError),
}

impl Config {
    /// Parse and validate a TOML document. Missing sections take their defaults.
    pub fn from_toml(text: &str) -> Result<Config, ConfigFileError> {
        let f: FileConfig = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        slots_beside_endpoints(text)?;
        let defaults = GateConfig::default();
        // A file that defines no classes gets the embedded classes *and* their default
        // class; a file that defines classes decides for itself whether unlabeled work has one.
        let default_class = match (&f.classes, f.default_class) {
            (None, None) => defaults.default_class,
            (_, d) => d,
        };
        let gate = GateConfig {
            pools: f.pools.unwrap_or(defaults.pools),
            classes: f.classes.unwrap_or(defaults.classes),
            default_class,
            admit_always: f.admit_always,
            shadow: f.shadow,
            retry: f.retry,
            ledger: f.ledger,
        };
        // An `[admin]` section turns the admin API on, on loopback unless it says otherwise.
        let admin = match f.admin {
            None => AdminConfig::default(),
            Some(a) => AdminConfig {
                listen: Some(
                    a.listen
                        .unwrap_or_else(|| SocketAddr::from(DEFAULT_ADMIN_LISTEN)),
                ),
                token_file: a.token_file,
                allow_remote: a.allow_remote,
                insecure_remote: a.insecure_remote,
                max_connections: a.max_connections.unwrap_or(DEFAULT_ADMIN_MAX_CONNECTIONS),
                max_connections_per_addr: a
                    .max_connections_per_addr
                    .unwrap_or(DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR),
            },
        };
        let cfg = Config {
            server: f.server,
            log: f.log,
            gate,
            admin,
            cluster: f.cluster,
        };
        cfg.validate_shape()?;
        Ok(cfg)
    }

    /// Warnings for keys a TOML document still spells the old way
    /// ([`slackgate_core::config::DEPRECATED_KEYS`]): read this release, gone in the next.
    /// Empty for a document that does not parse (its parse error says more).
    pub fn deprecations(text: &str) -> Vec<String> {
        let Ok(doc) = text.parse::<toml::Table>() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (table, old, new) in slackgate_core::config::DEPRECATED_KEYS {
            let Some(entries) = doc.get(*table).and_then(toml::Value::as_array) else {
                continue;
            };
            for (i, entry) in entries.iter().enumerate() {
                if entry.get(*old).is_some() {
                    out.push(format!(
                        "{table}[{i}].{old} is deprecated and will stop working in the next \
                         release: rename it to {new}"
                    ));
                }
            }
        }
        out
    }

    /// Read, parse and validate a file.
    pub fn from_file(path: &std::path::Path) -> Result<Config, ConfigFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_toml(&text)
    }

    /// Check everything needed to serve: the shape, and an upstream for every pool.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_shape()?;
        for (i, p) in self.gate.pools.iter().enumerate() {
            if p.upstream.is_none() && p.endpoints.is_empty() {
                return Err(err(
                    &format!("pools[{i}].upstream"),
                    "every pool needs an upstream URL or endpoints (or pass --upstream)",
                ));
            }
            if let Some(u) = &p.upstream {
                crate::wire::url::parse_base(u)
                    .map_err(|e| err(&format!("pools[{i}].upstream"), &e.to_string()))?;
            }
            for (j, e) in p.endpoints.iter().enumerate() {
                crate::wire::url::parse_base(&e.url)
                    .map_err(|m| err(&format!("pools[{i}].endpoints[{j}].url"), &m.to_string()))?;
            }
        }
        Ok(())
    }

    /// Check the values that are present (an upstream may still be given on the command line).
    pub fn validate_shape(&self) -> Result<(), ConfigError> {
        self.gate.validate()?;
        if let Some(c) = &self.cluster {
            c.validate(self.server.listen)?;
        }
        if self.server.max_body_bytes == 0 {
            return Err(err("server.max_body_bytes", "must be at least 1"));
        }
        if !(1..=60_000).contains(&self.server.tick_ms) {
            return Err(err("server.tick_ms", "must be between 1 and 60000"));
        }
        if self.server.upstream_timeout_ms == 0 {
            return Err(err("server.upstream_timeout_ms", "must be at least 1"));
        }
        if self.server.stream_idle_timeout_ms == 0 {
            return Err(err("server.stream_idle_timeout_ms", "must be at least 1"));
        }
        if self.server.upstream_idle_timeout_ms > MAX_UPSTREAM_IDLE_TIMEOUT_MS {
            return Err(err(
                "server.upstream_idle_timeout_ms",
                &format!(
                    "must be at most {MAX_UPSTREAM_IDLE_TIMEOUT_MS} (0 keeps no idle connection)"
                ),
            ));
        }
        if self.server.client_write_timeout_ms == 0 {
            return Err(err("server.client_write_timeout_ms", "must be at least 1"));
        }
        if self.server.body_read_timeout_ms == 0 {
            return Err(err("server.body_read_timeout_ms", "must be at least 1"));
        }
        if !(1..=86_400_000).contains(&self.server.ledger_prune_interval_ms) {
            return Err(err(
                "server.ledger_prune_interval_ms",
                "must be between 1 and 86400000",
            ));
        }
        if !(1..=600_000).contains(&self.server.ledger_flush_timeout_ms) {
            return Err(err(
                "server.ledger_flush_timeout_ms",
                "must be between 1 and 600000",
            ));
        }
        if let Some(k) = &self.server.tenant_hash_key {
            crate::support::tenant::parse_key(k).map_err(|m| err("server.tenant_hash_key", &m))?;
        }
        if self.server.header_read_timeout_ms == 0 {
            return Err(err("server.header_read_timeout_ms", "must be at least 1"));
        }
        if self.server.idle_timeout_ms == 0 {
            return Err(err("server.idle_timeout_ms", "must be at least 1"));
        }
        if self.server.max_connections == 0 {
            return Err(err("server.max_connections", "must be at least 1"));
        }
        if self.server.max_connections_per_addr == 0 {
            return Err(err("server.max_connections_per_addr", "must be at least 1"));
        }
        if self.admin.listen.is_some() {
            if self.admin.max_connections == 0 {
                return Err(err("admin.max_connections", "must be at least 1"));
            }
            if self.admin.max_connections_per_addr == 0 {
                return Err(err("admin.max_connections_per_addr", "must be at least 1"));
            }
        }
        if let Some(a) = self.admin.listen {
            if !a.ip().is_loopback() && self.admin.allow_remote && !self.admin.insecure_remote {
                return Err(err(
                    "admin.listen",
                    &format!(
                        "{a} is not a loopback address and the admin listener speaks plain HTTP: \
                         its bearer token would cross the network in the clear. Put it behind a \
                         TLS-terminating proxy on loopback, or set admin.insecure_remote = true \
                         to accept the risk"
                    ),
                ));
            }
            if !a.ip().is_loopback() && !self.admin.allow_remote {
                return Err(err(
                    "admin.listen",
                    &format!(
                        "{a} is not a loopback address; the admin API can roll back and drain \
                         the gate, so set admin.allow_remote = true to expose it beyond this host"
                    ),
                ));
            }
        }
        if self.server.config_poll_ms > 3_600_000 {
            return Err(err(
                "server.config_poll_ms",
                "must be at most 3600000 (0 turns the watcher off)",
            ));
        }
        if !(1..=MAX_LOG_CHANNEL_CAPACITY).contains(&self.log.channel_capacity) {
            // tokio allocates the channel's slots up front and panics on absurd capacities.
            return Err(err(
                "log.channel_capacity",
                &format!("must be between 1 and {MAX_LOG_CHANNEL_CAPACITY}"),
            ));
        }
        for (i, p) in self.gate.pools.iter().enumerate() {
            if let Some(u) = &p.upstream {
                crate::wire::url::parse_base(u)
                    .map_err(|m| err(&format!("pools[{i}].upstream"), &m.to_string()))?;
            }
            for (j, e) in p.endpoints.iter().enumerate() {
                crate::wire::url::parse_base(&e.url)
                    .map_err(|m| err(&format!("pools[{i}].endpoints[{j}].url"), &m.to_string()))?;
            }
        }
        Ok(())
    }
}

/// A TOML error as `path: message (line L, column C)`, the path found from the error's span
/// (`classes[1].deadline_ms`), like the semantic checks' errors.
fn parse_error(text: &str, e: &toml::de::Error) -> ConfigFileError {
    let Some(span) = e.span() else {
        return ConfigFileError::Parse(e.message().trim().to_string());
    };
    let (line, col) = crate::config::path::line_col(text, span.start);
    let message = e.message().trim();
    ConfigFileError::Parse(match crate::config::path::locate(text, span.start) {
        Some(path) => format!("{path}: {message} (line {line}, column {col})"),
        None => format!("{message} (line {line}, column {col})"),
    })
}

fn err(path: &str, message: &str) -> ConfigError {
    ConfigError {
        path: path.into(),
        message: message.into(),
    }
}

/// A pool that lists `endpoints` takes its slots from them: a pool-level `slots` (or
/// `max_in_flight`) beside them would be silently ignored, so it is refused.
fn slots_beside_endpoints(text: &str) -> Result<(), ConfigFileError> {
    let Ok(doc) = text.parse::<toml::Table>() else {
        return Ok(());
    };
    let Some(pools) = doc.get("pools").and_then(toml::Value::as_array) else {
        return Ok(());
    };
    for (i, p) in pools.iter().enumerate() {
        let listed = p
            .get("endpoints")
            .and_then(toml::Value::as_array)
            .is_some_and(|e| !e.is_empty());
        for key in ["slots", "max_in_flight"] {
            if listed && p.get(key).is_some() {
                return Err(ConfigFileError::Invalid(err(
                    &format!("pools[{i}].{key}"),
                    "a pool with endpoints takes its slots from them: set slots on each endpoint",
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_file_gets_defaults() {
        let c = Config::from_toml(
            r#"
            [[pools]]
            name = "default"
            upstream = "http://127.0.0.1:9"
            "#,
        );
        let c = c.map_err(|e| e.to_string());
        assert!(c.is_ok(), "{c:?}");
    }

    /// `slots` is the key; the old `max_in_flight` still works for one release, with a
    /// warning naming the entry, and a pool may not say both.
    #[test]
    fn slots_and_its_deprecated_alias() {
        let pools = |body: &str| {
            format!(
                "[[pools]]\nname = \"a\"\nslots = 2\n[[pools]]\nname = \"b\"\n{body}\n\
                 [[classes]]\nname = \"c\"\npool = \"b\"\n"
            )
        };
        let slots = |text: &str| {
            Config::from_toml(text)
                .map(|c| c.gate.pools.iter().map(|p| p.slots).collect::<Vec<_>>())
                .map_err(|e| e.to_string())
        };
        let new = pools("slots = 3");
        assert_eq!(slots(&new), Ok(vec![2, 3]));
        assert!(Config::deprecations(&new).is_empty());
        let old = pools("max_in_flight = 3");
        assert_eq!(slots(&old), Ok(vec![2, 3]));
        let warnings = Config::deprecations(&old);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("pools[1].max_in_flight is deprecated")
                && warnings[0].ends_with("rename it to slots"),
            "{warnings:?}"
        );
        let both = pools("slots = 3\nmax_in_flight = 3");
        let e = slots(&both).err().unwrap_or_default();
        assert!(e.contains("duplicate field"), "{e}");
        let zero = slots(&pools("max_in_flight = 0")).err().unwrap_or_default();
        assert!(zero.contains("pools[1].slots"), "{zero}");
    }

    #[test]
    fn upstream_idle_connections_are_given_up_before_common_servers_close_them() {
        // llama.cpp's server (cpp-httplib), uvicorn (vLLM) and Node close after 5 s idle; the
        // constant is checked against that at compile time, the default must be the constant.
        assert_eq!(
            ServerConfig::default().upstream_idle_timeout_ms,
            DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS
        );
    }

    #[test]
    fn unknown_fields_and_bad_values_are_explained() {
        let e = Config::from_toml("[server]\nlisten_addr = \"x\"\n").err();
        assert!(e
            .map(|e| e.to_string())
            .unwrap_or_default()
            .contains("listen_addr"));
        let e = Config::from_toml(
            "[[pools]]\nname=\"p\"\nupstream=\"ftp://x\"\n[[classes]]\nname=\"a\"\npool=\"p\"\n",
        )
        .err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("pools[0].upstream"), "{msg}");
        let c = Config::from_toml("[[pools]]\nname=\"p\"\n[[classes]]\nname=\"a\"\npool=\"p\"\n");
        let missing = c.map(|c| c.validate()).ok();
        let path = missing.and_then(|r| r.err()).map(|e| e.path);
        assert_eq!(path.as_deref(), Some("pools[0].upstream"));
        let e = Config::from_toml("[log]\nchannel_capacity = 16777217\n").err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("log.channel_capacity"), "{msg}");
        assert!(Config::from_toml("[log]\nchannel_capacity = 16777216\n").is_ok());
        let e = Config::from_toml("[server]\nclient_write_timeout_ms = 0\n").err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("server.client_write_timeout_ms"), "{msg}");
        let e = Config::from_toml("[server]\nbody_read_timeout_ms = 0\n").err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("server.body_read_timeout_ms"), "{msg}");
        let e = Config::from_toml(
            "[[pools]]\nname=\"p\"\n[[classes]]\nname=\"a\"\npool=\"p\"\n[[classes]]\nname=\"b\"\npool=\"p\"\ndeadline_ms = \"soon\"\n",
        )
        .err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.starts_with("classes[1].deadline_ms: "), "{msg}");
        assert!(msg.contains("line 9, column 15"), "{msg}");
        let e = Config::from_toml("[[classes]]\nname=\"a\"\ndeadlin_ms = 5\n").err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.starts_with("classes[0].deadlin_ms: unknown field"),
            "{msg}"
        );
        let e = Config::from_toml("[server]\nupstream_idle_timeout_ms = 3600001\n").err();
        let msg = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("server.upstream_idle_timeout_ms"), "{msg}");
        assert!(Config::from_toml("[server]\nupstream_idle_timeout_ms = 0\n").is_ok());
        let e = Config::from_toml("this is not toml = = =").err();
        assert!(matches!(e, Some(ConfigFileError::Parse(_))));
    }
}
