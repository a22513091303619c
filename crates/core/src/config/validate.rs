//! Validation: one named check per section of the configuration, run in the order of the file
//! (pools, classes, the default class, the ledger, retries), each returning the first problem
//! it finds with the path of the field at fault.
//!
//! A pool's checks take `at`, which turns a field name into its full path
//! (`limits.context_tokens` -> `pools[2].limits.context_tokens`), so the same check reads the
//! same whichever pool it runs on.

use super::{
    ClassConfig, ConfigError, GateConfig, LimitsConfig, OverflowMode, PoolConfig, PriorConfig,
    MAX_CONFIG_MS, MAX_LIMIT_TOKENS, MIN_RETRY_CEILING_MS,
};
use std::collections::{BTreeMap, BTreeSet};

/// Names a field of the section being checked by its full path.
type FieldPath<'a> = &'a dyn Fn(&str) -> String;

impl GateConfig {
    /// Check that the configuration can run; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_not_empty()?;
        let mut pool_names = BTreeSet::new();
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
            p.validate(&at)?;
        }
        let mut labels = BTreeMap::new();
        for (i, c) in self.classes.iter().enumerate() {
            let at = |f: &str| format!("classes[{i}].{f}");
            c.validate(&at, &pool_names, &mut labels)?;
        }
        self.validate_default_class(&labels)?;
        self.validate_ledger()?;
        self.validate_fairness()?;
        self.validate_retry()
    }

    /// At least one pool and one class.
    fn validate_not_empty(&self) -> Result<(), ConfigError> {
        if self.pools.is_empty() {
            return Err(ConfigError::new("pools", "at least one pool is required"));
        }
        if self.classes.is_empty() {
            return Err(ConfigError::new(
                "classes",
                "at least one class is required",
            ));
        }
        Ok(())
    }

    /// `default_class` names a class (by name or alias); `labels` holds every label, lowercase.
    fn validate_default_class(&self, labels: &BTreeMap<String, String>) -> Result<(), ConfigError> {
        if let Some(d) = &self.default_class {
            if !labels.contains_key(&d.to_ascii_lowercase()) {
                return Err(ConfigError::new(
                    "default_class",
                    format!("unknown class {d:?}"),
                ));
            }
        }
        Ok(())
    }

    /// `[ledger]`: hold TTL, retry cap and tenant grants in range.
    fn validate_ledger(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// `[fairness]`: positive finite weights on non-empty ids, bounded tracking.
    fn validate_fairness(&self) -> Result<(), ConfigError> {
        let f = &self.fairness;
        let weight_ok = |w: f64| w.is_finite() && w > 0.0 && w <= 1e6;
        if !weight_ok(f.default_weight) {
            return Err(ConfigError::new(
                "fairness.default_weight",
                "must be above 0 and at most 1000000",
            ));
        }
        for (id, w) in &f.weights {
            if id.is_empty() || id.len() > 256 || id == crate::config::OTHER_TENANT {
                return Err(ConfigError::new(
                    format!("fairness.weights.{id:?}"),
                    "ids must be 1 to 256 bytes and not the shared bucket's name \"other\"",
                ));
            }
            if !weight_ok(*w) {
                return Err(ConfigError::new(
                    format!("fairness.weights.{id:?}"),
                    "must be above 0 and at most 1000000",
                ));
            }
        }
        if f.max_tenants == 0 || f.max_tenants > crate::config::MAX_TRACKED_TENANTS {
            return Err(ConfigError::new(
                "fairness.max_tenants",
                "must be between 1 and 1000000",
            ));
        }
        if f.active_ms == 0 || f.active_ms > MAX_CONFIG_MS {
            return Err(ConfigError::new(
                "fairness.active_ms",
                "must be between 1 ms and a day",
            ));
        }
        if !(0.0..=1.0).contains(&f.headroom_max_idle) {
            return Err(ConfigError::new(
                "fairness.headroom_max_idle",
                "must be between 0 (no tenant headroom) and 1",
            ));
        }
        Ok(())
    }

    /// `[retry]`: jitter a percentage, and the Retry-After bounds in order under the ceiling.
    fn validate_retry(&self) -> Result<(), ConfigError> {
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

impl PoolConfig {
    /// Everything of one pool but its name: capacity, endpoints and their settings, limits,
    /// forecast, depth rule and priors.
    fn validate(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
        if self.slots == 0 || self.slots > 100_000 {
            return Err(ConfigError::new(
                at("slots"),
                "must be between 1 and 100000",
            ));
        }
        if self.max_queued == 0 {
            return Err(ConfigError::new(at("max_queued"), "must be at least 1"));
        }
        self.validate_endpoints(at)?;
        self.validate_auth(at)?;
        self.validate_health(at)?;
        self.validate_server_metrics(at)?;
        self.limits.validate(at)?;
        self.validate_forecast(at)?;
        if let Some(k) = self.max_depth_factor {
            if !(k.is_finite() && k >= 0.0) {
                return Err(ConfigError::new(
                    at("max_depth_factor"),
                    "must be a finite number >= 0",
                ));
            }
        }
        self.prior.validate(at)
    }

    /// `upstream` or `endpoints`, not both; each endpoint with a URL, slots and its own
    /// name; the slots in range in total.
    fn validate_endpoints(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
        if !self.endpoints.is_empty() && self.upstream.is_some() {
            return Err(ConfigError::new(
                at("endpoints"),
                "give either `upstream` (one server) or `endpoints`, not both",
            ));
        }
        if self.endpoints.len() > 256 {
            return Err(ConfigError::new(at("endpoints"), "at most 256 endpoints"));
        }
        let mut names = BTreeSet::new();
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
        Ok(())
    }

    /// `[pools.auth]`: at most one source of the key, and a header name that is an HTTP token.
    fn validate_auth(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// `[pools.health]`: a probe path, a positive ejection threshold, interval and timeout in
    /// range.
    fn validate_health(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// `[pools.server_metrics]`, when present: path, interval and staleness in range, and
    /// gauge names known for its kind.
    fn validate_server_metrics(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
        let Some(m) = &self.server_metrics else {
            return Ok(());
        };
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
        Ok(())
    }

    /// The wait forecast's window and the weight of refused work in range.
    fn validate_forecast(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
        if !(1_000..=86_400_000).contains(&self.forecast_window_ms) {
            return Err(ConfigError::new(
                at("forecast_window_ms"),
                "must be between 1000 (1 s) and 86400000 (a day)",
            ));
        }
        if !(0.0..=1.0).contains(&self.forecast_refused_weight) {
            return Err(ConfigError::new(
                at("forecast_refused_weight"),
                "must be between 0 and 1",
            ));
        }
        if self.promise_guard_ms > 60_000 {
            return Err(ConfigError::new(
                at("promise_guard_ms"),
                "must be at most 60000 (a minute)",
            ));
        }
        if let super::Headroom::Slots(n) = self.headroom {
            let slots = if self.endpoints.is_empty() {
                self.slots
            } else {
                self.endpoints.iter().map(|e| e.slots).sum()
            };
            if n >= slots.max(1) {
                return Err(ConfigError::new(
                    at("headroom"),
                    format!(
                        "{n} slots of {slots} would leave lower classes none: at most {}",
                        slots.saturating_sub(1)
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl LimitsConfig {
    /// `[pools.limits]`: token limits and the discovery interval in range.
    fn validate(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
        for (name, limit) in [
            ("limits.context_tokens", self.context_tokens),
            ("limits.max_output_tokens", self.max_output_tokens),
            (
                "limits.unlearned_output_tokens",
                Some(self.unlearned_output_tokens),
            ),
        ] {
            if limit.is_some_and(|c| c == 0 || c > MAX_LIMIT_TOKENS) {
                return Err(ConfigError::new(
                    at(name),
                    format!("must be between 1 and {MAX_LIMIT_TOKENS}"),
                ));
            }
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

impl PriorConfig {
    /// `[pools.prior]`: finite costs in range, a batch slowdown and a token ratio that make
    /// sense.
    fn validate(&self, at: FieldPath<'_>) -> Result<(), ConfigError> {
        for (name, v) in [
            ("prior.overhead_ms", self.overhead_ms),
            ("prior.prefill_ms_per_token", self.prefill_ms_per_token),
            ("prior.decode_ms_per_token", self.decode_ms_per_token),
            (
                "prior.decode_ms_per_1k_context",
                self.decode_ms_per_1k_context,
            ),
        ] {
            if !(v.is_finite() && (0.0..=MAX_CONFIG_MS as f64).contains(&v)) {
                return Err(ConfigError::new(
                    at(name),
                    "must be a finite number of milliseconds >= 0",
                ));
            }
        }
        if !(self.batch_slowdown.is_finite() && (0.0..=10.0).contains(&self.batch_slowdown)) {
            return Err(ConfigError::new(
                at("prior.batch_slowdown"),
                "must be a number between 0 and 10",
            ));
        }
        if !(self.chars_per_token.is_finite() && (0.25..=64.0).contains(&self.chars_per_token)) {
            return Err(ConfigError::new(
                at("prior.chars_per_token"),
                "must be a number between 0.25 and 64",
            ));
        }
        Ok(())
    }
}

impl ClassConfig {
    /// One class: a name, labels no other class uses (added to `labels`, lowercase), a known
    /// pool, a usable overflow, durations in range.
    fn validate(
        &self,
        at: FieldPath<'_>,
        pool_names: &BTreeSet<&str>,
        labels: &mut BTreeMap<String, String>,
    ) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() {
            return Err(ConfigError::new(at("name"), "must not be empty"));
        }
        self.claim_labels(at, labels)?;
        if !pool_names.contains(self.pool.as_str()) {
            return Err(unknown_pool(at("pool"), &self.pool, pool_names));
        }
        self.validate_overflow(at, pool_names)?;
        for (name, v) in [
            ("deadline_ms", self.deadline_ms),
            ("max_queue_age_ms", self.max_queue_age_ms),
            ("displace_within_ms", self.displace_within_ms),
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
        Ok(())
    }

    /// Add the class's name and aliases to `labels` (lowercase, to the class's name); a label
    /// another class holds already is an error at that label's field.
    fn claim_labels(
        &self,
        at: FieldPath<'_>,
        labels: &mut BTreeMap<String, String>,
    ) -> Result<(), ConfigError> {
        for (j, label) in std::iter::once(&self.name)
            .chain(self.aliases.iter())
            .enumerate()
        {
            let key = label.to_ascii_lowercase();
            if let Some(other) = labels.insert(key, self.name.clone()) {
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
        Ok(())
    }

    /// An overflow pool is another known pool; `overflow = "route"` needs one.
    fn validate_overflow(
        &self,
        at: FieldPath<'_>,
        pool_names: &BTreeSet<&str>,
    ) -> Result<(), ConfigError> {
        let Some(o) = &self.overflow_pool else {
            if self.overflow == OverflowMode::Route {
                return Err(ConfigError::new(
                    at("overflow"),
                    "\"route\" needs an overflow_pool to route to",
                ));
            }
            return Ok(());
        };
        if !pool_names.contains(o.as_str()) {
            return Err(unknown_pool(at("overflow_pool"), o, pool_names));
        }
        if *o == self.pool {
            return Err(ConfigError::new(
                at("overflow_pool"),
                format!("is the class's own pool {o:?}; name another pool or remove it"),
            ));
        }
        Ok(())
    }
}

/// The error for a class naming a pool that does not exist, listing the pools that do.
fn unknown_pool(path: String, name: &str, pool_names: &BTreeSet<&str>) -> ConfigError {
    ConfigError::new(
        path,
        format!(
            "unknown pool {:?} (known: {})",
            name,
            pool_names.iter().copied().collect::<Vec<_>>().join(", ")
        ),
    )
}
