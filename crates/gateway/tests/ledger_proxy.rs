//! The ledger on the proxy path: a live request's hold outlives its TTL (renewed, never
//! expired under a call still running upstream), and the reservation API cannot settle a
//! proxied request's hold.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

const CONFIG: &str = r#"
    default_class = "interactive"
    [[pools]]
    name = "default"
    slots = 1
    upstream = "{UPSTREAM}"
    [pools.prior]
    overhead_ms = 2500
    learn = false
    [[classes]]
    name = "interactive"
    priority = 100
    [ledger]
    hold_ttl_ms = 1000
    retry_cap = 3
"#;

// On tokio's paused clock: the gate reads its time through `support::clock`, which follows
// it, so the TTL passes at once while the held call stays upstream.
#[tokio::test(start_paused = true)]
async fn a_running_request_keeps_its_hold_past_the_ttl_and_its_key_stays_taken() {
    // The stub keeps the first call running until the test releases it.
    let s = stub(4, "fixed:10ms").await;
    let g = TestGate::start(CONFIG, s.local_addr(), "ledger-proxy").await;
    let url = g.url("/v1/chat/completions");
    let first = spawn_upstream(
        &url,
        &s,
        &[("idempotency-key", "K1"), ("x-stub-hold", "first")],
        chat(4),
    )
    .await;
    // Its hold was taken before it went upstream: half a TTL more and the TTL has passed
    // (the time is the test). A sleep on the paused clock passes at once, firing the gate's
    // timers (its ticks) in order on the way, as real time would.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Past the 1 s TTL, the first call is still running upstream: a replay is a duplicate,
    // not a second call.
    let r = post(
        &url,
        &[("idempotency-key", "K1"), ("x-attempt", "1")],
        &chat(4),
    )
    .await;
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.json()["admission"]["ledger"]["state"], "held");

    // The reservation API may not settle (or free the slot of) a proxied request.
    let r = post(
        &g.url("/admission/v1/commit"),
        &[],
        r#"{"idempotency_key":"K1","tokens_spent":0}"#,
    )
    .await;
    assert_eq!(
        (r.status.as_u16(), r.json()["action"].as_str()),
        (409, Some("not_a_reservation"))
    );

    post(
        &format!("http://{}/stub/release", s.local_addr()),
        &[],
        r#"{"name":"first"}"#,
    )
    .await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 200);
    let stats = s.stats();
    assert_eq!(
        (stats.requests, stats.max_in_flight_seen),
        (1, 1),
        "{stats:?}"
    );
    // Settled on its own response, with the upstream's count.
    let l = g.stats().await["ledger"].clone();
    assert_eq!(
        (
            l["held"].as_u64(),
            l["done"].as_u64(),
            l["expired"].as_u64()
        ),
        (Some(0), Some(1), Some(0)),
        "{l}"
    );
    assert!(l["tokens_spent"].as_u64().unwrap() > 0);
    // And it stays a duplicate once done.
    let r = post(
        &url,
        &[("idempotency-key", "K1"), ("x-attempt", "2")],
        &chat(4),
    )
    .await;
    assert_eq!(
        (
            r.status.as_u16(),
            r.json()["admission"]["ledger"]["state"].as_str()
        ),
        (409, Some("done"))
    );
    drop(s);
}

#[tokio::test]
async fn reserved_key_prefix_and_over_long_keys_are_refused() {
    let s = stub(1, "fixed:10ms").await;
    let g = TestGate::start(CONFIG, s.local_addr(), "ledger-proxy-keys").await;
    let url = g.url("/v1/chat/completions");
    let r = post(&url, &[("idempotency-key", "gen-1a2b-7")], &chat(4)).await;
    assert_eq!(
        (r.status.as_u16(), r.json()["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    let long = "x".repeat(300);
    let r = post(&url, &[("idempotency-key", &long)], &chat(4)).await;
    assert_eq!(
        (r.status.as_u16(), r.json()["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );
    assert_eq!(
        s.stats().requests,
        0,
        "refused requests never reach the upstream"
    );
}
