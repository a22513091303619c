//! Discrete-event simulator for slackgate: scenarios (the seeds' drills and real traces),
//! workloads, the upstream model, baseline admission policies, an upper bound on on-time work,
//! reports and charts. It drives the same admission core as the live gateway: slackgate's
//! policy here *is* `slackgate_core::Gate`, not a model of it.

#![forbid(unsafe_code)]

pub mod bound;
pub mod chart;
pub mod engine;
pub mod load;
pub mod matrix;
pub mod policies;
pub mod policy;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod shape;
pub mod tenants;
pub mod trace;
pub mod workload;

use policies::{
    clairvoyant::Clairvoyant, codel::Codel, fifo::Fifo, gradient::Gradient, slackgate::Slackgate,
};
use policy::Policy;
use scenario::{Scenario, ScenarioError};

/// Something that stops a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The scenario is invalid.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// The gate configuration the scenario implies is invalid.
    #[error("slackgate configuration: {0}")]
    Gate(#[from] slackgate_core::ConfigError),
    /// The scenario has a `[neighbour]`: load that bypasses the gate and takes the server's
    /// slots, which the simulator's upstream (the policy's own slots) cannot model.
    #[error("{0}: [neighbour] is load sent straight to the upstream, which the simulator does not model (its upstream is the policy's own slots); run it live with `slackgate drill`")]
    Neighbour(String),
    /// A policy name nobody knows.
    #[error("unknown policy {0:?}; known: {known}", known = scenario::known_policies().join(", "))]
    UnknownPolicy(String),
}

/// Baseline parameters, with the scenario's values or defaults derived from it.
#[derive(Clone, Debug, PartialEq)]
pub struct BaselineParams {
    /// `max-queue` cap.
    pub max_queue: usize,
    /// `seed000` age threshold (ms).
    pub seed000_max_age_ms: u64,
    /// `seed000` depth factor.
    pub seed000_depth_factor: f64,
    /// CoDel target (ms).
    pub codel_target_ms: u64,
    /// CoDel interval (ms).
    pub codel_interval_ms: u64,
    /// Gradient limits.
    pub gradient_min_limit: u32,
    /// Gradient limits.
    pub gradient_max_limit: u32,
}

impl BaselineParams {
    /// Defaults follow seed 000's own proportions: its age threshold is 25 s for a 60 s SLO,
    /// its depth factor 2; CoDel's target and interval scale the same way (a twelfth and a
    /// quarter of the tightest deadline); the queue cap is twice the slots.
    pub fn of(s: &Scenario) -> BaselineParams {
        let b = &s.baselines;
        let slo = s.tightest_deadline_ms().unwrap_or(60_000);
        let slots = s.upstream.slots;
        BaselineParams {
            max_queue: b.max_queue.unwrap_or(2 * slots as usize),
            seed000_max_age_ms: b.seed000_max_age_ms.unwrap_or(slo * 25 / 60),
            seed000_depth_factor: b.seed000_depth_factor.unwrap_or(2.0),
            codel_target_ms: b.codel_target_ms.unwrap_or((slo / 12).max(1)),
            codel_interval_ms: b.codel_interval_ms.unwrap_or((slo / 4).max(1)),
            gradient_min_limit: b.gradient_min_limit.unwrap_or(slots),
            gradient_max_limit: b.gradient_max_limit.unwrap_or(slots.saturating_mul(16)),
        }
    }
}

/// Queue cap of the CoDel baselines: generous, CoDel itself decides what to drop.
const CODEL_MAX_QUEUED: usize = 10_000;

/// A fresh policy by name.
pub fn build_policy(s: &Scenario, name: &str) -> Result<Box<dyn Policy>, SimError> {
    let p = BaselineParams::of(s);
    let cancel = s.cancel_on_disconnect;
    let slots = s.upstream.slots;
    Ok(match name {
        "none" => Box::new(Fifo::none()),
        "max-queue" => Box::new(Fifo::max_queue(p.max_queue, cancel)),
        "seed000" => Box::new(Fifo::seed000(
            p.seed000_max_age_ms,
            p.seed000_depth_factor,
            slots,
            cancel,
        )),
        "codel" => Box::new(Codel::new(
            p.codel_target_ms,
            p.codel_interval_ms,
            CODEL_MAX_QUEUED,
            cancel,
        )),
        "codel-lifo" => Box::new(Codel::adaptive_lifo(
            p.codel_target_ms,
            p.codel_interval_ms,
            CODEL_MAX_QUEUED,
            cancel,
        )),
        "gradient" => Box::new(Gradient::new(
            slots,
            p.gradient_min_limit,
            p.gradient_max_limit,
            cancel,
        )),
        "slackgate" => Box::new(Slackgate::new(s)?),
        "admit-always" => Box::new(Slackgate::admit_always(s)?),
        "slackgate-displace" => Box::new(Slackgate::displacing(s)?),
        "slackgate-unfair" => Box::new(Slackgate::unfair(s)?),
        "slackgate-work-conserving" => Box::new(Slackgate::work_conserving(s)?),
        "clairvoyant" => Box::new(Clairvoyant::new(slots)),
        "clairvoyant-firm" => Box::new(Clairvoyant::firm(slots)),
        other => return Err(SimError::UnknownPolicy(other.to_string())),
    })
}

/// The scenario over the window its requests span: a replayed trace ends when its last request
/// arrives, so rates and the offered load are over that window, not over the scenario's cap.
/// The simulator and the drill report over the same window.
pub fn windowed(s: &Scenario, arrivals: &[workload::Arrival]) -> Scenario {
    let mut w = s.clone();
    if s.arrivals.process == scenario::Process::Trace {
        if let Some(last) = arrivals.last() {
            w.duration_s = w.duration_s.min((last.at_ms + 1) as f64 / 1000.0);
        }
    }
    w
}

/// Run every named policy over the scenario (plus the clairvoyant reference for false
/// rejections, reported only if named) and summarise.
pub fn simulate(
    s: &Scenario,
    names: &[String],
) -> Result<(report::Report, Vec<engine::RunResult>), SimError> {
    simulate_with(s, names, true)
}

/// [`simulate`], optionally without the clairvoyant reference run (false rejections are then
/// not counted): the reference costs more than a policy on huge queues.
pub fn simulate_with(
    s: &Scenario,
    names: &[String],
    with_reference: bool,
) -> Result<(report::Report, Vec<engine::RunResult>), SimError> {
    if s.neighbour.is_some() {
        return Err(SimError::Neighbour(s.file.clone()));
    }
    let arrivals = workload::generate(s)?;
    let window = windowed(s, &arrivals);
    let s = &window;
    // Every name is checked before anything runs.
    let mut policies = names
        .iter()
        .map(|n| build_policy(s, n))
        .collect::<Result<Vec<_>, _>>()?;
    let runs: Vec<engine::RunResult> = policies
        .iter_mut()
        .map(|p| engine::run(s, &arrivals, p.as_mut()))
        .collect();
    // A reference run: the named policy's own run if it was asked for, else one more run
    // (unless references are off).
    let extra_run = |name: &str| -> Result<Option<engine::RunResult>, SimError> {
        if !with_reference || runs.iter().any(|r| r.policy == name) {
            return Ok(None);
        }
        let mut p = build_policy(s, name)?;
        Ok(Some(engine::run(s, &arrivals, p.as_mut())))
    };
    let (extra, extra_firm) = (extra_run("clairvoyant")?, extra_run("clairvoyant-firm")?);
    let find = |name: &str| runs.iter().find(|r| r.policy == name);
    let reference = find("clairvoyant").or(extra.as_ref());
    // The reference that keeps every admission: what a gate whose admission is a promise
    // could have served, knowing the future.
    let firm = find("clairvoyant-firm").or(extra_firm.as_ref());
    // Every run saw the same requests: any of them gives their windows and sizes.
    let requests = runs
        .first()
        .or(reference)
        .map_or(&[][..], |r| r.requests.as_slice());
    let b = bound::bound_at_speed(requests, s.upstream.speed());
    let rep = report::build(s, &runs, reference, firm, &b);
    Ok((rep, runs))
}
