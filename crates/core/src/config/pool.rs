//! A pool's tables: its servers (`endpoints`), credentials, TLS, health checks, server
//! metrics and request limits, with the defaults and derived values the gate and the gateway
//! read from them. Their checks are in `validate`.

use super::PriorConfig;
use serde::Deserialize;

/// One upstream pool.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Name used by classes (`pool = "..."`), metrics and logs.
    pub name: String,
    /// Slots: the number of requests sent upstream at once. The old key `max_in_flight` is
    /// still read for one release (see [`DEPRECATED_KEYS`](super::DEPRECATED_KEYS)).
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
    /// Slots kept free for the work of higher classes that cannot wait (trunk reservation):
    /// a lower class's job starts only while at least this many slots, less those the higher
    /// classes already run, stay free after it. `"learned"` (the default) sizes it from the
    /// higher classes' recent demand; a number pins it; `"off"` (or 0) turns it off. See
    /// [`Headroom`].
    pub headroom: Headroom,
    /// Time kept in hand on every promise (ms) for what no estimate sees: the gate's own
    /// scheduling, the ledger's commit before the send, connection setup, the network and a
    /// machine that pauses. A request with a deadline is admitted only if its padded wait and
    /// service end at least this long before the deadline. 0 holds promises to the exact
    /// projection, which the first hiccup of a few milliseconds breaks (a request admitted
    /// 20 ms inside its deadline finished after it on a busy CI machine).
    pub promise_guard_ms: u64,
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

/// A pool's headroom for urgent work (see [`PoolConfig::headroom`]): in TOML `"learned"`,
/// `"off"` or a number of slots.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(try_from = "HeadroomSetting")]
pub enum Headroom {
    /// Sized per pool from the higher classes' demand over the forecast window (see the
    /// gate's `headroom` module): about their mean busy slots plus half its square root.
    #[default]
    Learned,
    /// No headroom: a free slot goes to whatever is queued first by priority.
    Off,
    /// This many slots, pinned (at most the pool's slots less one: lower classes always
    /// keep a slot).
    Slots(u32),
}

/// How `headroom` is written in TOML: a word or a number.
#[derive(Deserialize)]
#[serde(untagged)]
enum HeadroomSetting {
    Word(String),
    Slots(i64),
}

impl TryFrom<HeadroomSetting> for Headroom {
    type Error = String;
    fn try_from(v: HeadroomSetting) -> Result<Self, Self::Error> {
        match v {
            HeadroomSetting::Word(w) => w.parse(),
            HeadroomSetting::Slots(0) => Ok(Headroom::Off),
            HeadroomSetting::Slots(n) => u32::try_from(n)
                .map(Headroom::Slots)
                .map_err(|_| format!("headroom must be a number of slots from 0, not {n}")),
        }
    }
}

/// `learned`, `off` or a number of slots (a command line's `--headroom`).
impl std::str::FromStr for Headroom {
    type Err = String;
    fn from_str(w: &str) -> Result<Self, Self::Err> {
        match w {
            "learned" => Ok(Headroom::Learned),
            "off" | "0" => Ok(Headroom::Off),
            n => n.parse::<u32>().map(Headroom::Slots).map_err(|_| {
                format!("headroom must be \"learned\", \"off\" or a number of slots, not {w:?}")
            }),
        }
    }
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

/// The largest context window or output limit a pool may be configured with (or a server
/// may report): 16M tokens, far past any model served today.
pub const MAX_LIMIT_TOKENS: u32 = 1 << 24;

/// The default [`PoolConfig::promise_guard_ms`].
pub const DEFAULT_PROMISE_GUARD_MS: u64 = 50;

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
            headroom: Headroom::Learned,
            promise_guard_ms: DEFAULT_PROMISE_GUARD_MS,
            endpoints: Vec::new(),
            auth: AuthConfig::default(),
            tls: TlsConfig::default(),
            health: HealthConfig::default(),
            server_metrics: None,
            limits: LimitsConfig::default(),
        }
    }
}
