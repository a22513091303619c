//! Requests outside admission (`GET /v1/models`, any non-POST under `/v1`): forwarded to the
//! first pool's upstream, unchanged but for hop-by-hop headers.

use super::exchange::upstream_failure;
use super::settle::hold_relayed_retry;
use crate::engine::state::Shared;
use crate::engine::unqueued::{body_failure, read_body};
use crate::upstream::failure::{self, Peer, SendFailure, Told};
use crate::upstream::{Transport, UpstreamBase};
use crate::wire::headers::{strip_hop_by_hop, upstream_request_headers};
use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use slackgate_core::Reason;
use std::sync::Arc;
use std::time::Duration;

/// Forward a request that is not admission-controlled to the first pool's upstream.
pub async fn passthrough(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ResBody> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let bytes = match read_body(&shared, body, &parts.headers).await {
        Ok(b) => b,
        Err(e) => return body_failure(&shared, &path, None, e),
    };
    let Some(base) = shared.passthrough_upstream() else {
        return bad_gateway("no upstream");
    };
    // The pool whose upstream answers pass-through routes: its client, its credentials, and
    // its label on the retry counter.
    let pool = shared.passthrough_pool_name().unwrap_or_default();
    let transport = shared.transports.for_pool(&pool);
    let up = match request(&transport, &base, parts, &path, bytes) {
        Ok(up) => up,
        Err(e) => return bad_gateway(&e.to_string()),
    };
    let limit = Duration::from_millis(shared.server.upstream_timeout_ms);
    let send = transport.client.send(up, |reason| {
        shared.metrics.upstream_retry(&pool, reason.as_str());
    });
    match tokio::time::timeout(limit, send)
        .await
        .map(|exchange| exchange.result)
    {
        Ok(Ok(r)) => relay(&shared, r),
        Ok(Err(e)) => {
            let told = upstream_failure(&shared, &pool, &base, &SendFailure::of(&e, ""));
            failed(&shared, &path, told)
        }
        Err(_) => {
            let failure = SendFailure::NoAnswer {
                limit_ms: shared.server.upstream_timeout_ms,
                limit: "server.upstream_timeout_ms",
            };
            failed(
                &shared,
                &path,
                failure::tell(Peer::Upstream(&base), &failure),
            )
        }
    }
}

/// The upstream failed: logged as an `error` line and told to the client.
fn failed(shared: &Shared, path: &str, told: Told) -> Response<ResBody> {
    shared.log_upstream_error(told.reason, told.status.as_u16(), path, &told.message);
    response::error(told.status, told.reason, &told.message, None, None)
}

/// The request as it goes upstream.
fn request(
    transport: &Transport,
    base: &UpstreamBase,
    parts: http::request::Parts,
    path: &str,
    bytes: Bytes,
) -> Result<Request<Bytes>, http::Error> {
    let uri = base.target(parts.uri.path_and_query())?;
    let mut headers = upstream_request_headers(parts.headers);
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
    Ok(up)
}

/// The upstream's answer, relayed.
fn relay(shared: &Shared, r: Response<Incoming>) -> Response<ResBody> {
    let (mut p, b) = r.into_parts();
    strip_hop_by_hop(&mut p.headers);
    hold_relayed_retry(shared, &mut p.headers);
    Response::from_parts(
        p,
        b.map_err(|e| -> crate::wire::response::BoxError { Box::new(e) })
            .boxed(),
    )
}

fn bad_gateway(message: &str) -> Response<ResBody> {
    response::error(
        StatusCode::BAD_GATEWAY,
        Reason::UpstreamUnavailable,
        message,
        None,
        None,
    )
}
