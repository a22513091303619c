//! The core's public vocabulary: what a caller passes in ([`Request`], [`Completion`]) and
//! what it gets back ([`Decision`], [`Event`], [`Completed`]), with the ids that name jobs,
//! lanes and pools.

use super::*;

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
pub struct LaneId(pub usize);

/// Index of a pool in the configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PoolId(pub usize);

/// A request as the core sees it: everything I/O-related is already parsed away.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// Resolved class (see [`Gate::classify`]); `None` means unlabeled with no default.
    pub class: Option<LaneId>,
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
    /// The id its fair share is counted under (`[fairness]`): the gateway's fairness header
    /// where the config names one, else the tenant. `None` counts in the shared bucket.
    pub fairness_id: Option<String>,
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
    pub class: Option<LaneId>,
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
    /// Projected time until a slot is free for this request (the work ahead now, plus
    /// `forecast_wait_ms`).
    pub projected_wait_ms: u64,
    /// The part of `projected_wait_ms` that higher-priority work expected to arrive while it
    /// waits adds (0 for the top priority, or with the class's `forecast = false`).
    pub forecast_wait_ms: u64,
    /// Estimated service time once dispatched.
    pub est_service_ms: u64,
    /// Expected output tokens used for the estimate.
    pub expected_output_tokens: u32,
    /// Requests in flight on the pool at decision time.
    pub in_flight: u32,
    /// Jobs queued ahead of this one (same or higher priority) at decision time.
    pub queued_ahead: u32,
    /// For rejections: when a retry could succeed.
    pub retry_after_ms: Option<u64>,
    /// For rejections: whether a retry can succeed soon (`x-should-retry`).
    pub should_retry: bool,
    /// The absolute deadline the gate holds the request to.
    pub deadline: Option<Millis>,
    /// The idempotency key the hold is (or would be) under.
    pub idempotency_key: crate::ledger::Shared,
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
    /// With `[fairness]` in use: the tenant's share of the pool at decision time (its weight
    /// over the active tenants' weights); `None` otherwise.
    pub tenant_share: Option<f64>,
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
        class: LaneId,
        /// Its pool.
        pool: PoolId,
        /// The endpoint of the pool it goes to (an index of the pool's endpoints: see
        /// [`Gate::endpoints`]).
        endpoint: usize,
        /// Time it spent queued.
        queue_wait_ms: u64,
        /// Slack left at dispatch (deadline - now - estimated service).
        deadline_slack_ms: Option<i64>,
        /// Estimated service time.
        est_service_ms: u64,
        /// In flight on the pool after this dispatch.
        in_flight: u32,
        /// Still queued on the pool.
        pool_depth: u32,
        /// The time since the pool's headroom (slots kept for higher classes) first held it
        /// back from a free slot; `None` when it never did.
        held_ms: Option<u64>,
    },
    /// This queued job will not be sent: answer its client with the reason.
    Drop {
        /// The job.
        job_id: JobId,
        /// Its class.
        class: LaneId,
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
        pool_depth: u32,
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
    pub class: LaneId,
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
    pub pool_depth: u32,
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
