//! Displacement (`displace_within_ms`) over real sockets: a shorter request that would be
//! refused for `projected_wait_exceeds_slack` takes the place of a longer one admitted moments
//! before; the longer one's client hears `displaced` (429) and it never reaches the upstream.
//! Off, the same traffic refuses the newcomer and serves the queued request, as admission
//! promised. In shadow mode nothing is displaced: the newcomer is a `shadow_reject` naming
//! the job it would have displaced. And a zero window is refused when the config is loaded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::net::SocketAddr;
use std::time::Duration;

/// One slot, a frozen estimator at 10 ms per output token and nothing else, so that a trusted
/// `X-Expected-Output-Tokens` hint is the estimate: 100 tokens are 1 s. One class with a 20 s
/// deadline and, optionally, a displacement window.
///
/// The sizes below are chosen so that no verdict depends on how fast the machine is. A holds
/// the slot (the stub keeps it until released), estimated 1000 ms, so its remaining estimate is
/// 1000 ms or less for the first 2 s and then grows by 1 ms per ms. B (1300 tokens, 13 s)
/// fits while that remainder is at most 20 - 13 = 7 s. C (800 tokens, 8 s) has a slack of
/// 12 s: behind A and B its wait is at least 13 s, never fits; behind A alone it fits while
/// A's remainder is under 12 s. The window (10 s) is far more than the gap between B and C.
fn config(window: Option<u64>) -> String {
    config_with(window, false)
}

/// [`config`], in shadow mode when `shadow`.
fn config_with(window: Option<u64>, shadow: bool) -> String {
    let displace = window.map_or(String::new(), |w| format!("displace_within_ms = {w}"));
    format!(
        r#"
        shadow = {shadow}
        [server]
        trust_size_hint = true
        [[pools]]
        name = "p"
        slots = 1
        upstream = "{{UPSTREAM}}"
        [pools.prior]
        overhead_ms = 0
        prefill_ms_per_token = 0
        decode_ms_per_token = 10
        learn = false
        [[classes]]
        name = "interactive"
        priority = 100
        deadline_ms = 20000
        pool = "p"
        {displace}
        "#
    )
}

/// How long any one step may take before the test gives up (a loaded 2-core machine).
const PATIENCE: Duration = Duration::from_secs(30);

/// Headers for one request: its name is its idempotency key and its stub request id, `hint`
/// its expected output, and the stub writes only 5 tokens (5 ms), so served requests end fast.
fn headers(name: &str, hint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("x-job-class", "interactive".into()),
        ("idempotency-key", name.into()),
        ("x-stub-request-id", name.into()),
        ("x-expected-output-tokens", hint.into()),
        ("x-stub-output-tokens", "5".into()),
    ]
}

fn send(url: &str, h: &[(&'static str, String)]) -> tokio::task::JoinHandle<Resp> {
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    spawn_post(url, &h, chat(2000))
}

async fn finish(task: tokio::task::JoinHandle<Resp>, what: &str) -> Resp {
    tokio::time::timeout(PATIENCE, task)
        .await
        .unwrap_or_else(|_| panic!("{what} got no answer within {PATIENCE:?}"))
        .unwrap()
}

/// The log line of `action` for the request with idempotency key `key`.
fn line<'a>(
    lines: &'a [serde_json::Value],
    key: &str,
    action: &str,
) -> Option<&'a serde_json::Value> {
    lines
        .iter()
        .find(|l| l["idempotency_key"] == key && l["action"] == action)
}

/// The ids of the requests the stub saw, in completion order (`GET /stub/requests`).
async fn upstream_ids(stub: SocketAddr) -> Vec<String> {
    let r = get(&format!("http://{stub}/stub/requests")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.json()["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|rec| rec["id"].as_str().unwrap().to_string())
        .collect()
}

/// The stub, the gate, A's and B's pending answers, and B's job id.
type Parked = (
    slackgate_stub::Stub,
    TestGate,
    tokio::task::JoinHandle<Resp>,
    tokio::task::JoinHandle<Resp>,
    u64,
);

/// Start the stub and the gate, park A in the slot (held by the stub until released) and
/// queue B behind it; returns B's job id once its admission is logged.
async fn a_running_b_queued(window: Option<u64>, name: &str) -> Parked {
    a_running_b_queued_in(&config(window), name).await
}

/// [`a_running_b_queued`] under a config of the caller's.
async fn a_running_b_queued_in(toml_text: &str, name: &str) -> Parked {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=1000").await;
    let gate = TestGate::start(toml_text, stub.local_addr(), name).await;
    let url = gate.url("/v1/chat/completions");
    let mut ha = headers("a", "100");
    ha.push(("x-stub-hold", "a".into()));
    let a = send(&url, &ha);
    let held = eventually(PATIENCE, || async { stub.stats().in_flight == 1 }).await;
    assert!(held, "A reached the stub and holds its slot");
    let b = send(&url, &headers("b", "1300"));
    let queued = eventually(PATIENCE, || async {
        line(&gate.log_lines().await, "b", "admit").is_some()
    })
    .await;
    assert!(queued, "B was admitted behind A");
    let lines = gate.log_lines().await;
    let b_id = line(&lines, "b", "admit").unwrap()["job_id"]
        .as_u64()
        .unwrap();
    (stub, gate, a, b, b_id)
}

/// End A's hold at the stub.
async fn release_a(stub: SocketAddr) {
    let r = post(
        &format!("http://{stub}/stub/release"),
        &[],
        r#"{"name":"a"}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn displacement_refuses_the_longer_queued_request_and_serves_the_shorter() {
    let (stub, gate, a, b, b_id) = a_running_b_queued(Some(10_000), "displace-on").await;
    let url = gate.url("/v1/chat/completions");
    let c = send(&url, &headers("c", "800"));

    // B's client hears at once that it lost its place, while A still holds the slot.
    let b = finish(b, "B").await;
    assert_eq!(b.status, 429, "{:?}", b.body);
    let body = b.json();
    assert_eq!(body["error"]["code"], "displaced", "{body}");
    assert_eq!(body["admission"]["action"], "drop", "{body}");
    assert_eq!(body["admission"]["reason"], "displaced", "{body}");
    assert_eq!(body["admission"]["job_id"], b_id, "{body}");
    // Its retry advice is the core's: when a retry would fit behind what is queued now (A's
    // remainder and C, about 9 s, against B's 7 s of slack: some 2 s, jittered), in the
    // body and in the headers, rounded up to whole seconds as for rejections. Its deadline
    // was relative (the class's), so a retry gets it whole again: worth retrying.
    let after_ms = body["admission"]["retry_after_ms"]
        .as_u64()
        .unwrap_or_else(|| panic!("no retry_after_ms in {body}"));
    assert!(after_ms >= 1000, "{body}");
    let secs = after_ms.div_ceil(1000).max(1).to_string();
    assert_eq!(b.header("retry-after"), Some(secs), "{:?}", b.headers);
    assert_eq!(
        b.header("retry-after-ms"),
        Some(after_ms.to_string()),
        "{:?}",
        b.headers
    );
    assert_eq!(b.header("x-should-retry").as_deref(), Some("true"));

    // C was admitted, but runs only after A: it is still waiting while A is held.
    let admitted = eventually(PATIENCE, || async {
        line(&gate.log_lines().await, "c", "admit").is_some()
    })
    .await;
    assert!(admitted, "C was admitted");
    assert!(
        !c.is_finished(),
        "C cannot be served while A holds the slot"
    );
    // B's hold was released with its drop: the ledger holds A's and C's tokens, not B's,
    // and so does the per-class gauge the decision log feeds.
    let lines = gate.log_lines().await;
    let held = |key: &str| {
        line(&lines, key, "admit").unwrap()["tokens_held"]
            .as_u64()
            .unwrap()
    };
    let (a_held, b_held, c_held) = (held("a"), held("b"), held("c"));
    assert!(b_held > 0, "B held tokens while queued");
    let m = gate.metrics().await;
    assert_eq!(metric(&m, "slackgate_ledger_holds"), Some(2.0), "A and C");
    assert_eq!(
        metric(&m, "slackgate_ledger_tokens_held"),
        Some((a_held + c_held) as f64)
    );
    release_a(stub.local_addr()).await;
    let a = finish(a, "A").await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let c = finish(c, "C").await;
    assert_eq!(c.status, 200, "{:?}", c.body);
    assert_eq!(
        c.header("x-slackgate-reason").as_deref(),
        Some("within_slack")
    );

    // B never reached the upstream: the stub saw A, then C.
    assert_eq!(upstream_ids(stub.local_addr()).await, ["a", "c"]);
    assert_eq!(stub.stats().served, 2);

    let lines = gate.log_lines().await;
    let c_admit = line(&lines, "c", "admit").unwrap();
    assert_eq!(c_admit["reason"], "within_slack", "{c_admit}");
    assert_eq!(c_admit["displaced_job_id"], b_id, "{c_admit}");
    let b_drop = line(&lines, "b", "drop").unwrap();
    assert_eq!(
        (&b_drop["job_id"], &b_drop["reason"]),
        (&serde_json::json!(b_id), &serde_json::json!("displaced")),
        "{b_drop}"
    );
    assert!(line(&lines, "b", "dispatch").is_none(), "B was dispatched");
    // Only C's admission names a victim.
    for key in ["a", "b"] {
        let admit = line(&lines, key, "admit").unwrap();
        assert!(admit["displaced_job_id"].is_null(), "{admit}");
    }
    let a_done = line(&lines, "a", "complete").unwrap();
    let c_sent = line(&lines, "c", "dispatch").unwrap();
    assert!(
        c_sent["seq"].as_u64() > a_done["seq"].as_u64(),
        "C was sent before A ended: {c_sent} {a_done}"
    );

    let m = gate.metrics().await;
    assert_eq!(
        metric(
            &m,
            "slackgate_decisions_total{class=\"interactive\",action=\"drop\",reason=\"displaced\"}"
        ),
        Some(1.0)
    );
    // Everything settled: nothing is held.
    assert_eq!(metric(&m, "slackgate_ledger_tokens_held"), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_names_the_job_it_would_displace_and_displaces_nothing() {
    let (stub, gate, a, b, b_id) =
        a_running_b_queued_in(&config_with(Some(10_000), true), "displace-shadow").await;
    let url = gate.url("/v1/chat/completions");
    let c = send(&url, &headers("c", "800"));
    let logged = eventually(PATIENCE, || async {
        line(&gate.log_lines().await, "c", "shadow_reject").is_some()
    })
    .await;
    assert!(logged, "C was admitted as a shadow_reject");
    let lines = gate.log_lines().await;
    let c_line = line(&lines, "c", "shadow_reject").unwrap();
    assert_eq!(c_line["reason"], "projected_wait_exceeds_slack", "{c_line}");
    assert_eq!(c_line["displaced_job_id"], b_id, "{c_line}");
    assert!(!b.is_finished(), "B stays queued behind A");

    release_a(stub.local_addr()).await;
    assert_eq!(finish(a, "A").await.status, 200);
    let b = finish(b, "B").await;
    assert_eq!(b.status, 200, "{:?}", b.body);
    assert_eq!(job_id(&b.headers), b_id);
    let c = finish(c, "C").await;
    assert_eq!(c.status, 200, "{:?}", c.body);
    assert_eq!(upstream_ids(stub.local_addr()).await, ["a", "b", "c"]);

    let lines = gate.log_lines().await;
    assert!(
        lines.iter().all(|l| l["reason"] != "displaced"),
        "nothing is displaced in shadow mode"
    );
    assert!(line(&lines, "b", "drop").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_window_admission_is_kept_and_the_newcomer_is_refused() {
    let (stub, gate, a, b, b_id) = a_running_b_queued(None, "displace-off").await;
    let url = gate.url("/v1/chat/completions");
    let c = finish(send(&url, &headers("c", "800")), "C").await;
    assert_eq!(c.status, 429, "{:?}", c.body);
    assert_eq!(c.json()["error"]["code"], "projected_wait_exceeds_slack");
    assert!(!b.is_finished(), "B stays queued behind A");

    release_a(stub.local_addr()).await;
    assert_eq!(finish(a, "A").await.status, 200);
    let b = finish(b, "B").await;
    assert_eq!(b.status, 200, "{:?}", b.body);
    assert_eq!(job_id(&b.headers), b_id);
    assert_eq!(upstream_ids(stub.local_addr()).await, ["a", "b"]);

    let lines = gate.log_lines().await;
    assert!(
        lines
            .iter()
            .all(|l| l["displaced_job_id"].is_null() && l["reason"] != "displaced"),
        "nothing is displaced when the window is off"
    );
    assert_eq!(
        line(&lines, "c", "reject").map(|l| &l["reason"]),
        Some(&serde_json::json!("projected_wait_exceeds_slack"))
    );
}

#[test]
fn a_zero_window_is_refused_with_the_field_named() {
    let dir = slackgate_testkit::temp_dir("displace-config");
    let file = dir.join("slackgate.toml");
    let base = config(None).replace("{UPSTREAM}", "http://127.0.0.1:9");
    let with = |window: &str| {
        base.replace(
            "pool = \"p\"",
            &format!("pool = \"p\"\n        displace_within_ms = {window}"),
        )
    };

    std::fs::write(&file, with("0")).unwrap();
    let err = slackgate_gateway::Config::from_file(&file)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("classes[0].displace_within_ms"),
        "field not named in: {err:?}"
    );

    std::fs::write(&file, with("5000")).unwrap();
    let cfg = slackgate_gateway::Config::from_file(&file).unwrap();
    assert_eq!(cfg.gate.classes[0].displace_within_ms, Some(5000));
    // Off unless set.
    std::fs::write(&file, &base).unwrap();
    let cfg = slackgate_gateway::Config::from_file(&file).unwrap();
    assert_eq!(cfg.gate.classes[0].displace_within_ms, None);
    let _ = std::fs::remove_dir_all(&dir);
}
