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

use crate::config::{ConfigError, GateConfig, OverflowMode, PriorConfig};
use crate::estimator::{
    ErrorSummary, ErrorTracker, Estimate, Estimator, EstimatorSnapshot, Sharing,
};
use crate::ledger::{HoldRecord, Ledger, LedgerReject, SettleError};
use crate::queue::{ClassQueue, QueueKey};
use crate::reason::{Action, Reason};
use crate::tokens::TokenCounter;
use crate::Millis;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Identifies one admitted (or rejected) request; assigned by the gate, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Index of a class in the configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ClassId(pub usize);

/// Index of a pool in the configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PoolId(pub usize);

/// A request as the core sees it: everything I/O-related is already parsed away.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// Resolved class (see [`Gate::classify`]); `None` means unlabeled with no default.
    pub class: Option<ClassId>,
    /// Absolute deadline for the whole response. `None`: the class default applies.
    pub deadline: Option<Millis>,
    /// Absolute deadline for the first token (`x-slo-ttft-ms`).
    pub first_token_deadline: Option<Millis>,
    /// Estimated prompt size, used when `prompt_chars` is `None` (the simulator knows tokens).
    pub prompt_tokens: u32,
    /// The prompt's length in characters: the gate turns it into tokens with the relation it
    /// learns from the upstream's `usage.prompt_tokens` (see [`crate::tokens`]), so it predicts
    /// with the same count it learns from.
    pub prompt_chars: Option<u32>,
    /// The model the request names, for a per-model characters-per-token relation.
    pub model: Option<String>,
    /// The request's output cap (`max_tokens` / `max_completion_tokens`). `Some(0)` for
    /// requests that generate nothing (embeddings).
    pub max_tokens: Option<u32>,
    /// The client's (or an output-length predictor's) guess of the output length, used
    /// instead of the class's learned mean when given (capped by `max_tokens`). The simulator
    /// passes the true length times its estimator noise here.
    pub expected_output_tokens: Option<u32>,
    /// The client fixed its deadline in absolute time (`X-Deadline`): its slack shrinks as
    /// fast as the queue drains, so a retry of the same request cannot succeed.
    pub deadline_is_absolute: bool,
    /// Idempotency key; `None`: the gate generates one (such a request can never be a
    /// duplicate).
    pub idempotency_key: Option<String>,
    /// Hashed tenant, for token grants.
    pub tenant: Option<String>,
    /// Attempt number (0 for the first try).
    pub attempt: u32,
    /// Tokens to hold; `None`: prompt tokens + expected output.
    pub hold_tokens: Option<u64>,
    /// A reservation-API hold: the worker calls the model itself and settles it by key. Once
    /// told to go it is never dropped on slack (only its TTL ends it), and only reservations
    /// can be settled by key.
    pub reservation: bool,
}

/// The answer at arrival, with every figure the decision log and the 429 body carry.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Assigned id (also for rejections, so log lines can be joined).
    pub job_id: JobId,
    /// Resolved class, if any.
    pub class: Option<ClassId>,
    /// Pool the class runs on.
    pub pool: Option<PoolId>,
    /// `admit` or `reject`.
    pub action: Action,
    /// Why.
    pub reason: Reason,
    /// Age of the oldest job this request would wait behind.
    pub queue_age_ms: u64,
    /// Deadline minus now minus own estimated service (the tighter of the response and
    /// first-token deadlines); `None` for best-effort work.
    pub deadline_slack_ms: Option<i64>,
    /// Projected time until a slot is free for this request.
    pub projected_wait_ms: u64,
    /// Estimated service time once dispatched.
    pub est_service_ms: u64,
    /// Expected output tokens used for the estimate.
    pub expected_output_tokens: u32,
    /// Requests in flight on the pool at decision time.
    pub in_flight: u32,
    /// Jobs queued ahead of this one (same or higher priority) at decision time.
    pub depth: u32,
    /// For rejections: when a retry could succeed.
    pub retry_after_ms: Option<u64>,
    /// For rejections: whether a retry can succeed soon (`x-should-retry`).
    pub should_retry: bool,
    /// The absolute deadline the gate holds the request to.
    pub deadline: Option<Millis>,
    /// The idempotency key the hold is (or would be) under.
    pub idempotency_key: String,
    /// Tokens held for this request (0 when rejected).
    pub tokens_held: u64,
    /// For ledger rejections: duplicate, retry cap or budget details.
    pub ledger: Option<LedgerReject>,
    /// Shadow mode was in force when the request was decided: like every job of shadow
    /// mode it is held to no deadline (never dropped or cut off late), even when admitted
    /// as it stands, since shadow-admitted work may have taken its place in the queue.
    pub shadow: bool,
    /// An admission by displacement (`displace_within_ms`): the queued job refused to make
    /// room for this one. [`Gate::poll`] yields its `Drop` (reason `displaced`) before any
    /// dispatch. In shadow mode: the job that would have been displaced (nothing is done).
    pub displaced: Option<JobId>,
}

impl Decision {
    /// True when the request was queued (admitted, or admitted in shadow mode although the
    /// gate would have rejected it).
    pub fn admitted(&self) -> bool {
        matches!(self.action, Action::Admit | Action::ShadowReject)
    }
}

/// Something the caller must act on, yielded by [`Gate::poll`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Event {
    /// Send this job upstream now; it holds a slot until `on_complete` or `cancel`.
    Dispatch {
        /// The job.
        job_id: JobId,
        /// Its class.
        class: ClassId,
        /// Its pool.
        pool: PoolId,
        /// Time it spent queued.
        queue_wait_ms: u64,
        /// Slack left at dispatch (deadline - now - estimated service).
        deadline_slack_ms: Option<i64>,
        /// Estimated service time.
        est_service_ms: u64,
        /// In flight on the pool after this dispatch.
        in_flight: u32,
        /// Still queued on the pool.
        depth: u32,
    },
    /// This queued job will not be sent: answer its client with the reason.
    Drop {
        /// The job.
        job_id: JobId,
        /// Its class.
        class: ClassId,
        /// Its pool.
        pool: PoolId,
        /// Why (`deadline_unmeetable`).
        reason: Reason,
        /// Time it spent queued.
        queue_wait_ms: u64,
        /// Slack left (negative: it cannot make its deadline).
        deadline_slack_ms: Option<i64>,
        /// Projected wait for a slot at the time of the drop.
        projected_wait_ms: u64,
        /// In flight on the pool.
        in_flight: u32,
        /// Still queued on the pool.
        depth: u32,
        /// When a retry could succeed, for drops whose client may try again (`displaced`);
        /// `None`: the caller's default for the reason.
        retry_after_ms: Option<u64>,
        /// Whether a retry can succeed soon (`x-should-retry`), with `retry_after_ms`.
        should_retry: bool,
    },
}

impl Event {
    /// The job this event is about.
    pub fn job_id(&self) -> JobId {
        match self {
            Event::Dispatch { job_id, .. } | Event::Drop { job_id, .. } => *job_id,
        }
    }
}

/// What the upstream reported when a job ended.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Completion {
    /// The response ended normally (false: upstream error, reset, timeout).
    pub ok: bool,
    /// Prompt tokens from the upstream's `usage`, when reported.
    pub prompt_tokens: Option<u32>,
    /// Completion tokens from the upstream's `usage` (or counted from the stream).
    pub completion_tokens: Option<u32>,
}

/// A job that ended (completed or cancelled), with its timings.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Completed {
    /// The job.
    pub job_id: JobId,
    /// Its class.
    pub class: ClassId,
    /// Its pool.
    pub pool: PoolId,
    /// Whether it had been dispatched (false: cancelled while queued).
    pub dispatched: bool,
    /// Time queued before dispatch (or until cancel).
    pub queue_wait_ms: u64,
    /// Time from dispatch to the end (0 if never dispatched).
    pub service_ms: u64,
    /// Time from arrival to the end.
    pub turnaround_ms: u64,
    /// Time from arrival to the first token, if one was seen.
    pub time_to_first_token_ms: Option<u64>,
    /// Deadline minus the end time (negative: late); `None` for best effort.
    pub deadline_slack_ms: Option<i64>,
    /// In flight on the pool after the slot was released.
    pub in_flight: u32,
    /// Queued on the pool.
    pub depth: u32,
    /// The job's hold as settled in the ledger (spent or wasted tokens).
    pub hold: Option<HoldRecord>,
    /// The service time the gate estimated for it when it was dispatched (admission's
    /// estimate, refreshed with what was learned while it queued and what it then shared the
    /// server with); for a job that never ran, admission's.
    pub est_service_ms: u64,
    /// Mean number of requests in flight on the pool while it ran (itself included); 0 if it
    /// never ran.
    pub concurrency: f64,
    /// Mean total context (tokens) of the other requests in flight while it ran.
    pub others_context: f64,
}

impl Completed {
    /// True when the job had a deadline and ended after it.
    pub fn missed_deadline(&self) -> bool {
        matches!(self.deadline_slack_ms, Some(s) if s < 0)
    }
}

/// Live view of one class, for metrics, `/stats` and the admin API.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassSnapshot {
    /// Class name.
    pub name: String,
    /// Pool name.
    pub pool: String,
    /// Priority.
    pub priority: u32,
    /// Switched on?
    pub enabled: bool,
    /// Jobs queued.
    pub depth: u32,
    /// Age of the oldest queued job.
    pub oldest_queue_age_ms: u64,
    /// Sum of the estimated service of queued jobs.
    pub queued_work_ms: u64,
    /// Projected wait a new request of this class would see now.
    pub projected_wait_ms: u64,
    /// Expected output tokens learned for this class.
    pub expected_output_tokens: u32,
    /// Jobs of this class holding a slot on this pool.
    pub in_flight: u32,
    /// Being drained (admin API): new work is refused with `class_disabled`.
    pub draining: bool,
    /// This row is the class's overflow lane: its work routed to its `overflow_pool`.
    pub overflow: bool,
    /// Removed by a config reload: it takes no new work; what it already had runs to its end.
    pub retired: bool,
    /// The class's default deadline (`deadline_ms`), against which its queue age is slack.
    pub deadline_ms: Option<u64>,
    /// The class's queue-age threshold (`max_queue_age_ms`).
    pub max_queue_age_ms: Option<u64>,
    /// How far the estimates of the class's recent completions were from what they took.
    pub est_error: ErrorSummary,
    /// Requests admitted as `probe` so far.
    pub probes: u64,
}

/// Live view of one pool.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolSnapshot {
    /// Pool name.
    pub name: String,
    /// Slots (`max_in_flight`).
    pub slots: u32,
    /// Slots taken.
    pub in_flight: u32,
    /// Jobs queued on the pool, all classes.
    pub depth: u32,
    /// Estimated remaining work of in-flight jobs.
    pub in_flight_remaining_ms: u64,
    /// How long the oldest in-flight job has held its slot (a stuck slot shows here while
    /// the queue itself may be empty: seed 002's eval).
    pub oldest_in_flight_age_ms: u64,
    /// Learned service-time model.
    pub estimator: EstimatorSnapshot,
    /// Whether the estimator learns from completions (`prior.learn`).
    pub learning: bool,
    /// Fewer completions than the warm-up needs: an idle pool admits on its prior anyway.
    pub warming_up: bool,
    /// Removed by a config reload: it takes no new work; what it already had runs to its end.
    pub retired: bool,
    /// Learned characters of prompt text per token (pool-wide).
    pub chars_per_token: f64,
    /// Learned tokens the chat template adds to every prompt (pool-wide).
    pub template_tokens: f64,
    /// Mean number of requests in flight while recent completions ran.
    pub mean_concurrency: f64,
}

/// Live view of the whole gate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GateSnapshot {
    /// The time of the snapshot.
    pub now_ms: Millis,
    /// Rollback flag.
    pub admit_always: bool,
    /// Shadow mode: would-be rejections are admitted and reported as `shadow_reject`.
    pub shadow: bool,
    /// Unlabeled work is refused (`reject_unlabeled`) while a drain asks for it, even with a
    /// default class.
    pub unlabeled_suspended: bool,
    /// The gate is shutting down: the time by which queued work must have finished.
    pub closing_at_ms: Option<Millis>,
    /// Per class.
    pub classes: Vec<ClassSnapshot>,
    /// Per pool.
    pub pools: Vec<PoolSnapshot>,
}

#[derive(Clone, Debug)]
struct Job {
    /// The lane (class entry) it is queued on; see [`ClassState`].
    class: ClassId,
    /// The pool it runs on (its lane's pool, fixed at admission: a reload that moves the
    /// class leaves this job where it was admitted).
    pool: PoolId,
    seq: u64,
    arrived_at: Millis,
    deadline: Option<Millis>,
    first_token_deadline: Option<Millis>,
    est: Estimate,
    prompt_tokens: u32,
    /// The estimator's own figure for its service (before the class's correction): what the
    /// correction learns from at completion.
    model_service_ms: u64,
    /// The output length its estimate assumed.
    expected_output: u32,
    /// Its context in tokens (prompt and half the expected output): what it adds to the
    /// attention work of every request it shares the server with.
    context: f64,
    /// The prompt's characters and model, to learn the token relation at completion.
    prompt_chars: Option<u32>,
    model: Option<String>,
    state: JobState,
    first_token_at: Option<Millis>,
    /// The output cap (`Some(0)`: generates nothing, e.g. embeddings).
    max_tokens: Option<u32>,
    /// Admitted while the estimator warms up: its estimate is not trusted enough to drop it.
    protected: bool,
    /// Idempotency key of its hold in the ledger.
    key: String,
    /// The gate made the key up (the client sent none): nobody can replay it.
    generated_key: bool,
    /// Placed through the reservation API.
    reservation: bool,
    /// The client fixed its deadline in absolute time: a retry cannot get more slack.
    deadline_is_absolute: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum JobState {
    Queued,
    /// Dispatched at `started_at`, when the pool's in-flight integrals stood at
    /// `busy_at_start` (count) and `context_at_start` (context).
    InFlight {
        started_at: Millis,
        busy_at_start: u128,
        context_at_start: f64,
        /// The pool's count of prompt tokens dispatched, just after its own.
        prefill_at_start: u64,
    },
}

impl Job {
    /// Dispatch order within a class: earliest deadline first (the response deadline or the
    /// first-token deadline, whichever is earlier); best-effort jobs last, in arrival order.
    fn key(&self) -> QueueKey {
        let d = match (self.deadline, self.first_token_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // `Millis::MAX` is reserved for best effort, so a deadline at the very end of time
        // still sorts (and is walked by `tick`) as a deadline.
        (d.map_or(Millis::MAX, |d| d.min(Millis::MAX - 1)), self.seq)
    }

    /// Tightest slack if the job started after `wait` from `now`.
    fn slack_after(&self, now: Millis, wait: u64) -> Option<i64> {
        slack(
            now,
            wait,
            self.deadline,
            self.first_token_deadline,
            self.est,
        )
    }
}

fn slack(
    now: Millis,
    wait: u64,
    deadline: Option<Millis>,
    first_token_deadline: Option<Millis>,
    est: Estimate,
) -> Option<i64> {
    let start = now.saturating_add(wait);
    let whole = deadline.map(|d| signed_diff(d, start.saturating_add(est.service_ms)));
    let first =
        first_token_deadline.map(|d| signed_diff(d, start.saturating_add(est.first_token_ms)));
    match (whole, first) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn signed_diff(a: Millis, b: Millis) -> i64 {
    let d = i128::from(a) - i128::from(b);
    d.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// One lane: a class's queue on one pool. Every configured class has its primary lane on its
/// own pool; a class with an `overflow_pool` has a second lane there, holding the work routed
/// to it. Lanes are indexed by [`ClassId`]: the first ones are the configured classes, in
/// order, and ids never change or get reused while the gate lives (a reload appends, and a
/// removed lane is only retired), so a queued or in-flight job's lane is always valid.
#[derive(Debug)]
struct ClassState {
    name: String,
    pool: PoolId,
    priority: u32,
    enabled: bool,
    /// Drained through the admin API: refuses new work like a disabled class. Runtime state,
    /// kept across reloads.
    draining: bool,
    default_deadline_ms: Option<u64>,
    max_queue_age_ms: Option<u64>,
    queue: ClassQueue,
    /// Learned mean output length (EWMA), seeded from the class prior. Only a primary lane's
    /// is used: an overflow lane learns into its class's.
    expected_output: Option<f64>,
    /// A tracked upper quantile (`OUTPUT_QUANTILE`) of the output length: what a request that
    /// gives no size is assumed to need for its own deadline check.
    output_q: Option<f64>,
    /// Configured `retry_hint`.
    retry_hint: Option<String>,
    /// The class's overflow lane and what to do with it (primary lanes only).
    overflow: Option<(ClassId, OverflowMode)>,
    /// For an overflow lane: the class it serves.
    overflow_of: Option<ClassId>,
    /// Removed by a reload: no new work; its queued and in-flight jobs run to their end.
    retired: bool,
    /// Configured `displace_within_ms` (primary lanes only): how recently admitted a queued
    /// job must be for a shorter newcomer to take its place.
    displace_within_ms: Option<u64>,
    /// Relative errors of the estimates of the class's recent completions (primary lanes:
    /// an overflow lane records into its class's).
    errors: ErrorTracker,
    /// Configured `probe_interval_ms` (0: no probes).
    probe_interval_ms: u64,
    /// When the class last admitted a probe, and which job that was (one live at a time).
    last_probe: Option<(Millis, JobId)>,
    /// Probes admitted so far.
    probes: u64,
    /// When the class last admitted a request (probes aside).
    last_admit_at: Option<Millis>,
    /// actual / estimated service of the class's recent completions, against the estimator's
    /// own figure: the class's empirical correction (see [`ClassState::correction`]).
    ratios: VecDeque<f64>,
    /// Prompt tokens of other jobs that started while the class's recent completions ran
    /// (EWMA): what a newcomer of the class should expect to be held up by.
    recent_others_prefill: f64,
    /// What admission reads of `errors` and `ratios`, kept current at each completion.
    record: ClassRecord,
}

/// A class's record as admission reads it (see [`ClassState::refresh_record`]).
#[derive(Clone, Copy, Debug)]
struct ClassRecord {
    errors: ErrorSummary,
    /// The largest relative error among the last [`CONFIRM_RECENT`] completions.
    recent_worst: f64,
    correction: f64,
}

impl Default for ClassRecord {
    fn default() -> Self {
        ClassRecord {
            errors: ErrorSummary::default(),
            recent_worst: 0.0,
            correction: 1.0,
        }
    }
}

impl ClassState {
    /// A per-class empirical model on top of the shared estimator: the median of actual over
    /// estimated service of the class's last completions. The estimator fits every class's
    /// requests with one set of coefficients, and a class whose requests the fit serves badly
    /// (rare long batch jobs among many short chats; what its requests share the server with)
    /// stays off by the same ratio; this takes that ratio out. 1 until a handful completed;
    /// kept within [`CORRECTION_RANGE`].
    fn correction(&self) -> f64 {
        self.record.correction
    }

    /// Recompute the figures admission reads on every offer ([`ClassRecord`]) from the
    /// class's windows: once per completion, not per decision (they sort).
    fn refresh_record(&mut self) {
        let correction = if self.ratios.len() < CONFIRM_SAMPLES as usize {
            1.0
        } else {
            let mut v: Vec<f64> = self.ratios.iter().copied().collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2].clamp(CORRECTION_RANGE.0, CORRECTION_RANGE.1)
        };
        self.record = ClassRecord {
            errors: self.errors.summary(),
            recent_worst: self.errors.recent_max(CONFIRM_RECENT),
            correction,
        };
    }

    /// The share by which a request's wait and service are padded before they are held to its
    /// deadline: the 90th percentile of the class's recent relative errors, within
    /// [0, MAX_MARGIN] (0 until a handful completed, and for a frozen estimator, whose figures
    /// are the operator's). The median was tried first: against a real llama-server it left
    /// 3.6% of admitted interactive requests late or dropped (`docs/config.md`).
    fn margin(&self, learning: bool) -> f64 {
        let e = self.record.errors;
        if !learning || e.samples < CONFIRM_SAMPLES {
            return 0.0;
        }
        e.p90.clamp(0.0, MAX_MARGIN)
    }

    /// Record a completion's actual service against the estimator's figure for it.
    fn learn_ratio(&mut self, model_ms: u64, actual_ms: u64) {
        let r = actual_ms.max(1) as f64 / model_ms.max(1) as f64;
        if !r.is_finite() {
            return;
        }
        if self.ratios.len() >= CORRECTION_WINDOW {
            self.ratios.pop_front();
        }
        self.ratios.push_back(r);
    }
}

/// Scale an estimate by a class's correction.
fn scale_estimate(e: Estimate, factor: f64) -> Estimate {
    let f = |v: u64| ((v as f64) * factor).round().clamp(1.0, 1e15) as u64;
    Estimate {
        service_ms: f(e.service_ms),
        first_token_ms: f(e.first_token_ms).min(f(e.service_ms)),
    }
}

#[derive(Debug)]
struct PoolState {
    /// The configuration it was built from: a reload keeps the learned estimator unless
    /// the prior or the upstream changed.
    prior: PriorConfig,
    upstream: Option<String>,
    /// Removed by a reload: no class admits to it; it keeps its slots until its jobs end.
    retired: bool,
    name: String,
    slots: u32,
    max_depth_factor: Option<f64>,
    max_queued: u32,
    default_output_tokens: u32,
    estimator: Estimator,
    /// Prompt characters to tokens, learned from the upstream's usage.
    tokens: TokenCounter,
    /// Integral of the in-flight count over time (job-milliseconds) up to `busy_at`: a job's
    /// mean concurrency is the integral's growth over its life divided by its duration.
    busy: u128,
    busy_at: Millis,
    /// Total context of the jobs in flight now, and its integral over time up to `busy_at`.
    context_now: f64,
    context_busy: f64,
    /// Mean context of each other job in flight during recent completions (EWMA).
    recent_other_context: f64,
    /// Prompt tokens of every job dispatched so far (a counter): the prefill work that
    /// started beside a job is its growth over the job's life.
    prefill_dispatched: u64,
    /// Mean concurrency of recent completions (EWMA): what a newcomer will likely share the
    /// server with once the pool is in its usual state.
    recent_concurrency: f64,
    /// In-flight jobs: id -> (started_at, estimated service).
    in_flight: BTreeMap<JobId, (Millis, u64)>,
    /// Classes of this pool, highest priority first (ties by class index, for determinism).
    classes: Vec<ClassId>,
}

/// Estimated time left of one in-flight job: its estimate minus what it has run. A job past
/// its estimate is treated as likely to run about as long again as it has overrun (a stuck
/// slot must look stuck, not about to free), and never as done: an eighth of its estimate is
/// the floor once it has overrun. A job still inside its estimate gets no floor: padding
/// the last seconds of every running job would make a later re-check (`tick`) see waits
/// that the admission did not, and drop work that was going to make it.
fn remaining(now: Millis, started: Millis, est: u64) -> u64 {
    let elapsed = now.saturating_sub(started);
    if elapsed < est {
        return est - elapsed;
    }
    (elapsed - est).max(est / 8).max(1)
}

/// Slot counts up to this are handled on the stack when projecting a wait.
const STACK_SLOTS: usize = 64;

impl PoolState {
    /// Bring the in-flight integral up to `now`; call before the in-flight set changes.
    fn advance_busy(&mut self, now: Millis) {
        let dt = now.saturating_sub(self.busy_at);
        self.busy = self
            .busy
            .saturating_add(u128::from(dt) * self.in_flight.len() as u128);
        self.context_busy += dt as f64 * self.context_now;
        self.busy_at = self.busy_at.max(now);
    }

    /// What a job dispatched at `started_at` shared the server with until `now`.
    fn sharing_since(
        &self,
        now: Millis,
        started_at: Millis,
        (busy_at_start, context_at_start, prefill_at_start): (u128, f64, u64),
        own_context: f64,
    ) -> Sharing {
        let concurrency = self.concurrency_since(now, started_at, busy_at_start);
        let dt = now.saturating_sub(started_at);
        let total = if dt == 0 {
            self.context_now
        } else {
            let area =
                self.context_busy + now.saturating_sub(self.busy_at) as f64 * self.context_now;
            (area - context_at_start) / dt as f64
        };
        Sharing {
            concurrency,
            others_context: (total - own_context).max(0.0),
            others_prefill: self.prefill_dispatched.saturating_sub(prefill_at_start) as f64,
        }
    }

    /// The integral as it stands at `now` (without moving it).
    fn busy_until(&self, now: Millis) -> u128 {
        let dt = now.saturating_sub(self.busy_at);
        self.busy
            .saturating_add(u128::from(dt) * self.in_flight.len() as u128)
    }

    /// Mean in-flight count (at least 1: the job itself) over a job's life so far.
    fn concurrency_since(&self, now: Millis, started_at: Millis, busy_at_start: u128) -> f64 {
        let dt = now.saturating_sub(started_at);
        if dt == 0 {
            return (self.in_flight.len() as f64).max(1.0);
        }
        let area = self.busy_until(now).saturating_sub(busy_at_start);
        (area as f64 / dt as f64).max(1.0)
    }

    /// How many requests a newcomer will share the server with while it runs: every slot's
    /// worth when it has to wait for one (the pool is saturated), otherwise what runs now plus
    /// what is queued ahead and itself, or the recent usual if that is more (others arrive
    /// while it runs); never more than the slots.
    fn expected_concurrency(&self, wait: u64, count_ahead: u32) -> f64 {
        let slots = f64::from(self.slots.max(1));
        if wait > 0 {
            return slots;
        }
        let others = self.in_flight.len() as f64 + f64::from(count_ahead);
        if others == 0.0 {
            // An idle pool: alone, whatever ran before (the recent mean is history and only
            // decays with completions, which an idle pool does not have).
            return 1.0;
        }
        (others + 1.0).max(self.recent_concurrency).min(slots)
    }

    /// [`PoolState::expected_concurrency`] with the others' context: each other request as
    /// long as the longer of what runs now (mean) and what recently ran beside completions.
    /// `others_prefill`: what the class's recent completions saw start beside them.
    fn expected_sharing(&self, wait: u64, count_ahead: u32, others_prefill: f64) -> Sharing {
        let k = self.expected_concurrency(wait, count_ahead);
        let current = if self.in_flight.is_empty() {
            0.0
        } else {
            self.context_now / self.in_flight.len() as f64
        };
        Sharing {
            others_prefill,
            ..Sharing::with(k, current.max(self.recent_other_context))
        }
    }

    /// A request's prompt tokens: counted from its characters with the learned relation when
    /// the gateway gave them, else as the caller estimated.
    fn prompt_tokens(&self, req: &Request) -> u32 {
        match req.prompt_chars {
            Some(chars) => self.tokens.tokens(chars, req.model.as_deref()),
            None => req.prompt_tokens,
        }
    }

    /// Estimated work left of all in-flight jobs (saturating: a few slots stuck for ages must
    /// not wrap to a short wait).
    fn in_flight_remaining(&self, now: Millis) -> u64 {
        self.in_flight
            .values()
            .map(|&(started, est)| remaining(now, started, est))
            .fold(0, u64::saturating_add)
    }

    /// When a slot is free for a job behind `work_ahead` ms of queued work: "water filling"
    /// over the slots. Each slot is free after its in-flight job's remaining time (free slots
    /// at once); the queued work ahead pours into the slots as they free up; the job starts
    /// when that work is absorbed. A long job thus only takes its own slot out of the
    /// picture instead of being averaged over every slot. O(slots).
    fn wait_for_slot(&self, now: Millis, work_ahead: u64) -> u64 {
        let n = self.slot_count();
        let mut stack = [0u64; STACK_SLOTS];
        let mut heap = Vec::new();
        let r: &mut [u64] = if n <= STACK_SLOTS {
            &mut stack[..n]
        } else {
            heap.resize(n, 0);
            &mut heap
        };
        self.free_times(now, r);
        water_fill(r, work_ahead)
    }

    /// Entries [`PoolState::free_times`] needs: one per slot, or per in-flight job if more
    /// run than there are slots (slots lowered under load).
    fn slot_count(&self) -> usize {
        (self.slots as usize).max(1).max(self.in_flight.len())
    }

    /// When each slot frees, from now, sorted: in-flight jobs' remaining times, 0 for free
    /// slots. `r` has [`PoolState::slot_count`] entries.
    fn free_times(&self, now: Millis, r: &mut [u64]) {
        r.fill(0);
        for (slot, &(started, est)) in r.iter_mut().zip(self.in_flight.values()) {
            *slot = remaining(now, started, est);
        }
        r.sort_unstable();
    }

    /// How long the pool has failed to free a slot: when every slot is busy, the age of the
    /// youngest in-flight job (all of them have held their slot at least that long); 0 when a
    /// slot is free.
    fn slot_age(&self, now: Millis) -> u64 {
        if (self.in_flight.len() as u32) < self.slots {
            return 0;
        }
        self.in_flight
            .values()
            .map(|&(started, _)| now.saturating_sub(started))
            .min()
            .unwrap_or(0)
    }
}

/// Spread rejected clients out: add 0 to `percent`% to a Retry-After, deterministically from
/// the job id (splitmix64), so clients rejected together do not return in lockstep and the
/// same inputs still give the same decisions.
fn jitter(after_ms: u64, job_id: JobId, percent: u32) -> u64 {
    if percent == 0 || after_ms == 0 {
        return after_ms;
    }
    let mut z = job_id.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let span = u128::from(after_ms) * u128::from(percent.min(100)) / 100;
    let extra = if span == 0 {
        0
    } else {
        u128::from(z) % (span + 1)
    };
    (u128::from(after_ms) + extra).min(u128::from(u64::MAX)) as u64
}

/// [`water_fill`] for a sequence of non-decreasing amounts of work over the same slots, in
/// O(slots + queries) overall instead of O(slots) per query: the level only rises, so the
/// number of slots taking part only grows. `tick` asks once per queued job.
struct WaterFiller<'a> {
    r: &'a [u64],
    j: usize,
    prefix: u128,
}

impl<'a> WaterFiller<'a> {
    fn new(r: &'a [u64]) -> Self {
        WaterFiller {
            r,
            j: 0,
            prefix: r.first().map_or(0, |&v| u128::from(v)),
        }
    }

    /// `water_fill(r, work)`; `work` must not decrease between calls.
    fn level(&mut self, work: u64) -> u64 {
        if self.r.is_empty() {
            return 0;
        }
        loop {
            let active = (self.j + 1) as u128;
            let level = (u128::from(work) + self.prefix)
                .div_ceil(active)
                .max(u128::from(self.r[self.j]));
            match self.r.get(self.j + 1) {
                Some(&next) if level > u128::from(next) => {
                    self.j += 1;
                    self.prefix += u128::from(next);
                }
                _ => return level.min(u128::from(u64::MAX)) as u64,
            }
        }
    }
}

/// Smallest `t >= r[0]` with `sum(max(0, t - r_i)) >= work`, for `r` sorted ascending (0 for
/// no slots). O(slots).
fn water_fill(r: &[u64], work: u64) -> u64 {
    WaterFiller::new(r).level(work)
}

/// Hasher for job ids. Ids are assigned by the gate (sequential, never from input), so
/// SipHash's protection against chosen keys buys nothing here and costs a third of a tick
/// over a long queue; a multiplicative mix spreads sequential ids over the buckets.
#[derive(Clone, Copy, Debug, Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 ^= self.0 >> 32;
    }
}

type IdHash = std::hash::BuildHasherDefault<IdHasher>;

const EWMA_ALPHA: f64 = 0.2;
/// Which quantile of a class's output lengths a request with no size hint must fit in its
/// deadline. The mean admits long requests that are later dropped when their slack runs out
/// (a 429 after the client waited); the 0.9 quantile refuses them at once. In the simulator,
/// without hints: seed 000 keeps its on-time count (74 -> 75) and admitted SLO attainment
/// goes from 52.5% to 78.1%; the trace at 2x loses 3% of its on-time count (3227 -> 3138)
/// for 73.4% -> 84.8%.
const OUTPUT_QUANTILE: f64 = 0.9;
/// Step of the streaming quantile tracker, as a fraction of the class's mean output.
const QUANTILE_STEP: f64 = 0.05;
/// The tracked quantile stays within this many times the class's mean output (a long tail of
/// 20% at 1000 tokens over 10-token answers is a ratio of about 5).
const QUANTILE_MAX_RATIO: f64 = 5.0;
/// A class's estimates are confirmed by at least this many recent completions ...
const CONFIRM_SAMPLES: u32 = 5;
/// ... whose median signed relative error is within this ...
const CONFIRM_BIAS: f64 = 0.25;
/// ... and whose 90th percentile absolute relative error is within this, as is that of each
/// of the last few (one probe that ran far off its estimate is a contradiction).
const CONFIRM_P90: f64 = 0.5;
const CONFIRM_RECENT: usize = 3;
/// The class correction's window (completions) and range.
const CORRECTION_WINDOW: usize = 32;
const CORRECTION_RANGE: (f64, f64) = (0.5, 4.0);
/// The largest margin a class's error pads its requests with.
const MAX_MARGIN: f64 = 0.5;
/// Weight of one completion in a pool's recent mean concurrency (EWMA).
const CONCURRENCY_ALPHA: f64 = 0.1;

/// What a request would see on one lane (see [`Gate::evaluate`]).
#[derive(Clone, Copy, Debug)]
struct Eval {
    pool: PoolId,
    est: Estimate,
    deadline: Option<Millis>,
    wait: u64,
    count_ahead: u32,
    queue_age_ms: u64,
    slack_ms: Option<i64>,
    /// The service time the request's own deadline check used (an upper quantile of its
    /// class's outputs when it gave no size): what it would cost if admitted.
    own_service_ms: u64,
    in_flight: u32,
    verdict: Result<Reason, Reason>,
    /// The verdict is the pool's hard `max_queued` cap: enforced even in shadow mode.
    hard_cap: bool,
    /// The prompt tokens the estimate used (counted with the pool's learned relation).
    prompt_tokens: u32,
    /// The class's recent completions confirm its estimates (see `estimate_confirmed`).
    sure: bool,
    /// The estimator's figure for the request before the class's correction.
    model_service_ms: u64,
    /// Its own service does not fit its deadline even with nothing ahead, at the concurrency
    /// it would run at now.
    hopeless: bool,
}

/// How a job's hold is settled when the job ends.
#[derive(Clone, Copy, Debug)]
enum Settle {
    /// Done: tokens spent.
    Commit(u64),
    /// Cancelled: tokens wasted.
    Cancel(u64),
    /// The ledger already expired it.
    AlreadyExpired,
}

/// The admission core. See the module docs for the calling protocol.
#[derive(Debug)]
pub struct Gate {
    cfg: GateConfig,
    classes: Vec<ClassState>,
    pools: Vec<PoolState>,
    labels: HashMap<String, ClassId>,
    default_class: Option<ClassId>,
    jobs: HashMap<JobId, Job, IdHash>,
    events: VecDeque<Event>,
    next_id: u64,
    last_now: Millis,
    ledger: Ledger,
    /// Ledger records changed since the caller last took them (to persist).
    ledger_out: Vec<HoldRecord>,
    /// Live jobs by idempotency key.
    keys: HashMap<String, JobId>,
    /// Prefix of generated keys, unique per process start (set by the caller).
    key_prefix: String,
    /// Shutting down: nothing new is admitted, and queued work must finish by this time.
    closing_at: Option<Millis>,
    /// A drain suspended the default class: unlabeled work is refused.
    unlabeled_suspended: bool,
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
            key_prefix: "gen".into(),
            closing_at: None,
            unlabeled_suspended: false,
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
    pub fn classify(&self, label: Option<&str>) -> Option<ClassId> {
        label
            .and_then(|l| self.labels.get(&l.trim().to_ascii_lowercase()).copied())
            .or(self.default_class.filter(|_| !self.unlabeled_suspended))
    }

    /// Canonical name of a class.
    pub fn class_name(&self, class: ClassId) -> &str {
        self.classes.get(class.0).map_or("", |c| c.name.as_str())
    }

    /// Name of a pool.
    pub fn pool_name(&self, pool: PoolId) -> &str {
        self.pools.get(pool.0).map_or("", |p| p.name.as_str())
    }

    /// Where a rejected client of a class should go instead: its configured `retry_hint`,
    /// or else the name of its overflow pool.
    pub fn retry_hint(&self, class: ClassId) -> Option<&str> {
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
    pub fn set_class_enabled(&mut self, class: ClassId, enabled: bool) {
        if let Some(c) = self.classes.get_mut(class.0) {
            c.enabled = enabled;
            let name = c.name.clone();
            if let Some(cc) = self.cfg.classes.iter_mut().find(|cc| cc.name == name) {
                cc.enabled = enabled;
            }
        }
    }

    /// Time never runs backwards inside the core, whatever the caller passes.
    fn clock(&mut self, now: Millis) -> Millis {
        self.last_now = self.last_now.max(now);
        self.last_now
    }

    /// The class a lane belongs to (itself for a primary lane).
    fn home(&self, lane: ClassId) -> ClassId {
        self.classes
            .get(lane.0)
            .and_then(|c| c.overflow_of)
            .unwrap_or(lane)
    }

    fn expected_output(&self, class: ClassId, max_tokens: Option<u32>) -> u32 {
        let c = &self.classes[self.home(class).0];
        let pool = &self.pools[c.pool.0];
        let learned = c
            .expected_output
            .map(|v| v.round().clamp(0.0, f64::from(u32::MAX)) as u32);
        match (learned, max_tokens) {
            (Some(l), Some(m)) => l.min(m),
            (Some(l), None) => l,
            (None, Some(m)) => m,
            (None, None) => pool.default_output_tokens,
        }
    }

    /// Work and count queued ahead of a request of `priority` on `pool`, and the oldest
    /// enqueue time among them: O(classes of the pool).
    fn ahead(&self, pool: PoolId, priority: u32) -> (u64, u32, Option<Millis>) {
        let mut work = 0u64;
        let mut count = 0u32;
        let mut oldest: Option<Millis> = None;
        for id in &self.pools[pool.0].classes {
            let c = &self.classes[id.0];
            if c.priority < priority {
                break; // sorted by priority, highest first
            }
            work = work.saturating_add(c.queue.work_ms());
            count = count.saturating_add(c.queue.len() as u32);
            if let Some(t) = c.queue.oldest_enqueued_at() {
                oldest = Some(oldest.map_or(t, |o: Millis| o.min(t)));
            }
        }
        (work, count, oldest)
    }

    /// Projected wait for a slot given the work ahead: nothing if a slot is free for it,
    /// otherwise in-flight remainder plus queued work, spread over the slots.
    fn projected_wait(&self, pool: PoolId, now: Millis, work_ahead: u64, count_ahead: u32) -> u64 {
        let p = &self.pools[pool.0];
        let busy = p.in_flight.len() as u32;
        if busy.saturating_add(count_ahead) < p.slots {
            return 0;
        }
        p.wait_for_slot(now, work_ahead)
    }

    fn pool_depth(&self, pool: PoolId) -> u32 {
        self.pools[pool.0]
            .classes
            .iter()
            .map(|c| self.classes[c.0].queue.len() as u32)
            .sum()
    }

    /// What a request would see on one lane: its estimate, deadline, wait and the verdict of
    /// the lane's thresholds (queue age, depth, slack). Class switches, the ledger and the
    /// flags are the caller's. O(classes of the pool + slots).
    fn evaluate(&self, now: Millis, lane: ClassId, req: &Request, expected_output: u32) -> Eval {
        let c = &self.classes[lane.0];
        let pool = c.pool;
        let p = &self.pools[pool.0];
        let prompt_tokens = p.prompt_tokens(req);
        let deadline = req
            .deadline
            .or_else(|| c.default_deadline_ms.map(|d| now.saturating_add(d)));
        let (work_ahead, count_ahead, oldest) = self.ahead(pool, c.priority);
        let wait = self.projected_wait(pool, now, work_ahead, count_ahead);
        // Its own service, sharing the server as it likely will.
        let home = &self.classes[self.home(lane).0];
        let sharing = p.expected_sharing(wait, count_ahead, home.recent_others_prefill);
        let factor = home.correction();
        let model_est = p
            .estimator
            .estimate(prompt_tokens, expected_output, sharing);
        let est = scale_estimate(model_est, factor);
        // Queue age: how long the work this request would wait behind has been waiting. That
        // is the oldest queued job ahead, or, when every slot is busy, how long the pool has
        // gone without freeing one (seed 002: one stuck eval, an empty queue, and a sync
        // request that would wait behind it).
        let queue_age_ms = oldest
            .map_or(0, |t| now.saturating_sub(t))
            .max(self.pools[pool.0].slot_age(now));
        // The request's own deadline check: with no size from the caller, it must fit with
        // an upper quantile of its class's outputs, not just the mean (its work in the queue
        // still counts at the mean: that is what many jobs add up to).
        let learned_q = self.classes[self.home(lane).0].output_q;
        let own_output = match (req.expected_output_tokens, learned_q) {
            (None, Some(q)) => {
                let q = q.round().clamp(0.0, f64::from(u32::MAX)) as u32;
                req.max_tokens.map_or(q, |m| q.min(m)).max(expected_output)
            }
            _ => expected_output,
        };
        let own = if own_output == expected_output {
            est
        } else {
            scale_estimate(
                p.estimator.estimate(prompt_tokens, own_output, sharing),
                factor,
            )
        };
        let slack_ms = slack(now, 0, deadline, req.first_token_deadline, own);
        // A promise needs room for the estimates' own error: the wait and the service are
        // inflated by the class's recent p90 error before they are held to the deadline
        // (a request admitted exactly at the edge is dropped by any overrun ahead of it).
        let margin = home.margin(p.estimator.learns());
        let padded_slack = slack(
            now,
            0,
            deadline,
            req.first_token_deadline,
            scale_estimate(own, 1.0 + margin),
        );
        let padded_wait = (wait as f64 * (1.0 + margin)).round().min(1e15) as u64;
        // Too big for its own deadline even where it would run now with nothing ahead (not at
        // the full concurrency a waiting request is estimated at): a retry cannot help. Only
        // asked when it does not fit as estimated: with non-negative coefficients an estimate
        // never grows as sharing shrinks, so one that fits there fits here.
        let hopeless = slack_ms.is_some_and(|s| s < 0) && {
            let own_now = scale_estimate(
                p.estimator.estimate(
                    prompt_tokens,
                    own_output,
                    p.expected_sharing(0, 0, home.recent_others_prefill),
                ),
                factor,
            );
            slack(now, 0, deadline, req.first_token_deadline, own_now).is_some_and(|s| s < 0)
        };
        let in_flight = p.in_flight.len() as u32;
        let sure = self.estimate_confirmed(lane);
        let mut hard_cap = false;
        let verdict = if c.max_queue_age_ms.is_some_and(|max| queue_age_ms > max) {
            Err(Reason::QueueAgeExceeded)
        } else if self.pool_depth(pool) >= p.max_queued {
            // Hard cap on everything queued on the pool, whatever the class: each queued
            // request holds a connection and its body in the gateway.
            hard_cap = true;
            Err(Reason::QueueDepthExceeded)
        } else if self.depth_exceeded(pool, in_flight, count_ahead) {
            Err(Reason::QueueDepthExceeded)
        } else if padded_slack.is_some_and(|s| i128::from(padded_wait) > i128::from(s)) {
            // A pool with a free slot and an estimator that has barely learned anything: the
            // estimate is the prior, which may be far too pessimistic (a 256-token guess for
            // a request that writes 20). Rejecting would keep it from ever learning, so admit
            // and learn; such a job is never dropped on its (untrusted) estimate.
            if wait == 0 && p.estimator.warming_up() {
                Ok(Reason::EstimatorWarmup)
            } else if wait == 0 && self.may_probe(now, lane) {
                // Refused on a free slot for its own size alone, and nothing of the class
                // admitted for a while: let one through to measure it, or the gate could lock
                // itself in (refused requests teach nothing, and a class's outputs drift).
                Ok(Reason::Probe)
            } else {
                Err(Reason::ProjectedWaitExceedsSlack)
            }
        } else {
            Ok(Reason::WithinSlack)
        };
        Eval {
            pool,
            est,
            deadline,
            wait,
            count_ahead,
            queue_age_ms,
            slack_ms,
            own_service_ms: own.service_ms,
            in_flight,
            verdict,
            hard_cap,
            prompt_tokens,
            sure,
            model_service_ms: model_est.service_ms,
            hopeless,
        }
    }

    /// The class's recent completions confirm its estimates: enough of them, unbiased and
    /// close, none of the very last far off. Only then is a request refused as too big for its
    /// own deadline told not to retry (`x-should-retry: false`). Probes do not depend on it: a
    /// class's record can be confirmed and stale (its outputs drift while it is refused). A
    /// frozen estimator (`learn = false`) holds the operator's own figures: trusted as such.
    fn estimate_confirmed(&self, lane: ClassId) -> bool {
        let pool = &self.pools[self.classes[lane.0].pool.0];
        if !pool.estimator.learns() {
            return true;
        }
        let r = &self.classes[self.home(lane).0].record;
        let e = r.errors;
        e.samples >= CONFIRM_SAMPLES
            && e.bias.abs() <= CONFIRM_BIAS
            && e.p90 <= CONFIRM_P90
            && r.recent_worst <= CONFIRM_P90
    }

    /// A probe of the class may be admitted now: probing is on, the estimator learns (a probe
    /// teaches a frozen one nothing), not in shadow mode (which admits anyway), no probe of the
    /// class is still live, and nothing of the class was admitted for `probe_interval_ms`.
    fn may_probe(&self, now: Millis, lane: ClassId) -> bool {
        let c = &self.classes[self.home(lane).0];
        let learns = self.pools[self.classes[lane.0].pool.0].estimator.learns();
        if c.probe_interval_ms == 0 || !learns || self.cfg.shadow || self.cfg.admit_always {
            return false;
        }
        if c.last_probe
            .is_some_and(|(_, id)| self.jobs.contains_key(&id))
        {
            return false;
        }
        let last = c.last_admit_at.max(c.last_probe.map(|(at, _)| at));
        match last {
            Some(at) => now.saturating_sub(at) >= c.probe_interval_ms,
            None => true,
        }
    }

    /// Decide at arrival. An admitted job is queued; call [`Gate::poll`] to dispatch it.
    pub fn offer(&mut self, now: Millis, req: Request) -> Decision {
        let now = self.clock(now);
        // A hold past its TTL must not answer duplicates until the next tick: expire first.
        self.expire_holds(now);
        let job_id = JobId(self.next_id);
        self.next_id += 1;
        // A generated key is only spelled out if the request is admitted (a refusal under it
        // is never recorded), so rejections cost no allocation for it.
        let key = req.idempotency_key.clone().unwrap_or_default();
        // Only a live class's primary lane takes offers; overflow lanes are reached from it.
        let Some(class) = req.class.filter(|c| {
            self.classes
                .get(c.0)
                .is_some_and(|c| c.overflow_of.is_none() && !c.retired)
        }) else {
            let mut d = self.rejection(job_id, None, Reason::RejectUnlabeled);
            d.idempotency_key = key;
            return d;
        };
        let expected_output = match (req.expected_output_tokens, req.max_tokens) {
            (Some(hint), Some(cap)) => hint.min(cap),
            (Some(hint), None) => hint,
            (None, cap) => self.expected_output(class, cap),
        };
        let mut e = self.evaluate(now, class, &req, expected_output);
        let mut d = Decision {
            job_id,
            class: Some(class),
            pool: Some(e.pool),
            action: Action::Reject,
            reason: Reason::WithinSlack,
            queue_age_ms: e.queue_age_ms,
            deadline_slack_ms: e.slack_ms,
            projected_wait_ms: e.wait,
            est_service_ms: e.est.service_ms,
            expected_output_tokens: expected_output,
            in_flight: e.in_flight,
            depth: e.count_ahead,
            retry_after_ms: None,
            should_retry: false,
            deadline: e.deadline,
            idempotency_key: key.clone(),
            tokens_held: 0,
            ledger: None,
            shadow: false,
            displaced: None,
        };
        let primary_pool = e.pool;
        // Shutting down: nothing new is taken on; another replica (or this one restarted)
        // can serve it, so a retry is worth it.
        if self.closing_at.is_some() {
            d.reason = Reason::ShuttingDown;
            // Jittered like every other Retry-After: a whole replica's clients are refused
            // at once here, and must not all come back in the same instant.
            let r = &self.cfg.retry;
            d.retry_after_ms = Some(jitter(r.min_retry_after_ms, job_id, r.jitter_percent));
            d.should_retry = true;
            return d;
        }
        // A caller's size hint may raise the hold but never lower it below what the class's
        // own estimate would hold: a hint of 0 must not slip past the tenant's grant.
        let hold_tokens = req.hold_tokens.unwrap_or_else(|| {
            let own = self.expected_output(class, req.max_tokens);
            u64::from(e.prompt_tokens).saturating_add(u64::from(expected_output.max(own)))
        });
        let tenant = req.tenant.as_deref();
        let shadow = self.cfg.shadow && !self.cfg.admit_always;
        d.shadow = shadow;
        // Never spend twice: a held or done key is a duplicate even under `admit_always` or
        // in shadow mode. The retry cap and the tenant grant are thresholds, bypassed by the
        // rollback flag (and only reported in shadow mode).
        let ledger_verdict = match self.ledger.check(
            if req.idempotency_key.is_some() {
                &key
            } else {
                ""
            },
            tenant,
            req.attempt,
            hold_tokens,
        ) {
            Err(dup @ LedgerReject::Duplicate { .. }) => Some(dup),
            Err(other) if !self.cfg.admit_always => Some(other),
            _ => None,
        };
        // The first would-be rejection of a shadowed request: reported, not enforced.
        let mut shadowed: Option<Reason> = None;
        let mut bypass_ledger = self.cfg.admit_always;
        if let Some(rej) = ledger_verdict {
            let reason = match rej {
                LedgerReject::Duplicate { .. } => Reason::RejectDuplicate,
                LedgerReject::RetryCap { .. } => Reason::RejectRetryCap,
                LedgerReject::BudgetExhausted { .. } => Reason::BudgetExhausted,
            };
            d.ledger = Some(rej);
            if shadow && reason != Reason::RejectDuplicate {
                shadowed = Some(reason);
                bypass_ledger = true;
            } else {
                d.reason = reason;
                let (after, retry) = self.retry_after(
                    job_id,
                    d.reason,
                    e.wait,
                    e.slack_ms,
                    e.count_ahead,
                    primary_pool,
                    e.hopeless && e.sure,
                );
                d.retry_after_ms = Some(after);
                d.should_retry = retry;
                return d;
            }
        }

        let c = &self.classes[class.0];
        let mut lane = class;
        let verdict = if self.cfg.admit_always {
            Ok(Reason::AdmitAlways)
        } else if !c.enabled || c.draining {
            // An operator's switch, not a threshold: enforced in shadow mode too.
            Err(Reason::ClassDisabled)
        } else {
            e.verdict
        };
        // A capacity rejection of a class with an overflow pool in `route` mode: admit it
        // there instead if it fits there (under the same class rules).
        let capacity = matches!(verdict, Err(r) if r.is_capacity());
        let verdict = match c.overflow {
            Some((overflow_lane, OverflowMode::Route)) if capacity => {
                let o = self.evaluate(now, overflow_lane, &req, expected_output);
                match o.verdict {
                    // In shadow mode nothing moves: the route is reported, not taken.
                    Ok(_) if shadow => Err(Reason::OverflowRouted),
                    Ok(_) => {
                        lane = overflow_lane;
                        e = o;
                        d.pool = Some(e.pool);
                        d.queue_age_ms = e.queue_age_ms;
                        d.deadline_slack_ms = e.slack_ms;
                        d.projected_wait_ms = e.wait;
                        d.est_service_ms = e.est.service_ms;
                        d.in_flight = e.in_flight;
                        d.depth = e.count_ahead;
                        d.deadline = e.deadline;
                        Ok(Reason::OverflowRouted)
                    }
                    Err(_) => verdict,
                }
            }
            _ => verdict,
        };
        // Displacement: a request that does not fit may take the place of a longer one of its
        // class admitted moments ago (see `displacement_victim`). The victim is only removed
        // once this request is queued below. Shadow mode only names the job it would have
        // displaced.
        let mut victim = None;
        let refused_wait = (e.wait, e.count_ahead);
        let verdict = match verdict {
            Err(Reason::ProjectedWaitExceedsSlack) => {
                match self.displacement_victim(now, lane, &e) {
                    Some((id, _)) if shadow => {
                        d.displaced = Some(id);
                        verdict
                    }
                    Some((id, wait)) => {
                        victim = Some(id);
                        e.wait = wait;
                        e.count_ahead = e.count_ahead.saturating_sub(1);
                        d.projected_wait_ms = wait;
                        d.depth = e.count_ahead;
                        Ok(Reason::WithinSlack)
                    }
                    None => verdict,
                }
            }
            v => v,
        };
        let verdict = match verdict {
            Err(r) if shadow && r != Reason::ClassDisabled && !e.hard_cap => {
                shadowed = shadowed.or(Some(r));
                Ok(r)
            }
            v => v,
        };

        match verdict {
            Ok(reason) => {
                match shadowed {
                    Some(would) => {
                        d.action = Action::ShadowReject;
                        d.reason = would;
                    }
                    None => {
                        d.action = Action::Admit;
                        d.reason = reason;
                    }
                }
                let key = if req.idempotency_key.is_some() {
                    key
                } else {
                    format!("{}-{}", self.key_prefix, job_id.0)
                };
                d.idempotency_key = key.clone();
                let cap = self.ledger.config().retry_cap;
                // Under admit_always (or a shadowed ledger refusal) the cap and grant were
                // bypassed: reserve past them.
                let attempt = if bypass_ledger {
                    req.attempt.min(cap)
                } else {
                    req.attempt
                };
                let hold = if bypass_ledger {
                    self.ledger
                        .reserve_unchecked(now, &key, tenant, attempt, hold_tokens)
                } else {
                    self.ledger.reserve(now, &key, tenant, attempt, hold_tokens)
                };
                match hold {
                    Ok(r) => {
                        d.tokens_held = r.tokens_held;
                        let r = if req.reservation {
                            self.ledger.mark_reservation(&key).unwrap_or(r)
                        } else {
                            self.ledger.untrack_expiry(&key).unwrap_or(r)
                        };
                        self.ledger_out.push(r);
                    }
                    Err(rej) => {
                        // check() just passed; only a duplicate can remain, and that was
                        // handled above. Refuse rather than hold twice (and displace nothing).
                        d.action = Action::Reject;
                        d.reason = Reason::RejectDuplicate;
                        d.ledger = Some(rej);
                        (d.projected_wait_ms, d.depth) = refused_wait;
                        return d;
                    }
                }
                self.keys.insert(key.clone(), job_id);
                let seq = job_id.0;
                let job = Job {
                    class: lane,
                    pool: e.pool,
                    seq,
                    arrived_at: now,
                    deadline: e.deadline,
                    first_token_deadline: req.first_token_deadline,
                    est: e.est,
                    prompt_tokens: e.prompt_tokens,
                    context: f64::from(e.prompt_tokens) + f64::from(expected_output) / 2.0,
                    model_service_ms: e.model_service_ms,
                    expected_output,
                    prompt_chars: req.prompt_chars,
                    model: req.model.clone(),
                    state: JobState::Queued,
                    first_token_at: None,
                    max_tokens: req.max_tokens,
                    // Warm-up jobs run on an untrusted estimate; a reservation's worker was
                    // already told to go: neither is dropped on slack.
                    protected: matches!(reason, Reason::EstimatorWarmup | Reason::Probe)
                        || req.reservation,
                    key: key.clone(),
                    generated_key: req.idempotency_key.is_none(),
                    reservation: req.reservation,
                    deadline_is_absolute: req.deadline_is_absolute,
                };
                let key = job.key();
                let l = &mut self.classes[lane.0];
                let displaceable =
                    l.displace_within_ms.is_some() && !job.protected && !job.reservation;
                l.queue
                    .push(key, now, job_id, e.est.service_ms, displaceable);
                self.jobs.insert(job_id, job);
                if shadowed.is_none() {
                    let home = self.home(lane);
                    let h = &mut self.classes[home.0];
                    if reason == Reason::Probe {
                        h.last_probe = Some((now, job_id));
                        h.probes += 1;
                    } else {
                        h.last_admit_at = Some(now);
                    }
                }
                // The displaced job's client hears it after this one is queued, so its
                // Retry-After counts this one's work.
                if let Some(id) = victim {
                    self.displace(now, id);
                    d.displaced = Some(id);
                }
            }
            Err(reason) => {
                d.reason = reason;
                // A refused request under a client key is recorded (a retry may follow);
                // one under a generated key holds nothing and can never be replayed.
                if req.idempotency_key.is_some() {
                    if let Some(r) =
                        self.ledger
                            .record_rejection(now, &key, tenant, req.attempt, hold_tokens)
                    {
                        self.ledger_out.push(r);
                    }
                }
                let (after, retry) = self.retry_after(
                    job_id,
                    reason,
                    e.wait,
                    e.slack_ms,
                    e.count_ahead,
                    primary_pool,
                    e.hopeless && e.sure,
                );
                d.retry_after_ms = Some(after);
                // With an absolute deadline the slack shrinks exactly as fast as the queue
                // drains: the same request retried later can never fit.
                let absolute_miss =
                    req.deadline_is_absolute && reason == Reason::ProjectedWaitExceedsSlack;
                d.should_retry = retry && !absolute_miss;
            }
        }
        d
    }

    /// The queued job a newcomer of `lane` that does not fit may displace: the longest one
    /// of the lane that is longer than the newcomer, was admitted within the lane's
    /// `displace_within_ms`, is not protected (warm-up, reservation), and without which the
    /// newcomer's projected wait fits its slack. Moore and Hodgson's rule for the most jobs on
    /// time (drop the longest) restricted to one-for-one swaps of recent admissions, so the
    /// queue never holds fewer jobs and a displaced client hears it soon after it arrived.
    /// With the newcomer's wait without it. O(log queued + slots), amortised: jobs leave the
    /// window in arrival order and are pruned once.
    fn displacement_victim(
        &mut self,
        now: Millis,
        lane: ClassId,
        e: &Eval,
    ) -> Option<(JobId, u64)> {
        let window = self.classes[lane.0].displace_within_ms?;
        let slack = e.slack_ms?;
        let c = &mut self.classes[lane.0];
        c.queue.prune_displaceable(now.saturating_sub(window));
        let (longest, id) = c.queue.longest_recent()?;
        // "Longer" by the measure the newcomer's own check used (for a sizeless request, an
        // upper quantile of its class), so a swap never trades a job for a likely longer one.
        if longest <= e.own_service_ms {
            return None;
        }
        let priority = c.priority;
        let (work, count, _) = self.ahead(e.pool, priority);
        let wait = self.projected_wait(
            e.pool,
            now,
            work.saturating_sub(longest),
            count.saturating_sub(1),
        );
        (i128::from(wait) <= i128::from(slack)).then_some((id, wait))
    }

    /// Refuse a queued job to make room for another: release its hold (nothing was spent)
    /// and tell its client (`displaced`) when a retry could fit: a retry has its whole
    /// relative deadline again (not so an absolute one), and would wait behind what is
    /// queued now.
    fn displace(&mut self, now: Millis, id: JobId) {
        let Some(job) = self.jobs.remove(&id) else {
            return;
        };
        self.unqueue(id, &job);
        self.settle_hold(now, &job, Settle::Cancel(0));
        let priority = self.classes[job.class.0].priority;
        let (work, count, _) = self.ahead(job.pool, priority);
        let wait = self.projected_wait(job.pool, now, work, count);
        let budget = job
            .deadline
            .map(|d| signed_diff(d, job.arrived_at).saturating_sub(job.est.service_ms as i64));
        let (after, useful) = self.retry_after(
            id,
            Reason::ProjectedWaitExceedsSlack,
            wait,
            budget,
            count,
            job.pool,
            false,
        );
        let mut ev = self.drop_event(now, id, &job, job.pool, 0, Reason::Displaced);
        if let Event::Drop {
            retry_after_ms,
            should_retry,
            ..
        } = &mut ev
        {
            *retry_after_ms = Some(after);
            *should_retry = useful && !job.deadline_is_absolute;
        }
        self.events.push_back(ev);
    }

    /// Seed 000's depth rule: every slot busy and more than `factor x slots` queued ahead.
    fn depth_exceeded(&self, pool: PoolId, in_flight: u32, count_ahead: u32) -> bool {
        let p = &self.pools[pool.0];
        match p.max_depth_factor {
            Some(k) => in_flight >= p.slots && f64::from(count_ahead) > k * f64::from(p.slots),
            None => false,
        }
    }

    /// Retry-After from the projected drain time: how long until the wait would fit.
    /// `hopeless`: the request is too big for its own deadline even on the server as it is now
    /// with nothing ahead, and the class's recent completions confirm the estimate: it is told
    /// not to retry. Without that evidence it may (a probe may correct the estimate
    /// meanwhile), and one that only a full server makes too slow is told when the queue
    /// drains.
    #[allow(clippy::too_many_arguments)]
    fn retry_after(
        &self,
        job_id: JobId,
        reason: Reason,
        wait: u64,
        slack_ms: Option<i64>,
        count_ahead: u32,
        pool: PoolId,
        hopeless: bool,
    ) -> (u64, bool) {
        let r = &self.cfg.retry;
        let need = match reason {
            // No retry of the same request can succeed soon: the class is off, the work is
            // unlabeled, the key is already held or done, the attempts are used up, or the
            // grant is spent.
            Reason::ClassDisabled
            | Reason::RejectUnlabeled
            | Reason::RejectDuplicate
            | Reason::RejectRetryCap
            | Reason::BudgetExhausted => return (r.hopeless_retry_after_ms, false),
            Reason::ProjectedWaitExceedsSlack => match slack_ms {
                // Even an empty queue cannot make this deadline: retrying the same request
                // is pointless, if the estimate is to be trusted.
                Some(_) if hopeless => return (r.hopeless_retry_after_ms, false),
                Some(s) if s < 0 => wait,
                Some(s) => wait.saturating_sub(s as u64),
                None => wait,
            },
            Reason::QueueDepthExceeded => {
                let p = &self.pools[pool.0];
                let allowed = p.max_depth_factor.unwrap_or(0.0) * f64::from(p.slots);
                let excess = (f64::from(count_ahead) - allowed).max(1.0);
                let share = excess / f64::from(count_ahead.max(1));
                (wait as f64 * share) as u64
            }
            _ => wait,
        };
        let after = need.max(r.min_retry_after_ms);
        let useful = after <= r.max_useful_retry_after_ms;
        (jitter(after, job_id, r.jitter_percent), useful)
    }

    fn rejection(&self, job_id: JobId, class: Option<ClassId>, reason: Reason) -> Decision {
        let (after, retry) = match reason {
            Reason::ClassDisabled | Reason::RejectUnlabeled => {
                (self.cfg.retry.hopeless_retry_after_ms, false)
            }
            _ => (self.cfg.retry.min_retry_after_ms, true),
        };
        Decision {
            job_id,
            class,
            pool: None,
            action: Action::Reject,
            reason,
            queue_age_ms: 0,
            deadline_slack_ms: None,
            projected_wait_ms: 0,
            est_service_ms: 0,
            expected_output_tokens: 0,
            in_flight: 0,
            depth: 0,
            retry_after_ms: Some(after),
            should_retry: retry,
            deadline: None,
            idempotency_key: String::new(),
            tokens_held: 0,
            ledger: None,
            shadow: self.cfg.shadow && !self.cfg.admit_always,
            displaced: None,
        }
    }

    /// The next thing to do: dispatch a job into a free slot, or tell a dropped job's client.
    /// Call until it returns `None` after every input.
    pub fn poll(&mut self, now: Millis) -> Option<Event> {
        let now = self.clock(now);
        loop {
            if let Some(ev) = self.events.pop_front() {
                return Some(ev);
            }
            if !self.dispatch_one(now) {
                return None;
            }
        }
    }

    /// Try to move one job into a free slot (or drop it if it cannot make its deadline).
    /// Returns false when no pool has both a free slot and a queued job.
    fn dispatch_one(&mut self, now: Millis) -> bool {
        for pi in 0..self.pools.len() {
            let pool = &self.pools[pi];
            if pool.in_flight.len() as u32 >= pool.slots {
                continue;
            }
            // Highest priority first; among equal priorities, earliest deadline.
            let mut best: Option<(u32, QueueKey, ClassId, JobId)> = None;
            for cid in &pool.classes {
                let c = &self.classes[cid.0];
                if let Some((key, id)) = c.queue.front() {
                    match best {
                        Some((p, k, _, _)) if p > c.priority || (p == c.priority && k <= key) => {}
                        _ => best = Some((c.priority, key, *cid, id)),
                    }
                    if best.is_some_and(|(p, _, _, _)| p > c.priority) {
                        break;
                    }
                }
            }
            let Some((_, _, _, id)) = best else { continue };
            let Some(job) = self.jobs.get(&id).cloned() else {
                continue;
            };
            self.unqueue(id, &job);
            // Shutting down: a job that cannot finish before the process stops is not started
            // (its client hears it now instead of being cut off mid-answer).
            let closing = !job.reservation
                && self
                    .closing_at
                    .is_some_and(|at| now.saturating_add(job.est.service_ms) > at);
            let dead = !self.cfg.admit_always
                && !self.cfg.shadow
                && !job.protected
                && job.slack_after(now, 0).is_some_and(|s| s < 0);
            let pool_id = PoolId(pi);
            if dead || closing {
                self.jobs.remove(&id);
                self.settle_hold(now, &job, Settle::Cancel(0));
                let reason = if closing {
                    Reason::ShuttingDown
                } else {
                    Reason::DeadlineUnmeetable
                };
                let ev = self.drop_event(now, id, &job, pool_id, 0, reason);
                self.events.push_back(ev);
                return true;
            }
            // Estimated again now, with what the gate has learned since the job was admitted
            // (a batch job may have queued for minutes) and what it shares the server with
            // now: the remaining work that other requests' waits are projected from.
            let depth_after = self.pool_depth(pool_id);
            let home = self.home(job.class);
            let (factor, prefill) = {
                let h = &self.classes[home.0];
                (h.correction(), h.recent_others_prefill)
            };
            let p = &self.pools[pi];
            let sharing = p.expected_sharing(0, depth_after, prefill);
            let model = p
                .estimator
                .estimate(job.prompt_tokens, job.expected_output, sharing);
            let est = scale_estimate(model, factor);
            let pool = &mut self.pools[pi];
            pool.advance_busy(now);
            pool.in_flight.insert(id, (now, est.service_ms));
            pool.context_now += job.context;
            pool.prefill_dispatched = pool
                .prefill_dispatched
                .saturating_add(u64::from(job.prompt_tokens));
            let in_flight = pool.in_flight.len() as u32;
            let (busy_at_start, context_at_start, prefill_at_start) =
                (pool.busy, pool.context_busy, pool.prefill_dispatched);
            if let Some(j) = self.jobs.get_mut(&id) {
                j.state = JobState::InFlight {
                    started_at: now,
                    busy_at_start,
                    context_at_start,
                    prefill_at_start,
                };
                j.est = est;
                j.model_service_ms = model.service_ms;
            }
            let depth = self.pool_depth(pool_id);
            self.events.push_back(Event::Dispatch {
                job_id: id,
                class: job.class,
                pool: pool_id,
                queue_wait_ms: now.saturating_sub(job.arrived_at),
                deadline_slack_ms: job.slack_after(now, 0),
                est_service_ms: est.service_ms,
                in_flight,
                depth,
            });
            return true;
        }
        false
    }

    fn unqueue(&mut self, id: JobId, job: &Job) {
        let _ = id;
        self.classes[job.class.0]
            .queue
            .remove(job.key(), job.arrived_at, job.est.service_ms);
    }

    fn drop_event(
        &self,
        now: Millis,
        id: JobId,
        job: &Job,
        pool: PoolId,
        wait: u64,
        reason: Reason,
    ) -> Event {
        Event::Drop {
            job_id: id,
            class: job.class,
            pool,
            reason,
            queue_wait_ms: now.saturating_sub(job.arrived_at),
            deadline_slack_ms: job.slack_after(now, wait),
            projected_wait_ms: wait,
            in_flight: self.pools[pool.0].in_flight.len() as u32,
            depth: self.pool_depth(pool),
            retry_after_ms: None,
            should_retry: false,
        }
    }

    /// Record the first token of a dispatched job (for time-to-first-token figures).
    pub fn on_first_token(&mut self, now: Millis, id: JobId) {
        let now = self.clock(now);
        if let Some(j) = self.jobs.get_mut(&id) {
            if j.first_token_at.is_none() && matches!(j.state, JobState::InFlight { .. }) {
                j.first_token_at = Some(now);
            }
        }
    }

    /// A dispatched job's response ended. Frees its slot and teaches the estimator. Returns
    /// `None` for an unknown or already-ended job, so a second call can never free twice.
    pub fn on_complete(&mut self, now: Millis, id: JobId, done: Completion) -> Option<Completed> {
        let now = self.clock(now);
        let job = self.jobs.get(&id)?;
        let JobState::InFlight {
            started_at,
            busy_at_start,
            context_at_start,
            prefill_at_start,
        } = job.state
        else {
            return None;
        };
        let job = self.jobs.remove(&id)?;
        let pool = job.pool;
        let sharing = self.pools[pool.0].sharing_since(
            now,
            started_at,
            (busy_at_start, context_at_start, prefill_at_start),
            job.context,
        );
        let concurrency = sharing.concurrency;
        // An overflow lane's completions teach its class's output length.
        let home = self.home(job.class);
        let c = &mut self.classes[home.0];
        let service_ms = now.saturating_sub(started_at);
        if done.ok {
            let prompt = done.prompt_tokens.unwrap_or(job.prompt_tokens);
            if done.completion_tokens.is_some() || job.max_tokens == Some(0) {
                // The estimate in force while it ran against what it took: the class's error
                // report, its padding and the evidence behind `x-should-retry`. Its own pool's
                // only: an overflow lane's pool has an estimator of its own.
                if job.class == home || c.pool == pool {
                    c.errors.record(job.est.service_ms, service_ms);
                    if self.pools[pool.0].estimator.learns() {
                        c.learn_ratio(job.model_service_ms, service_ms);
                    }
                    c.recent_others_prefill +=
                        CONCURRENCY_ALPHA * (sharing.others_prefill - c.recent_others_prefill);
                    c.refresh_record();
                }
                let p = &mut self.pools[pool.0];
                p.recent_concurrency += CONCURRENCY_ALPHA * (concurrency - p.recent_concurrency);
                if concurrency > 1.05 {
                    let each = sharing.others_context / (concurrency - 1.0);
                    p.recent_other_context += CONCURRENCY_ALPHA * (each - p.recent_other_context);
                }
                if let (Some(chars), Some(tokens)) = (job.prompt_chars, done.prompt_tokens) {
                    p.tokens.learn(chars, tokens, job.model.as_deref());
                }
            }
            let c = &mut self.classes[home.0];
            match done.completion_tokens {
                Some(out) => {
                    let v = f64::from(out);
                    c.expected_output = Some(match c.expected_output {
                        Some(prev) => prev + EWMA_ALPHA * (v - prev),
                        None => v,
                    });
                    // Stochastic quantile tracking: up by (1 - q) steps when an output is
                    // above the estimate, down by q steps when not; it settles where a
                    // fraction q of outputs lie below. The step scales with the larger of
                    // the mean and the quantile itself: scaled by the mean alone, a class
                    // whose outputs shrank (1000 tokens to 10) would take thousands of
                    // completions to bring its quantile down, refusing work meanwhile.
                    let scale = c.expected_output.unwrap_or(v).max(c.output_q.unwrap_or(v));
                    let step = QUANTILE_STEP * scale.max(1.0);
                    let below = if v <= c.output_q.unwrap_or(v) {
                        1.0
                    } else {
                        0.0
                    };
                    // Its down steps are small (a tenth of the up steps), so after the class's
                    // outputs shrink it would lag for hundreds of completions: it is kept
                    // within a few times the mean, which follows at once.
                    let cap = QUANTILE_MAX_RATIO * c.expected_output.unwrap_or(v).max(1.0);
                    c.output_q = Some(match c.output_q {
                        Some(q) => (q + step * (OUTPUT_QUANTILE - below)).clamp(0.0, cap),
                        None => v,
                    });
                    self.pools[pool.0]
                        .estimator
                        .observe(prompt, out, sharing, service_ms);
                }
                // A request that generates nothing (embeddings) reports no completion tokens:
                // it still teaches the overhead and prefill costs. A generating request with
                // no usage teaches nothing (its output length is unknown).
                None if job.max_tokens == Some(0) => {
                    self.pools[pool.0]
                        .estimator
                        .observe(prompt, 0, sharing, service_ms);
                }
                None => {}
            }
        }
        // Settle the hold: spent per the upstream's usage (or, without usage, what was held);
        // a failed response spent nothing billable and wasted what it streamed.
        let settle = if done.ok {
            let spent = match (done.prompt_tokens, done.completion_tokens) {
                (None, None) => self.ledger.get(&job.key).map_or(0, |r| r.tokens_held),
                (p, c) => u64::from(p.unwrap_or(job.prompt_tokens)) + u64::from(c.unwrap_or(0)),
            };
            Settle::Commit(spent)
        } else {
            Settle::Cancel(u64::from(done.completion_tokens.unwrap_or(0)))
        };
        Some(self.finish(now, id, job, pool, Some(started_at), settle))
    }

    /// The client went away (or the caller gave up): release the job's queue place or slot
    /// and settle its hold as cancelled. Returns `None` for an unknown or already-ended job.
    pub fn cancel(&mut self, now: Millis, id: JobId) -> Option<Completed> {
        self.cancel_wasted(now, id, 0)
    }

    /// [`Gate::cancel`], recording `wasted` tokens generated for the vanished client.
    pub fn cancel_wasted(&mut self, now: Millis, id: JobId, wasted: u64) -> Option<Completed> {
        let now = self.clock(now);
        let (job, pool, started) = self.take_job(id)?;
        Some(self.finish(now, id, job, pool, started, Settle::Cancel(wasted)))
    }

    /// Remove a live job from the gate's books: out of its queue if queued. Returns it, its
    /// pool and when it was dispatched (if it was); the caller `finish`es it.
    fn take_job(&mut self, id: JobId) -> Option<(Job, PoolId, Option<Millis>)> {
        let job = self.jobs.remove(&id)?;
        let pool = job.pool;
        let started = match job.state {
            JobState::Queued => {
                self.unqueue(id, &job);
                None
            }
            JobState::InFlight { started_at, .. } => Some(started_at),
        };
        Some((job, pool, started))
    }

    /// Settle a job's hold in the ledger and forget its key; returns the settled record.
    fn settle_hold(&mut self, now: Millis, job: &Job, settle: Settle) -> Option<HoldRecord> {
        if self
            .keys
            .get(&job.key)
            .is_some_and(|j| !self.jobs.contains_key(j))
        {
            self.keys.remove(&job.key);
        }
        let r = match settle {
            Settle::Commit(spent) => self.ledger.commit(now, &job.key, spent),
            Settle::Cancel(wasted) => self.ledger.cancel(now, &job.key, wasted),
            Settle::AlreadyExpired => return self.ledger.get(&job.key).cloned(),
        };
        // A generated key is persisted like any other but not remembered: nobody can replay
        // it, and keeping it for the retention would only cost memory.
        if job.generated_key && matches!(r, Ok(_) | Err(SettleError::HoldExpired(_))) {
            self.ledger.forget(&job.key);
        }
        match r {
            Ok(r) => {
                self.ledger_out.push(r.clone());
                Some(r)
            }
            // Expired on the way (its TTL passed): that is its settlement, and it must be
            // persisted like any other.
            Err(SettleError::HoldExpired(r)) => {
                self.ledger_out.push((*r).clone());
                Some(*r)
            }
            Err(_) => None,
        }
    }

    fn finish(
        &mut self,
        now: Millis,
        id: JobId,
        job: Job,
        pool: PoolId,
        started_at: Option<Millis>,
        settle: Settle,
    ) -> Completed {
        let sharing = match job.state {
            JobState::InFlight {
                started_at,
                busy_at_start,
                context_at_start,
                prefill_at_start,
            } => self.pools[pool.0].sharing_since(
                now,
                started_at,
                (busy_at_start, context_at_start, prefill_at_start),
                job.context,
            ),
            JobState::Queued => Sharing {
                concurrency: 0.0,
                ..Sharing::ALONE
            },
        };
        let p = &mut self.pools[pool.0];
        p.advance_busy(now);
        if p.in_flight.remove(&id).is_some() {
            p.context_now = (p.context_now - job.context).max(0.0);
            if p.in_flight.is_empty() {
                // No rounding left behind: an idle pool has no context.
                p.context_now = 0.0;
            }
        }
        let hold = self.settle_hold(now, &job, settle);
        let queue_wait_ms = started_at.unwrap_or(now).saturating_sub(job.arrived_at);
        Completed {
            job_id: id,
            class: job.class,
            pool,
            dispatched: started_at.is_some(),
            queue_wait_ms,
            service_ms: started_at.map_or(0, |s| now.saturating_sub(s)),
            turnaround_ms: now.saturating_sub(job.arrived_at),
            time_to_first_token_ms: job.first_token_at.map(|t| t.saturating_sub(job.arrived_at)),
            deadline_slack_ms: job.deadline.map(|d| signed_diff(d, now)),
            in_flight: self.pools[pool.0].in_flight.len() as u32,
            depth: self.pool_depth(pool),
            hold,
            est_service_ms: job.est.service_ms,
            concurrency: sharing.concurrency,
            others_context: sharing.others_context,
        }
    }

    /// Let time pass: drop queued jobs whose slack died while they waited (higher-priority
    /// work arrived, an in-flight job overran), so their clients hear it now rather than at
    /// their timeout. Walks the queues in dispatch order: O(queued jobs); call it on a timer.
    pub fn tick(&mut self, now: Millis) {
        let now = self.clock(now);
        self.expire_holds(now);
        if self.closing_at.is_some() {
            self.shutdown_sweep(now);
        }
        // The rollback flag and shadow mode enforce no deadline: nothing is dropped.
        if self.cfg.admit_always || self.cfg.shadow {
            return;
        }
        for pi in 0..self.pools.len() {
            let pool_id = PoolId(pi);
            let pool = &self.pools[pi];
            let slots = (pool.slots as usize).max(1);
            let free = slots - pool.in_flight.len().min(slots);
            // Per-slot remaining times, sorted once: each job's wait is a water fill of the
            // queued work ahead of it over these (see `PoolState::wait_for_slot`).
            let mut r = vec![0; pool.slot_count()];
            pool.free_times(now, &mut r);
            let mut work = 0u64;
            let mut count = 0usize;
            let mut filler = WaterFiller::new(&r);
            let mut doomed: Vec<(JobId, u64)> = Vec::new();
            let classes = self.pools[pi].classes.clone();
            let mut i = 0;
            while i < classes.len() {
                // Nothing at this level or below can die: stop walking.
                if !classes[i..]
                    .iter()
                    .any(|c| self.classes[c.0].queue.has_deadlined())
                {
                    break;
                }
                // One priority level at a time: its jobs with deadlines, merged in
                // earliest-deadline order, go first; its best-effort jobs (which cannot die)
                // are added in bulk after them.
                let prio = self.classes[classes[i].0].priority;
                let mut level: Vec<(QueueKey, JobId)> = Vec::new();
                let mut bulk = (0usize, 0u64);
                let first = i;
                while i < classes.len() && self.classes[classes[i].0].priority == prio {
                    let q = &self.classes[classes[i].0].queue;
                    level.extend(q.iter_deadlined());
                    let (n, w) = q.best_effort();
                    bulk = (bulk.0 + n, bulk.1.saturating_add(w));
                    i += 1;
                }
                // One class's queue is already in order; several at one priority merge.
                if i - first > 1 {
                    level.sort_unstable();
                }
                for (_, id) in level {
                    let Some(job) = self.jobs.get(&id) else {
                        continue;
                    };
                    let wait = if count < free { 0 } else { filler.level(work) };
                    if !job.protected && job.slack_after(now, wait).is_some_and(|s| s < 0) {
                        doomed.push((id, wait));
                    } else {
                        work = work.saturating_add(job.est.service_ms);
                        count += 1;
                    }
                }
                count += bulk.0;
                work = work.saturating_add(bulk.1);
            }
            for (id, wait) in doomed {
                if let Some(job) = self.jobs.remove(&id) {
                    self.unqueue(id, &job);
                    self.settle_hold(now, &job, Settle::Cancel(0));
                    let ev =
                        self.drop_event(now, id, &job, pool_id, wait, Reason::DeadlineUnmeetable);
                    self.events.push_back(ev);
                }
            }
        }
    }

    /// Jobs queued or in flight (admitted and not yet ended).
    pub fn live_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// A consistent view of queues, pools and estimators at `now`. Lanes and pools retired
    /// by a reload appear only while they still have work.
    pub fn snapshot(&self, now: Millis) -> GateSnapshot {
        let now = now.max(self.last_now);
        let mut lane_in_flight = vec![0u32; self.classes.len()];
        for p in &self.pools {
            for id in p.in_flight.keys() {
                if let Some(j) = self.jobs.get(id) {
                    if let Some(n) = lane_in_flight.get_mut(j.class.0) {
                        *n += 1;
                    }
                }
            }
        }
        let classes = self
            .classes
            .iter()
            .enumerate()
            .filter(|(i, c)| !c.retired || !c.queue.is_empty() || lane_in_flight[*i] > 0)
            .map(|(i, c)| {
                let (work, count, _) = self.ahead(c.pool, c.priority);
                let home = &self.classes[self.home(ClassId(i)).0];
                ClassSnapshot {
                    name: c.name.clone(),
                    pool: self.pools[c.pool.0].name.clone(),
                    priority: c.priority,
                    enabled: home.enabled,
                    depth: c.queue.len() as u32,
                    oldest_queue_age_ms: c
                        .queue
                        .oldest_enqueued_at()
                        .map_or(0, |t| now.saturating_sub(t)),
                    queued_work_ms: c.queue.work_ms(),
                    projected_wait_ms: self.projected_wait(c.pool, now, work, count),
                    expected_output_tokens: self.expected_output(ClassId(i), None),
                    in_flight: lane_in_flight[i],
                    draining: home.draining,
                    overflow: c.overflow_of.is_some(),
                    retired: c.retired,
                    deadline_ms: home.default_deadline_ms,
                    max_queue_age_ms: c.max_queue_age_ms,
                    est_error: home.record.errors,
                    probes: home.probes,
                }
            })
            .collect();
        let pools = self
            .pools
            .iter()
            .enumerate()
            .filter(|(i, p)| {
                !p.retired || !p.in_flight.is_empty() || self.pool_depth(PoolId(*i)) > 0
            })
            .map(|(i, p)| PoolSnapshot {
                name: p.name.clone(),
                slots: p.slots,
                in_flight: p.in_flight.len() as u32,
                depth: self.pool_depth(PoolId(i)),
                in_flight_remaining_ms: p.in_flight_remaining(now),
                oldest_in_flight_age_ms: p
                    .in_flight
                    .values()
                    .map(|&(started, _)| now.saturating_sub(started))
                    .max()
                    .unwrap_or(0),
                estimator: p.estimator.snapshot(),
                learning: p.prior.learn,
                warming_up: p.estimator.warming_up(),
                retired: p.retired,
                chars_per_token: p.tokens.chars_per_token(),
                template_tokens: p.tokens.template_tokens(),
                mean_concurrency: p.recent_concurrency,
            })
            .collect();
        GateSnapshot {
            now_ms: now,
            admit_always: self.cfg.admit_always,
            shadow: self.cfg.shadow,
            unlabeled_suspended: self.unlabeled_suspended,
            closing_at_ms: self.closing_at,
            classes,
            pools,
        }
    }
}

mod holds;
#[cfg(test)]
mod learning_tests;
pub mod ops;
#[cfg(test)]
mod ops_tests;
pub mod reconfigure;
#[cfg(test)]
mod tests;
