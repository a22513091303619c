//! Seed 001's drill over real HTTP, with its declared numbers: one free slot, a 12 s service
//! delay, 30 s of deadline slack, holds that live 20 s, one retry allowed. The reservation API
//! is what the seed's workers call before they call the model themselves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

const SEED001: &str = r#"
    default_class = "interactive"
    [server]
    tick_ms = 50
    [[pools]]
    name = "free"
    slots = 1
    upstream = "{UPSTREAM}"
    [pools.prior]
    overhead_ms = 12000        # each hold blocks the one slot for 12 s (declared, not learned)
    prefill_ms_per_token = 0
    decode_ms_per_token = 0
    learn = false
    [[classes]]
    name = "interactive"
    priority = 100
    deadline_ms = 30000        # thirty seconds of slack
    pool = "free"
    [ledger]
    hold_ttl_ms = 20000        # twenty seconds flat
    retry_cap = 1              # one replay only
"#;

/// Seed figures in seconds, to within the few milliseconds a real clock moves between calls.
fn secs(v: &serde_json::Value) -> f64 {
    (v.as_f64().unwrap_or(f64::NAN) * 10.0).round() / 10.0
}

async fn admit(g: &TestGate, key: &str, attempt: u32) -> Resp {
    post(
        &g.url("/admission/v1/reserve"),
        &[],
        &format!(r#"{{"idempotency_key":"{key}","tokens":800,"attempt":{attempt}}}"#),
    )
    .await
}

// On tokio's paused clock: the gate reads time through `support::clock::Clock`, which follows
// it, so the twenty seconds until job-18's hold expires pass at once (`advance`), and every
// figure is exact (no real time passes between the calls).
#[tokio::test(start_paused = true)]
async fn seed001_reservation_drill() {
    let stub = stub(1, "fixed:10ms").await;
    let g = TestGate::start(SEED001, stub.local_addr(), "seed001").await;
    let t0 = tokio::time::Instant::now();

    // job-17 reserves inside the slack: it would finish in 12 s.
    let r = admit(&g, "job-17", 0).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    let b = r.json();
    assert_eq!(b["action"], "reserve");
    assert_eq!(b["tokens_held"], 800);
    assert_eq!(secs(&b["projected_wait_s"]), 12.0);
    assert_eq!(b["hold_ttl_s"], 20.0);

    // job-18 reserves too (it would finish at 24 s, inside the 30 s slack).
    let r = admit(&g, "job-18", 0).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    assert_eq!(secs(&r.json()["projected_wait_s"]), 24.0);

    // job-17 replayed with attempt 1: a duplicate, and the hold stays at 800 tokens.
    let r = admit(&g, "job-17", 1).await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    let b = r.json();
    assert_eq!(b["action"], "reject_duplicate");
    assert_eq!(b["state"], "held");
    assert_eq!(b["tokens_held"], 800);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));

    // job-19 finds two holds waiting: 36 s projected against 30 s of slack.
    let r = admit(&g, "job-19", 0).await;
    assert_eq!(r.status, 429, "{:?}", r.body);
    let b = r.json();
    assert_eq!(b["action"], "reject_unreserved");
    assert_eq!(secs(&b["projected_wait_s"]), 36.0);
    assert_eq!(b["slack_s"], 30.0);
    assert_eq!(b["held"], 2);
    assert_eq!(b["reason"], "projected_wait_exceeds_slack");
    assert!(r.header("retry-after").is_some());

    // Over the retry cap.
    let r = admit(&g, "job-20", 2).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["action"], "reject_retry_cap");

    let s = get(&g.url("/admission/v1/stats")).await.json();
    assert_eq!(
        (s["held"].as_u64(), s["tokens_held"].as_u64()),
        (Some(2), Some(1600))
    );
    assert!(s["amplification"].is_null(), "nothing spent yet: {s}");

    // job-17's worker commits: tokens spent, amplification about one.
    let r = post(
        &g.url("/admission/v1/commit"),
        &[],
        r#"{"idempotency_key":"job-17"}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let b = r.json();
    assert_eq!(
        (b["action"].as_str(), b["tokens_spent"].as_u64()),
        (Some("commit"), Some(800))
    );
    assert_eq!(b["held_remaining"], 1);
    let s = get(&g.url("/admission/v1/stats")).await.json();
    assert_eq!(s["amplification"], 1.0, "{s}");

    // A commit for a key never reserved, and a replay of a done key.
    let r = post(
        &g.url("/admission/v1/commit"),
        &[],
        r#"{"idempotency_key":"job-99"}"#,
    )
    .await;
    assert_eq!(
        (r.status.as_u16(), r.json()["action"].as_str()),
        (404, Some("missing_hold"))
    );
    let r = admit(&g, "job-17", 1).await;
    assert_eq!(
        (r.status.as_u16(), r.json()["state"].as_str()),
        (409, Some("done"))
    );

    // job-18's worker never commits. Twenty seconds after it reserved, its hold expires: the
    // slot is released and its tokens count as wasted.
    let wait = Duration::from_millis(20_300).saturating_sub(t0.elapsed());
    tokio::time::advance(wait).await;
    let r = post(&g.url("/admission/v1/expire"), &[], "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["action"], "expire");
    let s = get(&g.url("/admission/v1/stats")).await.json();
    assert_eq!(s["held"], 0, "{s}");
    assert_eq!(s["expired"], 1, "{s}");
    assert_eq!(s["tokens_wasted"], 800, "{s}");
    assert_eq!(
        s["amplification"], 2.0,
        "(spent 800 + wasted 800) / 800: {s}"
    );
    let r = post(
        &g.url("/admission/v1/commit"),
        &[],
        r#"{"idempotency_key":"job-18"}"#,
    )
    .await;
    assert_eq!(
        (r.status.as_u16(), r.json()["action"].as_str()),
        (409, Some("hold_expired"))
    );
    // The slot is free again: a new reservation would finish in 12 s.
    let r = admit(&g, "job-21", 0).await;
    assert_eq!(secs(&r.json()["projected_wait_s"]), 12.0, "{:?}", r.body);

    // The decision log tells the same story with the stable field names.
    let lines = g.log_lines().await;
    let of = |key: &str| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l["idempotency_key"] == key)
            .map(|l| {
                format!(
                    "{}/{}",
                    l["action"].as_str().unwrap(),
                    l["reason"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(of("job-19"), vec!["reject/projected_wait_exceeds_slack"]);
    assert!(
        of("job-17").contains(&"reject/reject_duplicate".to_string()),
        "{:?}",
        of("job-17")
    );
    assert!(
        of("job-18").iter().any(|a| a.ends_with("hold_expired")),
        "{:?}",
        of("job-18")
    );
    drop(stub);
}

#[tokio::test]
async fn reservation_api_refuses_bad_input_and_changes_nothing() {
    let stub = stub(1, "fixed:10ms").await;
    let g = TestGate::start(SEED001, stub.local_addr(), "seed001-bad").await;
    assert_eq!(admit(&g, "ok", 0).await.status, 202);
    let before = get(&g.url("/admission/v1/stats")).await.json();
    let long_key = "k".repeat(300);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "/admission/v1/reserve",
            "{not json".into(),
            400,
            "invalid_json",
        ),
        (
            "/admission/v1/reserve",
            r#"{"tokens":-5}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/reserve",
            r#"{"tokens":1e30}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/reserve",
            r#"{"tokens":2000000000000}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/reserve",
            format!(r#"{{"idempotency_key":"{long_key}","tokens":1}}"#),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/reserve",
            r#"{"idempotency_key":"","tokens":1}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/reserve",
            r#"{"tokens":1,"surprise":true}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/commit",
            r#"{"idempotency_key":"ok","tokens_spent":-1}"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/commit",
            r#"[]"#.into(),
            400,
            "invalid_request",
        ),
        (
            "/admission/v1/cancel",
            r#"{}"#.into(),
            400,
            "invalid_request",
        ),
    ];
    for (path, body, status, code) in cases {
        let r = post(&g.url(path), &[], &body).await;
        assert_eq!(r.status.as_u16(), status, "{path} {body}: {:?}", r.body);
        assert_eq!(r.json()["error"]["code"], code, "{path} {body}");
    }
    let mut after = get(&g.url("/admission/v1/stats")).await.json();
    let mut before = before;
    // The projected wait shrinks as the clock runs; everything the ledger holds must not move.
    for v in [&mut before, &mut after] {
        if let Some(o) = v.as_object_mut() {
            o.remove("projected_wait_ms");
            o.remove("projected_wait_s");
        }
    }
    assert_eq!(before, after, "bad input changed the ledger");
    drop(stub);
}
