//! Answers to requests that never reach the core (bad input, a body that could not be read),
//! each with its decision-log line.

use crate::engine::state::Shared;
use crate::http::body::BodyError;
use crate::observe::codes::LineReason;
use crate::wire::request_info::BadRequest;
use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use slackgate_core::{Action, Reason};

/// Answer (and log) a request refused as bad input: 413 for a body past the limit, 400
/// otherwise.
pub fn bad_request(
    shared: &Shared,
    path: &str,
    label: Option<String>,
    e: BadRequest,
) -> Response<ResBody> {
    let status = match e.reason {
        Reason::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    shared.log_error(e.reason, status.as_u16(), path, label);
    response::error(status, e.reason, &e.message, None, None)
}

/// Answer (and log) a request whose body could not be read.
pub fn body_failure(
    shared: &Shared,
    path: &str,
    label: Option<String>,
    e: BodyError,
) -> Response<ResBody> {
    match e {
        BodyError::Bad(b) => bad_request(shared, path, label, b),
        BodyError::TimedOut(ms) => {
            shared.log_unqueued(
                Action::Error,
                LineReason::BodyReadTimeout,
                Some(StatusCode::REQUEST_TIMEOUT.as_u16()),
                path,
                label,
            );
            response::body_read_timeout(ms)
        }
        BodyError::ClientGone(why) => {
            // Nobody will read this answer; the line is what matters: a cancel, not bad input.
            shared.log_unqueued(
                Action::Cancel,
                Reason::ClientCancelled.into(),
                None,
                path,
                label,
            );
            response::error(
                StatusCode::BAD_REQUEST,
                Reason::ClientCancelled,
                &format!("the connection ended during the request body: {why}"),
                None,
                None,
            )
        }
    }
}

/// Read a request's whole body within the gate's limits (`server.max_body_bytes`,
/// `server.body_read_timeout_ms`).
pub async fn read_body<B>(shared: &Shared, body: B, headers: &HeaderMap) -> Result<Bytes, BodyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let server = &shared.server;
    crate::http::body::read_body(
        body,
        headers,
        server.max_body_bytes,
        server.body_read_timeout_ms,
    )
    .await
}
