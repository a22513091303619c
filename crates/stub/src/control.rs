//! The `/stub/*` control endpoints that tests and drills use to steer the stub: releasing held
//! requests and occupying slots outside any request.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;

use crate::server::{error, json_response, read_body, Refusal};
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
