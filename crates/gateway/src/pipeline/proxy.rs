//! The proxy path: parse, decide, wait for a slot, forward, stream back.
//!
//! Order of work for an OpenAI request: the arrival time is taken and headers are checked
//! first (cheap), then the body is read under a size and time limit and parsed, then the core
//! decides. The deadline counts from arrival: a slow upload spends the client's budget. A rejected request never touches
//! the upstream. An admitted one waits for its dispatch signal; while it waits, dropping the
//! request (client gone) drops its [`JobGuard`], which takes it out of the queue.

use crate::engine::body::TrackedBody;
use crate::engine::health::Verdict;
use crate::engine::state::{Admission, Go, JobGuard, JobMeta, Outcome, Shared, Signal};
use crate::engine::unqueued::{bad_request, body_failure, read_body};
use crate::support::clock::epoch_ms;
use crate::upstream::cause;
use crate::upstream::retry::RetryReason;
use crate::wire::headers::{strip_hop_by_hop, upstream_request_headers};
use crate::wire::request_info::Endpoint;
use crate::wire::request_info::{parse_body, parse_body_lenient, parse_headers_with};
use crate::wire::response::{self, AdmissionBody, ResBody, RetryAdvice};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use slackgate_core::{Decision, Reason, Request as CoreRequest};
use std::sync::Arc;
use std::time::Duration;

/// Most endpoints a request that could not connect is moved through before it fails.
const MAX_ENDPOINT_MOVES: usize = 8;

/// Handle an admission-controlled request (`POST /v1/...`) to an endpoint of kind `kind`.
pub async fn admitted<B>(shared: Arc<Shared>, req: Request<B>, kind: Endpoint) -> Response<ResBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // A deliberately slower build, to prove the regression guard fails on one.
    #[cfg(feature = "perf-slowdown")]
    perf_slowdown();
    // Arrival: the client's deadline budget runs from here, so the time its body takes to
    // arrive is spent from that budget, not added on top of it.
    let now = shared.clock.now_ms();
    let now_epoch = epoch_ms();
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let raw_label = parts
        .headers
        .get("x-job-class")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(64).collect::<String>());
    let hinfo = match parse_headers_with(
        &parts.headers,
        now_epoch,
        shared.server.trust_tenant_header,
        &shared.tenants,
    ) {
        Ok(h) => h,
        Err(e) => return bad_request(&shared, &path, raw_label, e),
    };
    let mut bytes = match read_body(&shared, body, &parts.headers).await {
        Ok(b) => b,
        Err(e) => return body_failure(&shared, &path, raw_label, e),
    };
    let binfo = match kind {
        Endpoint::Other => parse_body_lenient(&bytes),
        Endpoint::Chat | Endpoint::Completions | Endpoint::Embeddings => match parse_body(&bytes) {
            Ok((mut json, b)) => {
                // Settle streams on the upstream's own count: ask for the final usage chunk
                // (`stream_options.include_usage`) unless the client already said either way.
                if b.stream
                    && shared.server.stream_usage
                    && matches!(kind, Endpoint::Chat | Endpoint::Completions)
                    && ask_for_stream_usage(&mut json)
                {
                    if let Ok(v) = serde_json::to_vec(&json) {
                        bytes = bytes::Bytes::from(v);
                    }
                }
                b
            }
            Err(e) => return bad_request(&shared, &path, raw_label, e),
        },
    };
    // An embedding generates no tokens: its service time is prefill only.
    let max_tokens = match kind {
        Endpoint::Embeddings => Some(0),
        _ => binfo.max_tokens,
    };

    let relative = hinfo.deadline_in_ms.map(|ms| now.saturating_add(ms));
    let absolute = hinfo
        .deadline_epoch_ms
        .map(|at| now.saturating_add(at.saturating_sub(now_epoch)));
    let deadline = match (relative, absolute) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let core_req = CoreRequest {
        class: None, // resolved inside the lock, against the live class table
        deadline,
        first_token_deadline: hinfo.first_token_in_ms.map(|ms| now.saturating_add(ms)),
        prompt_tokens: binfo.prompt_tokens,
        prompt_chars: binfo.prompt_chars,
        model: binfo.model.clone(),
        max_tokens,
        expected_output_tokens: hinfo
            .expected_output_tokens
            .filter(|_| shared.server.trust_size_hint),
        deadline_is_absolute: relative.is_none() && absolute.is_some(),
        idempotency_key: hinfo.idempotency_key.clone(),
        tenant: hinfo.tenant.clone(),
        attempt: hinfo.attempt.unwrap_or(0),
        hold_tokens: None,
        reservation: false,
    };
    let meta = JobMeta {
        label: hinfo.class_label.clone(),
        tenant: hinfo.tenant.clone(),
        idempotency_key: hinfo.idempotency_key.clone(),
        attempt: hinfo.attempt,
        path: path.clone(),
        arrived_epoch_ms: now_epoch,
        ..JobMeta::default()
    };
    let label = hinfo.class_label.clone();
    let admission = shared.admit_labeled(label.as_deref(), core_req, meta);
    let (decision, signal, guard, hold_write) = match admission {
        Admission::Rejected(d, body) => return rejection(&d, &body),
        Admission::Queued {
            decision,
            signal,
            guard,
            hold_write,
        } => (decision, signal, guard, hold_write),
    };

    // Wait for a slot. The core drops a job whose deadline became unmeetable and tells us; if
    // this future is dropped (client gone) the guard takes the job out of the queue.
    let go = match wait_for_slot(&shared, signal, &decision, hold_write).await {
        Ok(go) => go,
        Err(SlotRefused::Answer(resp)) => return resp,
        Err(SlotRefused::LedgerDown(e)) => return ledger_unavailable(guard, &e),
        Err(SlotRefused::Duplicate(key)) => return duplicate_in_store(guard, &key),
    };
    let (pool, pool_name, queue_wait_ms) = (go.pool, go.pool_name, go.queue_wait_ms);
    let (mut endpoint, mut base, mut abort) = (go.endpoint, go.upstream, Some(go.abort));

    let mut headers = upstream_request_headers(parts.headers);
    // The gate reads `usage` from the response as it streams past; a compressed body would
    // hide it (and the SSE chunk boundaries), so ask the upstream for an uncompressed one.
    headers.insert(
        http::header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    let path_and_query = parts.uri.path_and_query().cloned();
    // Every endpoint of a pool shares its client and credentials.
    let transport = shared.transports.for_pool(&pool_name);
    let client_authorization = headers.remove(http::header::AUTHORIZATION);
    transport
        .auth
        .apply(&mut headers, client_authorization.as_ref());

    // The upstream must start answering before the deadline (the gate promised the client an
    // answer by then); without a deadline, the configured ceiling applies.
    // The decision already says whether the rollback flag admitted it: no second look at
    // the core (and its lock) on the request path.
    // Shadow mode enforces no deadline on any job decided under it (the dispatcher drops
    // none late): not only the would-be rejections it let through, but also the work it
    // admitted as it stands, which may have been pushed back in the queue by them.
    let enforce = decision.reason != Reason::AdmitAlways && !decision.shadow;
    let limit_ms = match decision.deadline {
        Some(d) if enforce => d.saturating_sub(shared.clock.now_ms()).max(1),
        _ => shared.server.upstream_timeout_ms,
    };
    // One limit for every attempt: a request moved to another endpoint keeps its deadline.
    let give_up = tokio::time::Instant::now() + Duration::from_millis(limit_ms);
    let mut moves = 0usize;
    let resp = loop {
        let uri = match base.target(path_and_query.as_ref()) {
            Ok(u) => u,
            Err(e) => {
                return fail(
                    guard,
                    StatusCode::BAD_GATEWAY,
                    Reason::UpstreamUnavailable,
                    &format!("cannot build upstream URL: {e}"),
                );
            }
        };
        let mut up = Request::new(bytes.clone());
        *up.method_mut() = parts.method.clone();
        *up.uri_mut() = uri;
        *up.headers_mut() = headers.clone();
        // A stale keep-alive is sent again on a fresh connection inside this same job: same
        // slot, same hold, same deadline (the timeout covers both attempts), no second decision.
        let send = transport.client.send(up, |reason| {
            shared.metrics.upstream_retry(&pool_name, reason.as_str());
        });
        let request = tokio::time::timeout_at(give_up, send);
        // The gate may cancel the job while it waits for the upstream's headers (a drain with
        // `cancel`, the end of the shutdown grace period): dropping the request cancels it
        // upstream too.
        let sent = tokio::select! {
            sent = request => sent,
            why = aborted(&mut abort) => {
                let msg = match why {
                    Reason::Drained => "the request's class was drained with cancel by an operator",
                    _ => "the gate is shutting down and its grace period ended",
                };
                guard.cancel_with(why, 0);
                return response::error(StatusCode::SERVICE_UNAVAILABLE, why, msg, None, None);
            }
        };
        let retried = sent.as_ref().ok().and_then(|exchange| exchange.retried);
        match sent.map(|exchange| exchange.result) {
            Ok(Ok(r)) => break r,
            Ok(Err(e)) if e.is_connect() => {
                shared.endpoint_verdict(pool, endpoint, Verdict::Failed("connect"), false);
                // The request never reached the endpoint: another one of the pool that can
                // start it now takes it, slot and all (at most once per other endpoint).
                // When none can, it queues again in its place and waits for the next slot.
                moves += 1;
                if moves < MAX_ENDPOINT_MOVES {
                    if let Some((to, b)) = shared.reroute(decision.job_id, pool) {
                        (endpoint, base) = (to, b);
                        continue;
                    }
                    if let Some(signal) = shared.requeue(decision.job_id) {
                        // The same hold: its flush answers for the same write.
                        match wait_for_slot(&shared, signal, &decision, hold_write).await {
                            Ok(go) => {
                                (endpoint, base, abort) =
                                    (go.endpoint, go.upstream, Some(go.abort));
                                continue;
                            }
                            Err(SlotRefused::Answer(resp)) => return resp,
                            Err(SlotRefused::LedgerDown(e)) => {
                                return ledger_unavailable(guard, &e)
                            }
                            Err(SlotRefused::Duplicate(key)) => {
                                return duplicate_in_store(guard, &key)
                            }
                        }
                    }
                }
                let (reason, msg) = upstream_failure(&shared, &pool_name, &base, &e, "");
                return fail(guard, StatusCode::BAD_GATEWAY, reason, &msg);
            }
            Ok(Err(e)) => {
                shared.endpoint_verdict(pool, endpoint, Verdict::Failed("connection"), false);
                let again = match retried {
                    Some(RetryReason::ConnectionClosed) => {
                        " (sent again on a new connection after the reused one closed)"
                    }
                    Some(RetryReason::ConnectionReset) => {
                        " (sent again on a new connection after the reused one was reset)"
                    }
                    None => "",
                };
                let (reason, msg) = upstream_failure(&shared, &pool_name, &base, &e, again);
                return fail(guard, StatusCode::BAD_GATEWAY, reason, &msg);
            }
            Err(_) => {
                return fail(
                    guard,
                    StatusCode::GATEWAY_TIMEOUT,
                    Reason::UpstreamTimeout,
                    &format!(
                        "upstream {base} sent no response within {limit_ms} ms (the request's \
                         deadline)"
                    ),
                );
            }
        }
    };

    // A provider's 429 is the gate's own 429, never a 502: the endpoint is paused as the
    // provider asks and its slots halve; the hold is released, not spent.
    if resp.status() == StatusCode::TOO_MANY_REQUESTS {
        shared.endpoint_verdict(pool, endpoint, Verdict::Healthy, false);
        return throttled(&shared, guard, pool, endpoint, resp.headers());
    }
    // Any answer is a live server; a 5xx is a failing one.
    let verdict = if resp.status().is_server_error() {
        Verdict::Failed("status_5xx")
    } else {
        Verdict::Healthy
    };
    shared.endpoint_verdict(pool, endpoint, verdict, false);
    let (mut rparts, rbody) = resp.into_parts();
    let sse = rparts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    strip_hop_by_hop(&mut rparts.headers);
    hold_relayed_retry(&shared, &mut rparts.headers);
    let h = &mut rparts.headers;
    h.insert("x-slackgate-job-id", HeaderValue::from(decision.job_id.0));
    h.insert(
        "x-slackgate-queue-wait-ms",
        HeaderValue::from(queue_wait_ms),
    );
    // `admit`, or `shadow_reject` (shadow mode admitted what the gate would have rejected;
    // the reason says why).
    h.insert(
        "x-slackgate-decision",
        HeaderValue::from_static(decision.action.as_str()),
    );
    if let Ok(v) = HeaderValue::from_str(&pool_name) {
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
    let status = rparts.status.as_u16();
    let idle = Duration::from_millis(shared.server.stream_idle_timeout_ms);
    let mut tracked = TrackedBody::new(rbody, guard, sse, status, idle);
    if let Some(abort) = abort {
        tracked = tracked.with_abort(abort);
    }
    Response::from_parts(rparts, BodyExt::boxed(tracked))
}

/// Wait for a slot. The core drops a job whose deadline became unmeetable and tells us (the
/// answer is then the `Err`); if this future is dropped (client gone) the caller's guard takes
/// the job out of the queue.
/// Why a request got no slot.
enum SlotRefused {
    /// The gate answered for it (dropped, shutting down).
    Answer(Response<ResBody>),
    /// Its hold could not be made durable and its class fails closed.
    LedgerDown(String),
    /// The shared ledger refused its hold: another replica holds or has done the key.
    Duplicate(String),
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
fn ledger_unavailable(guard: JobGuard, why: &str) -> Response<ResBody> {
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

async fn wait_for_slot(
    shared: &Shared,
    signal: tokio::sync::oneshot::Receiver<Signal>,
    decision: &Decision,
    hold_write: Option<crate::ledger_store::WriteSeq>,
) -> Result<Go, SlotRefused> {
    let (class, job) = (decision.class, decision.job_id);
    match signal.await {
        Ok(Signal::Go(go)) => {
            // The hold must be stored before upstream tokens are spent on it, so that a crash
            // after this point leaves a hold that expires (wasted), never a spend nobody
            // recorded. "Stored" is what the store promises: SQLite with the default
            // `server.ledger_synchronous = "normal"`, committed to the WAL (survives the
            // process dying, not a power loss or OS crash); with "full", synced to disk;
            // Redis, accepted by the server (its own persistence decides the rest). Group
            // commit: every request dispatched meanwhile shares the same commit. The answer
            // is for this request's own hold (the write that carried it), not for whatever
            // else was queued. When the store cannot (its batch failed every retry, no answer
            // within the flush timeout, Redis down or slow), a class failing open goes ahead
            // (the hold reaches the store when it returns, or expires), one failing closed is
            // refused.
            if let Err(e) = shared.durable_for(hold_write).await {
                shared.note_store_error(&e);
                // Looked up only here, off the path of every request that the store took.
                if shared.fail_mode_of(class) == slackgate_core::FailMode::Closed {
                    return Err(SlotRefused::LedgerDown(e));
                }
            } else if let Some(key) = shared.hold_refused(job) {
                // The one atomic check-and-hold across replicas: the shared ledger's script
                // refused this hold because the key is held or done there.
                return Err(SlotRefused::Duplicate(key));
            }
            Ok(go)
        }
        Ok(Signal::Dropped(reason, body, advice)) => {
            Err(SlotRefused::Answer(dropped(reason, &body, advice)))
        }
        // The sender vanished without a signal: only possible if the job was ended by
        // another path; answer rather than hang.
        Err(_) => Err(SlotRefused::Answer(response::error(
            StatusCode::SERVICE_UNAVAILABLE,
            Reason::ShuttingDown,
            "the gate stopped tracking this request",
            None,
            None,
        ))),
    }
}

/// Wait for the gate to cancel a running job; never resolves if it will not (its sender is
/// gone once the job ended by another path, and then the receiver is spent: `None`).
async fn aborted(abort: &mut Option<tokio::sync::oneshot::Receiver<Reason>>) -> Reason {
    if let Some(rx) = abort.as_mut() {
        if let Ok(reason) = rx.await {
            return reason;
        }
        *abort = None;
    }
    std::future::pending().await
}

/// The answer to a queued request the gate will not send: its deadline became unmeetable
/// (429), its class was drained with cancel (429, no retry), or the gate is shutting down
/// (503: another replica, or this one restarted, can take it).
fn dropped(reason: Reason, body: &AdmissionBody, core: Option<RetryAdvice>) -> Response<ResBody> {
    let (status, msg, after_ms, should_retry) = match reason {
        Reason::ShuttingDown => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the gate is shutting down and this queued request could not finish in its grace period; it was not sent upstream",
            1000,
            true,
        ),
        Reason::Drained => (
            StatusCode::TOO_MANY_REQUESTS,
            "the request's class was drained by an operator; it was not sent upstream",
            60_000,
            false,
        ),
        Reason::Displaced => (
            StatusCode::TOO_MANY_REQUESTS,
            "a shorter request of the same class took this queued request's place (displace_within_ms); it was not sent upstream",
            1000,
            false,
        ),
        Reason::HoldExpired => (
            StatusCode::TOO_MANY_REQUESTS,
            "the request's hold expired while it was queued; it was not sent upstream",
            1000,
            false,
        ),
        _ => (
            StatusCode::TOO_MANY_REQUESTS,
            "queued request can no longer finish by its deadline; it was not sent upstream",
            1000,
            false,
        ),
    };
    // The core's advice when it gave one (a displaced job: when a retry would be admitted,
    // and whether its deadline leaves room for one); otherwise the default for the reason.
    let advice = core.unwrap_or(RetryAdvice {
        after_ms,
        should_retry,
    });
    response::error(status, reason, msg, Some(body), Some(advice))
}

/// The upstream answered 429: pause its endpoint for the provider's Retry-After (the gate's
/// floor without one), end the job unspent, and answer 429 `upstream_throttled` with a
/// Retry-After at least the provider's.
fn throttled(
    shared: &Shared,
    guard: JobGuard,
    pool: slackgate_core::PoolId,
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

/// End the job with `reason` and answer the client with the matching error: the one place a
/// dispatched request that never reached (or never heard from) the upstream is settled. The
/// end line of the decision log carries `message` too.
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

/// Why a request to the upstream at `base` failed, as the client, the decision log and the
/// gate's own log (once per upstream a while: [`Shared::note_upstream_failure`]) are told:
/// a connection never made is `upstream_unavailable`, anything else `upstream_error`, with
/// the error's whole cause chain (`again`: how the request was sent a second time, if it was).
fn upstream_failure(
    shared: &Shared,
    pool: &str,
    base: &impl std::fmt::Display,
    e: &hyper_util::client::legacy::Error,
    again: &str,
) -> (Reason, String) {
    let (reason, at) = if e.is_connect() {
        (Reason::UpstreamUnavailable, "connecting to")
    } else {
        (Reason::UpstreamError, "on")
    };
    let msg = format!(
        "upstream request failed{again}: {} ({at} {base})",
        cause::chain(e)
    );
    shared.note_upstream_failure(pool, &base.to_string(), &msg);
    (reason, msg)
}

/// An upstream's own Retry-After, relayed with its answer, stops at the gate's ceiling too.
fn hold_relayed_retry(shared: &Shared, headers: &mut HeaderMap) {
    if headers.contains_key(http::header::RETRY_AFTER) || headers.contains_key("retry-after-ms") {
        response::clamp_relayed_retry(headers, shared.retry_ceiling_ms());
    }
}

/// Set `stream_options.include_usage = true` unless the client set it; true when changed.
fn ask_for_stream_usage(json: &mut serde_json::Value) -> bool {
    let Some(obj) = json.as_object_mut() else {
        return false;
    };
    let opts = obj
        .entry("stream_options")
        .or_insert_with(|| serde_json::json!({}));
    match opts.as_object_mut() {
        Some(o) if !o.contains_key("include_usage") => {
            o.insert("include_usage".into(), serde_json::Value::Bool(true));
            true
        }
        _ => false,
    }
}

fn rejection(d: &Decision, body: &AdmissionBody) -> Response<ResBody> {
    let advice = d.retry_after_ms.map(|ms| RetryAdvice {
        after_ms: ms,
        should_retry: d.should_retry,
    });
    let msg = match d.reason {
        Reason::ClassDisabled => "this class of work is switched off on this gate".to_string(),
        Reason::RejectUnlabeled => {
            "request has no known X-Job-Class and no default class is configured".to_string()
        }
        Reason::QueueAgeExceeded => format!(
            "oldest queued job ahead is {} ms old, over this class's max_queue_age_ms",
            d.queue_age_ms
        ),
        Reason::QueueDepthExceeded => {
            format!(
                "{} jobs already queued ahead with every slot busy",
                d.queued_ahead
            )
        }
        Reason::ProjectedWaitExceedsSlack => format!(
            "projected wait {} ms exceeds deadline slack {} ms",
            d.projected_wait_ms,
            d.deadline_slack_ms.unwrap_or(0)
        ),
        Reason::RejectDuplicate => format!(
            "idempotency key {:?} is already {}: a replay never reserves or spends twice",
            d.idempotency_key,
            match &d.ledger {
                Some(slackgate_core::ledger::LedgerReject::Duplicate { state, .. }) =>
                    state.as_str(),
                _ => "held",
            }
        ),
        Reason::RejectRetryCap => {
            "attempt number is over the retry cap for this idempotency key".to_string()
        }
        Reason::BudgetExhausted => {
            "the tenant's token grant cannot cover this request's hold".to_string()
        }
        Reason::ContextLengthExceeded => {
            "the prompt plus max_tokens is past the context window (or max_tokens past the \
             output limit) of this pool's servers; /stats shows pools[].context_tokens"
                .to_string()
        }
        other => format!("rejected: {other}"),
    };
    // A duplicate is a conflict with the key's existing hold (409, as seed 001 answers it);
    // a gate shutting down is unavailable, not overloaded (503: another replica can serve
    // it now); every other refusal is "not now" (429).
    // A request too big for the servers is bad input (400, as the servers answer it).
    let status = match d.reason {
        Reason::RejectDuplicate => StatusCode::CONFLICT,
        Reason::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        Reason::ContextLengthExceeded => StatusCode::BAD_REQUEST,
        _ => StatusCode::TOO_MANY_REQUESTS,
    };
    response::error(status, d.reason, &msg, Some(body), advice)
}

/// Forward a request that is not admission-controlled (`GET /v1/models`, any non-POST under
/// `/v1`) to the first pool's upstream, unchanged but for hop-by-hop headers.
pub async fn passthrough(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ResBody> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let bytes = match read_body(&shared, body, &parts.headers).await {
        Ok(b) => b,
        Err(e) => return body_failure(&shared, &path, None, e),
    };
    let Some(base) = shared.passthrough_upstream() else {
        return response::error(
            StatusCode::BAD_GATEWAY,
            Reason::UpstreamUnavailable,
            "no upstream",
            None,
            None,
        );
    };
    let uri = match base.target(parts.uri.path_and_query()) {
        Ok(u) => u,
        Err(e) => {
            return response::error(
                StatusCode::BAD_GATEWAY,
                Reason::UpstreamUnavailable,
                &e.to_string(),
                None,
                None,
            )
        }
    };
    let mut headers = upstream_request_headers(parts.headers);
    // The pool whose upstream answers pass-through routes: its client, its credentials, and
    // its label on the retry counter.
    let pool = shared.passthrough_pool_name().unwrap_or_default();
    let transport = shared.transports.for_pool(&pool);
    // The pool's key goes only with the model list, which clients and SDKs read before they
    // send: any other pass-through route (`DELETE /v1/files/...`) is outside admission and
    // the ledger, and must not act with the organisation's key for whoever reaches the gate.
    // Those keep the client's own `Authorization`, as before pool keys existed.
    if parts.method == http::Method::GET && path.trim_end_matches('/') == "/v1/models" {
        let client_authorization = headers.remove(http::header::AUTHORIZATION);
        transport
            .auth
            .apply(&mut headers, client_authorization.as_ref());
    }
    let mut up = Request::new(bytes);
    *up.method_mut() = parts.method;
    *up.uri_mut() = uri;
    *up.headers_mut() = headers;
    let limit = Duration::from_millis(shared.server.upstream_timeout_ms);
    let send = transport.client.send(up, |reason| {
        shared.metrics.upstream_retry(&pool, reason.as_str());
    });
    match tokio::time::timeout(limit, send)
        .await
        .map(|exchange| exchange.result)
    {
        Ok(Ok(r)) => {
            let (mut p, b) = r.into_parts();
            strip_hop_by_hop(&mut p.headers);
            hold_relayed_retry(&shared, &mut p.headers);
            Response::from_parts(
                p,
                b.map_err(|e| -> crate::wire::response::BoxError { Box::new(e) })
                    .boxed(),
            )
        }
        Ok(Err(e)) => {
            let (reason, msg) = upstream_failure(&shared, &pool, &base, &e, "");
            shared.log_upstream_error(reason, 502, &path, &msg);
            response::error(StatusCode::BAD_GATEWAY, reason, &msg, None, None)
        }
        Err(_) => {
            let msg = format!(
                "upstream {base} sent no response within {} ms (server.upstream_timeout_ms)",
                limit.as_millis()
            );
            shared.log_upstream_error(Reason::UpstreamTimeout, 504, &path, &msg);
            response::error(
                StatusCode::GATEWAY_TIMEOUT,
                Reason::UpstreamTimeout,
                &msg,
                None,
                None,
            )
        }
    }
}

/// About 200 µs of busy work on the request's worker thread (feature `perf-slowdown` only).
#[cfg(feature = "perf-slowdown")]
fn perf_slowdown() {
    let until = std::time::Instant::now() + std::time::Duration::from_micros(200);
    while std::time::Instant::now() < until {
        std::hint::spin_loop();
    }
}
