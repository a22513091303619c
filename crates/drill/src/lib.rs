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

#![forbid(unsafe_code)]

pub mod client;
pub mod progress;
mod report;
mod sampler;

pub use report::{class_counters, Agreement, ClassCounters};

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use slackgate_gateway::config::LogTarget;
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

/// Gate on (enforcing) or off (the `admit_always` rollback).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// The gate decides.
    On,
    /// `admit_always`: every request admitted, the outage you would have had.
    Off,
}

impl Mode {
    /// The name in reports.
    pub fn label(self) -> &'static str {
        match self {
            Mode::On => "gate-on",
            Mode::Off => "gate-off",
        }
    }

    /// The simulator policy that models it.
    pub fn sim_policy(self) -> &'static str {
        match self {
            Mode::On => "slackgate",
            Mode::Off => "admit-always",
        }
    }
}

/// Where the drill sends its load.
#[derive(Clone, Debug, PartialEq, Eq)]
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
}

impl Default for DrillOptions {
    fn default() -> Self {
        DrillOptions {
            time_scale: 1.0,
            target: Target::InProcess,
            modes: vec![Mode::On, Mode::Off],
            progress: false,
            log_dir: None,
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
    #[error("the runs must be gate on and/or gate off, each at most once")]
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
    /// against an external upstream: no gate at all).
    pub agreement: Option<Agreement>,
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
    for p in &mut gate.pools {
        p.upstream = Some(upstream.to_string());
        p.prior.overhead_ms *= scale;
        p.prior.prefill_ms_per_token *= scale;
        p.prior.decode_ms_per_token *= scale;
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
    cfg.log.path = "off".into();
    cfg
}

/// Refuse what the drill cannot reproduce live, rather than report a different experiment.
fn check_supported(s: &Scenario) -> Result<(), DrillError> {
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
    let twice = opts.modes.len() == 2 && opts.modes[0] == opts.modes[1];
    if opts.modes.is_empty() || opts.modes.len() > 2 || twice {
        return Err(DrillError::Runs);
    }
    check_supported(s)?;
    let arrivals = workload::generate(s)?;
    let s = slackgate_sim::windowed(s, &arrivals);
    let external = matches!(opts.target, Target::External { .. });
    let key_prefix = format!(
        "drill-{:x}-{}",
        slackgate_gateway::telemetry::epoch_ms(),
        std::process::id()
    );
    let mut runs = Vec::new();
    let mut summaries = Vec::new();
    for &mode in &opts.modes {
        let started = std::time::Instant::now();
        let (run, mut summary) = run_mode(&s, &arrivals, mode, opts, &key_prefix).await?;
        summary.wall_s = started.elapsed().as_secs_f64();
        summary.counters = class_counters(&s, &run);
        // The simulator's prediction for the same requests, unless the run has no model
        // there (no gate at all).
        if !(external && mode == Mode::Off) {
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
    let rep = report::build(&s, &runs, Some(&reference), &b);
    Ok(Drill {
        report: rep,
        runs,
        summaries,
        time_scale: opts.time_scale,
        size_hint: s.size_hint,
        external,
    })
}

/// The stub and gate a run talks to, if the drill started them.
struct Started {
    stub: Stub,
    gate: Gateway,
}

async fn start(
    s: &Scenario,
    mode: Mode,
    opts: &DrillOptions,
) -> Result<(Started, String, String), DrillError> {
    let start_err = |what: &'static str| {
        move |e: std::io::Error| DrillError::Start {
            what,
            why: e.to_string(),
        }
    };
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
    let mut cfg = gate_config(s, opts.time_scale, mode, &upstream);
    let log = match &opts.log_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(start_err("decision log"))?;
            let path = dir.join(format!("decisions-{}.jsonl", mode.label()));
            let _ = std::fs::remove_file(&path);
            cfg.log.path = path.display().to_string();
            DecisionLog::start(LogTarget::File(path), cfg.log.channel_capacity)
                .map_err(start_err("decision log"))?
        }
        None => DecisionLog::off(),
    };
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(start_err("gate"))?;
    let gate = Gateway::spawn(listener, &cfg, log)
        .map_err(|why| DrillError::Start { what: "gate", why })?;
    let target = format!("http://{}", gate.local_addr());
    Ok((Started { stub, gate }, target, upstream))
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
) -> Result<(RunResult, RunSummary), DrillError> {
    let scale = opts.time_scale;
    let (started, target, upstream) = match &opts.target {
        Target::InProcess => {
            let (st, target, upstream) = start(s, mode, opts).await?;
            (Some(st), target, upstream)
        }
        Target::External { gate, upstream } => {
            let upstream = upstream.trim_end_matches('/').to_string();
            let target = match mode {
                Mode::On => gate.trim_end_matches('/').to_string(),
                Mode::Off => upstream.clone(),
            };
            (None, target, upstream)
        }
    };
    let http = client::http_client();
    // The upstream's per-request accounting, read over HTTP whether the drill started the stub
    // or not; an upstream that is not a stub has none.
    let accounted = started.is_some() || sampler::clear_stub_requests(&http, &upstream).await;
    let counters = Arc::new(progress::Counters::default());
    let run = Arc::new(client::Run {
        scenario: s.clone(),
        scale,
        t0: tokio::time::Instant::now(),
        target: target.clone(),
        tag: mode.label(),
        key_prefix: key_prefix.to_string(),
        http: http.clone(),
        progress: counters.clone(),
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
    let busy: HashMap<String, u64> = records
        .iter()
        .flatten()
        .map(|r| (r.id.clone(), r.busy_ms))
        .collect();
    let stub_accounted = records.is_some();
    let mut summary = RunSummary {
        mode,
        label: mode.label(),
        wall_s: 0.0,
        transport_errors: 0,
        invalid: 0,
        stub_accounted,
        missing_records: 0,
        counters: Vec::new(),
        agreement: None,
    };
    let mut requests: Vec<RequestResult> = Vec::with_capacity(arrivals.len());
    let mut refusal_times = Vec::new();
    for (i, log) in logs.into_iter().enumerate() {
        let Some(log) = log else {
            return Err(DrillError::ClientPanicked(i));
        };
        summary.transport_errors += u64::from(log.transport_errors);
        summary.invalid += u64::from(log.invalid);
        let mut r = log.result;
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
    }
    series.period_ms = period_ms;
    let buckets = series.queue_age_ms.len().max(1);
    series.rejections = vec![0; buckets];
    for t in refusal_times {
        let b = ((t / period_ms) as usize).min(buckets - 1);
        series.rejections[b] += 1;
    }
    if let Some(st) = started {
        st.gate.shutdown().await;
        st.stub.shutdown().await;
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
