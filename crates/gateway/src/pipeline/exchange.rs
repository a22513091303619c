//! The exchange with the upstream: the request prepared once (headers, credentials, the
//! deadline that bounds every attempt), then sent, moved to another endpoint of the pool or
//! queued again when it cannot connect, until the upstream answers or the attempt ends.

use super::slot::{self, SlotRefused};
use crate::engine::health::{Failure, Verdict};
use crate::engine::state::{Go, Shared};
use crate::ledger_store::WriteSeq;
use crate::upstream::failure::{self, Peer, SendFailure, Told};
use crate::upstream::retry::RetryReason;
use crate::upstream::{Transport, UpstreamBase};
use crate::wire::headers::upstream_request_headers;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use slackgate_core::{Decision, PoolId, Reason};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// Most endpoints a request that could not connect is moved through before it fails.
const MAX_ENDPOINT_MOVES: usize = 8;

/// A dispatched request on its way upstream: where it goes now and what it sends.
pub(super) struct Upstream {
    /// The pool whose slot it holds.
    pub pool: PoolId,
    /// That pool's name.
    pub pool_name: String,
    /// Time it waited in the queue.
    pub queue_wait_ms: u64,
    /// The endpoint it goes to now (a failed connect moves it).
    pub endpoint: usize,
    /// That endpoint's base URL.
    pub base: UpstreamBase,
    /// Fires if the gate cancels the job while it runs.
    pub abort: Option<oneshot::Receiver<Reason>>,
    method: Method,
    path_and_query: Option<PathAndQuery>,
    headers: HeaderMap,
    bytes: Bytes,
    transport: Arc<Transport>,
    /// One limit for every attempt: a request moved to another endpoint keeps its deadline.
    give_up: tokio::time::Instant,
    limit_ms: u64,
}

/// How the exchange ended, for `super::settle`.
pub(super) enum Ending {
    /// The upstream answered (any status).
    Answered(Response<Incoming>),
    /// Never reached or never heard from the upstream.
    Failed {
        /// 502 or 504.
        status: StatusCode,
        /// `upstream_unavailable`, `upstream_error` or `upstream_timeout`.
        reason: Reason,
        /// Said to the client and the decision log.
        message: String,
    },
    /// The gate cancelled the job while it waited for the upstream's headers.
    Cancelled(Reason),
    /// Queued again after a failed connect, it got no slot.
    Refused(SlotRefused),
}

/// Prepare the upstream request: hop-by-hop and internal headers go, an uncompressed answer
/// is asked for, the pool's credentials are applied, and the deadline sets the time limit.
pub(super) fn prepare(
    shared: &Shared,
    parts: http::request::Parts,
    decision: &Decision,
    go: Go,
    bytes: Bytes,
) -> Upstream {
    let mut headers = upstream_request_headers(parts.headers);
    // The gate reads `usage` from the response as it streams past; a compressed body would
    // hide it (and the SSE chunk boundaries), so ask the upstream for an uncompressed one.
    headers.insert(
        http::header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    // Every endpoint of a pool shares its client and credentials.
    let transport = shared.transports.for_pool(&go.pool_name);
    let client_authorization = headers.remove(http::header::AUTHORIZATION);
    transport
        .auth
        .apply(&mut headers, client_authorization.as_ref());
    let limit_ms = time_limit_ms(shared, decision);
    Upstream {
        pool: go.pool,
        pool_name: go.pool_name,
        queue_wait_ms: go.queue_wait_ms,
        endpoint: go.endpoint,
        base: go.upstream,
        abort: Some(go.abort),
        method: parts.method,
        path_and_query: parts.uri.path_and_query().cloned(),
        headers,
        bytes,
        transport,
        give_up: tokio::time::Instant::now() + Duration::from_millis(limit_ms),
        limit_ms,
    }
}

/// The upstream must start answering before the deadline (the gate promised the client an
/// answer by then); without a deadline, the configured ceiling applies.
fn time_limit_ms(shared: &Shared, decision: &Decision) -> u64 {
    // The decision already says whether the rollback flag admitted it: no second look at
    // the core (and its lock) on the request path.
    // Shadow mode enforces no deadline on any job decided under it (the dispatcher drops
    // none late): not only the would-be rejections it let through, but also the work it
    // admitted as it stands, which may have been pushed back in the queue by them.
    let enforce = decision.reason != Reason::AdmitAlways && !decision.shadow;
    match decision.deadline {
        Some(d) if enforce => d.saturating_sub(shared.clock.now_ms()).max(1),
        _ => shared.server.upstream_timeout_ms,
    }
}

/// Send until the upstream answers or the exchange ends otherwise. A request that could not
/// connect moves to another endpoint of its pool that can start it now, slot and all, or
/// queues again in its place (the same hold: its flush answers for the same write).
pub(super) async fn run(
    shared: &Shared,
    up: &mut Upstream,
    decision: &Decision,
    hold_write: Option<WriteSeq>,
) -> Ending {
    let mut moves = 0usize;
    loop {
        let failure = match send_once(shared, up).await {
            Attempt::Done(ending) => return ending,
            Attempt::ConnectFailed(e) => e,
        };
        shared.endpoint_verdict(
            up.pool,
            up.endpoint,
            Verdict::Failed(Failure::Connect),
            false,
        );
        // The request never reached the endpoint: at most once per other endpoint.
        moves += 1;
        if moves < MAX_ENDPOINT_MOVES {
            if let Some((to, base)) = shared.reroute(decision.job_id, up.pool) {
                (up.endpoint, up.base) = (to, base);
                continue;
            }
            if let Some(signal) = shared.requeue(decision.job_id) {
                match slot::wait(shared, signal, decision, hold_write).await {
                    Ok(go) => {
                        (up.endpoint, up.base, up.abort) =
                            (go.endpoint, go.upstream, Some(go.abort));
                        continue;
                    }
                    Err(refused) => return Ending::Refused(refused),
                }
            }
        }
        return upstream_failure(
            shared,
            &up.pool_name,
            &up.base,
            &SendFailure::NotConnected(&failure),
        )
        .into();
    }
}

/// One attempt's outcome: an ending, or a connection never made (which may move on).
enum Attempt {
    Done(Ending),
    ConnectFailed(hyper_util::client::legacy::Error),
}

/// Send the request once to the current endpoint (a stale keep-alive is sent again on a fresh
/// connection inside this same attempt: same slot, same hold, same deadline, no second
/// decision).
async fn send_once(shared: &Shared, up: &mut Upstream) -> Attempt {
    let uri = match up.base.target(up.path_and_query.as_ref()) {
        Ok(u) => u,
        Err(e) => {
            return Attempt::Done(Ending::Failed {
                status: StatusCode::BAD_GATEWAY,
                reason: Reason::UpstreamUnavailable,
                message: format!("cannot build upstream URL: {e}"),
            })
        }
    };
    let mut req = Request::new(up.bytes.clone());
    *req.method_mut() = up.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = up.headers.clone();
    let pool_name = &up.pool_name;
    let send = up.transport.client.send(req, |reason| {
        shared.metrics.upstream_retry(pool_name, reason.as_str());
    });
    let request = tokio::time::timeout_at(up.give_up, send);
    // The gate may cancel the job while it waits for the upstream's headers (a drain with
    // `cancel`, the end of the shutdown grace period): dropping the request cancels it
    // upstream too.
    let sent = tokio::select! {
        sent = request => sent,
        why = slot::aborted(&mut up.abort) => return Attempt::Done(Ending::Cancelled(why)),
    };
    let retried = sent.as_ref().ok().and_then(|exchange| exchange.retried);
    match sent.map(|exchange| exchange.result) {
        Ok(Ok(r)) => Attempt::Done(Ending::Answered(r)),
        Ok(Err(e)) if e.is_connect() => Attempt::ConnectFailed(e),
        Ok(Err(e)) => {
            shared.endpoint_verdict(
                up.pool,
                up.endpoint,
                Verdict::Failed(Failure::Connection),
                false,
            );
            let again = match retried {
                Some(RetryReason::ConnectionClosed) => {
                    " (sent again on a new connection after the reused one closed)"
                }
                Some(RetryReason::ConnectionReset) => {
                    " (sent again on a new connection after the reused one was reset)"
                }
                None => "",
            };
            let failure = SendFailure::Broken(&e, again);
            Attempt::Done(upstream_failure(shared, &up.pool_name, &up.base, &failure).into())
        }
        Err(_) => {
            let failure = SendFailure::NoAnswer {
                limit_ms: up.limit_ms,
                limit: "the request's deadline",
            };
            Attempt::Done(failure::tell(Peer::Upstream(&up.base), &failure).into())
        }
    }
}

impl From<Told> for Ending {
    fn from(told: Told) -> Ending {
        Ending::Failed {
            status: told.status,
            reason: told.reason,
            message: told.message,
        }
    }
}

/// Why a request to the upstream at `base` failed, as the client and the decision log are
/// told ([`failure::tell`]), and noted in the gate's own log (once per upstream a while:
/// [`Shared::note_upstream_failure`]).
pub(super) fn upstream_failure(
    shared: &Shared,
    pool: &str,
    base: &impl std::fmt::Display,
    failure: &SendFailure<'_>,
) -> Told {
    let told = failure::tell(Peer::Upstream(base), failure);
    shared.note_upstream_failure(pool, &base.to_string(), &told.message);
    told
}
