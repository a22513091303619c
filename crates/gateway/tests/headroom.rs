//! Headroom over real sockets: best-effort batch work leaves a slot free for interactive
//! work, waits for it in the queue (not refused), and its dispatch line says how long the
//! headroom held it; the gauges and `/stats` show the headroom.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn best_effort_work_waits_past_the_headroom_and_interactive_work_finds_its_slot() {
    let stub = stub(2, "tokens:prefill_us=0,decode_us=1000").await;
    // Two slots, one pinned for interactive; batch has no deadline.
    let cfg = two_class_config(2, 5.0, 0.0, 10.0, false, "tick_ms = 10")
        .replace("slots = 2\n", "slots = 2\nheadroom = 1\n");
    let g = TestGate::start(&cfg, stub.local_addr(), "headroom").await;
    let url = g.url("/v1/chat/completions");
    let batch = |key: &'static str, hold: &'static str| {
        vec![
            ("x-job-class", "batch"),
            ("idempotency-key", key),
            ("x-stub-hold", hold),
        ]
    };
    // A takes one slot and stays there.
    let a = spawn_upstream(&url, &stub, &batch("hr-a", "a"), chat(8)).await;
    // B is admitted and queued with a slot free: the headroom keeps it.
    let b = spawn_post(&url, &batch("hr-b", "b"), chat(8));
    wait_until(WAIT, "B queued", || async {
        g.stats().await["gate"]["pools"][0]["depth"] == 1
    })
    .await;
    let stats = g.stats().await;
    let pool = &stats["gate"]["pools"][0];
    assert_eq!(
        (
            &pool["in_flight"],
            &pool["headroom_slots"],
            &pool["headroom_reserved_slots"]
        ),
        (&1.into(), &1.into(), &1.into()),
        "{pool}"
    );
    let m = g.metrics().await;
    assert_eq!(
        metric(&m, r#"slackgate_headroom_slots{pool="default"}"#),
        Some(1.0)
    );
    // Interactive work finds the kept slot at once.
    let c = post(&url, &[("x-job-class", "interactive")], &chat(4)).await;
    assert_eq!(c.status, 200, "{:?}", c.body);
    // When A ends, two slots are free: B starts, and its dispatch line says it was held.
    post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"name":"a"}"#,
    )
    .await;
    assert_eq!(a.await.unwrap().status, 200);
    wait_until(WAIT, "B in a stub slot", || async {
        stub.stats().in_flight == 1
    })
    .await;
    post(
        &format!("http://{}/stub/release", stub.local_addr()),
        &[],
        r#"{"name":"b"}"#,
    )
    .await;
    assert_eq!(b.await.unwrap().status, 200);
    let lines = g.log_lines().await;
    let dispatch = |key: &str| {
        lines
            .iter()
            .find(|l| l["action"] == "dispatch" && l["idempotency_key"] == key)
            .cloned()
            .unwrap()
    };
    assert!(dispatch("hr-a")["headroom_held_ms"].is_null());
    let held = dispatch("hr-b")["headroom_held_ms"].as_u64();
    assert!(held.is_some_and(|ms| ms > 0), "{:?}", dispatch("hr-b"));
}
