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
mod sampler;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use slackgate_gateway::config::LogTarget;
use slackgate_gateway::{Config, DecisionLog, Gateway};
use slackgate_sim::engine::{self, Outcome, RequestResult, RunResult};
use slackgate_sim::policies::slackgate::gate_config as sim_gate_config;
use slackgate_sim::report::{self, Report};
use slackgate_sim::scenario::{Process, Scenario, ScenarioError};
use slackgate_sim::{bound, build_policy, workload, SimError};
use slackgate_stub::{LatencySpec, Stub, StubConfig};
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
    /// A bad option.
    #[error("{0}")]
    Option(String),
    /// The stub or the gate could not start.
    #[error("cannot start the {what}: {why}")]
    Start {
        /// Which part.
        what: &'static str,
        /// Why.
        why: String,
    },
}

/// One class's counters in the seeds' own terms.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassCounters {
    /// The class.
    pub class: String,
    /// Requests admitted (at least one offer queued).
    pub admitted: u64,
    /// Requests whose final answer was a refusal or a drop.
    pub rejected: u64,
    /// Requests completed.
    pub done: u64,
    /// Admitted requests with a deadline that did not complete within it (seed 000's
    /// `slo_breach`): completed late, dropped, abandoned at their deadline, or failed.
    pub slo_breach: u64,
    /// Admitted requests whose slack reached zero before they completed (seed 003's
    /// `prod_completed_after_slack_zero` for the prod class). The drill's clients hang up at
    /// slack zero, so these show as abandonments rather than late completions.
    pub completed_after_slack_zero: u64,
}

/// Drill versus simulator for one mode.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Agreement {
    /// The mode.
    pub mode: &'static str,
    /// On-time completions, simulated.
    pub sim_on_time: u64,
    /// On-time completions, live.
    pub drill_on_time: u64,
    /// |drill - sim| / max(sim, 1).
    pub on_time_diff: f64,
    /// Refusals and drops, simulated.
    pub sim_refused: u64,
    /// Refusals and drops, live.
    pub drill_refused: u64,
    /// |drill - sim| / max(sim, 1).
    pub refused_diff: f64,
}

/// A finished drill.
#[derive(Clone, Debug)]
pub struct Drill {
    /// The runs in the simulator's report format (policies named `gate-on`, `gate-off`).
    pub report: Report,
    /// The raw runs.
    pub runs: Vec<RunResult>,
    /// Per mode, per class, the seeds' counters.
    pub counters: Vec<(&'static str, Vec<ClassCounters>)>,
    /// What the simulator predicts for the same modes, and how far the drill is from it.
    pub agreement: Vec<Agreement>,
    /// Real seconds each run took.
    pub wall_s: Vec<f64>,
    /// Connection failures the clients saw, per run (0 in a healthy drill).
    pub transport_errors: Vec<u64>,
    /// Whether upstream time per request came from the stub's accounting (else estimated).
    pub stub_accounted: Vec<bool>,
    /// Real seconds per scenario second.
    pub time_scale: f64,
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
    cfg.log.path = "off".into();
    cfg
}

/// The scenario's window: a replayed trace ends with its last arrival (as in `simulate`).
fn windowed(s: &Scenario, arrivals: &[workload::Arrival]) -> Scenario {
    let mut w = s.clone();
    if s.arrivals.process == Process::Trace {
        if let Some(last) = arrivals.last() {
            w.duration_s = w.duration_s.min((last.at_ms + 1) as f64 / 1000.0);
        }
    }
    w
}

/// Run the drill: each mode live, then the simulator on the same requests, then the report.
pub async fn run(s: &Scenario, opts: &DrillOptions) -> Result<Drill, DrillError> {
    let (lo, hi) = TIME_SCALE_RANGE;
    if !(opts.time_scale >= lo && opts.time_scale <= hi) {
        return Err(DrillError::Option(format!(
            "--time-scale must be between {lo} and {hi}, got {}",
            opts.time_scale
        )));
    }
    if opts.modes.is_empty() {
        return Err(DrillError::Option("no run to do".into()));
    }
    let arrivals = workload::generate(s)?;
    let s = windowed(s, &arrivals);
    let mut runs = Vec::new();
    let mut wall_s = Vec::new();
    let mut transport_errors = Vec::new();
    let mut stub_accounted = Vec::new();
    for &mode in &opts.modes {
        let started = std::time::Instant::now();
        let live = run_mode(&s, &arrivals, mode, opts).await?;
        wall_s.push(started.elapsed().as_secs_f64());
        transport_errors.push(live.transport_errors);
        stub_accounted.push(live.stub_accounted);
        runs.push(live.run);
    }
    // The simulator's view of the same requests: the reference schedule, the bound and the
    // two modes' predictions.
    let mut reference = build_policy(&s, "clairvoyant")?;
    let reference = engine::run(&s, &arrivals, reference.as_mut());
    let b = bound::bound(&reference.requests, s.upstream.slots);
    let rep = report::build(&s, &runs, Some(&reference), &b);
    let mut agreement = Vec::new();
    for (mode, live) in opts.modes.iter().zip(&runs) {
        let mut p = build_policy(&s, mode.sim_policy())?;
        let sim = engine::run(&s, &arrivals, p.as_mut());
        agreement.push(agree(*mode, &sim, live));
    }
    let counters = opts
        .modes
        .iter()
        .zip(&runs)
        .map(|(m, r)| (m.label(), class_counters(&s, r)))
        .collect();
    Ok(Drill {
        report: rep,
        runs,
        counters,
        agreement,
        wall_s,
        transport_errors,
        stub_accounted,
        time_scale: opts.time_scale,
    })
}

fn refused(r: &RunResult) -> u64 {
    r.requests
        .iter()
        .filter(|q| matches!(q.outcome, Outcome::Rejected | Outcome::Dropped))
        .count() as u64
}

fn on_time(r: &RunResult) -> u64 {
    r.requests.iter().filter(|q| q.on_time()).count() as u64
}

fn rel(a: u64, b: u64) -> f64 {
    a.abs_diff(b) as f64 / b.max(1) as f64
}

fn agree(mode: Mode, sim: &RunResult, live: &RunResult) -> Agreement {
    let (so, dr) = (on_time(sim), on_time(live));
    let (sr, drr) = (refused(sim), refused(live));
    Agreement {
        mode: mode.label(),
        sim_on_time: so,
        drill_on_time: dr,
        on_time_diff: rel(dr, so),
        sim_refused: sr,
        drill_refused: drr,
        refused_diff: rel(drr, sr),
    }
}

/// The seeds' counters, per class.
pub fn class_counters(s: &Scenario, run: &RunResult) -> Vec<ClassCounters> {
    s.classes
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let mut k = ClassCounters {
                class: c.name.clone(),
                ..ClassCounters::default()
            };
            for r in run.requests.iter().filter(|r| r.class == ci) {
                let admitted = r.admitted > 0;
                k.admitted += u64::from(admitted);
                match r.outcome {
                    Outcome::Rejected | Outcome::Dropped => k.rejected += 1,
                    Outcome::OnTime | Outcome::Late => k.done += 1,
                    _ => {}
                }
                if admitted && r.deadline_ms.is_some() && !r.on_time() {
                    k.slo_breach += 1;
                    if matches!(r.outcome, Outcome::Late | Outcome::Abandoned) {
                        k.completed_after_slack_zero += 1;
                    }
                }
            }
            k
        })
        .collect()
}

/// What one live run produced.
struct LiveRun {
    run: RunResult,
    transport_errors: u64,
    stub_accounted: bool,
}

/// Run one mode: start (or reach) the stub and gate, drive every client, collect.
async fn run_mode(
    s: &Scenario,
    arrivals: &[workload::Arrival],
    mode: Mode,
    opts: &DrillOptions,
) -> Result<LiveRun, DrillError> {
    let scale = opts.time_scale;
    let start_err = |what: &'static str| {
        move |e: std::io::Error| DrillError::Start {
            what,
            why: e.to_string(),
        }
    };
    let mut stub = None;
    let mut gate = None;
    let (target, upstream) = match &opts.target {
        Target::InProcess => {
            let listener = TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(start_err("stub"))?;
            let st = Stub::spawn(
                listener,
                StubConfig {
                    slots: s.upstream.slots as usize,
                    latency: LatencySpec::Fixed(std::time::Duration::from_millis(1)),
                    default_output_tokens: 16,
                    seed: s.seed,
                },
            )
            .map_err(start_err("stub"))?;
            let upstream = format!("http://{}", st.local_addr());
            let mut cfg = gate_config(s, scale, mode, &upstream);
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
            let g = Gateway::spawn(listener, &cfg, log)
                .map_err(|why| DrillError::Start { what: "gate", why })?;
            let target = format!("http://{}", g.local_addr());
            stub = Some(st);
            gate = Some(g);
            (target, upstream)
        }
        Target::External { gate, upstream } => {
            let target = match mode {
                Mode::On => gate.trim_end_matches('/').to_string(),
                Mode::Off => upstream.trim_end_matches('/').to_string(),
            };
            (target, upstream.trim_end_matches('/').to_string())
        }
    };
    let http = client::http_client();
    let external_stub = matches!(opts.target, Target::External { .. })
        && sampler::clear_stub_requests(&http, &upstream).await;
    let counters = Arc::new(progress::Counters::default());
    let run = Arc::new(client::Run {
        scenario: s.clone(),
        scale,
        t0: tokio::time::Instant::now(),
        target: target.clone(),
        tag: mode.label(),
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
    let mut tasks = tokio::task::JoinSet::new();
    for (i, a) in arrivals.iter().enumerate() {
        let run = run.clone();
        let a = a.clone();
        tasks.spawn(async move { (i, client::drive(run, a).await) });
    }
    let mut logs: Vec<Option<client::ClientLog>> = (0..arrivals.len()).map(|_| None).collect();
    let mut transport_errors = 0u64;
    while let Some(joined) = tasks.join_next().await {
        if let Ok((i, log)) = joined {
            transport_errors += u64::from(log.transport_errors);
            logs[i] = Some(log);
        }
    }
    let end_ms = run.now_ms();
    let _ = stop_sampler.send(true);
    let mut series = sampler.await.unwrap_or_default();
    if let Some(b) = bar {
        b.abort();
        progress::clear();
    }
    // Upstream time per request, from the stub's own accounting.
    let records = match (&stub, external_stub) {
        (Some(st), _) => Some(st.requests()),
        (None, true) => sampler::stub_requests(&http, &upstream).await,
        (None, false) => None,
    };
    let busy: std::collections::HashMap<String, u64> = records
        .iter()
        .flatten()
        .map(|r| (r.id.clone(), r.busy_ms))
        .collect();
    let stub_accounted = records.is_some();
    let mut requests: Vec<RequestResult> = Vec::with_capacity(arrivals.len());
    let mut refusal_times = Vec::new();
    for (i, log) in logs.into_iter().enumerate() {
        let Some(log) = log else {
            return Err(DrillError::Start {
                what: "client",
                why: format!("client task {i} panicked"),
            });
        };
        let mut r = log.result;
        r.busy_ms = if stub_accounted {
            let real: u64 = log.stub_ids.iter().filter_map(|id| busy.get(id)).sum();
            (real as f64 / scale).round() as u64
        } else if r.outcome == Outcome::OnTime {
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
    if let Some(g) = gate {
        g.shutdown().await;
    }
    if let Some(st) = stub {
        st.shutdown().await;
    }
    Ok(LiveRun {
        run: RunResult {
            policy: mode.label().into(),
            requests,
            series,
            end_ms,
            protocol_errors: 0,
        },
        transport_errors,
        stub_accounted,
    })
}

impl Drill {
    /// Markdown: the side-by-side report, the seeds' counters, and the simulator agreement.
    pub fn to_markdown(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Drill: gate on versus gate off, live over HTTP on 127.0.0.1 (time scale {})\n",
            self.time_scale
        );
        let walls: Vec<String> = self.wall_s.iter().map(|w| format!("{w:.1} s")).collect();
        let _ = writeln!(
            out,
            "Real time per run: {}. Figures are in scenario time. Upstream time per request: {}.\n",
            walls.join(", "),
            if self.stub_accounted.iter().all(|&b| b) {
                "measured by the stub"
            } else {
                "estimated (the upstream is not slackgate stub)"
            }
        );
        out.push_str(&self.report.to_markdown());
        out.push_str(&self.refusals_over_time());
        let _ = writeln!(out, "\n## The seeds' counters\n");
        let _ = writeln!(
            out,
            "| run | class | admitted | rejected | done | slo_breach | completed_after_slack_zero |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|");
        for (mode, classes) in &self.counters {
            for k in classes {
                let _ = writeln!(
                    out,
                    "| {mode} | {} | {} | {} | {} | {} | {} |",
                    k.class,
                    k.admitted,
                    k.rejected,
                    k.done,
                    k.slo_breach,
                    k.completed_after_slack_zero
                );
            }
        }
        let _ = writeln!(
            out,
            "\nslo_breach: admitted with a deadline, not completed within it. \
             completed_after_slack_zero: admitted, and slack reached zero before completion \
             (clients hang up at zero slack, so these are abandonments).\n"
        );
        let _ = writeln!(out, "## Drill versus simulator (same requests)\n");
        let _ = writeln!(
            out,
            "| run | on-time sim | on-time drill | diff | refused sim | refused drill | diff |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
        for a in &self.agreement {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1}% | {} | {} | {:.1}% |",
                a.mode,
                a.sim_on_time,
                a.drill_on_time,
                a.on_time_diff * 100.0,
                a.sim_refused,
                a.drill_refused,
                a.refused_diff * 100.0
            );
        }
        if self.transport_errors.iter().any(|&n| n > 0) {
            let _ = writeln!(
                out,
                "\nConnection failures seen by clients: {:?} (per run).",
                self.transport_errors
            );
        }
        out
    }

    /// Refusals and drops per tenth of the scenario, per run: where the shedding happened.
    pub fn refusals_over_time(&self) -> String {
        use std::fmt::Write;
        const BUCKETS: u64 = 10;
        let span_ms = ((self.report.duration_s * 1000.0) as u64).max(BUCKETS);
        let width = span_ms.div_ceil(BUCKETS);
        let mut out = String::new();
        let _ = writeln!(out, "\n## Refusals over time (scenario seconds)\n");
        let mut head = String::from("| run |");
        let mut rule = String::from("|---|");
        for b in 0..BUCKETS {
            let from = b * width / 1000;
            let to = (b + 1) * width / 1000;
            let _ = write!(head, " {from}-{to} |");
            rule.push_str("---:|");
        }
        head.push_str(" later |");
        rule.push_str("---:|");
        let _ = writeln!(out, "{head}\n{rule}");
        for run in &self.runs {
            let mut counts = [0u64; BUCKETS as usize + 1];
            for (i, &n) in run.series.rejections.iter().enumerate() {
                let t = i as u64 * run.series.period_ms.max(1);
                let b = ((t / width) as usize).min(BUCKETS as usize);
                counts[b] += u64::from(n);
            }
            let cells: Vec<String> = counts.iter().map(u64::to_string).collect();
            let _ = writeln!(out, "| {} | {} |", run.policy, cells.join(" | "));
        }
        out
    }

    /// JSON: the report plus the drill's own sections.
    pub fn to_json(&self) -> String {
        let report: serde_json::Value =
            serde_json::from_str(&self.report.to_json()).unwrap_or(serde_json::Value::Null);
        let counters: Vec<serde_json::Value> = self
            .counters
            .iter()
            .map(|(m, k)| serde_json::json!({"run": m, "classes": k}))
            .collect();
        let v = serde_json::json!({
            "time_scale": self.time_scale,
            "wall_s": self.wall_s,
            "transport_errors": self.transport_errors,
            "stub_accounted": self.stub_accounted,
            "report": report,
            "counters": counters,
            "agreement": self.agreement,
        });
        serde_json::to_string_pretty(&v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Write report.md, report.json and the charts into `dir`.
    pub fn write(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("report.md"), self.to_markdown())?;
        std::fs::write(dir.join("report.json"), self.to_json())?;
        report::write_charts(dir, "drill-", &self.report, &self.runs)
    }
}
