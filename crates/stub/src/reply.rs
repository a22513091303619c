//! The stub's responses and request bodies in one place: every error response (OpenAI's
//! error shape, from a [`Refusal`] or directly), JSON and plain replies, and the bounded
//! read of a request body. Shared by the model endpoints (`server.rs`) and the control
//! endpoints (`control.rs`).

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::Value;

use crate::openai;
use crate::stream::StubBody;

/// Largest request body the stub reads; larger bodies get 413.
pub(crate) const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// A request the stub refuses before serving it; becomes an OpenAI error response.
#[derive(Debug)]
pub(crate) struct Refusal {
    status: StatusCode,
    message: String,
    code: &'static str,
}

impl Refusal {
    /// A refusal with `status`, a human message and a stable machine `code`.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>, code: &'static str) -> Self {
        Refusal {
            status,
            message: message.into(),
            code,
        }
    }

    /// The error response for this refusal.
    pub(crate) fn into_response(self) -> Response<StubBody> {
        error(self.status, &self.message, self.code)
    }
}

/// Reads a request body of at most [`MAX_BODY_BYTES`].
pub(crate) async fn read_body(req: Request<Incoming>) -> Result<Bytes, Refusal> {
    let too_large = || {
        let msg = format!("request body exceeds {MAX_BODY_BYTES} bytes");
        Refusal::new(StatusCode::PAYLOAD_TOO_LARGE, msg, "body_too_large")
    };
    // Refuse on the declared length before reading anything.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("could not read request body: {e}"),
            "body_read_error",
        )),
    }
}

/// Builds every error response the stub sends, in the OpenAI error shape.
pub(crate) fn error(status: StatusCode, message: &str, code: &str) -> Response<StubBody> {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    json_response(status, &openai::error_body(message, kind, code))
}

/// A JSON response.
pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response<StubBody> {
    json_bytes(status, v.to_string())
}

/// A JSON response from already serialized bytes.
pub(crate) fn json_bytes(status: StatusCode, bytes: impl Into<Bytes>) -> Response<StubBody> {
    with_body(status, "application/json", StubBody::full(bytes))
}

pub(crate) fn plain(status: StatusCode, text: &'static str) -> Response<StubBody> {
    with_body(status, "text/plain", StubBody::full(text))
}

pub(crate) fn with_body(
    status: StatusCode,
    content_type: &'static str,
    body: StubBody,
) -> Response<StubBody> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    if content_type == "text/event-stream" {
        resp.headers_mut().insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
    }
    resp
}
