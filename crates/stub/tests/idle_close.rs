//! The stub closing idle keep-alive connections (`ConnConfig::idle_close`), over a raw TCP
//! connection so the test sees exactly what a client does: requests before the limit reuse
//! the connection, one sent after the limit but before the close is never read and the
//! connection ends under it, and an idle connection ends by itself.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use slackgate_stub::{ConnConfig, LatencySpec, Stub, StubConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(5);

async fn stub(idle_close: Option<Duration>) -> Stub {
    let cfg = StubConfig {
        latency: LatencySpec::Fixed(Duration::from_millis(1)),
        ..StubConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Stub::spawn_with(listener, cfg, ConnConfig { idle_close }).unwrap()
}

fn request() -> Vec<u8> {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: stub\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Send a request on `conn` and read its response: `Some(status line)`, or `None` when the
/// connection ended (closed or reset) before a response.
async fn exchange(conn: &mut TcpStream) -> Option<String> {
    conn.write_all(&request()).await.ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = timeout(WAIT, conn.read(&mut chunk)).await.unwrap().ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        let Some(head_end) = text.find("\r\n\r\n") else {
            continue;
        };
        let len: usize = text[..head_end]
            .to_ascii_lowercase()
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if buf.len() >= head_end + 4 + len {
            return text.lines().next().map(str::to_string);
        }
    }
}

#[tokio::test]
async fn a_request_arriving_as_an_idle_connection_closes_is_never_read() {
    let s = stub(Some(Duration::from_millis(100))).await;
    let mut conn = TcpStream::connect(s.local_addr()).await.unwrap();
    assert_eq!(
        exchange(&mut conn).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // Before the limit: the same connection serves the next request.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        exchange(&mut conn).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // Past the limit (100 ms) but before the close (125 ms): not read, the connection ends.
    tokio::time::sleep(Duration::from_millis(110)).await;
    assert_eq!(exchange(&mut conn).await, None);
    assert_eq!(s.stats().requests, 2, "the late request must not be read");
}

#[tokio::test]
async fn an_idle_connection_is_closed_by_the_stub() {
    let s = stub(Some(Duration::from_millis(50))).await;
    let mut conn = TcpStream::connect(s.local_addr()).await.unwrap();
    assert_eq!(
        exchange(&mut conn).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    let started = tokio::time::Instant::now();
    let mut byte = [0u8; 1];
    let n = timeout(WAIT, conn.read(&mut byte))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "the stub closes the connection");
    let waited = started.elapsed();
    // Closed at 50 ms + a quarter of it, give or take timer granularity.
    assert!(
        waited >= Duration::from_millis(55) && waited < Duration::from_millis(1000),
        "{waited:?}"
    );
}

#[tokio::test]
async fn without_idle_close_a_connection_stays_open() {
    let s = stub(None).await;
    let mut conn = TcpStream::connect(s.local_addr()).await.unwrap();
    assert_eq!(
        exchange(&mut conn).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // Idle six times the limit the other tests use: the time is the test.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        exchange(&mut conn).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    assert_eq!(s.stats().requests, 2);
}

#[tokio::test]
async fn requests_slower_than_the_idle_limit_are_not_cut() {
    // The limit counts only between requests: a 200 ms answer and a stream with 80 ms between
    // tokens both finish on a connection closed after 50 ms idle.
    let s = stub(Some(Duration::from_millis(50))).await;
    let addr = s.local_addr();
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let slow = [("x-stub-latency", "fixed:200ms")];
    let (status, _) = timeout(
        WAIT,
        common::call(addr, "POST", "/v1/chat/completions", &slow, body),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(status, http::StatusCode::OK);
    let stream =
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}"#;
    let gaps = [("x-stub-latency", "tokens:prefill_us=80000,decode_us=80000")];
    let open = common::open(addr, "POST", "/v1/chat/completions", &gaps, stream)
        .await
        .unwrap();
    let frames = timeout(WAIT, common::frames(open.resp))
        .await
        .unwrap()
        .unwrap();
    let text: String = frames.into_iter().map(|(_, f)| f).collect();
    assert!(text.contains("[DONE]"), "{text}");
    assert_eq!(s.stats().served, 2);
}
