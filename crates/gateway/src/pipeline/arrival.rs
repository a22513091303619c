//! The first phases of a request: its context at arrival, reading what it asks for (headers,
//! then the body, then the body's JSON), and the offer the core decides on.

use crate::engine::state::{JobMeta, Shared};
use crate::engine::unqueued::{bad_request, body_failure, read_body};
use crate::support::clock::epoch_ms;
use crate::wire::request_info::{
    class_label, fairness_id, parse_body, parse_body_lenient, parse_headers_with, BodyInfo,
    Endpoint, HeaderInfo,
};
use crate::wire::response::ResBody;
use bytes::Bytes;
use http::{Request, Response};
use slackgate_core::{Millis, Request as CoreRequest};

/// One request as it arrived: the per-request context every later phase reads.
pub(super) struct Arrival {
    /// The gate's clock at arrival: the client's deadline budget runs from here, so the time
    /// its body takes to arrive is spent from that budget, not added on top of it.
    pub now: Millis,
    /// The wall clock at arrival (absolute deadlines, the log's arrival time).
    pub now_epoch: u64,
    /// The kind of endpoint.
    pub kind: Endpoint,
    /// Method, URI and headers.
    pub parts: http::request::Parts,
    /// The path, for the decision log.
    pub path: String,
    /// The class label as sent (for lines about a request refused before it is parsed).
    pub raw_label: Option<String>,
}

/// What the request asks for.
pub(super) struct Asked {
    /// Read from its headers.
    pub headers: HeaderInfo,
    /// Read from its body.
    pub body: BodyInfo,
    /// The body to send upstream (changed only to ask for a stream's usage).
    pub bytes: Bytes,
}

impl Arrival {
    /// Take the arrival time and split the request.
    pub fn new<B>(shared: &Shared, req: Request<B>, kind: Endpoint) -> (Arrival, B) {
        let now = shared.clock.now_ms();
        let now_epoch = epoch_ms();
        let (parts, body) = req.into_parts();
        let arrival = Arrival {
            now,
            now_epoch,
            kind,
            path: parts.uri.path().to_string(),
            raw_label: class_label(&parts.headers),
            parts,
        };
        (arrival, body)
    }
}

/// Read the gate's headers (cheap, first), then the body under its size and time limits, then
/// the body's JSON. Bad input is answered here.
pub(super) async fn read<B>(
    shared: &Shared,
    a: &Arrival,
    body: B,
) -> Result<Asked, Response<ResBody>>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let refuse = |e| bad_request(shared, &a.path, a.raw_label.clone(), e);
    let server = &shared.server;
    let mut headers = parse_headers_with(
        &a.parts.headers,
        a.now_epoch,
        server.trust_tenant_header,
        &shared.tenants,
    )
    .map_err(refuse)?;
    if let Some(name) = server.fairness_header.as_deref() {
        if let Some(id) = fairness_id(&a.parts.headers, name).map_err(refuse)? {
            headers.fairness_id = Some(id);
        }
    }
    let mut bytes = read_body(shared, body, &a.parts.headers)
        .await
        .map_err(|e| body_failure(shared, &a.path, a.raw_label.clone(), e))?;
    let body = match a.kind {
        Endpoint::Other => parse_body_lenient(&bytes),
        Endpoint::Chat | Endpoint::Completions | Endpoint::Embeddings => {
            let (mut json, b) = parse_body(&bytes).map_err(refuse)?;
            // Settle streams on the upstream's own count: ask for the final usage chunk
            // (`stream_options.include_usage`) unless the client already said either way.
            if b.stream
                && server.stream_usage
                && matches!(a.kind, Endpoint::Chat | Endpoint::Completions)
                && ask_for_stream_usage(&mut json)
            {
                if let Ok(v) = serde_json::to_vec(&json) {
                    bytes = Bytes::from(v);
                }
            }
            b
        }
    };
    // Without X-Job-Class: the class other tools name (llm-d's objective, a priority number).
    if headers.class_label.is_none() {
        headers.class_label = server
            .class_map
            .label(&a.parts.headers, body.priority.as_deref())
            .map_err(refuse)?;
    }
    Ok(Asked {
        headers,
        body,
        bytes,
    })
}

/// Set `stream_options.include_usage = true` unless the client set it; true when changed.
fn ask_for_stream_usage(json: &mut serde_json::Value) -> bool {
    let Some(obj) = json.as_object_mut() else {
        return false;
    };
    let opts = obj
        .entry("stream_options")
        .or_insert_with(|| serde_json::json!({}));
    match opts.as_object_mut() {
        Some(o) if !o.contains_key("include_usage") => {
            o.insert("include_usage".into(), serde_json::Value::Bool(true));
            true
        }
        _ => false,
    }
}

/// The offer the core decides on, and what the gate keeps about the job beside it.
pub(super) fn offer(shared: &Shared, a: &Arrival, asked: &Asked) -> (CoreRequest, JobMeta) {
    let (h, b, now) = (&asked.headers, &asked.body, a.now);
    // An embedding generates no tokens: its service time is prefill only.
    let max_tokens = match a.kind {
        Endpoint::Embeddings => Some(0),
        _ => b.max_tokens,
    };
    let relative = h.deadline_in_ms.map(|ms| now.saturating_add(ms));
    let absolute = h
        .deadline_epoch_ms
        .map(|at| now.saturating_add(at.saturating_sub(a.now_epoch)));
    let deadline = match (relative, absolute) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let core_req = CoreRequest {
        class: None, // resolved inside the lock, against the live class table
        deadline,
        first_token_deadline: h.first_token_in_ms.map(|ms| now.saturating_add(ms)),
        prompt_tokens: b.prompt_tokens,
        prompt_chars: b.prompt_chars,
        model: b.model.clone(),
        max_tokens,
        expected_output_tokens: h
            .expected_output_tokens
            .filter(|_| shared.server.trust_size_hint),
        deadline_is_absolute: relative.is_none() && absolute.is_some(),
        idempotency_key: h.idempotency_key.clone(),
        tenant: h.tenant.clone(),
        fairness_id: h.fairness_id.clone(),
        attempt: h.attempt.unwrap_or(0),
        hold_tokens: None,
        reservation: false,
    };
    let meta = JobMeta {
        label: h.class_label.clone(),
        tenant: h.tenant.clone(),
        idempotency_key: h.idempotency_key.clone(),
        attempt: h.attempt,
        path: a.path.clone(),
        arrived_epoch_ms: a.now_epoch,
        routed_as_leader: a
            .parts
            .extensions
            .get::<crate::engine::state::RoutedAsLeader>()
            .is_some(),
        ..JobMeta::default()
    };
    (core_req, meta)
}
