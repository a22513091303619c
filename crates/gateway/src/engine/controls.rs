//! The state of the operator controls, kept beside the core: the config file in force, the
//! flags set at runtime over it (overrides), the admin token, the drain and shutdown state,
//! and the decision-log lines their changes write. The operations that change them
//! (the ops layer's `control`) and the cluster's lease thread act through these.
//!
//! Flags set at runtime are *overrides* of the config file: a reload keeps them (a rollback
//! flipped at 02:14 must not be undone by an unrelated edit of the file), and setting a flag
//! to `null` returns it to the file's value. They live in memory: a restart goes back to the
//! file. Drains are runtime state of the core and survive reloads the same way.

use crate::config::Config;
use crate::engine::state::Shared;
use crate::observe::codes::{Event, LineAction, LineReason};
use crate::observe::telemetry::LogLine;
use crate::support::clock::epoch_ms;
use crate::upstream::UpstreamBase;
use serde::{Deserialize, Serialize};
use slackgate_core::{Gate, GateConfig, PoolId};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Turns the text of the config file into a config: the CLI's version also applies its
/// command-line overrides (`--upstream`, `--slots`, ...), so a reload sees what a restart
/// with the same command would.
/// Why the admin token in force could not be set.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// `admin.token_file` names a file that cannot be read.
    #[error("admin.token_file: cannot read {}: {source}", path.display())]
    Unreadable {
        /// The file as configured.
        path: std::path::PathBuf,
        /// The read's error.
        source: std::io::Error,
    },
    /// The token is shorter than `MIN_TOKEN_LEN` (its length given).
    #[error("admin token: at least {MIN_TOKEN_LEN} characters are required (got {0})")]
    TooShort(usize),
}

pub type ConfigParser = Arc<dyn Fn(&str) -> Result<Config, String> + Send + Sync>;

/// Where reloads read the configuration from.
#[derive(Clone)]
pub struct ConfigSource {
    /// The config file.
    pub path: PathBuf,
    /// How its text becomes a config.
    pub parse: ConfigParser,
}

impl ConfigSource {
    /// A source that parses the file as it is (no command-line overrides).
    pub fn file(path: PathBuf) -> ConfigSource {
        ConfigSource {
            path,
            parse: Arc::new(|text| Config::from_toml(text).map_err(|e| e.to_string())),
        }
    }
}

/// Runtime overrides of the config file's flags. In cluster mode they are shared through
/// Redis: a flag set on any replica applies on every one (see the cluster layer).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Overrides {
    /// `admit_always`, when set through the admin API.
    pub admit_always: Option<bool>,
    /// `shadow`, when set through the admin API.
    pub shadow: Option<bool>,
    /// Per-class `enabled`, when set through the admin API.
    pub enabled: BTreeMap<String, bool>,
}

impl Overrides {
    /// The file's gate config with these overrides applied.
    pub(crate) fn apply(&self, mut gate: GateConfig) -> GateConfig {
        if let Some(v) = self.admit_always {
            gate.admit_always = v;
        }
        if let Some(v) = self.shadow {
            gate.shadow = v;
        }
        for c in &mut gate.classes {
            if let Some(&v) = self.enabled.get(&c.name) {
                c.enabled = v;
            }
        }
        gate
    }
}

/// State of the operator controls, kept beside the core.
pub struct Control {
    pub(crate) overrides: Mutex<Overrides>,
    /// The config file as last loaded (what `null` overrides return to).
    pub(crate) file: Mutex<Config>,
    pub(crate) source: Mutex<Option<ConfigSource>>,
    /// The admin token from the environment (the CLI reads `SLACKGATE_ADMIN_TOKEN`).
    pub(crate) env_token: Mutex<Option<String>>,
    /// The admin token in force: `admin.token_file`'s content, else the environment's.
    pub(crate) token: Mutex<Option<String>>,
    /// Successful loads of the config (1 at start).
    pub(crate) generation: AtomicU64,
    /// Past the shutdown grace period: the gate itself is closing connections.
    pub(crate) cutting_off: AtomicBool,
    /// A drain started and its classes have not been reported drained yet: the ticker checks.
    pub(crate) drain_pending: AtomicBool,
    /// A drain started and its pools have not been reported idle yet (they may still run
    /// other classes' work after the drained classes have none left).
    pub(crate) idle_pending: AtomicBool,
    /// Held across a flag change or a reload: each updates the overrides and then the core,
    /// and a reload applying the overrides in between would undo a concurrent flag change.
    pub(crate) serial: Mutex<()>,
}

impl Control {
    /// The pools as the config file in force defines them.
    pub fn pools(&self) -> Vec<slackgate_core::config::PoolConfig> {
        lock(&self.file).gate.pools.clone()
    }

    /// The pool named `name` as the config file in force defines it.
    pub fn pool_config(&self, name: &str) -> Option<slackgate_core::config::PoolConfig> {
        lock(&self.file)
            .gate
            .pools
            .iter()
            .find(|p| p.name == name)
            .cloned()
    }

    /// Controls for a gate started from `cfg`.
    pub fn new(cfg: &Config) -> Control {
        Control {
            overrides: Mutex::new(Overrides::default()),
            file: Mutex::new(cfg.clone()),
            source: Mutex::new(None),
            env_token: Mutex::new(None),
            token: Mutex::new(None),
            generation: AtomicU64::new(1),
            cutting_off: AtomicBool::new(false),
            drain_pending: AtomicBool::new(false),
            idle_pending: AtomicBool::new(false),
            serial: Mutex::new(()),
        }
    }

    /// Set where reloads read the config from.
    pub fn set_source(&self, source: Option<ConfigSource>) {
        *lock(&self.source) = source;
    }

    /// The config source, if reloads have one.
    pub fn source(&self) -> Option<ConfigSource> {
        lock(&self.source).clone()
    }

    /// Set the environment's admin token and (re)read the token in force.
    pub fn set_env_token(&self, token: Option<String>) -> Result<(), TokenError> {
        *lock(&self.env_token) = token.filter(|t| !t.trim().is_empty());
        let file = lock(&self.file).clone();
        self.load_token(&file)
    }

    /// Read the admin token for `cfg`: its `token_file`, else the environment's token.
    pub(crate) fn load_token(&self, cfg: &Config) -> Result<(), TokenError> {
        let token = match &cfg.admin.token_file {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| TokenError::Unreadable {
                        path: path.clone(),
                        source,
                    })?;
                Some(text.trim().to_string())
            }
            None => lock(&self.env_token).clone(),
        };
        if let Some(t) = &token {
            if t.len() < MIN_TOKEN_LEN {
                return Err(TokenError::TooShort(t.len()));
            }
        }
        *lock(&self.token) = token;
        Ok(())
    }

    /// Whether an admin token is configured at all.
    pub fn has_token(&self) -> bool {
        lock(&self.token).is_some()
    }

    /// Compare a presented token with the one in force, in constant time.
    pub fn token_matches(&self, presented: &str) -> bool {
        match &*lock(&self.token) {
            Some(t) => constant_time_eq(t.as_bytes(), presented.as_bytes()),
            None => false,
        }
    }

    /// The runtime overrides in force.
    pub fn overrides(&self) -> Overrides {
        lock(&self.overrides).clone()
    }

    /// Configurations loaded so far (1 at start, +1 per applied reload).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Past the shutdown grace period: connections are being closed by the gate.
    pub fn cutting_off(&self) -> bool {
        self.cutting_off.load(Ordering::Relaxed)
    }
}

/// Shortest admin token accepted: anything shorter is guessable.
pub const MIN_TOKEN_LEN: usize = 16;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain data behind these locks is consistent between calls; keep going after a panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Equal in time that depends only on the lengths, never on where the first difference is.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xff);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// The upstream of every pool id of `gate` (retired ones included: their in-flight work
/// still needs them).
pub(crate) fn pool_upstreams(gate: &Gate) -> Vec<Vec<Option<UpstreamBase>>> {
    (0..gate.pool_count())
        .map(|i| {
            gate.endpoints(0, PoolId(i))
                .iter()
                .map(|e| crate::upstream::parse_base(&e.url).ok())
                .collect()
        })
        .collect()
}

impl Shared {
    /// Log operator event lines, numbered in the core's order and counted in `/metrics`.
    /// Log an event about one endpoint (`action: "flag"`, `flag: "endpoint"`): it was
    /// ejected, readmitted, drained, undrained or throttled by its provider.
    pub(crate) fn endpoint_event(
        &self,
        pool: &str,
        endpoint: &str,
        event: Event,
        actor: &str,
        message: Option<String>,
    ) {
        let mut line = Self::event_line(LineAction::Flag, event, actor);
        line.flag = Some("endpoint".to_string());
        line.pool = Some(pool.to_string());
        line.endpoint = Some(endpoint.to_string());
        line.message = message;
        self.log_events(vec![line]);
    }

    /// Log a cluster event (`action: "flag"`, `flag: "cluster"`): this replica took or lost
    /// the gate's lease, or Redis went out of reach or came back.
    pub(crate) fn cluster_event(&self, event: Event, message: Option<String>) {
        let mut line = Self::event_line(LineAction::Flag, event, "gate");
        line.flag = Some("cluster".to_string());
        line.message = message;
        self.log_events(vec![line]);
    }

    pub(crate) fn log_events(&self, mut lines: Vec<LogLine>) {
        self.emit(&mut lines);
    }

    pub(crate) fn event_line(
        action: LineAction,
        reason: impl Into<LineReason>,
        actor: &str,
    ) -> LogLine {
        LogLine {
            ts_ms: epoch_ms(),
            action,
            reason: reason.into(),
            actor: Some(actor.to_string()),
            ..LogLine::default()
        }
    }

    pub(crate) fn flag_line(
        &self,
        flag: Event,
        class: Option<&str>,
        value: serde_json::Value,
        actor: &str,
    ) {
        let mut line = Self::event_line(LineAction::Flag, flag, actor);
        line.flag = Some(flag.as_str().to_string());
        line.class = class.map(str::to_string);
        line.value = Some(value);
        self.log_events(vec![line]);
    }

    /// Cluster mode: hand the overrides in force to the lease thread, which writes them to
    /// Redis for every replica (serialised under `serial`, so the last change wins).
    pub(crate) fn publish_overrides(&self) {
        if let Some(c) = &self.cluster {
            let o = lock(&self.control.overrides).clone();
            if let Ok(json) = serde_json::to_string(&o) {
                c.publish_flags(json);
            }
        }
    }

    /// Cluster mode: another replica changed the flags (read from Redis by the lease
    /// thread). Apply every override that differs from this replica's, each with its
    /// `flag` line (actor `cluster`); unknown classes are skipped.
    pub fn apply_cluster_overrides(&self, new: &Overrides) {
        let old = self.control.overrides();
        let actor = "cluster";
        let _serial = lock(&self.control.serial);
        if new.admit_always != old.admit_always {
            let config = lock(&self.control.file).gate.admit_always;
            lock(&self.control.overrides).admit_always = new.admit_always;
            let effective = new.admit_always.unwrap_or(config);
            self.with_core(|st, _, _| st.gate.set_admit_always(effective));
            self.flag_line(Event::AdmitAlways, None, json_flag(new.admit_always), actor);
        }
        if new.shadow != old.shadow {
            let config = lock(&self.control.file).gate.shadow;
            lock(&self.control.overrides).shadow = new.shadow;
            let effective = new.shadow.unwrap_or(config);
            self.with_core(|st, _, _| st.gate.set_shadow(effective));
            self.flag_line(Event::Shadow, None, json_flag(new.shadow), actor);
        }
        let classes: std::collections::BTreeSet<&String> =
            new.enabled.keys().chain(old.enabled.keys()).collect();
        for class in classes {
            let value = new.enabled.get(class).copied();
            if value == old.enabled.get(class).copied() {
                continue;
            }
            let config = lock(&self.control.file)
                .gate
                .classes
                .iter()
                .find(|c| &c.name == class)
                .is_none_or(|c| c.enabled);
            let effective = value.unwrap_or(config);
            let known = self.with_core(|st, _, _| match st.gate.class_by_name(class) {
                Some(id) => {
                    st.gate.set_class_enabled(id, effective);
                    true
                }
                None => false,
            });
            if !known {
                continue;
            }
            {
                let mut o = lock(&self.control.overrides);
                match value {
                    Some(v) => o.enabled.insert(class.clone(), v),
                    None => o.enabled.remove(class),
                };
            }
            self.flag_line(Event::Enabled, Some(class), json_flag(value), actor);
        }
    }

    /// Called by the ticker: once the drained classes have no work left, say so in the
    /// decision log (a `flag` line, reason `drain_idle`, `drained: true`), and once their
    /// pools are idle too, again if that came later (`idle: true`), so the operator waiting
    /// for step 4 of the drain order sees it without polling. Other classes may keep a
    /// shared pool busy for long after the drained ones are done.
    pub(crate) fn check_drain_idle(&self) {
        let c = &self.control;
        if !c.drain_pending.load(Ordering::Relaxed) && !c.idle_pending.load(Ordering::Relaxed) {
            return;
        }
        self.with_core(|st, _, lines| {
            let status = st.gate.drain_status();
            if status.classes.is_empty() || !status.drained {
                return;
            }
            let first = c.drain_pending.swap(false, Ordering::Relaxed);
            let idle_now = status.idle && c.idle_pending.load(Ordering::Relaxed);
            if idle_now {
                c.idle_pending.store(false, Ordering::Relaxed);
            }
            if !first && !idle_now {
                return;
            }
            let mut line = Self::event_line(LineAction::Flag, Event::DrainIdle, "gate");
            line.flag = Some("drain".into());
            line.value = Some(serde_json::json!({
                "drained": true,
                "idle": status.idle,
                "classes": status.classes.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
            }));
            lines.push(line);
        });
    }
}

/// A flag's override as JSON: `null` when it follows the file.
pub(crate) fn json_flag(v: Option<bool>) -> serde_json::Value {
    v.map_or(serde_json::Value::Null, serde_json::Value::Bool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq(b"abcdefghijklmnop", b"abcdefghijklmnop"));
        assert!(!constant_time_eq(b"abcdefghijklmnop", b"abcdefghijklmnoq"));
        assert!(!constant_time_eq(b"abcdefghijklmnop", b"abcdefghijklmno"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(!constant_time_eq(b"x", b""));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn overrides_apply_over_the_file() {
        let gate = GateConfig {
            shadow: true,
            ..GateConfig::default()
        };
        let o = Overrides {
            admit_always: Some(true),
            shadow: None,
            enabled: [("batch".to_string(), false)].into_iter().collect(),
        };
        let g = o.apply(gate);
        assert!(g.admit_always && g.shadow);
        assert!(!g.classes[1].enabled && g.classes[0].enabled);
    }
}
