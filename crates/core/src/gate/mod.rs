//! The admission gate: decisions at arrival, dispatch order, drops, completions.
//!
//! One [`Gate`] holds every pool and class. Callers feed it inputs with the current time and
//! perform what comes out:
//!
//! - [`Gate::offer`] decides at arrival: admit (the job is queued) or reject with a reason.
//! - [`Gate::poll`] yields [`Event`]s: `Dispatch` (send this job upstream now) or `Drop` (tell
//!   this queued job's client it cannot make its deadline). Call it after every input.
//! - [`Gate::on_complete`] / [`Gate::cancel`] end a job and free its slot exactly once.
//! - [`Gate::tick`] lets time pass: queued jobs whose slack died while they waited are dropped
//!   at once, not at their timeout.
//!
//! Projected wait is kept O(classes) per decision: each class queue keeps a running sum of its
//! estimated work, so the wait for priority `p` is the in-flight remainder plus the queued work
//! of classes at priority `>= p`, spread over the pool's slots.

use crate::config::{
    ConfigError, GateConfig, LimitsConfig, OverflowMode, PriorConfig, DEFAULT_CONTEXT_TOKENS,
};
use crate::estimator::{
    ErrorSummary, ErrorTracker, Estimate, Estimator, EstimatorSnapshot, Sharing,
};
use crate::ledger::{
    HoldRecord, Ledger, LedgerReject, SettleError, Settlement, GENERATED_KEY_PREFIX,
};
use crate::reason::{Action, Reason};
use crate::tokens::TokenCounter;
use crate::Millis;
use queue::{ClassQueue, QueueKey};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// The admission core. See the module docs for the calling protocol.
#[derive(Debug)]
pub struct Gate {
    cfg: GateConfig,
    classes: Vec<LaneState>,
    pools: Vec<PoolState>,
    labels: HashMap<String, LaneId>,
    default_class: Option<LaneId>,
    jobs: HashMap<JobId, Job, IdHash>,
    events: VecDeque<Event>,
    next_id: u64,
    last_now: Millis,
    ledger: Ledger,
    /// Ledger records changed since the caller last took them (to persist).
    ledger_out: Vec<HoldRecord>,
    /// Live jobs by idempotency key.
    keys: HashMap<crate::ledger::Shared, JobId>,
    /// Prefix of generated keys, unique per process start (set by the caller).
    key_prefix: String,
    /// The empty key of a decision without one (shared: a refusal allocates nothing).
    no_key: crate::ledger::Shared,
    /// Dispatch's list of jobs the tenant headroom passed over, kept between calls.
    passed_scratch: Vec<JobId>,
    /// Shutting down: nothing new is admitted, and queued work must finish by this time.
    closing_at: Option<Millis>,
    /// A drain suspended the default class: unlabeled work is refused.
    unlabeled_suspended: bool,
    /// Each pool's slots are split this many ways ([`Gate::set_capacity_share`]).
    share_parts: u32,
    /// Written into every hold this gate places (cluster mode).
    hold_owner: Option<String>,
}

impl Gate {
    /// Build a gate from a validated configuration.
    pub fn new(cfg: GateConfig) -> Result<Gate, ConfigError> {
        cfg.validate()?;
        let mut g = Gate {
            cfg: GateConfig {
                pools: Vec::new(),
                classes: Vec::new(),
                ..cfg.clone()
            },
            classes: Vec::new(),
            pools: Vec::new(),
            labels: HashMap::new(),
            default_class: None,
            jobs: HashMap::default(),
            events: VecDeque::new(),
            next_id: 1,
            last_now: 0,
            ledger: Ledger::new(cfg.ledger.clone()),
            ledger_out: Vec::new(),
            keys: HashMap::new(),
            key_prefix: GENERATED_KEY_PREFIX.into(),
            no_key: crate::ledger::Shared::from(""),
            passed_scratch: Vec::new(),
            closing_at: None,
            unlabeled_suspended: false,
            share_parts: 1,
            hold_owner: None,
        };
        // Building is a reconfiguration of an empty gate: every pool and lane is new.
        g.reconfigure(0, cfg)?;
        Ok(g)
    }

    /// The configuration in force.
    pub fn config(&self) -> &GateConfig {
        &self.cfg
    }

    /// Resolve a client's class label (name or alias, case-insensitive). Missing or unknown
    /// labels get the default class, or `None` when there is none (`reject_unlabeled`).
    pub fn classify(&self, label: Option<&str>) -> Option<LaneId> {
        label
            .and_then(|l| self.labels.get(&l.trim().to_ascii_lowercase()).copied())
            .or(self.default_class.filter(|_| !self.unlabeled_suspended))
    }

    /// Canonical name of a class.
    pub fn class_name(&self, class: LaneId) -> &str {
        self.classes.get(class.0).map_or("", |c| c.name.as_str())
    }

    /// A class's default deadline (ms after arrival), if it has one.
    pub fn class_deadline_ms(&self, class: LaneId) -> Option<u64> {
        self.classes
            .get(class.0)
            .and_then(|c| c.default_deadline_ms)
    }

    /// Name of a pool.
    pub fn pool_name(&self, pool: PoolId) -> &str {
        self.pools.get(pool.0).map_or("", |p| p.name.as_str())
    }

    /// Where a rejected client of a class should go instead: its configured `retry_hint`,
    /// or else the name of its overflow pool.
    pub fn retry_hint(&self, class: LaneId) -> Option<&str> {
        let c = self.classes.get(class.0)?;
        c.retry_hint.as_deref().or_else(|| {
            c.overflow
                .and_then(|(lane, _)| self.classes.get(lane.0))
                .map(|l| self.pool_name(l.pool))
        })
    }

    /// Set the `admit_always` rollback flag.
    pub fn set_admit_always(&mut self, on: bool) {
        self.cfg.admit_always = on;
    }

    /// Switch a class on or off. Queued work of a disabled class stays queued.
    pub fn set_class_enabled(&mut self, class: LaneId, enabled: bool) {
        if let Some(c) = self.classes.get_mut(class.0) {
            c.enabled = enabled;
            let name = c.name.clone();
            if let Some(cc) = self.cfg.classes.iter_mut().find(|cc| cc.name == name) {
                cc.enabled = enabled;
            }
        }
    }

    /// Jobs queued or in flight (admitted and not yet ended).
    pub fn live_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Time never runs backwards inside the core, whatever the caller passes.
    pub(super) fn clock(&mut self, now: Millis) -> Millis {
        self.last_now = self.last_now.max(now);
        self.last_now
    }

    /// The class a lane belongs to (itself for a primary lane).
    pub(super) fn home(&self, lane: LaneId) -> LaneId {
        self.classes
            .get(lane.0)
            .and_then(|c| c.overflow_of)
            .unwrap_or(lane)
    }

    /// The output a request of `class` is expected to produce: the class's learned mean
    /// (capped by its `max_tokens`), else, before anything is learned, its `max_tokens` up to
    /// `limits.unlearned_output_tokens`, else the prior's default; never more than `cap`, what
    /// the servers can produce for it (see [`Gate::bound_request`]).
    pub(super) fn expected_output(&self, class: LaneId, max_tokens: Option<u32>, cap: u32) -> u32 {
        let c = &self.classes[self.home(class).0];
        let pool = &self.pools[c.pool.0];
        let learned = c
            .expected_output
            .map(|v| v.round().clamp(0.0, f64::from(u32::MAX)) as u32);
        let expected = match (learned, max_tokens) {
            (Some(l), Some(m)) => l.min(m),
            (Some(l), None) => l,
            (None, Some(m)) => m.min(pool.limits.unlearned_output_tokens),
            (None, None) => pool.default_output_tokens,
        };
        expected.min(cap)
    }
}

mod admission;
mod capacity;
mod dispatch;
mod displacement;
#[cfg(test)]
mod displacement_tests;
mod endpoints;
#[cfg(test)]
mod endpoints_tests;
mod evaluate;
mod fairness;
mod forecast;
#[cfg(test)]
mod forecast_tests;
mod headroom;
#[cfg(test)]
mod headroom_tests;
mod holds;
mod learning;
#[cfg(test)]
mod learning_tests;
mod limits;
#[cfg(test)]
mod limits_tests;
pub mod ops;
#[cfg(test)]
mod ops_tests;
mod projection;
mod queue;
pub mod reconfigure;
mod retry;
mod snapshot;
mod state;
pub(crate) mod tenants;
#[cfg(test)]
mod tenants_tests;
#[cfg(test)]
mod tests;
mod types;

pub use endpoints::EndpointView;
use evaluate::*;
use forecast::*;
use learning::*;
use projection::*;
pub use snapshot::{ClassSnapshot, GateSnapshot, PoolSnapshot, TENANTS_SHOWN};
use state::*;
pub use tenants::TenantStats;
pub use types::*;
