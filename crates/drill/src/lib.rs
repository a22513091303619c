//! `slackgate drill`: a scenario's load, live. A stub upstream and a gate start in-process on
//! 127.0.0.1 (or the drill targets running ones), real clients send the scenario's requests
//! over HTTP with their classes, deadlines, sizes and retry habits, the stub injects the
//! scenario's faults, and the run is repeated with the gate off (`admit_always`). Both runs
//! are summarised in the simulator's report format, side by side, next to what the simulator
//! predicts for the same two configurations.
//!
//! Time is compressed by `time_scale`: a scenario second lasts `time_scale` real seconds, and
//! every duration the gate is configured with (deadlines, queue-age limits, the estimator's
//! priors, Retry-After floors) is scaled alike, so the drill is the scenario in miniature.
//! Figures are reported back in scenario time.
//!
//! Against a real model server ([`Target::Real`]) there is no stub: the drill's own gate
//! fronts the server, requests carry real prompt text of the scenario's token sizes, time
//! runs unscaled, and upstream time per request comes from the gate's decision log (dispatch
//! to end) instead of the stub's accounting. Either way the decision log also gives the
//! estimator's relative error per class ([`joblog`]).

#![forbid(unsafe_code)]

pub mod calibrate;
pub mod client;
pub mod html;
pub mod http_client;
pub mod joblog;
pub mod neighbour;
pub mod offered;
pub mod progress;
pub mod realserver;
pub mod redis;
mod report;
mod sampler;

pub use report::{
    admitted_on_time, class_counters, AdmittedOnTime, Agreement, ClassCounters, ClusterComparison,
};

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use slackgate_gateway::config::LogTarget;
use slackgate_gateway::engine::replica::Role;
use slackgate_gateway::{Config, DecisionLog, Gateway};
use slackgate_sim::engine::{self, RequestResult, RunResult};
use slackgate_sim::policies::slackgate::gate_config as sim_gate_config;
use slackgate_sim::report::Report;
use slackgate_sim::scenario::{Scenario, ScenarioError};
use slackgate_sim::{bound, build_policy, workload, SimError};
use slackgate_stub::{LatencySpec, Stub, StubConfig};
use std::collections::HashMap;
use std::time::Duration;
use tokio::net::TcpListener;

/// Smallest and largest accepted `--time-scale`.
pub const TIME_SCALE_RANGE: (f64, f64) = (0.001, 10.0);

/// Gate on (enforcing), gate on reading the server's own queue, or off (the `admit_always`
/// rollback).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// The gate decides, from its own view of the upstream.
    On,
    /// `admit_always`: every request admitted, the outage you would have had.
    Off,
    /// The gate decides and also scrapes the upstream's `/metrics` (pool
    /// `server_metrics`, kind `llamacpp`): work it did not send counts in its projected wait.
    /// The drill's default first run when the scenario has a `[neighbour]`.
    Signal,
    /// The gate on, as several replicas sharing one Redis ([`DrillOptions::replicas`]): the
    /// clients' offers are spread round-robin over the replicas. Compared with `On` (one
    /// replica) in the same drill.
    Cluster,
}

/// Every mode, in the order a label is looked up.
const MODES: [Mode; 4] = [Mode::On, Mode::Off, Mode::Signal, Mode::Cluster];

impl Mode {
    /// The name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Mode::On => "gate-on",
            Mode::Off => "gate-off",
            Mode::Signal => "gate-on-signal",
            Mode::Cluster => "gate-on-cluster",
        }
    }

    /// The mode a report label names.
    pub fn from_label(label: &str) -> Option<Mode> {
        MODES.into_iter().find(|m| m.label() == label)
    }

    /// A small number unique to the mode (0 to 3), to keep each run's prompts distinct.
    pub fn index(self) -> u64 {
        match self {
            Mode::On => 0,
            Mode::Off => 1,
            Mode::Signal => 2,
            Mode::Cluster => 3,
        }
    }

    /// The simulator policy that models it (the simulator has no server metrics: with no
    /// neighbour, the signal changes nothing and the gate is slackgate).
    pub fn sim_policy(self) -> &'static str {
        match self {
            Mode::On | Mode::Signal | Mode::Cluster => "slackgate",
            Mode::Off => "admit-always",
        }
    }
}

/// The runs a drill makes when none are named: gate on and gate off; with a `[neighbour]`
/// (and a gate the drill starts), gate on with the server's signal first, so both gate-on
/// figures come from one invocation.
pub fn default_modes(s: &Scenario, target: &Target) -> Vec<Mode> {
    default_modes_for(s, target, 1)
}

/// [`default_modes`] for `replicas` gate replicas: with more than one, the cluster run and
/// then the same scenario through one gate, to compare.
pub fn default_modes_for(s: &Scenario, target: &Target, replicas: usize) -> Vec<Mode> {
    if replicas > 1 {
        vec![Mode::Cluster, Mode::On]
    } else if s.neighbour.is_some() && !matches!(target, Target::External { .. }) {
        vec![Mode::Signal, Mode::On, Mode::Off]
    } else {
        vec![Mode::On, Mode::Off]
    }
}

/// Scrape interval of the signal run (scenario ms): scaled with time, at least the gate's
/// smallest accepted 100 real ms.
const SIGNAL_INTERVAL_MS: u64 = 250;

/// The `server_metrics` of the signal run: llama.cpp's gauges (the stub exports the same
/// names), scraped every 250 scenario ms, stale after four missed scrapes.
pub fn signal_metrics(scale: f64) -> slackgate_core::config::ServerMetricsConfig {
    let interval_ms = scale_ms(SIGNAL_INTERVAL_MS, scale).max(100);
    slackgate_core::config::ServerMetricsConfig {
        kind: slackgate_core::config::ServerKind::Llamacpp,
        path: "/metrics".into(),
        interval_ms,
        stale_ms: interval_ms * 4,
        running: None,
        waiting: None,
    }
}

/// Where the drill sends its load.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// Start a stub and a gate in-process on 127.0.0.1 for each run.
    InProcess,
    /// A running gate and its upstream. Gate on goes through the gate; gate off goes straight
    /// to the upstream (no gate at all). Per-request upstream accounting and faults need the
    /// upstream to be `slackgate stub`.
    External {
        /// Base URL of the gate (`http://127.0.0.1:8080`).
        gate: String,
        /// Base URL of the upstream.
        upstream: String,
    },
    /// A real OpenAI-compatible model server: the drill starts its own gate in front of it
    /// for each run (gate off: the same gate with `admit_always`), and no stub.
    Real(RealUpstream),
}

/// A real model server to drill, and how to talk to it.
#[derive(Clone, Debug, PartialEq)]
pub struct RealUpstream {
    /// Base URL (`http://127.0.0.1:8000`).
    pub url: String,
    /// The `model` field of requests; `None`: the first model of `/v1/models`, else
    /// `"drill"`.
    pub model: Option<String>,
    /// Characters of prompt text per token; `None`: measured from the server (`/tokenize`,
    /// else `usage.prompt_tokens` of two probes), else 4.
    pub chars_per_token: Option<f64>,
    /// The gate configuration to run instead of the one the scenario implies (priors,
    /// slots, classes); its pools are pointed at `url`.
    pub config: Option<Box<Config>>,
}

/// What the drill settled on for a real server.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RealInfo {
    /// Base URL.
    pub url: String,
    /// The `model` sent.
    pub model: String,
    /// Characters of prompt text per token.
    pub chars_per_token: f64,
    /// Where that ratio came from: `flag`, `tokenize`, `usage` or `default`.
    pub chars_per_token_source: &'static str,
    /// Whether the gate configuration came from `--config` (else the scenario's).
    pub config_file: bool,
}

/// How to run a drill.
#[derive(Clone, Debug)]
pub struct DrillOptions {
    /// Real seconds per scenario second.
    pub time_scale: f64,
    /// Where the load goes.
    pub target: Target,
    /// Which runs, in order.
    pub modes: Vec<Mode>,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Write each in-process gate's decision log here (`decisions-<mode>.jsonl`).
    pub log_dir: Option<PathBuf>,
    /// The estimator's error is measured on requests dispatched this many scenario seconds
    /// after a run starts (the warm-up is left out).
    pub error_after_s: f64,
    /// Gate replicas of the cluster run ([`Mode::Cluster`]), sharing one Redis; 1 (no
    /// cluster run) by default.
    pub replicas: usize,
    /// The Redis of the cluster run (`redis://127.0.0.1:PORT[/DB]`); `None`: the drill starts
    /// its own `redis-server` on a free loopback port and stops it after the run.
    pub redis: Option<String>,
    /// Offer this multiple of the upstream's capacity (see [`offered`]): a real server is
    /// measured first; otherwise the scenario's `[upstream]` is the measure. `None`: the
    /// scenario's own arrival rate.
    pub load: Option<f64>,
}

/// Most replicas a cluster run starts (each is a full gate in this process).
pub const MAX_REPLICAS: usize = 16;

/// Longest wait for the cluster run's replicas to agree on a leader (real time).
const CLUSTER_READY: Duration = Duration::from_secs(20);

impl Default for DrillOptions {
    fn default() -> Self {
        DrillOptions {
            time_scale: 1.0,
            target: Target::InProcess,
            modes: vec![Mode::On, Mode::Off],
            progress: false,
            log_dir: None,
            error_after_s: 30.0,
            replicas: 1,
            redis: None,
            load: None,
        }
    }
}

/// Something that stops a drill.
#[derive(Debug, thiserror::Error)]
pub enum DrillError {
    /// The scenario cannot be used.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// The simulator side failed.
    #[error(transparent)]
    Sim(#[from] SimError),
    /// `--time-scale` outside its range.
    #[error("--time-scale must be between {lo} and {hi}, got {0}", lo = TIME_SCALE_RANGE.0, hi = TIME_SCALE_RANGE.1)]
    TimeScale(f64),
    /// No run, or the same run twice.
    #[error("the runs must be among gate on, gate on with the server's signal and gate off, each at most once")]
    Runs,
    /// The scenario uses something the drill cannot reproduce live.
    #[error("{field}: {why}; simulate it with `slackgate sim` instead")]
    Unsupported {
        /// The scenario field.
        field: &'static str,
        /// Why the drill cannot do it.
        why: &'static str,
    },
    /// A client task panicked (a bug in the drill).
    #[error("the client of request {0} panicked")]
    ClientPanicked(usize),
    /// The stub or the gate could not start.
    #[error("cannot start the {what}: {why}")]
    Start {
        /// Which part.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// `--chars-per-token` is not a positive number.
    #[error("--chars-per-token must be a positive number, got {0}")]
    CharsPerToken(f64),
    /// The `--config` given for a real upstream does not fit the scenario.
    #[error("--config: {0}")]
    Config(String),
    /// `--replicas` out of range, or a cluster run without replicas.
    #[error("--replicas must be between 2 and {MAX_REPLICAS} for a cluster run (and a cluster run needs --replicas), got {0}")]
    Replicas(usize),
    /// The cluster run's Redis.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// `--load` out of range, or a scenario it cannot scale.
    #[error("--load: {0}")]
    Load(String),
    /// Measuring the real server for `--load` failed.
    #[error("measuring the server for --load: {0}")]
    Calibrate(#[from] calibrate::CalibrateError),
}

/// What one run produced besides its requests.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSummary {
    /// Gate on or off.
    pub mode: Mode,
    /// Its name in reports.
    pub label: &'static str,
    /// Real seconds it took.
    pub wall_s: f64,
    /// The most a client sent after its scheduled moment, in real milliseconds: a few on a
    /// machine with time to spare; hundreds when the machine was starved, and then the run's
    /// figures describe the machine, not the gate.
    pub send_late_ms: f64,
    /// Offers that never got an answer because the connection failed (0 in a healthy drill).
    pub transport_errors: u64,
    /// Offers the gate refused as malformed (a 4xx that is not a decision; 0 in a healthy
    /// drill).
    pub invalid: u64,
    /// Whether upstream time per request came from the stub's accounting (else estimated:
    /// the service time of completions, nothing for the rest).
    pub stub_accounted: bool,
    /// Completed offers the stub has no record of (0 when the accounting is whole).
    pub missing_records: u64,
    /// Per class, the seeds' counters.
    pub counters: Vec<ClassCounters>,
    /// Drill versus simulator; `None` when the simulator has no model of the run (gate off
    /// against an external upstream: no gate at all; a real upstream, not modelled).
    pub agreement: Option<Agreement>,
    /// Per class, the estimator's relative error over the run after the warm-up, from the
    /// gate's decision log (empty without one: an external gate).
    pub estimator_error: Vec<joblog::EstimatorError>,
    /// Per class, the tokens the gate settled (from the upstream's `usage`, or the ledger),
    /// from its decision log (empty without one).
    pub settled: Vec<ClassSettled>,
    /// Whether upstream time per request came from the gate's decision log (a real
    /// upstream: dispatch to end of each job).
    pub real_accounted: bool,
    /// Per class, requests refused for capacity while a slot was free and nothing was queued
    /// ahead of them (from the decision log; empty without one).
    pub refused_on_free_slot: Vec<(String, u64)>,
    /// What the scenario's `[neighbour]` client saw (`None` without one).
    pub neighbour: Option<neighbour::NeighbourReport>,
}

/// Tokens one class settled in a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassSettled {
    /// The class.
    pub class: String,
    /// Jobs that completed with status 200.
    pub completed: u64,
    /// Tokens spent (prompt + output of completions, as the upstream reported).
    pub tokens_spent: u64,
    /// Tokens wasted (generated for clients that left).
    pub tokens_wasted: u64,
}

/// A finished drill.
#[derive(Clone, Debug)]
pub struct Drill {
    /// The runs in the simulator's report format (policies named `gate-on`, `gate-off`).
    pub report: Report,
    /// The raw runs.
    pub runs: Vec<RunResult>,
    /// One per run, in the same order.
    pub summaries: Vec<RunSummary>,
    /// Real seconds per scenario second.
    pub time_scale: f64,
    /// Whether the gate was told each request's (noisy) size.
    pub size_hint: bool,
    /// Whether the load went to a gate and upstream the drill did not start.
    pub external: bool,
    /// Against a real model server: what the drill used.
    pub real: Option<RealInfo>,
    /// Gate replicas of the cluster run (1: there was none).
    pub replicas: usize,
    /// The warm-up left out of the estimator's error (scenario seconds).
    pub error_after_s: f64,
    /// How `--load` set the offered load, when it was given.
    pub load_fit: Option<offered::LoadFit>,
}

impl Drill {
    /// The summary of the run with this label.
    pub fn summary(&self, label: &str) -> Option<&RunSummary> {
        self.summaries.iter().find(|r| r.label == label)
    }

    /// Whether every offer got an answer from the gate: no connection failure, no request
    /// refused as malformed, no completion missing from the upstream's accounting.
    pub fn healthy(&self) -> bool {
        self.summaries
            .iter()
            .all(|r| r.transport_errors == 0 && r.invalid == 0 && r.missing_records == 0)
    }
}

/// Scale a scenario duration (ms) to real ms, at least 1.
fn scale_ms(ms: u64, scale: f64) -> u64 {
    ((ms as f64) * scale).round().max(1.0) as u64
}

/// The gate configuration a scenario implies (the simulator's, see
/// `slackgate_sim::policies::slackgate::gate_config`), with every duration scaled to real
/// time and the pool pointed at `upstream`.
pub fn gate_config(s: &Scenario, scale: f64, mode: Mode, upstream: &str) -> Config {
    let mut gate = sim_gate_config(s);
    gate.admit_always = mode == Mode::Off;
    set_signal(&mut gate.pools, mode, scale);
    for p in &mut gate.pools {
        p.upstream = Some(upstream.to_string());
        p.prior.overhead_ms *= scale;
        p.prior.prefill_ms_per_token *= scale;
        p.prior.decode_ms_per_token *= scale;
        p.prior.decode_ms_per_1k_context *= scale;
        p.forecast_window_ms = scale_ms(p.forecast_window_ms, scale).max(1_000);
        p.promise_guard_ms = ((p.promise_guard_ms as f64) * scale).round() as u64;
    }
    for c in &mut gate.classes {
        c.deadline_ms = c.deadline_ms.map(|d| scale_ms(d, scale));
        c.max_queue_age_ms = c.max_queue_age_ms.map(|d| scale_ms(d, scale));
    }
    let r = &mut gate.retry;
    r.min_retry_after_ms = scale_ms(r.min_retry_after_ms, scale);
    r.max_useful_retry_after_ms = scale_ms(r.max_useful_retry_after_ms, scale);
    r.hopeless_retry_after_ms = scale_ms(r.hopeless_retry_after_ms, scale);
    gate.ledger.hold_ttl_ms = scale_ms(gate.ledger.hold_ttl_ms, scale);
    let mut cfg = Config {
        gate,
        ..Config::default()
    };
    cfg.server.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    cfg.server.tick_ms = scale_ms(s.tick_ms, scale);
    cfg.server.ledger = "memory".into();
    // The drill's clients send the simulator's size estimate (unless `size_hint = false`).
    cfg.server.trust_size_hint = true;
    // Tenants name themselves in the fairness header, as a trusted proxy would set it.
    cfg.server.fairness_header = Some(FAIRNESS_HEADER.into());
    cfg.log.path = "off".into();
    cfg
}

/// The server's signal on the first pool for the signal run, off for the others (a
/// `--config` that sets one keeps its own settings in the signal run).
fn set_signal(pools: &mut [slackgate_core::config::PoolConfig], mode: Mode, scale: f64) {
    for (i, p) in pools.iter_mut().enumerate() {
        if mode == Mode::Signal && i == 0 {
            if p.server_metrics.is_none() {
                p.server_metrics = Some(signal_metrics(scale));
            }
        } else {
            p.server_metrics = None;
        }
    }
}

/// Refuse what the drill cannot reproduce live, rather than report a different experiment.
fn check_supported(s: &Scenario, opts: &DrillOptions) -> Result<(), DrillError> {
    let cluster = opts.modes.contains(&Mode::Cluster);
    if cluster && !(2..=MAX_REPLICAS).contains(&opts.replicas) {
        return Err(DrillError::Replicas(opts.replicas));
    }
    if opts.replicas != 1 && !cluster {
        return Err(DrillError::Replicas(opts.replicas));
    }
    if cluster && opts.target != Target::InProcess {
        return Err(DrillError::Unsupported {
            field: "--replicas (with --gate or --real-upstream)",
            why: "the cluster run starts its own replicas in front of the drill's stub",
        });
    }
    if cluster && s.neighbour.is_some() {
        return Err(DrillError::Unsupported {
            field: "[neighbour] (with --replicas)",
            why: "the cluster run does not scrape the upstream's signal",
        });
    }
    if matches!(opts.target, Target::External { .. }) && opts.modes.contains(&Mode::Signal) {
        return Err(DrillError::Unsupported {
            field: "--run signal (with --gate)",
            why: "the drill cannot turn a running gate's server_metrics on or off; set it in that gate's configuration and run `on`",
        });
    }
    if let Target::Real(_) = &opts.target {
        if !s.faults.is_empty() || !s.stuck.is_empty() {
            return Err(DrillError::Unsupported {
                field: "faults / stuck",
                why: "a real model server cannot be told to fail, hang or stall a request",
            });
        }
        if opts.time_scale != 1.0 {
            return Err(DrillError::Unsupported {
                field: "--time-scale (with a real upstream)",
                why: "a real server's speed cannot be scaled: run it at 1",
            });
        }
        if !s.cancel_on_disconnect {
            return Err(DrillError::Unsupported {
                field: "cancel_on_disconnect = false",
                why: "the live gate always cancels the upstream request of a client that hangs up",
            });
        }
        // A batching server slowing down under load is the server's own behaviour here.
        return Ok(());
    }
    if s.upstream.concurrency_slowdown > 0.0 {
        return Err(DrillError::Unsupported {
            field: "upstream.concurrency_slowdown",
            why: "the stub does not fix a request's slowdown when it starts; model a batching server with upstream.batch_slowdown, which the stub reproduces",
        });
    }
    if !s.cancel_on_disconnect {
        return Err(DrillError::Unsupported {
            field: "cancel_on_disconnect = false",
            why: "the live gate always cancels the upstream request of a client that hangs up",
        });
    }
    Ok(())
}

/// Run the drill: each mode live, then the simulator on the same requests, then the report.
pub async fn run(s: &Scenario, opts: &DrillOptions) -> Result<Drill, DrillError> {
    let (lo, hi) = TIME_SCALE_RANGE;
    if !(opts.time_scale >= lo && opts.time_scale <= hi) {
        return Err(DrillError::TimeScale(opts.time_scale));
    }
    let twice = opts
        .modes
        .iter()
        .enumerate()
        .any(|(i, m)| opts.modes[..i].contains(m));
    if opts.modes.is_empty() || opts.modes.len() > MODES.len() || twice {
        return Err(DrillError::Runs);
    }
    check_supported(s, opts)?;
    let (fitted, load_fit) = match (opts.load, &opts.target) {
        (None, _) => (s.clone(), None),
        (Some(_), Target::External { .. }) => {
            return Err(DrillError::Load(
                "a running gate's upstream cannot be measured; use --real-upstream".into(),
            ))
        }
        (Some(x), Target::Real(r)) => {
            let (f, fit) = offered::fit_real(s, &r.url, r.model.clone(), x).await?;
            (f, Some(fit))
        }
        (Some(x), _) => {
            let (f, fit) = offered::scale_to(s, x)?;
            (f, Some(fit))
        }
    };
    let arrivals = workload::generate(&fitted)?;
    let s = slackgate_sim::windowed(&fitted, &arrivals);
    let external = matches!(opts.target, Target::External { .. });
    let real = match &opts.target {
        Target::Real(r) => Some(resolve_real(&s, r).await?),
        _ => None,
    };
    let key_prefix = format!(
        "drill-{:x}-{}",
        slackgate_gateway::support::clock::epoch_ms(),
        std::process::id()
    );
    let mut runs = Vec::new();
    let mut summaries = Vec::new();
    for &mode in &opts.modes {
        let started = std::time::Instant::now();
        let (run, mut summary) =
            run_mode(&s, &arrivals, mode, opts, &key_prefix, real.as_ref()).await?;
        summary.wall_s = started.elapsed().as_secs_f64();
        summary.counters = class_counters(&s, &run);
        // The simulator's prediction for the same requests, unless the run has no model
        // there (no gate at all, a real server the scenario does not model, or a neighbour
        // loading the upstream behind the gate's back).
        if !(external && mode == Mode::Off) && real.is_none() && s.neighbour.is_none() {
            let mut p = build_policy(&s, mode.sim_policy())?;
            let sim = engine::run(&s, &arrivals, p.as_mut());
            summary.agreement = Some(report::agree(mode, &sim, &run));
        }
        runs.push(run);
        summaries.push(summary);
    }
    // The reference schedule (false rejections) and the bound, on the same requests.
    let mut reference = build_policy(&s, "clairvoyant")?;
    let reference = engine::run(&s, &arrivals, reference.as_mut());
    let b = bound::bound_at_speed(&reference.requests, s.upstream.speed());
    // False rejections are judged against the clairvoyant schedule on the scenario's cost
    // model, which says nothing about a real server's: none are counted there.
    // Nor with a neighbour: the reference does not know the server is shared.
    let modelled = real.is_none() && s.neighbour.is_none();
    let refr = Some(&reference).filter(|_| modelled);
    let firm = match modelled {
        true => {
            let mut p = build_policy(&s, "clairvoyant-firm")?;
            Some(engine::run(&s, &arrivals, p.as_mut()))
        }
        false => None,
    };
    let rep = report::build(&s, &runs, refr, firm.as_ref(), &b);
    Ok(Drill {
        report: rep,
        runs,
        summaries,
        time_scale: opts.time_scale,
        size_hint: s.size_hint,
        external,
        real,
        replicas: if opts.modes.contains(&Mode::Cluster) {
            opts.replicas
        } else {
            1
        },
        error_after_s: opts.error_after_s,
        load_fit,
    })
}

/// Settle, once for both runs, the model name and characters per token of a real server, and
/// check that a `--config` has a class for each of the scenario's.
async fn resolve_real(s: &Scenario, r: &RealUpstream) -> Result<RealInfo, DrillError> {
    let url = r.url.trim_end_matches('/').to_string();
    let http = http_client::http_client();
    let model = match &r.model {
        Some(m) => m.clone(),
        None => realserver::discover_model(&http, &url)
            .await
            .unwrap_or_else(|| "drill".into()),
    };
    let (chars_per_token, chars_per_token_source) = match r.chars_per_token {
        Some(f) if f.is_finite() && f > 0.0 => (f, "flag"),
        Some(f) => return Err(DrillError::CharsPerToken(f)),
        None => realserver::chars_per_token(&http, &url, &model)
            .await
            .unwrap_or((realserver::DEFAULT_CHARS_PER_TOKEN, "default")),
    };
    if let Some(cfg) = &r.config {
        for c in &s.classes {
            let known = cfg
                .gate
                .classes
                .iter()
                .any(|k| k.name == c.name || k.aliases.contains(&c.name));
            if !known {
                return Err(DrillError::Config(format!(
                    "the scenario's class {:?} is not a class (or alias) of the config",
                    c.name
                )));
            }
        }
    }
    Ok(RealInfo {
        url,
        model,
        chars_per_token,
        chars_per_token_source,
        config_file: r.config.is_some(),
    })
}

/// The header the drill's clients name their tenant in (llm-d's fairness id).
pub const FAIRNESS_HEADER: &str = "x-llm-d-inference-fairness-id";

/// The gate configuration of a run against a real server: the `--config` given (its pools
/// pointed at the server, on an ephemeral loopback port, in-memory ledger, no admin API) or
/// the scenario's, unscaled.
fn real_gate_config(s: &Scenario, r: &RealUpstream, mode: Mode, url: &str) -> Config {
    let Some(given) = &r.config else {
        return gate_config(s, 1.0, mode, url);
    };
    let mut cfg = (**given).clone();
    cfg.gate.admit_always = mode == Mode::Off;
    set_signal(&mut cfg.gate.pools, mode, 1.0);
    for p in &mut cfg.gate.pools {
        p.upstream = Some(url.to_string());
    }
    cfg.server.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    cfg.server.ledger = "memory".into();
    cfg.server.fairness_header = Some(FAIRNESS_HEADER.into());
    cfg.admin.listen = None;
    cfg
}

/// The stub (if any) and gate a run talks to, if the drill started them, and the gate's
/// decision log.
struct Started {
    stub: Option<Stub>,
    /// The gate (in a cluster run, the replica that led when the run started).
    gate: Gateway,
    /// A cluster run's other replicas, stopped before the leader.
    followers: Vec<Gateway>,
    /// A cluster run's Redis, stopped (if the drill started it) after every replica.
    redis: Option<redis::Redis>,
    /// A cluster run's replica URLs, in replica order (the clients' round-robin).
    spread: Vec<String>,
    log: DecisionLog,
    log_path: PathBuf,
    /// A directory made for the log because no `--out` was given: removed after the run.
    scratch: Option<PathBuf>,
}

async fn start(
    s: &Scenario,
    mode: Mode,
    opts: &DrillOptions,
    real: Option<&RealInfo>,
) -> Result<(Started, String, String), DrillError> {
    let start_err = |what: &'static str| {
        move |e: std::io::Error| DrillError::Start {
            what,
            why: e.to_string(),
        }
    };
    let (stub, mut cfg, upstream) = match (real, &opts.target) {
        (Some(info), Target::Real(r)) => {
            let cfg = real_gate_config(s, r, mode, &info.url);
            (None, cfg, info.url.clone())
        }
        _ => {
            let listener = TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(start_err("stub"))?;
            let stub = Stub::spawn(
                listener,
                StubConfig {
                    slots: s.upstream.slots as usize,
                    latency: LatencySpec::Fixed(Duration::from_millis(1)),
                    default_output_tokens: 16,
                    seed: s.seed,
                },
            )
            .map_err(start_err("stub"))?;
            let upstream = format!("http://{}", stub.local_addr());
            let cfg = gate_config(s, opts.time_scale, mode, &upstream);
            (Some(stub), cfg, upstream)
        }
    };
    // The decision log is always written: it gives the estimator's error, and against a
    // real server the upstream time of each request. Without `--out` it goes to a scratch
    // directory removed after the run.
    let (dir, scratch) = match &opts.log_dir {
        Some(dir) => (dir.clone(), None),
        None => {
            let dir = std::env::temp_dir().join(format!(
                "slackgate-drill-{}-{:x}-{}",
                std::process::id(),
                slackgate_gateway::support::clock::epoch_ms(),
                mode.label()
            ));
            (dir.clone(), Some(dir))
        }
    };
    std::fs::create_dir_all(&dir).map_err(start_err("decision log"))?;
    if mode == Mode::Cluster {
        return start_cluster(stub, cfg, &dir, scratch, opts, upstream).await;
    }
    let log_path = dir.join(format!("decisions-{}.jsonl", mode.label()));
    let _ = std::fs::remove_file(&log_path);
    cfg.log.path = log_path.display().to_string();
    let log = DecisionLog::start(LogTarget::File(log_path.clone()), cfg.log.channel_capacity)
        .map_err(start_err("decision log"))?;
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(start_err("gate"))?;
    let gate = Gateway::spawn(listener, &cfg, log.clone()).map_err(|why| DrillError::Start {
        what: "gate",
        why: why.to_string(),
    })?;
    let target = format!("http://{}", gate.local_addr());
    Ok((
        Started {
            stub,
            gate,
            followers: Vec::new(),
            redis: None,
            spread: Vec::new(),
            log,
            log_path,
            scratch,
        },
        target,
        upstream,
    ))
}

/// Start a cluster run's Redis (or reach the one given) and `opts.replicas` gates sharing it
/// under a cluster name of their own, each with its own decision log
/// (`decisions-gate-on-cluster-r<i>.jsonl`), and wait until one leads and every other
/// forwards to it. The run's target (metrics, the decision log read back) is the leader.
async fn start_cluster(
    stub: Option<Stub>,
    cfg: Config,
    dir: &std::path::Path,
    scratch: Option<PathBuf>,
    opts: &DrillOptions,
    upstream: String,
) -> Result<(Started, String, String), DrillError> {
    let redis = match &opts.redis {
        Some(url) => redis::Redis::existing(url)?,
        None => tokio::task::spawn_blocking(redis::Redis::start)
            .await
            .map_err(|e| DrillError::Start {
                what: "redis-server",
                why: e.to_string(),
            })??,
    };
    // A name of its own: several drills (or a re-run) can share one Redis.
    let name = format!(
        "drill-{:x}-{}",
        slackgate_gateway::support::clock::epoch_ms(),
        std::process::id()
    );
    let start_err = |what: &'static str| {
        move |why: slackgate_gateway::engine::start::StartError| DrillError::Start {
            what,
            why: why.to_string(),
        }
    };
    let mut gates = Vec::with_capacity(opts.replicas);
    let mut logs = Vec::with_capacity(opts.replicas);
    for i in 0..opts.replicas {
        let mut c = cfg.clone();
        let cluster = slackgate_gateway::config::ClusterConfig {
            redis: redis.url(),
            name: name.clone(),
            replica_id: Some(format!("r{i}")),
            ..slackgate_gateway::config::ClusterConfig::default()
        };
        let store = slackgate_gateway::server::open_cluster_store(&cluster, &c.gate.ledger)
            .map_err(start_err("cluster ledger"))?;
        c.cluster = Some(cluster);
        let path = dir.join(format!("decisions-{}-r{i}.jsonl", Mode::Cluster.label()));
        let _ = std::fs::remove_file(&path);
        c.log.path = path.display().to_string();
        let log = DecisionLog::start(LogTarget::File(path.clone()), c.log.channel_capacity)
            .map_err(|e| DrillError::Start {
                what: "decision log",
                why: e.to_string(),
            })?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| DrillError::Start {
                what: "gate replica",
                why: e.to_string(),
            })?;
        let gate = Gateway::spawn_with_store(listener, &c, log.clone(), store)
            .map_err(start_err("gate replica"))?;
        gates.push(gate);
        logs.push((log, path));
    }
    let spread: Vec<String> = gates
        .iter()
        .map(|g| format!("http://{}", g.local_addr()))
        .collect();
    let leader = wait_for_leader(&gates).await;
    let Some(leader) = leader else {
        let why = format!(
            "no replica led, with every other one following it, within {CLUSTER_READY:?} (redis {})",
            redis.url()
        );
        for g in gates {
            g.shutdown().await;
        }
        return Err(DrillError::Start {
            what: "cluster",
            why,
        });
    };
    let gate = gates.remove(leader);
    let (log, log_path) = logs.swap_remove(leader);
    let target = spread.get(leader).cloned().unwrap_or_default();
    Ok((
        Started {
            stub,
            gate,
            followers: gates,
            redis: Some(redis),
            spread,
            log,
            log_path,
            scratch,
        },
        target,
        upstream,
    ))
}

/// The index of the replica that leads once every replica sees the same leader and all the
/// replicas; `None` if that does not happen within [`CLUSTER_READY`].
async fn wait_for_leader(gates: &[Gateway]) -> Option<usize> {
    let deadline = tokio::time::Instant::now() + CLUSTER_READY;
    loop {
        let status: Vec<_> = gates
            .iter()
            .filter_map(|g| g.shared().cluster.as_ref().map(|c| c.status()))
            .collect();
        let leaders: Vec<usize> = (0..status.len())
            .filter(|&i| status[i].role == Role::Leader)
            .collect();
        if let ([l], true) = (leaders.as_slice(), status.len() == gates.len()) {
            let id = &status[*l].replica_id;
            let agreed = status.iter().all(|st| {
                st.replicas.len() == gates.len()
                    && (st.role == Role::Leader
                        || (st.role == Role::Follower
                            && st.leader.as_ref().is_some_and(|x| &x.id == id)))
            });
            if agreed {
                return Some(*l);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Longest wait for the upstream to go idle after the last client, so the accounting of
/// cancelled requests has landed (real time).
const SETTLE: Duration = Duration::from_secs(10);

/// Run one mode: start (or reach) the stub and gate, drive every client, collect.
async fn run_mode(
    s: &Scenario,
    arrivals: &[workload::Arrival],
    mode: Mode,
    opts: &DrillOptions,
    key_prefix: &str,
    real: Option<&RealInfo>,
) -> Result<(RunResult, RunSummary), DrillError> {
    let scale = opts.time_scale;
    let (started, target, upstream) = match &opts.target {
        Target::InProcess | Target::Real(_) => {
            let (st, target, upstream) = start(s, mode, opts, real).await?;
            (Some(st), target, upstream)
        }
        Target::External { gate, upstream } => {
            let upstream = upstream.trim_end_matches('/').to_string();
            let target = match mode {
                Mode::On | Mode::Signal | Mode::Cluster => gate.trim_end_matches('/').to_string(),
                Mode::Off => upstream.clone(),
            };
            (None, target, upstream)
        }
    };
    let http = http_client::http_client();
    // The upstream's per-request accounting, read over HTTP whether the drill started the stub
    // or not; an upstream that is not a stub has none.
    let accounted = match &started {
        Some(st) => st.stub.is_some(),
        None => sampler::clear_stub_requests(&http, &upstream).await,
    };
    let counters = Arc::new(progress::Counters::default());
    let run_epoch_ms = slackgate_gateway::support::clock::epoch_ms();
    let run = Arc::new(client::Run {
        scenario: s.clone(),
        scale,
        t0: tokio::time::Instant::now(),
        target: target.clone(),
        spread: started
            .as_ref()
            .map_or_else(Vec::new, |st| st.spread.clone()),
        tag: mode.label(),
        key_prefix: key_prefix.to_string(),
        http: http.clone(),
        progress: counters.clone(),
        real: real.map(|r| client::RealRequests {
            model: r.model.clone(),
            chars_per_token: r.chars_per_token,
        }),
    });
    // Chart samples: one per period of scenario time, at least 50 real ms apart.
    let span_ms = (s.duration_s * 1000.0) as u64;
    let period_ms = (span_ms / 300).max(100).max((50.0 / scale).ceil() as u64);
    let gate_metrics = match (&opts.target, mode) {
        (Target::External { .. }, Mode::Off) => None,
        _ => Some(format!("{target}/metrics")),
    };
    let (stop_sampler, stopped) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sampler::sample(
        http.clone(),
        gate_metrics,
        run.clone(),
        period_ms,
        stopped,
    ));
    let bar = opts
        .progress
        .then(|| progress::spawn(mode.label().into(), arrivals.len() as u64, counters));
    // The neighbour loads the upstream directly, beside the gated clients.
    let neighbour_task = s.neighbour.as_ref().map(|_| {
        tokio::spawn(neighbour::drive(
            run.clone(),
            upstream.clone(),
            workload::neighbour_arrivals(s),
        ))
    });
    // Clients are started at their arrival time, not all up front: memory follows the
    // requests in flight, not the scenario's length.
    let mut logs: Vec<Option<client::ClientLog>> = (0..arrivals.len()).map(|_| None).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, a) in arrivals.iter().enumerate() {
        tokio::time::sleep_until(run.at(a.at_ms)).await;
        let run = run.clone();
        let a = a.clone();
        tasks.spawn(async move { (i, client::drive(run, a).await) });
        while let Some(Ok((j, log))) = tasks.try_join_next() {
            logs[j] = Some(log);
        }
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok((j, log)) = joined {
            logs[j] = Some(log);
        }
    }
    let end_ms = run.now_ms();
    let neighbour_report = match neighbour_task {
        Some(t) => Some(t.await.unwrap_or_default()),
        None => None,
    };
    let _ = stop_sampler.send(true);
    let mut series = sampler.await.unwrap_or_default();
    if let Some(b) = bar {
        b.abort();
        progress::clear();
    }
    // Upstream time per request, from the stub's own accounting, once the cancellations of
    // the last clients have reached it.
    let records = if accounted {
        sampler::wait_stub_idle(&http, &upstream, SETTLE).await;
        sampler::stub_requests(&http, &upstream).await
    } else {
        None
    };
    // The gate's decision log, once the gate has stopped and every line is on disk.
    let jobs = match started {
        Some(st) => {
            // Followers first: the leader then gives its lease up with nobody to take it.
            for f in st.followers {
                f.shutdown().await;
            }
            st.gate.shutdown().await;
            st.log.flush().await;
            drop(st.redis);
            if let Some(stub) = st.stub {
                stub.shutdown().await;
            }
            let jobs = joblog::read(&st.log_path).unwrap_or_default();
            if let Some(dir) = st.scratch {
                let _ = std::fs::remove_dir_all(dir);
            }
            Some(jobs)
        }
        None => None,
    };
    let busy: HashMap<String, u64> = records
        .iter()
        .flatten()
        .map(|r| (r.id.clone(), r.busy_ms))
        .collect();
    let stub_accounted = records.is_some();
    // Each scenario class with the name the gate logs it under: its own, or, with a
    // `--config` that knows it as an alias, that class's name.
    let class_names: Vec<(String, String)> = s
        .classes
        .iter()
        .map(|c| {
            let logged = match &opts.target {
                Target::Real(RealUpstream {
                    config: Some(cfg), ..
                }) => cfg
                    .gate
                    .classes
                    .iter()
                    .find(|k| k.name == c.name || k.aliases.contains(&c.name))
                    .map_or_else(|| c.name.clone(), |k| k.name.clone()),
                _ => c.name.clone(),
            };
            (c.name.clone(), logged)
        })
        .collect();
    let mut summary = RunSummary {
        mode,
        label: mode.label(),
        wall_s: 0.0,
        send_late_ms: run.progress.latest_ms(),
        transport_errors: 0,
        invalid: 0,
        stub_accounted,
        missing_records: 0,
        counters: Vec::new(),
        agreement: None,
        estimator_error: jobs.as_ref().map_or_else(Vec::new, |j| {
            let warm_up_ms = (opts.error_after_s.max(0.0) * 1000.0 * scale) as u64;
            joblog::estimator_error(j, &class_names, run_epoch_ms + warm_up_ms)
        }),
        settled: jobs
            .as_ref()
            .map_or_else(Vec::new, |j| settled(j, &class_names)),
        real_accounted: false,
        refused_on_free_slot: jobs.as_ref().map_or_else(Vec::new, |j| {
            let slots = match &opts.target {
                Target::Real(RealUpstream {
                    config: Some(cfg), ..
                }) => cfg.gate.pools.first().map_or(1, |p| p.slots),
                _ => s.upstream.slots,
            };
            joblog::refused_on_a_free_slot(j, &class_names, slots)
        }),
        neighbour: neighbour_report,
    };
    let mut requests: Vec<RequestResult> = Vec::with_capacity(arrivals.len());
    let mut refusal_times = Vec::new();
    let mut client_logs = Vec::with_capacity(arrivals.len());
    for (i, log) in logs.into_iter().enumerate() {
        let Some(log) = log else {
            return Err(DrillError::ClientPanicked(i));
        };
        summary.transport_errors += u64::from(log.transport_errors);
        summary.invalid += u64::from(log.invalid);
        let mut r = log.result.clone();
        r.busy_ms = if stub_accounted {
            summary.missing_records += log
                .completed_ids
                .iter()
                .filter(|id| !busy.contains_key(*id))
                .count() as u64;
            let real: u64 = log.stub_ids.iter().filter_map(|id| busy.get(id)).sum();
            (real as f64 / scale).round() as u64
        } else if r.on_time() || r.outcome == slackgate_sim::engine::Outcome::Late {
            r.size_ms
        } else {
            0
        };
        refusal_times.extend(log.refusals.iter().map(|f| f.at_ms));
        requests.push(r);
        client_logs.push(log);
    }
    // Against a real server, upstream time comes from the gate's log instead.
    if let (Some(jobs), Some(_)) = (&jobs, real) {
        real_busy(&mut requests, &client_logs, jobs, &class_names, scale);
        summary.real_accounted = true;
    }
    series.period_ms = period_ms;
    let buckets = series.queue_age_ms.len().max(1);
    series.rejections = vec![0; buckets];
    for t in refusal_times {
        let b = ((t / period_ms) as usize).min(buckets - 1);
        series.rejections[b] += 1;
    }
    let run = RunResult {
        policy: mode.label().into(),
        requests,
        series,
        end_ms,
        protocol_errors: 0,
    };
    Ok((run, summary))
}

/// Per class, the tokens the gate settled.
/// (Two scenario classes that the config maps to one class both show that class's figures.)
fn settled(
    jobs: &HashMap<u64, joblog::JobFacts>,
    classes: &[(String, String)],
) -> Vec<ClassSettled> {
    classes
        .iter()
        .map(|(c, logged)| {
            let mut k = ClassSettled {
                class: c.clone(),
                ..ClassSettled::default()
            };
            for j in jobs.values().filter(|j| &j.class == logged) {
                k.completed += u64::from(j.actual_service_ms.is_some());
                k.tokens_spent += j.tokens_spent;
                k.tokens_wasted += j.tokens_wasted;
            }
            k
        })
        .collect()
}

/// Upstream time per request from the gate's log: the jobs whose ids the client saw, plus,
/// for a request that ended without seeing its last job's id (abandoned while the server
/// was still working, or failed), one of the dispatched jobs no client claimed. Those are
/// paired per class in arrival order: the gate numbers jobs as they arrive, so the pairing
/// is the true one unless two clients of a class raced to the gate.
fn real_busy(
    requests: &mut [RequestResult],
    logs: &[client::ClientLog],
    jobs: &HashMap<u64, joblog::JobFacts>,
    classes: &[(String, String)],
    scale: f64,
) {
    use slackgate_sim::engine::Outcome;
    let to_scenario = |ms: u64| (ms as f64 / scale).round() as u64;
    let mut claimed = std::collections::HashSet::new();
    for (r, log) in requests.iter_mut().zip(logs) {
        let real: u64 = log
            .job_ids
            .iter()
            .filter_map(|id| jobs.get(id))
            .map(joblog::JobFacts::busy_ms)
            .sum();
        r.busy_ms = to_scenario(real);
        claimed.extend(log.job_ids.iter().copied());
    }
    for (ci, (_, c)) in classes.iter().enumerate() {
        let mut orphans: Vec<(u64, u64)> = jobs
            .iter()
            .filter(|(id, j)| {
                &j.class == c && j.dispatched_at_ms.is_some() && !claimed.contains(id)
            })
            .map(|(&id, j)| (id, j.busy_ms()))
            .collect();
        orphans.sort_unstable();
        let mut waiting: Vec<(u64, usize)> = requests
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                r.class == ci
                    && r.admitted > 0
                    && matches!(r.outcome, Outcome::Abandoned | Outcome::Failed)
                    && !logs[*i].last_job_seen
            })
            .map(|(i, r)| (r.first_at_ms, i))
            .collect();
        waiting.sort_unstable();
        for ((_, i), (_, busy)) in waiting.into_iter().zip(orphans) {
            requests[i].busy_ms += to_scenario(busy);
        }
    }
}
