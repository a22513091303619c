//! slackgate under simulation: the very admission core the live gateway runs
//! ([`slackgate_core::Gate`]), configured from the scenario, with the engine standing in for
//! the gateway: it offers requests, performs dispatches and drops, reports completions with
//! their token usage, and cancels the jobs of clients that gave up.

use crate::policy::{Action, Job, Policy, Verdict};
use crate::scenario::{RetryMode, Scenario};
use slackgate_core::config::{ClassConfig, GateConfig, PoolConfig, PriorConfig};
use slackgate_core::{Completion, ConfigError, Event, Gate, JobId, LaneId, Request};
use std::collections::HashMap;

/// The core, driven by the simulator.
pub struct Slackgate {
    gate: Gate,
    /// `slackgate`, or `admit-always` with the rollback flag set.
    name: &'static str,
    /// Pass each request's noisy output length to the core (the scenario's `size_hint`).
    size_hint: bool,
    cancel_abandoned: bool,
    /// Classes whose clients retry: their requests carry an idempotency key so a retry is
    /// recognised as the same request (attempt counting, never held twice).
    keyed: Vec<bool>,
    to_core: HashMap<u64, JobId>,
    to_sim: HashMap<JobId, u64>,
    /// Core operations since the ledger's records were last drained.
    since_drain: u32,
    /// The scenario's tenants' names, by index: their fairness ids.
    tenants: Vec<String>,
}

/// The gate configuration a scenario implies: one pool with the upstream's slots and its true
/// cost model as the estimator's prior, one gate class per scenario class.
pub fn gate_config(s: &Scenario) -> GateConfig {
    let u = &s.upstream;
    let pool = PoolConfig {
        name: "upstream".into(),
        slots: u.slots,
        max_depth_factor: s.slackgate.max_depth_factor,
        max_queued: PoolConfig::default()
            .max_queued
            .max(u.slots.saturating_mul(64)),
        prior: if s.slackgate.default_priors {
            PriorConfig {
                learn: s.slackgate.learn,
                ..PriorConfig::default()
            }
        } else {
            PriorConfig {
                overhead_ms: u.overhead_ms,
                prefill_ms_per_token: u.prefill_ms_per_token,
                decode_ms_per_token: u.decode_ms_per_token,
                // The scenario's batching model (0 for the linear upstream, whose own
                // `concurrency_slowdown` only slows decoding, fixed at start).
                decode_ms_per_1k_context: u.decode_ms_per_1k_context,
                batch_slowdown: u.batch_slowdown,
                learn: s.slackgate.learn,
                ..PriorConfig::default()
            }
        },
        upstream: None,
        forecast_window_ms: s
            .slackgate
            .forecast_window_ms
            .unwrap_or(PoolConfig::default().forecast_window_ms),
        forecast_refused_weight: s
            .slackgate
            .forecast_refused_weight
            .unwrap_or(PoolConfig::default().forecast_refused_weight),
        headroom: s.slackgate.headroom.unwrap_or_default(),
        promise_guard_ms: s
            .slackgate
            .promise_guard_ms
            .unwrap_or(PoolConfig::default().promise_guard_ms),
        ..PoolConfig::default()
    };
    let classes = s
        .classes
        .iter()
        .map(|c| ClassConfig {
            name: c.name.clone(),
            priority: c.priority,
            deadline_ms: c.deadline_ms,
            max_queue_age_ms: c.max_queue_age_ms,
            displace_within_ms: c.displace_within_ms,
            forecast: s.slackgate.forecast,
            pool: "upstream".into(),
            ..ClassConfig::default()
        })
        .collect();
    let mut fairness = slackgate_core::config::FairnessConfig::default();
    for t in &s.tenants {
        fairness.weights.insert(t.name.clone(), t.weight);
    }
    if let Some(idle) = s.slackgate.tenant_headroom_max_idle {
        fairness.headroom_max_idle = idle;
    }
    GateConfig {
        pools: vec![pool],
        classes,
        default_class: None,
        fairness,
        ..GateConfig::default()
    }
}

impl Slackgate {
    /// A gate for the scenario.
    pub fn new(s: &Scenario) -> Result<Slackgate, ConfigError> {
        Slackgate::with_config(s, gate_config(s))
    }

    /// The same gate with the `admit_always` rollback flag set: every request is admitted and
    /// queued by priority, nothing is dropped, clients that give up are still cancelled. This
    /// is what `slackgate drill` runs as "gate off".
    pub fn admit_always(s: &Scenario) -> Result<Slackgate, ConfigError> {
        let mut cfg = gate_config(s);
        cfg.admit_always = true;
        Slackgate::with_config(s, cfg)
    }

    /// The gate with displacement on (`slackgate-displace`): every class with a deadline may
    /// swap a longer queued request admitted within its `displace_within_ms` (default: its
    /// deadline) for a shorter newcomer that does not fit otherwise.
    pub fn displacing(s: &Scenario) -> Result<Slackgate, ConfigError> {
        let mut cfg = gate_config(s);
        for (c, spec) in cfg.classes.iter_mut().zip(&s.classes) {
            c.displace_within_ms = spec.displace_within_ms.or(spec.deadline_ms);
        }
        let mut g = Slackgate::with_config(s, cfg)?;
        g.name = "slackgate-displace";
        Ok(g)
    }

    /// The gate without `[fairness]` (`slackgate-unfair`): every tenant in one bucket, as
    /// before tenants had shares; the comparison for the fairness figures.
    pub fn unfair(s: &Scenario) -> Result<Slackgate, ConfigError> {
        let mut cfg = gate_config(s);
        cfg.fairness = Default::default();
        let mut g = Slackgate::with_config(s, cfg)?;
        g.name = "slackgate-unfair";
        Ok(g)
    }

    /// The gate with `[fairness]` but no tenant headroom (`slackgate-work-conserving`):
    /// shares held at admission only, every free slot taken at dispatch.
    pub fn work_conserving(s: &Scenario) -> Result<Slackgate, ConfigError> {
        let mut cfg = gate_config(s);
        cfg.fairness.headroom_max_idle = 0.0;
        let mut g = Slackgate::with_config(s, cfg)?;
        g.name = "slackgate-work-conserving";
        Ok(g)
    }

    /// A gate with an explicit configuration (tests, tuning).
    pub fn with_config(s: &Scenario, cfg: GateConfig) -> Result<Slackgate, ConfigError> {
        let name = if cfg.admit_always {
            "admit-always"
        } else {
            "slackgate"
        };
        let gate = Gate::new(cfg)?;
        Ok(Slackgate {
            gate,
            name,
            size_hint: s.size_hint,
            cancel_abandoned: s.cancel_on_disconnect,
            keyed: s
                .classes
                .iter()
                .map(|c| c.retry != RetryMode::None)
                .collect(),
            to_core: HashMap::new(),
            to_sim: HashMap::new(),
            since_drain: 0,
            tenants: s.tenants.iter().map(|t| t.name.clone()).collect(),
        })
    }

    fn forget(&mut self, core: JobId) -> Option<u64> {
        let id = self.to_sim.remove(&core)?;
        self.to_core.remove(&id);
        Some(id)
    }

    /// The core keeps ledger records for a store to persist; the simulator has none, so
    /// drop them now and then instead of letting them pile up.
    fn drain_ledger(&mut self) {
        self.since_drain += 1;
        if self.since_drain >= 1024 {
            self.since_drain = 0;
            drop(self.gate.take_ledger_records());
        }
    }

    fn pump(&mut self, now: u64, out: &mut Vec<Action>) {
        while let Some(ev) = self.gate.poll(now) {
            match ev {
                Event::Dispatch { job_id, .. } => {
                    if let Some(&id) = self.to_sim.get(&job_id) {
                        out.push(Action::Dispatch(id));
                    }
                }
                Event::Drop { job_id, reason, .. } => {
                    if let Some(id) = self.forget(job_id) {
                        out.push(Action::Drop(id, reason.as_str()));
                    }
                }
            }
        }
    }
}

impl Policy for Slackgate {
    fn name(&self) -> &str {
        self.name
    }

    fn offer(&mut self, now: u64, job: &Job, _in_flight: u32) -> Verdict {
        self.drain_ledger();
        let req = Request {
            class: Some(LaneId(job.class)),
            deadline: job.deadline_ms,
            prompt_tokens: job.prompt_tokens,
            max_tokens: Some(job.max_tokens),
            expected_output_tokens: self.size_hint.then_some(job.expected_output_tokens),
            idempotency_key: self
                .keyed
                .get(job.class)
                .copied()
                .unwrap_or(false)
                .then(|| format!("r{}", job.request)),
            attempt: job.attempt,
            fairness_id: job.tenant.and_then(|t| self.tenants.get(t).cloned()),
            ..Request::default()
        };
        let d = self.gate.offer(now, req);
        if d.admitted() {
            self.to_core.insert(job.id, d.job_id);
            self.to_sim.insert(d.job_id, job.id);
            Verdict::Admit
        } else {
            Verdict::Reject {
                reason: d.reason.as_str(),
                retry_after_ms: d.retry_after_ms,
            }
        }
    }

    fn next(&mut self, now: u64, _free: u32, out: &mut Vec<Action>) {
        self.pump(now, out);
    }

    fn on_complete(&mut self, now: u64, id: u64, _service_ms: u64, output_tokens: u32) {
        self.drain_ledger();
        if let Some(core) = self.to_core.get(&id).copied() {
            self.forget(core);
            self.gate.on_complete(
                now,
                core,
                Completion {
                    ok: true,
                    prompt_tokens: None,
                    completion_tokens: Some(output_tokens),
                },
            );
        }
    }

    fn on_fail(&mut self, now: u64, id: u64, _service_ms: u64) {
        self.drain_ledger();
        if let Some(core) = self.to_core.get(&id).copied() {
            self.forget(core);
            let failed = Completion {
                ok: false,
                prompt_tokens: None,
                completion_tokens: None,
            };
            self.gate.on_complete(now, core, failed);
        }
    }

    fn on_abandon(&mut self, now: u64, id: u64) -> bool {
        if !self.cancel_abandoned {
            return false;
        }
        if let Some(core) = self.to_core.get(&id).copied() {
            self.forget(core);
            self.gate.cancel(now, core);
        }
        true
    }

    fn tick(&mut self, now: u64, out: &mut Vec<Action>) {
        self.gate.tick(now);
        self.pump(now, out);
    }
}
