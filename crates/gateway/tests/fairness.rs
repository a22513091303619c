//! Fair share between tenants (`[fairness]`) over real sockets: a tenant named in the
//! configured fairness header that floods its class is refused early with
//! `tenant_share_exceeded` (429, its share in the body and the log, an honest Retry-After)
//! while another tenant's request still gets in; the per-tenant gauges are on the metrics
//! page; a malformed fairness header is refused with a reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

const HEADER: &str = "x-llm-d-inference-fairness-id";
const PATIENCE: Duration = Duration::from_secs(30);

fn headers(tenant: &str, key: &str, tokens: &str) -> Vec<(&'static str, String)> {
    vec![
        ("x-job-class", "interactive".into()),
        (HEADER, tenant.into()),
        ("idempotency-key", key.into()),
        ("x-stub-request-id", key.into()),
        ("x-expected-output-tokens", tokens.into()),
        ("x-stub-output-tokens", "5".into()),
    ]
}

fn send(url: &str, h: &[(&'static str, String)]) -> tokio::task::JoinHandle<Resp> {
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    spawn_post(url, &h, chat(2000))
}

fn admitted(lines: &[serde_json::Value], key: &str) -> bool {
    lines
        .iter()
        .any(|l| l["idempotency_key"] == key && l["action"] == "admit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_is_refused_on_its_share_and_another_still_gets_in() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=1000").await;
    let gate = TestGate::start(FAIR_TWO_TENANTS, stub.local_addr(), "fairness").await;
    let url = gate.url("/v1/chat/completions");
    // b holds the slot (1 s estimated): b is active, and its share is kept for it.
    let mut hb = headers("b", "b1", "100");
    hb.push(("x-stub-hold", "b1".into()));
    let _b1 = send(&url, &hb);
    let held = eventually(PATIENCE, || async { stub.stats().in_flight == 1 }).await;
    assert!(held, "b1 holds the slot");
    // a queues two 5 s requests: its share is half of one slot, so 5 s queued is 10 s at
    // its share, within its 15 s of slack; 10 s queued (20 s) is not.
    let _a1 = send(&url, &headers("a", "a1", "500"));
    wait_until(PATIENCE, "a1 admitted", || async {
        admitted(&gate.log_lines().await, "a1")
    })
    .await;
    let _a2 = send(&url, &headers("a", "a2", "500"));
    wait_until(PATIENCE, "a2 admitted", || async {
        admitted(&gate.log_lines().await, "a2")
    })
    .await;
    let h = headers("a", "a3", "500");
    let hv: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let a3 = post(&url, &hv, &chat(2000)).await;
    assert_eq!(a3.status, 429, "{:?}", a3.body);
    let body = a3.json();
    assert_eq!(
        body["admission"]["reason"], "tenant_share_exceeded",
        "{body}"
    );
    assert_eq!(body["admission"]["tenant_share"], 0.5, "{body}");
    // Retry-After: when a's backlog, drained at its share, fits (10 s at 0.5 = 20 s against
    // about 15 s of slack: some 5 s).
    let after = body["admission"]["retry_after_ms"].as_u64().unwrap();
    assert!((4_000..=8_000).contains(&after), "{body}");
    assert_eq!(a3.header("x-should-retry").as_deref(), Some("true"));
    // b's next request still fits: 1 s + 10 s of a's work ahead, within its 19 s of slack.
    let hb2 = headers("b", "b2", "100");
    let _b2 = send(&url, &hb2);
    wait_until(PATIENCE, "b2 admitted", || async {
        admitted(&gate.log_lines().await, "b2")
    })
    .await;
    let lines = gate.log_lines().await;
    let refused = lines
        .iter()
        .find(|l| l["idempotency_key"] == "a3" && l["action"] == "reject")
        .unwrap();
    assert_eq!(refused["reason"], "tenant_share_exceeded");
    assert_eq!(refused["tenant_share"], 0.5);
    // The metrics page shows the tenants, bounded (two tracked here).
    let page = gate.metrics().await;
    assert_eq!(
        metric(
            &page,
            r#"slackgate_tenants_tracked{class="interactive",pool="p"}"#
        ),
        Some(2.0),
        "{page}"
    );
    assert_eq!(
        metric(
            &page,
            r#"slackgate_tenant_share{class="interactive",pool="p",tenant="a"}"#
        ),
        Some(0.5),
        "{page}"
    );
    // b's request holds the slot; a's are queued.
    assert_eq!(
        metric(
            &page,
            r#"slackgate_tenant_running{class="interactive",pool="p",tenant="b"}"#
        ),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        metric(
            &page,
            r#"slackgate_tenant_running{class="interactive",pool="p",tenant="a"}"#
        ),
        Some(0.0),
        "{page}"
    );
    // A fairness id over the limit is refused with a reason, never cut into another id.
    let long = "x".repeat(300);
    let bad = post(
        &url,
        &[("x-job-class", "interactive"), (HEADER, long.as_str())],
        &chat(10),
    )
    .await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    assert_eq!(
        bad.json()["error"]["code"],
        "invalid_request",
        "{:?}",
        bad.body
    );
    let _ = post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"name":"b1"}"#,
    )
    .await;
}

#[test]
fn a_fairness_header_the_gate_reads_for_something_else_is_refused() {
    for (name, ok) in [
        ("x-llm-d-inference-fairness-id", true),
        ("x-team", true),
        ("authorization", false),
        ("x-tenant", false),
        ("x-slackgate-replica", false),
        ("X-Upper", false),
        ("", false),
        ("bad header", false),
    ] {
        let text = format!("[server]\nfairness_header = {name:?}\n");
        let r = slackgate_gateway::Config::from_toml(&text);
        assert_eq!(r.is_ok(), ok, "{name:?}: {:?}", r.err());
    }
    let r = slackgate_gateway::Config::from_toml("[fairness.weights]\na = -1\n");
    assert!(
        r.err()
            .is_some_and(|e| e.to_string().contains("fairness.weights")),
        "a negative weight is refused at its path"
    );
}

/// With `unlisted = "own"` every id gets a bucket; the metrics page shows the 10 with the
/// most work queued per class and sums the rest into one row per class, however many ids
/// arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_show_ten_tenants_and_sum_the_rest() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=1000").await;
    let config = FAIR_TWO_TENANTS.replace(
        "[fairness.weights]",
        "[fairness]\nunlisted = \"own\"\n[fairness.weights]",
    );
    let gate = TestGate::start(&config, stub.local_addr(), "fairness-rest").await;
    let url = gate.url("/v1/chat/completions");
    let mut hold = headers("b", "hold", "10");
    hold.push(("x-stub-hold", "hold".into()));
    let _hold = send(&url, &hold);
    let held = eventually(PATIENCE, || async { stub.stats().in_flight == 1 }).await;
    assert!(held, "the slot is held");
    // Twelve more tenants queue one request each, t0 the smallest and t11 the largest.
    let mut sent = Vec::new();
    for i in 0..12 {
        let key = format!("t{i}");
        sent.push(send(&url, &headers(&key, &key, &(10 + i).to_string())));
    }
    wait_until(PATIENCE, "all twelve admitted", || async {
        let lines = gate.log_lines().await;
        (0..12).all(|i| admitted(&lines, &format!("t{i}")))
    })
    .await;
    let page = gate.metrics().await;
    let shown = page
        .lines()
        .filter(|l| l.starts_with("slackgate_tenant_share{"))
        .count();
    assert_eq!(shown, 10, "{page}");
    assert_eq!(
        metric(
            &page,
            r#"slackgate_tenants_tracked{class="interactive",pool="p"}"#
        ),
        Some(13.0),
        "{page}"
    );
    // The three not shown (b, whose request runs, and the two smallest backlogs) summed:
    // 10 and 11 tokens at 10 ms, and none for b.
    let rest = metric(
        &page,
        r#"slackgate_tenant_rest_queued_work_seconds{class="interactive",pool="p"}"#,
    );
    assert!(
        rest.is_some_and(|s| (s - 0.21).abs() < 1e-6),
        "{rest:?}\n{page}"
    );
    let rest_share = metric(
        &page,
        r#"slackgate_tenant_rest_share{class="interactive",pool="p"}"#,
    );
    assert!(
        rest_share.is_some_and(|s| (s - 3.0 / 13.0).abs() < 1e-6),
        "{rest_share:?}"
    );
    assert!(
        page.contains(r#"tenant="t11""#) && !page.contains(r#"tenant="t0""#),
        "{page}"
    );
    let _ = post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"name":"hold"}"#,
    )
    .await;
}

/// The reservation API counts a worker's reservation under the configured fairness header
/// when it sends one (as a proxied request), under its `tenant` otherwise; a malformed header
/// is refused with a reason before anything is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_counts_under_the_fairness_header() {
    let stub = stub(1, "tokens:prefill_us=0,decode_us=1000").await;
    let gate = TestGate::start(FAIR_TWO_TENANTS, stub.local_addr(), "fairness-reserve").await;
    let url = gate.url("/admission/v1/reserve");
    let body = |key: &str| {
        serde_json::json!({"idempotency_key": key, "tokens": 10, "class": "interactive",
            "tenant": "worker-pool", "slack_ms": 20000})
        .to_string()
    };
    let r = post(&url, &[(HEADER, "a")], &body("r1")).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    let r = post(&url, &[], &body("r2")).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    let stats = gate.stats().await;
    let tenants: Vec<String> = stats["gate"]["classes"][0]["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tenant"].as_str().unwrap().to_string())
        .collect();
    // r1 under `a`; r2 (no header) under its tenant id, unlisted: the shared `other`.
    assert!(tenants.contains(&"a".to_string()), "{stats}");
    assert!(tenants.contains(&"other".to_string()), "{stats}");
    let long = "x".repeat(300);
    let bad = post(&url, &[(HEADER, long.as_str())], &body("r3")).await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    // Nothing was queued for it (a path that reads nothing would compare null with null).
    let depth = |s: &serde_json::Value| s["gate"]["classes"][0]["depth"].as_u64();
    assert!(depth(&stats).is_some(), "{stats}");
    assert_eq!(depth(&gate.stats().await), depth(&stats));
}
