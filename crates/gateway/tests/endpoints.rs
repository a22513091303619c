//! Several endpoints in one pool, over real sockets: three stub servers of different slot
//! counts and speeds behind one pool. Requests spread over them by projected start, none
//! ever runs on an endpoint beyond its slots, one endpoint killed mid-run is ejected without
//! losing a request it had not started, and it is readmitted when it returns. Operators
//! drain one through the admin API.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use slackgate_gateway::Config;
use slackgate_stub::{LatencySpec, Stub, StubConfig};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A stub with more slots than the gate gives it, so its own peak concurrency shows what
/// the gate sent at once (a stub never runs more than its own slots).
async fn server(addr: &str, decode_us: u64) -> Stub {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let latency: LatencySpec = format!("tokens:prefill_us=0,decode_us={decode_us}")
        .parse()
        .unwrap();
    Stub::spawn(
        listener,
        StubConfig {
            slots: 16,
            latency,
            default_output_tokens: 16,
            seed: 3,
        },
    )
    .unwrap()
}

fn config(a: SocketAddr, b: SocketAddr, c: SocketAddr) -> Config {
    let text = format!(
        r#"
[server]
tick_ms = 20

[admin]

[[pools]]
name = "llm"
endpoints = [
  {{ name = "a", url = "http://{a}", slots = 2 }},
  {{ name = "b", url = "http://{b}", slots = 1 }},
  {{ name = "c", url = "http://{c}", slots = 3 }},
]
[pools.health]
path = "/health"
# No probes of healthy endpoints: only requests that fail eject one (an ejected one is
# probed every second to be readmitted).
interval_ms = 0
eject_after = 2
timeout_ms = 500

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 30000
pool = "llm"
"#
    );
    Config::from_toml(&text).unwrap()
}

/// Send `n` chat requests from `workers` concurrent clients; the statuses, in no order.
async fn load(url: &str, n: usize, workers: usize) -> Vec<u16> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (url, next) = (url.to_string(), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, Ordering::SeqCst) < n as u64 {
                let r = post(&url, &[("x-job-class", "interactive")], &chat(8)).await;
                out.push(r.status.as_u16());
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_share_the_load_eject_a_dead_one_and_readmit_it() {
    // a: fast (2 ms/token), b: slow (10 ms/token), c: medium (5 ms/token).
    let a = server("127.0.0.1:0", 2_000).await;
    let b = server("127.0.0.1:0", 10_000).await;
    let c = server("127.0.0.1:0", 5_000).await;
    let b_addr = b.local_addr();
    let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gate = TestGate::start_with(
        config(a.local_addr(), b_addr, c.local_addr()),
        "endpoints",
        Some((admin_listener, Some(TOKEN.to_string()))),
        None,
    )
    .await;
    let url = gate.url("/v1/chat/completions");

    // 1. Spread: 60 requests from 10 clients, more than the 6 slots.
    let statuses = load(&url, 60, 10).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let (sa, sb, sc) = (a.stats(), b.stats(), c.stats());
    assert_eq!(sa.served + sb.served + sc.served, 60);
    assert!(sa.served > 0 && sb.served > 0 && sc.served > 0);
    // Never beyond an endpoint's slots in the gate's config.
    assert!(
        sa.max_in_flight_seen <= 2,
        "a ran {}",
        sa.max_in_flight_seen
    );
    assert!(
        sb.max_in_flight_seen <= 1,
        "b ran {}",
        sb.max_in_flight_seen
    );
    assert!(
        sc.max_in_flight_seen <= 3,
        "c ran {}",
        sc.max_in_flight_seen
    );
    // The slow single-slot endpoint takes the smallest share.
    assert!(
        sb.served < sa.served && sb.served < sc.served,
        "{sa:?} {sb:?} {sc:?}"
    );
    let m = gate.metrics().await;
    assert_eq!(
        metric(&m, r#"slackgate_endpoint_slots{pool="llm",endpoint="c"}"#),
        Some(3.0)
    );
    assert_eq!(metric(&m, r#"slackgate_slots{pool="llm"}"#), Some(6.0));

    // 2. b dies under load. Clients keep sending; b is ejected after two failed requests,
    // and a request that could not connect to b moves to another endpoint instead of
    // failing: only a request b was already running may fail.
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..6 {
        let (url, stop, failed, sent) = (
            url.clone(),
            Arc::clone(&stop),
            Arc::clone(&failed),
            Arc::clone(&sent),
        );
        clients.push(tokio::spawn(async move {
            // Bounded: at most 400 requests per client, whatever happens.
            for _ in 0..400 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let r = post(&url, &[("x-job-class", "interactive")], &chat(8)).await;
                sent.fetch_add(1, Ordering::SeqCst);
                if r.status != 200 {
                    eprintln!("failed: {} {}", r.status, String::from_utf8_lossy(&r.body));
                    failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    wait_until(Duration::from_secs(10), "b serving under load", || async {
        b.stats().in_flight > 0
    })
    .await;
    b.shutdown().await;
    wait_until(Duration::from_secs(10), "b ejected", || async {
        metric(
            &gate.metrics().await,
            r#"slackgate_endpoint_ejected{pool="llm",endpoint="b"}"#,
        ) == Some(1.0)
    })
    .await;
    assert_eq!(
        metric(&gate.metrics().await, r#"slackgate_slots{pool="llm"}"#),
        Some(5.0)
    );
    // Traffic goes on while b is out: wait for 30 more answers.
    let mark = sent.load(Ordering::SeqCst);
    wait_until(
        Duration::from_secs(20),
        "traffic while b is out",
        || async { sent.load(Ordering::SeqCst) >= mark + 30 },
    )
    .await;

    // 3. b comes back on the same address; a probe readmits it.
    let b2 = server(&b_addr.to_string(), 10_000).await;
    wait_until(Duration::from_secs(10), "b readmitted", || async {
        metric(
            &gate.metrics().await,
            r#"slackgate_endpoint_ejected{pool="llm",endpoint="b"}"#,
        ) == Some(0.0)
    })
    .await;
    wait_until(Duration::from_secs(20), "b serving again", || async {
        b2.stats().served >= 2
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    for t in clients {
        t.await.unwrap();
    }
    // At most what b held when it died failed (one slot; the stale-connection retry may
    // meet the dead server once more for the same request).
    assert!(
        failed.load(Ordering::SeqCst) <= 1,
        "{} of {} failed",
        failed.load(Ordering::SeqCst),
        sent.load(Ordering::SeqCst)
    );
    assert!(b2.stats().max_in_flight_seen <= 1);
    assert!(a.stats().max_in_flight_seen <= 2 && c.stats().max_in_flight_seen <= 3);
    let m = gate.metrics().await;
    let events = |e: &str| {
        metric(
            &m,
            &format!(r#"slackgate_endpoint_events_total{{pool="llm",endpoint="b",event="{e}"}}"#),
        )
    };
    assert_eq!(events("ejected"), Some(1.0));
    assert_eq!(events("readmitted"), Some(1.0));
    // At least the request whose failure ejected b could not connect, and was moved to
    // another endpoint (`rerouted`, counted on the one that took it) or queued again
    // (`requeued`, counted on b).
    let moved = |e: &str, event: &str| {
        metric(
            &m,
            &format!(
                r#"slackgate_endpoint_events_total{{pool="llm",endpoint="{e}",event="{event}"}}"#
            ),
        )
        .unwrap_or(0.0)
    };
    let rerouted = moved("a", "rerouted") + moved("c", "rerouted") + moved("b", "requeued");
    assert!(rerouted >= 1.0, "no request was moved off b:\n{m}");
    // Every endpoint's count of the gate's requests is back to zero.
    for e in ["a", "b", "c"] {
        assert_eq!(
            metric(
                &m,
                &format!(r#"slackgate_endpoint_in_flight{{pool="llm",endpoint="{e}"}}"#)
            ),
            Some(0.0),
            "{e}"
        );
    }
    let lines = gate.log_lines().await;
    let flagged: Vec<&str> = lines
        .iter()
        .filter(|l| l["flag"] == "endpoint" && l["endpoint"] == "b")
        .filter_map(|l| l["reason"].as_str())
        .collect();
    assert_eq!(flagged, vec!["endpoint_ejected", "endpoint_readmitted"]);
    // Dispatch and complete lines name the endpoint each request ran on.
    assert!(lines
        .iter()
        .any(|l| l["action"] == "complete" && l["endpoint"] == "c"));

    // 4. An operator drains a for a restart: nothing new goes there; undrain brings it back.
    let r = admin(&gate, "POST", "/admin/pools/llm/endpoints/a/drain", "").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["changed"], true);
    let before = a.stats().served;
    assert!(load(&url, 12, 4).await.iter().all(|s| *s == 200));
    assert_eq!(a.stats().served, before, "a drained endpoint got work");
    let r = admin(&gate, "POST", "/admin/pools/llm/endpoints/a/undrain", "").await;
    assert_eq!(r.json()["draining"], false);
    assert!(load(&url, 12, 4).await.iter().all(|s| *s == 200));
    assert!(
        a.stats().served > before,
        "an undrained endpoint got no work"
    );
    // Unknown names are a 404, not a panic.
    let r = admin(&gate, "POST", "/admin/pools/llm/endpoints/zz/drain", "").await;
    assert_eq!(r.status, 404);
    let r = admin(&gate, "POST", "/admin/pools/nope/endpoints/a/drain", "").await;
    assert_eq!(r.status, 404);
    let r = admin(&gate, "GET", "/admin/pools/llm/endpoints/a/drain", "").await;
    assert_eq!(r.status, 405);
}

#[tokio::test]
async fn every_endpoint_out_refuses_deadline_work_at_once() {
    let a = server("127.0.0.1:0", 1_000).await;
    let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = a.local_addr();
    let gate = TestGate::start_with(
        config(addr, addr, addr),
        "endpoints-out",
        Some((admin_listener, Some(TOKEN.to_string()))),
        None,
    )
    .await;
    for e in ["a", "b", "c"] {
        let r = admin(
            &gate,
            "POST",
            &format!("/admin/pools/llm/endpoints/{e}/drain"),
            "",
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let r = post(
        &gate.url("/v1/chat/completions"),
        &[("x-job-class", "interactive")],
        &chat(8),
    )
    .await;
    // No capacity at all: 503, not the 429 of contended capacity.
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(
        r.header("x-llm-d-request-dropped-reason").as_deref(),
        Some("upstream_unavailable")
    );
    assert_eq!(a.stats().requests, 0);
}

#[test]
fn a_pool_with_endpoints_takes_no_pool_level_slots() {
    let text = r#"
[[pools]]
name = "default"
slots = 4
endpoints = [{ url = "http://127.0.0.1:1", slots = 2 }]
"#;
    let e = Config::from_toml(text).unwrap_err().to_string();
    assert!(e.contains("pools[0].slots"), "{e}");
    let text = r#"
[[pools]]
name = "default"
upstream = "http://127.0.0.1:1"
endpoints = [{ url = "http://127.0.0.1:2", slots = 2 }]
"#;
    let e = Config::from_toml(text).unwrap_err().to_string();
    assert!(e.contains("either `upstream`"), "{e}");
    let text = r#"
[[pools]]
name = "default"
endpoints = [{ url = "http://127.0.0.1:1", slots = 2 }, { url = "http://127.0.0.1:2", slots = 0 }]
"#;
    let e = Config::from_toml(text).unwrap_err().to_string();
    assert!(e.contains("pools[0].endpoints[1].slots"), "{e}");
    let text = r#"
[[pools]]
name = "default"
endpoints = [{ name = "x", url = "http://127.0.0.1:1", slots = 2 }, { name = "x", url = "http://127.0.0.1:2", slots = 1 }]
"#;
    let e = Config::from_toml(text).unwrap_err().to_string();
    assert!(e.contains("duplicate endpoint name"), "{e}");
    let text = r#"
[[pools]]
name = "default"
endpoints = [{ url = "ftp://127.0.0.1:1", slots = 2 }]
"#;
    let e = Config::from_toml(text).unwrap_err().to_string();
    assert!(e.contains("pools[0].endpoints[0].url"), "{e}");
    // Unnamed endpoints are named by position; the pool's slots are their sum.
    let text = r#"
[[pools]]
name = "default"
endpoints = [{ url = "http://127.0.0.1:1", slots = 2 }, { url = "http://127.0.0.1:2", slots = 5 }]
"#;
    let cfg = Config::from_toml(text).unwrap();
    let p = &cfg.gate.pools[0];
    assert_eq!(p.total_slots(), 7);
    let names: Vec<String> = p.endpoint_list().into_iter().map(|e| e.name).collect();
    assert_eq!(names, vec!["e0", "e1"]);
}
