//! Stable reason and action codes.
//!
//! These strings are an interface: they appear in HTTP bodies, the decision log, metric labels
//! and the docs. Never rename one; add a new variant instead.

use serde::Serialize;

/// Why a decision, drop or completion happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Admitted: the projected wait fits the request's slack (or it has no deadline).
    WithinSlack,
    /// Admitted because the `admit_always` rollback flag bypasses every threshold.
    AdmitAlways,
    /// Admitted on an idle pool while the estimator is still learning (fewer than a handful of
    /// completions): a prior that is too pessimistic must not lock the gate shut forever.
    EstimatorWarmup,
    /// Dispatched: a slot became free for the job.
    SlotFree,
    /// The class is switched off (drain, `probe_class_enabled = false`).
    ClassDisabled,
    /// No class label (or an unknown one) and no default class configured.
    RejectUnlabeled,
    /// The idempotency key is already held or done: a replay never reserves or spends twice.
    RejectDuplicate,
    /// The attempt number is over the ledger's retry cap.
    RejectRetryCap,
    /// The tenant's token grant cannot cover the hold.
    BudgetExhausted,
    /// The hold outlived its TTL before it was settled; its tokens count as wasted.
    HoldExpired,
    /// The oldest job this request would wait behind is older than the class's `max_queue_age_ms`.
    QueueAgeExceeded,
    /// Every slot is busy and the queue ahead is deeper than `max_depth_factor` x slots.
    QueueDepthExceeded,
    /// The projected wait for a slot is longer than the request's remaining deadline slack.
    ProjectedWaitExceedsSlack,
    /// A queued job can no longer finish by its deadline; it is dropped instead of being sent.
    DeadlineUnmeetable,
    /// The upstream answered and the response body ended normally.
    Completed,
    /// The client went away before its response ended.
    ClientCancelled,
    /// The request body is not valid JSON (or not a JSON object).
    InvalidJson,
    /// The request body is larger than the configured limit.
    BodyTooLarge,
    /// A deadline header is malformed, negative or absurd.
    InvalidDeadline,
    /// A well-formed body with a missing or invalid field (reservation API).
    InvalidRequest,
    /// The upstream refused the connection or could not be reached; at admission, every
    /// endpoint of the pool is ejected or drained (a capacity refusal: another pool can help).
    UpstreamUnavailable,
    /// The upstream (a hosted API) answered 429: the gate answers with its own 429 and a
    /// Retry-After at least the provider's, pauses that endpoint until then and halves its
    /// slots. The request's hold is released, not spent.
    UpstreamThrottled,
    /// The upstream stayed silent past the request's deadline.
    UpstreamTimeout,
    /// The upstream broke the response (reset, protocol error) or answered with a server error.
    UpstreamError,
    /// The gateway is shutting down and no longer accepts work; queued work that cannot finish
    /// before the shutdown deadline is told so at once.
    ShuttingDown,
    /// The class is being drained (admin API) and its queued or in-flight work was cancelled.
    Drained,
    /// The class's own pool could not take the request in time, so it was admitted on the
    /// class's overflow pool (`overflow = "route"`).
    OverflowRouted,
    /// A queued request was refused to make room for a shorter one of its class that would
    /// otherwise have been rejected (`displace_within_ms`); it was never sent upstream.
    Displaced,
    /// Admitted on a free slot although its own estimate said it could not make its deadline,
    /// because nothing of its class was admitted for `probe_interval_ms`: a bounded share that
    /// measures the estimate, so the gate never locks itself in (such a request may well be
    /// late: that is the price, one per interval at most).
    Probe,
    /// Cluster mode: no replica holds the gate's lease, or it cannot be reached (Redis down or
    /// slow, the leader gone), and the class fails closed (`fail_mode = "closed"`): refused
    /// with 503 rather than decided on one replica's partial view.
    ClusterUnavailable,
    /// The ledger store (SQLite file, Redis) could not make a hold durable within its timeout
    /// and the class fails closed: the request is refused with 503 before any upstream work,
    /// its hold released.
    LedgerUnavailable,
    /// The request cannot fit the pool's servers: its prompt plus its `max_tokens` is past
    /// their context window (or its `max_tokens` past their output limit). Refused at
    /// arrival with 400, as vLLM and OpenAI answer it (llama.cpp would stop at its window
    /// instead); a retry of the same request cannot help.
    ContextLengthExceeded,
    /// `[fairness]`: the tenant's queued work on the class is more than its share of the
    /// pool serves within the request's slack (another tenant's share is kept for it). The
    /// tenant's own requests are refused early; the others keep their slack. Retry-After is
    /// when its backlog will fit.
    TenantShareExceeded,
}

impl Reason {
    /// A capacity rejection: the pool could not take the request in time. Only these can be
    /// helped by another pool (`retry_hint`, `overflow`); a switched-off class, a duplicate
    /// or a spent grant would be refused there too.
    pub fn is_capacity(self) -> bool {
        matches!(
            self,
            Reason::QueueAgeExceeded
                | Reason::QueueDepthExceeded
                | Reason::ProjectedWaitExceedsSlack
                | Reason::UpstreamUnavailable
        )
    }

    /// The stable code used in logs, metrics, response bodies and docs.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::WithinSlack => "within_slack",
            Reason::AdmitAlways => "admit_always",
            Reason::EstimatorWarmup => "estimator_warmup",
            Reason::SlotFree => "slot_free",
            Reason::ClassDisabled => "class_disabled",
            Reason::RejectUnlabeled => "reject_unlabeled",
            Reason::RejectDuplicate => "reject_duplicate",
            Reason::RejectRetryCap => "reject_retry_cap",
            Reason::BudgetExhausted => "budget_exhausted",
            Reason::HoldExpired => "hold_expired",
            Reason::QueueAgeExceeded => "queue_age_exceeded",
            Reason::QueueDepthExceeded => "queue_depth_exceeded",
            Reason::ProjectedWaitExceedsSlack => "projected_wait_exceeds_slack",
            Reason::DeadlineUnmeetable => "deadline_unmeetable",
            Reason::Completed => "completed",
            Reason::ClientCancelled => "client_cancelled",
            Reason::InvalidJson => "invalid_json",
            Reason::BodyTooLarge => "body_too_large",
            Reason::InvalidDeadline => "invalid_deadline",
            Reason::InvalidRequest => "invalid_request",
            Reason::UpstreamUnavailable => "upstream_unavailable",
            Reason::UpstreamThrottled => "upstream_throttled",
            Reason::UpstreamTimeout => "upstream_timeout",
            Reason::UpstreamError => "upstream_error",
            Reason::ShuttingDown => "shutting_down",
            Reason::Drained => "drained",
            Reason::OverflowRouted => "overflow_routed",
            Reason::Displaced => "displaced",
            Reason::Probe => "probe",
            Reason::ClusterUnavailable => "cluster_unavailable",
            Reason::LedgerUnavailable => "ledger_unavailable",
            Reason::ContextLengthExceeded => "context_length_exceeded",
            Reason::TenantShareExceeded => "tenant_share_exceeded",
        }
    }

    /// Every reason, in declaration order (for docs and metric pre-registration).
    pub const ALL: [Reason; 33] = [
        Reason::WithinSlack,
        Reason::AdmitAlways,
        Reason::EstimatorWarmup,
        Reason::SlotFree,
        Reason::ClassDisabled,
        Reason::RejectUnlabeled,
        Reason::RejectDuplicate,
        Reason::RejectRetryCap,
        Reason::BudgetExhausted,
        Reason::HoldExpired,
        Reason::QueueAgeExceeded,
        Reason::QueueDepthExceeded,
        Reason::ProjectedWaitExceedsSlack,
        Reason::DeadlineUnmeetable,
        Reason::Completed,
        Reason::ClientCancelled,
        Reason::InvalidJson,
        Reason::BodyTooLarge,
        Reason::InvalidDeadline,
        Reason::InvalidRequest,
        Reason::UpstreamUnavailable,
        Reason::UpstreamThrottled,
        Reason::UpstreamTimeout,
        Reason::UpstreamError,
        Reason::ShuttingDown,
        Reason::Drained,
        Reason::OverflowRouted,
        Reason::Displaced,
        Reason::Probe,
        Reason::ClusterUnavailable,
        Reason::LedgerUnavailable,
        Reason::ContextLengthExceeded,
        Reason::TenantShareExceeded,
    ];
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happened to a request at one point of its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Accepted into the queue.
    Admit,
    /// Refused at arrival, before it was queued.
    Reject,
    /// Sent upstream: it holds a slot now.
    Dispatch,
    /// Removed from the queue without being sent (its deadline became unmeetable).
    Drop,
    /// Finished upstream (successfully or not) and released its slot.
    Complete,
    /// The client went away; its slot or queue place was released.
    Cancel,
    /// Refused for bad input or a broken upstream, outside the admission policy.
    Error,
    /// Shadow mode: the gate would have rejected the request (the decision's reason says
    /// why) but admitted it, so thresholds can be calibrated on live traffic first.
    ShadowReject,
}

impl Action {
    /// The stable code used in logs, metrics and response bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Admit => "admit",
            Action::Reject => "reject",
            Action::Dispatch => "dispatch",
            Action::Drop => "drop",
            Action::Complete => "complete",
            Action::Cancel => "cancel",
            Action::Error => "error",
            Action::ShadowReject => "shadow_reject",
        }
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_codes_are_unique_and_match_serde() {
        let mut seen = std::collections::BTreeSet::new();
        for r in Reason::ALL {
            assert!(seen.insert(r.as_str()), "duplicate code {}", r.as_str());
            let json = serde_json_like(r);
            assert_eq!(json, r.as_str());
        }
    }

    // serde's snake_case renaming must agree with as_str(); check through Debug-to-snake.
    fn serde_json_like(r: Reason) -> String {
        let dbg = format!("{r:?}");
        let mut out = String::new();
        for (i, ch) in dbg.chars().enumerate() {
            if ch.is_uppercase() {
                if i > 0 {
                    out.push('_');
                }
                out.extend(ch.to_lowercase());
            } else {
                out.push(ch);
            }
        }
        out
    }
}
