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
//! | DELETE | `/admin/drain` | end every drain |
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

use crate::engine::state::Shared;
use crate::http::accept::{accept_until_stopped, serve_connection, Ending};
use crate::ops::control::ControlError;
use crate::wire::response::{self, ResBody};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;
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
/// Most classes one drain request may name.
const MAX_DRAIN_CLASSES: usize = 256;

/// Serve the admin API on `listener` until `stop` turns true.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
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
            async move {
                let _ = stream.set_nodelay(true);
                let ending = Ending {
                    stop: None,
                    lifetime: Some(ADMIN_CONNECTION_LIMIT),
                };
                serve_connection(stream, guard, ending, move |req| {
                    let shared = Arc::clone(&shared);
                    async move { route(&shared, req, peer).await }
                })
                .await;
            }
        },
    )
    .await;
    reaper.abort();
    conns.shutdown().await;
}

fn error(status: StatusCode, code: &'static str, message: &str) -> Response<ResBody> {
    response::admin_error(status, code, message)
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
        error(self.status, self.code, &self.message)
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

/// Read a small JSON body; `Err` is the 4xx to answer.
async fn json_body(req: Request<Incoming>) -> Result<serde_json::Value, Refused> {
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        Refused::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("admin request bodies are at most {MAX_ADMIN_BODY} bytes"),
        )
    };
    if declared.is_some_and(|n| n > MAX_ADMIN_BODY as u64) {
        return Err(too_large());
    }
    let body = Limited::new(req.into_body(), MAX_ADMIN_BODY).collect();
    let bytes: Bytes = match tokio::time::timeout(ADMIN_READ_TIMEOUT, body).await {
        Err(_) => {
            return Err(Refused::new(
                StatusCode::REQUEST_TIMEOUT,
                response::BODY_READ_TIMEOUT,
                "the request body did not arrive in time",
            ))
        }
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return Err(too_large())
        }
        Ok(Err(e)) => {
            return Err(Refused::new(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("could not read the request body: {e}"),
            ))
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    #[serde(default)]
    classes: Vec<String>,
    #[serde(default)]
    cancel: bool,
    #[serde(default)]
    unlabeled: bool,
}

/// `DELETE /admin/drain` with a body: end the drain of these classes only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndDrainBody {
    #[serde(default)]
    classes: Vec<String>,
    /// Also admit unlabeled work again.
    #[serde(default)]
    unlabeled: bool,
}

fn control_error(e: ControlError) -> Response<ResBody> {
    match e {
        ControlError::UnknownClass(..) => {
            error(StatusCode::NOT_FOUND, "unknown_class", &e.to_string())
        }
        ControlError::InvalidConfig(_) => {
            error(StatusCode::BAD_REQUEST, "invalid_config", &e.to_string())
        }
        ControlError::NoConfigFile => error(StatusCode::CONFLICT, "no_config_file", &e.to_string()),
    }
}

const FLAGS: [&str; 2] = ["admit_always", "shadow"];

/// Route one admin request.
pub async fn route(shared: &Shared, req: Request<Incoming>, peer: SocketAddr) -> Response<ResBody> {
    if let Err(denied) = authorize(shared, req.headers()) {
        shared.metrics.decision("none", "error", "unauthorized");
        return denied.response();
    }
    let path = req.uri().path().trim_end_matches('/').to_string();
    let method = req.method().clone();
    let who = actor(req.headers(), peer);
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    let write = method == Method::PUT || method == Method::POST;
    match parts.as_slice() {
        ["admin", "flags"] if method == Method::GET => {
            response::json(&crate::ops::control::flags(shared))
        }
        ["admin", "flags", flag] if write => {
            if !FLAGS.contains(flag) {
                return error(
                    StatusCode::NOT_FOUND,
                    "unknown_flag",
                    &format!(
                        "unknown flag {:?} (flags: admit_always, shadow; per class: /admin/classes/<class>/enabled; drains: /admin/drain)",
                        truncate(flag)
                    ),
                );
            }
            let value = match json_body(req).await.and_then(|b| flag_value(&b)) {
                Ok(v) => v,
                Err(r) => return r.response(),
            };
            let view = if *flag == "admit_always" {
                crate::ops::control::set_admit_always(shared, value, &who)
            } else {
                crate::ops::control::set_shadow(shared, value, &who)
            };
            response::json(
                &json!({"flag": flag, "value": view.value, "override": view.override_value, "config": view.config}),
            )
        }
        ["admin", "classes", class, "enabled"] if write => {
            let class = class.to_string();
            let value = match json_body(req).await.and_then(|b| flag_value(&b)) {
                Ok(v) => v,
                Err(r) => return r.response(),
            };
            match crate::ops::control::set_class_enabled(shared, &class, value, &who) {
                Ok(view) => response::json(
                    &json!({"class": class, "flag": "enabled", "value": view.value, "override": view.override_value, "config": view.config}),
                ),
                Err(e) => control_error(e),
            }
        }
        ["admin", "drain"] if method == Method::GET => {
            response::json(&crate::ops::control::drain_status(shared))
        }
        ["admin", "drain"] if method == Method::DELETE => {
            let body = match json_body(req).await {
                Ok(b) => b,
                Err(r) => return r.response(),
            };
            // No body: every drain ends. A body names the classes whose drain ends.
            let ended = if body.is_null() {
                crate::ops::control::end_drain(shared, None, true, &who)
            } else {
                let usage = "expected no body (end every drain) or {\"classes\": [\"eval\"], \"unlabeled\": false}";
                let d: EndDrainBody = match serde_json::from_value(body) {
                    Ok(d) => d,
                    Err(e) => return invalid(&format!("{usage}: {e}")).response(),
                };
                if d.classes.is_empty() && !d.unlabeled {
                    return invalid(usage).response();
                }
                if d.classes.len() > MAX_DRAIN_CLASSES || d.classes.iter().any(|c| c.len() > 256) {
                    return invalid("too many or too long class names").response();
                }
                crate::ops::control::end_drain(shared, Some(&d.classes), d.unlabeled, &who)
            };
            match ended {
                Ok(status) => response::json(&status),
                Err(e) => control_error(e),
            }
        }
        ["admin", "drain"] if method == Method::POST => {
            let body = match json_body(req).await {
                Ok(b) => b,
                Err(r) => return r.response(),
            };
            let d: DrainBody = match serde_json::from_value(body) {
                Ok(d) => d,
                Err(e) => {
                    return invalid(&format!(
                        "expected {{\"classes\": [\"eval\"], \"cancel\": false, \"unlabeled\": false}}: {e}"
                    ))
                    .response()
                }
            };
            if d.classes.is_empty() && !d.unlabeled {
                return invalid("name at least one class to drain (or \"unlabeled\": true)")
                    .response();
            }
            if d.classes.len() > MAX_DRAIN_CLASSES || d.classes.iter().any(|c| c.len() > 256) {
                return invalid("too many or too long class names").response();
            }
            match crate::ops::control::drain(shared, &d.classes, d.cancel, d.unlabeled, &who) {
                Ok(status) => response::json(&status),
                Err(e) => control_error(e),
            }
        }
        ["admin", "pools", pool, "endpoints", endpoint, action @ ("drain" | "undrain")]
            if method == Method::POST =>
        {
            let draining = *action == "drain";
            match shared.drain_endpoint(pool, endpoint, draining, &who) {
                Ok(changed) => response::json(&json!({
                    "pool": pool, "endpoint": endpoint, "draining": draining, "changed": changed,
                })),
                Err(e) => error(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    &truncate(&e.to_string()),
                ),
            }
        }
        ["admin", "queues"] if method == Method::GET => response::json(&queues(shared)),
        ["admin", "estimator"] if method == Method::GET => response::json(&estimator(shared)),
        ["admin", "ledger"] if method == Method::GET => {
            let (ledger, _) = shared.ledger_view();
            response::json(&json!({"ledger": ledger, "store": shared.store.stats()}))
        }
        ["admin", "cluster"] if method == Method::GET => match &shared.cluster {
            Some(c) => response::json(&c.status()),
            None => error(
                StatusCode::NOT_FOUND,
                "not_clustered",
                "this gate runs alone (no [cluster] section)",
            ),
        },
        ["admin", "reload"] if method == Method::POST => {
            match crate::ops::control::reload_from_source(shared, &who) {
                Ok(outcome) => response::json(&outcome),
                Err(e) => control_error(e),
            }
        }
        ["admin", "flags"]
        | ["admin", "flags", _]
        | ["admin", "classes", _, "enabled"]
        | ["admin", "drain"]
        | ["admin", "queues"]
        | ["admin", "pools", _, "endpoints", _, "drain" | "undrain"]
        | ["admin", "estimator"]
        | ["admin", "ledger"]
        | ["admin", "cluster"]
        | ["admin", "reload"] => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            &format!("{method} is not allowed on {}", truncate(&path)),
        ),
        _ => error(
            StatusCode::NOT_FOUND,
            "not_found",
            &format!("no admin route for {}", truncate(&path)),
        ),
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// `GET /admin/queues`: the live queue per class and the slots per pool.
fn queues(shared: &Shared) -> serde_json::Value {
    let snap = shared.snapshot();
    let classes: Vec<_> = snap
        .classes
        .iter()
        .map(|c| {
            json!({
                "class": c.name, "pool": c.pool, "priority": c.priority,
                "enabled": c.enabled, "draining": c.draining, "overflow": c.overflow,
                "retired": c.retired, "depth": c.depth,
                "oldest_queue_age_ms": c.oldest_queue_age_ms,
                "projected_wait_ms": c.projected_wait_ms, "queued_work_ms": c.queued_work_ms,
                "in_flight": c.in_flight,
            })
        })
        .collect();
    let pools: Vec<_> = snap
        .pools
        .iter()
        .map(|p| {
            json!({
                "pool": p.name, "slots": p.slots, "in_flight": p.in_flight, "depth": p.depth,
                "oldest_in_flight_age_ms": p.oldest_in_flight_age_ms,
                "in_flight_remaining_ms": p.in_flight_remaining_ms, "retired": p.retired,
                "endpoints": p.endpoints,
            })
        })
        .collect();
    json!({"now_ms": snap.now_ms, "classes": classes, "pools": pools})
}

/// `GET /admin/estimator`: what the gate believes a request costs, per pool and class.
fn estimator(shared: &Shared) -> serde_json::Value {
    let snap = shared.snapshot();
    let pools: Vec<_> = snap
        .pools
        .iter()
        .map(|p| {
            json!({
                "pool": p.name, "overhead_ms": p.estimator.overhead_ms,
                "prefill_ms_per_token": p.estimator.prefill_ms_per_token,
                "decode_ms_per_token": p.estimator.decode_ms_per_token,
                "decode_ms_per_1k_context": p.estimator.decode_ms_per_1k_context,
                "batch_slowdown": p.estimator.batch_slowdown,
                "decode_ms_per_1k_shared_context": p.estimator.decode_ms_per_1k_shared_context,
                "stall_ms_per_prefill_token": p.estimator.stall_ms_per_prefill_token,
                "chars_per_token": p.chars_per_token,
                "template_tokens": p.template_tokens,
                "mean_concurrency": p.mean_concurrency,
                "samples": p.estimator.samples, "learning": p.learning,
                "warming_up": p.warming_up,
            })
        })
        .collect();
    let classes: Vec<_> = snap
        .classes
        .iter()
        .filter(|c| !c.overflow)
        .map(|c| {
            json!({
                "class": c.name, "expected_output_tokens": c.expected_output_tokens,
                "est_error": c.est_error, "probes": c.probes,
            })
        })
        .collect();
    json!({"pools": pools, "classes": classes})
}
