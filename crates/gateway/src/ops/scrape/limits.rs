//! Reading a model server's context window from what it says about itself.
//!
//! A request's declared size is bounded by the servers' context window (see the core's
//! `gate::limits`); where a server says what that window is, the gate uses it rather than a
//! configured guess. llama.cpp's `GET /props` gives the per-slot window as
//! `default_generation_settings.n_ctx` (the whole context divided by `--parallel`); vLLM's
//! `GET /v1/models` gives `max_model_len` per model. Servers that say neither (hosted APIs,
//! TGI, the stub without `/props`) leave the configured window (or the default) in force.
//!
//! Everything read here is untrusted input: bodies are capped at [`MAX_LIMITS_BODY_BYTES`],
//! a missing or absurd figure reads as "not said", and each request runs under a timeout.

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::HeaderMap;
use serde_json::Value;
use slackgate_core::config::MAX_LIMIT_TOKENS;
use std::time::Duration;

use crate::upstream::{parse_base, UpstreamClient};

/// Largest self-description read, in bytes (llama.cpp's `/props` carries the chat template:
/// tens of kilobytes at most).
pub const MAX_LIMITS_BODY_BYTES: usize = 1 << 20;

/// The window llama.cpp's `/props` body names: `default_generation_settings.n_ctx` (per
/// slot), else a top-level `n_ctx` (older builds). `None` when absent or absurd.
pub fn llamacpp_context(body: &[u8]) -> Option<u32> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let n = v
        .get("default_generation_settings")
        .and_then(|s| s.get("n_ctx"))
        .or_else(|| v.get("n_ctx"))?;
    plausible(n)
}

/// The smallest `max_model_len` among the models vLLM's `/v1/models` body lists (a request
/// may go to any of them). `None` when no model names one.
pub fn vllm_context(body: &[u8]) -> Option<u32> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("data")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("max_model_len").and_then(plausible))
        .min()
}

/// The smallest window a server's answer is believed for: below it, the answer more likely
/// comes from another service on that port than from a model server, and believing it would
/// refuse nearly every request of the pool.
pub const MIN_DISCOVERED_CONTEXT: u32 = 256;

/// A window between [`MIN_DISCOVERED_CONTEXT`] and [`MAX_LIMIT_TOKENS`] tokens, as a whole
/// number.
fn plausible(n: &Value) -> Option<u32> {
    let n = n.as_u64()?;
    (u64::from(MIN_DISCOVERED_CONTEXT)..=u64::from(MAX_LIMIT_TOKENS))
        .contains(&n)
        .then_some(n as u32)
}

/// Ask the server at `base_url` for its context window: `/props` first, then `/v1/models`.
/// `Ok(None)`: both answered and neither named one; `Err`: a request got no answer (so the
/// server may still have a window it could not say: keep the last one), with the reasons.
pub async fn discover_context(
    client: &UpstreamClient,
    base_url: &str,
    headers: &HeaderMap,
    timeout: Duration,
) -> Result<Option<u32>, String> {
    let mut errors = Vec::new();
    for (path, read) in [
        ("/props", llamacpp_context as fn(&[u8]) -> Option<u32>),
        ("/v1/models", vllm_context),
    ] {
        match get(client, base_url, path, headers, timeout).await {
            Ok(Some(body)) => {
                if let Some(n) = read(&body) {
                    return Ok(Some(n));
                }
            }
            Ok(None) => {}
            Err(e) => errors.push(format!("{path}: {e}")),
        }
    }
    if errors.is_empty() {
        Ok(None)
    } else {
        Err(errors.join("; "))
    }
}

/// GET `path` under `base_url`: the body of a 2xx answer, `None` for any other status, an
/// error when no answer came within `timeout` or the body is over the cap.
async fn get(
    client: &UpstreamClient,
    base_url: &str,
    path: &'static str,
    headers: &HeaderMap,
    timeout: Duration,
) -> Result<Option<Bytes>, String> {
    let base = parse_base(base_url).map_err(|e| e.to_string())?;
    let uri = base
        .target(Some(&PathAndQuery::from_static(path)))
        .map_err(|e| e.to_string())?;
    let exchange = super::get_body(client, uri, headers.clone(), MAX_LIMITS_BODY_BYTES);
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => Err(format!("no whole answer within {} ms", timeout.as_millis())),
        Ok(Ok(body)) => Ok(Some(body)),
        // It answered, and not with a window: a server that does not serve this path.
        Ok(Err(e)) if e.reason == super::ScrapeReason::Status => Ok(None),
        Ok(Err(e)) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llamacpp_props_name_the_per_slot_window() {
        let body = br#"{"default_generation_settings":{"n_ctx":2048,"n_predict":-1},
                        "total_slots":4,"chat_template":"..."}"#;
        assert_eq!(llamacpp_context(body), Some(2048));
        assert_eq!(llamacpp_context(br#"{"n_ctx":4096}"#), Some(4096));
    }

    #[test]
    fn vllm_models_name_the_smallest_window() {
        let body = br#"{"object":"list","data":[{"id":"a","max_model_len":32768},
                        {"id":"b","max_model_len":8192},{"id":"c"}]}"#;
        assert_eq!(vllm_context(body), Some(8192));
    }

    /// Hostile or foreign bodies read as "not said", never as a window of 0 or of 2^64.
    #[test]
    fn absurd_or_missing_figures_are_not_a_window() {
        for body in [
            &br#"{"n_ctx":0}"#[..],
            br#"{"n_ctx":1}"#,
            br#"{"n_ctx":255}"#,
            br#"{"n_ctx":-5}"#,
            br#"{"n_ctx":1e30}"#,
            br#"{"n_ctx":"4096"}"#,
            br#"{"n_ctx":99999999999}"#,
            br#"{"default_generation_settings":null}"#,
            br#"[1,2,3]"#,
            b"not json",
            b"",
        ] {
            assert_eq!(
                llamacpp_context(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [
            &br#"{"data":[{"max_model_len":0}]}"#[..],
            br#"{"data":{"max_model_len":4096}}"#,
            br#"{"object":"list","data":[{"id":"gpt-4o"}]}"#,
            b"\xff\xfe",
        ] {
            assert_eq!(
                vllm_context(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
