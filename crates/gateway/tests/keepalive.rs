//! Upstream keep-alive connections that the server closes: over real sockets, a request that
//! meets a stale pooled connection is sent once more on a fresh one and never fails, while a
//! request the server may have worked on (a response begun, or a failure long after the
//! request went out) is never sent twice.
//!
//! Two upstreams: the stub closing idle connections like llama.cpp's server or uvicorn
//! (`ConnConfig::idle_close`), and a raw TCP server that misbehaves on cue at the byte level.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{chat, metric, post, TestGate};
use http::StatusCode;
use http_body_util::BodyExt;
use slackgate_stub::{ConnConfig, LatencySpec, Stub, StubConfig};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(5);

/// One pool of one slot (requests go one at a time, so one upstream connection is reused)
/// with the gate's idle timeout above the upstream's, so the gate keeps connections the
/// server closes.
fn config(idle_timeout_ms: u64) -> String {
    common::two_class_config(
        1,
        5.0,
        0.0,
        1.0,
        false,
        &format!("upstream_idle_timeout_ms = {idle_timeout_ms}"),
    )
}

/// Sum of `slackgate_upstream_retries_total` over its labels.
fn retries(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("slackgate_upstream_retries_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn idle_closing_stub(idle_close: Duration) -> Stub {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Stub::spawn_with(
        listener,
        StubConfig {
            slots: 4,
            latency: LatencySpec::Fixed(Duration::from_millis(2)),
            default_output_tokens: 4,
            seed: 1,
        },
        ConnConfig {
            idle_close: Some(idle_close),
        },
    )
    .unwrap()
}

#[tokio::test]
async fn requests_around_the_upstream_idle_close_never_fail() {
    // The stub closes connections idle 100 ms (and resets one a request arrives on between
    // 100 and 125 ms); the gate would keep them a second.
    let s = idle_closing_stub(Duration::from_millis(100)).await;
    let g = TestGate::start(&config(1000), s.local_addr(), "keepalive").await;
    let url = g.url("/v1/chat/completions");
    // Pauses before, at and after the close, twice over; on a machine so slow that no
    // request landed in the race window, a few more rounds (at most 5 in all).
    let pauses_ms = [40u64, 80, 95, 100, 105, 110, 115, 120, 130, 150, 250];
    let mut sent: u32 = 0;
    for round in 0..5 {
        if round >= 2 && retries(&g.metrics().await) >= 1.0 {
            break;
        }
        for (i, pause) in pauses_ms.iter().enumerate() {
            tokio::time::sleep(Duration::from_millis(*pause)).await;
            let id = format!("ka-{round}-{i}");
            let r = timeout(
                WAIT,
                post(&url, &[("x-stub-request-id", id.as_str())], &chat(4)),
            )
            .await
            .expect("request timed out");
            assert_eq!(
                r.status,
                StatusCode::OK,
                "after a {pause} ms pause: {:?}",
                r.body
            );
            assert!(r.json()["choices"][0].is_object(), "{:?}", r.body);
            sent += 1;
        }
    }
    // The race really happened, so the test did not pass by luck of timing...
    let m = g.metrics().await;
    let retried = retries(&m);
    assert!(retried >= 1.0, "no stale connection was hit:\n{m}");
    assert!(retried <= f64::from(sent), "{m}");
    // ...and the stub read each request exactly once: the retried ones never reached it.
    let records = s.requests();
    assert_eq!(records.len(), sent as usize, "{records:?}");
    let mut ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), sent as usize, "a request reached the stub twice");
    assert_eq!(s.stats().requests, u64::from(sent));
    // One job per request: the retry is inside the job, not a second decision or completion.
    let lines = g.log_lines().await;
    let count = |action: &str| lines.iter().filter(|l| l["action"] == action).count();
    assert_eq!(count("admit"), sent as usize);
    assert_eq!(count("complete"), sent as usize);
    assert!(lines
        .iter()
        .filter(|l| l["action"] == "complete")
        .all(|l| l["status"] == 200 && l["reason"] != "upstream_error"));
}

#[tokio::test]
async fn a_reset_after_the_response_head_is_not_sent_again() {
    // The stub's `reset` fault on a stream: headers and a few chunks, then the connection is
    // cut. The request was worked on, so it must not be sent a second time.
    let s = idle_closing_stub(Duration::from_secs(10)).await;
    let g = TestGate::start(&config(5000), s.local_addr(), "keepalive-reset").await;
    let url = g.url("/v1/chat/completions");
    // A first request leaves a pooled connection for the faulty one to reuse.
    let warm = post(&url, &[("x-stub-request-id", "warm")], &chat(4)).await;
    assert_eq!(warm.status, StatusCode::OK);
    let body = r#"{"model":"stub","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true}"#;
    let req = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("x-stub-fault", "reset")
        .header("x-stub-request-id", "cut")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let resp = timeout(WAIT, client.request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let broke = timeout(WAIT, resp.into_body().collect())
        .await
        .unwrap()
        .is_err();
    assert!(broke, "the client must see the stream break");

    let m = g.metrics().await;
    assert_eq!(retries(&m), 0.0, "{m}");
    let ids: Vec<String> = s.requests().into_iter().map(|r| r.id).collect();
    assert_eq!(ids.iter().filter(|id| *id == "cut").count(), 1, "{ids:?}");
    assert_eq!(s.stats().requests, 2);
}

/// What the raw upstream does to the request numbered `on` on each connection (from 1); every
/// other request is answered normally, keeping the connection alive.
#[derive(Clone, Copy, Debug)]
struct Misbehave {
    on: u64,
    how: How,
    /// How long a normal answer takes.
    answer_after: Duration,
}

#[derive(Clone, Copy, Debug)]
enum How {
    /// Close the connection as the request arrives, without reading it: a keep-alive closed
    /// under a request the server never saw.
    CloseUnread,
    /// Read it, send the start of a status line, and close.
    PartialHead,
    /// Read it, work on it for a while, and close without a byte.
    CloseAfter(Duration),
}

/// A raw HTTP/1.1 upstream that misbehaves on cue.
struct RawUpstream {
    addr: SocketAddr,
    /// Requests read in full.
    read: Arc<AtomicU64>,
    /// Connections accepted.
    accepted: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawUpstream {
    async fn start(plan: Misbehave) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (read, accepted) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (counter, conns_seen) = (read.clone(), accepted.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                conns_seen.fetch_add(1, Ordering::SeqCst);
                conns.spawn(serve_raw(stream, plan, counter.clone()));
            }
        });
        RawUpstream {
            addr,
            read,
            accepted,
            task,
        }
    }
}

/// Read one request (head and `content-length` body); `None` when the connection ends first.
async fn read_request(stream: &mut TcpStream) -> Option<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(())
}

async fn serve_raw(mut stream: TcpStream, plan: Misbehave, read: Arc<AtomicU64>) {
    let body = r#"{"id":"raw","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}"#;
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    for n in 1.. {
        let cue = n == plan.on;
        if cue && matches!(plan.how, How::CloseUnread) {
            // Wait for the request's bytes, then close with them unread: a reset.
            let _ = stream.readable().await;
            return;
        }
        if read_request(&mut stream).await.is_none() {
            return;
        }
        read.fetch_add(1, Ordering::SeqCst);
        match plan.how {
            How::PartialHead if cue => {
                let _ = stream.write_all(b"HTTP/1.1 200 O").await;
                let _ = stream.flush().await;
                return;
            }
            How::CloseAfter(d) if cue => {
                tokio::time::sleep(d).await;
                return;
            }
            _ => {
                tokio::time::sleep(plan.answer_after).await;
                if stream.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Two requests in a row through a gate in front of `up` keeping idle connections
/// `idle_timeout_ms`: the second reuses the first's connection if it may. Returns the second response's status and error code.
async fn two_in_a_row(
    up: &RawUpstream,
    name: &str,
    idle_timeout_ms: u64,
) -> (TestGate, StatusCode, String) {
    let g = TestGate::start(&config(idle_timeout_ms), up.addr, name).await;
    let url = g.url("/v1/chat/completions");
    let first = post(&url, &[], &chat(4)).await;
    assert_eq!(first.status, StatusCode::OK, "{:?}", first.body);
    // Let the gate put the connection back in its pool before the next request. hyper does
    // that from a task of its own once the response has ended, and nothing outside shows the
    // moment; on this single-threaded runtime that task, already runnable, is polled before
    // the sleeping test is, however slow the machine.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = timeout(Duration::from_secs(10), post(&url, &[], &chat(4)))
        .await
        .unwrap();
    let code = second.json()["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (g, second.status, code)
}

#[tokio::test]
async fn a_reused_connection_closed_under_a_request_is_retried_once_on_a_fresh_one() {
    let up = RawUpstream::start(Misbehave {
        on: 2,
        how: How::CloseUnread,
        answer_after: Duration::ZERO,
    })
    .await;
    let (g, status, code) = two_in_a_row(&up, "raw-close", 5000).await;
    assert_eq!(status, StatusCode::OK, "{code}");
    // Read in full: the first request, then the retry on a new connection (its first).
    assert_eq!(up.read.load(Ordering::SeqCst), 2);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    let m = g.metrics().await;
    assert_eq!(retries(&m), 1.0, "{m}");
    let reset = metric(
        &m,
        r#"slackgate_upstream_retries_total{pool="default",reason="connection_reset"}"#,
    );
    let closed = metric(
        &m,
        r#"slackgate_upstream_retries_total{pool="default",reason="connection_closed"}"#,
    );
    assert_eq!(reset.unwrap_or(0.0) + closed.unwrap_or(0.0), 1.0, "{m}");
}

#[tokio::test]
async fn the_retry_takes_a_new_connection_not_another_stale_one() {
    // Two connections in the pool, both stale after their first request (as after an idle
    // spell): the retry must not pick the other one.
    let up = RawUpstream::start(Misbehave {
        on: 2,
        how: How::CloseUnread,
        answer_after: Duration::from_millis(100),
    })
    .await;
    let cfg = config(5000).replace("slots = 1", "slots = 2");
    let g = TestGate::start(&cfg, up.addr, "raw-two").await;
    let url = g.url("/v1/chat/completions");
    let body = chat(4);
    let (a, b) = tokio::join!(post(&url, &[], &body), post(&url, &[], &body));
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
    assert_eq!(
        up.accepted.load(Ordering::SeqCst),
        2,
        "two pooled connections"
    );
    // Back in the pool first (see `two_in_a_row`).
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = timeout(WAIT, post(&url, &[], &chat(4))).await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(up.accepted.load(Ordering::SeqCst), 3);
    assert_eq!(up.read.load(Ordering::SeqCst), 3);
    assert_eq!(retries(&g.metrics().await), 1.0);
}

#[tokio::test]
async fn a_response_that_had_begun_is_not_retried() {
    let up = RawUpstream::start(Misbehave {
        on: 2,
        how: How::PartialHead,
        answer_after: Duration::ZERO,
    })
    .await;
    let (g, status, code) = two_in_a_row(&up, "raw-partial", 5000).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(code, "upstream_error");
    // No wait needed: a retry would have come before the answer.
    assert_eq!(up.read.load(Ordering::SeqCst), 2, "sent twice");
    assert_eq!(retries(&g.metrics().await), 0.0);
}

#[tokio::test]
async fn a_server_that_worked_on_a_request_before_closing_is_not_retried() {
    // Past the 1 s race window: the server may have done the work; do not do it twice.
    let up = RawUpstream::start(Misbehave {
        on: 2,
        how: How::CloseAfter(Duration::from_millis(1200)),
        answer_after: Duration::ZERO,
    })
    .await;
    let (g, status, code) = two_in_a_row(&up, "raw-late", 5000).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(code, "upstream_error");
    // No wait needed: a retry would have come before the answer.
    assert_eq!(up.read.load(Ordering::SeqCst), 2, "sent twice");
    assert_eq!(retries(&g.metrics().await), 0.0);
}

#[tokio::test]
async fn a_new_connection_closed_under_its_first_request_is_not_retried() {
    // Not a stale keep-alive: a server that drops fresh connections is failing, and the gate
    // answers 502 rather than knock twice.
    let up = RawUpstream::start(Misbehave {
        on: 1,
        how: How::CloseUnread,
        answer_after: Duration::ZERO,
    })
    .await;
    let g = TestGate::start(&config(5000), up.addr, "raw-fresh").await;
    let r = post(&g.url("/v1/chat/completions"), &[], &chat(4)).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "upstream_error");
    // No wait needed: a retry would have come before the answer.
    assert_eq!(up.accepted.load(Ordering::SeqCst), 1, "connected again");
    assert_eq!(up.read.load(Ordering::SeqCst), 0);
    assert_eq!(retries(&g.metrics().await), 0.0);
}

#[tokio::test]
async fn an_idle_timeout_of_zero_keeps_no_connection() {
    // Every request on a new connection: the server's second-request misbehaviour is never met.
    let up = RawUpstream::start(Misbehave {
        on: 2,
        how: How::CloseUnread,
        answer_after: Duration::ZERO,
    })
    .await;
    let (g, status, code) = two_in_a_row(&up, "raw-no-pool", 0).await;
    assert_eq!(status, StatusCode::OK, "{code}");
    assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(retries(&g.metrics().await), 0.0);
}
