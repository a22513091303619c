//! A scenario: the upstream, the workload (generated or replayed from a trace), the clients'
//! behaviour and the classes, as one TOML file. Parsing refuses unknown fields, and every
//! error names the file, the line and the field, because a typo in a drill must not silently
//! become a different experiment.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// A scenario that cannot run, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Io {
        /// The path.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A field is missing, unknown, of the wrong type or out of range.
    #[error("{file}:{line}: field {field}: {message}")]
    Field {
        /// The path.
        file: String,
        /// 1-based line (0 when unknown).
        line: usize,
        /// Dotted path of the field (`classes[1].deadline_ms`).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The trace the scenario names is unreadable or malformed.
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
}

/// How arrivals are spaced.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Process {
    /// Exponential inter-arrival times.
    #[default]
    Poisson,
    /// Gamma inter-arrival times with coefficient of variation `cv` (bursty for cv > 1).
    Gamma,
    /// Evenly spaced arrivals (a scripted burst).
    Uniform,
    /// Replay the `[trace]`.
    Trace,
}

/// What a client does after a 429.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum RetryMode {
    /// Give up.
    #[default]
    None,
    /// Wait the advertised Retry-After once, then give up.
    Once,
    /// Retry at once, `storm_retries` times (a retry storm).
    Storm,
}

/// A distribution of token counts.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "dist", rename_all = "lowercase", deny_unknown_fields)]
pub enum Dist {
    /// Always `value`.
    Fixed {
        /// The value.
        value: u32,
    },
    /// Uniform integers in `[min, max]`.
    Uniform {
        /// Smallest.
        min: u32,
        /// Largest.
        max: u32,
    },
    /// Lognormal with the given median and shape, capped at `max` (heavy-tailed outputs).
    Lognormal {
        /// Median.
        median: f64,
        /// Shape (sigma of the underlying normal).
        sigma: f64,
        /// Cap.
        max: u32,
    },
    /// Pareto with scale `min` and tail index `alpha`, capped at `max`.
    Pareto {
        /// Scale (smallest value).
        min: f64,
        /// Tail index (smaller: heavier).
        alpha: f64,
        /// Cap.
        max: u32,
    },
}

impl Dist {
    pub(crate) fn validate(&self) -> Result<(), (&'static str, String)> {
        match *self {
            Dist::Fixed { .. } => Ok(()),
            Dist::Uniform { min, max } if min > max => Err(("min", format!("{min} > max {max}"))),
            Dist::Uniform { .. } => Ok(()),
            Dist::Lognormal { median, sigma, .. } => {
                if !(median.is_finite() && median > 0.0) {
                    Err(("median", "must be a positive number".into()))
                } else if !(sigma.is_finite() && (0.0..=5.0).contains(&sigma)) {
                    Err(("sigma", "must be between 0 and 5".into()))
                } else {
                    Ok(())
                }
            }
            Dist::Pareto { min, alpha, .. } => {
                if !(min.is_finite() && min > 0.0) {
                    Err(("min", "must be a positive number".into()))
                } else if !(alpha.is_finite() && alpha > 0.0) {
                    Err(("alpha", "must be a positive number".into()))
                } else {
                    Ok(())
                }
            }
        }
    }
}

fn default_slots() -> u32 {
    4
}
fn default_one() -> f64 {
    1.0
}
fn default_priority() -> u32 {
    50
}
fn default_max_tokens() -> u32 {
    4096
}
fn default_storm() -> u32 {
    3
}
fn default_true() -> bool {
    true
}
fn default_tick() -> u64 {
    100
}
fn default_seed() -> u64 {
    1
}
fn default_prompt() -> Dist {
    Dist::Fixed { value: 0 }
}

/// The model endpoint: slots and a token cost model.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    /// Requests served at once.
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// Fixed cost per request (ms).
    #[serde(default)]
    pub overhead_ms: f64,
    /// Cost per prompt token (ms).
    #[serde(default)]
    pub prefill_ms_per_token: f64,
    /// Cost per output token at concurrency 1 (ms).
    pub decode_ms_per_token: f64,
    /// Each additional request running at once slows decoding by this fraction (0.1: four
    /// at once decode 30% slower), fixed when the job starts.
    #[serde(default)]
    pub concurrency_slowdown: f64,
    /// A continuous-batching server: while k requests run at once, each progresses at
    /// 1 / (1 + batch_slowdown x (k - 1)) of its speed alone, re-computed the moment k
    /// changes (0: perfect batching, 1: plain time sharing). Excludes `concurrency_slowdown`.
    #[serde(default)]
    pub batch_slowdown: f64,
    /// Each output token costs this many ms more per 1000 tokens of context (prompt plus the
    /// tokens generated so far): decoding slows as the context grows, as on llama.cpp.
    #[serde(default)]
    pub decode_ms_per_1k_context: f64,
}

impl Upstream {
    /// Whether requests share the server's speed while they run (`batch_slowdown > 0`): the
    /// engine then runs the dynamic processor-sharing model instead of fixed service times.
    pub fn batching(&self) -> bool {
        self.batch_slowdown > 0.0
    }

    /// How much slower each of `k` requests running at once progresses than alone.
    pub fn batch_factor(&self, k: u32) -> f64 {
        1.0 + self.batch_slowdown * f64::from(k.saturating_sub(1))
    }

    /// The most alone-work the server gets through per unit of time with every slot usable:
    /// `slots` without batching, else the best of k / (1 + batch_slowdown x (k - 1)) over
    /// k = 1..=slots (k = slots for a slowdown up to 1, k = 1 above it). Capacity for trace
    /// compression and the speed of the upper bound's fluid machine.
    pub fn speed(&self) -> f64 {
        if !self.batching() {
            return f64::from(self.slots.max(1));
        }
        let k = if self.batch_slowdown <= 1.0 {
            self.slots.max(1)
        } else {
            1
        };
        f64::from(k) / self.batch_factor(k)
    }
}

/// A step in the arrival rate: `factor` times the base rate in `[from_s, to_s)`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// Start (s).
    pub from_s: f64,
    /// End (s).
    pub to_s: f64,
    /// Rate multiplier.
    pub factor: f64,
}

/// The arrival process.
#[derive(Clone, Debug, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct Arrivals {
    /// Spacing.
    #[serde(default)]
    pub process: Process,
    /// Base rate (requests/s); unused for traces.
    #[serde(default)]
    pub rate: f64,
    /// Coefficient of variation of inter-arrival times (gamma only).
    #[serde(default)]
    pub cv: Option<f64>,
    /// Stop after this many arrivals.
    #[serde(default)]
    pub count: Option<u64>,
    /// Rate steps (bursts).
    #[serde(default)]
    pub steps: Vec<Step>,
    /// Classes in a fixed repeating order instead of drawn by `share`.
    #[serde(default)]
    pub class_sequence: Vec<String>,
    /// Sinusoidal swings of the rate (`shape`; Poisson only).
    #[serde(default)]
    pub waves: Vec<crate::shape::Wave>,
    /// A rise and fall of the rate over the run (`shape`; Poisson only).
    #[serde(default)]
    pub diurnal: Option<crate::shape::Diurnal>,
    /// Markov-modulated bursts, synchronized over classes (`shape`; Poisson only).
    #[serde(default)]
    pub bursts: Option<crate::shape::Bursts>,
    /// Size changes from a time on (`shape`).
    #[serde(default)]
    pub size_shifts: Vec<crate::shape::SizeShift>,
}

impl Arrivals {
    /// The time-varying part of the arrivals.
    pub fn shape(&self) -> crate::shape::Shape<'_> {
        crate::shape::Shape {
            waves: &self.waves,
            diurnal: self.diurnal.as_ref(),
            bursts: self.bursts.as_ref(),
            size_shifts: &self.size_shifts,
        }
    }
}

/// One rule assigning trace rows to a class; the first matching rule wins.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClassRule {
    /// The class.
    pub class: String,
    /// Smallest prompt matched.
    #[serde(default)]
    pub min_prompt_tokens: Option<u32>,
    /// Largest prompt matched.
    #[serde(default)]
    pub max_prompt_tokens: Option<u32>,
    /// Smallest output matched.
    #[serde(default)]
    pub min_output_tokens: Option<u32>,
    /// Largest output matched.
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Of the rows that match, this fraction (drawn deterministically per row).
    #[serde(default = "default_one")]
    pub fraction: f64,
}

/// Replay of a `TIMESTAMP,ContextTokens,GeneratedTokens` trace.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TraceSpec {
    /// The CSV, relative to the scenario file.
    pub path: String,
    /// Offered load as a multiple of capacity: the trace's timestamps are stretched or
    /// compressed so its work over its span is this many times what the slots can serve.
    /// `None`: replay at the recorded pace.
    #[serde(default)]
    pub load: Option<f64>,
    /// Use only the first rows.
    #[serde(default)]
    pub max_rows: Option<usize>,
    /// Class assignment; rows no rule matches get the first class.
    #[serde(default)]
    pub rules: Vec<ClassRule>,
}

/// A traffic class: how its clients behave and what the gate is told about it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClassSpec {
    /// Name.
    pub name: String,
    /// Higher runs first.
    #[serde(default = "default_priority")]
    pub priority: u32,
    /// Share of generated arrivals (normalised over classes).
    #[serde(default = "default_one")]
    pub share: f64,
    /// The client's deadline: it gives up this long after it first sent the request.
    /// `None`: best effort.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// slackgate's per-class queue-age threshold.
    #[serde(default)]
    pub max_queue_age_ms: Option<u64>,
    /// slackgate's per-class displacement window (`displace_within_ms`; off when unset).
    /// `slackgate-displace` uses the class deadline when this is unset.
    #[serde(default)]
    pub displace_within_ms: Option<u64>,
    /// Prompt length.
    #[serde(default = "default_prompt")]
    pub prompt_tokens: Dist,
    /// True output length (generated workloads).
    #[serde(default = "default_prompt")]
    pub output_tokens: Dist,
    /// The requests' `max_tokens`.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Behaviour after a 429.
    #[serde(default)]
    pub retry: RetryMode,
    /// Retries of a storm.
    #[serde(default = "default_storm")]
    pub storm_retries: u32,
    /// The client waits for its answer past its deadline instead of hanging up (seed 003's
    /// and seed 000's harnesses do): a completion after the deadline is then late, not
    /// abandoned. The deadline still tells the gate the request's slack.
    #[serde(default)]
    pub patient: bool,
    /// The drill's client asks for a streamed response (the simulator is the same either way).
    #[serde(default = "default_true")]
    pub stream: bool,
}

/// A long job injected at a fixed time (seed 002's eval holding the only slot).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Stuck {
    /// When it arrives (s).
    pub at_s: f64,
    /// How long it holds its slot once started (s).
    pub duration_s: f64,
    /// Its class.
    pub class: String,
}

/// What an injected upstream fault does to a request it hits.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// Service takes `factor` times as long (a latency spike).
    Latency,
    /// The upstream answers an error status at once.
    Error,
    /// The connection is reset mid-stream, after the third token (or the last, if fewer).
    Reset,
    /// The upstream never answers: the slot is held until the client gives up (or, for a
    /// client with no deadline, until the run's end: arrivals' end plus `HANG_TAIL_MS`).
    Hang,
}

/// How long after the last arrival a hung request is ended at the latest (ms): the drill's
/// clients with no deadline give up then, and the simulator ends hung jobs then.
pub const HANG_TAIL_MS: u64 = 60_000;

/// Faults injected into the upstream for requests arriving in a window (`[[faults]]`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// Window start (s).
    pub at_s: f64,
    /// Window length (s).
    pub duration_s: f64,
    /// Share of the window's requests hit (0..=1, default 1).
    #[serde(default = "default_one")]
    pub rate: f64,
    /// `latency`: the slowdown factor (> 0).
    #[serde(default)]
    pub factor: Option<f64>,
    /// `error`: the status answered (400..=599, default 503).
    #[serde(default)]
    pub status: Option<u16>,
    /// Only requests of this class (default: every class).
    #[serde(default)]
    pub class: Option<String>,
}

/// Traffic sent straight to the upstream by a client that bypasses the gate (`[neighbour]`):
/// a second team, a notebook, a cron job on the same server (seed 001's "unknown
/// neighbours"). The gate never sees these requests; they only take the server's slots. Only
/// the drill sends them: the simulator's upstream is the policy's own slots, so
/// `slackgate sim` refuses a scenario with a neighbour.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Neighbour {
    /// Mean requests per second while sending.
    pub rate_per_s: f64,
    /// Spacing of its requests: `poisson` (default) or `uniform`.
    #[serde(default)]
    pub process: Process,
    /// Prompt length, as a class's.
    #[serde(default = "default_prompt")]
    pub prompt_tokens: Dist,
    /// Output length, as a class's.
    #[serde(default = "default_prompt")]
    pub output_tokens: Dist,
    /// Whether it asks for streamed responses.
    #[serde(default = "default_true")]
    pub stream: bool,
    /// It starts sending at this time (s).
    #[serde(default)]
    pub start_s: f64,
    /// It stops sending at this time (s; default: the scenario's `duration_s`).
    #[serde(default)]
    pub end_s: Option<f64>,
    /// Bursts: send for `on_s` seconds, then pause `off_s` seconds, repeatedly from
    /// `start_s` (both or neither; default: send all the time).
    #[serde(default)]
    pub on_s: Option<f64>,
    /// The pause between bursts (s).
    #[serde(default)]
    pub off_s: Option<f64>,
}

impl Neighbour {
    /// Whether the neighbour sends at `t_s` (scenario seconds): inside its window and, with
    /// bursts, inside a burst.
    pub fn sending_at(&self, t_s: f64, duration_s: f64) -> bool {
        let end = self.end_s.unwrap_or(duration_s).min(duration_s);
        if t_s < self.start_s || t_s >= end {
            return false;
        }
        match (self.on_s, self.off_s) {
            (Some(on), Some(off)) => (t_s - self.start_s) % (on + off) < on,
            _ => true,
        }
    }

    fn validate(&self, duration_s: f64) -> Result<(), (String, String)> {
        let at = |f: &str| format!("neighbour.{f}");
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !(pos(self.rate_per_s) && self.rate_per_s <= 10_000.0) {
            return Err((
                at("rate_per_s"),
                "must be a positive number of requests per second, at most 10000".into(),
            ));
        }
        if !matches!(self.process, Process::Poisson | Process::Uniform) {
            return Err((at("process"), "must be \"poisson\" or \"uniform\"".into()));
        }
        if !(self.start_s.is_finite() && self.start_s >= 0.0 && self.start_s < duration_s) {
            return Err((
                at("start_s"),
                "must be a number of seconds from 0 to before duration_s".into(),
            ));
        }
        if let Some(end) = self.end_s {
            if !(end.is_finite() && end > self.start_s) {
                return Err((at("end_s"), "must be after start_s".into()));
            }
        }
        match (self.on_s, self.off_s) {
            (None, None) => {}
            (Some(on), Some(off)) => {
                if !(pos(on) && on <= 86_400.0) {
                    return Err((at("on_s"), "must be a positive number of seconds".into()));
                }
                if !(off.is_finite() && (0.0..=86_400.0).contains(&off)) {
                    return Err((at("off_s"), "must be a number of seconds, 0 or more".into()));
                }
            }
            (Some(_), None) => return Err((at("off_s"), "on_s needs off_s".into())),
            (None, Some(_)) => return Err((at("on_s"), "off_s needs on_s".into())),
        }
        if let Err((f, m)) = self.prompt_tokens.validate() {
            return Err((at(&format!("prompt_tokens.{f}")), m));
        }
        if let Err((f, m)) = self.output_tokens.validate() {
            return Err((at(&format!("output_tokens.{f}")), m));
        }
        Ok(())
    }
}

/// Parameters of the baseline policies. `None`: derived from the scenario (see docs).
#[derive(Clone, Debug, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct Baselines {
    /// `max-queue`: queued jobs allowed.
    pub max_queue: Option<usize>,
    /// `seed000`: oldest queued age threshold (ms).
    pub seed000_max_age_ms: Option<u64>,
    /// `seed000`: depth factor k (reject when depth > k x slots with all slots busy).
    pub seed000_depth_factor: Option<f64>,
    /// `codel`: target sojourn (ms).
    pub codel_target_ms: Option<u64>,
    /// `codel`: interval (ms).
    pub codel_interval_ms: Option<u64>,
    /// `gradient`: smallest limit.
    pub gradient_min_limit: Option<u32>,
    /// `gradient`: largest limit.
    pub gradient_max_limit: Option<u32>,
}

/// slackgate's own knobs beyond the classes' (`max_queue_age_ms` lives on the class).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SlackgateSpec {
    /// Seed 000's depth rule on the pool, if wanted.
    #[serde(default)]
    pub max_depth_factor: Option<f64>,
    /// Whether the estimator learns from completions.
    #[serde(default = "default_true")]
    pub learn: bool,
    /// Start the estimator from the gate's default priors (as a new operator's gate would)
    /// instead of the scenario's true costs: shows whether it converges from there.
    #[serde(default)]
    pub default_priors: bool,
    /// Every class's `forecast` (the wait of a lower class counts the higher classes'
    /// expected arrivals).
    #[serde(default = "default_true")]
    pub forecast: bool,
    /// The pool's `forecast_window_ms` (default: the gate's).
    #[serde(default)]
    pub forecast_window_ms: Option<u64>,
    /// The pool's `forecast_refused_weight` (default: the gate's).
    #[serde(default)]
    pub forecast_refused_weight: Option<f64>,
    /// The pool's `headroom` (`"learned"`, `"off"` or a number of slots; default: the
    /// gate's).
    #[serde(default)]
    pub headroom: Option<slackgate_core::config::Headroom>,
    /// The pool's `promise_guard_ms` in scenario ms (default: the gate's). The drill keeps
    /// it in real ms scaled like every other duration.
    #[serde(default)]
    pub promise_guard_ms: Option<u64>,
    /// `[fairness] headroom_max_idle` (default: the gate's).
    #[serde(default)]
    pub tenant_headroom_max_idle: Option<f64>,
}

impl Default for SlackgateSpec {
    fn default() -> Self {
        SlackgateSpec {
            max_depth_factor: None,
            learn: true,
            default_priors: false,
            forecast: true,
            forecast_window_ms: None,
            forecast_refused_weight: None,
            headroom: None,
            promise_guard_ms: None,
            tenant_headroom_max_idle: None,
        }
    }
}

/// A whole scenario.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name, for reports.
    pub name: String,
    /// What it reproduces.
    #[serde(default)]
    pub description: String,
    /// Arrivals stop after this long (s); the run continues until every request has ended.
    pub duration_s: f64,
    /// Random seed (arrivals, sizes, noise).
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Policies to compare; empty: all.
    #[serde(default)]
    pub policies: Vec<String>,
    /// Sigma of the lognormal factor by which the gate's view of each job's output is wrong
    /// (0: exact, 0.6: typically off by x1.8).
    #[serde(default)]
    pub estimator_noise: f64,
    /// Housekeeping period of the policies (ms).
    #[serde(default = "default_tick")]
    pub tick_ms: u64,
    /// Whether the gate is told each request's (noisy) output length, as a caller that knows
    /// its sizes would (`X-Expected-Output-Tokens`); without it the gate uses the class's
    /// learned mean, capped by `max_tokens`.
    #[serde(default = "default_true")]
    pub size_hint: bool,
    /// Whether a gate sees a client give up and cancels its upstream request. The `none`
    /// policy (no gate) never does.
    #[serde(default = "default_true")]
    pub cancel_on_disconnect: bool,
    /// The model endpoint.
    pub upstream: Upstream,
    /// Arrivals.
    #[serde(default)]
    pub arrivals: Arrivals,
    /// Trace replay (with `arrivals.process = "trace"`).
    #[serde(default)]
    pub trace: Option<TraceSpec>,
    /// Classes.
    pub classes: Vec<ClassSpec>,
    /// Tenants, each with its own stream of one class's requests (see `tenants`).
    #[serde(default)]
    pub tenants: Vec<crate::tenants::TenantSpec>,
    /// Injected long jobs.
    #[serde(default)]
    pub stuck: Vec<Stuck>,
    /// Injected upstream faults.
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// A client that bypasses the gate and loads the upstream directly (drill only).
    #[serde(default)]
    pub neighbour: Option<Neighbour>,
    /// Baseline parameters.
    #[serde(default)]
    pub baselines: Baselines,
    /// slackgate's knobs.
    #[serde(default)]
    pub slackgate: SlackgateSpec,
    /// Directory of the scenario file (trace paths are relative to it).
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// The file name, for messages.
    #[serde(skip)]
    pub file: String,
}

/// Every policy the simulator knows, in report order.
pub const ALL_POLICIES: &[&str] = &[
    "none",
    "max-queue",
    "seed000",
    "codel",
    "codel-lifo",
    "gradient",
    "slackgate",
    "clairvoyant",
];

/// Policies run only when named: `admit-always` is slackgate's core with its rollback flag
/// set (the drill's "gate off"), there to compare with a live drill; `slackgate-displace` is
/// slackgate with displacement on for every class with a deadline (window: the class's
/// `displace_within_ms`, else its deadline); `clairvoyant-firm` is the clairvoyant reference
/// without revocation: it never drops what it admitted (a greedy reference for gates whose
/// admission is a promise, not an upper bound); `slackgate-unfair` is slackgate without
/// `[fairness]`, `slackgate-work-conserving` with it but no tenant headroom.
pub const EXTRA_POLICIES: &[&str] = &[
    "admit-always",
    "slackgate-displace",
    "slackgate-unfair",
    "slackgate-work-conserving",
    "clairvoyant-firm",
];

/// Every policy name `--policy` and `policies` accept.
pub fn known_policies() -> Vec<&'static str> {
    ALL_POLICIES.iter().chain(EXTRA_POLICIES).copied().collect()
}

impl Scenario {
    /// Read and validate a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            file: file.clone(),
            source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Scenario::parse(&file, &text, &base)
    }

    /// Parse and validate scenario text; `file` names it in errors, `base_dir` anchors the
    /// trace path.
    pub fn parse(file: &str, text: &str, base_dir: &Path) -> Result<Scenario, ScenarioError> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(0, |sp| {
                text[..sp.start.min(text.len())].matches('\n').count() + 1
            });
            let message = e.message().to_string();
            let field = field_of_message(&message).unwrap_or_else(|| "(document)".into());
            ScenarioError::Field {
                file: file.into(),
                line,
                field,
                message,
            }
        })?;
        s.base_dir = base_dir.to_path_buf();
        s.file = file.into();
        if let Err((field, message)) = s.validate() {
            let line = locate(text, &field);
            return Err(ScenarioError::Field {
                file: file.into(),
                line,
                field,
                message,
            });
        }
        Ok(s)
    }

    /// Index of a class by name.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.name == name)
    }

    /// The policies to run, in report order.
    pub fn policy_names(&self) -> Vec<String> {
        if self.policies.is_empty() {
            ALL_POLICIES.iter().map(|s| s.to_string()).collect()
        } else {
            self.policies.clone()
        }
    }

    /// Check every field; the first problem as (dotted field path, what is wrong). `parse`
    /// runs it; call it again after overriding fields (the command line's `--noise`).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |f: &str, m: &str| Err((f.to_string(), m.to_string()));
        let pos = |v: f64| v.is_finite() && v > 0.0;
        let nonneg = |v: f64| v.is_finite() && v >= 0.0;
        if self.name.trim().is_empty() {
            return err("name", "must not be empty");
        }
        if !(pos(self.duration_s) && self.duration_s <= 30.0 * 86_400.0) {
            return err(
                "duration_s",
                "must be a positive number of seconds (at most 30 days)",
            );
        }
        if !(nonneg(self.estimator_noise) && self.estimator_noise <= 3.0) {
            return err("estimator_noise", "must be between 0 and 3");
        }
        if self.tick_ms == 0 || self.tick_ms > 60_000 {
            return err("tick_ms", "must be between 1 and 60000");
        }
        for (i, p) in self.policies.iter().enumerate() {
            if !known_policies().contains(&p.as_str()) {
                return Err((
                    format!("policies[{i}]"),
                    format!(
                        "unknown policy {p:?}; known: {}",
                        known_policies().join(", ")
                    ),
                ));
            }
        }
        let u = &self.upstream;
        if u.slots == 0 || u.slots > 10_000 {
            return err("upstream.slots", "must be between 1 and 10000");
        }
        for (f, v) in [
            ("upstream.overhead_ms", u.overhead_ms),
            ("upstream.prefill_ms_per_token", u.prefill_ms_per_token),
            ("upstream.decode_ms_per_token", u.decode_ms_per_token),
            ("upstream.concurrency_slowdown", u.concurrency_slowdown),
            ("upstream.batch_slowdown", u.batch_slowdown),
            (
                "upstream.decode_ms_per_1k_context",
                u.decode_ms_per_1k_context,
            ),
        ] {
            if !nonneg(v) || v > 1e7 {
                return err(f, "must be a non-negative number");
            }
        }
        if u.batch_slowdown > 0.0 && u.concurrency_slowdown > 0.0 {
            return err(
                "upstream.batch_slowdown",
                "batch_slowdown and concurrency_slowdown are two models of the same slowdown; set one of them",
            );
        }
        if self.classes.is_empty() {
            return err("classes", "at least one class is required");
        }
        for (i, c) in self.classes.iter().enumerate() {
            let at = |f: &str| format!("classes[{i}].{f}");
            if c.name.trim().is_empty() {
                return Err((at("name"), "must not be empty".into()));
            }
            if self.class_index(&c.name) != Some(i) {
                return Err((at("name"), format!("duplicate class {:?}", c.name)));
            }
            if !nonneg(c.share) {
                return Err((at("share"), "must be a non-negative number".into()));
            }
            for (field, ms) in [
                ("deadline_ms", c.deadline_ms),
                ("displace_within_ms", c.displace_within_ms),
            ] {
                if ms.is_some_and(|d| d == 0 || d > 86_400_000) {
                    return Err((at(field), "must be between 1 and 86400000".into()));
                }
            }
            if let Err((f, m)) = c.prompt_tokens.validate() {
                return Err((at(&format!("prompt_tokens.{f}")), m));
            }
            if let Err((f, m)) = c.output_tokens.validate() {
                return Err((at(&format!("output_tokens.{f}")), m));
            }
            if c.storm_retries > 100 {
                return Err((at("storm_retries"), "must be at most 100".into()));
            }
        }
        crate::tenants::validate(self)?;
        let a = &self.arrivals;
        // With tenants, the scenario's own arrivals may be none at all (rate 0).
        let silent = a.rate == 0.0 && !self.tenants.is_empty();
        if a.process != Process::Trace {
            if !((pos(a.rate) || silent) && a.rate <= 1e6) {
                return err(
                    "arrivals.rate",
                    "must be a positive number of requests per second",
                );
            }
            if self.classes.iter().map(|c| c.share).sum::<f64>() <= 0.0
                && a.class_sequence.is_empty()
            {
                return err("classes", "at least one class needs a positive share");
            }
        }
        if let Some(cv) = a.cv {
            if !(pos(cv) && cv <= 20.0) {
                return err("arrivals.cv", "must be between 0 and 20");
            }
        }
        for (i, st) in a.steps.iter().enumerate() {
            let at = |f: &str| format!("arrivals.steps[{i}].{f}");
            if !nonneg(st.from_s) {
                return Err((at("from_s"), "must be a non-negative number".into()));
            }
            if !(st.to_s.is_finite() && st.to_s > st.from_s) {
                return Err((at("to_s"), "must be after from_s".into()));
            }
            if !(nonneg(st.factor) && st.factor <= 1e4) {
                return Err((at("factor"), "must be a non-negative number".into()));
            }
        }
        crate::shape::validate_in(self)?;
        for (i, name) in a.class_sequence.iter().enumerate() {
            if self.class_index(name).is_none() {
                return Err((
                    format!("arrivals.class_sequence[{i}]"),
                    format!("unknown class {name:?}"),
                ));
            }
        }
        match (&self.trace, a.process) {
            (None, Process::Trace) => {
                return err(
                    "trace",
                    "arrivals.process = \"trace\" needs a [trace] table",
                )
            }
            (Some(_), p) if p != Process::Trace => {
                return err("arrivals.process", "a [trace] needs process = \"trace\"")
            }
            (Some(t), _) => {
                if t.path.trim().is_empty() {
                    return err("trace.path", "must name a CSV file");
                }
                if t.load.is_some_and(|l| !(pos(l) && l <= 1000.0)) {
                    return err("trace.load", "must be a positive multiple of capacity");
                }
                for (i, r) in t.rules.iter().enumerate() {
                    if self.class_index(&r.class).is_none() {
                        return Err((
                            format!("trace.rules[{i}].class"),
                            format!("unknown class {:?}", r.class),
                        ));
                    }
                    if !(nonneg(r.fraction) && r.fraction <= 1.0) {
                        return Err((
                            format!("trace.rules[{i}].fraction"),
                            "must be between 0 and 1".into(),
                        ));
                    }
                }
            }
            _ => {}
        }
        for (i, st) in self.stuck.iter().enumerate() {
            let at = |f: &str| format!("stuck[{i}].{f}");
            if !nonneg(st.at_s) {
                return Err((at("at_s"), "must be a non-negative number".into()));
            }
            if !(pos(st.duration_s) && st.duration_s <= 86_400.0) {
                return Err((at("duration_s"), "must be a positive number".into()));
            }
            if self.class_index(&st.class).is_none() {
                return Err((at("class"), format!("unknown class {:?}", st.class)));
            }
        }
        for (i, f) in self.faults.iter().enumerate() {
            let at = |k: &str| format!("faults[{i}].{k}");
            if !nonneg(f.at_s) {
                return Err((at("at_s"), "must be a non-negative number".into()));
            }
            if !(pos(f.duration_s) && f.duration_s <= 86_400.0) {
                return Err((
                    at("duration_s"),
                    "must be a positive number of seconds".into(),
                ));
            }
            if !(nonneg(f.rate) && f.rate <= 1.0) {
                return Err((at("rate"), "must be between 0 and 1".into()));
            }
            match (f.kind, f.factor) {
                (FaultKind::Latency, Some(x)) if pos(x) && x <= 1000.0 => {}
                (FaultKind::Latency, _) => {
                    return Err((
                        at("factor"),
                        "a latency fault needs a factor in (0, 1000]".into(),
                    ))
                }
                (_, Some(_)) => {
                    return Err((at("factor"), "only a latency fault takes a factor".into()))
                }
                (_, None) => {}
            }
            match (f.kind, f.status) {
                (FaultKind::Error, Some(st)) if !(400..=599).contains(&st) => {
                    return Err((at("status"), "must be an error status, 400..=599".into()))
                }
                (FaultKind::Error, _) | (_, None) => {}
                (_, Some(_)) => {
                    return Err((at("status"), "only an error fault takes a status".into()))
                }
            }
            if let Some(c) = &f.class {
                if self.class_index(c).is_none() {
                    return Err((at("class"), format!("unknown class {c:?}")));
                }
            }
        }
        let b = &self.baselines;
        if b.max_queue == Some(0) {
            return err("baselines.max_queue", "must be at least 1");
        }
        if b.seed000_depth_factor.is_some_and(|k| !nonneg(k)) {
            return err("baselines.seed000_depth_factor", "must be non-negative");
        }
        if b.codel_target_ms == Some(0) || b.codel_interval_ms == Some(0) {
            return err("baselines", "codel target and interval must be positive");
        }
        if let (Some(lo), Some(hi)) = (b.gradient_min_limit, b.gradient_max_limit) {
            if lo == 0 || lo > hi {
                return err(
                    "baselines.gradient_min_limit",
                    "must be positive and at most gradient_max_limit",
                );
            }
        }
        if self.slackgate.max_depth_factor.is_some_and(|k| !nonneg(k)) {
            return err("slackgate.max_depth_factor", "must be non-negative");
        }
        if let Some(n) = &self.neighbour {
            n.validate(self.duration_s)?;
        }
        Ok(())
    }

    /// Nominal service time (ms) of a job at concurrency 1.
    pub fn service_ms(&self, prompt_tokens: u32, output_tokens: u32) -> f64 {
        self.service(prompt_tokens, output_tokens, 1.0).0
    }

    /// Service time and time to the first token (ms) of a job whose decoding runs `slow`
    /// times slower than alone: the upstream's cost model, in one place.
    ///
    /// With `decode_ms_per_1k_context`, output token i (0-based) decodes at a context of
    /// P + i + 1/2 tokens (the middle of its step), so the O tokens add
    /// `decode_ms_per_1k_context x O x (P + O/2) / 1000` in all and the first one
    /// `decode_ms_per_1k_context x (P + 1/2) / 1000`; the stub's `batching:` latency steps
    /// the same way, token by token.
    pub fn service(&self, prompt_tokens: u32, output_tokens: u32, slow: f64) -> (f64, f64) {
        let u = &self.upstream;
        let prefill = u.overhead_ms + u.prefill_ms_per_token * f64::from(prompt_tokens);
        let decode = u.decode_ms_per_token * slow;
        if u.decode_ms_per_1k_context > 0.0 {
            let (p, o) = (f64::from(prompt_tokens), f64::from(output_tokens));
            let per_ctx = u.decode_ms_per_1k_context / 1000.0 * slow;
            let first = prefill
                + if output_tokens > 0 {
                    decode + per_ctx * (p + 0.5)
                } else {
                    0.0
                };
            let total = prefill + decode * o + per_ctx * o * (p + o / 2.0);
            return (total, first);
        }
        // Kept apart (not the branch above with a zero term) so scenarios without a context
        // term compute exactly the figures they always did.
        let first = prefill + if output_tokens > 0 { decode } else { 0.0 };
        (prefill + decode * f64::from(output_tokens), first)
    }

    /// The fault, if any, that hits a request arriving at `at_ms` of class `class` with id
    /// `request`: the first `[[faults]]` window containing the arrival whose class matches and
    /// whose `rate` draw (a hash of the seed, the request and the fault, so the simulator and
    /// the drill pick the same requests) falls below the rate.
    pub fn fault_for(&self, request: u64, at_ms: u64, class: usize) -> Option<&Fault> {
        self.faults.iter().enumerate().find_map(|(i, f)| {
            let from = f.at_s * 1000.0;
            let to = from + f.duration_s * 1000.0;
            let t = at_ms as f64;
            let class_ok = match &f.class {
                None => true,
                Some(c) => self.class_index(c) == Some(class),
            };
            let hit = crate::rng::unit_hash(self.seed, request, i as u64) < f.rate;
            (t >= from && t < to && class_ok && hit).then_some(f)
        })
    }

    /// The deadline tightest of all classes (ms), for deriving baseline defaults.
    pub fn tightest_deadline_ms(&self) -> Option<u64> {
        self.classes.iter().filter_map(|c| c.deadline_ms).min()
    }
}

/// Pull the field name out of a serde message such as "unknown field `foo`, expected ...".
fn field_of_message(message: &str) -> Option<String> {
    for marker in ["unknown field `", "missing field `"] {
        if let Some(rest) = message.split(marker).nth(1) {
            return rest.split('`').next().map(str::to_string);
        }
    }
    None
}

/// Best-effort line of a dotted field path (`classes[1].deadline_ms`) in the TOML text: finds
/// the table header (counting repeated `[[x]]` headers), then the key inside it. Returns 0
/// when it cannot tell.
pub fn locate(text: &str, path: &str) -> usize {
    let mut parts: Vec<&str> = path.split('.').collect();
    let key = parts.pop().unwrap_or("");
    let (key, _) = split_index(key);
    // The innermost table named by the path, with the index of its occurrence.
    let mut header = String::new();
    let mut occurrence = 0usize;
    for p in &parts {
        let (name, idx) = split_index(p);
        if !header.is_empty() {
            header.push('.');
        }
        header.push_str(name);
        occurrence = idx.unwrap_or(0);
    }
    let mut in_table = parts.is_empty();
    let mut seen = 0usize;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with('[') {
            let name = t.trim_matches(|c| c == '[' || c == ']').trim();
            if !parts.is_empty() && name == header {
                in_table = seen == occurrence;
                seen += 1;
                if key.is_empty() && in_table {
                    return n + 1;
                }
            } else {
                in_table = false;
            }
            continue;
        }
        if in_table {
            if let Some((k, _)) = t.split_once('=') {
                if k.trim() == key {
                    return n + 1;
                }
            }
        }
    }
    // A whole table (`trace`) or a key we could not find: point at the header.
    if !header.is_empty() {
        let want = format!("[{header}]");
        let want2 = format!("[[{header}]]");
        for (n, line) in text.lines().enumerate() {
            let t = line.trim();
            if t == want || t == want2 {
                return n + 1;
            }
        }
    }
    0
}

fn split_index(s: &str) -> (&str, Option<usize>) {
    match s.split_once('[') {
        Some((name, rest)) => (name, rest.trim_end_matches(']').parse().ok()),
        None => (s, None),
    }
}

#[cfg(test)]
#[path = "scenario_tests.rs"]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
