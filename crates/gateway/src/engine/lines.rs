//! The decision log's lines for each transition of a job, and the admission body a refused
//! or dropped request is answered with.

use crate::engine::state::{JobMeta, Outcome};
use crate::observe::codes::LineReason;
use crate::observe::telemetry::LogLine;
use crate::support::clock::epoch_ms;
use crate::wire::response::AdmissionBody;
use slackgate_core::{Action, Completed, Decision, JobId, Reason};

pub(crate) fn base_line(id: JobId, meta: &JobMeta, action: Action, reason: Reason) -> LogLine {
    LogLine {
        ts_ms: epoch_ms(),
        job_id: id.0,
        class: (!meta.class.is_empty()).then(|| meta.class.clone()),
        class_label: meta.label.clone(),
        tenant: meta.tenant.clone(),
        idempotency_key: meta.idempotency_key.clone(),
        enqueued_at_ms: Some(meta.arrived_epoch_ms),
        action: action.into(),
        reason: reason.into(),
        pool: (!meta.pool.is_empty()).then(|| meta.pool.clone()),
        endpoint: meta.endpoint.clone(),
        path: Some(meta.path.clone()),
        attempt: meta.attempt,
        ..LogLine::default()
    }
}

pub(crate) fn decision_line(d: &Decision, meta: &JobMeta) -> LogLine {
    let mut line = base_line(d.job_id, meta, d.action, d.reason);
    line.queue_age_ms = Some(d.queue_age_ms);
    line.deadline_slack_ms = d.deadline_slack_ms;
    line.projected_wait_ms = Some(d.projected_wait_ms);
    line.forecast_wait_ms = Some(d.forecast_wait_ms);
    line.est_service_ms = Some(d.est_service_ms);
    line.in_flight = Some(d.in_flight);
    line.queued_ahead = Some(d.queued_ahead);
    // A rejection holds nothing: `null`, on the proxy's and the reservation API's alike.
    line.tokens_held = d.admitted().then_some(meta.tokens_held);
    line.displaced_job_id = d.displaced.map(|id| id.0);
    line.tenant_share = d.tenant_share;
    if !d.admitted() {
        // The status the client is answered: a duplicate is a conflict, the rest "not now".
        line.status = Some(if d.reason == Reason::RejectDuplicate {
            409
        } else {
            429
        });
    }
    line
}

/// The decision-log line of a request that ended before it reached the core.
pub(crate) fn unqueued_line(
    action: Action,
    reason: LineReason,
    status: Option<u16>,
    path: &str,
    label: Option<String>,
) -> LogLine {
    LogLine {
        ts_ms: epoch_ms(),
        action: action.into(),
        reason,
        status,
        path: Some(path.to_string()),
        class_label: label,
        ..LogLine::default()
    }
}

pub(crate) fn end_line(
    c: &Completed,
    meta: &JobMeta,
    outcome: Option<Outcome>,
    wasted: u64,
    cancel_reason: Reason,
) -> LogLine {
    let (action, reason) = match outcome {
        Some(o) => (
            Action::Complete,
            o.reason.unwrap_or(if o.ok {
                Reason::Completed
            } else {
                Reason::UpstreamError
            }),
        ),
        None => (Action::Cancel, cancel_reason),
    };
    let mut line = base_line(c.job_id, meta, action, reason);
    line.queue_wait_ms = Some(c.queue_wait_ms);
    line.deadline_slack_ms = c.deadline_slack_ms;
    line.in_flight = Some(c.in_flight);
    line.pool_depth = Some(c.pool_depth);
    line.turnaround_ms = Some(c.turnaround_ms);
    line.ttft_ms = c.time_to_first_token_ms;
    line.tokens_held = Some(meta.tokens_held);
    if c.dispatched {
        line.est_service_ms = Some(c.est_service_ms);
        line.service_ms = Some(c.service_ms);
        line.concurrency = Some((c.concurrency * 100.0).round() / 100.0);
        if outcome.is_some_and(|o| o.ok) {
            let actual = c.service_ms.max(1) as f64;
            let e = (c.est_service_ms as f64 - actual) / actual;
            line.est_error = Some((e * 1000.0).round() / 1000.0);
        }
    }
    if let Some(o) = outcome {
        line.status = Some(o.status);
    }
    // The ledger's settlement is the truth for tokens; without one (never reserved), fall
    // back to what the response reported.
    match &c.hold {
        Some(h) => {
            line.tokens_spent = Some(h.tokens_spent);
            line.tokens_wasted = Some(h.tokens_wasted);
            if h.state == slackgate_core::HoldState::Expired {
                line.reason = Reason::HoldExpired.into();
            }
        }
        None => {
            let spent = outcome.map_or(0, |o| {
                u64::from(o.prompt_tokens.unwrap_or(0))
                    + u64::from(o.completion_tokens.unwrap_or(0))
            });
            line.tokens_spent = Some(spent);
            line.tokens_wasted = Some(if outcome.is_some() { 0 } else { wasted });
        }
    }
    line
}

pub(crate) fn admission_body(
    d: &Decision,
    meta: &JobMeta,
    retry_hint: Option<String>,
) -> AdmissionBody {
    AdmissionBody {
        action: d.action.as_str(),
        reason: d.reason.as_str(),
        queue_age_ms: Some(d.queue_age_ms),
        queue_wait_ms: None,
        deadline_slack_ms: d.deadline_slack_ms,
        projected_wait_ms: d.projected_wait_ms,
        forecast_wait_ms: Some(d.forecast_wait_ms),
        est_service_ms: d.est_service_ms,
        in_flight: d.in_flight,
        queued_ahead: Some(d.queued_ahead),
        pool_depth: None,
        retry_hint,
        retry_after_ms: d.retry_after_ms,
        job_id: d.job_id.0,
        class: (!meta.class.is_empty()).then(|| meta.class.clone()),
        idempotency_key: (!d.idempotency_key.is_empty()).then(|| d.idempotency_key.to_string()),
        ledger: d.ledger.clone(),
        tenant_share: d.tenant_share,
    }
}
