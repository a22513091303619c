//! The admin API: the seeds' rollback paths as controls an operator can flip at 02:14, on a
//! listener of its own (loopback unless `admin.allow_remote`), behind a bearer token.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/admin/flags` | every flag: value in force, override, file value |
//! | PUT/POST | `/admin/flags/admit_always` | `{"value": true \| false \| null}` (null: back to the file) |
//! | PUT/POST | `/admin/flags/shadow` | same shape |
//! | PUT/POST | `/admin/classes/{class}/enabled` | same shape |
//! | GET | `/admin/drain` | drain status: per class queued / in flight, pools idle |
//! | POST | `/admin/drain` | `{"classes": [...], "cancel": false, "unlabeled": false}` |
//! | DELETE | `/admin/drain` | end every drain (a body `{"classes": [...], "unlabeled": false}`: those only) |
//! | POST | `/admin/pools/{pool}/endpoints/{endpoint}/drain` | take the endpoint out of placement (`/undrain`: back) |
//! | GET | `/admin/queues` | per class: depth, oldest age, projected wait; per pool: slots |
//! | GET | `/admin/estimator` | per pool: learned costs, samples; per class: output length |
//! | GET | `/admin/ledger` | the reservation ledger's totals and its store |
//! | GET | `/admin/cluster` | cluster mode: role, leader, lease, Redis health, replicas seen |
//! | POST | `/admin/reload` | reload the config file now: 200 with what changed, 400 why not |
//!
//! Without a configured token every call is refused (401 `admin_token_unset`); a missing or
//! wrong token is refused too (401 `unauthorized`), compared in constant time. Every change
//! is one decision-log line (`action: "flag"` or `"reload"`) naming the actor: the
//! `x-admin-actor` header (else `admin`) and the peer address. In cluster mode the flags
//! (`admit_always`, `shadow`, a class's `enabled`) set on any replica apply on every one,
//! through Redis; drains and reloads apply to the replica called.
//!
//! The live page (`/live` and below) is served on this listener too, with its own session
//! cookie (see [`crate::ops::live`]); a cookie authorizes nothing here.
//!
//! This file checks the caller and reads bodies; the route table and one handler per route
//! are in [`routes`].

mod routes;

use crate::engine::state::Shared;
use crate::http::accept::{accept_until_stopped, serve_connection, Ending};
use crate::http::body::BodyError;
use crate::observe::codes::LineReason;
use crate::ops::control::ControlError;
use crate::ops::live::Live;
use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use routes::Route;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Largest admin request body: the controls take a few hundred bytes.
pub const MAX_ADMIN_BODY: usize = 64 * 1024;
/// Longest time to receive an admin request's body.
const ADMIN_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest life of one admin connection, whatever it does.
const ADMIN_CONNECTION_LIMIT: Duration = Duration::from_secs(60);

/// Serve the admin API on `listener` until `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    live: Arc<Live>,
    mut stop: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    // The same connection limits as the proxy's, with the admin listener's own caps.
    let tracker = Arc::clone(&shared.admin_conns);
    let reaper = tokio::spawn(Arc::clone(&tracker).reaper());
    accept_until_stopped(
        &listener,
        &tracker,
        &mut stop,
        &mut conns,
        |stream, peer, guard| {
            let shared = Arc::clone(&shared);
            let live = Arc::clone(&live);
            async move {
                let _ = stream.set_nodelay(true);
                let ending = Ending {
                    stop: None,
                    lifetime: Some(ADMIN_CONNECTION_LIMIT),
                };
                serve_connection(stream, guard, ending, move |req| {
                    let shared = Arc::clone(&shared);
                    let live = Arc::clone(&live);
                    async move {
                        // The live page authorizes by its own cookie, on its own paths.
                        if crate::ops::live::is_live_path(req.uri().path()) {
                            return crate::ops::live::route(&live, &shared, &req);
                        }
                        route(&shared, req, peer).await
                    }
                })
                .await;
            }
        },
    )
    .await;
    reaper.abort();
    conns.shutdown().await;
}

/// A refused admin request: its status, stable code and message (built into a response in
/// one place, [`response::admin_error`]).
#[derive(Debug)]
struct Refused {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl Refused {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Refused {
        Refused {
            status,
            code,
            message: message.into(),
        }
    }

    fn response(&self) -> Response<ResBody> {
        response::admin_error(self.status, self.code, &self.message)
    }
}

/// A control that failed: an unknown class is 404, an invalid config 400, a reload without
/// a config file 409.
impl From<ControlError> for Refused {
    fn from(e: ControlError) -> Refused {
        let (status, code) = match e {
            ControlError::UnknownClass(..) => (StatusCode::NOT_FOUND, "unknown_class"),
            ControlError::InvalidConfig(_) => (StatusCode::BAD_REQUEST, "invalid_config"),
            ControlError::NoConfigFile => (StatusCode::CONFLICT, "no_config_file"),
        };
        Refused::new(status, code, e.to_string())
    }
}

/// Check the bearer token; `Err` is the 401 to answer.
fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<(), Refused> {
    if !shared.control.has_token() {
        return Err(Refused::new(
            StatusCode::UNAUTHORIZED,
            "admin_token_unset",
            "no admin token is configured (admin.token_file or SLACKGATE_ADMIN_TOKEN): every admin call is refused",
        ));
    }
    let presented = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    match presented {
        Some(t) if shared.control.token_matches(t) => Ok(()),
        Some(_) => Err(Refused::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "wrong admin token",
        )),
        None => Err(Refused::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing admin token: send Authorization: Bearer <token>",
        )),
    }
}

/// Who asked: `x-admin-actor` (printable, at most 64 characters; else `admin`) at the peer.
fn actor(headers: &HeaderMap, peer: SocketAddr) -> String {
    let name = headers
        .get("x-admin-actor")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.len() <= 64 && !v.chars().any(char::is_control))
        .unwrap_or("admin");
    format!("{name}@{peer}")
}

/// Read a small JSON body through the gateway's one body reader (`http::body`); `Err` is the
/// 4xx to answer.
async fn json_body(req: Request<Incoming>) -> Result<serde_json::Value, Refused> {
    let (parts, body) = req.into_parts();
    let timeout_ms = u64::try_from(ADMIN_READ_TIMEOUT.as_millis()).unwrap_or(u64::MAX);
    let read = crate::http::body::read_body(body, &parts.headers, MAX_ADMIN_BODY, timeout_ms);
    let bytes: Bytes = match read.await {
        Ok(bytes) => bytes,
        Err(BodyError::Bad(b)) if b.reason == slackgate_core::Reason::BodyTooLarge => {
            return Err(Refused::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("admin request bodies are at most {MAX_ADMIN_BODY} bytes"),
            ))
        }
        Err(BodyError::TimedOut(_)) => {
            return Err(Refused::new(
                StatusCode::REQUEST_TIMEOUT,
                response::BODY_READ_TIMEOUT,
                "the request body did not arrive in time",
            ))
        }
        // Badly framed, or the connection ended mid-body: the same 400 either way.
        Err(BodyError::Bad(b)) => return Err(invalid(&b.message)),
        Err(BodyError::ClientGone(e)) => {
            return Err(invalid(&format!("could not read the request body: {e}")))
        }
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Value::Null);
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        Refused::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the body is not JSON: {e}"),
        )
    })
}

/// A 400 `invalid_request` with `message`.
fn invalid(message: &str) -> Refused {
    Refused::new(StatusCode::BAD_REQUEST, "invalid_request", message)
}

/// `{"value": true | false | null}`.
fn flag_value(body: &serde_json::Value) -> Result<Option<bool>, Refused> {
    let usage = "expected {\"value\": true | false | null} (null: back to the config file's value)";
    let Some(obj) = body.as_object() else {
        return Err(invalid(usage));
    };
    if obj.len() != 1 {
        return Err(invalid(usage));
    }
    match obj.get("value") {
        Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
        Some(serde_json::Value::Null) => Ok(None),
        _ => Err(invalid(usage)),
    }
}

/// Route one admin request: check the token, find its route in the table
/// ([`Route::of`]) and answer it with that route's handler ([`routes::answer`]).
pub async fn route(shared: &Shared, req: Request<Incoming>, peer: SocketAddr) -> Response<ResBody> {
    if let Err(denied) = authorize(shared, req.headers()) {
        shared.metrics.decision(
            "none",
            slackgate_core::Action::Error.into(),
            LineReason::Unauthorized,
        );
        return denied.response();
    }
    let path = req.uri().path().trim_end_matches('/').to_string();
    let who = actor(req.headers(), peer);
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    let answered = match Route::of(req.method(), &parts) {
        Ok(found) => routes::answer(shared, found, req, &who).await,
        Err(miss) => Err(miss.refused(req.method(), &path)),
    };
    answered.unwrap_or_else(|refused| refused.response())
}

/// At most the first 80 characters of `s`, to quote a caller's input in an answer.
fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}
