//! The one request-body reader: the whole body, within a size and a time limit
//! (`server.max_body_bytes` and `server.body_read_timeout_ms` for the proxy path, the
//! reservation API and cluster forwarding; the admin API's own smaller limits for its
//! controls).

use crate::wire::request_info::BadRequest;
use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Limited};
use slackgate_core::Reason;
use std::time::Duration;

/// Why a request body could not be read.
pub enum BodyError {
    /// Too large or malformed: answered with 4xx and an `error` line.
    Bad(BadRequest),
    /// Not all there within `server.body_read_timeout_ms`: 408.
    TimedOut(u64),
    /// The client went away mid-upload: a `cancel` line.
    ClientGone(String),
}

/// Read the whole request body, refusing more than `limit` bytes or taking longer than
/// `timeout_ms`.
pub async fn read_body<B>(
    body: B,
    headers: &HeaderMap,
    limit: usize,
    timeout_ms: u64,
) -> Result<Bytes, BodyError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let too_large = || {
        BodyError::Bad(BadRequest {
            reason: Reason::BodyTooLarge,
            message: format!("request body exceeds the limit of {limit} bytes"),
        })
    };
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let collected = tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        Limited::new(body, limit).collect(),
    )
    .await;
    match collected {
        Err(_) => Err(BodyError::TimedOut(timeout_ms)),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large())
        }
        // A body the client framed wrongly (bad chunked encoding) is its mistake, not a cancel.
        Ok(Err(e))
            if e.downcast_ref::<hyper::Error>()
                .is_some_and(|h| h.is_parse()) =>
        {
            Err(BodyError::Bad(BadRequest {
                reason: Reason::InvalidJson,
                message: format!("could not read the request body: {e}"),
            }))
        }
        // Anything else is the connection ending before the body did: the client vanished.
        Ok(Err(e)) => Err(BodyError::ClientGone(e.to_string())),
    }
}
