//! The live page (`/live` on the admin listener) over real sockets: the token exchanged for a
//! cookie and dropped from the URL, what the cookie opens and what it never opens (the admin
//! API, writes above all), the stream's frames against `/stats?snapshot=N`, the bound on
//! subscribers, and hostile input. A gate and a stub on 127.0.0.1:0, a real HTTP client; the
//! page itself in a real browser is tests/python/test_live_page.py.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use serde_json::Value;
use slackgate_stub::Stub;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One slot, 100 ms jobs; frames every 100 ms; at most two streams.
const CONFIG: &str = r#"
default_class = "interactive"
[server]
tick_ms = 10
[admin]
live_frame_ms = 100
live_max_subscribers = 2
[[pools]]
name = "default"
slots = 1
upstream = "{UPSTREAM}"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 500
[[classes]]
name = "batch"
priority = 10
"#;

/// Every wait in this file is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

async fn gate(name: &str, token: Option<&str>) -> (Stub, TestGate) {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let gate = TestGate::start_admin(CONFIG, stub.local_addr(), name, token).await;
    (stub, gate)
}

/// The session cookie's `name=value`, from the exchange.
async fn session(gate: &TestGate) -> String {
    let r = get(&gate.admin_url(&format!("/live?token={TOKEN}"))).await;
    assert_eq!(r.status, 303, "{:?}", r.body);
    let set = r.header("set-cookie").expect("a cookie");
    set.split(';').next().unwrap().trim().to_string()
}

/// The complete chunks of a chunked body so far, joined.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n + 2 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// A raw GET of the stream: the head, and the events read until `events` arrived (or the
/// answer was a refusal).
async fn read_stream(gate: &TestGate, headers: &str, events: usize) -> (String, Vec<(u64, Value)>) {
    let addr = gate.gate.admin_addr().unwrap();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET /live/stream HTTP/1.1\r\nhost: x\r\n{headers}\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let read = async {
        loop {
            let text = String::from_utf8_lossy(&buf).to_string();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                if !head.starts_with("HTTP/1.1 200") {
                    return (head.to_string(), String::new());
                }
                let body = dechunk(body);
                if body.matches("event: frame").count() >= events {
                    return (head.to_string(), body);
                }
            }
            let n = s.read(&mut chunk).await.unwrap();
            if n == 0 {
                return (text, String::new());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    let (head, body) = tokio::time::timeout(WAIT, read).await.expect("bounded");
    let mut frames = Vec::new();
    for ev in body.split("\n\n") {
        let id = ev.lines().find_map(|l| l.strip_prefix("id: "));
        let data = ev.lines().find_map(|l| l.strip_prefix("data: "));
        if let (Some(id), Some(data)) = (id, data) {
            frames.push((
                id.trim().parse().unwrap(),
                serde_json::from_str(data).unwrap(),
            ));
        }
    }
    (head, frames)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_becomes_a_cookie_for_the_page_only() {
    let (_stub, gate) = gate("live-cookie", Some(TOKEN)).await;
    // The exchange: 303 to /live (the token gone from the URL), a strict HttpOnly cookie.
    let r = get(&gate.admin_url(&format!("/live?token={TOKEN}"))).await;
    assert_eq!(r.status, 303);
    assert_eq!(r.header("location").as_deref(), Some("/live"));
    assert_eq!(r.header("cache-control").as_deref(), Some("no-store"));
    let set = r.header("set-cookie").unwrap();
    for part in [
        "slackgate_live=",
        "HttpOnly",
        "SameSite=Strict",
        "Path=/live",
    ] {
        assert!(set.contains(part), "{set}");
    }
    let cookie = session(&gate).await;
    // The page and its assets, with a policy that allows this origin only.
    for (path, kind) in [
        ("/live", "text/html"),
        ("/live/app.js", "text/javascript"),
        ("/live/app.css", "text/css"),
        ("/live/uplot.js", "text/javascript"),
        ("/live/uplot.css", "text/css"),
    ] {
        let r = request("GET", &gate.admin_url(path), &[("cookie", &cookie)], "").await;
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.header("content-type").unwrap().starts_with(kind),
            "{path}"
        );
    }
    let page = request("GET", &gate.admin_url("/live"), &[("cookie", &cookie)], "").await;
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
    assert!(!csp.contains("unsafe-inline"));
    assert!(String::from_utf8_lossy(&page.body).contains("/live/stream"));
    // The bearer token opens the page too (curl, scripts).
    let auth = format!("Bearer {TOKEN}");
    let r = request(
        "GET",
        &gate.admin_url("/live"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    // The cookie opens nothing of the admin API: not its reads, never its writes.
    for (method, path, body) in [
        ("GET", "/admin/flags", ""),
        ("PUT", "/admin/flags/admit_always", r#"{"value":true}"#),
        ("POST", "/admin/flags/shadow", r#"{"value":true}"#),
        ("POST", "/admin/drain", r#"{"classes":["batch"]}"#),
        ("POST", "/admin/reload", ""),
    ] {
        let r = request(method, &gate.admin_url(path), &[("cookie", &cookie)], body).await;
        assert_eq!(r.status, 401, "{method} {path}");
        assert_eq!(r.json()["error"]["code"], "unauthorized");
    }
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["admit_always"]["value"], false);
    assert_eq!(flags["shadow"]["value"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_missing_and_hostile_credentials_are_refused() {
    let (_stub, gate) = gate("live-refusals", Some(TOKEN)).await;
    let cookie = session(&gate).await;
    let expect = |r: &Resp, status: u16, code: &str, what: &str| {
        assert_eq!(r.status, status, "{what}: {:?}", r.body);
        assert_eq!(r.json()["error"]["code"], code, "{what}");
    };
    // No credential, a wrong token, a forged or unknown cookie.
    expect(
        &get(&gate.admin_url("/live")).await,
        401,
        "unauthorized",
        "none",
    );
    let wrong = format!("/live?token={}X", &TOKEN[..TOKEN.len() - 1]);
    expect(
        &get(&gate.admin_url(&wrong)).await,
        401,
        "unauthorized",
        "wrong token",
    );
    expect(
        &get(&gate.admin_url("/live?token=")).await,
        401,
        "unauthorized",
        "empty",
    );
    expect(
        &get(&gate.admin_url("/live?token=%zz")).await,
        401,
        "unauthorized",
        "bad escape",
    );
    for forged in [
        format!("slackgate_live={}", "0".repeat(64)),
        "slackgate_live=../../etc".to_string(),
        format!("slackgate_live={}", "a".repeat(5000)),
        "slackgate_live=".to_string(),
    ] {
        let r = request("GET", &gate.admin_url("/live"), &[("cookie", &forged)], "").await;
        expect(&r, 401, "unauthorized", "forged cookie");
        let r = request(
            "GET",
            &gate.admin_url("/live/stream"),
            &[("cookie", &forged)],
            "",
        )
        .await;
        expect(&r, 401, "unauthorized", "forged cookie on the stream");
    }
    // The token is never taken in the stream's URL, even the right one, even with a cookie.
    let r = request(
        "GET",
        &gate.admin_url(&format!("/live/stream?token={TOKEN}")),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    expect(&r, 400, "token_in_query", "token on the stream URL");
    let r = request(
        "GET",
        &gate.admin_url("/live/app.js?x=1"),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    expect(&r, 400, "invalid_query", "other query");
    let r = request(
        "GET",
        &gate.admin_url("/live?foo=bar"),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    expect(&r, 400, "invalid_query", "no token in the query");
    // An oversized query.
    let long = format!("/live?token={}", "t".repeat(5000));
    expect(
        &get(&gate.admin_url(&long)).await,
        414,
        "query_too_long",
        "oversized",
    );
    // Wrong methods, with or without credentials.
    for method in ["POST", "PUT", "DELETE", "PATCH"] {
        for path in ["/live", "/live/stream"] {
            let r = request(method, &gate.admin_url(path), &[("cookie", &cookie)], "{}").await;
            expect(&r, 405, "method_not_allowed", method);
            assert_eq!(r.header("allow").as_deref(), Some("GET"));
        }
    }
    // Paths below /live the page does not have.
    let r = request(
        "GET",
        &gate.admin_url("/live/../admin/flags"),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_ne!(r.status, 200);
    let r = request(
        "GET",
        &gate.admin_url("/live/nope"),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    expect(&r, 404, "not_found", "unknown asset");
    // Refusals are counted like the admin API's.
    let m = gate.metrics().await;
    assert!(m.contains(r#"reason="unauthorized""#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_the_page_is_closed() {
    let (_stub, gate) = gate("live-notoken", None).await;
    let r = get(&gate.admin_url("/live?token=anything")).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "admin_token_unset");
    assert_eq!(get(&gate.admin_url("/live")).await.status, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_frame_is_the_stats_document_of_its_snapshot() {
    let (_stub, gate) = gate("live-frames", Some(TOKEN)).await;
    let cookie = session(&gate).await;
    // Load: a burst of interactive requests on one slot, some refused.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let url = gate.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            post(&url, &[("x-job-class", "interactive")], &chat(10))
                .await
                .status
        }));
    }
    let (head, frames) = read_stream(&gate, &format!("cookie: {cookie}\r\n"), 5).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/event-stream"), "{head}");
    assert!(frames.len() >= 5, "{} frames", frames.len());
    for w in frames.windows(2) {
        assert!(w[1].0 > w[0].0, "frames in order, each once");
    }
    for (id, frame) in &frames {
        assert_eq!(frame["snapshot"].as_u64(), Some(*id));
        let stats = get(&gate.url(&format!("/stats?snapshot={id}"))).await;
        assert_eq!(stats.status, 200);
        assert_eq!(
            &stats.json(),
            frame,
            "frame {id} against /stats?snapshot={id}"
        );
    }
    for t in tasks {
        t.await.unwrap();
    }
    // After the load, a new frame's totals equal the live /stats's.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut before = Value::Null;
    loop {
        let s = get(&gate.url("/stats")).await.json();
        let pool = &s["gate"]["pools"][0];
        if s["decisions"] == before && pool["in_flight"] == 0 && pool["depth"] == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never settled: {s}");
        before = s["decisions"].clone();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let seen = gate.gate.shared().frames.latest_seq();
    let (_, later) = read_stream(
        &gate,
        &format!("cookie: {cookie}\r\nlast-event-id: {seen}\r\n"),
        1,
    )
    .await;
    let newest = later.last().unwrap();
    assert!(newest.0 > seen);
    let live = get(&gate.url("/stats")).await.json();
    assert_eq!(newest.1["decisions"], live["decisions"]);
    let admitted: u64 = live["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["action"] == "admit")
        .map(|d| d["count"].as_u64().unwrap())
        .sum();
    assert!(admitted >= 1, "{live}");
    // Reconnecting with Last-Event-ID sends only what was missed.
    let last = newest.0;
    let (_, again) = read_stream(
        &gate,
        &format!("cookie: {cookie}\r\nlast-event-id: {last}\r\n"),
        1,
    )
    .await;
    assert!(again.iter().all(|(id, _)| *id > last), "only newer frames");
    // Snapshots not kept, and hostile queries.
    let r = get(&gate.url("/stats?snapshot=999999999")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "snapshot_gone");
    for q in ["snapshot=-1", "snapshot=abc", "snapshot=1&x=1", "x=1"] {
        let r = get(&gate.url(&format!("/stats?{q}"))).await;
        assert_eq!(r.status, 400, "{q}");
        assert_eq!(r.json()["error"]["code"], "invalid_query");
    }
    // The live document names no snapshot.
    assert!(live["snapshot"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_are_bounded_and_a_closed_stream_frees_its_place() {
    let (_stub, gate) = gate("live-bound", Some(TOKEN)).await;
    let cookie = session(&gate).await;
    let addr = gate.gate.admin_addr().unwrap();
    let open = || async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET /live/stream HTTP/1.1\r\nhost: x\r\ncookie: {cookie}\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(WAIT, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        s
    };
    let first = open().await;
    let _second = open().await;
    // The third is refused with a code that says why.
    let r = request(
        "GET",
        &gate.admin_url("/live/stream"),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "live_subscribers_full");
    // One closes: its place is free again (the server notices at its next frame).
    drop(first);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (head, _) = read_stream(&gate, &format!("cookie: {cookie}\r\n"), 1).await;
        if head.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the place was never freed: {head}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// On tokio's paused clock: a session's quarter of an hour passes at once (the gate's timers
// fire in order on the way, as in real time).
#[tokio::test(start_paused = true)]
async fn an_expired_session_is_refused_and_a_new_token_opens_a_new_one() {
    let (_stub, gate) = gate("live-expiry", Some(TOKEN)).await;
    let cookie = session(&gate).await;
    let open = |c: String| {
        let url = gate.admin_url("/live");
        async move { request("GET", &url, &[("cookie", &c)], "").await }
    };
    assert_eq!(open(cookie.clone()).await.status, 200);
    tokio::time::sleep(Duration::from_secs(899)).await;
    assert_eq!(
        open(cookie.clone()).await.status,
        200,
        "still inside its 900 s"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = open(cookie.clone()).await;
    assert_eq!(r.status, 401, "expired");
    assert_eq!(r.json()["error"]["code"], "unauthorized");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("expired"));
    let r = request(
        "GET",
        &gate.admin_url("/live/stream"),
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(r.status, 401, "the stream too");
    let fresh = session(&gate).await;
    assert_ne!(fresh, cookie);
    assert_eq!(open(fresh).await.status, 200);
}

#[test]
fn the_live_settings_are_checked() {
    // The config with `[admin]`'s live settings replaced by `admin_lines`: `Err` says why not.
    let check = |admin_lines: &str| -> Result<(), String> {
        let text = CONFIG
            .replace(
                "live_frame_ms = 100\nlive_max_subscribers = 2\n",
                &format!("{admin_lines}\n"),
            )
            .replace("{UPSTREAM}", "http://127.0.0.1:9");
        let cfg = slackgate_gateway::Config::from_toml(&text).map_err(|e| e.to_string())?;
        cfg.validate().map_err(|e| e.to_string())
    };
    assert_eq!(check(""), Ok(()));
    assert_eq!(
        check("live_max_subscribers = 1\nlive_session_s = 60"),
        Ok(())
    );
    for (lines, field) in [
        ("live_max_subscribers = 0", "admin.live_max_subscribers"),
        ("live_session_s = 5", "admin.live_session_s"),
        ("live_session_s = 100000", "admin.live_session_s"),
        ("live_frame_ms = 50", "admin.live_frame_ms"),
        ("live_frame_ms = 60000", "admin.live_frame_ms"),
        ("live_frames = 100", "live_frames"),
        ("live_max_subscribers = -1", "live_max_subscribers"),
    ] {
        let e = check(lines).expect_err(lines);
        assert!(e.contains(field), "{lines}: {e}");
    }
}
