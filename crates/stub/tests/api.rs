//! The stub's OpenAI surface over real sockets: response shapes, usage counts, streaming, and
//! the errors it gives for bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{call, call_json, chat, events, frames, open, start, TestResult};
use http::StatusCode;
use slackgate_stub::{LatencySpec, StubConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHAT: &str = "/v1/chat/completions";

fn quick() -> StubConfig {
    StubConfig {
        latency: LatencySpec::Fixed(Duration::from_millis(5)),
        ..StubConfig::default()
    }
}

#[tokio::test]
async fn chat_completion_reports_usage() -> TestResult {
    let stub = start(quick()).await?;
    let addr = stub.local_addr();
    // 41 chars -> ceil(41/4) = 11 prompt tokens.
    let (status, v) = call_json(addr, "POST", CHAT, &[], &chat(41, r#""max_tokens":7"#)).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "m1");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "tok ".repeat(7));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 11);
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["total_tokens"], 18);

    // The header beats max_tokens; without either, the configured default applies.
    let hdr = [("x-stub-output-tokens", "2")];
    let (_, v) = call_json(addr, "POST", CHAT, &hdr, &chat(4, r#""max_tokens":50"#)).await?;
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let (_, v) = call_json(addr, "POST", CHAT, &[], &chat(4, "")).await?;
    assert_eq!(v["usage"]["completion_tokens"], 16);

    let s = stub.stats();
    assert_eq!(
        (s.served, s.requests, s.in_flight, s.cancelled),
        (3, 3, 0, 0)
    );
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn text_completion_and_embeddings() -> TestResult {
    let stub = start(quick()).await?;
    let addr = stub.local_addr();
    let body = r#"{"prompt":"abcdefgh","max_completion_tokens":3}"#;
    let (status, v) = call_json(addr, "POST", "/v1/completions", &[], body).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "stub");
    assert_eq!(v["choices"][0]["text"], "tok tok tok ");
    assert_eq!(v["usage"]["prompt_tokens"], 2);

    let body = r#"{"model":"e","input":["abcd","efghijkl"]}"#;
    let (status, v) = call_json(addr, "POST", "/v1/embeddings", &[], body).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["data"][1]["embedding"].as_array().map(Vec::len), Some(8));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], 3);
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn stream_sends_each_token_as_it_is_produced() -> TestResult {
    let stub = start(StubConfig::default()).await?;
    let addr = stub.local_addr();
    // 40 chars = 10 prompt tokens -> 10 ms prefill; then a token every 20 ms.
    let hdr = [("x-stub-latency", "tokens:prefill_us=1000,decode_us=20000")];
    let body = chat(
        40,
        r#""max_tokens":10,"stream":true,"stream_options":{"include_usage":true}"#,
    );
    let o = open(addr, "POST", CHAT, &hdr, &body).await?;
    assert_eq!(o.resp.status(), StatusCode::OK);
    assert_eq!(o.resp.headers()["content-type"], "text/event-stream");
    let frames = frames(o.resp).await?;

    let token_frames: Vec<_> = frames.iter().filter(|(_, f)| f.contains("tok ")).collect();
    assert_eq!(token_frames.len(), 10, "one frame per token: {frames:?}");
    assert!(token_frames
        .iter()
        .all(|(_, f)| f.matches("data: ").count() == 1));
    let spread = token_frames[9].0 - token_frames[0].0;
    assert!(
        spread >= Duration::from_millis(150) && spread < Duration::from_millis(450),
        "9 decode steps of 20 ms took {spread:?}"
    );

    let text: String = frames.iter().map(|(_, f)| f.as_str()).collect();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let ev = events(&text);
    assert_eq!(ev.len(), 12, "10 tokens, finish, usage");
    assert_eq!(ev[0]["object"], "chat.completion.chunk");
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(ev[1]["choices"][0]["delta"].get("role"), None);
    assert_eq!(ev[10]["choices"][0]["finish_reason"], "length");
    assert_eq!(ev[11]["choices"].as_array().map(Vec::len), Some(0));
    assert_eq!(ev[11]["usage"]["prompt_tokens"], 10);
    assert_eq!(ev[11]["usage"]["completion_tokens"], 10);

    let s = common::wait_for(&stub, Duration::from_secs(1), |s| s.served == 1).await?;
    assert_eq!((s.in_flight, s.cancelled), (0, 0));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn stream_without_usage_and_text_chunks() -> TestResult {
    let stub = start(quick()).await?;
    let body = r#"{"prompt":"hi","max_tokens":2,"stream":true}"#;
    let (status, bytes) = call(stub.local_addr(), "POST", "/v1/completions", &[], body).await?;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(bytes.to_vec())?;
    let ev = events(&text);
    assert_eq!(ev.len(), 3, "2 tokens and the finish chunk: {text}");
    assert_eq!(ev[0]["object"], "text_completion");
    assert_eq!(ev[0]["choices"][0]["text"], "tok ");
    assert!(ev.iter().all(|e| e.get("usage").is_none()));
    assert!(text.ends_with("data: [DONE]\n\n"));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn bad_input_gets_openai_errors() -> TestResult {
    let stub = start(quick()).await?;
    let addr = stub.local_addr();

    let (status, v) = call_json(addr, "POST", CHAT, &[], "{not json").await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "invalid_json");
    assert_eq!(v["error"]["param"], serde_json::Value::Null);

    let (status, v) = call_json(addr, "GET", "/v2/nothing", &[], "").await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "not_found");

    let (status, _) = call_json(addr, "GET", CHAT, &[], "").await?;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    for (name, value) in [
        ("x-stub-latency", "fixed:12"),
        ("x-stub-output-tokens", "-1"),
        ("x-stub-fault", "explode"),
    ] {
        let (status, v) = call_json(addr, "POST", CHAT, &[(name, value)], &chat(4, "")).await?;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}: {value}");
        assert_eq!(v["error"]["code"], "invalid_header");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains(name));
    }
    // None of the refused requests took a slot.
    let s = stub.stats();
    assert_eq!((s.served, s.cancelled, s.max_in_flight_seen), (0, 0, 0));
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn oversized_bodies_get_413() -> TestResult {
    let stub = start(quick()).await?;
    let addr = stub.local_addr();

    // Declared length over the limit: refused before any body byte is read.
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        9 * 1024 * 1024
    );
    tcp.write_all(head.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("body_too_large"), "{text}");

    // Chunked body (no declared length) that grows past the limit while being read.
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut rd, mut wr) = tcp.into_split();
    let writer = tokio::spawn(async move {
        let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
        wr.write_all(head.as_bytes()).await?;
        let chunk = format!("{:x}\r\n{}\r\n", 1024 * 1024, "x".repeat(1024 * 1024));
        for _ in 0..9 {
            wr.write_all(chunk.as_bytes()).await?;
        }
        wr.write_all(b"0\r\n\r\n").await
    });
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), rd.read(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    // The server stops reading; our remaining writes may fail, which is fine.
    writer.abort();
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn info_endpoints() -> TestResult {
    let stub = start(quick()).await?;
    let addr = stub.local_addr();
    let (status, body) = call(addr, "GET", "/health", &[], "").await?;
    assert_eq!((status, body.as_ref()), (StatusCode::OK, b"ok".as_ref()));
    let (_, v) = call_json(addr, "GET", "/v1/models", &[], "").await?;
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "stub");
    assert_eq!(v["data"][0]["object"], "model");
    call(addr, "POST", CHAT, &[], &chat(4, "")).await?;
    let (_, v) = call_json(addr, "GET", "/stub/stats", &[], "").await?;
    assert_eq!(v["served"], 1);
    assert_eq!(v["requests"], 1);
    for key in [
        "in_flight",
        "queued",
        "cancelled",
        "max_in_flight_seen",
        "occupied",
    ] {
        assert!(v.get(key).is_some(), "{key} missing from {v}");
    }
    stub.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn run_until_stops_on_signal() -> TestResult {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(slackgate_stub::run_until(listener, quick(), async {
        let _ = rx.await;
    }));
    let (status, _) = call(addr, "GET", "/health", &[], "").await?;
    assert_eq!(status, StatusCode::OK);
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(2), server).await???;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    Ok(())
}

#[tokio::test]
async fn refuses_unservable_slot_counts() -> TestResult {
    for slots in [0, usize::MAX] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let cfg = StubConfig {
            slots,
            ..StubConfig::default()
        };
        let err = slackgate_stub::Stub::spawn(listener, cfg).err();
        assert_eq!(
            err.map(|e| e.kind()),
            Some(std::io::ErrorKind::InvalidInput)
        );
    }
    Ok(())
}

#[test]
fn spawn_outside_a_runtime_is_an_error_not_a_panic() -> TestResult {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Converting needs a runtime; spawning afterwards, outside it, must not panic.
    let listener = rt.block_on(async { tokio::net::TcpListener::from_std(std_listener) })?;
    assert!(slackgate_stub::Stub::spawn(listener, quick()).is_err());
    Ok(())
}

#[tokio::test]
async fn absurd_latency_is_a_long_wait_not_a_crash() -> TestResult {
    let stub = start(quick()).await?;
    let addr = stub.local_addr();
    let hdr = [(
        "x-stub-latency",
        "tokens:prefill_us=86400000000,decode_us=1",
    )];
    let body = chat(100_000, r#""max_tokens":99999999999,"stream":true"#);
    let pending = tokio::time::timeout(
        Duration::from_millis(200),
        call(addr, "POST", CHAT, &hdr, &body),
    )
    .await;
    assert!(pending.is_err(), "should still be waiting");
    common::wait_for(&stub, Duration::from_secs(1), |s| s.in_flight == 0).await?;
    let (status, _) = call(addr, "GET", "/health", &[], "").await?;
    assert_eq!(status, StatusCode::OK);
    stub.shutdown().await;
    Ok(())
}
