//! Reading what the gate needs from a client request: class, deadlines, tenant and a token
//! estimate. Parsing is separate from applying (mini-redis style): these functions only look,
//! and every malformed input becomes a reason code with a message, never a panic.

use http::HeaderMap;
use slackgate_core::Reason;

/// Keys the gate generates for requests without one start with this; clients may not use it
/// (a guessable generated key must not be pre-reservable by someone else).
pub use slackgate_core::ledger::GENERATED_KEY_PREFIX;

/// Longest deadline a header may ask for: one day. Anything beyond is a unit mistake.
pub const MAX_DEADLINE_MS: u64 = 86_400_000;
/// Longest class label considered; longer ones are treated as unknown.
const MAX_LABEL_LEN: usize = 64;

/// A malformed request: the reason code and a message for the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRequest {
    /// Stable reason code.
    pub reason: Reason,
    /// What is wrong, in words.
    pub message: String,
}

fn bad(reason: Reason, message: impl Into<String>) -> BadRequest {
    BadRequest {
        reason,
        message: message.into(),
    }
}

/// What the headers say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeaderInfo {
    /// `X-Job-Class`, if sent.
    pub class_label: Option<String>,
    /// `X-Deadline-Ms`: relative budget for the whole response.
    pub deadline_in_ms: Option<u64>,
    /// `X-Deadline`: absolute, epoch milliseconds.
    pub deadline_epoch_ms: Option<u64>,
    /// `x-llm-d-slo-ttft-ms` or its alias `x-slo-ttft-ms`: relative budget for the first token.
    pub first_token_in_ms: Option<u64>,
    /// Hash of the bearer key (or the `X-Tenant` header).
    pub tenant: Option<String>,
    /// The fairness id: the configured fairness header's value, else `tenant`.
    pub fairness_id: Option<String>,
    /// `Idempotency-Key` / `X-Idempotency-Key`.
    pub idempotency_key: Option<String>,
    /// `X-Attempt`, or the OpenAI SDKs' `x-stainless-retry-count`.
    pub attempt: Option<u32>,
    /// `X-Expected-Output-Tokens`: the caller's own estimate of the output length, used
    /// instead of the class's learned mean (capped by `max_tokens`).
    pub expected_output_tokens: Option<u32>,
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, BadRequest> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| {
            bad(
                Reason::InvalidDeadline,
                format!("{name}: not visible ASCII"),
            )
        }),
    }
}

/// Parse a millisecond count: a non-negative integer (a fractional value is rounded up).
fn parse_ms(name: &str, v: &str) -> Result<u64, BadRequest> {
    let n: f64 = v.parse().map_err(|_| {
        bad(
            Reason::InvalidDeadline,
            format!("{name}: {v:?} is not a number of milliseconds"),
        )
    })?;
    if !n.is_finite() || n < 0.0 {
        return Err(bad(
            Reason::InvalidDeadline,
            format!("{name}: {v:?} must be a non-negative number of milliseconds"),
        ));
    }
    if n > u64::MAX as f64 / 2.0 {
        return Err(bad(
            Reason::InvalidDeadline,
            format!("{name}: {v:?} is absurdly large"),
        ));
    }
    Ok(n.ceil() as u64)
}

fn relative(name: &str, h: &HeaderMap) -> Result<Option<u64>, BadRequest> {
    let Some(v) = header_str(h, name)? else {
        return Ok(None);
    };
    bounded_ms(name, v).map(Some)
}

/// A relative budget: 1 ms to a day.
fn bounded_ms(name: &str, v: &str) -> Result<u64, BadRequest> {
    let ms = parse_ms(name, v)?;
    if ms == 0 || ms > MAX_DEADLINE_MS {
        return Err(bad(
            Reason::InvalidDeadline,
            format!("{name}: {ms} ms is outside 1..={MAX_DEADLINE_MS}"),
        ));
    }
    Ok(ms)
}

/// The first-token budget: llm-d's `x-llm-d-slo-ttft-ms`, or `x-slo-ttft-ms` (its older name,
/// which inference-perf sends). Each is read as [`relative`] reads a budget; copies of either,
/// or both names, must agree: a second value a proxy appended must not pass unnoticed.
fn first_token(h: &HeaderMap) -> Result<Option<u64>, BadRequest> {
    let mut found: Option<(&str, u64)> = None;
    for name in FIRST_TOKEN_HEADERS {
        for v in h.get_all(name) {
            let text = v.to_str().map(str::trim).map_err(|_| {
                bad(
                    Reason::InvalidDeadline,
                    format!("{name}: not visible ASCII"),
                )
            })?;
            let ms = bounded_ms(name, text)?;
            match found {
                Some((first, seen)) if seen != ms => {
                    return Err(bad(
                        Reason::InvalidDeadline,
                        format!("{name}: {ms} ms disagrees with {first}: {seen} ms"),
                    ))
                }
                _ => found = Some((name, ms)),
            }
        }
    }
    Ok(found.map(|(_, ms)| ms))
}

/// The first-token budget's names, llm-d's current one first.
pub const FIRST_TOKEN_HEADERS: [&str; 2] = ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"];

/// The `X-Job-Class` label: trimmed, cut one character past the longest class name (so an
/// over-long label matches no class rather than a shorter one), `None` when absent, empty or
/// not visible ASCII. The one reader of the label: the proxy, the reservation API, the
/// decision log and a cluster replica deciding alone all see the same class.
pub fn class_label(h: &HeaderMap) -> Option<String> {
    h.get("x-job-class")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().chars().take(MAX_LABEL_LEN + 1).collect::<String>())
        .filter(|s| !s.is_empty())
}

/// Read the gate's headers. `now_epoch_ms` bounds absolute deadlines to a sane window.
/// Tenant ids are hashed under an all-zero key here: for tests and tools, not for serving.
pub fn parse_headers(h: &HeaderMap, now_epoch_ms: u64) -> Result<HeaderInfo, BadRequest> {
    parse_headers_with(
        h,
        now_epoch_ms,
        false,
        &crate::support::tenant::TenantHasher::new([0; crate::support::tenant::KEY_BYTES]),
    )
}

/// [`parse_headers`], trusting an `X-Tenant` header over the bearer key when
/// `trust_tenant_header` (set `server.trust_tenant_header` only behind a proxy that sets it:
/// otherwise any client could pick a fresh tenant and escape its grant); tenant ids are
/// hashed with `tenants`. The headers are read in a fixed order (deadlines, key, size hint),
/// so the first malformed one is the one reported.
pub fn parse_headers_with(
    h: &HeaderMap,
    now_epoch_ms: u64,
    trust_tenant_header: bool,
    tenants: &crate::support::tenant::TenantHasher,
) -> Result<HeaderInfo, BadRequest> {
    let deadline_in_ms = relative("x-deadline-ms", h)?;
    let first_token_in_ms = first_token(h)?;
    let deadline_epoch_ms = absolute_deadline(h, now_epoch_ms)?;
    let class_label = class_label(h);
    let tenant = tenant(h, trust_tenant_header, tenants);
    let idempotency_key = idempotency_key(h)?;
    let attempt = attempt(h);
    let expected_output_tokens = expected_output_tokens(h)?;
    Ok(HeaderInfo {
        class_label,
        deadline_in_ms,
        deadline_epoch_ms,
        first_token_in_ms,
        fairness_id: tenant.clone(),
        tenant,
        idempotency_key,
        attempt,
        expected_output_tokens,
    })
}

/// Longest fairness id read from a fairness header.
pub const MAX_FAIRNESS_ID_LEN: usize = 256;

/// The fairness id from the configured header `name`: visible ASCII, at most
/// [`MAX_FAIRNESS_ID_LEN`] bytes; `None` when absent or empty (the tenant id is used then). A
/// malformed one is refused: the header comes from a trusted proxy, so it is a fault to see.
pub fn fairness_id(h: &HeaderMap, name: &str) -> Result<Option<String>, BadRequest> {
    let mut all = h.get_all(name).iter();
    let Some(v) = all.next() else {
        return Ok(None);
    };
    // A proxy that appends its value instead of replacing the client's leaves two: which
    // one is the proxy's cannot be told, so neither is taken.
    if all.next().is_some() {
        return Err(bad(
            Reason::InvalidRequest,
            format!("{name}: sent more than once"),
        ));
    }
    let id = v
        .to_str()
        .map(str::trim)
        .map_err(|_| bad(Reason::InvalidRequest, format!("{name}: not visible ASCII")))?;
    if id.len() > MAX_FAIRNESS_ID_LEN {
        return Err(bad(
            Reason::InvalidRequest,
            format!(
                "{name}: {} bytes, over the limit of {MAX_FAIRNESS_ID_LEN}",
                id.len()
            ),
        ));
    }
    Ok((!id.is_empty()).then(|| id.to_string()))
}

/// `X-Deadline`: epoch milliseconds within a day of `now_epoch_ms` either way.
fn absolute_deadline(h: &HeaderMap, now_epoch_ms: u64) -> Result<Option<u64>, BadRequest> {
    let Some(v) = header_str(h, "x-deadline")? else {
        return Ok(None);
    };
    let at = parse_ms("x-deadline", v)?;
    let lo = now_epoch_ms.saturating_sub(MAX_DEADLINE_MS);
    let hi = now_epoch_ms.saturating_add(MAX_DEADLINE_MS);
    if !(lo..=hi).contains(&at) {
        return Err(bad(
            Reason::InvalidDeadline,
            format!("x-deadline: {at} is not an epoch-milliseconds time within a day of now ({now_epoch_ms})"),
        ));
    }
    Ok(Some(at))
}

/// The tenant's id: `X-Tenant` when trusted (`t:<hash>`), else the bearer key's (`k:<hash>`).
fn tenant(
    h: &HeaderMap,
    trust_tenant_header: bool,
    tenants: &crate::support::tenant::TenantHasher,
) -> Option<String> {
    h.get("x-tenant")
        .filter(|_| trust_tenant_header)
        .and_then(|v| v.to_str().ok())
        .map(|s| tenants.id("t", s.trim().as_bytes()))
        .or_else(|| {
            h.get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|s| {
                    s.strip_prefix("Bearer ")
                        .or_else(|| s.strip_prefix("bearer "))
                })
                .map(|key| tenants.id("k", key.trim().as_bytes()))
        })
}

/// `Idempotency-Key` (or `X-Idempotency-Key`): the key a hold is placed under. Never
/// truncated (two long keys sharing a prefix must not collide), so an over-long or non-text
/// key is refused, as is one in the gate's own generated-key space; an empty one is none.
fn idempotency_key(h: &HeaderMap) -> Result<Option<String>, BadRequest> {
    let Some(v) = ["idempotency-key", "x-idempotency-key"]
        .iter()
        .find_map(|n| h.get(*n))
    else {
        return Ok(None);
    };
    let key = v
        .to_str()
        .map(str::trim)
        .map_err(|_| bad(Reason::InvalidRequest, "idempotency-key: not visible ASCII"))?;
    if key.len() > slackgate_core::ledger::MAX_KEY_LEN {
        return Err(bad(
            Reason::InvalidRequest,
            format!(
                "idempotency-key: {} bytes, over the limit of {}",
                key.len(),
                slackgate_core::ledger::MAX_KEY_LEN
            ),
        ));
    }
    if key.starts_with(GENERATED_KEY_PREFIX) {
        return Err(bad(
            Reason::InvalidRequest,
            format!(
                "idempotency-key: keys starting with {GENERATED_KEY_PREFIX:?} are reserved \
                 for the gate"
            ),
        ));
    }
    Ok(Some(key.to_string()).filter(|k| !k.is_empty()))
}

/// `X-Attempt`, or the OpenAI SDKs' `x-stainless-retry-count`; unreadable counts as absent.
fn attempt(h: &HeaderMap) -> Option<u32> {
    ["x-attempt", "x-stainless-retry-count"]
        .iter()
        .find_map(|n| h.get(*n))
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
}

/// `X-Expected-Output-Tokens`: a whole number of tokens, or the request is refused.
fn expected_output_tokens(h: &HeaderMap) -> Result<Option<u32>, BadRequest> {
    let Some(v) = h.get("x-expected-output-tokens") else {
        return Ok(None);
    };
    let text = v.to_str().map(str::trim).unwrap_or("<not visible ASCII>");
    let n = text.parse::<u32>().map_err(|_| {
        bad(
            Reason::InvalidRequest,
            format!(
                "x-expected-output-tokens: {text:?} is not a whole number of tokens (0..={})",
                u32::MAX
            ),
        )
    })?;
    Ok(Some(n))
}

/// What the JSON body says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BodyInfo {
    /// Estimated prompt tokens (characters / 4, at least 1), for when the characters are not
    /// known; the core counts tokens from `prompt_chars` with what it learned of the upstream.
    pub prompt_tokens: u32,
    /// Characters of prompt text (messages' contents, `prompt`, `input`).
    pub prompt_chars: Option<u32>,
    /// `max_completion_tokens` or `max_tokens`.
    pub max_tokens: Option<u32>,
    /// `"stream": true`.
    pub stream: bool,
    /// `model`, for the log.
    pub model: Option<String>,
    /// `priority` (vLLM's field) as JSON text, read only when `[server.class_map]` maps
    /// priorities (`labels::ClassMap::label` parses it).
    pub priority: Option<String>,
}

/// Parse an OpenAI request body (chat, completion or embedding). It must be a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<(serde_json::Value, BodyInfo), BadRequest> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        bad(
            Reason::InvalidJson,
            format!("request body is not valid JSON: {e}"),
        )
    })?;
    let Some(obj) = v.as_object() else {
        return Err(bad(
            Reason::InvalidJson,
            "request body must be a JSON object",
        ));
    };
    let mut chars: u64 = 0;
    if let Some(msgs) = obj.get("messages").and_then(|m| m.as_array()) {
        for m in msgs {
            chars += text_chars(m.get("content"));
        }
    }
    chars += text_chars(obj.get("prompt"));
    chars += text_chars(obj.get("input"));
    let prompt_tokens = chars.div_ceil(4).clamp(1, u64::from(u32::MAX)) as u32;
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(|v| v.as_f64()))
        .filter(|n| n.is_finite() && *n >= 0.0)
        .map(|n| n.min(f64::from(u32::MAX)) as u32);
    let stream = obj.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
    let model = obj
        .get("model")
        .and_then(|m| m.as_str())
        .map(|s| s.chars().take(128).collect());
    let info = BodyInfo {
        prompt_tokens,
        prompt_chars: Some(chars.min(u64::from(u32::MAX)) as u32),
        max_tokens,
        stream,
        model,
        priority: obj
            .get("priority")
            .map(|p| p.to_string().chars().take(64).collect()),
    };
    Ok((v, info))
}

/// Read the body of a request to an endpoint the gate does not know in detail
/// (`/v1/responses`, `/v1/audio/transcriptions`, ...): a JSON object is parsed as
/// [`parse_body`] does; anything else (multipart, binary, a JSON array) is never refused, and
/// its prompt is estimated as body bytes / 4 (at least 1), with no output cap.
pub fn parse_body_lenient(bytes: &[u8]) -> BodyInfo {
    match parse_body(bytes) {
        Ok((_, info)) => info,
        Err(_) => BodyInfo {
            prompt_tokens: (bytes.len() as u64 / 4).clamp(1, u64::from(u32::MAX)) as u32,
            ..BodyInfo::default()
        },
    }
}

/// Characters of text in a content value: a string, an array of strings, or an array of
/// content parts (`{"type": "text", "text": ...}`). Token-id arrays count one token each
/// (four characters).
fn text_chars(v: Option<&serde_json::Value>) -> u64 {
    match v {
        Some(serde_json::Value::String(s)) => s.chars().count() as u64,
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                serde_json::Value::String(s) => s.chars().count() as u64,
                serde_json::Value::Number(_) => 4,
                serde_json::Value::Object(o) => text_chars(o.get("text")),
                serde_json::Value::Array(_) => text_chars(Some(item)),
                _ => 0,
            })
            .sum(),
        _ => 0,
    }
}

/// The kind of admission-controlled endpoint a `POST /v1/...` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/embeddings`: generates no tokens.
    Embeddings,
    /// Any other `POST /v1/...`: body read leniently.
    Other,
}

impl Endpoint {
    /// The endpoint of a normalised path (no trailing slash).
    pub fn of(path: &str) -> Endpoint {
        match path {
            "/v1/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/embeddings" => Endpoint::Embeddings,
            _ => Endpoint::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(*k, v);
            }
        }
        h
    }

    #[test]
    fn deadline_headers_are_validated() {
        let now = 1_700_000_000_000;
        let ok = parse_headers(
            &headers(&[("x-deadline-ms", "4000"), ("x-slo-ttft-ms", "1500.2")]),
            now,
        );
        let ok = ok.ok().unwrap_or_default();
        assert_eq!(ok.deadline_in_ms, Some(4000));
        assert_eq!(ok.first_token_in_ms, Some(1501));
        for bad_value in ["-5", "abc", "0", "1e30", "NaN", "inf", "86400001", ""] {
            let r = parse_headers(&headers(&[("x-deadline-ms", bad_value)]), now);
            assert_eq!(
                r.err().map(|e| e.reason),
                Some(Reason::InvalidDeadline),
                "{bad_value}"
            );
        }
        let r = parse_headers(&headers(&[("x-deadline", "12")]), now);
        assert_eq!(r.err().map(|e| e.reason), Some(Reason::InvalidDeadline));
        let r = parse_headers(&headers(&[("x-deadline", &(now + 5000).to_string())]), now);
        assert_eq!(r.ok().and_then(|i| i.deadline_epoch_ms), Some(now + 5000));
    }

    #[test]
    fn expected_output_hint_is_a_token_count_or_an_error() {
        let r = parse_headers(&headers(&[("x-expected-output-tokens", " 250 ")]), 0);
        assert_eq!(r.ok().and_then(|i| i.expected_output_tokens), Some(250));
        let r = parse_headers(&headers(&[]), 0);
        assert_eq!(r.ok().and_then(|i| i.expected_output_tokens), None);
        for bad_value in ["-1", "2.5", "abc", "", "99999999999", "1e3"] {
            let r = parse_headers(&headers(&[("x-expected-output-tokens", bad_value)]), 0);
            assert_eq!(
                r.err().map(|e| e.reason),
                Some(Reason::InvalidRequest),
                "{bad_value:?}"
            );
        }
    }

    #[test]
    fn over_long_idempotency_keys_are_refused_not_truncated() {
        let long = "k".repeat(300);
        let r = parse_headers(&headers(&[("idempotency-key", &long)]), 0);
        assert_eq!(r.err().map(|e| e.reason), Some(Reason::InvalidRequest));
        let ok = "k".repeat(256);
        let r = parse_headers(&headers(&[("x-idempotency-key", &ok)]), 0);
        assert_eq!(
            r.ok().and_then(|i| i.idempotency_key).map(|k| k.len()),
            Some(256)
        );
    }

    #[test]
    fn tenant_attempt_and_key() {
        let h = headers(&[
            ("authorization", "Bearer sk-secret"),
            ("x-stainless-retry-count", "2"),
            ("idempotency-key", "job-17"),
            ("x-job-class", " sync "),
        ]);
        let i = parse_headers(&h, 0).ok().unwrap_or_default();
        assert_eq!(i.attempt, Some(2));
        assert_eq!(i.idempotency_key.as_deref(), Some("job-17"));
        assert_eq!(i.class_label.as_deref(), Some("sync"));
        let t = i.tenant.unwrap_or_default();
        assert!(t.starts_with("k:") && !t.contains("secret"), "{t}");
    }

    #[test]
    fn the_fairness_id_is_the_tenant_unless_the_named_header_says_otherwise() {
        const H: &str = "x-llm-d-inference-fairness-id";
        let h = headers(&[("authorization", "Bearer sk-secret"), (H, " team-a ")]);
        let i = parse_headers(&h, 0).ok().unwrap_or_default();
        assert_eq!(i.fairness_id, i.tenant, "by default the tenant's id");
        assert_eq!(fairness_id(&h, H).ok().flatten().as_deref(), Some("team-a"));
        // Absent or empty: the tenant's id stays.
        assert_eq!(fairness_id(&headers(&[]), H).ok().flatten(), None);
        assert_eq!(fairness_id(&headers(&[(H, "  ")]), H).ok().flatten(), None);
        // Oversized or not text: refused with a reason, never truncated into another id.
        let long = "x".repeat(MAX_FAIRNESS_ID_LEN + 1);
        let e = fairness_id(&headers(&[(H, long.as_str())]), H).err();
        assert_eq!(e.map(|e| e.reason), Some(Reason::InvalidRequest));
        let mut raw = HeaderMap::new();
        raw.insert(
            H,
            http::HeaderValue::from_bytes(b"caf\xc3\xa9")
                .unwrap_or(http::HeaderValue::from_static("x")),
        );
        let e = fairness_id(&raw, H).err();
        assert_eq!(e.map(|e| e.reason), Some(Reason::InvalidRequest));
        // Twice (a client's and an appending proxy's): neither is taken.
        let mut twice = HeaderMap::new();
        twice.append(H, http::HeaderValue::from_static("client"));
        twice.append(H, http::HeaderValue::from_static("proxy"));
        let e = fairness_id(&twice, H).err();
        assert_eq!(e.map(|e| e.reason), Some(Reason::InvalidRequest));
    }

    #[test]
    fn bodies_are_estimated_and_hostile_ones_rejected() {
        let (_, b) = parse_body(br#"{"model":"m","messages":[{"role":"user","content":"12345678"},
            {"role":"user","content":[{"type":"text","text":"abcd"}]}],"max_tokens":64,"stream":true}"#)
            .ok()
            .unwrap_or_default();
        assert_eq!(b.prompt_tokens, 3);
        assert_eq!(b.max_tokens, Some(64));
        assert!(b.stream);
        let (_, b) = parse_body(br#"{"prompt":"x","max_completion_tokens":1e40,"max_tokens":-1}"#)
            .ok()
            .unwrap_or_default();
        assert_eq!(b.max_tokens, Some(u32::MAX));
        for hostile in [
            &b"not json"[..],
            b"[1,2]",
            b"\"str\"",
            b"",
            b"{\"a\":",
            &[0xff, 0xfe],
        ] {
            assert_eq!(
                parse_body(hostile).err().map(|e| e.reason),
                Some(Reason::InvalidJson)
            );
        }
        let b =
            parse_body_lenient(b"--boundary\r\ncontent-disposition: form-data\r\n\r\n0123456789");
        assert_eq!((b.prompt_tokens, b.max_tokens), (14, None));
        let b = parse_body_lenient(br#"{"input":"12345678","max_output_tokens":5,"max_tokens":3}"#);
        assert_eq!((b.prompt_tokens, b.max_tokens), (2, Some(3)));
        assert_eq!(parse_body_lenient(b"").prompt_tokens, 1);
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(
            parse_body(deep.as_bytes()).is_err(),
            "deep nesting is refused, not a stack overflow"
        );
    }
}
