//! The checks of a whole configuration: the core's, then each section's in a fixed order
//! (the first error found is the one reported, so the order is part of the interface), then
//! the upstream URLs. Each section's own checks sit beside its type (`server.rs`,
//! `admin.rs`, `cluster.rs`).

use super::{err, Config, LogConfig, MAX_LOG_CHANNEL_CAPACITY};
use slackgate_core::{ConfigError, PoolConfig};

impl Config {
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
            check_pool_urls(i, p)?;
        }
        Ok(())
    }

    /// Check the values that are present (an upstream may still be given on the command line).
    pub fn validate_shape(&self) -> Result<(), ConfigError> {
        self.gate.validate()?;
        if let Some(c) = &self.cluster {
            c.validate(self.server.listen)?;
        }
        self.server.check_request_path()?;
        self.server.check_ledger()?;
        self.server.check_connections()?;
        self.admin.check()?;
        self.server.check_config_poll()?;
        self.server.check_fairness_header()?;
        let classes = &self.gate.classes;
        let is_class = |name: &str| {
            classes
                .iter()
                .any(|c| c.name == name || c.aliases.iter().any(|a| a == name))
        };
        self.server
            .class_map
            .check(is_class)
            .map_err(|(path, message)| err(&path, &message))?;
        check_log(&self.log)?;
        for (i, p) in self.gate.pools.iter().enumerate() {
            check_pool_urls(i, p)?;
        }
        Ok(())
    }
}

/// `[log]`: a channel tokio can allocate (it allocates the slots up front and panics on
/// absurd capacities).
fn check_log(log: &LogConfig) -> Result<(), ConfigError> {
    if !(1..=MAX_LOG_CHANNEL_CAPACITY).contains(&log.channel_capacity) {
        return Err(err(
            "log.channel_capacity",
            &format!("must be between 1 and {MAX_LOG_CHANNEL_CAPACITY}"),
        ));
    }
    Ok(())
}

/// The URLs pool `i` names, when it names them: its `upstream` and each endpoint's `url`.
fn check_pool_urls(i: usize, pool: &PoolConfig) -> Result<(), ConfigError> {
    if let Some(u) = &pool.upstream {
        crate::wire::url::parse_base(u)
            .map_err(|m| err(&format!("pools[{i}].upstream"), &m.to_string()))?;
    }
    for (j, e) in pool.endpoints.iter().enumerate() {
        crate::wire::url::parse_base(&e.url)
            .map_err(|m| err(&format!("pools[{i}].endpoints[{j}].url"), &m.to_string()))?;
    }
    Ok(())
}
