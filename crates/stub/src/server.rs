//! The HTTP side of the stub: the accept loop, routing, and the model endpoints.
//!
//! Each accepted connection is served by hyper's HTTP/1.1 server on its own task. The tasks live in
//! a `JoinSet` owned by the accept loop, so stopping the loop aborts every connection at once,
//! which is what a drill that "kills the upstream" wants. With [`ConnConfig::idle_close`] a
//! connection left idle is closed the way real servers close keep-alives (see [`crate::idle`]).

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::control;
use crate::idle::{ConnConfig, IdleClose, IdleSince, IdleWhenDone};
use crate::latency::{LatencySpec, Load, Pacer};
use crate::openai::{self, clamp_tokens, Endpoint, ModelRequest};
use crate::records::{check_request_id, Outcome, Tag};
use crate::reply::{error, json_response, plain, read_body, with_body, Refusal};
use crate::state::Shared;
use crate::stream::{token_stream, StreamPlan, StubBody};

/// Returned to hyper to drop a connection without any response (the `reset` fault).
#[derive(Debug, thiserror::Error)]
#[error("injected reset fault: dropping the connection")]
pub(crate) struct ResetConnection;

type Reply = Result<Response<StubBody>, ResetConnection>;

/// Accepts connections until `shutdown` resolves, then aborts them all.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    conn: ConnConfig,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    conns.spawn(serve_connection(stream, shared.clone(), conn));
                }
                // Usually EMFILE or a connection reset before accept; back off briefly rather
                // than spin, and keep serving the connections we have.
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            },
            // Reap finished connections so the set does not grow without bound.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.shutdown().await;
    // Occupations run on their own tasks; end them too so their slots and timers go away.
    shared.release(None);
    Ok(())
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>, conn: ConnConfig) {
    // Streamed chunks are tiny; without this, Nagle plus delayed ACKs would bunch them up.
    let _ = stream.set_nodelay(true);
    let idle = IdleSince::new();
    let io = IdleClose::new(stream, conn.idle_close, idle.clone());
    let svc = service_fn(move |req| {
        let (shared, idle) = (shared.clone(), idle.clone());
        async move {
            let reply = route(shared, req).await?;
            Ok::<_, ResetConnection>(reply.map(|body| IdleWhenDone::new(body, idle)))
        }
    });
    // Errors here are the client going away or the reset fault; either way the connection is done.
    let _ = http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(io), svc)
        .await;
}

// The methods each route accepts. Statics rather than literals: `Method` has drop glue, so a
// `&[Method::GET]` literal could not be borrowed for the whole function.
static GET: [Method; 1] = [Method::GET];
static POST: [Method; 1] = [Method::POST];
// `DELETE /stub/requests` is an alias of `POST /stub/requests/clear`.
static GET_OR_DELETE: [Method; 2] = [Method::GET, Method::DELETE];

async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Reply {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let model = |e| (&POST[..], Some(e));
    let (allowed, endpoint) = match path.as_str() {
        "/v1/chat/completions" => model(Endpoint::Chat),
        "/v1/completions" => model(Endpoint::Text),
        "/v1/embeddings" => model(Endpoint::Embeddings),
        "/v1/models" | "/props" | "/health" | "/metrics" | "/stub/stats" => (&GET[..], None),
        "/stub/requests" => (&GET_OR_DELETE[..], None),
        "/stub/release" | "/stub/occupy" | "/stub/requests/clear" => (&POST[..], None),
        _ => {
            let msg = format!("no route for {method} {path}");
            return Ok(error(StatusCode::NOT_FOUND, &msg, "not_found"));
        }
    };
    if !allowed.contains(&method) {
        let names: Vec<&str> = allowed.iter().map(Method::as_str).collect();
        let msg = format!("{path} only accepts {}", names.join(" or "));
        return Ok(error(
            StatusCode::METHOD_NOT_ALLOWED,
            &msg,
            "method_not_allowed",
        ));
    }
    if let Some(endpoint) = endpoint {
        return model_request(shared, endpoint, req).await;
    }
    let context = shared
        .context_tokens
        .load(std::sync::atomic::Ordering::Relaxed);
    Ok(match path.as_str() {
        "/v1/models" if context > 0 => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                    "owned_by": "slackgate", "max_model_len": context}]}),
        ),
        "/v1/models" => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "slackgate"}]}),
        ),
        "/props" if context > 0 => json_response(
            StatusCode::OK,
            &json!({"default_generation_settings": {"n_ctx": context},
                    "total_slots": shared.cfg.slots}),
        ),
        "/props" => error(
            StatusCode::NOT_FOUND,
            "no route for GET /props (this stub claims no context window)",
            "not_found",
        ),
        "/health" => plain(StatusCode::OK, "ok"),
        "/metrics" => with_body(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            StubBody::full(metrics_text(&shared.stats())),
        ),
        "/stub/stats" => json_response(StatusCode::OK, &json!(shared.stats())),
        "/stub/requests" if method == Method::GET => control::requests(&shared),
        "/stub/requests" | "/stub/requests/clear" => control::clear_requests(&shared),
        "/stub/release" => control::release(&shared, req).await,
        _ => control::occupy(&shared, req).await,
    })
}

/// The model name the stub reports in `/v1/models` and labels its vLLM-style metrics with.
const MODEL_NAME: &str = "stub";

/// `GET /metrics`: the stub's queue in the Prometheus text format, under llama.cpp's names
/// (`llamacpp:requests_processing`, `llamacpp:requests_deferred`) and vLLM's
/// (`vllm:num_requests_running`, `vllm:num_requests_waiting`, labelled by `model_name`), so a
/// gate configured for either server kind can read it.
///
/// Running is the requests holding a slot, waiting those queued for one: real requests only.
/// Slots taken by `/stub/occupy` are capacity taken away, not requests, and appear in neither
/// (a request queued because of them is counted as waiting). Both come from one snapshot, so
/// they agree with each other and with `/stub/stats`.
pub(crate) fn metrics_text(stats: &crate::StubStats) -> String {
    let (running, waiting) = (stats.in_flight, stats.queued);
    format!(
        "# HELP llamacpp:requests_processing Number of requests processing.\n\
         # TYPE llamacpp:requests_processing gauge\n\
         llamacpp:requests_processing {running}\n\
         # HELP llamacpp:requests_deferred Number of requests deferred.\n\
         # TYPE llamacpp:requests_deferred gauge\n\
         llamacpp:requests_deferred {waiting}\n\
         # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{model_name=\"{MODEL_NAME}\"}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"{MODEL_NAME}\"}} {waiting}.0\n"
    )
}

/// Per-request test controls carried in `x-stub-*` headers.
#[derive(Default)]
struct Overrides {
    output_tokens: Option<u32>,
    latency: Option<LatencySpec>,
    hold: Option<String>,
    fault: Option<Fault>,
    /// `x-stub-request-id`: record this request in `/stub/requests`.
    request_id: Option<String>,
}

/// An injected failure (`x-stub-fault`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    Status(StatusCode),
    Reset,
    Hang,
}

impl Overrides {
    /// Reads the `x-stub-*` headers; a malformed one is a 400 naming the header.
    fn from_headers(h: &HeaderMap) -> Result<Self, Refusal> {
        let get = |name: &str| -> Result<Option<&str>, Refusal> {
            match h.get(name) {
                None => Ok(None),
                Some(v) => v
                    .to_str()
                    .map(|s| Some(s.trim()))
                    .map_err(|_| bad_header(name, "header value is not visible ASCII".to_owned())),
            }
        };
        let mut o = Overrides::default();
        if let Some(v) = get("x-stub-output-tokens")? {
            let n: u64 = v.parse().map_err(|_| {
                bad_header(
                    "x-stub-output-tokens",
                    format!("`{v}` is not a non-negative integer"),
                )
            })?;
            o.output_tokens = Some(clamp_tokens(n));
        }
        if let Some(v) = get("x-stub-latency")? {
            o.latency = Some(
                v.parse()
                    .map_err(|e| bad_header("x-stub-latency", format!("{e}")))?,
            );
        }
        o.hold = get("x-stub-hold")?.map(str::to_owned);
        if let Some(v) = get("x-stub-fault")? {
            o.fault = Some(parse_fault(v).ok_or_else(|| {
                bad_header(
                    "x-stub-fault",
                    format!("`{v}` is not one of status:<400-599>, reset, hang"),
                )
            })?);
        }
        if let Some(v) = get("x-stub-request-id")? {
            check_request_id(v).map_err(|why| bad_header("x-stub-request-id", why))?;
            o.request_id = Some(v.to_owned());
        }
        Ok(o)
    }
}

fn parse_fault(v: &str) -> Option<Fault> {
    match v {
        "reset" => Some(Fault::Reset),
        "hang" => Some(Fault::Hang),
        _ => {
            let code: u16 = v.strip_prefix("status:")?.trim().parse().ok()?;
            let status = StatusCode::from_u16(code).ok()?;
            (status.is_client_error() || status.is_server_error()).then_some(Fault::Status(status))
        }
    }
}

/// Serves `POST /v1/{chat/completions,completions,embeddings}`.
async fn model_request(shared: Arc<Shared>, endpoint: Endpoint, req: Request<Incoming>) -> Reply {
    shared.count_request();
    let overrides = match Overrides::from_headers(req.headers()) {
        Ok(o) => o,
        Err(refusal) => return Ok(refusal.into_response()),
    };
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(refusal) => return Ok(refusal.into_response()),
    };
    let parsed = match ModelRequest::parse(endpoint, &body) {
        Ok(p) => p,
        Err(e) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                "invalid_json",
            ))
        }
    };
    let tokens = match endpoint {
        Endpoint::Embeddings => 0,
        _ => overrides
            .output_tokens
            .or(parsed.max_tokens)
            .unwrap_or(clamp_tokens(u64::from(shared.cfg.default_output_tokens))),
    };
    // Register before queueing, so a release sent while the request waits for a slot is not lost.
    let hold = overrides.hold.as_deref().map(|n| shared.register_hold(n));
    // From here on the request is accounted: its guards record it however it ends.
    let tag = overrides.request_id.map(|id| Tag {
        id,
        output_tokens: tokens,
        stream: parsed.stream,
    });

    let Some(mut slot) = shared.acquire_slot(tag).await else {
        return Ok(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "stub is shutting down",
            "shutting_down",
        ));
    };
    match overrides.fault {
        Some(Fault::Status(status)) => {
            slot.settle(Outcome::Faulted);
            return Ok(error(
                status,
                "injected fault from x-stub-fault",
                "stub_fault",
            ));
        }
        // Keep the slot until the client gives up; dropping this future then drops the guard,
        // which counts the request as cancelled.
        Some(Fault::Hang) => std::future::pending::<()>().await,
        Some(Fault::Reset) if !parsed.stream => {
            slot.settle(Outcome::Faulted);
            return Err(ResetConnection);
        }
        _ => {}
    }
    if let Some((_registration, released)) = hold {
        // An error only means the registry dropped the sender; either way the hold is over.
        let _ = released.await;
    }

    // Service time starts once the slot is ours and any hold is over.
    let start = Instant::now();
    let spec = overrides.latency.unwrap_or(shared.cfg.latency);
    let schedule = shared.schedule(&spec, parsed.prompt_tokens, tokens);
    let load: Load = {
        let shared = shared.clone();
        std::sync::Arc::new(move || shared.in_flight())
    };
    let mut pacer = Pacer::new(schedule, start, load);
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Text => "cmpl",
        Endpoint::Embeddings => "embd",
    };
    let id = format!("{prefix}-stub-{}", shared.next_response_id());

    if parsed.stream {
        let plan = StreamPlan {
            endpoint,
            id,
            model: parsed.model,
            pacer,
            prompt_tokens: parsed.prompt_tokens,
            include_usage: parsed.include_usage,
            reset_before: (overrides.fault == Some(Fault::Reset)).then_some(tokens.min(3)),
        };
        let body = StubBody::guarded(token_stream(plan), slot);
        return Ok(with_body(StatusCode::OK, "text/event-stream", body));
    }
    pacer.until(tokens).await;
    let value = match endpoint {
        Endpoint::Embeddings => openai::embeddings(&parsed),
        _ => openai::completion(endpoint, &id, &parsed, tokens),
    };
    let body = StubBody::full_guarded(value.to_string(), slot);
    Ok(with_body(StatusCode::OK, "application/json", body))
}

fn bad_header(name: &str, why: String) -> Refusal {
    let msg = format!("invalid {name} header: {why}");
    Refusal::new(StatusCode::BAD_REQUEST, msg, "invalid_header")
}
