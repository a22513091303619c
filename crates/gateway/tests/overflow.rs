//! Overflow and dedicated pools over real sockets: two stub upstreams (a free pool with one
//! slot, a paid one), a class that routes to the paid pool when its own cannot take it in
//! time, one that is only told where to go (`retry_hint`), and Retry-After jitter across a
//! crowd of rejected clients.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

/// `free`: one slot. `paid`: two. `sync` routes to `paid`, `chat` is hinted to it, `eval`
/// runs on `free` only. Rejections come back after 5 to 7.5 s (50 % jitter).
fn config(free: SocketAddr, paid: SocketAddr) -> String {
    format!(
        r#"
[server]
tick_ms = 10
[retry]
min_retry_after_ms = 5000
jitter_percent = 50
[[pools]]
name = "free"
slots = 1
upstream = "http://{free}"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
learn = false
[[pools]]
name = "paid"
slots = 2
upstream = "http://{paid}"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
learn = false
[[classes]]
name = "sync"
priority = 100
deadline_ms = 4000
max_queue_age_ms = 300
pool = "free"
overflow_pool = "paid"
overflow = "route"
[[classes]]
name = "chat"
priority = 100
deadline_ms = 4000
max_queue_age_ms = 300
pool = "free"
overflow_pool = "paid"
[[classes]]
name = "eval"
priority = 10
pool = "free"
"#
    )
}

/// Start both stubs and the gate, and park an eval in the free pool's only slot for longer
/// than the classes' 300 ms queue-age cap.
async fn stuck_free_pool(
    name: &str,
) -> (
    slackgate_stub::Stub,
    slackgate_stub::Stub,
    TestGate,
    tokio::task::JoinHandle<Resp>,
) {
    let free = stub(1, "tokens:prefill_us=0,decode_us=10000").await;
    let paid = stub(2, "tokens:prefill_us=0,decode_us=10000").await;
    let gate = TestGate::start_cfg(
        slackgate_gateway::Config::from_toml(&config(free.local_addr(), paid.local_addr()))
            .unwrap(),
        name,
    )
    .await;
    let url = gate.url("/v1/chat/completions");
    let stuck = spawn_post(
        &url,
        &[("x-job-class", "eval"), ("x-stub-hold", "night")],
        chat(8),
    );
    let busy = eventually(Duration::from_secs(3), || async {
        gate.stats().await["gate"]["pools"][0]["oldest_in_flight_age_ms"]
            .as_u64()
            .is_some_and(|a| a > 400)
    })
    .await;
    assert!(busy, "the eval holds the free slot");
    (free, paid, gate, stuck)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_route_serves_on_the_paid_pool() {
    let (free, paid, gate, stuck) = stuck_free_pool("overflow-route").await;
    let url = gate.url("/v1/chat/completions");
    let r = post(&url, &[("x-job-class", "sync")], &chat(8)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        r.header("x-slackgate-reason").as_deref(),
        Some("overflow_routed")
    );
    assert_eq!(r.header("x-slackgate-pool").as_deref(), Some("paid"));
    assert!(
        r.elapsed < Duration::from_secs(2),
        "served at once, not after the eval"
    );
    assert_eq!(paid.stats().requests, 1, "the paid upstream served it");
    assert_eq!(
        free.stats().requests,
        1,
        "only the eval reached the free upstream"
    );

    let lines = gate.log_lines().await;
    let admit = lines
        .iter()
        .find(|l| l["class"] == "sync" && l["action"] == "admit")
        .unwrap();
    assert_eq!(admit["reason"], "overflow_routed");
    assert_eq!(admit["pool"], "paid");
    let id = &admit["job_id"];
    let done = lines
        .iter()
        .find(|l| &l["job_id"] == id && l["action"] == "complete")
        .unwrap();
    assert_eq!(
        (done["pool"].as_str(), done["status"].as_u64()),
        (Some("paid"), Some(200))
    );
    // The class has a row on the paid pool in the queue gauges, and routed decisions count.
    let m = gate.metrics().await;
    assert!(metric(&m, "slackgate_queue_depth{class=\"sync\",pool=\"paid\"}").is_some());
    assert_eq!(
        metric(
            &m,
            "slackgate_decisions_total{class=\"sync\",action=\"admit\",reason=\"overflow_routed\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "slackgate_class_enabled{class=\"sync\"}"),
        Some(1.0),
        "one switch per class, not per pool"
    );

    post(
        &format!("http://{}/stub/release", free.local_addr()),
        &[],
        r#"{"all":true}"#,
    )
    .await;
    assert_eq!(stuck.await.unwrap().status, 200);
    // With the free pool idle again, sync runs on its own pool.
    let r = post(&url, &[("x-job-class", "sync")], &chat(8)).await;
    assert_eq!(r.header("x-slackgate-pool").as_deref(), Some("free"));
    assert_eq!(
        r.header("x-slackgate-reason").as_deref(),
        Some("within_slack")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_hint_names_the_paid_pool_and_retry_afters_are_spread() {
    let (free, paid, gate, stuck) = stuck_free_pool("overflow-hint").await;
    let url = gate.url("/v1/chat/completions");
    // Twenty clients rejected at (nearly) the same moment.
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            post(&url, &[("x-job-class", "chat")], &chat(8)).await
        }));
    }
    let mut secs = BTreeSet::new();
    let mut ms = BTreeSet::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 429, "{:?}", r.body);
        let b = r.json();
        assert_eq!(b["error"]["code"], "queue_age_exceeded");
        assert_eq!(b["admission"]["retry_hint"], "paid");
        let after_ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
        assert!((5_000..=7_500).contains(&after_ms), "{after_ms}");
        ms.insert(after_ms);
        secs.insert(r.header("retry-after").unwrap());
    }
    assert!(ms.len() >= 15, "retry-after-ms should be spread: {ms:?}");
    assert!(
        secs.len() >= 2,
        "Retry-After seconds should differ: {secs:?}"
    );
    assert_eq!(paid.stats().requests, 0, "hint mode never routes");
    post(
        &format!("http://{}/stub/release", free.local_addr()),
        &[],
        r#"{"all":true}"#,
    )
    .await;
    assert_eq!(stuck.await.unwrap().status, 200);
}
