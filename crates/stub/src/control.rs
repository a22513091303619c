//! The `/stub/*` control endpoints that tests and drills use to steer the stub: releasing held
//! requests, occupying slots outside any request, and reading or clearing the request records.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;

use crate::records::RequestLog;
use crate::reply::{error, json_bytes, json_response, read_body, Refusal};
use crate::state::Shared;
use crate::stream::StubBody;

/// Body of `POST /stub/release`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    name: Option<String>,
    #[serde(default)]
    all: bool,
}

/// Body of `POST /stub/occupy`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OccupyBody {
    slots: usize,
    /// Without `ms`, the slots stay occupied until a release-all.
    ms: Option<u64>,
}

/// Parses a small JSON control body, or answers 400.
async fn parse<T: for<'de> Deserialize<'de>>(req: Request<Incoming>) -> Result<T, Refusal> {
    let bytes = read_body(req).await?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let msg = format!("invalid control body: {e}");
        Refusal::new(StatusCode::BAD_REQUEST, msg, "invalid_json")
    })
}

/// `POST /stub/release {"name":N}` or `{"all":true}`: wakes matching holds (and, for `all`,
/// ends occupations); answers `{"released":count}`.
pub(crate) async fn release(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<StubBody> {
    let body: ReleaseBody = match parse(req).await {
        Ok(b) => b,
        Err(refusal) => return refusal.into_response(),
    };
    let released = match (body.all, body.name.as_deref()) {
        (true, _) => shared.release(None),
        (false, Some(name)) => shared.release(Some(name)),
        (false, None) => {
            let msg = "release needs {\"name\":\"..\"} or {\"all\":true}";
            return error(StatusCode::BAD_REQUEST, msg, "invalid_request");
        }
    };
    json_response(StatusCode::OK, &json!({ "released": released }))
}

/// `POST /stub/occupy {"slots":N,"ms":M}`: waits for N slots like a request would, then keeps
/// them for M ms (or until a release-all) on a background task; answers once they are held.
pub(crate) async fn occupy(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<StubBody> {
    let body: OccupyBody = match parse(req).await {
        Ok(b) => b,
        Err(refusal) => return refusal.into_response(),
    };
    if body.slots == 0 || body.slots > shared.cfg.slots {
        let msg = format!(
            "slots must be between 1 and the stub's {} slots",
            shared.cfg.slots
        );
        return error(StatusCode::BAD_REQUEST, &msg, "invalid_request");
    }
    // Register first so a release-all racing with the wait still ends this occupation.
    let (entry, released) = shared.register_occupation();
    // If the caller disconnects while waiting, this future is dropped and nothing is taken.
    let Some(guard) = shared.occupy(body.slots).await else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "stub is shutting down",
            "shutting_down",
        );
    };
    let ms = body.ms;
    tokio::spawn(async move {
        let timer = async {
            match ms {
                Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = timer => {}
            _ = released => {}
        }
        drop(guard);
        drop(entry);
    });
    json_response(StatusCode::OK, &json!({ "occupied": body.slots }))
}

/// `GET /stub/requests`: every request record so far, as `{"requests":[..],"dropped":N}`.
pub(crate) fn requests(shared: &Shared) -> Response<StubBody> {
    // Serialize under the lock rather than cloning up to a million records first.
    log_response(shared.with_requests(serde_json::to_vec))
}

/// `POST /stub/requests/clear` (or `DELETE /stub/requests`): the same answer as
/// `GET /stub/requests`, taken atomically with emptying the log, so a drill that reads this way
/// never loses a record that lands between a read and a clear.
pub(crate) fn clear_requests(shared: &Shared) -> Response<StubBody> {
    let log: RequestLog = shared.take_requests();
    log_response(serde_json::to_vec(&log))
}

fn log_response(serialized: serde_json::Result<Vec<u8>>) -> Response<StubBody> {
    match serialized {
        Ok(bytes) => json_bytes(StatusCode::OK, bytes),
        // Plain structs of strings and numbers always serialize; this is only for completeness.
        Err(e) => {
            let msg = format!("could not serialize the request records: {e}");
            error(StatusCode::INTERNAL_SERVER_ERROR, &msg, "internal_error")
        }
    }
}
