//! Talking to a real OpenAI-compatible model server (llama.cpp's `llama-server`, vLLM, ...):
//! deterministic prompt text of a chosen token length, the server's characters per token
//! (from its `/tokenize` endpoint, else from `usage.prompt_tokens` of two probes), the
//! model name it serves, and one measured chat completion with its `usage`.
//!
//! Used by the drill against a real upstream and by `slackgate calibrate`. Every prompt is
//! different text (its own seed), so a server's prompt cache cannot make a repeated shape
//! look cheaper than it is.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::http_client::HttpClient;

/// Characters per token assumed when nothing better is known (English text, common BPE
/// vocabularies).
pub const DEFAULT_CHARS_PER_TOKEN: f64 = 4.0;

/// Largest response body read from a model server.
const MAX_BODY: usize = 64 * 1024 * 1024;

/// Longest wait for a probe (`/tokenize`, `/v1/models`, a one-token completion).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Words the prompt text is drawn from: common, short, mixed lengths, so the text tokenizes
/// like ordinary prose in any vocabulary.
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "year",
    "water",
    "house",
    "number",
    "system",
    "program",
    "question",
    "government",
    "small",
    "large",
    "between",
    "under",
    "never",
    "always",
    "because",
    "through",
    "several",
    "river",
    "garden",
    "window",
    "morning",
    "evening",
    "careful",
    "quickly",
    "problem",
    "answer",
];

/// Deterministic text of about `chars` characters (at least one word), different for each
/// `seed`: a numbered preamble then words from a fixed list picked by a small PRNG.
pub fn prompt_text(seed: u64, chars: usize) -> String {
    let mut out = format!("Request {seed}: ");
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < chars {
        // xorshift64: cheap, reproducible, good enough to vary word order.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        out.push(' ');
    }
    out
}

/// Characters of text to send for about `tokens` prompt tokens at `chars_per_token`.
pub fn chars_for(tokens: u32, chars_per_token: f64) -> usize {
    (f64::from(tokens.max(1)) * chars_per_token)
        .round()
        .max(1.0) as usize
}

/// What one request to a model server returned.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// HTTP status.
    pub status: u16,
    /// Send to end of response.
    pub total_ms: f64,
    /// `usage.prompt_tokens`, when reported.
    pub prompt_tokens: Option<u32>,
    /// `usage.completion_tokens`, when reported.
    pub completion_tokens: Option<u32>,
}

/// Errors talking to a model server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The request could not be built (a bad URL).
    #[error("cannot build a request to {0}")]
    Build(String),
    /// No answer, or the connection broke.
    #[error("{url}: {why}")]
    Transport {
        /// Where.
        url: String,
        /// What went wrong.
        why: String,
    },
    /// No answer in time.
    #[error("{0}: no answer within {1:?}")]
    Timeout(String, Duration),
}

/// Send `body` (JSON) to `url` with `method` and read the whole answer: (status, body).
pub async fn call(
    http: &HttpClient,
    method: Method,
    url: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> Result<(StatusCode, Bytes), ServerError> {
    let payload = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(payload))
        .map_err(|_| ServerError::Build(url.to_string()))?;
    let transport = |e: String| ServerError::Transport {
        url: url.to_string(),
        why: e,
    };
    let fut = async {
        let resp = http
            .request(req)
            .await
            .map_err(|e| transport(e.to_string()))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| transport(e.to_string()))?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| ServerError::Timeout(url.to_string(), timeout))?
}

/// The first model the server lists at `/v1/models`, if it answers.
pub async fn discover_model(http: &HttpClient, base: &str) -> Option<String> {
    let url = format!("{base}/v1/models");
    let (status, body) = call(http, Method::GET, &url, None, PROBE_TIMEOUT)
        .await
        .ok()?;
    if status != StatusCode::OK {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    v.pointer("/data/0/id")
        .and_then(|m| m.as_str())
        .map(str::to_string)
}

/// Characters per token from the server's `/tokenize`: llama.cpp's form
/// (`{"content": ..}` -> `{"tokens": [..]}`) first, then vLLM's (`{"model", "prompt"}` ->
/// `{"count": n}`). `None` when the server has neither.
pub async fn tokenize_ratio(http: &HttpClient, base: &str, model: &str) -> Option<f64> {
    let text = prompt_text(1, 4000);
    let url = format!("{base}/tokenize");
    let bodies = [
        serde_json::json!({"content": text}),
        serde_json::json!({"model": model, "prompt": text}),
    ];
    for body in &bodies {
        let Ok((StatusCode::OK, answer)) =
            call(http, Method::POST, &url, Some(body), PROBE_TIMEOUT).await
        else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer) else {
            continue;
        };
        let count = v
            .get("count")
            .and_then(serde_json::Value::as_u64)
            .or_else(|| {
                v.get("tokens")
                    .and_then(|t| t.as_array())
                    .map(|t| t.len() as u64)
            });
        if let Some(n) = count.filter(|&n| n > 0) {
            return Some(text.chars().count() as f64 / n as f64);
        }
    }
    None
}

/// A chat-completion body: `content` as the one user message, `max_tokens`, non-streamed
/// unless `stream` (then with `stream_options.include_usage`, so the last chunk carries
/// `usage`). `ignore_eos` asks llama.cpp and vLLM to generate all `max_tokens`, as the
/// scenario or the calibration plan wants; servers that do not know it ignore it.
pub fn chat_body(model: &str, content: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": true,
    });
    if stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body
}

/// `(prompt_tokens, completion_tokens)` from a response's `usage`, non-streamed (a JSON
/// body) or streamed (the SSE chunk that carries `usage`).
pub fn usage_of(body: &[u8]) -> (Option<u32>, Option<u32>) {
    let read = |v: &serde_json::Value| {
        let u = v.get("usage")?;
        let n = |k: &str| {
            u.get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
        };
        Some((n("prompt_tokens"), n("completion_tokens")))
    };
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        return read(&v).unwrap_or((None, None));
    }
    // A stream: the last `data:` line with a usage object wins.
    let text = String::from_utf8_lossy(body);
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
        .filter_map(|v| read(&v))
        .rfind(|u| u.0.is_some() || u.1.is_some())
        .unwrap_or((None, None))
}

/// Send one non-streamed chat completion and time it.
pub async fn complete(
    http: &HttpClient,
    base: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<Measured, ServerError> {
    let url = format!("{base}/v1/chat/completions");
    let started = Instant::now();
    let (status, answer) = call(http, Method::POST, &url, Some(body), timeout).await?;
    let total_ms = started.elapsed().as_secs_f64() * 1000.0;
    let (prompt_tokens, completion_tokens) = usage_of(&answer);
    Ok(Measured {
        status: status.as_u16(),
        total_ms,
        prompt_tokens,
        completion_tokens,
    })
}

/// Characters per token from `usage.prompt_tokens` of two one-token completions, a short
/// and a long prompt: the slope, so the chat template's fixed tokens cancel out.
pub async fn usage_ratio(http: &HttpClient, base: &str, model: &str) -> Option<f64> {
    let (short, long) = (prompt_text(2, 40), prompt_text(3, 2000));
    let mut counts = Vec::new();
    for text in [&short, &long] {
        let m = complete(http, base, &chat_body(model, text, 1, false), PROBE_TIMEOUT)
            .await
            .ok()?;
        counts.push(m.prompt_tokens.filter(|_| m.status == 200)?);
    }
    let dt = f64::from(counts[1]) - f64::from(counts[0]);
    let dc = long.chars().count() as f64 - short.chars().count() as f64;
    (dt > 0.0).then(|| dc / dt)
}

/// The server's characters per token: `/tokenize` if it has one, else the slope of
/// `usage.prompt_tokens`; `None` when neither works. Returns the ratio and where it came
/// from (`"tokenize"` or `"usage"`).
pub async fn chars_per_token(
    http: &HttpClient,
    base: &str,
    model: &str,
) -> Option<(f64, &'static str)> {
    if let Some(r) = tokenize_ratio(http, base, model).await {
        return Some((r, "tokenize"));
    }
    usage_ratio(http, base, model).await.map(|r| (r, "usage"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_deterministic_sized_and_distinct() {
        let a = prompt_text(7, 500);
        assert_eq!(a, prompt_text(7, 500));
        assert_ne!(a, prompt_text(8, 500));
        assert!(a.len() >= 500 && a.len() < 520, "{}", a.len());
        assert!(!prompt_text(1, 0).is_empty());
        assert_eq!(chars_for(100, 1.2), 120);
        assert_eq!(chars_for(0, 4.0), 4);
    }

    #[test]
    fn reads_usage_from_a_body_and_from_a_stream() {
        let body = br#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34}}"#;
        assert_eq!(usage_of(body), (Some(12), Some(34)));
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(usage_of(stream), (Some(5), Some(2)));
        assert_eq!(usage_of(b"not json"), (None, None));
    }
}
