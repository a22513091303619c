//! Integration tests of the gate's defences against clients and upstreams that misbehave at
//! the transport level, over real sockets on 127.0.0.1:0: a client that stops reading, a slow
//! or abandoned upload, shutdown with requests in flight, hop-by-hop headers, the routes that
//! are admission-controlled, and the ordering and accounting of the decision log.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::{
    chat, eventually, get, job_id, post, read_log, stub, temp_log, two_class_config, wait_until,
    TestGate,
};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use slackgate_gateway::config::LogTarget;
use slackgate_gateway::{Config, DecisionLog, Gateway};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

/// One pool of `slots` in front of `{UPSTREAM}` with fixed priors (5 ms overhead, `prefill_ms`
/// per prompt token, `decode_ms` per output token, no learning), an `interactive` default
/// class with a 30 s deadline and a best-effort `batch` class; `server` is extra `[server]`
/// settings.
fn config(slots: u32, prefill_ms: f64, decode_ms: f64, server: &str) -> String {
    two_class_config(slots, 5.0, prefill_ms, decode_ms, false, server)
}

/// Field `name` of the first pool in `/stats`.
async fn pool_stat(g: &TestGate, name: &str) -> u64 {
    g.stats().await["gate"]["pools"][0][name]
        .as_u64()
        .unwrap_or(u64::MAX)
}

/// Wait for a log line matching `pred`.
async fn wait_for(g: &TestGate, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let lines = g.log_lines().await;
        if let Some(l) = lines.iter().find(|l| pred(l)) {
            return l.clone();
        }
        if start.elapsed() > WAIT {
            panic!("no {what} line in {lines:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `stream: true` chat body asking for `max_tokens`.
fn chat_stream(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"stub","stream":true,"messages":[{{"role":"user","content":"hello"}}],"max_tokens":{max_tokens}}}"#
    )
}

/// The request head of a raw HTTP/1.1 POST with a declared body length.
fn raw_head(path: &str, extra: &str, content_length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: gate\r\ncontent-type: application/json\r\n\
         content-length: {content_length}\r\n{extra}\r\n"
    )
}

/// Read a raw HTTP response until the peer closes (or `WAIT` passes).
async fn read_all(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = timeout(WAIT, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

// 1 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn client_that_stops_reading_is_disconnected_and_its_slot_freed() {
    // A fast upstream streams ~65k tokens (megabytes of SSE); the client reads none of them.
    let s = stub(4, "tokens:prefill_us=0,decode_us=10").await;
    let cfg = config(2, 0.0, 0.0, "client_write_timeout_ms = 500");
    let g = TestGate::start(&cfg, s.local_addr(), "stall").await;

    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    // A small receive buffer so the stall starts early (the kernel may round it up).
    sock.set_recv_buffer_size(4096).unwrap();
    let mut client = sock.connect(g.addr).await.unwrap();
    let body = chat_stream(65_536);
    let head = raw_head("/v1/chat/completions", "x-job-class: batch\r\n", body.len());
    client.write_all(head.as_bytes()).await.unwrap();
    client.write_all(body.as_bytes()).await.unwrap();

    assert!(
        eventually(WAIT, || async { pool_stat(&g, "in_flight").await == 1 }).await,
        "never dispatched"
    );
    // The client keeps its socket open and never reads: the gate must notice the stalled
    // writes and let the slot go, long before the stream could have ended.
    let freed = eventually(WAIT, || async { pool_stat(&g, "in_flight").await == 0 }).await;
    assert!(freed, "slot pinned by a client that stopped reading");
    let cancel = wait_for(&g, "cancel", |l| l["action"] == "cancel").await;
    assert_eq!(cancel["reason"], "client_cancelled");
    assert!(
        !g.log_lines()
            .await
            .iter()
            .any(|l| l["action"] == "complete"),
        "the whole stream fit in socket buffers: the test proves nothing"
    );
    drop(client);
}

// 2 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn shutdown_lets_a_stream_in_flight_finish_and_logs_it() {
    // 10 tokens at 100 ms: a one-second stream.
    let s = stub(4, "tokens:prefill_us=0,decode_us=100000").await;
    let text =
        config(2, 0.0, 100.0, "").replace("{UPSTREAM}", &format!("http://{}", s.local_addr()));
    let cfg = Config::from_toml(&text).unwrap();
    let log_path = temp_log("shutdown");
    let log = DecisionLog::start(LogTarget::File(log_path.clone()), 1024).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gate = Gateway::spawn(listener, &cfg, log).unwrap();
    let addr = gate.local_addr();

    let url = format!("http://{addr}/v1/chat/completions");
    let client = tokio::spawn(async move {
        let req = Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(chat_stream(10))))
            .unwrap();
        let c = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
        let resp = c.request(req).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    });
    // Shut down with the stream in flight (about a second of it left).
    let stats = format!("http://{addr}/stats");
    wait_until(WAIT, "the stream in flight", || async {
        let s: Value = serde_json::from_slice(&get(&stats).await.body).unwrap_or(Value::Null);
        s["gate"]["pools"][0]["in_flight"] == 1
    })
    .await;
    let started = Instant::now();
    timeout(WAIT, gate.shutdown()).await.expect("shutdown hung");
    let waited = started.elapsed();

    let text = timeout(WAIT, client).await.unwrap().unwrap();
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "cut short: {text}"
    );
    assert_eq!(text.matches("\"content\":\"tok \"").count(), 10);
    assert!(
        waited >= Duration::from_millis(500),
        "shutdown returned after {waited:?}, before the stream ended"
    );
    let lines = read_log(&log_path);
    let _ = std::fs::remove_file(&log_path);
    let complete = lines.iter().find(|l| l["action"] == "complete");
    let complete = complete.unwrap_or_else(|| panic!("no complete line: {lines:#?}"));
    assert_eq!(complete["reason"], "completed");
    // The gate asked the upstream for the stream's usage: 2 prompt + 10 completion tokens.
    assert_eq!(complete["tokens_spent"], 12);
    // The listener is closed: new connections are refused.
    assert!(TcpStream::connect(addr).await.is_err(), "still accepting");
}

// 3 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_slow_upload_spends_the_deadline_budget() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(2, 0.0, 1.0, ""), s.local_addr(), "slowup").await;
    let body = chat(4);
    let (a, b) = body.as_bytes().split_at(10);
    let mut c = TcpStream::connect(g.addr).await.unwrap();
    let extra = "x-deadline-ms: 5000\r\nconnection: close\r\n";
    c.write_all(raw_head("/v1/chat/completions", extra, body.len()).as_bytes())
        .await
        .unwrap();
    c.write_all(a).await.unwrap();
    // The request arrives when the gate has read its headers; from then on, a slow upload
    // (the time is the test).
    let conns = &g.gate.shared().conns;
    wait_until(WAIT, "the headers read", || async { conns.busy() == 1 }).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    c.write_all(b).await.unwrap();
    let resp = read_all(&mut c).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let admit = wait_for(&g, "admit", |l| l["action"] == "admit").await;
    let slack = admit["deadline_slack_ms"].as_i64().unwrap();
    // 5000 ms from arrival, 1200 of them spent uploading.
    assert!(slack <= 3800, "upload time not counted: slack {slack} ms");
    assert!(slack > 3000, "slack {slack} ms");
}

// 4 ------------------------------------------------------------------------------------------

/// What the echo upstream saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    headers: HeaderMap,
    body_len: usize,
}

/// An upstream that answers every request with a small JSON body (with `usage`) and records
/// what it received. Its responses carry a `Connection`-named header, `x-up-hop`.
async fn echo_upstream() -> (SocketAddr, Arc<Mutex<Vec<Seen>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let record = Arc::clone(&record);
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let record = Arc::clone(&record);
                    async move {
                        let (parts, body) = req.into_parts();
                        let body = body
                            .collect()
                            .await
                            .map(|c| c.to_bytes())
                            .unwrap_or_default();
                        record.lock().unwrap().push(Seen {
                            method: parts.method.to_string(),
                            path: parts.uri.path().to_string(),
                            headers: parts.headers,
                            body_len: body.len(),
                        });
                        let json = r#"{"object":"echo","usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
                        let resp = Response::builder()
                            .header("content-type", "application/json")
                            .header("connection", "x-up-hop")
                            .header("x-up-hop", "1")
                            .header("x-up-keep", "1")
                            .body(Full::new(Bytes::from(json)))
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn every_post_under_v1_is_admission_controlled() {
    let (up, seen) = echo_upstream().await;
    // Output tokens are expensive (1 s each), prompt tokens 1 ms: est_service_ms tells
    // whether the gate counted output for a request.
    let g = TestGate::start(&config(2, 1.0, 1000.0, ""), up, "routes").await;
    let batch = [("x-job-class", "batch")];

    // A trailing slash is the same endpoint: admitted, and still strict about JSON.
    let r = post(&g.url("/v1/chat/completions/"), &batch, &chat(1)).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.header("x-slackgate-job-id").is_some(), "not admitted");
    let r = post(&g.url("/v1/chat/completions/"), &batch, "not json").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["code"], "invalid_json");

    // Embeddings generate nothing: no output time in the estimate.
    let r = post(
        &g.url("/v1/embeddings"),
        &batch,
        r#"{"model":"m","input":"12345678"}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let job: u64 = r.header("x-slackgate-job-id").unwrap().parse().unwrap();
    let admit = wait_for(&g, "embeddings admit", |l| {
        l["job_id"] == job && l["action"] == "admit"
    })
    .await;
    let est = admit["est_service_ms"].as_u64().unwrap();
    assert!(
        est < 1000,
        "embedding estimated with output tokens: {est} ms"
    );

    // Another endpoint with a multipart body: admitted, prompt estimated from its size.
    let multipart = format!(
        "--b\r\ncontent-disposition: form-data; name=\"file\"\r\n\r\n{}\r\n--b--\r\n",
        "x".repeat(400)
    );
    let req = Request::post(g.url("/v1/audio/transcriptions"))
        .header("content-type", "multipart/form-data; boundary=b")
        .header("x-job-class", "batch")
        .body(Full::new(Bytes::from(multipart.clone())))
        .unwrap();
    let c = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let resp = timeout(WAIT, c.request(req)).await.unwrap().unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let job = job_id(resp.headers());
    let _ = resp.into_body().collect().await;
    let admit = wait_for(&g, "multipart admit", |l| {
        l["job_id"] == job && l["action"] == "admit"
    })
    .await;
    assert_eq!(admit["path"], "/v1/audio/transcriptions");
    assert!(
        admit["tokens_held"].as_u64().unwrap() >= (multipart.len() / 4) as u64,
        "{admit}"
    );
    assert!(admit["est_service_ms"].as_u64().unwrap() >= 100, "{admit}");
    let complete = wait_for(&g, "multipart complete", |l| {
        l["job_id"] == job && l["action"] == "complete"
    })
    .await;
    assert_eq!(complete["tokens_spent"], 5, "usage read from the response");

    // A JSON body on an unknown endpoint is read for its size too.
    let r = post(
        &g.url("/v1/responses"),
        &batch,
        r#"{"model":"m","input":"hi"}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.header("x-slackgate-job-id").is_some());

    // GET under /v1 stays a pass-through.
    let r = get(&g.url("/v1/models")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.header("x-slackgate-job-id").is_none(), "GET was admitted");

    let seen = seen.lock().unwrap().clone();
    let paths: Vec<(&str, &str)> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.path.as_str()))
        .collect();
    assert_eq!(
        paths,
        [
            ("POST", "/v1/chat/completions/"),
            ("POST", "/v1/embeddings"),
            ("POST", "/v1/audio/transcriptions"),
            ("POST", "/v1/responses"),
            ("GET", "/v1/models"),
        ]
    );
    assert_eq!(seen[2].body_len, multipart.len(), "multipart body altered");
    let admits = g
        .log_lines()
        .await
        .iter()
        .filter(|l| l["action"] == "admit")
        .count();
    assert_eq!(admits, 4);
}

// 6, 11 --------------------------------------------------------------------------------------

#[tokio::test]
async fn a_body_that_never_finishes_arriving_gets_408() {
    let (up, seen) = echo_upstream().await;
    let g = TestGate::start(
        &config(2, 0.0, 1.0, "body_read_timeout_ms = 300"),
        up,
        "bodyto",
    )
    .await;
    let mut c = TcpStream::connect(g.addr).await.unwrap();
    c.write_all(raw_head("/v1/chat/completions", "", 100).as_bytes())
        .await
        .unwrap();
    c.write_all(b"{\"model\":").await.unwrap();
    let started = Instant::now();
    let resp = read_all(&mut c).await;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(resp.contains("\"code\":\"body_read_timeout\""), "{resp}");
    assert!(started.elapsed() < Duration::from_secs(3));
    let line = wait_for(&g, "error", |l| l["action"] == "error").await;
    assert_eq!(line["reason"], "body_read_timeout");
    assert_eq!(line["status"], 408);
    assert!(seen.lock().unwrap().is_empty(), "reached the upstream");
}

#[tokio::test]
async fn a_client_gone_mid_upload_is_a_cancel_not_bad_json() {
    let (up, seen) = echo_upstream().await;
    let g = TestGate::start(&config(2, 0.0, 1.0, ""), up, "upgone").await;
    let mut c = TcpStream::connect(g.addr).await.unwrap();
    c.write_all(raw_head("/v1/chat/completions", "", 100).as_bytes())
        .await
        .unwrap();
    c.write_all(b"{\"model\":").await.unwrap();
    // Gone once the gate is reading the body (the request's headers are in).
    let conns = &g.gate.shared().conns;
    wait_until(WAIT, "the request begun", || async { conns.busy() == 1 }).await;
    drop(c);
    let line = wait_for(&g, "cancel", |l| l["action"] == "cancel").await;
    assert_eq!(line["reason"], "client_cancelled");
    assert_eq!(line["path"], "/v1/chat/completions");
    let lines = g.log_lines().await;
    assert!(
        !lines.iter().any(|l| l["reason"] == "invalid_json"),
        "{lines:#?}"
    );
    assert!(seen.lock().unwrap().is_empty(), "reached the upstream");
}

// 7, 13 --------------------------------------------------------------------------------------

#[tokio::test]
async fn hop_by_hop_headers_stop_at_the_gate_and_upstream_bodies_are_uncompressed() {
    let (up, seen) = echo_upstream().await;
    let g = TestGate::start(&config(2, 0.0, 1.0, ""), up, "hops").await;
    let r = post(
        &g.url("/v1/chat/completions"),
        &[
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "secret-for-this-hop"),
            ("x-keep", "1"),
            ("keep-alive", "timeout=5"),
            ("accept-encoding", "gzip, br"),
        ],
        &chat(2),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    // Response direction: the upstream named `x-up-hop` in its Connection header.
    assert!(r.header("x-up-hop").is_none(), "{:?}", r.headers);
    assert_eq!(r.header("x-up-keep").as_deref(), Some("1"));

    let seen = seen.lock().unwrap().clone();
    let h = &seen[0].headers;
    assert!(
        h.get("x-hop").is_none(),
        "Connection-named header forwarded"
    );
    assert!(h.get("keep-alive").is_none());
    assert_eq!(h.get("x-keep").map(|v| v.as_bytes()), Some(&b"1"[..]));
    // A gzip answer would hide `usage` from the gate.
    assert_eq!(
        h.get("accept-encoding").map(|v| v.as_bytes()),
        Some(&b"identity"[..])
    );
}

// 8, 9, 10 -----------------------------------------------------------------------------------

#[tokio::test]
async fn log_lines_carry_the_core_order_and_ttft_is_a_streaming_measure() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=2000").await;
    let g = TestGate::start(&config(1, 0.0, 2.0, ""), s.local_addr(), "seq").await;
    let url = g.url("/v1/chat/completions");
    let mut tasks = Vec::new();
    for i in 0..6 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let body = if i % 2 == 0 { chat(3) } else { chat_stream(3) };
            post(&url, &[], &body).await
        }));
    }
    let bad = post(&url, &[], "{").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    for t in tasks {
        assert_eq!(t.await.unwrap().status, StatusCode::OK);
    }
    assert!(eventually(WAIT, || async { pool_stat(&g, "in_flight").await == 0 }).await);
    let lines = g.log_lines().await;
    // 6 x (admit, dispatch, complete) + 1 error.
    assert_eq!(lines.len(), 19, "{lines:#?}");
    let mut seqs: Vec<u64> = lines.iter().map(|l| l["seq"].as_u64().unwrap()).collect();
    seqs.sort_unstable();
    assert_eq!(
        seqs,
        (1..=19).collect::<Vec<u64>>(),
        "seq not a gapless total order"
    );
    let seq_of = |job: &Value, action: &str| {
        lines
            .iter()
            .find(|l| &l["job_id"] == job && l["action"] == action)
            .map(|l| l["seq"].as_u64().unwrap())
            .unwrap()
    };
    for admit in lines.iter().filter(|l| l["action"] == "admit") {
        let job = &admit["job_id"];
        assert!(seq_of(job, "admit") < seq_of(job, "dispatch"));
        assert!(seq_of(job, "dispatch") < seq_of(job, "complete"));
    }
    for d in lines.iter().filter(|l| l["action"] == "dispatch") {
        assert_eq!(d["reason"], "slot_free");
    }
    // One slot: a dispatch that follows a complete in `seq` order is the slot it freed.
    let mut by_seq = lines.clone();
    by_seq.sort_by_key(|l| l["seq"].as_u64());
    let mut in_flight = 0i32;
    for l in &by_seq {
        match l["action"].as_str() {
            Some("dispatch") => in_flight += 1,
            Some("complete") => in_flight -= 1,
            _ => {}
        }
        assert!(
            (0..=1).contains(&in_flight),
            "seq order breaks the slot count: {by_seq:#?}"
        );
    }
    let ttfts: Vec<bool> = lines
        .iter()
        .filter(|l| l["action"] == "complete")
        .map(|l| l["ttft_ms"].is_u64())
        .collect();
    assert_eq!(
        ttfts.iter().filter(|t| **t).count(),
        3,
        "ttft only for the three streams: {lines:#?}"
    );
}

// 12 -----------------------------------------------------------------------------------------

#[cfg(target_os = "linux")]
#[tokio::test]
async fn log_lines_that_cannot_be_written_count_as_dropped_only() {
    use slackgate_gateway::observe::telemetry::LogLine;
    use std::sync::atomic::Ordering;
    let log = DecisionLog::start(LogTarget::File("/dev/full".into()), 16).unwrap();
    for _ in 0..3 {
        assert!(log.log(&LogLine::default()));
    }
    log.flush().await;
    assert_eq!(log.counters().written.load(Ordering::Relaxed), 0);
    assert_eq!(log.counters().dropped.load(Ordering::Relaxed), 3);
}
