//! Integration tests of the proxy path over real sockets: a real `Gateway` in front of a real
//! `Stub` upstream, both on 127.0.0.1:0. Each test asserts something that a broken gate would
//! get wrong: headers and decision lines, streaming without buffering, slots held until the
//! body ends and released on every path (client gone mid-stream or while queued, upstream
//! refused, hung, failed or reset), rejections that never reach the upstream, bad input,
//! pass-through routes, metrics and a live estimator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::{chat, eventually, get, job_id, post, stub, two_class_config, Resp, TestGate};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::time::timeout;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(5);

/// Decision-log fields present on every line (docs/reference.md lists them all; the
/// `reference_doc` test compares that list with the code both ways).
const STABLE_FIELDS: [&str; 19] = [
    "ts_ms",
    "job_id",
    "class",
    "tenant",
    "idempotency_key",
    "enqueued_at_ms",
    "queue_age_ms",
    "queue_wait_ms",
    "deadline_slack_ms",
    "projected_wait_ms",
    "est_service_ms",
    "tokens_held",
    "tokens_spent",
    "tokens_wasted",
    "in_flight",
    "queued_ahead",
    "pool_depth",
    "action",
    "reason",
];

/// A gate config: one pool of `slots` in front of `{UPSTREAM}`, priors `overhead_ms` and
/// `decode_ms` per token (learning on or off), an `interactive` default class with a 30 s
/// deadline and a best-effort `batch` class. Bodies are limited to 1024 bytes.
fn config(slots: u32, overhead_ms: f64, decode_ms: f64, learn: bool) -> String {
    // These tests send X-Tenant as a fronting proxy would.
    let server = "max_body_bytes = 1024\ntrust_tenant_header = true";
    two_class_config(slots, overhead_ms, 0.0, decode_ms, learn, server)
}

/// A body shaped for the bounded test helpers below.
type TestBody = BoxBody<Bytes, Infallible>;

fn client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn full_body(s: impl Into<Bytes>) -> TestBody {
    Full::new(s.into()).boxed()
}

/// POST and return the response with its body still streaming.
async fn send_streaming(url: &str, headers: &[(&str, &str)], body: &str) -> Response<Incoming> {
    let mut b = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(full_body(body.to_string())).unwrap();
    bounded(client().request(req)).await.unwrap()
}

/// Send any request; a transport error is returned rather than unwrapped.
async fn send_raw(req: Request<TestBody>) -> Result<Resp, String> {
    let start = Instant::now();
    let resp = bounded(client().request(req))
        .await
        .map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    let body = bounded(body.collect())
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| e.to_string())?;
    Ok(Resp {
        status: parts.status,
        headers: parts.headers,
        body,
        elapsed: start.elapsed(),
    })
}

/// Await `f`, failing the test if it takes longer than [`WAIT`].
async fn bounded<F: Future>(f: F) -> F::Output {
    timeout(WAIT, f).await.expect("timed out")
}

/// Field `name` of the first pool in `/stats`.
async fn pool_stat(g: &TestGate, name: &str) -> u64 {
    g.stats().await["gate"]["pools"][0][name]
        .as_u64()
        .unwrap_or(u64::MAX)
}

/// Wait until the pool's `in_flight` and `depth` are both 0.
async fn assert_idle(g: &TestGate) {
    let idle = eventually(WAIT, || async {
        pool_stat(g, "in_flight").await == 0 && pool_stat(g, "depth").await == 0
    })
    .await;
    assert!(idle, "gate never went idle: {}", g.stats().await["gate"]);
}

/// The first log line for `job` with `action`, waiting for it to be written.
async fn wait_line(g: &TestGate, job: u64, action: &str) -> Value {
    let start = Instant::now();
    loop {
        let found = g
            .log_lines()
            .await
            .into_iter()
            .find(|l| l["job_id"] == job && l["action"] == action);
        match found {
            Some(l) => return l,
            None if start.elapsed() > WAIT => panic!("no {action} line for job {job}"),
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// `slackgate_ledger_tokens_held`: must return to 0 (no hold leaks).
async fn tokens_held(g: &TestGate) -> f64 {
    let m = get(&g.url("/metrics")).await;
    let m = String::from_utf8(m.body.to_vec()).unwrap();
    metric(&m, "slackgate_ledger_tokens_held").unwrap_or(f64::NAN)
}

fn assert_stable_fields(line: &Value) {
    for f in STABLE_FIELDS {
        assert!(line.get(f).is_some(), "field {f} missing from {line}");
    }
}

fn error_code(r: &Resp) -> String {
    r.json()["error"]["code"].as_str().unwrap_or("").to_string()
}

/// A `stream: true` chat body asking for `max_tokens`.
fn chat_stream(max_tokens: u32) -> String {
    format!(
        r#"{{"model":"stub","stream":true,"messages":[{{"role":"user","content":"hello"}}],"max_tokens":{max_tokens}}}"#
    )
}

// 1 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn non_streaming_chat_is_admitted_forwarded_and_logged() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(2, 5.0, 1.0, true), s.local_addr(), "chat").await;

    let r = post(
        &g.url("/v1/chat/completions"),
        &[("idempotency-key", "k-1"), ("x-tenant", "acme")],
        &chat(8),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let body = r.json();
    let prompt = body["usage"]["prompt_tokens"].as_u64().expect("usage");
    let completion = body["usage"]["completion_tokens"].as_u64().expect("usage");
    assert_eq!(completion, 8);
    assert_eq!(r.header("x-slackgate-decision").as_deref(), Some("admit"));
    let wait: u64 = r
        .header("x-slackgate-queue-wait-ms")
        .and_then(|v| v.parse().ok())
        .expect("x-slackgate-queue-wait-ms");
    assert!(wait < 1000, "queue wait {wait}");
    let job = job_id(&r.headers);

    let complete = wait_line(&g, job, "complete").await;
    let lines = g.log_lines().await;
    let mine: Vec<&Value> = lines.iter().filter(|l| l["job_id"] == job).collect();
    let actions: Vec<&str> = mine.iter().filter_map(|l| l["action"].as_str()).collect();
    assert_eq!(actions, ["admit", "dispatch", "complete"], "{mine:?}");
    for l in &mine {
        assert_stable_fields(l);
        assert_eq!(l["class"], "interactive");
        assert_eq!(l["idempotency_key"], "k-1");
        assert!(l["tenant"].as_str().is_some_and(|t| t.starts_with("t:")));
        assert!(l["ts_ms"].as_u64().is_some_and(|t| t > 1_600_000_000_000));
    }
    assert_eq!(mine[0]["reason"], "within_slack");
    assert!(mine[0]["tokens_held"].as_u64().is_some_and(|t| t >= 8));
    // One name, one meaning: the decision carries the age of the oldest job ahead and the
    // count ahead; the dispatch and completion carry the job's own wait and the pool's queue.
    assert_eq!(
        (&mine[0]["queue_age_ms"], &mine[0]["queued_ahead"]),
        (&json!(0), &json!(0))
    );
    assert!(mine[0]["queue_wait_ms"].is_null() && mine[0]["pool_depth"].is_null());
    for l in &mine[1..] {
        assert!(
            l["queue_age_ms"].is_null() && l["queued_ahead"].is_null(),
            "{l}"
        );
        assert_eq!(l["queue_wait_ms"], json!(wait), "{l}");
        assert_eq!(l["pool_depth"], 0, "{l}");
    }
    assert_eq!(complete["reason"], "completed");
    assert_eq!(complete["status"], 200);
    assert_eq!(complete["tokens_spent"], prompt + completion);
    assert_eq!(complete["tokens_wasted"], 0);
    assert_idle(&g).await;
}

// 2 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn streaming_is_passed_through_chunk_by_chunk_and_holds_the_slot() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=30000").await;
    let g = TestGate::start(&config(2, 5.0, 30.0, true), s.local_addr(), "stream").await;

    let resp = send_streaming(&g.url("/v1/chat/completions"), &[], &chat_stream(10)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let job = job_id(resp.headers());
    let mut body = resp.into_body();
    let mut times = Vec::new();
    let mut text = Vec::new();
    let mut in_flight_mid_stream = None;
    while let Some(frame) = bounded(body.frame()).await {
        let frame = frame.expect("stream broke");
        if let Some(d) = frame.data_ref() {
            times.push(Instant::now());
            text.extend_from_slice(d);
            if times.len() == 2 {
                // The stream has ~8 more tokens to go (240 ms): the slot must still be taken.
                in_flight_mid_stream = Some(pool_stat(&g, "in_flight").await);
            }
        }
    }
    let spread = times[times.len() - 1] - times[0];
    assert!(times.len() >= 8, "only {} frames: buffered?", times.len());
    assert!(
        spread > Duration::from_millis(150),
        "frames spread {spread:?}"
    );
    assert_eq!(
        in_flight_mid_stream,
        Some(1),
        "slot released before the end"
    );
    let text = String::from_utf8(text).unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(text.matches("\"content\":\"tok \"").count(), 10);

    assert_idle(&g).await;
    let complete = wait_line(&g, job, "complete").await;
    assert_eq!(complete["reason"], "completed");
    // The client asked for no usage chunk, so the gate asked for one on its behalf
    // (`server.stream_usage`): the hold settles on the upstream's own total, prompt included.
    let total = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["usage"]["total_tokens"].as_u64())
        .expect("the injected usage chunk reached the client");
    assert!(total > 10, "{total}");
    assert_eq!(complete["tokens_spent"], total);
    assert!(complete["ttft_ms"].as_u64().is_some());

    // With a usage chunk, the upstream's own count is what the gate records.
    let body = r#"{"model":"stub","stream":true,"stream_options":{"include_usage":true},
        "messages":[{"role":"user","content":"hello there, model"}],"max_tokens":3}"#;
    let resp = send_streaming(&g.url("/v1/chat/completions"), &[], body).await;
    let job = job_id(resp.headers());
    let text = bounded(resp.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    let text = String::from_utf8(text.to_vec()).unwrap();
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["usage"].is_object())
        .expect("usage chunk")["usage"]
        .clone();
    let complete = wait_line(&g, job, "complete").await;
    assert_eq!(complete["tokens_spent"], usage["total_tokens"]);
    assert_eq!(
        complete["tokens_spent"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() + 3)
    );
}

// 3 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn client_gone_mid_stream_cancels_upstream_and_frees_the_slot() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=30000").await;
    let g = TestGate::start(&config(2, 5.0, 30.0, true), s.local_addr(), "midstream").await;

    let resp = send_streaming(&g.url("/v1/chat/completions"), &[], &chat_stream(100)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let job = job_id(resp.headers());
    let mut body = resp.into_body();
    let mut frames = 0;
    while frames < 2 {
        let f = bounded(body.frame()).await.expect("ended early").unwrap();
        frames += usize::from(f.data_ref().is_some());
    }
    assert_eq!(pool_stat(&g, "in_flight").await, 1);
    let dropped_at = Instant::now();
    drop(body);

    assert_idle(&g).await;
    let cancel = wait_line(&g, job, "cancel").await;
    assert_eq!(cancel["reason"], "client_cancelled");
    assert!(
        cancel["tokens_wasted"].as_u64().is_some_and(|w| w >= 2),
        "{cancel}"
    );
    assert_eq!(cancel["tokens_spent"], 0);
    assert!(
        eventually(WAIT, || async { s.stats().cancelled == 1 }).await,
        "upstream request not cancelled: {:?}",
        s.stats()
    );
    assert_eq!(s.stats().served, 0);
    assert_eq!(s.stats().in_flight, 0);
    // 100 tokens at 30 ms would take 3 s: the cancel must not wait for the stream's end.
    assert!(dropped_at.elapsed() < Duration::from_millis(1500));
    assert_eq!(tokens_held(&g).await, 0.0, "hold leaked");
}

#[tokio::test]
async fn client_gone_before_response_headers_cancels_upstream() {
    let s = stub(4, "fixed:3s").await;
    let g = TestGate::start(&config(2, 5.0, 1.0, true), s.local_addr(), "preheaders").await;
    let url = g.url("/v1/chat/completions");
    // The client gives up while the upstream is still working on the (non-streamed) answer.
    let gave_up = timeout(Duration::from_millis(300), post(&url, &[], &chat(4))).await;
    assert!(gave_up.is_err(), "a 3 s upstream answered within 300 ms?");
    assert_idle(&g).await;
    let lines = g.log_lines().await;
    let cancel = lines
        .iter()
        .find(|l| l["action"] == "cancel")
        .unwrap_or_else(|| panic!("no cancel line: {lines:?}"));
    assert_eq!(cancel["reason"], "client_cancelled");
    assert!(
        eventually(WAIT, || async { s.stats().cancelled == 1 }).await,
        "upstream request not cancelled: {:?}",
        s.stats()
    );
    assert_eq!(tokens_held(&g).await, 0.0, "hold leaked");
}

// 4 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn client_gone_while_queued_never_reaches_upstream() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(1, 5.0, 1.0, true), s.local_addr(), "queued").await;

    // Occupy the only slot with a request the stub holds until released.
    let url = g.url("/v1/chat/completions");
    let first =
        tokio::spawn(async move { post(&url, &[("x-stub-hold", "first")], &chat(4)).await });
    assert!(eventually(WAIT, || async { pool_stat(&g, "in_flight").await == 1 }).await);

    // A second client queues behind it, then hangs up.
    let body = chat(4);
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        g.addr,
        body.len()
    );
    let mut sock = tokio::net::TcpStream::connect(g.addr).await.unwrap();
    sock.write_all(raw.as_bytes()).await.unwrap();
    assert!(eventually(WAIT, || async { pool_stat(&g, "depth").await == 1 }).await);
    drop(sock);

    assert!(
        eventually(WAIT, || async { pool_stat(&g, "depth").await == 0 }).await,
        "queued job not removed when its client left"
    );
    assert_eq!(pool_stat(&g, "in_flight").await, 1);
    let lines = g.log_lines().await;
    let admits: Vec<u64> = lines
        .iter()
        .filter(|l| l["action"] == "admit")
        .filter_map(|l| l["job_id"].as_u64())
        .collect();
    assert_eq!(admits.len(), 2, "{lines:?}");
    let second = admits[1];
    let cancel = wait_line(&g, second, "cancel").await;
    assert_eq!(cancel["reason"], "client_cancelled");
    assert_eq!(cancel["tokens_wasted"], 0);
    assert!(
        !lines
            .iter()
            .any(|l| l["job_id"] == second && l["action"] == "dispatch"),
        "a gone client was dispatched"
    );

    // Let the first finish; the second must never have been sent.
    let released = post(
        &format!("http://{}/stub/release", s.local_addr()),
        &[],
        r#"{"name":"first"}"#,
    )
    .await;
    assert_eq!(released.status, StatusCode::OK);
    let first = bounded(first).await.unwrap();
    assert_eq!(first.status, StatusCode::OK);
    assert_idle(&g).await;
    assert_eq!(s.stats().requests, 1, "{:?}", s.stats());
    assert_eq!(s.stats().served, 1);
    assert_eq!(tokens_held(&g).await, 0.0, "hold leaked");
}

// 5 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_gate_not_the_upstream_queues_under_concurrency() {
    let s = stub(8, "fixed:40ms").await;
    let g = TestGate::start(&config(2, 40.0, 0.0, false), s.local_addr(), "concurrency").await;

    let mut tasks = Vec::new();
    for _ in 0..20 {
        let url = g.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move { post(&url, &[], &chat(4)).await }));
    }
    let mut ok = 0;
    for t in tasks {
        let r = bounded(t).await.unwrap();
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        ok += 1;
    }
    assert_eq!(ok, 20);
    let st = s.stats();
    assert!(st.max_in_flight_seen <= 2, "upstream saw {st:?}");
    assert_eq!(
        st.max_in_flight_seen, 2,
        "the two slots were never both used"
    );
    assert_eq!(st.requests, 20);
    assert_eq!(st.served, 20);
    assert_idle(&g).await;
    let lines = g.log_lines().await;
    let count = |a: &str| lines.iter().filter(|l| l["action"] == a).count();
    assert_eq!(
        (count("admit"), count("dispatch"), count("complete")),
        (20, 20, 20)
    );
    let max_in_flight = lines
        .iter()
        .filter_map(|l| l["in_flight"].as_u64())
        .max()
        .unwrap_or(0);
    assert!(max_in_flight <= 2, "log shows in_flight {max_in_flight}");
}

// 6 ------------------------------------------------------------------------------------------

/// Check a bad request's status, `error.code` and that an `error` line with that reason was
/// logged.
async fn expect_bad(g: &TestGate, r: &Resp, status: StatusCode, code: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {:?}", r.body);
    assert_eq!(error_code(r), code, "{what}");
    assert_eq!(r.json()["error"]["type"], "invalid_request_error", "{what}");
    let logged = eventually(WAIT, || async {
        g.log_lines().await.iter().any(|l| {
            l["action"] == "error" && l["reason"] == code && l["status"] == status.as_u16()
        })
    })
    .await;
    assert!(logged, "{what}: no error line with reason {code}");
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_never_reaches_upstream() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(2, 5.0, 1.0, true), s.local_addr(), "bad").await;
    let url = g.url("/v1/chat/completions");

    let r = post(&url, &[], r#"{"model": "stub", "messages": [}"#).await;
    expect_bad(&g, &r, StatusCode::BAD_REQUEST, "invalid_json", "malformed").await;
    let r = post(&url, &[], r#"[{"model": "stub"}]"#).await;
    expect_bad(&g, &r, StatusCode::BAD_REQUEST, "invalid_json", "array").await;

    // Over max_body_bytes (1024), declared with Content-Length ...
    let big = format!(
        r#"{{"model":"stub","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2000)
    );
    let r = post(&url, &[], &big).await;
    expect_bad(
        &g,
        &r,
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "content-length",
    )
    .await;
    // ... and chunked, with no declared length.
    let chunks: Vec<Result<Frame<Bytes>, Infallible>> = big
        .as_bytes()
        .chunks(300)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    let req = Request::post(&url)
        .header("content-type", "application/json")
        .body(StreamBody::new(futures_util::stream::iter(chunks)).boxed())
        .unwrap();
    let r = send_raw(req).await.unwrap();
    expect_bad(
        &g,
        &r,
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "chunked",
    )
    .await;

    for bad in ["-1", "abc", "0", "99999999999", "1e400", "NaN"] {
        let r = post(&url, &[("x-deadline-ms", bad)], &chat(4)).await;
        expect_bad(&g, &r, StatusCode::BAD_REQUEST, "invalid_deadline", bad).await;
    }
    let now = common_epoch_ms();
    for (what, at) in [
        ("x-deadline far past", now.saturating_sub(10 * 86_400_000)),
        ("x-deadline far future", now + 10 * 86_400_000),
        ("x-deadline in seconds", now / 1000 + 30),
    ] {
        let at = at.to_string();
        let r = post(&url, &[("x-deadline", &at)], &chat(4)).await;
        expect_bad(&g, &r, StatusCode::BAD_REQUEST, "invalid_deadline", what).await;
    }
    let r = post(&url, &[("x-slo-ttft-ms", "-5")], &chat(4)).await;
    expect_bad(&g, &r, StatusCode::BAD_REQUEST, "invalid_deadline", "ttft").await;
    assert_eq!(s.stats().requests, 0, "bad input reached the upstream");

    // Huge header values: a 64 KiB class label and deadline are handled; a 1 MiB header is
    // refused by the HTTP layer; the gate keeps serving either way.
    let long_label = "a".repeat(64 * 1024);
    let r = post(&url, &[("x-job-class", &long_label)], &chat(4)).await;
    assert_eq!(r.status, StatusCode::OK, "long label: {:?}", r.body);
    let long_deadline = "9".repeat(64 * 1024);
    let r = post(&url, &[("x-deadline-ms", &long_deadline)], &chat(4)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&r), "invalid_deadline");
    let huge = "b".repeat(1024 * 1024);
    let req = Request::post(&url)
        .header("x-job-class", &huge)
        .body(full_body(chat(4)))
        .unwrap();
    // The connection may simply be closed on it (an Err): fine, as long as the gate lives.
    if let Ok(r) = send_raw(req).await {
        assert!(r.status.is_client_error(), "1 MiB header: {}", r.status);
    }
    assert_eq!(get(&g.url("/healthz")).await.status, StatusCode::OK);

    // An unknown class goes to the default class.
    let r = post(&url, &[("x-job-class", "no-such-class")], &chat(4)).await;
    assert_eq!(r.status, StatusCode::OK);
    let admit = wait_line(&g, job_id(&r.headers), "admit").await;
    assert_eq!(admit["class"], "interactive");
    assert_eq!(admit["class_label"], "no-such-class");
    assert_idle(&g).await;
    assert_eq!(s.stats().requests, 2);
}

fn common_epoch_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test]
async fn unknown_class_without_default_is_rejected_unlabeled() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let cfg = config(2, 5.0, 1.0, true).replace("default_class = \"interactive\"", "");
    let g = TestGate::start(&cfg, s.local_addr(), "unlabeled").await;
    let url = g.url("/v1/chat/completions");

    for headers in [&[("x-job-class", "mystery")][..], &[][..]] {
        let r = post(&url, headers, &chat(4)).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{headers:?}");
        assert_eq!(error_code(&r), "reject_unlabeled");
        assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
        assert!(r.header("retry-after").is_some());
        assert_eq!(r.json()["admission"]["reason"], "reject_unlabeled");
    }
    // A known class still works.
    let r = post(&url, &[("x-job-class", "batch")], &chat(4)).await;
    assert_eq!(r.status, StatusCode::OK);
    let lines = g.log_lines().await;
    let rejects = lines
        .iter()
        .filter(|l| l["action"] == "reject" && l["reason"] == "reject_unlabeled")
        .count();
    assert_eq!(rejects, 2);
    assert_eq!(s.stats().requests, 1);
}

// 7 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn upstream_refusing_connections_is_502_and_frees_the_slot() {
    let dead = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    }; // dropped: nothing listens there now
    let g = TestGate::start(&config(1, 5.0, 1.0, true), dead, "refused").await;
    let r = post(&g.url("/v1/chat/completions"), &[], &chat(4)).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(error_code(&r), "upstream_unavailable");
    assert_eq!(r.json()["error"]["type"], "upstream_error");
    assert_idle(&g).await;
    // The slot really is free: a second request gets the same answer, not a queue.
    let r = post(&g.url("/v1/chat/completions"), &[], &chat(4)).await;
    assert_eq!(error_code(&r), "upstream_unavailable");
    let lines = g.log_lines().await;
    let ends = lines
        .iter()
        .filter(|l| l["action"] == "complete" && l["reason"] == "upstream_unavailable")
        .count();
    assert_eq!(ends, 2, "{lines:?}");
    assert_idle(&g).await;
}

#[tokio::test]
async fn hung_upstream_times_out_at_the_deadline() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(1, 5.0, 1.0, true), s.local_addr(), "hang").await;
    let r = post(
        &g.url("/v1/chat/completions"),
        &[("x-stub-fault", "hang"), ("x-deadline-ms", "300")],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{:?}", r.body);
    assert_eq!(error_code(&r), "upstream_timeout");
    assert!(
        r.elapsed >= Duration::from_millis(280) && r.elapsed < Duration::from_millis(800),
        "answered after {:?}",
        r.elapsed
    );
    assert_idle(&g).await;
    // The gate gave up on the upstream request too.
    assert!(
        eventually(WAIT, || async { s.stats().in_flight == 0 }).await,
        "{:?}",
        s.stats()
    );
    assert_eq!(s.stats().cancelled, 1);
    let lines = g.log_lines().await;
    assert!(lines
        .iter()
        .any(|l| l["action"] == "complete" && l["reason"] == "upstream_timeout"));
}

#[tokio::test]
async fn upstream_error_status_is_passed_through_and_completes() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(1, 5.0, 1.0, true), s.local_addr(), "503").await;
    let r = post(
        &g.url("/v1/chat/completions"),
        &[("x-stub-fault", "status:503")],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_code(&r), "stub_fault", "the upstream's own body");
    let complete = wait_line(&g, job_id(&r.headers), "complete").await;
    assert_eq!(complete["status"], 503);
    assert_eq!(complete["reason"], "upstream_error");
    assert_idle(&g).await;
    // A failed response teaches the estimator nothing.
    assert_eq!(
        g.stats().await["gate"]["pools"][0]["estimator"]["samples"],
        0
    );
}

#[tokio::test]
async fn upstream_reset_mid_stream_truncates_and_frees_the_slot() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=20000").await;
    let g = TestGate::start(&config(1, 5.0, 20.0, true), s.local_addr(), "reset").await;
    let resp = send_streaming(
        &g.url("/v1/chat/completions"),
        &[("x-stub-fault", "reset")],
        &chat_stream(10),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let job = job_id(resp.headers());
    let mut body = resp.into_body();
    let mut text = Vec::new();
    let mut broke = false;
    while let Some(f) = bounded(body.frame()).await {
        match f {
            Ok(f) => text.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..])),
            Err(_) => {
                broke = true;
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&text);
    assert!(broke, "client saw a clean end of a broken stream: {text}");
    assert!(!text.contains("[DONE]"), "{text}");
    assert!(text.contains("tok "), "the chunks before the reset arrive");
    assert_idle(&g).await;
    let complete = wait_line(&g, job, "complete").await;
    assert_eq!(complete["reason"], "upstream_error");
}

#[tokio::test]
async fn upstream_stalled_mid_stream_is_cut_off_and_frees_the_slot() {
    // Headers and then silence: the stub's first token takes 3 s; the gate's idle limit is
    // 300 ms, so the client sees a broken body quickly and the slot is released.
    let s = stub(4, "tokens:prefill_us=0,decode_us=3000000").await;
    let cfg = config(1, 5.0, 1.0, false).replace(
        "max_body_bytes = 1024",
        "max_body_bytes = 1024\nstream_idle_timeout_ms = 300",
    );
    let g = TestGate::start(&cfg, s.local_addr(), "stall").await;
    let started = Instant::now();
    let resp = send_streaming(&g.url("/v1/chat/completions"), &[], &chat_stream(10)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let job = job_id(resp.headers());
    let mut body = resp.into_body();
    let mut broke = false;
    while let Some(f) = bounded(body.frame()).await {
        if f.is_err() {
            broke = true;
            break;
        }
    }
    assert!(broke, "a stalled upstream must not look like a clean end");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_millis(2000),
        "cut off after {waited:?}"
    );
    assert_idle(&g).await;
    let complete = wait_line(&g, job, "complete").await;
    assert_eq!(complete["reason"], "upstream_timeout");
    assert_eq!(tokens_held(&g).await, 0.0, "hold leaked");
}

#[tokio::test]
async fn upstream_reset_before_headers_is_502() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    let g = TestGate::start(&config(1, 5.0, 1.0, true), s.local_addr(), "reset0").await;
    let r = post(
        &g.url("/v1/chat/completions"),
        &[("x-stub-fault", "reset")],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{:?}", r.body);
    assert_eq!(error_code(&r), "upstream_error");
    assert_idle(&g).await;
    let lines = g.log_lines().await;
    assert!(lines
        .iter()
        .any(|l| l["action"] == "complete" && l["reason"] == "upstream_error"));
    assert_eq!(tokens_held(&g).await, 0.0, "hold leaked");
}

// 8 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn rejection_is_fast_explained_and_never_reaches_upstream() {
    let s = stub(4, "fixed:800ms").await;
    let cfg = config(1, 800.0, 0.0, false).replace("deadline_ms = 30000", "deadline_ms = 1000");
    let g = TestGate::start(&cfg, s.local_addr(), "reject").await;
    let url = g.url("/v1/chat/completions");

    let u = url.clone();
    let first = tokio::spawn(async move { post(&u, &[], &chat(4)).await });
    assert!(eventually(WAIT, || async { pool_stat(&g, "in_flight").await == 1 }).await);

    let r = post(&url, &[], &chat(4)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    assert!(
        r.elapsed < Duration::from_millis(100),
        "rejection took {:?}",
        r.elapsed
    );
    let secs: u64 = r
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("integer Retry-After");
    assert!(secs >= 1);
    let ms: u64 = r
        .header("retry-after-ms")
        .and_then(|v| v.parse().ok())
        .expect("retry-after-ms");
    assert!(ms >= 1 && ms.div_ceil(1000) == secs, "{ms} ms vs {secs} s");
    assert!(matches!(
        r.header("x-should-retry").as_deref(),
        Some("true" | "false")
    ));
    assert_eq!(
        r.header("x-slackgate-reason").as_deref(),
        Some("projected_wait_exceeds_slack")
    );
    let b = r.json();
    assert_eq!(b["error"]["type"], "admission_rejected");
    assert_eq!(b["error"]["code"], "projected_wait_exceeds_slack");
    assert!(b["error"]["param"].is_null());
    assert!(b["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    let a = &b["admission"];
    for f in [
        "action",
        "reason",
        "queue_age_ms",
        "queue_wait_ms",
        "deadline_slack_ms",
        "projected_wait_ms",
        "in_flight",
        "queued_ahead",
        "pool_depth",
        "retry_hint",
        "class",
    ] {
        assert!(a.get(f).is_some(), "admission.{f} missing: {a}");
    }
    assert_eq!(a["action"], "reject");
    assert_eq!(a["reason"], "projected_wait_exceeds_slack");
    assert_eq!(a["class"], "interactive");
    assert_eq!(a["in_flight"], 1);
    assert_eq!(a["queued_ahead"], 0);
    // A decision's body has no queue wait or pool depth of its own (a drop's has).
    assert!(
        a["queue_wait_ms"].is_null() && a["pool_depth"].is_null(),
        "{a}"
    );
    assert_eq!(a["deadline_slack_ms"], 200);
    let wait = a["projected_wait_ms"].as_u64().unwrap();
    assert!(wait > 200 && wait <= 800, "projected wait {wait}");

    let first = bounded(first).await.unwrap();
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        s.stats().requests,
        1,
        "the rejected request reached the stub"
    );
    let lines = g.log_lines().await;
    let reject = lines
        .iter()
        .find(|l| l["action"] == "reject")
        .expect("reject line");
    assert_stable_fields(reject);
    assert_eq!(reject["reason"], "projected_wait_exceeds_slack");
    assert_eq!(reject["status"], 429);
    assert!(reject["tokens_held"].is_null());
    assert_idle(&g).await;
}

// 9 ------------------------------------------------------------------------------------------

#[tokio::test]
async fn first_token_deadline_that_cannot_be_met_is_rejected() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=1000").await;
    // 500 ms before any first token; the class itself has no deadline (best effort).
    let cfg = config(1, 500.0, 1.0, false).replace("deadline_ms = 30000", "");
    let g = TestGate::start(&cfg, s.local_addr(), "ttft").await;
    let url = g.url("/v1/chat/completions");

    let r = post(&url, &[("x-slo-ttft-ms", "100")], &chat(4)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    assert_eq!(error_code(&r), "projected_wait_exceeds_slack");
    let slack = r.json()["admission"]["deadline_slack_ms"].as_i64().unwrap();
    assert!(slack < 0, "slack {slack}");
    // A first-token budget that can be met is admitted.
    let r = post(&url, &[("x-slo-ttft-ms", "5000")], &chat(4)).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(s.stats().requests, 1);
}

// 10 -----------------------------------------------------------------------------------------

/// The value of the first sample line of `metrics` starting with `prefix`.
fn metric(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn passthrough_health_metrics_and_stats() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=2000").await;
    let g = TestGate::start(&config(2, 5.0, 2.0, true), s.local_addr(), "routes").await;

    let r = get(&g.url("/v1/models")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["data"][0]["id"], "stub");
    let r = get(&g.url("/nope")).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&r), "not_found");
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    let r = get(&g.url("/healthz")).await;
    assert_eq!(r.status, StatusCode::OK);

    for _ in 0..3 {
        let r = post(&g.url("/v1/chat/completions"), &[], &chat(5)).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let resp = send_streaming(&g.url("/v1/chat/completions"), &[], &chat_stream(5)).await;
    let _ = bounded(resp.into_body().collect()).await.unwrap();
    assert_idle(&g).await;

    let r = get(&g.url("/metrics")).await;
    assert_eq!(r.status, StatusCode::OK);
    let m = String::from_utf8(r.body.to_vec()).unwrap();
    let admits = metric(
        &m,
        "slackgate_decisions_total{class=\"interactive\",action=\"admit\",reason=\"within_slack\"}",
    );
    assert_eq!(admits, Some(4.0), "{m}");
    let age = metric(
        &m,
        "slackgate_queue_oldest_age_seconds{class=\"interactive\"",
    );
    assert_eq!(age, Some(0.0));
    assert_eq!(
        metric(&m, "slackgate_in_flight{pool=\"default\"}"),
        Some(0.0)
    );
    let done = metric(
        &m,
        "slackgate_turnaround_seconds_bucket{class=\"interactive\",le=\"+Inf\"}",
    );
    assert_eq!(done, Some(4.0));
    // Time to first token is a streaming measure: only the one SSE response has it; the
    // first byte of a JSON body is the whole answer, not a first token.
    let ttft = metric(
        &m,
        "slackgate_time_to_first_token_seconds_bucket{class=\"interactive\",le=\"+Inf\"}",
    );
    assert_eq!(ttft, Some(1.0));
    let fast = metric(
        &m,
        "slackgate_turnaround_seconds_bucket{class=\"interactive\",le=\"1\"}",
    );
    assert_eq!(fast, Some(4.0), "requests of ~10 ms took over 1 s?");
    let decode = metric(
        &m,
        "slackgate_estimator_decode_seconds_per_token{pool=\"default\"}",
    )
    .unwrap();
    // Four ~10 ms requests may fit as overhead alone: the constrained fit can put decode at
    // exactly 0, never below.
    assert!(
        decode.is_finite() && (0.0..0.1).contains(&decode),
        "{decode}"
    );
    for l in m.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let v: f64 = l.rsplit(' ').next().unwrap().parse().unwrap();
        // The estimator's bias is signed (below 0: its estimates run short); nothing else is.
        let signed = l.starts_with("slackgate_estimate_bias_ratio");
        assert!(v.is_finite() && (signed || v >= 0.0), "bad sample {l}");
    }
    // Four completions: the class's estimate error is reported, median and p90.
    for name in ["median", "p90"] {
        let series = format!("slackgate_estimate_error_{name}_ratio{{class=\"interactive\"}}");
        assert!(metric(&m, &series).is_some(), "{series}");
    }

    let st = g.stats().await;
    let classes = st["gate"]["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 2);
    assert_eq!(classes[0]["name"], "interactive");
    let pools = st["gate"]["pools"].as_array().unwrap();
    assert_eq!(pools[0]["name"], "default");
    assert_eq!(pools[0]["slots"], 2);
    assert_eq!(pools[0]["estimator"]["samples"], 4);
}

// 11 -----------------------------------------------------------------------------------------

#[tokio::test]
async fn estimator_learns_the_live_decode_rate() {
    let s = stub(4, "tokens:prefill_us=0,decode_us=20000").await;
    let g = TestGate::start(&config(1, 5.0, 1.0, true), s.local_addr(), "learn").await;
    let url = g.url("/v1/chat/completions");
    for i in 0..15 {
        let tokens = [2, 8, 14, 20, 5][i % 5];
        let r = post(&url, &[], &chat(tokens)).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    assert_idle(&g).await;
    let est = g.stats().await["gate"]["pools"][0]["estimator"].clone();
    let decode = est["decode_ms_per_token"].as_f64().unwrap();
    assert!(
        (14.0..=26.0).contains(&decode),
        "learned decode {decode} ms/token, want 20 +-30%: {est}"
    );
    assert_eq!(est["samples"], 15);
}
