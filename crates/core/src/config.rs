//! Admission configuration: classes, pools, estimator priors and the unlabeled-work policy.
//!
//! The core only defines and validates the shape; reading TOML from a file belongs to the
//! gateway. Every field has a default so a config can be as small as one pool and one class.
//! Validation reports the path of the offending field (`classes[1].pool`), because an operator
//! editing a file at 02:14 needs to know *where*, not only *what*.

use serde::Deserialize;

/// Everything the admission core needs to decide.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GateConfig {
    /// Upstream pools; each has a number of slots (`slots`).
    pub pools: Vec<PoolConfig>,
    /// Traffic classes, each running on one pool.
    pub classes: Vec<ClassConfig>,
    /// Class given to requests with no class label or an unknown one. `None` rejects them with
    /// `reject_unlabeled` (seed 002: unlabeled work is how an eval becomes user latency).
    pub default_class: Option<String>,
    /// Rollback flag (seed 000): admit everything, never drop; the gate behaves as a plain queue.
    pub admit_always: bool,
    /// Shadow mode: decide as usual, but admit what would be rejected (logged as
    /// `shadow_reject` with the reason) and drop nothing, to calibrate thresholds on live
    /// traffic before enforcing them.
    pub shadow: bool,
    /// How Retry-After is computed and when clients are told not to retry.
    pub retry: RetryConfig,
    /// The token reservation ledger: hold TTL, retry cap, tenant grants.
    pub ledger: crate::ledger::LedgerConfig,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            pools: vec![PoolConfig::default()],
            classes: vec![
                ClassConfig {
                    name: "interactive".into(),
                    priority: 100,
                    deadline_ms: Some(30_000),
                    aliases: vec!["sync".into(), "chat".into(), "prod".into()],
                    ..ClassConfig::default()
                },
                ClassConfig {
                    name: "batch".into(),
                    priority: 10,
                    deadline_ms: None,
                    aliases: vec!["eval".into(), "probe".into(), "replay".into()],
                    ..ClassConfig::default()
                },
            ],
            // Unlabeled work must not borrow interactive priority (seed 002): it runs as batch.
            default_class: Some("batch".into()),
            admit_always: false,
            shadow: false,
            retry: RetryConfig::default(),
            ledger: crate::ledger::LedgerConfig::default(),
        }
    }
}

/// Config keys renamed in this release and still read under their old name, as
/// `(table, old key, new key)`: `pools` is every `[[pools]]` entry. The old name goes away in
/// the next release; the gateway warns when a file still uses one (see CHANGELOG.md).
pub const DEPRECATED_KEYS: &[(&str, &str, &str)] = &[("pools", "max_in_flight", "slots")];

/// One upstream pool.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Name used by classes (`pool = "..."`), metrics and logs.
    pub name: String,
    /// Slots: the number of requests sent upstream at once. The old key `max_in_flight` is
    /// still read for one release (see [`DEPRECATED_KEYS`]).
    #[serde(alias = "max_in_flight")]
    pub slots: u32,
    /// Seed 000's depth rule: reject when every slot is busy and more than this many times
    /// `slots` jobs are queued ahead. `None` disables the rule.
    pub max_depth_factor: Option<f64>,
    /// Hard cap on jobs queued on this pool, all classes together (`queue_depth_exceeded`
    /// beyond). Each queued request holds a connection and its body in the gateway, so even
    /// best-effort work without a deadline must not queue without bound.
    pub max_queued: u32,
    /// Starting point of the service-time estimator, before it has learned anything.
    pub prior: PriorConfig,
    /// Base URL of the upstream serving this pool (`http://127.0.0.1:8000`). The core never
    /// connects anywhere; the gateway reads this.
    pub upstream: Option<String>,
    /// How much history of each class's demand the wait forecast of lower classes averages
    /// over (see the class's `forecast`): 12 buckets of a twelfth of this.
    pub forecast_window_ms: u64,
    /// The share of a higher class's refused work (refused for want of capacity) counted as
    /// demand in the forecast, beside all of its admitted work.
    pub forecast_refused_weight: f64,
    /// Several servers behind the pool, each with its own slots, in place of one `upstream`:
    /// the pool's capacity is the sum of its healthy endpoints' slots, and each dispatched
    /// request goes to the endpoint that can start it soonest. Empty: one endpoint, the
    /// pool's `upstream` with the pool's `slots`.
    pub endpoints: Vec<EndpointConfig>,
    /// Credentials the gateway sends upstream (a provider's API key). The core ignores it.
    pub auth: AuthConfig,
    /// TLS for `https://` upstreams. The core ignores it.
    pub tls: TlsConfig,
    /// How the gateway checks endpoints, ejects failing ones and readmits them.
    pub health: HealthConfig,
    /// Read the server's own queue from its metrics endpoint (off when absent): work the gate
    /// did not send counts in the projected wait.
    pub server_metrics: Option<ServerMetricsConfig>,
    /// What one request may ask of the pool's servers: their context window and output
    /// limit. A declared size is client input; these bound it (see [`LimitsConfig`]).
    pub limits: LimitsConfig,
}

/// The largest request the servers of a pool can take. A request whose prompt plus
/// `max_tokens` cannot fit is refused at arrival (400 `context_length_exceeded`, as the
/// servers themselves would answer), and every estimate, hold and projection of a request's
/// output is capped by what fits, so no declared size can inflate the projected wait (or a
/// tenant's spend) past what a server could really do.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// The servers' context window in tokens (prompt and output together, per request:
    /// llama.cpp's per-slot `n_ctx`, vLLM's `max_model_len`). Unset: what the servers report
    /// (`discover`), else [`DEFAULT_CONTEXT_TOKENS`]. When both are known the smaller holds.
    pub context_tokens: Option<u32>,
    /// The longest output one request may ask for (`max_tokens`), beside the context window
    /// (hosted APIs often cap output below the context). Unset: the context window only.
    pub max_output_tokens: Option<u32>,
    /// Ask each endpoint its context window (llama.cpp `GET /props`, vLLM `GET /v1/models`
    /// `max_model_len`) when the gateway starts and every `discover_interval_ms`. Unset: only
    /// where the pool names its servers as llama.cpp or vLLM (`[pools.server_metrics] kind`),
    /// so the gate sends nothing a server was not said to answer.
    pub discover: Option<bool>,
    /// How often the servers are asked again (a server restarted with another context).
    pub discover_interval_ms: u64,
    /// Until a class has seen a completion (nothing learned), a declared `max_tokens` counts
    /// for at most this many output tokens in its estimate, its hold and every projection:
    /// a fresh gate must not take a client's declared ceiling as its size.
    pub unlearned_output_tokens: u32,
}

/// The context window assumed when neither the configuration nor a server names one: the
/// largest that common open models serve (128k tokens).
pub const DEFAULT_CONTEXT_TOKENS: u32 = 131_072;

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            context_tokens: None,
            max_output_tokens: None,
            discover: None,
            discover_interval_ms: 60_000,
            unlearned_output_tokens: 4_096,
        }
    }
}

/// One server of a pool.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Name in logs, metrics and the admin API (default: `e0`, `e1`, ... by position).
    #[serde(default)]
    pub name: String,
    /// Base URL (`http://10.0.0.7:8080`, `https://api.openai.com/v1`).
    pub url: String,
    /// Requests sent to this endpoint at once (vLLM's `max_num_seqs`, llama.cpp's `-np`).
    pub slots: u32,
}

/// Upstream credentials of a pool: at most one of `api_key_env` and `api_key_file`. The key
/// is sent as `authorization: Bearer KEY` (or as the bare key in any other `header`, e.g.
/// Azure's `api-key`), never logged.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Environment variable holding the key.
    pub api_key_env: Option<String>,
    /// File holding the key (surrounding whitespace is trimmed), read at start and reload.
    pub api_key_file: Option<String>,
    /// Header carrying the key (default `authorization`, as `Bearer KEY`).
    pub header: Option<String>,
    /// Send the client's own `Authorization` upstream. Without a pool key it always is; with
    /// one, the client's header wins when this is true and the pool's key replaces it when
    /// false (the default).
    pub pass_client_authorization: bool,
}

/// TLS settings for a pool's `https://` endpoints.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM file of extra root certificates (a private CA), trusted beside the system's.
    pub ca_file: Option<String>,
    /// Trust the system's root certificates (default true).
    pub system_roots: bool,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            ca_file: None,
            system_roots: true,
        }
    }
}

/// Endpoint health: passive (failed requests) and active (a probe on a timer).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Path probed with a GET (a 2xx is healthy).
    pub path: String,
    /// How often every endpoint is probed, in milliseconds; 0: no active probes (an ejected
    /// endpoint is still probed every second, to readmit it). Unset: 5000 for a pool with
    /// several endpoints, 0 for a pool with one (its failures are seen on its requests, and
    /// there is nowhere else to send them).
    pub interval_ms: Option<u64>,
    /// Consecutive failures (connection refused or reset, 5xx, a failed probe) that eject
    /// an endpoint; one successful probe readmits it.
    pub eject_after: u32,
    /// Probe timeout in milliseconds.
    pub timeout_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            path: "/v1/models".into(),
            interval_ms: None,
            eject_after: 3,
            timeout_ms: 2_000,
        }
    }
}

/// Which server a pool's metrics come from: the names of its running and waiting gauges.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerKind {
    /// llama.cpp's `llama-server --metrics`.
    Llamacpp,
    /// vLLM.
    Vllm,
    /// Hugging Face text-generation-inference.
    Tgi,
    /// SGLang.
    Sglang,
    /// Any server: give `running` and `waiting`.
    Custom,
}

impl ServerKind {
    /// The built-in (running, waiting) gauge names; `None` for `custom`.
    pub fn gauges(self) -> Option<(&'static str, &'static str)> {
        match self {
            ServerKind::Llamacpp => {
                Some(("llamacpp:requests_processing", "llamacpp:requests_deferred"))
            }
            ServerKind::Vllm => Some(("vllm:num_requests_running", "vllm:num_requests_waiting")),
            ServerKind::Tgi => Some(("tgi_batch_current_size", "tgi_queue_size")),
            ServerKind::Sglang => Some(("sglang:num_running_reqs", "sglang:num_queue_reqs")),
            ServerKind::Custom => None,
        }
    }
}

/// Scraping a server's own queue (`[pools.server_metrics]`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerMetricsConfig {
    /// The server, for its gauge names.
    pub kind: ServerKind,
    /// Path of its Prometheus text endpoint (default `/metrics`).
    #[serde(default = "default_metrics_path")]
    pub path: String,
    /// Scrape interval in milliseconds (default 1000).
    #[serde(default = "default_metrics_interval")]
    pub interval_ms: u64,
    /// A reading older than this is stale and ignored: the gate falls back to its own view
    /// (default 5000).
    #[serde(default = "default_metrics_stale")]
    pub stale_ms: u64,
    /// Gauge of requests running (overrides the kind's; required for `custom`). Series of
    /// the same name are summed over their labels.
    pub running: Option<String>,
    /// Gauge of requests waiting in the server's queue (as `running`).
    pub waiting: Option<String>,
}

fn default_metrics_path() -> String {
    "/metrics".into()
}
fn default_metrics_interval() -> u64 {
    1_000
}
fn default_metrics_stale() -> u64 {
    5_000
}

/// Active probes of a pool with several endpoints when `health.interval_ms` is unset.
pub const DEFAULT_PROBE_INTERVAL_MS: u64 = 5_000;

impl HealthConfig {
    /// The probe interval in force for a pool of `endpoints` endpoints (0: none).
    pub fn interval_for(&self, endpoints: usize) -> u64 {
        match self.interval_ms {
            Some(ms) => ms,
            None if endpoints > 1 => DEFAULT_PROBE_INTERVAL_MS,
            None => 0,
        }
    }
}

impl ServerMetricsConfig {
    /// The (running, waiting) gauge names in force.
    pub fn gauges(&self) -> Option<(String, String)> {
        let builtin = self.kind.gauges();
        let running = self
            .running
            .clone()
            .or_else(|| builtin.map(|b| b.0.to_string()))?;
        let waiting = self
            .waiting
            .clone()
            .or_else(|| builtin.map(|b| b.1.to_string()))?;
        Some((running, waiting))
    }
}

impl LimitsConfig {
    fn validate(&self, at: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
        if self
            .context_tokens
            .is_some_and(|c| c == 0 || c > MAX_LIMIT_TOKENS)
        {
            return Err(ConfigError::new(
                at("limits.context_tokens"),
                format!("must be between 1 and {MAX_LIMIT_TOKENS}"),
            ));
        }
        if self
            .max_output_tokens
            .is_some_and(|c| c == 0 || c > MAX_LIMIT_TOKENS)
        {
            return Err(ConfigError::new(
                at("limits.max_output_tokens"),
                format!("must be between 1 and {MAX_LIMIT_TOKENS}"),
            ));
        }
        if self.unlearned_output_tokens == 0 || self.unlearned_output_tokens > MAX_LIMIT_TOKENS {
            return Err(ConfigError::new(
                at("limits.unlearned_output_tokens"),
                format!("must be between 1 and {MAX_LIMIT_TOKENS}"),
            ));
        }
        if !(1_000..=MAX_CONFIG_MS).contains(&self.discover_interval_ms) {
            return Err(ConfigError::new(
                at("limits.discover_interval_ms"),
                "must be between 1000 (1 s) and 86400000 (a day)",
            ));
        }
        Ok(())
    }
}

impl PoolConfig {
    /// Whether the gateway asks this pool's servers their context window (`limits.discover`,
    /// or by default where the servers are named as llama.cpp or vLLM).
    pub fn discovers_limits(&self) -> bool {
        self.limits.discover.unwrap_or_else(|| {
            self.server_metrics
                .as_ref()
                .is_some_and(|m| matches!(m.kind, ServerKind::Llamacpp | ServerKind::Vllm))
        })
    }
}

/// The largest context window or output limit a pool may be configured with (or a server
/// may report): 16M tokens, far past any model served today.
pub const MAX_LIMIT_TOKENS: u32 = 1 << 24;

impl PoolConfig {
    /// The endpoints in force: the configured ones (unnamed ones named by position), or the
    /// pool's `upstream` and `slots` as a single endpoint `e0` (none without an upstream).
    pub fn endpoint_list(&self) -> Vec<EndpointConfig> {
        if self.endpoints.is_empty() {
            return self
                .upstream
                .iter()
                .map(|u| EndpointConfig {
                    name: "e0".into(),
                    url: u.clone(),
                    slots: self.slots,
                })
                .collect();
        }
        self.endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| EndpointConfig {
                name: if e.name.trim().is_empty() {
                    format!("e{i}")
                } else {
                    e.name.clone()
                },
                ..e.clone()
            })
            .collect()
    }

    /// Check the endpoints, credentials, health and metrics settings; `at` names a field.
    fn validate_endpoints(&self, at: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
        if !self.endpoints.is_empty() && self.upstream.is_some() {
            return Err(ConfigError::new(
                at("endpoints"),
                "give either `upstream` (one server) or `endpoints`, not both",
            ));
        }
        if self.endpoints.len() > 256 {
            return Err(ConfigError::new(at("endpoints"), "at most 256 endpoints"));
        }
        let mut names = std::collections::BTreeSet::new();
        let mut total = 0u64;
        for (j, e) in self.endpoint_list().iter().enumerate() {
            let f = |k: &str| at(&format!("endpoints[{j}].{k}"));
            if e.url.trim().is_empty() {
                return Err(ConfigError::new(f("url"), "must not be empty"));
            }
            if e.slots == 0 || e.slots > 100_000 {
                return Err(ConfigError::new(f("slots"), "must be between 1 and 100000"));
            }
            if !names.insert(e.name.clone()) {
                return Err(ConfigError::new(
                    f("name"),
                    format!("duplicate endpoint name {:?}", e.name),
                ));
            }
            total += u64::from(e.slots);
        }
        if total > 100_000 {
            return Err(ConfigError::new(
                at("endpoints"),
                "the endpoints' slots add up to more than 100000",
            ));
        }
        if self.auth.api_key_env.is_some() && self.auth.api_key_file.is_some() {
            return Err(ConfigError::new(
                at("auth"),
                "give at most one of api_key_env and api_key_file",
            ));
        }
        if let Some(h) = &self.auth.header {
            let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
            if h.is_empty() || !h.chars().all(token) {
                return Err(ConfigError::new(
                    at("auth.header"),
                    format!("{h:?} is not an HTTP header name"),
                ));
            }
        }
        let hc = &self.health;
        if !hc.path.starts_with('/') || hc.path.len() > 1024 {
            return Err(ConfigError::new(
                at("health.path"),
                "must be a path starting with /",
            ));
        }
        if hc.eject_after == 0 {
            return Err(ConfigError::new(
                at("health.eject_after"),
                "must be at least 1",
            ));
        }
        let interval = hc.interval_ms.unwrap_or(0);
        if interval > MAX_CONFIG_MS || (interval != 0 && interval < 100) {
            return Err(ConfigError::new(
                at("health.interval_ms"),
                "must be 0 (no probes) or between 100 and 86400000",
            ));
        }
        if !(1..=60_000).contains(&hc.timeout_ms) {
            return Err(ConfigError::new(
                at("health.timeout_ms"),
                "must be between 1 and 60000",
            ));
        }
        if let Some(m) = &self.server_metrics {
            if !m.path.starts_with('/') || m.path.len() > 1024 {
                return Err(ConfigError::new(
                    at("server_metrics.path"),
                    "must be a path starting with /",
                ));
            }
            if !(100..=3_600_000).contains(&m.interval_ms) {
                return Err(ConfigError::new(
                    at("server_metrics.interval_ms"),
                    "must be between 100 and 3600000",
                ));
            }
            if m.stale_ms < m.interval_ms || m.stale_ms > MAX_CONFIG_MS {
                return Err(ConfigError::new(
                    at("server_metrics.stale_ms"),
                    "must be at least interval_ms and at most 86400000",
                ));
            }
            if m.gauges().is_none() {
                return Err(ConfigError::new(
                    at("server_metrics"),
                    "kind = \"custom\" needs both `running` and `waiting` gauge names",
                ));
            }
        }
        Ok(())
    }

    /// The pool's slots: the sum of its endpoints' when it lists them.
    pub fn total_slots(&self) -> u32 {
        if self.endpoints.is_empty() {
            self.slots
        } else {
            self.endpoints
                .iter()
                .fold(0u32, |a, e| a.saturating_add(e.slots))
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            name: "default".into(),
            slots: 4,
            max_depth_factor: None,
            max_queued: 10_000,
            prior: PriorConfig::default(),
            upstream: None,
            forecast_window_ms: 300_000,
            forecast_refused_weight: 0.5,
            endpoints: Vec::new(),
            auth: AuthConfig::default(),
            tls: TlsConfig::default(),
            health: HealthConfig::default(),
            server_metrics: None,
            limits: LimitsConfig::default(),
        }
    }
}

/// The estimator's priors (see [`crate::estimator`]): a request alone on the server takes
/// `overhead + prefill x P + decode x O + decode_ms_per_1k_context x O x (P + O/2) / 1000`, and
/// each other request in flight beside it adds `batch_slowdown` times that. `slackgate
/// calibrate` measures all of them on a real server.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PriorConfig {
    /// Fixed cost per request, in milliseconds.
    pub overhead_ms: f64,
    /// Cost of each prompt token, in milliseconds.
    pub prefill_ms_per_token: f64,
    /// Cost of each generated token with a short context, in milliseconds.
    pub decode_ms_per_token: f64,
    /// Extra cost of each generated token per 1000 tokens of context (prompt and output so
    /// far), in milliseconds: attention reads the whole context at every step.
    pub decode_ms_per_1k_context: f64,
    /// How much each other request in flight adds to a request's time, as a fraction of its
    /// time alone: 0 for a server that batches perfectly, 1 for one that only time-shares.
    pub batch_slowdown: f64,
    /// Characters of prompt text per token, until the upstream's `usage.prompt_tokens` teach
    /// the real ratio of its tokenizer.
    pub chars_per_token: f64,
    /// Output length assumed when a request names no `max_tokens` and nothing was learned yet.
    pub default_output_tokens: u32,
    /// Whether the estimator learns from completions (false pins the priors, for drills).
    pub learn: bool,
}

impl Default for PriorConfig {
    fn default() -> Self {
        PriorConfig {
            overhead_ms: 200.0,
            prefill_ms_per_token: 0.2,
            decode_ms_per_token: 20.0,
            decode_ms_per_1k_context: 0.0,
            batch_slowdown: 0.5,
            chars_per_token: 4.0,
            default_output_tokens: 256,
            learn: true,
        }
    }
}

/// A traffic class.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClassConfig {
    /// Canonical name (`interactive`, `batch`, ...), as logged.
    pub name: String,
    /// Other labels clients may send for this class (`sync`, `chat` -> interactive).
    pub aliases: Vec<String>,
    /// Higher runs first. Work of a higher priority never waits behind queued lower work.
    pub priority: u32,
    /// Deadline (relative, for the whole response) when the request names none. `None`:
    /// best effort, never rejected on slack.
    pub deadline_ms: Option<u64>,
    /// Reject new work of this class when the oldest job it would wait behind is older.
    pub max_queue_age_ms: Option<u64>,
    /// Switched-off classes are rejected with `class_disabled`.
    pub enabled: bool,
    /// The pool this class runs on.
    pub pool: String,
    /// Where a rejected client should go instead (seed 002's `dedicated_pool`), sent as
    /// `retry_hint` in the rejection body.
    pub retry_hint: Option<String>,
    /// Prior for the expected output length of this class (learned online afterwards).
    pub expected_output_tokens: Option<u32>,
    /// A second pool this class may use when its own cannot serve it in time (seed 003's
    /// `paid_path`, seed 002's dedicated pool).
    pub overflow_pool: Option<String>,
    /// What a capacity rejection does with the overflow pool: name it in `retry_hint`
    /// (`hint`, the default) or admit the request there when it fits (`route`).
    pub overflow: OverflowMode,
    /// Displacement, off by default (admission is then a promise). When set, a request of
    /// this class that would be rejected for `projected_wait_exceeds_slack` is admitted in
    /// place of the longest queued request of the class that is longer than it, was admitted
    /// at most this many ms ago and whose removal makes the newcomer fit; that request is
    /// refused with `displaced` before any upstream work. One for one, so the count of queued
    /// work never falls, and the capacity freed goes to more requests later: under overload
    /// this serves more requests on time, at the price of refusing some already admitted.
    pub displace_within_ms: Option<u64>,
    /// Never lock in: when a request of this class is refused only because its own estimate
    /// exceeds its deadline while a slot is free, and nothing of the class was admitted for
    /// this many ms, it is admitted as a `probe` to measure the estimate (at most one in
    /// flight). 0 turns probing off.
    pub probe_interval_ms: u64,
    /// Count, in a request's projected wait, the work of higher-priority classes expected to
    /// arrive while it waits (their recent admitted work per second): a lower-priority
    /// request is refused at arrival instead of being admitted and dropped after higher work
    /// overtook it. No effect on the top priority (nothing overtakes it) or on a class
    /// without a deadline. `false` projects only the work ahead now.
    pub forecast: bool,
    /// What the gate does with this class when the state it shares is out of reach: in
    /// cluster mode no replica holds the lease or the leader cannot be reached (Redis down or
    /// slow); on any gate, the ledger store cannot make a hold durable in time. `open` (the
    /// default): decide anyway, on this replica's own view with its share of the slots, and
    /// let holds reach the store when it returns. `closed`: refuse with 503
    /// (`cluster_unavailable`, `ledger_unavailable`) rather than risk a spend the ledger does
    /// not record.
    pub fail_mode: FailMode,
}

/// A class's choice when shared state is unreachable ([`ClassConfig::fail_mode`]).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// Decide on this replica's own view (its share of the slots).
    #[default]
    Open,
    /// Refuse with 503 and a reason.
    Closed,
}

impl FailMode {
    /// `open` or `closed`, as configured and logged.
    pub fn as_str(self) -> &'static str {
        match self {
            FailMode::Open => "open",
            FailMode::Closed => "closed",
        }
    }
}

/// How a class uses its overflow pool.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverflowMode {
    /// Reject as usual, with `retry_hint` naming the overflow pool.
    #[default]
    Hint,
    /// Admit on the overflow pool when the request's projected wait there fits its slack
    /// (`overflow_routed`); reject with the hint otherwise.
    Route,
}

impl Default for ClassConfig {
    fn default() -> Self {
        ClassConfig {
            name: String::new(),
            aliases: Vec::new(),
            priority: 50,
            deadline_ms: None,
            max_queue_age_ms: None,
            enabled: true,
            pool: "default".into(),
            retry_hint: None,
            expected_output_tokens: None,
            overflow_pool: None,
            overflow: OverflowMode::Hint,
            displace_within_ms: None,
            probe_interval_ms: 10_000,
            forecast: true,
            fail_mode: FailMode::Open,
        }
    }
}

/// How rejections tell clients when to come back.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Smallest Retry-After ever sent.
    pub min_retry_after_ms: u64,
    /// Beyond this projected drain time a retry cannot succeed soon: send
    /// `x-should-retry: false` so SDK clients stop instead of hammering.
    pub max_useful_retry_after_ms: u64,
    /// Retry-After, with `x-should-retry: false`, for rejections no retry of the same request
    /// can fix soon: `class_disabled`, `reject_unlabeled`, `reject_duplicate`,
    /// `reject_retry_cap`, `budget_exhausted`, and `projected_wait_exceeds_slack` for a request
    /// too big for its own deadline even with nothing ahead (when the class's recent
    /// completions confirm the estimate).
    pub hopeless_retry_after_ms: u64,
    /// Up to this many percent are added to each Retry-After (deterministically per job) so
    /// clients rejected together do not all come back at the same instant.
    pub jitter_percent: u32,
    /// The ceiling of every Retry-After the gate sends (its own, jitter included, and an
    /// upstream provider's it passes on): past a few minutes a projection says more about
    /// the requests ahead than about when this client can be served.
    pub max_retry_after_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            min_retry_after_ms: 1_000,
            max_useful_retry_after_ms: 30_000,
            hopeless_retry_after_ms: 60_000,
            jitter_percent: 20,
            max_retry_after_ms: 300_000,
        }
    }
}

/// A configuration that cannot run, with the path of the field at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// Where the problem is, e.g. `classes[1].pool`.
    pub path: String,
    /// What is wrong and what would be right.
    pub message: String,
}

impl ConfigError {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// The lowest `retry.max_retry_after_ms`: the gateway's fixed Retry-Afters (a duplicate key,
/// a drained class: 60 s) and a cluster lease (at most 60 s) must fit under it.
pub const MIN_RETRY_CEILING_MS: u64 = 60_000;

/// A deadline or age longer than this (one day) is almost certainly a unit mistake.
pub const MAX_CONFIG_MS: u64 = 86_400_000;

impl GateConfig {
    /// Check that the configuration can run; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.pools.is_empty() {
            return Err(ConfigError::new("pools", "at least one pool is required"));
        }
        if self.classes.is_empty() {
            return Err(ConfigError::new(
                "classes",
                "at least one class is required",
            ));
        }
        let mut pool_names = std::collections::BTreeSet::new();
        for (i, p) in self.pools.iter().enumerate() {
            let at = |f: &str| format!("pools[{i}].{f}");
            if p.name.trim().is_empty() {
                return Err(ConfigError::new(at("name"), "must not be empty"));
            }
            if !pool_names.insert(p.name.as_str()) {
                return Err(ConfigError::new(
                    at("name"),
                    format!("duplicate pool name {:?}", p.name),
                ));
            }
            if p.slots == 0 || p.slots > 100_000 {
                return Err(ConfigError::new(
                    at("slots"),
                    "must be between 1 and 100000",
                ));
            }
            if p.max_queued == 0 {
                return Err(ConfigError::new(at("max_queued"), "must be at least 1"));
            }
            p.validate_endpoints(&at)?;
            p.limits.validate(&at)?;
            if !(1_000..=86_400_000).contains(&p.forecast_window_ms) {
                return Err(ConfigError::new(
                    at("forecast_window_ms"),
                    "must be between 1000 (1 s) and 86400000 (a day)",
                ));
            }
            if !(0.0..=1.0).contains(&p.forecast_refused_weight) {
                return Err(ConfigError::new(
                    at("forecast_refused_weight"),
                    "must be between 0 and 1",
                ));
            }
            if let Some(k) = p.max_depth_factor {
                if !(k.is_finite() && k >= 0.0) {
                    return Err(ConfigError::new(
                        at("max_depth_factor"),
                        "must be a finite number >= 0",
                    ));
                }
            }
            let pr = &p.prior;
            for (name, v) in [
                ("prior.overhead_ms", pr.overhead_ms),
                ("prior.prefill_ms_per_token", pr.prefill_ms_per_token),
                ("prior.decode_ms_per_token", pr.decode_ms_per_token),
                (
                    "prior.decode_ms_per_1k_context",
                    pr.decode_ms_per_1k_context,
                ),
            ] {
                if !(v.is_finite() && (0.0..=MAX_CONFIG_MS as f64).contains(&v)) {
                    return Err(ConfigError::new(
                        at(name),
                        "must be a finite number of milliseconds >= 0",
                    ));
                }
            }
            if !(pr.batch_slowdown.is_finite() && (0.0..=10.0).contains(&pr.batch_slowdown)) {
                return Err(ConfigError::new(
                    at("prior.batch_slowdown"),
                    "must be a number between 0 and 10",
                ));
            }
            if !(pr.chars_per_token.is_finite() && (0.25..=64.0).contains(&pr.chars_per_token)) {
                return Err(ConfigError::new(
                    at("prior.chars_per_token"),
                    "must be a number between 0.25 and 64",
                ));
            }
        }
        let mut labels = std::collections::BTreeMap::new();
        for (i, c) in self.classes.iter().enumerate() {
            let at = |f: &str| format!("classes[{i}].{f}");
            if c.name.trim().is_empty() {
                return Err(ConfigError::new(at("name"), "must not be empty"));
            }
            for (j, label) in std::iter::once(&c.name).chain(c.aliases.iter()).enumerate() {
                let key = label.to_ascii_lowercase();
                if let Some(other) = labels.insert(key, c.name.clone()) {
                    let field = if j == 0 {
                        at("name")
                    } else {
                        at(&format!("aliases[{}]", j - 1))
                    };
                    return Err(ConfigError::new(
                        field,
                        format!("label {label:?} is already used by class {other:?}"),
                    ));
                }
            }
            if !pool_names.contains(c.pool.as_str()) {
                return Err(ConfigError::new(
                    at("pool"),
                    format!(
                        "unknown pool {:?} (known: {})",
                        c.pool,
                        pool_names.iter().copied().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
            if let Some(o) = &c.overflow_pool {
                if !pool_names.contains(o.as_str()) {
                    return Err(ConfigError::new(
                        at("overflow_pool"),
                        format!(
                            "unknown pool {:?} (known: {})",
                            o,
                            pool_names.iter().copied().collect::<Vec<_>>().join(", ")
                        ),
                    ));
                }
                if *o == c.pool {
                    return Err(ConfigError::new(
                        at("overflow_pool"),
                        format!("is the class's own pool {o:?}; name another pool or remove it"),
                    ));
                }
            } else if c.overflow == OverflowMode::Route {
                return Err(ConfigError::new(
                    at("overflow"),
                    "\"route\" needs an overflow_pool to route to",
                ));
            }
            for (name, v) in [
                ("deadline_ms", c.deadline_ms),
                ("max_queue_age_ms", c.max_queue_age_ms),
                ("displace_within_ms", c.displace_within_ms),
            ] {
                if let Some(v) = v {
                    if v == 0 || v > MAX_CONFIG_MS {
                        return Err(ConfigError::new(
                            at(name),
                            format!("must be between 1 and {MAX_CONFIG_MS} ms"),
                        ));
                    }
                }
            }
        }
        if let Some(d) = &self.default_class {
            if !labels.contains_key(&d.to_ascii_lowercase()) {
                return Err(ConfigError::new(
                    "default_class",
                    format!("unknown class {d:?}"),
                ));
            }
        }
        let l = &self.ledger;
        if l.hold_ttl_ms == 0 || l.hold_ttl_ms > 7 * MAX_CONFIG_MS {
            return Err(ConfigError::new(
                "ledger.hold_ttl_ms",
                "must be between 1 ms and 7 days",
            ));
        }
        if l.retry_cap > 1000 {
            return Err(ConfigError::new("ledger.retry_cap", "must be at most 1000"));
        }
        for (tenant, grant) in &l.grants {
            if tenant.is_empty() || *grant > crate::ledger::MAX_TOKENS {
                return Err(ConfigError::new(
                    format!("ledger.grants.{tenant:?}"),
                    "tenant ids must be non-empty and grants at most 2^40 tokens",
                ));
            }
        }
        let r = &self.retry;
        if r.jitter_percent > 100 {
            return Err(ConfigError::new(
                "retry.jitter_percent",
                "must be between 0 and 100",
            ));
        }
        if r.min_retry_after_ms > r.max_useful_retry_after_ms {
            return Err(ConfigError::new(
                "retry.min_retry_after_ms",
                "must not exceed retry.max_useful_retry_after_ms",
            ));
        }
        if !(MIN_RETRY_CEILING_MS..=MAX_CONFIG_MS).contains(&r.max_retry_after_ms)
            || r.max_retry_after_ms < r.max_useful_retry_after_ms
            || r.max_retry_after_ms < r.hopeless_retry_after_ms
        {
            return Err(ConfigError::new(
                "retry.max_retry_after_ms",
                "must be between 60000 (the fixed Retry-After of a duplicate or a drain) and \
                 86400000, and at least max_useful_retry_after_ms and hopeless_retry_after_ms",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_discovered_where_the_servers_are_named_or_asked_for() {
        let mut p = PoolConfig::default();
        assert!(
            !p.discovers_limits(),
            "nothing is sent to an unnamed server"
        );
        let metrics = |kind| ServerMetricsConfig {
            kind,
            path: "/metrics".into(),
            interval_ms: 1000,
            stale_ms: 5000,
            running: None,
            waiting: None,
        };
        p.server_metrics = Some(metrics(ServerKind::Llamacpp));
        assert!(p.discovers_limits());
        p.server_metrics = Some(metrics(ServerKind::Tgi));
        assert!(!p.discovers_limits());
        p.limits.discover = Some(true);
        assert!(p.discovers_limits());
        p.server_metrics = Some(metrics(ServerKind::Vllm));
        p.limits.discover = Some(false);
        assert!(!p.discovers_limits());
    }

    #[test]
    fn default_config_is_valid() {
        assert_eq!(GateConfig::default().validate(), Ok(()));
    }

    #[test]
    fn errors_name_the_field() {
        let mut c = GateConfig::default();
        c.classes[1].pool = "gpu".into();
        let e = c.validate().err();
        assert_eq!(e.map(|e| e.path), Some("classes[1].pool".to_string()));

        let mut c = GateConfig::default();
        c.classes[1].aliases.push("SYNC".into());
        let e = c.validate().err();
        assert_eq!(e.map(|e| e.path), Some("classes[1].aliases[3]".to_string()));

        let mut c = GateConfig::default();
        c.pools[0].slots = 0;
        assert!(c.validate().is_err());

        let mut c = GateConfig::default();
        c.pools[0].prior.decode_ms_per_token = f64::NAN;
        assert!(c.validate().is_err());

        let mut c = GateConfig::default();
        c.classes[0].overflow_pool = Some("paid".into());
        let e = c.validate().err();
        assert_eq!(
            e.map(|e| e.path),
            Some("classes[0].overflow_pool".to_string())
        );

        let mut c = GateConfig::default();
        c.classes[0].overflow_pool = Some("default".into());
        assert!(c.validate().is_err(), "its own pool is no overflow");

        let mut c = GateConfig::default();
        c.classes[1].overflow = OverflowMode::Route;
        let e = c.validate().err();
        assert_eq!(e.map(|e| e.path), Some("classes[1].overflow".to_string()));

        let c = GateConfig {
            default_class: Some("nope".into()),
            ..GateConfig::default()
        };
        assert_eq!(
            c.validate().err().map(|e| e.path),
            Some("default_class".to_string())
        );
    }
}
