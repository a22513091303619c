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
//!
//! This file reads the document; each section's type and its own checks are in `server.rs`,
//! `admin.rs` and `cluster.rs` (the core checks its own sections), and `validate.rs` runs
//! every check in order. `path.rs` names the field a TOML error points at.

mod admin;
mod cluster;
pub mod path;
mod server;
mod validate;

pub use admin::{
    AdminConfig, DEFAULT_ADMIN_LISTEN, DEFAULT_ADMIN_MAX_CONNECTIONS,
    DEFAULT_ADMIN_MAX_CONNECTIONS_PER_ADDR,
};
pub use cluster::ClusterConfig;
pub use server::{
    ServerConfig, Synchronous, DEFAULT_FLUSH_TIMEOUT_MS, DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
    MAX_UPSTREAM_IDLE_TIMEOUT_MS,
};

use admin::AdminFile;
use serde::Deserialize;
use slackgate_core::{ClassConfig, ConfigError, GateConfig, PoolConfig, RetryConfig};
use std::path::PathBuf;

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
    fairness: slackgate_core::config::FairnessConfig,
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
            fairness: f.fairness,
        };
        let admin = AdminConfig::from_section(f.admin);
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

    /// `headroom`: a word or a number of slots, with a reason for anything else.
    #[test]
    fn headroom_is_learned_off_or_a_number_of_slots() {
        use slackgate_core::config::Headroom;
        let parse = |v: &str| {
            Config::from_toml(&format!("[[pools]]\nname = \"default\"\nslots = 4\n{v}\n"))
                .map(|c| c.gate.pools[0].headroom)
                .map_err(|e| e.to_string())
        };
        assert_eq!(parse(""), Ok(Headroom::Learned));
        assert_eq!(parse("headroom = \"learned\""), Ok(Headroom::Learned));
        assert_eq!(parse("headroom = \"off\""), Ok(Headroom::Off));
        assert_eq!(parse("headroom = 0"), Ok(Headroom::Off));
        assert_eq!(parse("headroom = 3"), Ok(Headroom::Slots(3)));
        for (bad, says) in [
            ("headroom = 4", "would leave lower classes none"),
            ("headroom = -1", "from 0"),
            ("headroom = 99999999999", "from 0"),
            ("headroom = \"lots\"", "\"learned\", \"off\" or a number"),
            ("headroom = 1.5", "headroom"),
            ("headroom = true", "headroom"),
            ("headroom = [1]", "headroom"),
        ] {
            match parse(bad) {
                Err(e) => assert!(e.contains(says), "{bad}: {e}"),
                Ok(h) => panic!("{bad} parsed as {h:?}"),
            }
        }
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
