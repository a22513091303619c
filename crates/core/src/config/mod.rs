//! Admission configuration: classes, pools, estimator priors and the unlabeled-work policy.
//!
//! The core only defines and validates the shape; reading TOML from a file belongs to the
//! gateway. Every field has a default so a config can be as small as one pool and one class.
//! Validation reports the path of the offending field (`classes[1].pool`), because an operator
//! editing a file at 02:14 needs to know *where*, not only *what*.
//!
//! The types of the top-level tables and of a class live here; a pool's tables (endpoints,
//! credentials, TLS, health, server metrics, limits) in `pool`; the checks, one named function
//! per section, in `validate`.

use serde::Deserialize;

mod fairness;
mod pool;
#[cfg(test)]
mod tests;
mod validate;

pub use fairness::{FairnessConfig, Unlisted, MAX_TRACKED_TENANTS, OTHER_TENANT};
pub use pool::{
    AuthConfig, EndpointConfig, Headroom, HealthConfig, LimitsConfig, PoolConfig, ServerKind,
    ServerMetricsConfig, TlsConfig, DEFAULT_CONTEXT_TOKENS, DEFAULT_PROBE_INTERVAL_MS,
    MAX_LIMIT_TOKENS,
};

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
    /// Weighted fair share between the tenants of a class.
    pub fairness: FairnessConfig,
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
            fairness: FairnessConfig::default(),
        }
    }
}

/// Config keys renamed in this release and still read under their old name, as
/// `(table, old key, new key)`: `pools` is every `[[pools]]` entry. The old name goes away in
/// the next release; the gateway warns when a file still uses one (see CHANGELOG.md).
pub const DEPRECATED_KEYS: &[(&str, &str, &str)] = &[("pools", "max_in_flight", "slots")];

/// The estimator's priors (see the `estimator` module): a request alone on the server takes
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
