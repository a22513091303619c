//! The OpenAI wire format, as far as the stub needs it: reading requests leniently, writing
//! responses, stream chunks and error bodies.
//!
//! Requests are read as untyped JSON on purpose. A real upstream accepts many optional fields and
//! shapes (string or array prompts, content parts), and the stub only needs a few numbers out of
//! them; a strict schema would make the stub reject traffic the gateway legitimately forwards.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// Output token counts above this are clamped, so an absurd `max_tokens` cannot make the stub
/// build a multi-gigabyte response or stream for hours.
pub(crate) const MAX_OUTPUT_TOKENS: u32 = 65_536;

/// Dimension of the fake embedding vectors.
pub(crate) const EMBEDDING_DIM: usize = 8;

/// Which model endpoint a request hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Text,
    /// `POST /v1/embeddings`
    Embeddings,
}

/// What the stub needs to know about a model request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelRequest {
    /// Echoed back in responses.
    pub model: String,
    /// `ceil(chars / 4)`, at least 1.
    pub prompt_tokens: u32,
    /// From `max_completion_tokens` / `max_tokens`, if present.
    pub max_tokens: Option<u32>,
    /// `"stream": true`.
    pub stream: bool,
    /// `"stream_options": {"include_usage": true}`.
    pub include_usage: bool,
    /// Number of embedding inputs (1 for a plain string).
    pub inputs: usize,
}

/// Why a request body was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BodyError {
    /// Not JSON at all.
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    /// JSON, but not an object.
    #[error("request body must be a JSON object")]
    NotObject,
}

impl ModelRequest {
    /// Parses a model request body.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, BodyError> {
        let v: Value = serde_json::from_slice(body).map_err(|e| BodyError::Json(e.to_string()))?;
        let obj = v.as_object().ok_or(BodyError::NotObject)?;
        let model = obj
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("stub")
            .to_owned();
        let (chars, inputs) = match endpoint {
            Endpoint::Chat => {
                let chars = obj
                    .get("messages")
                    .and_then(Value::as_array)
                    .map_or(0, |msgs| {
                        msgs.iter()
                            .map(|m| m.get("content").map_or(0, text_chars))
                            .sum()
                    });
                (chars, 1)
            }
            Endpoint::Text => (obj.get("prompt").map_or(0, text_chars), 1),
            Endpoint::Embeddings => {
                let input = obj.get("input").unwrap_or(&Value::Null);
                let inputs = match input {
                    // An array of strings is many inputs; an array of numbers is one tokenized input.
                    Value::Array(items) if items.iter().all(Value::is_string) => items.len(),
                    _ => 1,
                };
                (text_chars(input), inputs.max(1))
            }
        };
        let max_tokens = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| obj.get(*k).and_then(Value::as_u64))
            .map(clamp_tokens);
        let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let include_usage = obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(ModelRequest {
            model,
            // Saturate rather than clamp: usage must report what was sent, up to u32.
            prompt_tokens: u32::try_from(chars.div_ceil(4).max(1)).unwrap_or(u32::MAX),
            max_tokens,
            stream: stream && endpoint != Endpoint::Embeddings,
            include_usage,
            inputs,
        })
    }
}

/// Clamps a count to [`MAX_OUTPUT_TOKENS`] and `u32`.
pub(crate) fn clamp_tokens(n: u64) -> u32 {
    n.min(u64::from(MAX_OUTPUT_TOKENS)) as u32
}

/// Characters of text in a content value: a string, an array of strings or content parts
/// (`{"type":"text","text":..}`), or an array of token ids (counted as 4 chars each).
fn text_chars(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.chars().count() as u64,
        Value::Number(_) => 4,
        Value::Array(items) => items.iter().map(text_chars).sum(),
        Value::Object(part) => part.get("text").map_or(0, text_chars),
        _ => 0,
    }
}

/// The generated completion text: one `"tok "` per output token.
pub(crate) fn completion_text(tokens: u32) -> String {
    "tok ".repeat(tokens as usize)
}

/// Seconds since the epoch, for the `created` field.
fn created() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The usage object.
pub(crate) fn usage(prompt: u32, completion: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": u64::from(prompt) + u64::from(completion),
    })
}

/// A complete non-streaming chat or text completion.
pub(crate) fn completion(endpoint: Endpoint, id: &str, req: &ModelRequest, tokens: u32) -> Value {
    let text = completion_text(tokens);
    let (object, choice) = match endpoint {
        Endpoint::Text => (
            "text_completion",
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}),
        ),
        _ => (
            "chat.completion",
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }),
        ),
    };
    json!({
        "id": id,
        "object": object,
        "created": created(),
        "model": req.model,
        "choices": [choice],
        "usage": usage(req.prompt_tokens, tokens),
    })
}

/// An embeddings response with one small deterministic vector per input.
pub(crate) fn embeddings(req: &ModelRequest) -> Value {
    let data: Vec<Value> = (0..req.inputs)
        .map(|i| {
            let v: Vec<f64> = (0..EMBEDDING_DIM)
                .map(|d| (((i + 1) * (d + 3)) % 17) as f64 / 17.0 - 0.5)
                .collect();
            json!({"object": "embedding", "index": i, "embedding": v})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens},
    })
}

/// One streamed chunk. `token` is the content of this chunk, `finish` the final reason, and
/// `first` adds the assistant role the way OpenAI does on the first chat delta.
pub(crate) fn chunk(
    endpoint: Endpoint,
    id: &str,
    model: &str,
    token: Option<&str>,
    first: bool,
    finish: Option<&str>,
) -> Value {
    let choice = match endpoint {
        Endpoint::Text => json!({
            "index": 0,
            "text": token.unwrap_or(""),
            "logprobs": null,
            "finish_reason": finish,
        }),
        _ => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(t) = token {
                delta.insert("content".into(), t.into());
            }
            json!({"index": 0, "delta": delta, "finish_reason": finish})
        }
    };
    json!({
        "id": id,
        "object": chunk_object(endpoint),
        "created": created(),
        "model": model,
        "choices": [choice],
    })
}

/// The trailing usage chunk sent when `stream_options.include_usage` is set.
pub(crate) fn usage_chunk(
    endpoint: Endpoint,
    id: &str,
    model: &str,
    prompt: u32,
    completion: u32,
) -> Value {
    json!({
        "id": id,
        "object": chunk_object(endpoint),
        "created": created(),
        "model": model,
        "choices": [],
        "usage": usage(prompt, completion),
    })
}

fn chunk_object(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Text => "text_completion",
        _ => "chat.completion.chunk",
    }
}

/// An OpenAI error body: `{"error":{"message","type","param":null,"code"}}`.
pub(crate) fn error_body(message: &str, kind: &str, code: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_prompt_tokens_from_every_shape() -> Result<(), BodyError> {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"abcdefghi"},
            {"role":"user","content":[{"type":"text","text":"abc"}]}],"max_tokens":7}"#;
        let r = ModelRequest::parse(Endpoint::Chat, chat)?;
        assert_eq!((r.model.as_str(), r.prompt_tokens), ("m", 3));
        assert_eq!(r.max_tokens, Some(7));
        let r = ModelRequest::parse(Endpoint::Text, br#"{"prompt":"abcd"}"#)?;
        assert_eq!(
            (r.model.as_str(), r.prompt_tokens, r.max_tokens),
            ("stub", 1, None)
        );
        let r = ModelRequest::parse(Endpoint::Embeddings, br#"{"input":["abcdefgh","x"]}"#)?;
        assert_eq!((r.prompt_tokens, r.inputs), (3, 2));
        let r = ModelRequest::parse(Endpoint::Chat, br#"{"messages":[]}"#)?;
        assert_eq!(r.prompt_tokens, 1, "at least one prompt token");
        Ok(())
    }

    #[test]
    fn prefers_max_completion_tokens_and_clamps() -> Result<(), BodyError> {
        let r = ModelRequest::parse(
            Endpoint::Chat,
            br#"{"max_completion_tokens":3,"max_tokens":9,"stream":true,
                "stream_options":{"include_usage":true}}"#,
        )?;
        assert_eq!(r.max_tokens, Some(3));
        assert!(r.stream && r.include_usage);
        let r = ModelRequest::parse(Endpoint::Chat, br#"{"max_tokens":99999999999999}"#)?;
        assert_eq!(r.max_tokens, Some(MAX_OUTPUT_TOKENS));
        Ok(())
    }

    #[test]
    fn refuses_bad_bodies() {
        assert!(matches!(
            ModelRequest::parse(Endpoint::Chat, b"{nope"),
            Err(BodyError::Json(_))
        ));
        assert_eq!(
            ModelRequest::parse(Endpoint::Chat, b"[1,2]"),
            Err(BodyError::NotObject)
        );
    }
}
