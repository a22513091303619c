//! Operator controls of a running gate: runtime flags, drains, config reloads and the
//! shutdown sequence. The admin API ([`crate::ops::admin`]), the config watcher and the signal
//! handlers call these; each change goes through the core under its lock and is written to
//! the decision log as one line (`flag`, `reload`, `shutdown`), which `/metrics` counts too.
//! The state they change is [`crate::engine::controls`].

use crate::config::Config;
pub use crate::engine::controls::{
    constant_time_eq, ConfigParser, ConfigSource, Control, Overrides, MIN_TOKEN_LEN,
};
use crate::engine::controls::{json_flag, lock, pool_upstreams};
use crate::engine::state::Shared;
use crate::observe::codes::{Event, LineAction};
use serde::Serialize;
use slackgate_core::{DrainStatus, Gate, Reason, ReconfigureReport};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

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

/// `GET /admin/flags`.
pub fn flags(shared: &Shared) -> FlagsView {
    let file = lock(&shared.control.file).gate.clone();
    let o = shared.control.overrides();
    let snap = shared.snapshot();
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
        config_generation: shared.control.generation(),
    }
}

/// Set (or with `None`, return to the file's value) the `admit_always` rollback flag.
pub fn set_admit_always(shared: &Shared, value: Option<bool>, actor: &str) -> FlagView {
    let _serial = lock(&shared.control.serial);
    let config = lock(&shared.control.file).gate.admit_always;
    lock(&shared.control.overrides).admit_always = value;
    let effective = value.unwrap_or(config);
    shared.with_core(|st, _, _| st.gate.set_admit_always(effective));
    shared.flag_line(Event::AdmitAlways, None, json_flag(value), actor);
    shared.publish_overrides();
    FlagView {
        value: effective,
        override_value: value,
        config,
    }
}

/// Set (or with `None`, return to the file's value) shadow mode.
pub fn set_shadow(shared: &Shared, value: Option<bool>, actor: &str) -> FlagView {
    let _serial = lock(&shared.control.serial);
    let config = lock(&shared.control.file).gate.shadow;
    lock(&shared.control.overrides).shadow = value;
    let effective = value.unwrap_or(config);
    shared.with_core(|st, _, _| st.gate.set_shadow(effective));
    shared.flag_line(Event::Shadow, None, json_flag(value), actor);
    shared.publish_overrides();
    FlagView {
        value: effective,
        override_value: value,
        config,
    }
}

/// Switch a class on or off (or with `None`, back to the file's `enabled`). Queued work
/// of a disabled class stays queued; drain it to cancel it.
pub fn set_class_enabled(
    shared: &Shared,
    class: &str,
    value: Option<bool>,
    actor: &str,
) -> Result<FlagView, ControlError> {
    let _serial = lock(&shared.control.serial);
    let config = lock(&shared.control.file)
        .gate
        .classes
        .iter()
        .find(|c| c.name == class)
        .is_none_or(|c| c.enabled);
    let effective = value.unwrap_or(config);
    shared.with_core(|st, _, _| {
        let id = st
            .gate
            .class_by_name(class)
            .ok_or_else(|| unknown_class(&st.gate, class))?;
        st.gate.set_class_enabled(id, effective);
        Ok(())
    })?;
    {
        let mut o = lock(&shared.control.overrides);
        match value {
            Some(v) => o.enabled.insert(class.to_string(), v),
            None => o.enabled.remove(class),
        };
    }
    shared.flag_line(Event::Enabled, Some(class), json_flag(value), actor);
    shared.publish_overrides();
    Ok(FlagView {
        value: effective,
        override_value: value,
        config,
    })
}

/// Drain classes (seed 002): refuse their new work, optionally refuse unlabeled work,
/// and with `cancel` drop their queued jobs and cancel their in-flight requests upstream.
pub fn drain(
    shared: &Shared,
    classes: &[String],
    cancel: bool,
    unlabeled: bool,
    actor: &str,
) -> Result<DrainStatus, ControlError> {
    let status = shared.with_core(|st, now, lines| {
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
        shared.control.drain_pending.store(true, Ordering::Relaxed);
        shared.control.idle_pending.store(true, Ordering::Relaxed);
        let mut line = Shared::event_line(LineAction::Flag, Event::Drain, actor);
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
    shared: &Shared,
    classes: Option<&[String]>,
    unlabeled: bool,
    actor: &str,
) -> Result<DrainStatus, ControlError> {
    shared.with_core(|st, _, lines| {
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
            shared.control.drain_pending.store(false, Ordering::Relaxed);
            shared.control.idle_pending.store(false, Ordering::Relaxed);
        }
        let mut line = Shared::event_line(LineAction::Flag, Event::Undrain, actor);
        line.flag = Some("undrain".into());
        line.value = Some(serde_json::json!({ "classes": ending, "unlabeled": unlabeled }));
        lines.push(line);
        Ok(st.gate.drain_status())
    })
}

/// Where the drain stands.
pub fn drain_status(shared: &Shared) -> DrainStatus {
    shared.with_core(|st, _, _| st.gate.drain_status())
}

/// Read the config source again and apply it (SIGHUP, `POST /admin/reload`). An invalid
/// config is refused, logged, and changes nothing.
pub fn reload_from_source(shared: &Shared, actor: &str) -> Result<ReloadOutcome, ControlError> {
    let Some(source) = shared.control.source() else {
        return Err(ControlError::NoConfigFile);
    };
    match std::fs::read_to_string(&source.path) {
        Ok(text) => reload_text(shared, &source, &text, actor),
        Err(e) => {
            let why = format!("cannot read {}: {e}", source.path.display());
            reload_refused_text(shared, &why, actor);
            Err(ControlError::InvalidConfig(why))
        }
    }
}

/// Parse `text` the way `source` does and apply it.
pub fn reload_text(
    shared: &Shared,
    source: &ConfigSource,
    text: &str,
    actor: &str,
) -> Result<ReloadOutcome, ControlError> {
    for w in crate::Config::deprecations(text) {
        tracing::warn!("warning: {}: {w}", source.path.display());
    }
    match (source.parse)(text) {
        Ok(cfg) => reload(shared, cfg, actor),
        Err(e) => {
            let why = format!("{}: {e}", source.path.display());
            reload_refused_text(shared, &why, actor);
            Err(ControlError::InvalidConfig(why))
        }
    }
}

/// Log (and print) a refused reload: the previous config stays in force.
pub fn reload_refused_text(shared: &Shared, why: &str, actor: &str) {
    tracing::warn!("config reload refused, the previous config stays in force: {why}");
    let mut line = Shared::event_line(LineAction::Reload, Event::ConfigRejected, actor);
    line.message = Some(why.to_string());
    shared.log_events(vec![line]);
}

/// Apply a new configuration to the running gate, keeping queued and in-flight work
/// (see the core's `reconfigure`) and the runtime overrides.
pub fn reload(shared: &Shared, cfg: Config, actor: &str) -> Result<ReloadOutcome, ControlError> {
    let _serial = lock(&shared.control.serial);
    let refuse = |why: String| {
        reload_refused_text(shared, &why, actor);
        Err(ControlError::InvalidConfig(why))
    };
    if let Err(e) = cfg.validate() {
        return refuse(format!("invalid configuration: {e}"));
    }
    let old = lock(&shared.control.file).clone();
    if cfg.admin.token_file != old.admin.token_file || cfg.admin.token_file.is_some() {
        if let Err(e) = shared.control.load_token(&cfg) {
            return refuse(e.to_string());
        }
    }
    // Read CA files and API keys before touching the core: a reload that cannot build
    // its transports is refused whole.
    let transports = match shared.transports.prepare(&cfg.gate.pools) {
        Ok(t) => t,
        Err(e) => return refuse(format!("invalid configuration: {e}")),
    };
    let gate_cfg = {
        let mut o = lock(&shared.control.overrides);
        // Overrides of classes the new file no longer has are forgotten.
        o.enabled
            .retain(|name, _| cfg.gate.classes.iter().any(|c| &c.name == name));
        o.apply(cfg.gate.clone())
    };
    let applied = shared.with_core(|st, now, _| {
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
    shared.transports.install(transports);
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
    *lock(&shared.control.file) = cfg;
    let generation = shared.control.generation.fetch_add(1, Ordering::Relaxed) + 1;
    let outcome = ReloadOutcome {
        generation,
        changes,
        restart_required,
    };
    let mut line = Shared::event_line(LineAction::Reload, Event::ConfigReloaded, actor);
    line.message = serde_json::to_string(&outcome).ok();
    shared.log_events(vec![line]);
    if !outcome.restart_required.is_empty() {
        tracing::info!(
            "config reloaded (generation {generation}); changes to {} apply after a restart",
            outcome.restart_required.join(", ")
        );
    }
    Ok(outcome)
}

/// Start the shutdown: refuse new work, and tell every queued request that cannot
/// finish within `grace_ms` now (`shutting_down`). Work that fits keeps running.
pub fn begin_shutdown(shared: &Shared, grace_ms: u64) {
    shared.with_core(|st, now, lines| {
        st.gate.begin_shutdown(now, now.saturating_add(grace_ms));
        let mut line = Shared::event_line(LineAction::Shutdown, Reason::ShuttingDown, "signal");
        line.message = Some(format!(
            "draining: {} queued or in flight, grace {grace_ms} ms",
            st.gate.live_jobs()
        ));
        lines.push(line);
    });
}

/// The grace period is over: cancel every request still running (`shutting_down`).
pub fn cut_off(shared: &Shared) {
    shared.control.cutting_off.store(true, Ordering::Relaxed);
    shared.with_core(|st, _, _| {
        for w in st.waiting.values_mut() {
            if let Some(tx) = w.abort.take() {
                let _ = tx.send(Reason::ShuttingDown);
            }
        }
    });
}

fn unknown_class(gate: &Gate, name: &str) -> ControlError {
    ControlError::UnknownClass(name.to_string(), gate.class_names().join(", "))
}
