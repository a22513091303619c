//! The reservation API (seed 001), for workers that call the model themselves:
//! `POST /admission/v1/reserve`, `/commit`, `/cancel`, `/expire`, `GET /admission/v1/stats`.
//!
//! A reservation is the same decision, against the same queues and the same ledger, as a
//! proxied request: it counts toward the projected wait of everything behind it until the
//! worker commits (tokens spent) or cancels (tokens wasted), or its hold expires. Bodies and
//! action codes follow seed 001 (`reserve`, `reject_duplicate`, `reject_retry_cap`,
//! `reject_unreserved`, `commit`, `hold_expired`, `missing_hold`, `expire`); figures are given
//! in seconds as the seed does (`projected_wait_s` is the wait *plus* the job's own service,
//! i.e. when it would finish) and in milliseconds.

use crate::engine::state::{JobMeta, Shared};
use crate::engine::unqueued::{bad_request, body_failure, read_body};
use crate::wire::request_info::BadRequest;
use crate::wire::response::{self, ResBody};
use http::{Request, Response, StatusCode};
use serde::Deserialize;
use serde_json::json;
use slackgate_core::ledger::{LedgerReject, SettleError, MAX_KEY_LEN, MAX_TOKENS};
use slackgate_core::{Decision, Reason, Request as CoreRequest};
use std::sync::Arc;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveBody {
    idempotency_key: Option<String>,
    tokens: u64,
    #[serde(default)]
    attempt: u32,
    class: Option<String>,
    /// Deadline budget from now (seed 001's "slack": 30 s).
    slack_ms: Option<u64>,
    tenant: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleBody {
    idempotency_key: String,
    /// For commit: tokens spent (default: the hold). For cancel: tokens wasted (default 0).
    tokens: Option<u64>,
    tokens_spent: Option<u64>,
    tokens_wasted: Option<u64>,
}

fn invalid(message: impl Into<String>) -> BadRequest {
    BadRequest {
        reason: Reason::InvalidRequest,
        message: message.into(),
    }
}

fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, BadRequest> {
    serde_json::from_slice(bytes).map_err(|e| {
        let reason = if e.is_data() {
            Reason::InvalidRequest
        } else {
            Reason::InvalidJson
        };
        BadRequest {
            reason,
            message: format!("invalid body: {e}"),
        }
    })
}

/// Check a key a client names. A new reservation may not use the gate's own `gen-` prefix;
/// a commit or cancel may (`settling`): it is how a worker settles a reservation it made
/// without a key, under the key the gate generated and answered with. A proxied request's
/// generated key is refused there anyway (`not_a_reservation`).
fn check_key(key: &str, settling: bool) -> Result<(), BadRequest> {
    if key.is_empty() || key.len() > MAX_KEY_LEN || key.chars().any(char::is_control) {
        return Err(invalid(format!(
            "idempotency_key must be 1..={MAX_KEY_LEN} bytes of printable text"
        )));
    }
    if !settling && key.starts_with(crate::wire::request_info::GENERATED_KEY_PREFIX) {
        return Err(invalid(format!(
            "idempotency keys starting with {:?} are reserved for keys the gate generates",
            crate::wire::request_info::GENERATED_KEY_PREFIX
        )));
    }
    Ok(())
}

fn check_tokens(name: &str, n: u64) -> Result<(), BadRequest> {
    if n > MAX_TOKENS {
        return Err(invalid(format!("{name} = {n} is absurd (over 2^40)")));
    }
    Ok(())
}

fn with_status(status: StatusCode, mut r: Response<ResBody>) -> Response<ResBody> {
    *r.status_mut() = status;
    r
}

/// Route one reservation-API request.
pub async fn handle<B>(shared: Arc<Shared>, req: Request<B>) -> Response<ResBody>
where
    B: http_body::Body<Data = bytes::Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let path = req.uri().path().trim_end_matches('/').to_string();
    let method = req.method().clone();
    match (method.as_str(), path.as_str()) {
        ("GET", "/admission/v1/stats") => stats(&shared),
        ("POST", "/admission/v1/expire") => {
            let (released, wasted) = shared.expire_now();
            let _ = shared.durable().await;
            response::json(
                &json!({"action": "expire", "released": released, "tokens_wasted": wasted}),
            )
        }
        ("POST", "/admission/v1/reserve" | "/admission/v1/commit" | "/admission/v1/cancel") => {
            let (parts, body) = req.into_parts();
            // A worker behind the same trusted proxy names its tenant's fairness id as a
            // proxied request does.
            let fairness = match shared.server.fairness_header.as_deref() {
                Some(name) => match crate::wire::request_info::fairness_id(&parts.headers, name) {
                    Ok(id) => id,
                    Err(e) => return bad_request(&shared, &path, None, e),
                },
                None => None,
            };
            let bytes = match read_body(&shared, body, &parts.headers).await {
                Ok(b) => b,
                Err(e) => return body_failure(&shared, &path, None, e),
            };
            handle_body_as(&shared, &path, &bytes, fairness).await
        }
        _ => response::not_found(&path),
    }
}

/// Answer a `POST` to `/admission/v1/reserve`, `/commit` or `/cancel` whose body has been
/// read (`path` without a trailing slash; any other path is `cancel`). Public for the fuzz
/// harness, which drives the bodies without sockets.
pub async fn handle_body(shared: &Arc<Shared>, path: &str, bytes: &[u8]) -> Response<ResBody> {
    handle_body_as(shared, path, bytes, None).await
}

/// [`handle_body`], a reservation counted under `fairness` (the configured fairness header's
/// value) for its tenant's share when given, else under its `tenant`.
async fn handle_body_as(
    shared: &Arc<Shared>,
    path: &str,
    bytes: &[u8],
    fairness: Option<String>,
) -> Response<ResBody> {
    let result = match path {
        "/admission/v1/reserve" => reserve(shared, bytes, fairness).await,
        "/admission/v1/commit" => settle(shared, bytes, true).await,
        _ => settle(shared, bytes, false).await,
    };
    result.unwrap_or_else(|e| bad_request(shared, path, None, e))
}

/// `POST /admission/v1/reserve`, in named phases like the proxy's ([`super::proxy`]):
///
/// ```text
/// parse (body, key, tenant, sizes) -> offer -> decide -> make the hold durable -> answer
/// ```
///
/// Bad input is answered before the core sees it (`Err`, a 400 built by the caller).
async fn reserve(
    shared: &Arc<Shared>,
    bytes: &[u8],
    fairness: Option<String>,
) -> Result<Response<ResBody>, BadRequest> {
    let mut asked = parse_reserve(shared, bytes)?;
    asked.fairness = fairness.or_else(|| asked.tenant.clone());
    let now = shared.clock.now_ms();
    let (req, meta) = offer(&asked, now);
    let (d, held, write) = shared.reserve(asked.body.class.as_deref(), req, meta);
    if d.admitted() {
        if let Some(refused) = make_durable(shared, &d, write).await {
            return Ok(refused);
        }
        return Ok(reserved(shared, &d, held, now));
    }
    Ok(rejected(&d, held, now))
}

/// A reservation as asked: its checked body and the tenant id it names.
struct AskedReservation {
    body: ReserveBody,
    /// The tenant as an id, hashed like the proxy's `X-Tenant` (`t:<keyed hash>`), so grants
    /// apply the same way.
    tenant: Option<String>,
    /// What it counts under in `[fairness]`: the configured fairness header's value, else
    /// the tenant id.
    fairness: Option<String>,
}

/// Phase **parse**: the JSON body, then its key, tenant, tokens and slack, in that order.
fn parse_reserve(shared: &Shared, bytes: &[u8]) -> Result<AskedReservation, BadRequest> {
    let body: ReserveBody = parse(bytes)?;
    if let Some(k) = &body.idempotency_key {
        check_key(k, false)?;
    }
    if body
        .tenant
        .as_ref()
        .is_some_and(|t| t.is_empty() || t.len() > 256)
    {
        return Err(invalid("tenant must be 1..=256 bytes"));
    }
    let tenant = body
        .tenant
        .as_deref()
        .map(|t| shared.tenants.id("t", t.as_bytes()));
    check_tokens("tokens", body.tokens)?;
    if body
        .slack_ms
        .is_some_and(|s| s == 0 || s > crate::wire::request_info::MAX_DEADLINE_MS)
    {
        return Err(invalid("slack_ms must be between 1 and 86400000"));
    }
    Ok(AskedReservation {
        body,
        tenant,
        fairness: None,
    })
}

/// Phase **offer**: the core's request (deadline from `now`) and the job's meta.
fn offer(asked: &AskedReservation, now: u64) -> (CoreRequest, JobMeta) {
    let b = &asked.body;
    let req = CoreRequest {
        deadline: b.slack_ms.map(|s| now.saturating_add(s)),
        // A reservation's service time is the pool's per-request cost: a worker holds the
        // slot for one call, whatever its size.
        prompt_tokens: 0,
        max_tokens: Some(0),
        idempotency_key: b.idempotency_key.clone(),
        tenant: asked.tenant.clone(),
        fairness_id: asked.fairness.clone(),
        attempt: b.attempt,
        hold_tokens: Some(b.tokens),
        reservation: true,
        ..CoreRequest::default()
    };
    let meta = JobMeta {
        label: b.class.clone(),
        tenant: asked.tenant.clone(),
        attempt: Some(b.attempt),
        path: "/admission/v1/reserve".into(),
        ..JobMeta::default()
    };
    (req, meta)
}

/// Phase **make the hold durable**, for an admitted reservation: the hold is durable before
/// the worker is told to go ahead. `Some` is the answer when it cannot go ahead: the store
/// failed and the class fails closed (503), or a shared ledger refused the hold (another
/// replica holds or has done the key: a duplicate after all, 409).
async fn make_durable(
    shared: &Shared,
    d: &Decision,
    write: Option<crate::ledger_store::WriteSeq>,
) -> Option<Response<ResBody>> {
    match shared.durable_for(write).await {
        Err(e) => {
            shared.note_store_error(&e);
            // The worker would call the model with no durable hold: a class failing
            // closed is told no (its hold released), as the proxy's requests are.
            (shared.fail_mode_of(d.class) == slackgate_core::FailMode::Closed)
                .then(|| ledger_unavailable(shared, &d.idempotency_key, &e.to_string()))
        }
        Ok(()) if shared.hold_refused_key(&d.idempotency_key) => {
            Some(duplicate_in_shared_ledger(shared, &d.idempotency_key))
        }
        Ok(()) => None,
    }
}

/// 409 `reject_duplicate` for a hold the shared ledger refused: the hold is released
/// (settled as cancelled, nothing spent).
fn duplicate_in_shared_ledger(shared: &Shared, key: &str) -> Response<ResBody> {
    let _ = shared.settle_key_because(key, false, 0, Some(Reason::RejectDuplicate));
    let mut resp = with_status(
        StatusCode::CONFLICT,
        response::json(&json!({
            "action": "reject",
            "reason": Reason::RejectDuplicate.as_str(),
            "idempotency_key": key,
            "message": "the key is already held or done in the shared ledger: a replay never reserves or spends twice",
        })),
    );
    response::add_retry_headers(
        &mut resp,
        Reason::RejectDuplicate,
        Some(response::RetryAdvice {
            after_ms: 60_000,
            should_retry: false,
        }),
    );
    resp
}

/// Seed 001 reports when the job would *finish*: the wait for a slot plus its own service.
fn finish_ms(d: &Decision) -> u64 {
    d.projected_wait_ms.saturating_add(d.est_service_ms)
}

/// What is left of the reservation's deadline budget at `now` (ms), if it has a deadline.
fn budget_ms(d: &Decision, now: u64) -> Option<u64> {
    d.deadline.map(|dl| dl.saturating_sub(now))
}

/// Phase **answer**, admitted: 202 `reserve` with the key, the hold and when it would finish.
fn reserved(shared: &Shared, d: &Decision, held: u64, now: u64) -> Response<ResBody> {
    let finish_ms = finish_ms(d);
    let ttl = shared.hold_ttl_ms();
    with_status(
        StatusCode::ACCEPTED,
        response::json(&json!({
            "action": "reserve",
            "idempotency_key": d.idempotency_key,
            "tokens_held": d.tokens_held,
            "projected_wait_s": finish_ms as f64 / 1000.0,
            "projected_wait_ms": finish_ms,
            "slack_s": budget_ms(d, now).map(|s| s as f64 / 1000.0),
            "hold_ttl_s": ttl as f64 / 1000.0,
            "held": held,
            "job_id": d.job_id.0,
        })),
    )
}

/// Phase **answer**, refused: the ledger's refusal (duplicate, retry cap, tenant budget) or
/// the core's (`reject_unreserved`), with Retry-After and `x-should-retry`.
fn rejected(d: &Decision, held: u64, now: u64) -> Response<ResBody> {
    let key = &d.idempotency_key;
    let (status, body) = match &d.ledger {
        Some(LedgerReject::Duplicate { state, tokens_held }) => (
            StatusCode::CONFLICT,
            json!({"action": "reject_duplicate", "idempotency_key": key,
                   "state": state.as_str(), "tokens_held": tokens_held}),
        ),
        Some(LedgerReject::RetryCap { attempt, retry_cap }) => (
            StatusCode::TOO_MANY_REQUESTS,
            json!({"action": "reject_retry_cap", "idempotency_key": key,
                   "attempt": attempt, "retry_cap": retry_cap}),
        ),
        Some(LedgerReject::BudgetExhausted {
            remaining,
            requested,
        }) => (
            StatusCode::TOO_MANY_REQUESTS,
            json!({"action": "budget_exhausted", "idempotency_key": key,
                   "remaining": remaining, "requested": requested}),
        ),
        None => {
            let finish_ms = finish_ms(d);
            (
                unreserved_status(d.reason),
                json!({"action": "reject_unreserved", "idempotency_key": key,
                       "projected_wait_s": finish_ms as f64 / 1000.0,
                       "projected_wait_ms": finish_ms,
                       "slack_s": budget_ms(d, now).map(|s| s as f64 / 1000.0),
                       "held": held, "reason": d.reason.as_str()}),
            )
        }
    };
    let advice = d.retry_after_ms.map(|ms| response::RetryAdvice {
        after_ms: ms,
        should_retry: d.should_retry,
    });
    let mut r = with_status(status, response::json(&body));
    response::add_retry_headers(&mut r, d.reason, advice);
    r
}

/// The status of a reservation the core refused.
fn unreserved_status(reason: Reason) -> StatusCode {
    match reason {
        // During shutdown: 503 like the proxy's, so a worker tries another replica rather
        // than waiting for this one.
        Reason::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        // No endpoint of the pool takes work: no capacity, not contended capacity.
        Reason::UpstreamUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        // More tokens than the pool's context window: no retry can succeed.
        Reason::ContextLengthExceeded => StatusCode::BAD_REQUEST,
        _ => StatusCode::TOO_MANY_REQUESTS,
    }
}

async fn settle(
    shared: &Arc<Shared>,
    bytes: &[u8],
    commit: bool,
) -> Result<Response<ResBody>, BadRequest> {
    let b: SettleBody = parse(bytes)?;
    check_key(&b.idempotency_key, true)?;
    let given = if commit {
        b.tokens_spent.or(b.tokens)
    } else {
        b.tokens_wasted.or(b.tokens)
    };
    if let Some(n) = given {
        check_tokens("tokens", n)?;
    }
    let key = b.idempotency_key;
    let tokens = match given {
        Some(n) => n,
        None if commit => shared.held_tokens(&key).unwrap_or(0),
        None => 0,
    };
    let r = shared.settle_key(&key, commit, tokens);
    if let Err(e) = shared.durable().await {
        shared.note_store_error(&e);
    }
    let held_remaining = shared.ledger_view().0.held;
    Ok(match r {
        Ok(h) if commit => response::json(&json!({
            "action": "commit", "idempotency_key": key, "tokens_spent": h.tokens_spent,
            "held_remaining": held_remaining})),
        Ok(h) => response::json(&json!({
            "action": "cancel", "idempotency_key": key, "tokens_wasted": h.tokens_wasted,
            "held_remaining": held_remaining})),
        Err(SettleError::MissingHold) => with_status(
            StatusCode::NOT_FOUND,
            response::json(&json!({"action": "missing_hold", "idempotency_key": key})),
        ),
        Err(SettleError::HoldExpired(h)) => with_status(
            StatusCode::CONFLICT,
            response::json(&json!({"action": "hold_expired", "idempotency_key": key,
                                   "tokens_wasted": h.tokens_wasted})),
        ),
        // A commit retried after a lost answer finds the key done: the same answer again,
        // nothing settled twice.
        Err(SettleError::NotHeld(slackgate_core::HoldState::Done)) if commit => {
            let spent = shared.settled_tokens(&key).unwrap_or(0);
            response::json(&json!({
                "action": "commit", "idempotency_key": key, "tokens_spent": spent,
                "held_remaining": held_remaining, "replayed": true}))
        }
        Err(SettleError::NotAReservation) => with_status(
            StatusCode::CONFLICT,
            response::json(
                &json!({"action": "not_a_reservation", "idempotency_key": key,
                                   "reason": "this hold belongs to a proxied request, settled by its own response"}),
            ),
        ),
        Err(SettleError::NotHeld(state)) => with_status(
            StatusCode::CONFLICT,
            response::json(&json!({"action": "not_held", "idempotency_key": key,
                                   "state": state.as_str()})),
        ),
    })
}

fn stats(shared: &Shared) -> Response<ResBody> {
    let (l, snap) = shared.ledger_view();
    // The wait a new default-class request would see, plus its service: seed 001's figure.
    let wait_ms = snap.classes.first().map_or(0, |c| c.projected_wait_ms);
    response::json(&json!({
        "held": l.held,
        "tokens_held": l.tokens_held,
        "tokens_spent": l.tokens_spent,
        "tokens_wasted": l.tokens_wasted,
        "amplification": l.amplification,
        "done": l.done,
        "cancelled": l.cancelled,
        "expired": l.expired,
        "rejected": l.rejected,
        "projected_wait_ms": wait_ms,
        "projected_wait_s": wait_ms as f64 / 1000.0,
    }))
}
/// 503 `ledger_unavailable` for a reservation whose hold could not be made durable in a
/// class failing closed: the hold is released (settled as cancelled, nothing spent).
fn ledger_unavailable(shared: &Shared, key: &str, why: &str) -> Response<ResBody> {
    let _ = shared.settle_key_because(key, false, 0, Some(Reason::LedgerUnavailable));
    let mut resp = with_status(
        StatusCode::SERVICE_UNAVAILABLE,
        response::json(&json!({
            "action": "reject",
            "reason": Reason::LedgerUnavailable.as_str(),
            "idempotency_key": key,
            "message": format!(
                "the ledger store could not record this reservation's hold ({why}), and its \
                 class fails closed: do not call the model; retry shortly"
            ),
        })),
    );
    response::add_retry_headers(
        &mut resp,
        Reason::LedgerUnavailable,
        Some(response::RetryAdvice {
            after_ms: 1_000,
            should_retry: true,
        }),
    );
    resp
}
