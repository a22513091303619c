//! Every response the gateway itself writes is built here: rejections, bad input, upstream
//! failures and the small JSON endpoints. Clients (and OpenAI SDKs) see one error shape:
//! `{"error": {"message", "type", "param", "code"}}`, with `code` a stable reason code, plus an
//! `admission` object on admission decisions.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use serde::Serialize;
use slackgate_core::Reason;

/// Boxed error type carried by response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of every response the gateway returns.
pub type ResBody = BoxBody<Bytes, BoxError>;

/// A complete body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> ResBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// The `admission` object of a decision response (and of the decision header's reasoning).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct AdmissionBody {
    /// `reject`, `drop`, ...
    pub action: &'static str,
    /// Stable reason code.
    pub reason: &'static str,
    /// On a decision: age of the oldest job the request would wait behind (`null` on a drop).
    pub queue_age_ms: Option<u64>,
    /// On a drop: the job's own time in the queue (`null` on a decision).
    pub queue_wait_ms: Option<u64>,
    /// Deadline minus now minus estimated service; null for best effort.
    pub deadline_slack_ms: Option<i64>,
    /// Projected wait for a slot.
    pub projected_wait_ms: u64,
    /// On a decision: the part of `projected_wait_ms` forecast from higher-priority work
    /// expected to arrive meanwhile (`null` on a drop).
    pub forecast_wait_ms: Option<u64>,
    /// Estimated service once dispatched.
    pub est_service_ms: u64,
    /// In flight on the pool.
    pub in_flight: u32,
    /// On a decision: jobs queued ahead of the request on its pool (`null` on a drop).
    pub queued_ahead: Option<u32>,
    /// On a drop: jobs queued on the pool, every class, after it (`null` on a decision).
    pub pool_depth: Option<u32>,
    /// Where to go instead (configured per class), if anywhere.
    pub retry_hint: Option<String>,
    /// Milliseconds until a retry could succeed.
    pub retry_after_ms: Option<u64>,
    /// The job id, to join with the decision log.
    pub job_id: u64,
    /// Resolved class.
    pub class: Option<String>,
    /// The idempotency key the decision is about.
    pub idempotency_key: Option<String>,
    /// Ledger details of a `reject_duplicate` (state, tokens held), `reject_retry_cap` or
    /// `budget_exhausted` (remaining grant) rejection.
    pub ledger: Option<slackgate_core::ledger::LedgerReject>,
    /// With `[fairness]` in use, on a decision: the tenant's share of the pool; a
    /// `tenant_share_exceeded` refusal names it (`null` otherwise).
    pub tenant_share: Option<f64>,
}

/// Retry advice for a rejection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryAdvice {
    /// When to come back.
    pub after_ms: u64,
    /// Whether coming back can help (`x-should-retry`).
    pub should_retry: bool,
}

/// The error type string OpenAI-style clients see for each family of reasons.
fn error_type(reason: Reason) -> &'static str {
    match reason {
        Reason::InvalidJson
        | Reason::BodyTooLarge
        | Reason::InvalidDeadline
        | Reason::ContextLengthExceeded
        | Reason::ClientCancelled => "invalid_request_error",
        Reason::UpstreamUnavailable
        | Reason::UpstreamTimeout
        | Reason::UpstreamError
        | Reason::UpstreamThrottled => "upstream_error",
        Reason::ShuttingDown | Reason::ClusterUnavailable | Reason::LedgerUnavailable => {
            "service_unavailable"
        }
        _ => "admission_rejected",
    }
}

/// Reason code of a request whose body did not arrive within `server.body_read_timeout_ms`.
/// Not an admission-core reason (the core never sees the request), so it lives here, the one
/// place the gateway writes its own responses; the decision log uses this same constant.
pub const BODY_READ_TIMEOUT: &str = "body_read_timeout";

/// 408: the request body did not arrive within `limit_ms`.
pub fn body_read_timeout(limit_ms: u64) -> Response<ResBody> {
    with_code(
        StatusCode::REQUEST_TIMEOUT,
        BODY_READ_TIMEOUT,
        "invalid_request_error",
        &format!("the request body did not arrive within {limit_ms} ms"),
        None,
        None,
    )
}

/// An admin API error: the same body shape, with an admin code (`unauthorized`,
/// `unknown_flag`, `unknown_class`, `invalid_config`, ...).
pub fn admin_error(status: StatusCode, code: &'static str, message: &str) -> Response<ResBody> {
    let mut r = with_code(status, code, "admin_error", message, None, None);
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"slackgate-admin\""),
        );
    }
    r
}

/// A refused request to one of the gate's own pages (`/stats?snapshot=`, the live page):
/// the same body shape, with its code (`snapshot_gone`, `invalid_query`, ...).
pub fn page_error(status: StatusCode, code: &'static str, message: &str) -> Response<ResBody> {
    with_code(status, code, "invalid_request_error", message, None, None)
}

/// A 200 response whose body is `bytes` of `content_type` (a serialized frame, an asset).
pub fn bytes(content_type: &'static str, body: Bytes) -> Response<ResBody> {
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    resp
}

/// Cluster mode: this replica does not hold the gate's lease (it changed hands) and did
/// nothing with the request; the replica that sent it here asks Redis where the lease is
/// now and sends it there (the header marks the answer as this refusal, not an upstream's).
pub fn not_leader() -> Response<ResBody> {
    let mut r = error(
        StatusCode::SERVICE_UNAVAILABLE,
        Reason::ClusterUnavailable,
        "this replica does not hold the gate's lease (it changed hands): ask again",
        None,
        None,
    );
    r.headers_mut().insert(
        crate::wire::headers::NOT_LEADER_HEADER,
        http::HeaderValue::from_static("1"),
    );
    r
}

/// Build an error response with the one body shape every client can parse.
pub fn error(
    status: StatusCode,
    reason: Reason,
    message: &str,
    admission: Option<&AdmissionBody>,
    retry: Option<RetryAdvice>,
) -> Response<ResBody> {
    let mut r = with_code(
        status,
        reason.as_str(),
        error_type(reason),
        message,
        admission,
        retry,
    );
    r.headers_mut().insert(
        crate::wire::headers::DROPPED_REASON_HEADER,
        HeaderValue::from_static(reason.as_str()),
    );
    r
}

fn with_code(
    status: StatusCode,
    code: &'static str,
    kind: &'static str,
    message: &str,
    admission: Option<&AdmissionBody>,
    retry: Option<RetryAdvice>,
) -> Response<ResBody> {
    let body = serde_json::json!({
        "error": {
            "message": message,
            "type": kind,
            "param": null,
            "code": code,
        },
        "admission": admission,
    });
    let bytes = serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert("x-slackgate-reason", HeaderValue::from_static(code));
    set_retry(&mut resp, retry);
    resp
}

/// Add the reason and retry advice headers to a response built elsewhere (the reservation
/// API's seed-shaped bodies).
pub fn add_retry_headers(resp: &mut Response<ResBody>, reason: Reason, retry: Option<RetryAdvice>) {
    resp.headers_mut().insert(
        "x-slackgate-reason",
        HeaderValue::from_static(reason.as_str()),
    );
    resp.headers_mut().insert(
        crate::wire::headers::DROPPED_REASON_HEADER,
        HeaderValue::from_static(reason.as_str()),
    );
    set_retry(resp, retry);
}

/// Hold an upstream's own `Retry-After` / `retry-after-ms` (relayed with its response) to the
/// gate's ceiling (`retry.max_retry_after_ms`). A date past it, or a value that does not
/// parse as a number of seconds, is replaced by the ceiling in seconds.
pub fn clamp_relayed_retry(headers: &mut http::HeaderMap, ceiling_ms: u64) {
    let secs = ceiling_ms.div_ceil(1000).max(1);
    // (header, its unit in ms, the ceiling in that unit)
    for (name, unit_ms, ceiling) in [
        (http::header::RETRY_AFTER, 1000.0, secs),
        (HeaderName::from_static("retry-after-ms"), 1.0, ceiling_ms),
    ] {
        let Some(v) = headers.get(&name) else {
            continue;
        };
        let within = v
            .to_str()
            .ok()
            .and_then(|t| t.trim().parse::<f64>().ok())
            .is_some_and(|n| n.is_finite() && n >= 0.0 && n * unit_ms <= ceiling_ms as f64);
        if !within {
            headers.insert(name, HeaderValue::from(ceiling));
        }
    }
}

fn set_retry(resp: &mut Response<ResBody>, retry: Option<RetryAdvice>) {
    let h = resp.headers_mut();
    if let Some(r) = retry {
        // Whole seconds, rounded up (RFC 9110), and the exact figure for SDKs that read it.
        let secs = r.after_ms.div_ceil(1000).max(1);
        h.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        h.insert("retry-after-ms", HeaderValue::from(r.after_ms));
        h.insert(
            "x-should-retry",
            HeaderValue::from_static(if r.should_retry { "true" } else { "false" }),
        );
    }
}

/// A 200 JSON response.
pub fn json<T: Serialize>(value: &T) -> Response<ResBody> {
    match serde_json::to_vec_pretty(value) {
        Ok(bytes) => {
            let mut resp = Response::new(full(bytes));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            Reason::UpstreamError,
            &format!("cannot encode response: {e}"),
            None,
            None,
        ),
    }
}

/// A 200 plain-text response.
pub fn text(content_type: &'static str, body: String) -> Response<ResBody> {
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    resp
}

/// 404 for paths the gateway does not serve.
pub fn not_found(path: &str) -> Response<ResBody> {
    let body = serde_json::json!({
        "error": {"message": format!("no route for {path}"), "type": "invalid_request_error",
                  "param": null, "code": "not_found"}
    });
    let mut resp = Response::new(full(serde_json::to_vec(&body).unwrap_or_default()));
    *resp.status_mut() = StatusCode::NOT_FOUND;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relayed_retry_after_is_held_to_the_ceiling() {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from_static("87413276"),
        );
        h.insert("retry-after-ms", HeaderValue::from_static("87413275800"));
        clamp_relayed_retry(&mut h, 300_000);
        assert_eq!(h[http::header::RETRY_AFTER], "300");
        assert_eq!(h["retry-after-ms"], "300000");
        // An HTTP date is not trusted to be near: the ceiling.
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from_static("Fri, 31 Dec 2100 23:59:59 GMT"),
        );
        clamp_relayed_retry(&mut h, 300_000);
        assert_eq!(h[http::header::RETRY_AFTER], "300");
        // Within the ceiling: left as sent; absent: not added.
        let mut h = http::HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("2"));
        clamp_relayed_retry(&mut h, 300_000);
        assert_eq!(h[http::header::RETRY_AFTER], "2");
        assert!(h.get("retry-after-ms").is_none());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let r = error(
            StatusCode::TOO_MANY_REQUESTS,
            Reason::ProjectedWaitExceedsSlack,
            "full",
            None,
            Some(RetryAdvice {
                after_ms: 1001,
                should_retry: true,
            }),
        );
        assert_eq!(r.headers()["retry-after"], "2");
        assert_eq!(r.headers()["retry-after-ms"], "1001");
        assert_eq!(r.headers()["x-should-retry"], "true");
        assert_eq!(
            r.headers()["x-llm-d-request-dropped-reason"],
            "projected_wait_exceeds_slack"
        );
        assert_eq!(
            r.headers()["x-slackgate-reason"],
            "projected_wait_exceeds_slack"
        );
    }
}
