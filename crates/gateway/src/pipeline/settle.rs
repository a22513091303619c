//! How a dispatched job ends: the one place that settles it (its outcome, the endpoint's
//! verdict on the answer, and through the job guard the ledger and the estimator) and
//! answers the client. Every ending of the exchange comes here: a refusal after dispatch, a
//! failure or cancellation, a provider's 429, and an answer, which streams back through a
//! [`TrackedBody`] that settles the job when the stream ends.

use super::exchange::{Ending, Upstream};
use super::slot::SlotRefused;
use crate::engine::body::TrackedBody;
use crate::engine::health::{Failure, Verdict};
use crate::engine::state::{JobGuard, Outcome, Shared};
use crate::support::clock::epoch_ms;
use crate::wire::headers::strip_hop_by_hop;
use crate::wire::response::{self, ResBody, RetryAdvice};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use slackgate_core::{Decision, PoolId, Reason};
use std::time::Duration;

/// Settle a job refused after its dispatch, before anything went upstream.
pub(super) fn refused(guard: JobGuard, why: SlotRefused) -> Response<ResBody> {
    match why {
        // The gate answered for it; the guard, dropped here, ends the job.
        SlotRefused::Answer(resp) => resp,
        SlotRefused::LedgerDown(e) => ledger_unavailable(guard, &e),
        SlotRefused::Duplicate(key) => duplicate_in_store(guard, &key),
        SlotRefused::Deposed => {
            guard.cancel_with(Reason::ClusterUnavailable, 0);
            response::not_leader()
        }
    }
}

/// Settle a job by how its exchange ended, and answer the client.
pub(super) fn ended(
    shared: &Shared,
    guard: JobGuard,
    decision: &Decision,
    up: Upstream,
    ending: Ending,
) -> Response<ResBody> {
    match ending {
        Ending::Answered(resp) => answered(shared, guard, decision, up, resp),
        Ending::Failed {
            status,
            reason,
            message,
        } => fail(guard, status, reason, &message),
        Ending::Cancelled(why) => {
            let msg = match why {
                Reason::Drained => "the request's class was drained with cancel by an operator",
                _ => "the gate is shutting down and its grace period ended",
            };
            guard.cancel_with(why, 0);
            response::error(StatusCode::SERVICE_UNAVAILABLE, why, msg, None, None)
        }
        Ending::Refused(why) => refused(guard, why),
    }
}

/// Classify the upstream's answer and stream it back. A provider's 429 is the gate's own 429,
/// never a 502: the endpoint is paused as the provider asks and its slots halve; the hold is
/// released, not spent. Any other answer is a live server; a 5xx is a failing one.
fn answered(
    shared: &Shared,
    guard: JobGuard,
    decision: &Decision,
    up: Upstream,
    resp: Response<Incoming>,
) -> Response<ResBody> {
    if resp.status() == StatusCode::TOO_MANY_REQUESTS {
        shared.endpoint_verdict(up.pool, up.endpoint, Verdict::Healthy, false);
        return throttled(shared, guard, up.pool, up.endpoint, resp.headers());
    }
    let verdict = if resp.status().is_server_error() {
        Verdict::Failed(Failure::Status5xx)
    } else {
        Verdict::Healthy
    };
    shared.endpoint_verdict(up.pool, up.endpoint, verdict, false);
    stream_back(shared, guard, decision, up, resp)
}

/// The upstream's answer as the client gets it: hop-by-hop headers stripped, a relayed
/// Retry-After held to the ceiling, the gate's own headers stamped, and the body wrapped so
/// the job settles when the stream ends (or its client goes away).
fn stream_back(
    shared: &Shared,
    guard: JobGuard,
    decision: &Decision,
    up: Upstream,
    resp: Response<Incoming>,
) -> Response<ResBody> {
    let (mut rparts, rbody) = resp.into_parts();
    let sse = rparts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    strip_hop_by_hop(&mut rparts.headers);
    hold_relayed_retry(shared, &mut rparts.headers);
    stamp(&mut rparts.headers, decision, &up);
    let status = rparts.status.as_u16();
    let idle = Duration::from_millis(shared.server.stream_idle_timeout_ms);
    let mut tracked = TrackedBody::new(rbody, guard, sse, status, idle);
    if let Some(abort) = up.abort {
        tracked = tracked.with_abort(abort);
    }
    Response::from_parts(rparts, BodyExt::boxed(tracked))
}

/// The gate's own headers on an answer it relays.
fn stamp(h: &mut HeaderMap, decision: &Decision, up: &Upstream) {
    h.insert("x-slackgate-job-id", HeaderValue::from(decision.job_id.0));
    h.insert(
        "x-slackgate-queue-wait-ms",
        HeaderValue::from(up.queue_wait_ms),
    );
    // `admit`, or `shadow_reject` (shadow mode admitted what the gate would have rejected;
    // the reason says why).
    h.insert(
        "x-slackgate-decision",
        HeaderValue::from_static(decision.action.as_str()),
    );
    if let Ok(v) = HeaderValue::from_str(&up.pool_name) {
        h.insert("x-slackgate-pool", v);
    }
    h.insert(
        "x-slackgate-reason",
        HeaderValue::from_static(decision.reason.as_str()),
    );
    if let Some(s) = decision.deadline_slack_ms {
        h.insert("x-slackgate-deadline-slack-ms", HeaderValue::from(s));
    }
    h.insert(
        "x-slackgate-projected-wait-ms",
        HeaderValue::from(decision.projected_wait_ms),
    );
}

/// An upstream's own Retry-After, relayed with its answer, stops at the gate's ceiling too.
pub(super) fn hold_relayed_retry(shared: &Shared, headers: &mut HeaderMap) {
    if headers.contains_key(http::header::RETRY_AFTER) || headers.contains_key("retry-after-ms") {
        response::clamp_relayed_retry(headers, shared.retry_ceiling_ms());
    }
}

/// Refuse a dispatched request before anything goes upstream: its slot and hold released,
/// nothing spent (the job is cancelled under `reason`), the client told `message`.
fn refuse_dispatched(
    guard: JobGuard,
    status: StatusCode,
    reason: Reason,
    message: &str,
    advice: RetryAdvice,
) -> Response<ResBody> {
    guard.cancel_with(reason, 0);
    response::error(status, reason, message, None, Some(advice))
}

/// The shared ledger refused the hold (another replica holds or has settled its key): 409
/// `reject_duplicate`.
fn duplicate_in_store(guard: JobGuard, key: &str) -> Response<ResBody> {
    refuse_dispatched(
        guard,
        StatusCode::CONFLICT,
        Reason::RejectDuplicate,
        &format!(
            "idempotency key {key:?} is already held or done in the shared ledger: a replay \
             never reserves or spends twice"
        ),
        RetryAdvice {
            after_ms: 60_000,
            should_retry: false,
        },
    )
}

/// The ledger store could not record the hold and the class fails closed: 503
/// `ledger_unavailable`.
fn ledger_unavailable(guard: JobGuard, why: &crate::ledger_store::StoreError) -> Response<ResBody> {
    refuse_dispatched(
        guard,
        StatusCode::SERVICE_UNAVAILABLE,
        Reason::LedgerUnavailable,
        &format!(
            "the ledger store could not record this request's hold ({why}), and its class \
             fails closed: nothing was sent upstream; retry shortly"
        ),
        RetryAdvice {
            after_ms: 1_000,
            should_retry: true,
        },
    )
}

/// The upstream answered 429: pause its endpoint for the provider's Retry-After (the gate's
/// floor without one), end the job unspent, and answer 429 `upstream_throttled` with a
/// Retry-After at least the provider's.
fn throttled(
    shared: &Shared,
    guard: JobGuard,
    pool: PoolId,
    endpoint: usize,
    headers: &HeaderMap,
) -> Response<ResBody> {
    let provider = crate::upstream::throttle::provider_retry_after(headers, epoch_ms());
    let (after_ms, should_retry) = shared.throttle_endpoint(pool, endpoint, provider);
    guard.finish(Outcome {
        status: 429,
        reason: Some(Reason::UpstreamThrottled),
        ..Outcome::default()
    });
    let msg = match provider {
        Some(ms) => format!(
            "the upstream is rate limiting this pool and asked for {ms} ms; not sent again before then"
        ),
        None => "the upstream is rate limiting this pool (it gave no Retry-After)".to_string(),
    };
    response::error(
        StatusCode::TOO_MANY_REQUESTS,
        Reason::UpstreamThrottled,
        &msg,
        None,
        Some(RetryAdvice {
            after_ms,
            should_retry,
        }),
    )
}

/// End the job with `reason` and answer the client with the matching error: a dispatched
/// request that never reached (or never heard from) the upstream. The end line of the
/// decision log carries `message` too.
fn fail(guard: JobGuard, status: StatusCode, reason: Reason, message: &str) -> Response<ResBody> {
    guard.fail(
        Outcome {
            reason: Some(reason),
            ..Outcome::default()
        },
        message,
    );
    response::error(status, reason, message, None, None)
}
