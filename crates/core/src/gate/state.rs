//! What the gate keeps between calls: a job's record, a lane's (class queue on one pool) and a
//! pool's bookkeeping (in-flight set and the integrals the estimator learns sharing from), and
//! the constants that tune how a class's record is learned.

use super::*;

#[derive(Clone, Debug)]
pub(super) struct Job {
    /// The lane (class entry) it is queued on; see [`LaneState`].
    pub(super) class: LaneId,
    /// The pool it runs on (its lane's pool, fixed at admission: a reload that moves the
    /// class leaves this job where it was admitted).
    pub(super) pool: PoolId,
    pub(super) seq: u64,
    pub(super) arrived_at: Millis,
    pub(super) deadline: Option<Millis>,
    pub(super) first_token_deadline: Option<Millis>,
    pub(super) est: Estimate,
    pub(super) prompt_tokens: u32,
    /// The estimator's own figure for its service (before the class's correction): what the
    /// correction learns from at completion.
    pub(super) model_service_ms: u64,
    /// The output length its estimate assumed.
    pub(super) expected_output: u32,
    /// Its context in tokens (prompt and half the expected output): what it adds to the
    /// attention work of every request it shares the server with.
    pub(super) context: f64,
    /// The prompt's characters and model, to learn the token relation at completion.
    pub(super) prompt_chars: Option<u32>,
    pub(super) model: Option<crate::ledger::Shared>,
    pub(super) state: JobState,
    pub(super) first_token_at: Option<Millis>,
    /// The output cap (`Some(0)`: generates nothing, e.g. embeddings).
    pub(super) max_tokens: Option<u32>,
    /// Admitted while the estimator warms up: its estimate is not trusted enough to drop it.
    pub(super) protected: bool,
    /// Idempotency key of its hold in the ledger.
    pub(super) key: crate::ledger::Shared,
    /// The gate made the key up (the client sent none): nobody can replay it.
    pub(super) generated_key: bool,
    /// Placed through the reservation API.
    pub(super) reservation: bool,
    /// The client fixed its deadline in absolute time: a retry cannot get more slack.
    pub(super) deadline_is_absolute: bool,
    /// The wait projected at admission and that wait plus the estimated service: what the
    /// promise was made on (see [`LaneState::wait_margin`]).
    pub(super) promised_wait: u64,
    pub(super) promised_total: u64,
    /// When the pool's headroom first held it back from a free slot (see `headroom`).
    pub(super) held_since: Option<Millis>,
    /// Its tenant's bucket on its lane (`[fairness]` in use), where its queued work counts.
    pub(super) tenant_slot: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum JobState {
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
    pub(super) fn key(&self) -> QueueKey {
        let d = match (self.deadline, self.first_token_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // `Millis::MAX` is reserved for best effort, so a deadline at the very end of time
        // still sorts (and is walked by `tick`) as a deadline.
        (d.map_or(Millis::MAX, |d| d.min(Millis::MAX - 1)), self.seq)
    }

    /// Tightest slack if the job started after `wait` from `now`.
    pub(super) fn slack_after(&self, now: Millis, wait: u64) -> Option<i64> {
        slack(
            now,
            wait,
            self.deadline,
            self.first_token_deadline,
            self.est,
        )
    }
}

/// One lane: a class's queue on one pool. Every configured class has its primary lane on its
/// own pool; a class with an `overflow_pool` has a second lane there, holding the work routed
/// to it. Lanes are indexed by [`LaneId`]: the first ones are the configured classes, in
/// order, and ids never change or get reused while the gate lives (a reload appends, and a
/// removed lane is only retired), so a queued or in-flight job's lane is always valid.
#[derive(Debug)]
pub(super) struct LaneState {
    pub(super) name: String,
    pub(super) pool: PoolId,
    pub(super) priority: u32,
    pub(super) enabled: bool,
    /// Drained through the admin API: refuses new work like a disabled class. Runtime state,
    /// kept across reloads.
    pub(super) draining: bool,
    pub(super) default_deadline_ms: Option<u64>,
    pub(super) max_queue_age_ms: Option<u64>,
    pub(super) queue: ClassQueue,
    /// Learned mean output length (EWMA), seeded from the class prior. Only a primary lane's
    /// is used: an overflow lane learns into its class's.
    pub(super) expected_output: Option<f64>,
    /// A tracked upper quantile (`OUTPUT_QUANTILE`) of the output length: what a request that
    /// gives no size is assumed to need for its own deadline check.
    pub(super) output_q: Option<f64>,
    /// Configured `retry_hint`.
    pub(super) retry_hint: Option<String>,
    /// The class's overflow lane and what to do with it (primary lanes only).
    pub(super) overflow: Option<(LaneId, OverflowMode)>,
    /// For an overflow lane: the class it serves.
    pub(super) overflow_of: Option<LaneId>,
    /// Removed by a reload: no new work; its queued and in-flight jobs run to their end.
    pub(super) retired: bool,
    /// Configured `displace_within_ms` (primary lanes only): how recently admitted a queued
    /// job must be for a shorter newcomer to take its place.
    pub(super) displace_within_ms: Option<u64>,
    /// Relative errors of the estimates of the class's recent completions (primary lanes:
    /// an overflow lane records into its class's).
    pub(super) errors: ErrorTracker,
    /// Configured `probe_interval_ms` (0: no probes).
    pub(super) probe_interval_ms: u64,
    /// When the class last admitted a probe, and which job that was (one live at a time).
    pub(super) last_probe: Option<(Millis, JobId)>,
    /// Probes admitted so far.
    pub(super) probes: u64,
    /// When the class last admitted a request (probes aside).
    pub(super) last_admit_at: Option<Millis>,
    /// actual / estimated service of the class's recent completions, against the estimator's
    /// own figure: the class's empirical correction (see [`LaneState::correction`]).
    pub(super) ratios: VecDeque<f64>,
    /// Prompt tokens of other jobs that started while the class's recent completions ran
    /// (EWMA): what a newcomer of the class should expect to be held up by.
    pub(super) recent_others_prefill: f64,
    /// What admission reads of `errors` and `ratios`, kept current at each completion.
    pub(super) record: ClassRecord,
    /// Configured `forecast`: its requests' waits count the higher-priority work expected to
    /// arrive while they wait (see [`super::forecast`]).
    pub(super) forecast: bool,
    /// Estimated work this lane admitted recently, and refused for want of capacity: its
    /// demand, which lower lanes forecast from.
    pub(super) admitted: RateWindow,
    pub(super) refused: RateWindow,
    /// How late its recent jobs started against the wait projected at admission, as a share
    /// of the promise (wait + service), with when: on pools whose servers report neighbours,
    /// the part of the wait no projection sees (see [`LaneState::wait_margin_at`]).
    pub(super) wait_errors: VecDeque<(Millis, f64)>,
    /// The [`WAIT_QUANTILE_PERCENT`] quantile of `wait_errors`, within [0,
    /// [`MAX_WAIT_MARGIN`]] (0 with fewer than a handful).
    pub(super) wait_margin: f64,
    /// Its tenants' shares (see [`super::tenants`]).
    pub(super) tenants: super::tenants::TenantBook,
}

/// A class's record as admission reads it (see [`LaneState::refresh_record`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct ClassRecord {
    pub(super) errors: ErrorSummary,
    /// The largest relative error among the last [`CONFIRM_RECENT`] completions.
    pub(super) recent_worst: f64,
    pub(super) correction: f64,
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

/// Wait errors kept per lane.
pub(super) const WAIT_ERRORS: usize = 64;
/// The quantile of the wait errors the promise is padded by, in percent.
pub(super) const WAIT_QUANTILE_PERCENT: usize = 99;
/// The largest wait margin: half the promise. A burst of drops must not refuse a class whose
/// deadline is under twice its service on an idle server.
pub(super) const MAX_WAIT_MARGIN: f64 = 0.5;

impl LaneState {
    /// Record how late a job started against its promise (`error`, a share of the promise;
    /// negative: early; a dropped job missed it whole, 1) at `now`, and refresh the margin:
    /// with neighbours on the server the gate does not control, the projection misses the ones
    /// that arrive in bursts while a job waits; the promise is padded by how much it has
    /// recently missed by. Samples older than `window_ms` are forgotten.
    pub(super) fn record_wait_error(&mut self, now: Millis, error: f64, window_ms: u64) {
        if self.wait_errors.len() == WAIT_ERRORS {
            self.wait_errors.pop_front();
        }
        self.wait_errors.push_back((now, error.clamp(-1.0, 1.0)));
        while self
            .wait_errors
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) > window_ms)
        {
            self.wait_errors.pop_front();
        }
        self.wait_margin = if self.wait_errors.len() < CONFIRM_SAMPLES as usize {
            0.0
        } else {
            let mut v: Vec<f64> = self.wait_errors.iter().map(|(_, e)| *e).collect();
            v.sort_by(f64::total_cmp);
            v[(v.len() * WAIT_QUANTILE_PERCENT / 100).min(v.len() - 1)].clamp(0.0, MAX_WAIT_MARGIN)
        };
    }

    /// The wait margin in force at `now`: 0 once the newest sample is older than `window_ms`.
    /// Refused requests add no samples, so a margin learned in a burst must not outlive it:
    /// the class would stay refused on an idle server with nothing to correct it.
    pub(super) fn wait_margin_at(&self, now: Millis, window_ms: u64) -> f64 {
        match self.wait_errors.back() {
            Some((t, _)) if now.saturating_sub(*t) <= window_ms => self.wait_margin,
            _ => 0.0,
        }
    }

    /// A per-class empirical model on top of the shared estimator: the median of actual over
    /// estimated service of the class's last completions. The estimator fits every class's
    /// requests with one set of coefficients, and a class whose requests the fit serves badly
    /// (rare long batch jobs among many short chats; what its requests share the server with)
    /// stays off by the same ratio; this takes that ratio out. 1 until a handful completed;
    /// kept within [`CORRECTION_RANGE`].
    pub(super) fn correction(&self) -> f64 {
        self.record.correction
    }

    /// Recompute the figures admission reads on every offer ([`ClassRecord`]) from the
    /// class's windows: once per completion, not per decision (they sort).
    pub(super) fn refresh_record(&mut self) {
        let correction = if self.ratios.len() < CONFIRM_SAMPLES as usize {
            1.0
        } else {
            // On the stack: this runs at every completion.
            let n = self.ratios.len().min(CORRECTION_WINDOW);
            let mut v = [0.0; CORRECTION_WINDOW];
            for (slot, r) in v.iter_mut().zip(self.ratios.iter().take(n)) {
                *slot = *r;
            }
            let median =
                crate::estimator::quantile(&mut v[..n], 0.5, crate::estimator::Rank::Upper);
            median.clamp(CORRECTION_RANGE.0, CORRECTION_RANGE.1)
        };
        self.record = ClassRecord {
            errors: self.errors.summary(),
            recent_worst: self.errors.recent_max(CONFIRM_RECENT),
            correction,
        };
    }

    /// The share by which a request's wait and service are padded before they are held to its
    /// deadline: the 90th percentile of the class's recent relative errors, within
    /// [MIN_MARGIN, MAX_MARGIN] (0 until a handful completed, and for a frozen estimator, whose figures
    /// are the operator's). The median was tried first and left admitted interactive
    /// requests late or dropped in front of a real llama-server (BENCHMARKS.md).
    pub(super) fn margin(&self, learning: bool) -> f64 {
        let e = self.record.errors;
        if !learning || e.samples < CONFIRM_SAMPLES {
            return 0.0;
        }
        e.p90.clamp(MIN_MARGIN, MAX_MARGIN)
    }

    /// Record a completion's actual service against the estimator's figure for it.
    pub(super) fn learn_ratio(&mut self, model_ms: u64, actual_ms: u64) {
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

/// A job holding a slot: when it started, its estimated service, and its endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Running {
    pub(super) started: Millis,
    pub(super) est: u64,
    pub(super) endpoint: usize,
    /// Its lane: the headroom counts the slots urgent classes already hold.
    pub(super) lane: LaneId,
    /// Its tenant's bucket on the lane, when tenants are told apart (the tenant headroom
    /// counts the slots each tenant holds).
    pub(super) tenant: Option<u32>,
}

#[derive(Debug)]
pub(super) struct PoolState {
    /// The configuration it was built from: a reload keeps the learned estimator unless
    /// the prior or the upstream changed.
    pub(super) prior: PriorConfig,
    pub(super) upstream: Option<String>,
    /// Removed by a reload: no class admits to it; it keeps its slots until its jobs end.
    pub(super) retired: bool,
    pub(super) name: String,
    /// Capacity in force: the available endpoints' slots in force, summed.
    pub(super) slots: u32,
    pub(super) max_depth_factor: Option<f64>,
    pub(super) max_queued: u32,
    /// Width of a bucket of its lanes' demand windows (`forecast_window_ms` / buckets).
    pub(super) forecast_bucket_ms: u64,
    /// Configured `forecast_refused_weight`.
    pub(super) forecast_refused_weight: f64,
    /// Configured `headroom` (see [`super::headroom`]).
    pub(super) headroom: crate::config::Headroom,
    /// Configured `promise_guard_ms`: kept in hand on every promise.
    pub(super) promise_guard_ms: u64,
    pub(super) default_output_tokens: u32,
    /// The configured limits (`[pools.limits]`) and the smallest context window its
    /// servers reported (see [`Gate::set_discovered_context`]).
    pub(super) limits: LimitsConfig,
    pub(super) discovered_context: Option<u32>,
    pub(super) estimator: Estimator,
    /// Prompt characters to tokens, learned from the upstream's usage.
    pub(super) tokens: TokenCounter,
    /// Integral of the in-flight count over time (job-milliseconds) up to `busy_at`: a job's
    /// mean concurrency is the integral's growth over its life divided by its duration.
    pub(super) busy: u128,
    pub(super) busy_at: Millis,
    /// Total context of the jobs in flight now, and its integral over time up to `busy_at`.
    pub(super) context_now: f64,
    pub(super) context_busy: f64,
    /// Mean context of each other job in flight during recent completions (EWMA).
    pub(super) recent_other_context: f64,
    /// Prompt tokens of every job dispatched so far (a counter): the prefill work that
    /// started beside a job is its growth over the job's life.
    pub(super) prefill_dispatched: u64,
    /// Mean concurrency of recent completions (EWMA): what a newcomer will likely share the
    /// server with once the pool is in its usual state.
    pub(super) recent_concurrency: f64,
    /// In-flight jobs.
    pub(super) in_flight: BTreeMap<JobId, Running>,
    /// The servers behind the pool (see [`super::endpoints`]); `slots` is their capacity.
    pub(super) endpoints: Vec<super::endpoints::EndpointState>,
    /// Mean service time of recent completions (EWMA, 0 before any): the size a
    /// neighbour's request is assumed to have.
    pub(super) recent_service_ms: f64,
    /// Slot-milliseconds the servers' neighbours held or queued for, per bucket of the
    /// forecast window (see [`super::forecast`]).
    pub(super) neighbours: RateWindow,
    /// Classes of this pool, highest priority first (ties by class index, for determinism).
    pub(super) classes: Vec<LaneId>,
}

/// Hasher for job ids. Ids are assigned by the gate (sequential, never from input), so
/// SipHash's protection against chosen keys buys nothing here and costs a third of a tick
/// over a long queue; a multiplicative mix spreads sequential ids over the buckets.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IdHasher(u64);

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

pub(super) type IdHash = std::hash::BuildHasherDefault<IdHasher>;

pub(super) const EWMA_ALPHA: f64 = 0.2;

/// Which quantile of a class's output lengths a request with no size hint must fit in its
/// deadline. The mean admits long requests that are later dropped when their slack runs out
/// (a 429 after the client waited); the 0.9 quantile refuses them at once, for a higher
/// admitted SLO attainment at a small cost in on-time count (measured without size hints in
/// the simulator: BENCHMARKS.md).
pub(super) const OUTPUT_QUANTILE: f64 = 0.9;

/// Step of the streaming quantile tracker, as a fraction of the class's mean output.
pub(super) const QUANTILE_STEP: f64 = 0.05;

/// The tracked quantile stays within this many times the class's mean output (a long tail of
/// 20% at 1000 tokens over 10-token answers is a ratio of about 5).
pub(super) const QUANTILE_MAX_RATIO: f64 = 5.0;

/// A class's estimates are confirmed by at least this many recent completions ...
pub(super) const CONFIRM_SAMPLES: u32 = 5;

/// ... whose median signed relative error is within this ...
pub(super) const CONFIRM_BIAS: f64 = 0.25;

/// ... and whose 90th percentile absolute relative error is within this, as is that of each
/// of the last few (one probe that ran far off its estimate is a contradiction).
pub(super) const CONFIRM_P90: f64 = 0.5;

pub(super) const CONFIRM_RECENT: usize = 3;

/// The class correction's window (completions) and range.
pub(super) const CORRECTION_WINDOW: usize = 32;

pub(super) const CORRECTION_RANGE: (f64, f64) = (0.5, 4.0);

/// The largest margin a class's error pads its requests with.
pub(super) const MAX_MARGIN: f64 = 0.5;
/// The smallest, once a learning estimator has a record: the estimates of the work ahead are
/// made again at dispatch with what was learned since, and a request admitted exactly at the
/// edge of its slack is dropped by the first millisecond they move (seen in the simulator at
/// noise 0: admitted with wait = slack, dropped 0.3 s and 2.3 s later).
pub(super) const MIN_MARGIN: f64 = 0.01;

/// Weight of one completion in a pool's recent mean concurrency (EWMA).
pub(super) const CONCURRENCY_ALPHA: f64 = 0.1;
