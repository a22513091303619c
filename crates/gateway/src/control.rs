//! Operator controls of a running gate: runtime flags, drains, config reloads and the
//! shutdown sequence. The admin API ([`crate::admin`]), the config watcher and the signal
//! handlers call these; each change goes through the core under its lock and is written to
//! the decision log as one line (`flag`, `reload`, `shutdown`), which `/metrics` counts too.
//!
//! Flags set here are *overrides* of the config file: a reload keeps them (a rollback flipped
//! at 02:14 must not be undone by an unrelated edit of the file), and setting a flag to
//! `null` returns it to the file's value. They live in memory: a restart goes back to the
//! file. Drains are runtime state of the core and survive reloads the same way.

use crate::config::Config;
use crate::state::Shared;
use crate::telemetry::{epoch_ms, LogLine};
use crate::upstream::UpstreamBase;
use serde::{Deserialize, Serialize};
use slackgate_core::{DrainStatus, Gate, GateConfig, PoolId, Reason, ReconfigureReport};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Turns the text of the config file into a config: the CLI's version also applies its
/// command-line overrides (`--upstream`, `--slots`, ...), so a reload sees what a restart
/// with the same command would.
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
/// Redis: a flag set on any replica applies on every one (see `crate::cluster`).
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
    fn apply(&self, mut gate: GateConfig) -> GateConfig {
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
    overrides: Mutex<Overrides>,
    /// The config file as last loaded (what `null` overrides return to).
    file: Mutex<Config>,
    source: Mutex<Option<ConfigSource>>,
    /// The admin token from the environment (the CLI reads `SLACKGATE_ADMIN_TOKEN`).
    env_token: Mutex<Option<String>>,
    /// The admin token in force: `admin.token_file`'s content, else the environment's.
    token: Mutex<Option<String>>,
    /// Successful loads of the config (1 at start).
    generation: AtomicU64,
    /// Past the shutdown grace period: the gate itself is closing connections.
    cutting_off: AtomicBool,
    /// A drain started and its classes have not been reported drained yet: the ticker checks.
    drain_pending: AtomicBool,
    /// A drain started and its pools have not been reported idle yet (they may still run
    /// other classes' work after the drained classes have none left).
    idle_pending: AtomicBool,
    /// Held across a flag change or a reload: each updates the overrides and then the core,
    /// and a reload applying the overrides in between would undo a concurrent flag change.
    serial: Mutex<()>,
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
    pub fn set_env_token(&self, token: Option<String>) -> Result<(), String> {
        *lock(&self.env_token) = token.filter(|t| !t.trim().is_empty());
        let file = lock(&self.file).clone();
        self.load_token(&file)
    }

    /// Read the admin token for `cfg`: its `token_file`, else the environment's token.
    fn load_token(&self, cfg: &Config) -> Result<(), String> {
        let token = match &cfg.admin.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!("admin.token_file: cannot read {}: {e}", path.display())
                })?;
                Some(text.trim().to_string())
            }
            None => lock(&self.env_token).clone(),
        };
        if let Some(t) = &token {
            if t.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "admin token: at least {MIN_TOKEN_LEN} characters are required (got {})",
                    t.len()
                ));
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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

/// One flag's value, where it comes from, and the file's value.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FlagView {
    /// The value in force.
    pub value: bool,
    /// Set through the admin API (`null`: the file's value applies).
    #[serde(rename = "override")]
    pub override_value: Option<bool>,
    /// The config file's value.
    pub config: bool,
}

/// One class's switches.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ClassFlags {
    /// `enabled`, its override and the file's value.
    pub enabled: FlagView,
    /// Being drained.
    pub draining: bool,
}

/// `GET /admin/flags`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FlagsView {
    /// The rollback flag.
    pub admit_always: FlagView,
    /// Shadow mode.
    pub shadow: FlagView,
    /// Per class.
    pub classes: BTreeMap<String, ClassFlags>,
    /// A drain refuses unlabeled work.
    pub unlabeled_suspended: bool,
    /// Configurations loaded so far.
    pub config_generation: u64,
}

/// The answer to a reload.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReloadOutcome {
    /// The new configuration's generation.
    pub generation: u64,
    /// What it changed in the gate.
    pub changes: ReconfigureReport,
    /// Sections that changed but only apply after a restart (`server`, `log`,
    /// `admin.listen`).
    pub restart_required: Vec<String>,
}

/// Why a control request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No such class.
    #[error("unknown class {0:?} (known: {1})")]
    UnknownClass(String, String),
    /// The new configuration is invalid; the old one stays in force.
    #[error("{0}")]
    InvalidConfig(String),
    /// Reload asked of a gate started without a config file.
    #[error("this gate was started without a config file: nothing to reload")]
    NoConfigFile,
}

impl Shared {
    /// Log operator event lines, numbered in the core's order and counted in `/metrics`.
    /// Log an event about one endpoint (`action: "flag"`, `flag: "endpoint"`): it was
    /// ejected, readmitted, drained, undrained or throttled by its provider.
    pub(crate) fn endpoint_event(
        &self,
        pool: &str,
        endpoint: &str,
        event: &'static str,
        actor: &str,
        message: Option<String>,
    ) {
        let mut line = Self::event_line("flag", event, actor);
        line.flag = Some("endpoint".to_string());
        line.pool = Some(pool.to_string());
        line.endpoint = Some(endpoint.to_string());
        line.message = message;
        self.log_events(vec![line]);
    }

    /// Log a cluster event (`action: "flag"`, `flag: "cluster"`): this replica took or lost
    /// the gate's lease, or Redis went out of reach or came back.
    pub(crate) fn cluster_event(&self, event: &'static str, message: Option<String>) {
        let mut line = Self::event_line("flag", event, "gate");
        line.flag = Some("cluster".to_string());
        line.message = message;
        self.log_events(vec![line]);
    }

    fn log_events(&self, mut lines: Vec<LogLine>) {
        self.emit(&mut lines);
    }

    fn event_line(action: &'static str, reason: &'static str, actor: &str) -> LogLine {
        LogLine {
            ts_ms: epoch_ms(),
            action,
            reason,
            actor: Some(actor.to_string()),
            ..LogLine::default()
        }
    }

    fn flag_line(
        &self,
        flag: &'static str,
        class: Option<&str>,
        value: serde_json::Value,
        actor: &str,
    ) {
        let mut line = Self::event_line("flag", flag, actor);
        line.flag = Some(flag.to_string());
        line.class = class.map(str::to_string);
        line.value = Some(value);
        self.log_events(vec![line]);
    }

    /// `GET /admin/flags`.
    pub fn flags(&self) -> FlagsView {
        let file = lock(&self.control.file).gate.clone();
        let o = self.control.overrides();
        let snap = self.snapshot();
        let view = |value: bool, ov: Option<bool>, config: bool| FlagView {
            value,
            override_value: ov,
            config,
        };
        let classes = snap
            .classes
            .iter()
            .filter(|c| !c.overflow && !c.retired)
            .map(|c| {
                let config = file
                    .classes
                    .iter()
                    .find(|f| f.name == c.name)
                    .is_none_or(|f| f.enabled);
                (
                    c.name.clone(),
                    ClassFlags {
                        enabled: view(c.enabled, o.enabled.get(&c.name).copied(), config),
                        draining: c.draining,
                    },
                )
            })
            .collect();
        FlagsView {
            admit_always: view(snap.admit_always, o.admit_always, file.admit_always),
            shadow: view(snap.shadow, o.shadow, file.shadow),
            classes,
            unlabeled_suspended: snap.unlabeled_suspended,
            config_generation: self.control.generation(),
        }
    }

    /// Cluster mode: hand the overrides in force to the lease thread, which writes them to
    /// Redis for every replica (serialised under `serial`, so the last change wins).
    fn publish_overrides(&self) {
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
            self.flag_line("admit_always", None, json_flag(new.admit_always), actor);
        }
        if new.shadow != old.shadow {
            let config = lock(&self.control.file).gate.shadow;
            lock(&self.control.overrides).shadow = new.shadow;
            let effective = new.shadow.unwrap_or(config);
            self.with_core(|st, _, _| st.gate.set_shadow(effective));
            self.flag_line("shadow", None, json_flag(new.shadow), actor);
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
            self.flag_line("enabled", Some(class), json_flag(value), actor);
        }
    }

    /// Set (or with `None`, return to the file's value) the `admit_always` rollback flag.
    pub fn set_admit_always(&self, value: Option<bool>, actor: &str) -> FlagView {
        let _serial = lock(&self.control.serial);
        let config = lock(&self.control.file).gate.admit_always;
        lock(&self.control.overrides).admit_always = value;
        let effective = value.unwrap_or(config);
        self.with_core(|st, _, _| st.gate.set_admit_always(effective));
        self.flag_line("admit_always", None, json_flag(value), actor);
        self.publish_overrides();
        FlagView {
            value: effective,
            override_value: value,
            config,
        }
    }

    /// Set (or with `None`, return to the file's value) shadow mode.
    pub fn set_shadow(&self, value: Option<bool>, actor: &str) -> FlagView {
        let _serial = lock(&self.control.serial);
        let config = lock(&self.control.file).gate.shadow;
        lock(&self.control.overrides).shadow = value;
        let effective = value.unwrap_or(config);
        self.with_core(|st, _, _| st.gate.set_shadow(effective));
        self.flag_line("shadow", None, json_flag(value), actor);
        self.publish_overrides();
        FlagView {
            value: effective,
            override_value: value,
            config,
        }
    }

    /// Switch a class on or off (or with `None`, back to the file's `enabled`). Queued work
    /// of a disabled class stays queued; drain it to cancel it.
    pub fn set_class_enabled(
        &self,
        class: &str,
        value: Option<bool>,
        actor: &str,
    ) -> Result<FlagView, ControlError> {
        let _serial = lock(&self.control.serial);
        let config = lock(&self.control.file)
            .gate
            .classes
            .iter()
            .find(|c| c.name == class)
            .is_none_or(|c| c.enabled);
        let effective = value.unwrap_or(config);
        self.with_core(|st, _, _| {
            let id = st
                .gate
                .class_by_name(class)
                .ok_or_else(|| unknown_class(&st.gate, class))?;
            st.gate.set_class_enabled(id, effective);
            Ok(())
        })?;
        {
            let mut o = lock(&self.control.overrides);
            match value {
                Some(v) => o.enabled.insert(class.to_string(), v),
                None => o.enabled.remove(class),
            };
        }
        self.flag_line("enabled", Some(class), json_flag(value), actor);
        self.publish_overrides();
        Ok(FlagView {
            value: effective,
            override_value: value,
            config,
        })
    }

    /// Drain classes (seed 002): refuse their new work, optionally refuse unlabeled work,
    /// and with `cancel` drop their queued jobs and cancel their in-flight requests upstream.
    pub fn drain(
        &self,
        classes: &[String],
        cancel: bool,
        unlabeled: bool,
        actor: &str,
    ) -> Result<DrainStatus, ControlError> {
        let status = self.with_core(|st, now, lines| {
            let mut ids = Vec::new();
            for name in classes {
                ids.push(
                    st.gate
                        .class_by_name(name)
                        .ok_or_else(|| unknown_class(&st.gate, name))?,
                );
            }
            if unlabeled {
                st.gate.suspend_unlabeled(true);
            }
            let running = st.gate.drain(now, &ids, cancel);
            // Cancel the running ones: their request futures or response bodies see the
            // abort and end the job through their guard (a `cancel` line, reason `drained`).
            for id in running {
                if let Some(tx) = st.waiting.get_mut(&id).and_then(|w| w.abort.take()) {
                    let _ = tx.send(Reason::Drained);
                }
            }
            self.control.drain_pending.store(true, Ordering::Relaxed);
            self.control.idle_pending.store(true, Ordering::Relaxed);
            let mut line = Self::event_line("flag", "drain", actor);
            line.flag = Some("drain".into());
            line.value = Some(serde_json::json!({
                "classes": classes, "cancel": cancel, "unlabeled": unlabeled,
            }));
            lines.push(line);
            Ok(st.gate.drain_status())
        })?;
        Ok(status)
    }

    /// End drains. `None`: every drain ends, the drained classes admit again and unlabeled
    /// work too. `Some(classes)`: only those classes' drains end (naming one that is not
    /// drained changes nothing), and the unlabeled suspension only with `unlabeled`.
    pub fn end_drain(
        &self,
        classes: Option<&[String]>,
        unlabeled: bool,
        actor: &str,
    ) -> Result<DrainStatus, ControlError> {
        self.with_core(|st, _, lines| {
            let draining: Vec<String> = st
                .gate
                .drain_status()
                .classes
                .into_iter()
                .map(|c| c.name)
                .collect();
            let ending: Vec<String> = match classes {
                None => draining,
                Some(named) => {
                    for name in named {
                        if st.gate.class_by_name(name).is_none() {
                            return Err(unknown_class(&st.gate, name));
                        }
                    }
                    draining.into_iter().filter(|d| named.contains(d)).collect()
                }
            };
            let ids: Vec<_> = ending
                .iter()
                .filter_map(|n| st.gate.class_by_name(n))
                .collect();
            st.gate.end_drain(&ids);
            let unlabeled = classes.is_none() || unlabeled;
            if unlabeled {
                st.gate.suspend_unlabeled(false);
            }
            if st.gate.drain_status().classes.is_empty() {
                self.control.drain_pending.store(false, Ordering::Relaxed);
                self.control.idle_pending.store(false, Ordering::Relaxed);
            }
            let mut line = Self::event_line("flag", "undrain", actor);
            line.flag = Some("undrain".into());
            line.value = Some(serde_json::json!({ "classes": ending, "unlabeled": unlabeled }));
            lines.push(line);
            Ok(st.gate.drain_status())
        })
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
            let mut line = Self::event_line("flag", "drain_idle", "gate");
            line.flag = Some("drain".into());
            line.value = Some(serde_json::json!({
                "drained": true,
                "idle": status.idle,
                "classes": status.classes.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
            }));
            lines.push(line);
        });
    }

    /// Where the drain stands.
    pub fn drain_status(&self) -> DrainStatus {
        self.with_core(|st, _, _| st.gate.drain_status())
    }

    /// Read the config source again and apply it (SIGHUP, `POST /admin/reload`). An invalid
    /// config is refused, logged, and changes nothing.
    pub fn reload_from_source(&self, actor: &str) -> Result<ReloadOutcome, ControlError> {
        let Some(source) = self.control.source() else {
            return Err(ControlError::NoConfigFile);
        };
        match std::fs::read_to_string(&source.path) {
            Ok(text) => self.reload_text(&source, &text, actor),
            Err(e) => {
                let why = format!("cannot read {}: {e}", source.path.display());
                self.reload_refused_text(&why, actor);
                Err(ControlError::InvalidConfig(why))
            }
        }
    }

    /// Parse `text` the way `source` does and apply it.
    pub fn reload_text(
        &self,
        source: &ConfigSource,
        text: &str,
        actor: &str,
    ) -> Result<ReloadOutcome, ControlError> {
        for w in crate::Config::deprecations(text) {
            eprintln!("slackgate: warning: {}: {w}", source.path.display());
        }
        match (source.parse)(text) {
            Ok(cfg) => self.reload(cfg, actor),
            Err(e) => {
                let why = format!("{}: {e}", source.path.display());
                self.reload_refused_text(&why, actor);
                Err(ControlError::InvalidConfig(why))
            }
        }
    }

    /// Log (and print) a refused reload: the previous config stays in force.
    pub fn reload_refused_text(&self, why: &str, actor: &str) {
        eprintln!("slackgate: config reload refused, the previous config stays in force: {why}");
        let mut line = Self::event_line("reload", "config_rejected", actor);
        line.message = Some(why.to_string());
        self.log_events(vec![line]);
    }

    /// Apply a new configuration to the running gate, keeping queued and in-flight work
    /// (see the core's `reconfigure`) and the runtime overrides.
    pub fn reload(&self, cfg: Config, actor: &str) -> Result<ReloadOutcome, ControlError> {
        let _serial = lock(&self.control.serial);
        let refuse = |why: String| {
            self.reload_refused_text(&why, actor);
            Err(ControlError::InvalidConfig(why))
        };
        if let Err(e) = cfg.validate() {
            return refuse(format!("invalid configuration: {e}"));
        }
        let old = lock(&self.control.file).clone();
        if cfg.admin.token_file != old.admin.token_file || cfg.admin.token_file.is_some() {
            if let Err(e) = self.control.load_token(&cfg) {
                return refuse(e);
            }
        }
        // Read CA files and API keys before touching the core: a reload that cannot build
        // its transports is refused whole.
        let transports = match self.transports.prepare(&cfg.gate.pools) {
            Ok(t) => t,
            Err(e) => return refuse(format!("invalid configuration: {e}")),
        };
        let gate_cfg = {
            let mut o = lock(&self.control.overrides);
            // Overrides of classes the new file no longer has are forgotten.
            o.enabled
                .retain(|name, _| cfg.gate.classes.iter().any(|c| &c.name == name));
            o.apply(cfg.gate.clone())
        };
        let applied = self.with_core(|st, now, _| {
            let report = st.gate.reconfigure(now, gate_cfg)?;
            st.upstreams = pool_upstreams(&st.gate);
            Ok::<_, slackgate_core::ConfigError>(report)
        });
        let changes = match applied {
            Ok(r) => r,
            Err(e) => return refuse(format!("invalid configuration: {e}")),
        };
        // Only once the core took the new config: a refused reload leaves the old transports
        // in force.
        self.transports.install(transports);
        let mut restart_required = Vec::new();
        if cfg.server != old.server {
            restart_required.push("server".to_string());
        }
        if cfg.log != old.log {
            restart_required.push("log".to_string());
        }
        if cfg.cluster != old.cluster {
            restart_required.push("cluster".to_string());
        }
        if cfg.admin.listen != old.admin.listen
            || cfg.admin.allow_remote != old.admin.allow_remote
            || cfg.admin.insecure_remote != old.admin.insecure_remote
        {
            restart_required.push("admin.listen".to_string());
        }
        if cfg.admin.max_connections != old.admin.max_connections
            || cfg.admin.max_connections_per_addr != old.admin.max_connections_per_addr
        {
            restart_required.push("admin.max_connections".to_string());
        }
        *lock(&self.control.file) = cfg;
        let generation = self.control.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let outcome = ReloadOutcome {
            generation,
            changes,
            restart_required,
        };
        let mut line = Self::event_line("reload", "config_reloaded", actor);
        line.message = serde_json::to_string(&outcome).ok();
        self.log_events(vec![line]);
        if !outcome.restart_required.is_empty() {
            eprintln!(
                "slackgate: config reloaded (generation {generation}); changes to {} apply after a restart",
                outcome.restart_required.join(", ")
            );
        }
        Ok(outcome)
    }

    /// Start the shutdown: refuse new work, and tell every queued request that cannot
    /// finish within `grace_ms` now (`shutting_down`). Work that fits keeps running.
    pub fn begin_shutdown(&self, grace_ms: u64) {
        self.with_core(|st, now, lines| {
            st.gate.begin_shutdown(now, now.saturating_add(grace_ms));
            let mut line = Self::event_line("shutdown", "shutting_down", "signal");
            line.message = Some(format!(
                "draining: {} queued or in flight, grace {grace_ms} ms",
                st.gate.live_jobs()
            ));
            lines.push(line);
        });
    }

    /// The grace period is over: cancel every request still running (`shutting_down`).
    pub fn cut_off(&self) {
        self.control.cutting_off.store(true, Ordering::Relaxed);
        self.with_core(|st, _, _| {
            for w in st.waiting.values_mut() {
                if let Some(tx) = w.abort.take() {
                    let _ = tx.send(Reason::ShuttingDown);
                }
            }
        });
    }
}

fn json_flag(v: Option<bool>) -> serde_json::Value {
    v.map_or(serde_json::Value::Null, serde_json::Value::Bool)
}

fn unknown_class(gate: &Gate, name: &str) -> ControlError {
    ControlError::UnknownClass(name.to_string(), gate.class_names().join(", "))
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
